"""The native layer alone: two processes exchange worker addresses and rkeys over a pipe, then get/put."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from kvflow import (
    CacheDesc,
    DataType,
    LLMException,
    LLMFailed,
    LLMLinkFailed,
    LLMOutOfMemory,
    LLMParamInvalid,
)
from kvflow._plan import plan_blocks
from ucx_testlib import TLS_PARAMS, NativePeer, requires_ucx

from kvflow_ucx import _lowlevel as ll
from kvflow_ucx._transport import _ucx_config

pytestmark = requires_ucx


def test_versions_and_status_mapping() -> None:
    ll.load()
    v = ll.versions()
    assert v["library"].startswith(v["headers"].split(".")[0] + ".")
    assert ll.status_name(-25) == "UCS_ERR_CONNECTION_RESET"
    err = ll.ucx_error(-25, "ucp_get_nbx")
    assert isinstance(err, LLMLinkFailed)
    assert "ucp_get_nbx" in str(err) and "UCS_ERR_CONNECTION_RESET" in str(err)
    assert isinstance(ll.ucx_error(-80, "x"), LLMLinkFailed)  # UCS_ERR_ENDPOINT_TIMEOUT
    assert "UCS_ERR_ENDPOINT_TIMEOUT" in str(ll.ucx_error(-80, "x"))
    assert isinstance(ll.ucx_error(-45, "x"), LLMLinkFailed)  # a link-failure range code
    assert isinstance(ll.ucx_error(-4, "x"), LLMOutOfMemory)
    assert isinstance(ll.ucx_error(-5, "x"), LLMParamInvalid)
    assert type(ll.ucx_error(-99, "x")) is LLMFailed


@settings(max_examples=300, deadline=None)
@given(ntensors=hs.integers(1, 8), stride=hs.sampled_from([1, 8, 4096, 12288]), lblocks=hs.integers(1, 40),
       rblocks=hs.integers(1, 40), lblock=hs.integers(0, 39), rblock=hs.integers(0, 39), write=hs.booleans())
def test_one_block_table_in_c_is_kvflows_plan(ntensors: int, stride: int, lblocks: int, rblocks: int,
                                              lblock: int, rblock: int, write: bool) -> None:
    """``kvf_block1_table`` (the plan of ``blocks_now``'s one-block transfers) holds the same runs,
    in the same order, as ``kvflow._plan.plan_blocks`` for the same request."""
    lblock, rblock = lblock % lblocks, rblock % rblocks  # blocks_now checks the indices before C plans

    def layout(num_blocks: int, base: int) -> tuple[CacheDesc, np.ndarray]:
        desc = CacheDesc(num_tensors=ntensors, data_type=DataType.DT_UINT8, shape=[num_blocks, stride])
        addrs = [base + t * (num_blocks * stride + 4096) for t in range(ntensors)]
        return desc, np.array(addrs, dtype=np.uint64)

    (ld, la), (rd, ra) = layout(lblocks, 1 << 40), layout(rblocks, 1 << 44)
    if write:
        want = plan_blocks(ld, la, rd, ra, [lblock], [rblock], None, local_is_src=True).table
    else:
        want = plan_blocks(rd, ra, ld, la, [rblock], [lblock], None, local_is_src=False).table
    assert np.array_equal(ll.block1_table(la, ra, stride, lblock, rblock), want)


def test_bad_ucx_setting_is_a_typed_error() -> None:
    lib = tuple(int(x) for x in ll.versions()["library"].split(".")[:2])
    if lib >= (1, 20):  # older UCX (Debian's 1.13) only warns about an unknown variable
        with pytest.raises(LLMParamInvalid, match="UCS_ERR_INVALID_PARAM"):
            ll.Worker({"NO_SUCH_UCX_VARIABLE": "1"})
    with pytest.raises(LLMException, match="UCS_ERR_"):
        ll.Worker({"TLS": "no_such_transport"})


def test_check_runs() -> None:
    lb = ll.bounds([1000, 5000], [100, 100])
    rb = ll.bounds([1 << 40], [4096])

    def check(la: list[int], ra: list[int], n: list[int], li: list[int], ri: list[int]) -> int:
        return ll.check_runs(np.array(la, np.uint64), np.array(ra, np.uint64), np.array(n, np.uint64),
                             np.array(li, np.int64), lb, np.array(ri, np.int64), rb)

    r0 = 1 << 40
    assert check([1000, 5050], [r0, r0 + 4000], [100, 50], [0, 1], [0, 0]) == -1
    assert check([1000, 5050], [r0, r0 + 4000], [100, 51], [0, 1], [0, 0]) == 2  # local end of run 1
    assert check([1000, 5000], [r0, r0 + 4001], [100, 96], [0, 1], [0, 0]) == 3  # remote end of run 1
    assert check([999], [r0], [1], [0], [0]) == 0  # before the region
    assert check([1000], [r0], [0], [0], [0]) == 0  # empty run
    assert check([1000], [r0], [1], [2], [0]) == 0  # no such local tensor
    assert check([1000], [r0], [1], [0], [-1]) == 1  # no such remote tensor
    assert check([1000], [r0 - 1], [1], [0], [0]) == 1
    assert check([1000], [r0], [1 << 63], [0], [0]) == 0  # no wrap-around


def _drive(w: ll.Worker, op: ll.Op, flush_ep: ll.Endpoint | None = None, limit: int = 2_000_000) -> int:
    if flush_ep is not None:
        flush_ep.flush(op)
    status = op.finish()
    rounds = 0
    while status is None:
        w.progress()
        for ev_id, kind, st in w.events():
            if kind == ll.EV_OP and ev_id == op.id:
                status = st
        rounds += 1
        assert rounds < limit, "operation did not complete"
    return status


@pytest.mark.parametrize("tls", TLS_PARAMS)
def test_two_processes_get_and_put(tls: str) -> None:
    config = _ucx_config({"kvflow.ucx.TLS": tls})[0]
    nbytes, block = 1 << 20, 4096
    peer = NativePeer(nbytes, seed=11, config=config)
    try:
        w = ll.Worker(config)
        peer.send(w.address)
        ep = w.connect(peer.info["address"])
        rkey = ep.rkey_unpack(peer.info["rkey"])
        local = np.zeros(nbytes, dtype=np.uint8)
        m = w.mem_map(int(local.ctypes.data), nbytes)
        n = nbytes // block
        rng = np.random.default_rng(5)
        lo, ro = rng.permutation(n), rng.permutation(n)
        la = np.uint64(local.ctypes.data) + lo.astype(np.uint64) * np.uint64(block)
        ra = np.uint64(peer.info["addr"]) + ro.astype(np.uint64) * np.uint64(block)
        lens = np.full(n, block, dtype=np.uint64)
        idx = np.zeros(n, dtype=np.int64)
        memh, rkeys = w.memh_table([m]), w.rkey_table([rkey])

        op = w.new_op()
        assert ep.rma(op, False, la, ra, lens, idx, memh, idx, rkeys, 1 << 62) == n
        assert _drive(w, op) == ll.UCS_OK
        peer.send("bytes")
        remote = np.frombuffer(peer.recv(), dtype=np.uint8)
        assert np.array_equal(local.reshape(n, block)[lo], remote.reshape(n, block)[ro])
        lanes = ep.info()
        want = ("tcp/",) if tls == "tcp" else ("cma/", "sysv/", "posix/")
        assert any(w in lanes for w in want), lanes

        local[:] = np.random.default_rng(6).integers(0, 256, nbytes, dtype=np.uint8)
        op = w.new_op()
        issued = 0
        while issued < n:  # in chunks, as the transport issues large batches
            issued += ep.rma(op, True, la[issued:], ra[issued:], lens[issued:], idx[issued:], memh,
                             idx[issued:], rkeys, 64 * block)
        assert _drive(w, op) == ll.UCS_OK  # each chunk of puts ends with a flush
        peer.send("bytes")
        remote = np.frombuffer(peer.recv(), dtype=np.uint8)
        assert np.array_equal(local.reshape(n, block)[lo], remote.reshape(n, block)[ro])

        close = w.new_op()
        ep.close(close, force=False)
        assert _drive(w, close) in (ll.UCS_OK, -25, -80)
        w.rkey_destroy(rkey)
        w.mem_unmap(m)
        w.destroy()
    finally:
        peer.stop()


def test_a_dead_peer_fails_the_operation() -> None:
    """The peer process dies: a get to it completes with a link error, and the endpoint reports it."""
    config = _ucx_config({"kvflow.ucx.TLS": "tcp"})[0]
    peer = NativePeer(1 << 16, seed=1, config=config)
    try:
        w = ll.Worker(config)
        peer.send(w.address)
        ep = w.connect(peer.info["address"])
        rkey = ep.rkey_unpack(peer.info["rkey"])
        local = np.zeros(1 << 16, dtype=np.uint8)
        m = w.mem_map(int(local.ctypes.data), local.nbytes)
        one = np.zeros(1, dtype=np.int64)
        args = (np.array([local.ctypes.data], np.uint64), np.array([peer.info["addr"]], np.uint64),
                np.array([4096], np.uint64), one, w.memh_table([m]), one, w.rkey_table([rkey]), 1 << 62)
        op = w.new_op()
        ep.rma(op, False, *args)
        assert _drive(w, op) == ll.UCS_OK
        peer.proc.kill()
        peer.proc.join(10)
        op = w.new_op()
        ep.rma(op, False, *args)
        status = _drive(w, op, limit=50_000_000)
        assert status < 0
        assert isinstance(ll.ucx_error(status, "get"), LLMLinkFailed)
        close = w.new_op()
        ep.close(close, force=True)
        _drive(w, close)
        w.rkey_destroy(rkey)
        w.mem_unmap(m)
        w.destroy()
    finally:
        peer.stop()


def test_sibling_worker_shares_the_context() -> None:
    """A sibling worker (the transport's target) serves memory mapped through its parent: a get from
    the parent's endpoint to the sibling reads it with the parent's rkey. Destroying the parent
    destroys the sibling first."""
    config = _ucx_config({"kvflow.ucx.TLS": "tcp"})[0]
    w = ll.Worker(config)
    target = w.sibling()
    assert target.address != w.address and target.efd != w.efd
    src = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms, md = w.mem_map(int(src.ctypes.data), src.nbytes), w.mem_map(int(dst.ctypes.data), dst.nbytes)
    ep = w.connect(target.address)
    rkey = ep.rkey_unpack(ms.rkey)
    one = np.zeros(1, dtype=np.int64)
    op = w.new_op()
    ep.rma(op, False, np.array([dst.ctypes.data], np.uint64), np.array([src.ctypes.data], np.uint64),
           np.array([src.nbytes], np.uint64), one, w.memh_table([md]), one, w.rkey_table([rkey]), 1 << 62)
    status = op.finish()
    for _ in range(2_000_000):
        if status is not None:
            break
        target.progress()  # UCX's TCP emulates the get with messages: the target serves them
        w.progress()
        status = next((st for ev_id, kind, st in w.events() if kind == ll.EV_OP and ev_id == op.id), None)
    assert status == ll.UCS_OK
    assert np.array_equal(src, dst)
    close = w.new_op()
    ep.close(close, force=True)
    _drive(w, close)
    w.rkey_destroy(rkey)
    w.mem_unmap(ms)
    w.mem_unmap(md)
    w.destroy()
    assert not target.alive and not w.alive
