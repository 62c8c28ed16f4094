"""Pull and push of caches and block lists between two processes, over every available transport."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvflow import (
    CacheDesc,
    CacheIndex,
    DataType,
    KvCacheExtParam,
    LLMKvCacheNotExist,
    LLMNotYetLink,
    LLMParamInvalid,
    LLMStatusCode,
)
from kvflow.testing import pattern

from .conftest import DESC, LOCAL_CLUSTER, Pair, blocks

pytestmark = pytest.mark.asyncio


async def test_pull_kv_blocks_seed_mapping(pair: Pair) -> None:
    """The seed's example: prompt blocks [0,1,2,3] land in decoder blocks [3,2,1,0]."""
    rid = await pair.peer.register(DESC, seed=100)
    cache, arrs = await pair.local_cache(DESC)
    await pair.dd.pull_kv_blocks(pair.index(rid), cache, [0, 1, 2, 3], [3, 2, 1, 0])
    remote = await pair.peer.read(rid)
    for t in range(DESC.num_tensors):
        got, src = blocks(arrs[t], DESC), blocks(remote[t], DESC)
        for s, d in zip([0, 1, 2, 3], [3, 2, 1, 0]):
            assert np.array_equal(got[d], src[s])
        assert not got[4:].any(), "blocks outside the list changed"


@pytest.mark.parametrize("op", ["pull", "push"])
async def test_small_transfers_awaited_back_to_back_let_the_loop_run(pair: Pair, op: str) -> None:
    """One task awaiting small transfers back to back, which mostly finish inside their calls,
    still lets the loop run its other tasks (kvflow's ``LoopTurns``): a task on the same loop that
    only yields measures the longest stretch without a turn. Before, such shm pulls ran for seconds
    without one, and the peer dropped the link for want of heartbeats."""
    rid = await pair.peer.register(DESC, seed=5)
    cache, arrs = await pair.local_cache(DESC, seed=6)
    ci = pair.index(rid)
    gaps: list[float] = []
    stop = False

    async def other_task() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    other = asyncio.ensure_future(other_task())
    await asyncio.sleep(0)
    n, t0 = 0, time.perf_counter()
    while n < 50_000 and time.perf_counter() - t0 < 0.5:  # 0.5 s of transfers, bounded in count too
        b = n % DESC.num_blocks
        if op == "pull":
            await pair.dd.pull_kv_blocks(ci, cache, [b], [b])
        else:
            await pair.dd.push_kv_blocks(cache, ci, [b], [b])
        n += 1
    stop = True
    await other
    # A turn comes about every 0.75 ms of such transfers; without them the stretch is the whole 0.5 s.
    assert len(gaps) > 20, (n, len(gaps))
    assert max(gaps) < 0.05, (n, sorted(gaps)[-5:])
    remote = await pair.peer.read(rid)  # and the link still works, with the bytes in place
    for t in range(DESC.num_tensors):
        assert np.array_equal(arrs[t], remote[t])


async def test_pull_kv_cache_batch_index_and_size(pair: Pair) -> None:
    rid = await pair.peer.register(DESC, seed=200)
    cache, arrs = await pair.local_cache(DESC)
    await pair.dd.pull_kv_cache(pair.index(rid, batch_index=5), cache, batch_index=2)
    await pair.dd.pull_kv_cache(pair.index(rid, batch_index=1), cache, batch_index=6, size=24)
    remote = await pair.peer.read(rid)
    for t in range(DESC.num_tensors):
        got, src = blocks(arrs[t], DESC), blocks(remote[t], DESC)
        assert np.array_equal(got[2], src[5])
        assert np.array_equal(got[6][:24], src[1][:24])
        assert not got[6][24:].any(), "bytes past size changed"
        assert not np.delete(got, [2, 6], axis=0).any()


async def test_push_kv_cache_and_blocks(pair: Pair) -> None:
    rid = await pair.peer.register(DESC, seed=None)
    cache, arrs = await pair.local_cache(DESC, seed=300)
    await pair.dd.push_kv_cache(cache, pair.index(rid, batch_index=7), src_batch_index=3)
    await pair.dd.push_kv_blocks(cache, pair.index(rid), [0, 1, 2, 3], [3, 2, 1, 0])
    remote = await pair.peer.read(rid)
    for t in range(DESC.num_tensors):
        got, src = blocks(remote[t], DESC), blocks(arrs[t], DESC)
        assert np.array_equal(got[7], src[3])
        for s, d in zip([0, 1, 2, 3], [3, 2, 1, 0]):
            assert np.array_equal(got[d], src[s])
        assert not got[4:7].any()


@pytest.mark.parametrize("per_layer", [1, 2, 4])
async def test_layer_range_changes_only_that_layer(pair: Pair, per_layer: int) -> None:
    desc = CacheDesc(num_tensors=8, data_type=DataType.DT_FLOAT16, shape=[4, 32])
    rid = await pair.peer.register(desc, seed=None)
    cache, arrs = await pair.local_cache(desc, seed=400)
    layers = desc.num_tensors // per_layer
    src_layer, dst_layer = 0, layers - 1
    ext = KvCacheExtParam((src_layer, src_layer), (dst_layer, dst_layer), per_layer)
    await pair.dd.push_kv_blocks(cache, pair.index(rid), [1, 2], [2, 3], ext)
    remote = await pair.peer.read(rid)
    dst_tensors = set(range(dst_layer * per_layer, (dst_layer + 1) * per_layer))
    for t in range(desc.num_tensors):
        got = blocks(remote[t], desc)
        if t in dst_tensors:
            src = blocks(arrs[src_layer * per_layer + t - dst_layer * per_layer], desc)
            assert np.array_equal(got[2:4], src[1:3])
            assert not got[:2].any()
        else:
            assert not got.any(), f"tensor {t} outside the layer changed"


async def test_layer_range_as_python_range(pair: Pair) -> None:
    desc = CacheDesc(num_tensors=6, data_type=DataType.DT_INT8, shape=[2, 64])
    rid = await pair.peer.register(desc, seed=500)
    cache, arrs = await pair.local_cache(desc)
    await pair.dd.pull_kv_cache(pair.index(rid, 1), cache, 0, -1, KvCacheExtParam(range(1, 3), range(0, 2), 2))
    remote = await pair.peer.read(rid)
    for t in range(4):
        assert np.array_equal(blocks(arrs[t], desc)[0], blocks(remote[t + 2], desc)[1])
    assert not arrs[4].any() and not arrs[5].any()


async def test_pull_while_peer_registers_later(pair: Pair) -> None:
    """A cache registered after the link is visible to the peer."""
    rid = await pair.peer.register(DESC, seed=600)
    cache, arrs = await pair.local_cache(DESC)
    await pair.dd.pull_kv_blocks(pair.index(rid), cache, [5], [5])
    assert np.array_equal(blocks(arrs[0], DESC)[5], blocks((await pair.peer.read(rid))[0], DESC)[5])


async def test_unknown_remote_cache_keeps_link_healthy(pair: Pair) -> None:
    cache, arrs = await pair.local_cache(DESC)
    with pytest.raises(LLMKvCacheNotExist) as err:
        await pair.dd.pull_kv_blocks(pair.index(9999), cache, [0], [0])
    assert err.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    rid = await pair.peer.register(DESC, seed=700)
    await pair.dd.pull_kv_blocks(pair.index(rid), cache, [0], [0])
    assert pair.dd.link_info(1).state == "linked"
    assert arrs[0].any()


async def test_unregistered_remote_cache_is_not_exist(pair: Pair) -> None:
    rid = await pair.peer.register(DESC, seed=800)
    cache, _ = await pair.local_cache(DESC)
    await pair.dd.pull_kv_blocks(pair.index(rid), cache, [0], [0])  # cached description now
    await pair.peer.call("unregister", rid)
    with pytest.raises(LLMKvCacheNotExist):
        await pair.dd.pull_kv_blocks(pair.index(rid), cache, [0], [0])
    with pytest.raises(LLMKvCacheNotExist):
        await pair.dd.push_kv_blocks(cache, pair.index(rid), [0], [0])


async def test_not_yet_link(pair: Pair) -> None:
    cache, _ = await pair.local_cache(DESC)
    with pytest.raises(LLMNotYetLink) as err:
        await pair.dd.pull_kv_blocks(CacheIndex(77, 1), cache, [0], [0])
    assert err.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    with pytest.raises(LLMNotYetLink):
        await pair.dd.push_kv_cache(cache, CacheIndex(77, 1))


async def test_local_cache_not_registered(pair: Pair) -> None:
    cache, _ = await pair.local_cache(DESC)
    await pair.dd.unregister_kv_cache(cache.cache_id)
    with pytest.raises(LLMKvCacheNotExist):
        await pair.dd.pull_kv_blocks(pair.index(1), cache, [0], [0])


async def test_64_concurrent_transfers_on_one_link(pair: Pair) -> None:
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[128, 4096])
    rid = await pair.peer.register(desc, seed=900)
    cache, arrs = await pair.local_cache(desc)
    rng = np.random.default_rng(1)
    perm = rng.permutation(128)
    ops = [pair.dd.pull_kv_blocks(pair.index(rid), cache, [int(perm[2 * i]), int(perm[2 * i + 1])],
                                  [2 * i, 2 * i + 1]) for i in range(64)]
    await asyncio.gather(*ops)
    remote = await pair.peer.read(rid)
    for t in range(2):
        got, src = blocks(arrs[t], desc), blocks(remote[t], desc)
        assert np.array_equal(got, src[perm])


async def test_push_from_the_side_that_did_not_link(pair: Pair) -> None:
    """The peer (server side of the link) pushes into and pulls from our cache."""
    cache, arrs = await pair.local_cache(DESC)
    rid = await pair.peer.register(DESC, seed=1100)
    ours = (LOCAL_CLUSTER, cache.cache_id)
    await pair.peer.call("transfer", "push_blocks", rid, ours, [0, 1, 2, 3], [3, 2, 1, 0], None)
    await pair.peer.call("transfer", "push_cache", rid, (*ours, 7), 6, None, None)  # its slot 6 -> our slot 7
    remote = await pair.peer.read(rid)
    for t in range(DESC.num_tensors):
        got, src = blocks(arrs[t], DESC), blocks(remote[t], DESC)
        for s, d in zip([0, 1, 2, 3], [3, 2, 1, 0]):
            assert np.array_equal(got[d], src[s])
        assert np.array_equal(got[7], src[6])
    for t in range(DESC.num_tensors):
        arrs[t][:] = pattern(5000 + t, DESC.tensor_bytes)
    rid2 = await pair.peer.register(DESC, seed=None)
    await pair.peer.call("transfer", "pull_blocks", rid2, ours, [1], [4], None)
    got = await pair.peer.read(rid2)
    assert np.array_equal(blocks(got[0], DESC)[4], blocks(arrs[0], DESC)[1])


BAD_BLOCK_CALLS = [
    pytest.param(([0, 8], [0, 1], None), id="src-block-past-end"),
    pytest.param(([0, 1], [0, 8], None), id="dst-block-past-end"),
    pytest.param(([0, -1], [0, 1], None), id="negative-block"),
    pytest.param(([0, 1, 2], [0, 1], None), id="unequal-lists"),
    pytest.param(([], [], None), id="empty-lists"),
    pytest.param(([0, 1], [2, 2], None), id="duplicate-dst"),
    pytest.param(([0.5], [1], None), id="float-block"),
    pytest.param(([0], [1], KvCacheExtParam((0, 2), (0, 2), 2)), id="layer-past-cache"),
    pytest.param(([0], [1], KvCacheExtParam((0, 0), (0, 1), 2)), id="unequal-layer-spans"),
    pytest.param(([0], [1], KvCacheExtParam((0, 0), (0, 0), 3)), id="per-layer-not-dividing"),
    pytest.param(([0], [1], KvCacheExtParam((1, 0), (1, 0), 2)), id="first-after-last"),
    pytest.param(([0], [1], KvCacheExtParam((0, 0), (0, 0), 0)), id="zero-per-layer"),
]


@pytest.mark.parametrize("args", BAD_BLOCK_CALLS)
async def test_bad_block_arguments_move_no_byte(pair: Pair, args: tuple) -> None:
    src_b, dst_b, ext = args
    rid = await pair.peer.register(DESC, seed=1200)
    cache, arrs = await pair.local_cache(DESC, seed=1300)
    before_local = [a.copy() for a in arrs]
    before_remote = await pair.peer.read(rid)
    with pytest.raises(LLMParamInvalid) as err:
        await pair.dd.pull_kv_blocks(pair.index(rid), cache, src_b, dst_b, ext)
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMParamInvalid):
        await pair.dd.push_kv_blocks(cache, pair.index(rid), src_b, dst_b, ext)
    assert all(np.array_equal(a, b) for a, b in zip(arrs, before_local))
    after_remote = await pair.peer.read(rid)
    assert all(np.array_equal(a, b) for a, b in zip(after_remote, before_remote))


BAD_CACHE_CALLS = [
    pytest.param(dict(src_batch=8, dst_batch=0, size=-1), id="src-batch-past-end"),
    pytest.param(dict(src_batch=0, dst_batch=8, size=-1), id="dst-batch-past-end"),
    pytest.param(dict(src_batch=0, dst_batch=0, size=DESC.stride + 1), id="size-past-slot"),
    pytest.param(dict(src_batch=0, dst_batch=0, size=0), id="size-zero"),
    pytest.param(dict(src_batch=0, dst_batch=0, size=-2), id="size-negative"),
    pytest.param(dict(src_batch=0, dst_batch=0, size=-1, ext=KvCacheExtParam((2, 2), (2, 2), 2)),
                 id="layer-past-cache"),
]


@pytest.mark.parametrize("kw", BAD_CACHE_CALLS)
async def test_bad_cache_arguments_move_no_byte(pair: Pair, kw: dict) -> None:
    rid = await pair.peer.register(DESC, seed=1400)
    cache, arrs = await pair.local_cache(DESC, seed=1500)
    before_local = [a.copy() for a in arrs]
    before_remote = await pair.peer.read(rid)
    ext = kw.get("ext")
    with pytest.raises(LLMParamInvalid):
        await pair.dd.pull_kv_cache(pair.index(rid, kw["src_batch"]), cache, kw["dst_batch"], kw["size"], ext)
    with pytest.raises(LLMParamInvalid):
        await pair.dd.push_kv_cache(cache, pair.index(rid, kw["dst_batch"]), kw["src_batch"], kw["size"], ext)
    assert all(np.array_equal(a, b) for a, b in zip(arrs, before_local))
    assert all(np.array_equal(a, b) for a, b in zip(await pair.peer.read(rid), before_remote))


async def test_block_size_mismatch_is_param_invalid(pair: Pair) -> None:
    rid = await pair.peer.register(CacheDesc(4, DataType.DT_INT32, [8, 32]), seed=1600)
    cache, arrs = await pair.local_cache(DESC)
    with pytest.raises(LLMParamInvalid, match="block sizes differ"):
        await pair.dd.pull_kv_blocks(pair.index(rid), cache, [0], [0])
    assert not any(a.any() for a in arrs)


async def test_blocks_batch_index_must_be_zero(pair: Pair) -> None:
    cache, _ = await pair.local_cache(DESC)
    with pytest.raises(LLMParamInvalid, match="batch_index"):
        await pair.dd.pull_kv_blocks(CacheIndex(1, 1, 3), cache, [0], [0])


async def test_large_scattered_pull_is_exact(pair: Pair) -> None:
    """More runs than one frame or one iovec batch holds; every byte compared."""
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[20000, 256])
    rid = await pair.peer.register(desc, seed=1700)
    cache, arrs = await pair.local_cache(desc)
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(20000), rng.permutation(20000)
    await pair.dd.pull_kv_blocks(pair.index(rid), cache, src, dst, timeout_in_millis=30000)
    remote = await pair.peer.read(rid)
    for t in range(2):
        got = blocks(arrs[t], desc)
        assert np.array_equal(got[dst], blocks(remote[t], desc)[src])
