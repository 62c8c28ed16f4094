"""shm's native fast path for small block transfers: one C call checks, plans and copies.

``kvf_blocks`` plans in C by the rules of ``kvflow._plan.plan_blocks``. The hypothesis tests hold the
two planners to the same bytes, and to refusing the same input; the other tests run it between real
processes through ``LlmDataDist`` and ``kvflow.sync``: the bytes land, ``stats()`` counts them, and
bad input gets the typed error with nothing moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import kvflow.sync
import numpy as np
import pytest
from conftest import requires_cma
from hypothesis import given, settings
from hypothesis import strategies as st
from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LLMParamInvalid,
    LlmRole,
)
from kvflow._plan import plan_blocks
from test_shm_transport import SHM, DataDistPeer

from kvflow_shm import _lowlevel as ll

pytestmark = requires_cma

PEER_DESC = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[64, 16384])  # _peer.serve_datadist's
BLOCK = 16384


def _layout(ntensors: int, stride: int, num_blocks: int, base: int) -> tuple[CacheDesc, np.ndarray, ll.Regions]:
    """A cache layout at made-up addresses (nothing is copied): desc, tensor addresses, regions."""
    desc = CacheDesc(num_tensors=ntensors, data_type=DataType.DT_UINT8, shape=[num_blocks, stride])
    addrs = np.array([base + t * (num_blocks * stride + 4096) for t in range(ntensors)], dtype=np.uint64)
    return desc, addrs, ll.Regions(addrs, np.full(ntensors, num_blocks * stride, dtype=np.uint64))


def _python_plan(write: bool, local: tuple[CacheDesc, np.ndarray], remote: tuple[CacheDesc, np.ndarray],
                 src: list[int], dst: list[int]) -> np.ndarray | None:
    """kvflow's planner on the same request (push: local is the source), or None if it refuses."""
    (sd, sa), (dd, da) = (local, remote) if write else (remote, local)
    try:
        return plan_blocks(sd, sa, dd, da, src, dst, None, local_is_src=write).table
    except LLMParamInvalid:
        return None


@settings(max_examples=400, deadline=None)
@given(ntensors=st.integers(1, 4), stride=st.sampled_from([1, 8, 4096, 12288]), lblocks=st.integers(1, 40),
       rblocks=st.integers(1, 40), write=st.booleans(),
       src=st.lists(st.integers(-2, 44), min_size=0, max_size=20),
       dst=st.lists(st.integers(-2, 44), min_size=0, max_size=20))
def test_c_planner_maps_the_same_bytes_as_kvflows_planner_and_refuses_the_same_input(
        ntensors: int, stride: int, lblocks: int, rblocks: int, write: bool, src: list[int], dst: list[int]) -> None:
    if len(dst) > len(src) or (len(src) and len(dst) and src[0] % 3 == 0):
        dst = dst[:len(src)]  # equal lengths most of the time, so that most examples are valid
    ld, la, lr = _layout(ntensors, stride, lblocks, 1 << 40)
    rd, ra, rr = _layout(ntensors, stride, rblocks, 1 << 44)
    pair = ll.Pair(os.getpid(), stride, lblocks, rblocks, lr, rr, 1 << 30)
    want = _python_plan(write, (ld, la), (rd, ra), src, dst)
    got = ll.plan_blocks(pair, write, src, dst)
    if want is None:
        assert got is None  # refused by both; the Python path then raises the typed error
    else:
        assert got is not None, "the C planner declined a request that kvflow's planner accepts"
        assert np.array_equal(got, want)


@given(num_blocks=st.integers(2, 40), short=st.integers(1, 4096), block=st.integers(0, 39), write=st.booleans())
def test_runs_outside_a_described_region_are_refused_by_both_paths(num_blocks: int, short: int, block: int,
                                                                   write: bool) -> None:
    """A peer that describes more blocks than the region it grants: neither path moves a byte."""
    block %= num_blocks
    stride = 4096
    ld, la, lr = _layout(2, stride, num_blocks, 1 << 40)
    rd, ra, _ = _layout(2, stride, num_blocks, 1 << 44)
    rr = ll.Regions(ra, np.full(2, num_blocks * stride - short, dtype=np.uint64))  # the last block cut short
    pair = ll.Pair(os.getpid(), stride, num_blocks, num_blocks, lr, rr, 1 << 30)
    last = num_blocks - 1
    src, dst = ([block], [last]) if write else ([last], [block])
    assert ll.plan_blocks(pair, write, src, dst) is None
    buf = np.zeros(8, dtype=np.uint8)
    assert ll.transfer_blocks(pair, write, src, dst, ll.scratch()) == 0  # declined before any syscall
    table = _python_plan(write, (ld, la), (rd, ra), src, dst)
    assert table is not None  # the planner checks block indices; the transport checks the regions
    with pytest.raises(ll.RunOutOfBounds) as exc:
        ll.transfer_table(os.getpid(), write, table, lr, rr, 1 << 30, ll.scratch())
    assert exc.value.side == "remote"
    assert not buf.any()


def test_a_copy_within_this_process_and_batches_past_the_inline_bounds_declined() -> None:
    ntensors, stride, nblocks = 16, 64, 128
    a = [np.random.default_rng(t).integers(0, 256, nblocks * stride, dtype=np.uint8) for t in range(ntensors)]
    b = [np.zeros(nblocks * stride, dtype=np.uint8) for _ in range(ntensors)]

    def regions(arrs: list[np.ndarray]) -> ll.Regions:
        return ll.Regions(np.array([x.ctypes.data for x in arrs], dtype=np.uint64),
                          np.full(len(arrs), nblocks * stride, dtype=np.uint64))

    pair = ll.Pair(os.getpid(), stride, nblocks, nblocks, regions(b), regions(a), 1 << 30)  # pull: a -> b
    out = ll.scratch()
    src, dst = list(range(0, 32, 2)), list(range(64, 96, 2))  # 16 runs per tensor: 256 in all, the most
    assert ll.transfer_blocks(pair, False, src, dst, out) == 256 * stride and out[1] == 256
    for t in range(ntensors):
        assert np.array_equal(b[t].reshape(nblocks, -1)[dst], a[t].reshape(nblocks, -1)[src])
        assert not b[t].reshape(nblocks, -1)[[0, 65, 97]].any()
    assert ll.transfer_blocks(pair, False, src + [40], dst + [100], out) == 0  # 272 runs: declined
    assert ll.transfer_blocks(pair, False, list(range(65)), list(range(65)), out) == 0  # > FAST_MAX_BLOCKS
    small = ll.Pair(os.getpid(), stride, nblocks, nblocks, regions(b), regions(a), 2 * stride * ntensors - 1)
    assert ll.transfer_blocks(small, False, [1, 2], [3, 4], out) == 0  # one byte past InlineBytes
    assert not b[0].reshape(nblocks, -1)[[3, 4, 100]].any()


class _Linked:
    """An LlmDataDist linked over shm to a peer process holding ``PEER_DESC``, with a local cache like it."""

    def __init__(self, dd: LlmDataDist, peer: DataDistPeer, cache: Any, mine: list[np.ndarray]) -> None:
        self.dd, self.peer, self.cache, self.mine = dd, peer, cache, mine
        self.ci = CacheIndex(1, peer.cache_id)

    async def theirs(self) -> list[np.ndarray]:
        return [np.frombuffer(b, dtype=np.uint8).reshape(64, -1) for b in await self.peer.call("contents")]

    def series(self, op: str) -> dict[str, Any]:
        return self.dd.stats()["links"][1]["series"]["shm"][op]  # type: ignore[no-any-return]


def _no_python_path(dd: LlmDataDist) -> None:
    """Make the endpoint's Python-planned paths fail loudly: what follows must take ``blocks_now``."""
    ep = dd._table.links[1].endpoint

    def refuse(*_: Any, **__: Any) -> bool:
        raise AssertionError("took the Python-planned path")

    ep.read_now = ep.write_now = refuse  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def _linked() -> AsyncIterator[_Linked]:
    """A peer process and an LlmDataDist linked to it over shm, for at most 60 s; both end after."""
    peer = DataDistPeer(SHM)
    try:
        async with asyncio.timeout(60), LlmDataDist(2, LlmRole.DECODER, options=SHM) as dd:
            rets = await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", peer.port)])], 5000)
            assert [int(r) for r in rets] == [0] and dd.link_info(1).transport == "shm"
            mine = [np.zeros(PEER_DESC.tensor_bytes, dtype=np.uint8) for _ in range(2)]
            cache = await dd.register_kv_cache(PEER_DESC, mine)
            lk = _Linked(dd, peer, cache, mine)
            await dd.pull_kv_blocks(lk.ci, cache, [0], [63])  # through the loop: the link learns the peer's cache
            mine[0][:] = mine[1][:] = 0
            yield lk
    finally:
        peer.stop()


@pytest.mark.asyncio
async def test_small_block_pulls_and_pushes_take_the_native_path_and_count_in_stats() -> None:
    async with _linked() as lk:
        dd = lk.dd
        before = lk.series("pull")
        _no_python_path(dd)
        await dd.pull_kv_blocks(lk.ci, lk.cache, [3, 4, 5, 9], [0, 1, 2, 7])  # two runs per tensor
        theirs = await lk.theirs()
        for t in range(2):
            mine = lk.mine[t].reshape(64, -1)
            assert np.array_equal(mine[[0, 1, 2, 7]], theirs[t][[3, 4, 5, 9]])
            assert not mine[[3, 4, 5, 6, 8]].any()
        after = lk.series("pull")
        assert after["transfers"] - before["transfers"] == 1
        assert after["bytes"] - before["bytes"] == 4 * BLOCK * 2
        assert after["runs"] - before["runs"] == 4
        assert after["latency"]["count"] - before["latency"]["count"] == 1
        for t in lk.mine:
            t[:] = np.random.default_rng(3).integers(0, 256, t.size, dtype=np.uint8)
        await dd.push_kv_blocks(lk.cache, lk.ci, (10,), (20,))  # a tuple, one block
        theirs = await lk.theirs()
        for t in range(2):
            assert np.array_equal(theirs[t][20], lk.mine[t].reshape(64, -1)[10])
        push = lk.series("push")
        assert (push["transfers"], push["bytes"], push["runs"]) == (1, 2 * BLOCK, 2)


BAD: list[tuple[Any, Any]] = [
    ([64], [0]),  # past the peer's last block
    ([0], [-1]),  # negative
    ([1, 2], [5, 5]),  # a destination block twice
    ([1, 2], [3]),  # unequal lengths
    ([True], [2]),  # a bool is not a block index (C would see 1)
    ([1], [2.0]),  # nor is a float
    ([1 << 70], [2]),  # beyond int64
]


@pytest.mark.asyncio
async def test_bad_block_lists_get_the_typed_error_and_move_nothing() -> None:
    async with _linked() as lk:
        dd = lk.dd
        before = lk.series("pull")
        for src, dst in BAD:
            with pytest.raises(LLMParamInvalid):
                await dd.pull_kv_blocks(lk.ci, lk.cache, src, dst)
            with pytest.raises(LLMParamInvalid):
                await dd.push_kv_blocks(lk.cache, lk.ci, src, dst)
        assert not lk.mine[0].any() and not lk.mine[1].any()
        after = lk.series("pull")
        assert after["transfers"] == before["transfers"]
        assert after["errors"].get("LLM_PARAM_INVALID", 0) == len(BAD)
        # another block size: the pair never takes the fast path; the planner says why
        other = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[32, 2 * BLOCK])
        cache2 = await dd.register_kv_cache(other, [np.zeros(other.tensor_bytes, np.uint8) for _ in range(2)])
        with pytest.raises(LLMParamInvalid, match="block sizes differ"):
            await dd.pull_kv_blocks(lk.ci, cache2, [1], [1])


def test_sync_facade_copies_small_blocks_natively_on_the_calling_thread() -> None:
    peer = DataDistPeer(SHM)
    try:
        with kvflow.sync.LlmDataDist(2, LlmRole.DECODER, options=SHM) as sdd:
            rets = sdd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", peer.port)])], 5000)
            assert [int(r) for r in rets] == [0]
            mine = [np.zeros(PEER_DESC.tensor_bytes, dtype=np.uint8) for _ in range(2)]
            cache = sdd.register_kv_cache(PEER_DESC, mine)
            ci = CacheIndex(1, peer.cache_id)
            sdd.pull_kv_blocks(ci, cache, [0], [63])  # learns the peer's cache
            _no_python_path(sdd._dd)
            engine = sdd._dd._engine
            calls = []
            run_now = engine.run_now
            engine.run_now = lambda req: calls.append(req) or run_now(req)  # type: ignore[method-assign]
            sdd.pull_kv_blocks(ci, cache, [8, 9], [1, 2])
            sdd.push_kv_blocks(cache, ci, [1], [30])
            with pytest.raises(LLMParamInvalid):
                sdd.pull_kv_blocks(ci, cache, [99], [1])
            assert len(calls) == 1  # only the bad request went past the native path
            theirs = [np.frombuffer(b, dtype=np.uint8).reshape(64, -1)
                      for b in asyncio.run(_contents(peer))]
            for t in range(2):
                assert np.array_equal(mine[t].reshape(64, -1)[[1, 2]], theirs[t][[8, 9]])
                assert np.array_equal(theirs[t][30], theirs[t][8])  # mine[1] came from their block 8
            series = sdd.stats()["links"][1]["series"]["shm"]
            assert series["pull"]["transfers"] == 2 and series["push"]["transfers"] == 1
            assert series["pull"]["errors"] == {"LLM_PARAM_INVALID": 1}
    finally:
        peer.stop()


async def _contents(peer: DataDistPeer) -> Any:
    return await peer.call("contents")
