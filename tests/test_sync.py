"""kvflow.sync.LlmDataDist: the blocking facade, against a peer process, over tcp and shm.

The local side is a ``kvflow.sync.LlmDataDist`` driven from plain threads (the test's own thread
has no running event loop); the peer is the API suite's prefill child process. Every transfer's
bytes are compared in full. The end of the module runs tests/test_api_transfers.py again with its
``pair.dd`` backed by the sync facade (each call made from a worker thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import inspect
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import kvflow
import kvflow.sync
from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LayerEvents,
    LayerSynchronizer,
    LLMException,
    LLMFailed,
    LLMKvCacheNotExist,
    LLMNotYetLink,
    LLMParamInvalid,
    LlmRole,
    LLMStatusCode,
    LLMTimeoutError,
    TransferConfig,
)
from kvflow.testing import pattern

from . import test_api_transfers as api_suite
from ._docblocks import python_blocks, run_as_script
from .conftest import DESC, LOCAL_CLUSTER, PEER_CLUSTER, Pair, Peer, _api_transports, blocks, start_peer

ROOT = Path(__file__).resolve().parent.parent
S = LLMStatusCode


# ---------------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module", params=[p for p in _api_transports() if p.id in ("tcp", "shm")])
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    """The prefill child process (cluster 1), once per transport."""
    p = start_peer(request.param)
    yield p
    p.proc.stop()


def peer_call(peer: Peer, op: str, *args: Any, timeout: float = 30.0) -> Any:
    """One command to the peer process, from a thread without an event loop; its errors are raised here."""
    peer.proc.send((op, args))
    if not peer.proc.conn.poll(timeout):
        raise TimeoutError(f"peer process sent nothing within {timeout} s")
    kind, value = peer.proc.conn.recv()
    if kind == "err":
        raise value
    assert kind == "ok", f"the peer process failed:\n{value}"
    return value


def peer_register(peer: Peer, desc: CacheDesc, seed: int | None) -> int:
    return int(peer_call(peer, "register", (desc.num_tensors, int(desc.data_type), list(desc.shape)), seed))


def wait_peer_dropped(peer: Peer) -> None:
    """Let the peer drop its side of our link before the next test links with the same cluster id
    (a broken one, left by a peer that was stopped meanwhile, is replaced by the next link)."""
    for _ in range(500):
        if peer_call(peer, "links").get(LOCAL_CLUSTER) in (None, "broken"):
            return
        time.sleep(0.01)


def new_sync(peer: Peer, **options: str) -> kvflow.sync.LlmDataDist:
    return kvflow.sync.LlmDataDist(LOCAL_CLUSTER, LlmRole.DECODER, options={**peer.options, **options})


def link(dd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    assert dd.link_llm_clusters([ClusterInfo(PEER_CLUSTER, [IpInfo(*peer.address)])], 5000) == [S.LLM_SUCCESS]
    assert dd.link_info(PEER_CLUSTER).transport == peer.transport


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler for the test, whatever the run inherited: a shell starts background
    jobs (`pytest ... &`) with SIGINT ignored, and Python then keeps it ignored, so no Ctrl-C would arrive."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture
def sdd(peer: Peer) -> Iterator[kvflow.sync.LlmDataDist]:
    """A sync LlmDataDist (cluster 2) linked to the peer."""
    dd = new_sync(peer)
    dd.initialize()
    try:
        link(dd, peer)
        yield dd
    finally:
        dd.close()
        wait_peer_dropped(peer)


def zeros(desc: CacheDesc) -> list[np.ndarray]:
    return [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(desc.num_tensors)]


def seeded(desc: CacheDesc, seed: int) -> list[np.ndarray]:
    return [pattern(seed + t, desc.tensor_bytes) for t in range(desc.num_tensors)]


def expect_blocks(before: list[np.ndarray], src: list[np.ndarray], desc: CacheDesc, src_blocks: list[int],
                  dst_blocks: list[int]) -> list[np.ndarray]:
    """``before`` with ``src``'s ``src_blocks`` copied into ``dst_blocks`` (every tensor)."""
    out = [a.copy() for a in before]
    for o, s in zip(out, src):
        blocks(o, desc)[dst_blocks] = blocks(s, desc)[src_blocks]
    return out


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"tensor {t} differs in {int((g != w).sum())} bytes"


def loop_thread(dd: kvflow.sync.LlmDataDist) -> threading.Thread:
    return dd._thread


def pull_errors(dd: kvflow.sync.LlmDataDist) -> dict[str, int]:
    return dd.stats()["ops"].get("pull", {}).get("errors", {})


def until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------------- transfers
def test_pull_and_push_kv_blocks_every_byte(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 100)
    arrs = zeros(DESC)
    cache = sdd.register_kv_cache(DESC, arrs)
    assert cache.cache_id > 0
    remote = peer_call(peer, "read", rid)
    assert sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [0, 1, 2, 3], [3, 2, 1, 0]) is None
    want = expect_blocks(zeros(DESC), remote, DESC, [0, 1, 2, 3], [3, 2, 1, 0])
    assert_same(arrs, want)

    for a, s in zip(arrs, seeded(DESC, 200)):
        a[:] = s
    rid2 = peer_register(peer, DESC, None)
    sdd.push_kv_blocks(cache, CacheIndex(PEER_CLUSTER, rid2), [4, 5, 6], [0, 7, 3])
    assert_same(peer_call(peer, "read", rid2), expect_blocks(zeros(DESC), arrs, DESC, [4, 5, 6], [0, 7, 3]))
    assert sdd.stats()["total"]["transfers"] == 2


def test_pull_and_push_kv_cache_every_byte(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 300)
    arrs = zeros(DESC)
    cache = sdd.register_kv_cache(DESC, arrs)
    sdd.pull_kv_cache(CacheIndex(PEER_CLUSTER, rid, 5), cache, batch_index=2)
    sdd.pull_kv_cache(CacheIndex(PEER_CLUSTER, rid, 1), cache, 6, 24)  # positional size: 24 bytes per tensor
    remote = peer_call(peer, "read", rid)
    want = expect_blocks(zeros(DESC), remote, DESC, [5], [2])
    for w, r in zip(want, remote):
        blocks(w, DESC)[6][:24] = blocks(r, DESC)[1][:24]
    assert_same(arrs, want)

    rid2 = peer_register(peer, DESC, None)
    sdd.push_kv_cache(cache, CacheIndex(PEER_CLUSTER, rid2, 7), src_batch_index=2,
                      ext_param=KvCacheExtParam((1, 1), (0, 0), 2))  # layer 1 (tensors 2, 3) -> layer 0
    got = peer_call(peer, "read", rid2)
    want2 = zeros(DESC)
    for t in (0, 1):
        blocks(want2[t], DESC)[7] = blocks(arrs[t + 2], DESC)[2]
    assert_same(got, want2)


def test_typed_errors_propagate_with_their_traceback(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 400)
    arrs = seeded(DESC, 500)
    before = [a.copy() for a in arrs]
    cache = sdd.register_kv_cache(DESC, arrs)
    with pytest.raises(LLMNotYetLink) as err:
        sdd.pull_kv_blocks(CacheIndex(77, 1), cache, [0], [0])
    assert err.value.status_code == S.LLM_NOT_YET_LINK
    files = [str(entry.path) for entry in err.traceback]
    assert any(f.endswith(os.path.join("kvflow", "_datadist.py")) for f in files), files  # the loop's side
    assert files[0] == __file__  # ... below this test's frame
    with pytest.raises(LLMParamInvalid) as perr:
        sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [0, 8], [0, 1])
    assert perr.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMParamInvalid):
        sdd.push_kv_blocks(cache, CacheIndex(PEER_CLUSTER, rid), [0, 1], [2, 2])
    with pytest.raises(LLMKvCacheNotExist):
        sdd.pull_kv_cache(CacheIndex(PEER_CLUSTER, 9999), cache)
    with pytest.raises(LLMNotYetLink):
        sdd.link_info(77)
    with pytest.raises(LLMParamInvalid):
        sdd.register_kv_cache(DESC, arrs[:2])
    assert_same(arrs, before)
    assert_same(peer_call(peer, "read", rid), seeded(DESC, 400))
    assert sdd.link_info(PEER_CLUSTER).state == "linked"


def test_a_timeout_is_a_timeout_error(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 600)  # not looked up yet: the pull must ask the (stopped) peer
    arrs = zeros(DESC)
    cache = sdd.register_kv_cache(DESC, arrs)
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [1], [1], timeout_in_millis=300)
        took = time.monotonic() - t0
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert isinstance(err.value, LLMTimeoutError) and err.value.status_code == S.LLM_TIMEOUT
    assert 0.25 < took < 3.0, took
    assert not any(a.any() for a in arrs)
    sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [1], [1], timeout_in_millis=10_000)
    assert_same(arrs, expect_blocks(zeros(DESC), seeded(DESC, 600), DESC, [1], [1]))


def test_submit_returns_a_concurrent_future(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 700)
    arrs = zeros(DESC)
    cf = sdd.submit_register_kv_cache(DESC, arrs)
    assert isinstance(cf, concurrent.futures.Future)
    cache = cf.result(10)
    futs = [sdd.submit_pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [b], [7 - b]) for b in range(7)]
    assert all(isinstance(f, concurrent.futures.Future) for f in futs)
    done, pending = concurrent.futures.wait(futs, timeout=30)
    assert not pending and all(f.result() is None for f in done)
    bad = sdd.submit_pull_kv_blocks(CacheIndex(77, 1), cache, [0], [0])
    assert isinstance(bad.exception(10), LLMNotYetLink)

    async def from_a_loop() -> list[S]:  # submit_* may be called, and awaited, in a running loop
        await asyncio.wrap_future(sdd.submit_pull_kv_cache(CacheIndex(PEER_CLUSTER, rid, 7), cache, 0))
        return await asyncio.wrap_future(sdd.submit_link_llm_clusters(
            [ClusterInfo(PEER_CLUSTER, [IpInfo(*peer.address)])]))

    assert kvflow.run(from_a_loop()) == [S.LLM_ALREADY_LINK]
    remote = peer_call(peer, "read", rid)
    assert_same(arrs, expect_blocks(zeros(DESC), remote, DESC, list(range(8)), [7 - b for b in range(7)] + [0]))


def test_eight_threads_pull_at_once_on_one_instance(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[256, 4096])
    rid = peer_register(peer, desc, 800)
    arrs = zeros(desc)
    cache = sdd.register_kv_cache(desc, arrs)
    perm = np.random.default_rng(5).permutation(256)
    start = threading.Barrier(8)
    errors: list[BaseException] = []
    threads_seen: set[int] = set()

    def worker(w: int) -> None:
        try:
            start.wait(10)
            threads_seen.add(threading.get_ident())
            for k in range(16):  # 16 pulls of 2 blocks each; thread w owns local blocks [32w, 32w + 32)
                dst = [32 * w + 2 * k, 32 * w + 2 * k + 1]
                sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [int(perm[d]) for d in dst], dst)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert len(threads_seen) == 8
    remote = peer_call(peer, "read", rid)
    assert_same(arrs, [blocks(r, desc)[perm].reshape(-1) for r in remote])
    assert sdd.stats()["ops"]["pull"]["transfers"] == 8 * 16


# ---------------------------------------------------------------------- layer-wise push
class BlockingSync(LayerSynchronizer):
    """A plain (blocking) synchronizer that records the thread each call runs on."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        time.sleep(0.005)  # an accelerator event's wait
        self.calls.append((layer_index, threading.get_ident()))
        return True


def test_transfer_cache_async_with_a_blocking_synchronizer(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    desc = CacheDesc(num_tensors=8, data_type=DataType.DT_FLOAT16, shape=[8, 64])  # 4 layers of K, V
    rid = peer_register(peer, desc, None)
    arrs = seeded(desc, 900)
    cache = sdd.register_kv_cache(desc, arrs)
    sync = BlockingSync()
    task = sdd.transfer_cache_async(cache, sync, [TransferConfig(CacheIndex(PEER_CLUSTER, rid))],
                                    src_block_indices=[0, 1, 2], dst_block_indices=[5, 6, 7])
    assert isinstance(task, kvflow.sync.CacheTask)
    assert task.wait() is None
    assert task.done() and not task.cancelled() and task.exception() is None
    assert task.get_results() == [S.LLM_SUCCESS]
    assert task.synchronize(1000) == S.LLM_SUCCESS
    assert task.num_layers == task.layers_ready == task.layers_sent == 4
    assert task.config_layers_sent == [4] and sorted(task.layer_sent_at) == [0, 1, 2, 3]
    assert [layer for layer, _ in sync.calls] == [0, 1, 2, 3]
    threads = {ident for _, ident in sync.calls}
    assert loop_thread(sdd).ident not in threads, "the blocking synchronizer ran on kvflow's loop thread"
    assert threading.get_ident() not in threads
    assert_same(peer_call(peer, "read", rid), expect_blocks(zeros(desc), arrs, desc, [0, 1, 2], [5, 6, 7]))


def test_transfer_cache_async_layer_events_from_this_thread(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    desc = CacheDesc(num_tensors=4, data_type=DataType.DT_INT32, shape=[4, 32])
    rid = peer_register(peer, desc, None)
    arrs = seeded(desc, 1000)
    cache = sdd.register_kv_cache(desc, arrs)
    events = LayerEvents(2)
    task = sdd.transfer_cache_async(cache, events, [TransferConfig(CacheIndex(PEER_CLUSTER, rid, 3),
                                                                   (1, 1), (0, 0), src_batch_index=2)])
    assert task.synchronize(50) == S.LLM_TIMEOUT and not task.done()  # waiting for layer 1, which goes on
    events.mark_ready(1)
    task.wait()
    assert task.get_results() == [S.LLM_SUCCESS] and task.cancel() is False
    want = zeros(desc)
    for t in (0, 1):
        blocks(want[t], desc)[3] = blocks(arrs[t + 2], desc)[2]
    assert_same(peer_call(peer, "read", rid), want)


def test_transfer_cache_async_cancel_and_failures(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, None)
    cache = sdd.register_kv_cache(DESC, seeded(DESC, 1100))
    with pytest.raises(LLMParamInvalid, match="transfer_configs"):
        sdd.transfer_cache_async(cache, LayerEvents(2), [TransferConfig(CacheIndex(PEER_CLUSTER, rid), (0, 5))])
    events = LayerEvents(2)
    task = sdd.transfer_cache_async(cache, events, [TransferConfig(CacheIndex(PEER_CLUSTER, rid))],
                                    [0], [1])
    assert task.cancel() is True
    with pytest.raises(LLMFailed, match="cancelled"):
        task.wait()
    assert task.cancelled() and task.synchronize() == S.LLM_FAILED

    class Never(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return False

    task = sdd.transfer_cache_async(cache, Never(), [TransferConfig(CacheIndex(PEER_CLUSTER, rid))], [0], [1])
    with pytest.raises(LLMFailed, match="never be ready"):
        task.wait()
    assert task.get_results() == [S.LLM_FAILED]


# ---------------------------------------------------------------------- in a running loop
def test_a_blocking_call_in_a_running_loop_raises(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    cache = sdd.register_kv_cache(DESC, zeros(DESC))

    async def main() -> None:
        sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, 1), cache, [0], [0])

    with pytest.raises(LLMFailed, match=r"event loop: use kvflow\.LlmDataDist and await pull_kv_blocks\(") as err:
        kvflow.run(main())
    assert "submit_pull_kv_blocks" in str(err.value)
    assert issubclass(LLMFailed, RuntimeError)

    async def close_in_loop() -> None:
        sdd.close()

    with pytest.raises(LLMFailed, match=r"close blocks .* await finalize\(\)"):
        asyncio.run(close_in_loop())
    assert not sdd.closed and loop_thread(sdd).is_alive()


def test_a_blocking_call_on_kvflows_own_loop_raises(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    """An async synchronizer runs on kvflow's loop thread: a blocking call there would deadlock."""
    rid = peer_register(peer, DESC, None)
    cache = sdd.register_kv_cache(DESC, seeded(DESC, 1200))

    class CallsBack(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            sdd.stats()
            return True

    task = sdd.transfer_cache_async(cache, CallsBack(), [TransferConfig(CacheIndex(PEER_CLUSTER, rid))],
                                    [0], [0])
    with pytest.raises(LLMFailed, match=r"LlmDataDist\.stats blocks .* running event loop"):
        task.wait()
    assert sdd.link_info(PEER_CLUSTER).state == "linked"


# ---------------------------------------------------------------------- lifecycle
def test_close_joins_the_thread_and_later_calls_fail(peer: Peer) -> None:
    dd = new_sync(peer)
    thread = loop_thread(dd)
    assert thread.is_alive() and thread.daemon
    dd.initialize()
    link(dd, peer)
    cache = dd.register_kv_cache(DESC, zeros(DESC))
    try:
        assert dd.listen_address is None and dd.transports == (peer.transport,)
    finally:
        dd.close()
    assert not thread.is_alive()
    assert dd.closed and dd.listen_address is None
    dd.close()  # idempotent
    with pytest.raises(LLMFailed, match="closed"):
        dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, 1), cache, [0], [0])
    with pytest.raises(LLMFailed, match="closed"):
        dd.submit_pull_kv_blocks(CacheIndex(PEER_CLUSTER, 1), cache, [0], [0])
    with pytest.raises(LLMFailed, match="closed"):
        dd.stats()
    assert dd.cluster_id == LOCAL_CLUSTER and dd.role == LlmRole.DECODER
    wait_peer_dropped(peer)
    assert LOCAL_CLUSTER not in peer_call(peer, "links")


def test_close_from_many_threads_and_before_initialize(peer: Peer) -> None:
    dd = new_sync(peer)  # never initialized: close only stops the thread
    thread = loop_thread(dd)
    closers = [threading.Thread(target=dd.close) for _ in range(4)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(10)
    assert not thread.is_alive() and all(not t.is_alive() for t in closers)
    with pytest.raises(LLMFailed, match="closed"):
        dd.initialize()


def test_close_fails_calls_in_flight(peer: Peer) -> None:
    dd = new_sync(peer)
    dd.initialize()
    link(dd, peer)
    rid = peer_register(peer, DESC, 1300)
    cache = dd.register_kv_cache(DESC, zeros(DESC))
    os.kill(peer.proc.pid, signal.SIGSTOP)  # a pull waits for the peer's description of its cache
    try:
        # cancelling the future cancels the pull on the loop
        gone = dd.submit_pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [1], [1], timeout_in_millis=60_000)
        time.sleep(0.1)
        assert gone.cancel() and gone.cancelled()
        assert until(lambda: pull_errors(dd) == {"CANCELLED": 1})
        assert dd.link_info(PEER_CLUSTER).state == "linked"
        fut = dd.submit_pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [0], [0], timeout_in_millis=60_000)
        time.sleep(0.2)
        assert not fut.done()
        t0 = time.monotonic()
        dd.close()
        assert isinstance(fut.exception(10), LLMException), fut.exception()
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert not loop_thread(dd).is_alive()
    wait_peer_dropped(peer)


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_in_a_blocking_call_cancels_the_operation(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 1500)
    arrs = zeros(DESC)
    cache = sdd.register_kv_cache(DESC, arrs)
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        ctrl_c = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        ctrl_c.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [0], [0], timeout_in_millis=30_000)
        assert time.monotonic() - t0 < 5
        assert until(lambda: pull_errors(sdd) == {"CANCELLED": 1})
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [0], [4], timeout_in_millis=10_000)
    assert_same(arrs, expect_blocks(zeros(DESC), seeded(DESC, 1500), DESC, [0], [4]))


def test_calls_fail_rather_than_hang_if_the_loop_ended(peer: Peer) -> None:
    dd = new_sync(peer)
    dd.initialize()
    dd._loop.call_soon_threadsafe(dd._loop.stop)  # as if the loop thread died
    loop_thread(dd).join(10)
    assert not loop_thread(dd).is_alive() and dd.closed
    with pytest.raises(LLMFailed, match="closed"):
        dd.stats()
    dd.close()


def test_context_manager(peer: Peer) -> None:
    rid = peer_register(peer, DESC, 1400)
    arrs = zeros(DESC)
    with kvflow.sync.LlmDataDist(LOCAL_CLUSTER, LlmRole.DECODER, options=peer.options) as dd:
        thread = loop_thread(dd)
        link(dd, peer)
        cache = dd.register_kv_cache(DESC, arrs)
        dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [2, 3], [0, 1])
        dd.unregister_kv_cache(cache.cache_id)
        assert dd.unlink_llm_clusters([ClusterInfo(PEER_CLUSTER, [IpInfo(*peer.address)])]) == [S.LLM_SUCCESS]
    assert not thread.is_alive() and dd.closed
    assert_same(arrs, expect_blocks(zeros(DESC), seeded(DESC, 1400), DESC, [2, 3], [0, 1]))
    wait_peer_dropped(peer)


def test_a_failed_initialize_in_with_closes() -> None:
    dd = kvflow.sync.LlmDataDist(5, options={"kvflow.NoSuchKey": "1"})
    thread = loop_thread(dd)
    with pytest.raises(LLMParamInvalid, match="NoSuchKey"):
        with dd:
            pass
    assert dd.closed and not thread.is_alive()


def test_constructor_errors_start_no_thread() -> None:
    before = {t for t in threading.enumerate() if t.name.startswith("kvflow-sync")}
    with pytest.raises(LLMParamInvalid):
        kvflow.sync.LlmDataDist(-1)
    with pytest.raises(LLMParamInvalid):
        kvflow.sync.LlmDataDist(1, role=99)  # type: ignore[arg-type]
    assert {t for t in threading.enumerate() if t.name.startswith("kvflow-sync")} == before


def test_an_instance_dropped_without_close_stops_its_thread() -> None:
    dd = kvflow.sync.LlmDataDist(6, options={"kvflow.Transports": "tcp", "llm.ListenIpInfo": "127.0.0.1:0"})
    dd.initialize()
    thread = loop_thread(dd)
    del dd
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_uses_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop")
    with kvflow.sync.LlmDataDist(7) as dd:
        assert type(dd._loop).__module__.startswith("uvloop")


# ---------------------------------------------------------------------- the surface
def _public(cls: type) -> dict[str, Any]:
    return {n: inspect.getattr_static(cls, n) for n in dir(cls) if not n.startswith("_")}


def test_same_methods_and_signatures_as_the_async_api() -> None:
    sync_cls = kvflow.sync.LlmDataDist
    for name, attr in _public(kvflow.LlmDataDist).items():
        assert hasattr(sync_cls, name), name
        if isinstance(attr, property):
            assert isinstance(inspect.getattr_static(sync_cls, name), property), name
            continue
        if not callable(attr):  # instance attributes (cluster_id, role) are properties here
            continue
        want = inspect.signature(attr)
        assert inspect.signature(getattr(sync_cls, name)) == want, name
        if inspect.iscoroutinefunction(attr):
            assert not inspect.iscoroutinefunction(getattr(sync_cls, name)), name
            assert inspect.signature(getattr(sync_cls, f"submit_{name}")).parameters == want.parameters, name
    for name in ("cluster_id", "role"):
        assert isinstance(inspect.getattr_static(sync_cls, name), property)
    for name in _public(kvflow.CacheTask):
        assert hasattr(kvflow.sync.CacheTask, name), name
    assert hasattr(kvflow.sync.CacheTask, "wait")


# ---------------------------------------------------------------------- docs and bench
def _doc_blocks() -> list[Any]:
    return [pytest.param(code, id=f"block{i}") for i, code in enumerate(python_blocks("docs/sync.md"))]


@pytest.mark.parametrize("code", _doc_blocks())
def test_docs_examples_run_as_written(code: str, tmp_path: Path) -> None:
    res = run_as_script(code, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_bench_sync_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from kvflow._bench_sync import main

    assert main(["--transport", "tcp", "--n", "60", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "overhead of the sync facade at p50" in out and "no-op" in out


# ---------------------------------------------------------------------- the API suite, through the facade
class AwaitableSync:
    """``kvflow.LlmDataDist``'s surface over a ``kvflow.sync.LlmDataDist``, for the async API suite:
    each call runs the blocking method on a worker thread (which has no running loop)."""

    def __init__(self, dd: kvflow.sync.LlmDataDist) -> None:
        self._dd = dd

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._dd, name)
        if inspect.iscoroutinefunction(getattr(kvflow.LlmDataDist, name)):
            async def call(*args: Any, **kwargs: Any) -> Any:
                return await asyncio.to_thread(method, *args, **kwargs)

            return call

        def plain(*args: Any, **kwargs: Any) -> Any:  # blocks the test's loop for one hop: fine in a test
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                return ex.submit(method, *args, **kwargs).result()

        return plain


@pytest.fixture
def pair(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> Pair:
    return Pair(AwaitableSync(sdd), peer)  # type: ignore[arg-type]


def _through_sync(test: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> None:
        await test(*args, **kwargs)

    return pytest.mark.asyncio(run)


for _name, _test in list(vars(api_suite).items()):
    if _name.startswith("test_") and inspect.iscoroutinefunction(_test):
        globals()[f"test_api_{_name[len('test_'):]}"] = _through_sync(_test)
del _name, _test


# ------------------------------------------------------------------ cancelling a stalled transfer
STALL_OPTS = {"kvflow.Transports": "shm", "kvflow.HeartbeatTimeout": "10000", "llm.SyncKvCacheWaitTime": "30000"}


@pytest.fixture
def faulting_peer() -> Iterator[tuple[Any, dict[str, Any]]]:
    """A shm peer whose cache pages fault until resolved (tests/_uffdpeer.py)."""
    import multiprocessing as mp

    from . import _uffdpeer

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_uffdpeer.serve, args=(child, 8 << 20, STALL_OPTS), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(60)
        info = conn.recv()
        if "error" in info:
            pytest.skip(f"this machine does not let a test process use {info['error']}")
        yield conn, info
    finally:
        with contextlib.suppress(OSError):
            conn.send(("exit",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _stalled_pull(conn: Any, info: dict[str, Any]) -> tuple[kvflow.sync.LlmDataDist, list[np.ndarray], Any]:
    """A blocking-API instance, linked over shm, and a pull of blocks 1..63 stalled in the peer's
    first page fault; the peer resolves every page 0.5 s from now (from a timer thread)."""
    half, rid = info["half"], info["cache_id"]
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[half // 4096, 4096])
    dd = kvflow.sync.LlmDataDist(2, LlmRole.DECODER, options=STALL_OPTS)
    dd.initialize()
    assert dd.link_llm_clusters([ClusterInfo(PEER_CLUSTER, [IpInfo("127.0.0.1", info["port"])])], 5000) == [0]
    arrs = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(2)]
    cache = dd.register_kv_cache(desc, arrs)
    blocks_ = list(range(1, 64))

    def resolve() -> None:
        conn.send(("resolve", 0, 2 * half, 0xAB))
        conn.recv()

    threading.Timer(0.5, resolve).start()
    return dd, arrs, (CacheIndex(PEER_CLUSTER, rid), cache, blocks_)


def test_cancelling_a_submitted_pull_returns_once_no_byte_of_it_can_land(
        faulting_peer: tuple[Any, dict[str, Any]]) -> None:
    """``fut.cancel()`` of a submitted pull whose copy is stalled in the peer's page fault returns
    only once the copy has stopped: no byte lands after it. It used to return at once."""
    conn, info = faulting_peer
    dd, arrs, (ci, cache, blocks_) = _stalled_pull(conn, info)
    try:
        fut = dd.submit_pull_kv_blocks(ci, cache, blocks_, blocks_, timeout_in_millis=30_000)
        time.sleep(0.2)
        assert not fut.done()
        t0 = time.monotonic()
        assert fut.cancel() and fut.cancelled()
        assert time.monotonic() - t0 > 0.2  # it waited for the stalled copy (resolved at 0.5 s)
        landed = sum(int(np.count_nonzero(a)) for a in arrs)
        time.sleep(0.3)
        assert sum(int(np.count_nonzero(a)) for a in arrs) == landed
    finally:
        dd.close()


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_in_a_blocking_pull_returns_once_no_byte_of_it_can_land(
        faulting_peer: tuple[Any, dict[str, Any]]) -> None:
    """Ctrl-C (SIGINT to the calling thread) during a blocking pull stalled in the peer's page fault:
    KeyboardInterrupt reaches the caller only once the copy has stopped."""
    conn, info = faulting_peer
    dd, arrs, (ci, cache, blocks_) = _stalled_pull(conn, info)
    me = threading.get_ident()
    threading.Timer(0.2, lambda: signal.pthread_kill(me, signal.SIGINT)).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            dd.pull_kv_blocks(ci, cache, blocks_, blocks_, timeout_in_millis=30_000)
        assert time.monotonic() - t0 > 0.4  # interrupted at 0.2 s, stalled until 0.5 s
        landed = sum(int(np.count_nonzero(a)) for a in arrs)
        time.sleep(0.3)
        assert sum(int(np.count_nonzero(a)) for a in arrs) == landed
    finally:
        dd.close()
