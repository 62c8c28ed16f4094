"""transfer_cache_async: layer-wise overlapped push between two (three) real processes.

The test process is the prefill side; two spawned peer processes are decode sides that register
caches on request and report their bytes, so every check looks at the destination's memory."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow import (
    CacheDesc,
    CacheIndex,
    CacheTask,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LayerEvents,
    LayerSynchronizer,
    LlmDataDist,
    LLMException,
    LLMFailed,
    LLMKvCacheNotExist,
    LLMParamInvalid,
    LlmRole,
    LLMStatusCode,
    LLMTimeoutError,
    TransferConfig,
    available_transports,
)
from kvflow._proc import PeerProcess, recv_from_parent

S = LLMStatusCode
PREFILL = 1
STRIDE = 512  # bytes per block of one tensor
BLOCKS = 6
WAIT = 10.0  # seconds: the bound on every wait of the test itself


# ---------------------------------------------------------------------- the decode peers
async def _peer_main(conn: Connection) -> None:
    args = conn.recv()
    dd = LlmDataDist(args["cluster"], LlmRole.DECODER)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "kvflow.Transports": args["transports"]})
    conn.send(dd.listen_address)
    caches: dict[int, list[np.ndarray]] = {}
    while True:
        msg = await recv_from_parent(conn)
        if msg == "stop":
            break
        op = msg["op"]
        if op == "register":
            desc = CacheDesc(msg["num_tensors"], DataType.DT_UINT8, [msg["blocks"], STRIDE])
            tensors = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(desc.num_tensors)]
            cache = await dd.register_kv_cache(desc, tensors)
            caches[cache.cache_id] = tensors
            conn.send(cache.cache_id)
        elif op == "read":
            conn.send([t.copy() for t in caches[msg["cache_id"]]])
        elif op == "unregister":
            await dd.unregister_kv_cache(msg["cache_id"])
            caches.pop(msg["cache_id"], None)
            conn.send("ok")
    await dd.finalize()


class Peer:
    def __init__(self, cluster: int, transports: str) -> None:
        self.cluster = cluster
        self.proc = PeerProcess(_peer_main)
        self.proc.send({"cluster": cluster, "transports": transports})
        self.address: tuple[str, int] | None = None

    async def ask(self, msg: Any) -> Any:
        self.proc.send(msg)
        return await self.proc.recv(WAIT)

    async def register(self, num_tensors: int, blocks: int = BLOCKS) -> int:
        return await self.ask({"op": "register", "num_tensors": num_tensors, "blocks": blocks})

    async def read(self, cache_id: int) -> list[np.ndarray]:
        return await self.ask({"op": "read", "cache_id": cache_id})


TRANSPORTS = ["tcp"] + (["shm"] if available_transports().get("shm") == "ok" else [])


@pytest.fixture(scope="module")
def peers() -> Any:
    """Two decode processes per transport, shared by the tests of this module."""
    out: dict[str, list[Peer]] = {}
    for i, t in enumerate(TRANSPORTS):
        out[t] = [Peer(10 + 2 * i, t), Peer(11 + 2 * i, t)]
    try:
        for group in out.values():
            for p in group:
                assert p.proc.conn.poll(60), "peer process did not start"
                p.address = p.proc.conn.recv()
        yield out
    finally:
        for group in out.values():
            for p in group:
                p.proc.stop()


class Prefill:
    """The prefill side of one test: an LlmDataDist linked to the peers, a source cache of
    ``layers`` x ``per_layer`` tensors with non-zero contents."""

    def __init__(self, peers: list[Peer], layers: int = 8, per_layer: int = 2, options: dict[str, str] | None = None,
                 transport: str = "tcp") -> None:
        self.peers = peers
        self.layers, self.per_layer = layers, per_layer
        self.dd = LlmDataDist(PREFILL, LlmRole.PROMPT)
        self.options = {"kvflow.Transports": transport, "llm.SyncKvCacheWaitTime": "5000", **(options or {})}
        rng = np.random.default_rng(layers * 100 + per_layer)
        n = layers * per_layer
        self.src = [rng.integers(1, 256, BLOCKS * STRIDE, dtype=np.uint8) for _ in range(n)]
        self.desc = CacheDesc(n, DataType.DT_UINT8, [BLOCKS, STRIDE])

    async def __aenter__(self) -> Prefill:
        await self.dd.initialize(self.options)
        self.cache = await self.dd.register_kv_cache(self.desc, self.src)
        rets = await self.dd.link_llm_clusters(
            [ClusterInfo(p.cluster, [IpInfo(*p.address)]) for p in self.peers], 5000)
        assert rets == [S.LLM_SUCCESS] * len(self.peers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.dd.finalize()


def blk(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1, STRIDE)


def check_layers(got: list[np.ndarray], src: list[np.ndarray], per_layer: int, layer_map: dict[int, int],
                 block_map: list[tuple[int, int]] | None = None) -> None:
    """Destination layer ``d`` holds source layer ``layer_map[d]`` in the mapped blocks; everything else is 0."""
    for t, arr in enumerate(got):
        want = np.zeros_like(arr)
        d_layer, j = divmod(t, per_layer)
        if d_layer in layer_map:
            s = src[layer_map[d_layer] * per_layer + j]
            if block_map is None:
                want[:] = s
            else:
                for sb, db in block_map:
                    blk(want)[db] = blk(s)[sb]
        if not np.array_equal(arr, want):
            bad = np.flatnonzero(arr != want)
            raise AssertionError(f"destination tensor {t} (layer {d_layer}): {bad.size} bytes differ, "
                                 f"first at {bad[0]}")


async def until(cond: Any, what: str, timeout: float = WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def compute(events: LayerEvents, layers: range, seconds: float) -> threading.Thread:
    """A 'prefill compute' thread that finishes one layer every ``seconds``."""
    def run() -> None:
        for layer in layers:
            time.sleep(seconds)
            events.mark_ready(layer)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


SRC_BLOCKS = [0, 1, 2, 5, 3]
DST_BLOCKS = [4, 5, 0, 1, 3]
BLOCK_MAP = list(zip(SRC_BLOCKS, DST_BLOCKS))
ALL8 = {layer: layer for layer in range(8)}


# ---------------------------------------------------------------------- every byte
@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_byte_of_every_layer_lands(peers: Any, transport: str) -> None:
    peer = peers[transport][0]
    async with Prefill([peer], transport=transport) as pf:
        dst = await peer.register(16)
        events = LayerEvents(8)
        task = pf.dd.transfer_cache_async(pf.cache, events, [TransferConfig(CacheIndex(peer.cluster, dst))],
                                          SRC_BLOCKS, DST_BLOCKS)
        assert isinstance(task, CacheTask) and not task.done()
        th = compute(events, range(8), 0.005)
        async with asyncio.timeout(WAIT):
            await task
        th.join(WAIT)
        assert task.done() and task.get_results() == [S.LLM_SUCCESS]
        assert await task.synchronize() == S.LLM_SUCCESS and task.exception() is None
        assert task.num_layers == task.layers_ready == task.layers_sent == 8
        assert task.config_layers_sent == [8]
        for layer in range(8):
            assert events.ready_at[layer] <= task.layer_ready_at[layer] <= task.layer_sent_at[layer]
        assert task.exposed_seconds is not None and 0 <= task.exposed_seconds < WAIT
        assert pf.dd.link_info(peer.cluster).transport == transport
        check_layers(await peer.read(dst), pf.src, 2, ALL8, BLOCK_MAP)
        stats = pf.dd.stats()  # every send is counted as a push; the exposed time is observed once
        assert stats["layerwise"]["layers"] == 8 and stats["layerwise"]["exposed_seconds"]["count"] == 1
        assert stats["ops"]["push"]["bytes"] == 16 * len(SRC_BLOCKS) * STRIDE


class ThreadEvents(LayerSynchronizer):
    """A blocking synchronizer: waits (on kvflow's worker thread) for a ``threading.Event`` per layer."""

    def __init__(self, layers: int) -> None:
        self.events = [threading.Event() for _ in range(layers)]

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self.events[layer_index].wait(WAIT)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["LayerEvents", "blocking"])
async def test_exposed_seconds_counts_from_readiness_not_from_when_the_loop_saw_it(peers: Any, kind: str) -> None:
    peer = peers["tcp"][0]
    async with Prefill([peer]) as pf:
        dst = await peer.register(16)
        events, blocking = LayerEvents(8), ThreadEvents(8)

        def mark(layer: int) -> None:
            (events.mark_ready if kind == "LayerEvents" else lambda i: blocking.events[i].set())(layer)

        sync: LayerSynchronizer = events if kind == "LayerEvents" else blocking
        task = pf.dd.transfer_cache_async(pf.cache, sync, [TransferConfig(CacheIndex(peer.cluster, dst))],
                                          SRC_BLOCKS, DST_BLOCKS)
        for layer in range(7):
            mark(layer)
        await until(lambda: task.layers_sent == 7, "seven layers sent")
        marked = time.perf_counter()
        mark(7)
        time.sleep(0.05)  # noqa: ASYNC251 - the loop is busy elsewhere: the task cannot see layer 7 before this ends
        async with asyncio.timeout(WAIT):
            await task
        assert task.get_results() == [S.LLM_SUCCESS]
        assert marked <= task.layer_ready_at[7] < marked + 0.02, task.layer_ready_at[7] - marked
        assert task.exposed_seconds is not None and task.exposed_seconds >= 0.05


@pytest.mark.asyncio
async def test_no_layer_is_sent_before_it_is_ready(peers: Any) -> None:
    peer = peers["tcp"][0]
    async with Prefill([peer]) as pf:
        dst = await peer.register(16)
        events = LayerEvents(8)
        task = pf.dd.transfer_cache_async(pf.cache, events, [TransferConfig(CacheIndex(peer.cluster, dst))],
                                          SRC_BLOCKS, DST_BLOCKS)
        for layer in range(4):
            events.mark_ready(layer)
        await until(lambda: task.layers_sent == 4, "layers 0..3 to be sent")
        # the synchronizer holds layer 4: the destination has layers 0..3 and nothing else, and keeps it so
        assert await task.synchronize(timeout_in_millis=50) == S.LLM_TIMEOUT
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 0.05)  # giving up on the task does not cancel it
        assert task.layers_ready == 4 and not task.done() and task.get_results() == [None]
        check_layers(await peer.read(dst), pf.src, 2, {layer: layer for layer in range(4)}, BLOCK_MAP)
        for layer in range(4, 8):
            events.mark_ready(layer)
        assert await task.synchronize(timeout_in_millis=int(WAIT * 1000)) == S.LLM_SUCCESS
        await task
        check_layers(await peer.read(dst), pf.src, 2, ALL8, BLOCK_MAP)


# ---------------------------------------------------------------------- the synchronizer fails
class _BlockingSync(LayerSynchronizer):
    """A plain blocking synchronizer (runs in a thread): ready until ``bad``, then False."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.threads: set[str] = set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.threads.add(threading.current_thread().name)
        time.sleep(0.002)
        return layer_index < self.bad


class _AsyncRaising(LayerSynchronizer):
    def __init__(self, bad: int) -> None:
        self.bad = bad

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(0.001)
        if layer_index == self.bad:
            raise ValueError(f"compute of layer {layer_index} crashed")
        return True


async def _link_still_works(pf: Prefill, peer: Peer) -> None:
    dst = await peer.register(16)
    await pf.dd.push_kv_blocks(pf.cache, CacheIndex(peer.cluster, dst), SRC_BLOCKS, DST_BLOCKS)
    check_layers(await peer.read(dst), pf.src, 2, ALL8, BLOCK_MAP)


@pytest.mark.asyncio
async def test_synchronizer_returning_false(peers: Any) -> None:
    peer = peers["tcp"][0]
    async with Prefill([peer]) as pf:
        dst = await peer.register(16)
        sync = _BlockingSync(bad=3)
        task = pf.dd.transfer_cache_async(pf.cache, sync, [TransferConfig(CacheIndex(peer.cluster, dst))],
                                          SRC_BLOCKS, DST_BLOCKS)
        with pytest.raises(LLMFailed, match="never be ready") as info:
            await asyncio.wait_for(task, WAIT)
        assert info.value.status_code == S.LLM_FAILED
        assert await task.synchronize() == S.LLM_FAILED
        assert task.get_results() == [S.LLM_FAILED] and task.layers_sent == 3
        assert all(name.startswith("kvflow-layer-sync") for name in sync.threads)
        check_layers(await peer.read(dst), pf.src, 2, {0: 0, 1: 1, 2: 2}, BLOCK_MAP)
        await _link_still_works(pf, peer)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["coroutine", "events"])
async def test_synchronizer_raising(peers: Any, kind: str) -> None:
    peer = peers["tcp"][0]
    async with Prefill([peer]) as pf:
        dst = await peer.register(16)
        if kind == "coroutine":
            sync: LayerSynchronizer = _AsyncRaising(bad=2)
        else:
            events = LayerEvents(8)
            sync = events
            events.mark_ready(0)
            events.mark_ready(1)
            threading.Timer(0.02, events.fail, [ValueError("compute of layer 2 crashed")]).start()
        task = pf.dd.transfer_cache_async(pf.cache, sync, [TransferConfig(CacheIndex(peer.cluster, dst))],
                                          SRC_BLOCKS, DST_BLOCKS)
        with pytest.raises(LLMFailed, match="layer 2") as info:
            await asyncio.wait_for(task, WAIT)
        assert isinstance(info.value.__cause__, ValueError)
        assert task.get_results() == [S.LLM_FAILED] and task.layers_sent == 2
        check_layers(await peer.read(dst), pf.src, 2, {0: 0, 1: 1}, BLOCK_MAP)
        await _link_still_works(pf, peer)


class _SlowBlocking(LayerSynchronizer):
    """Blocking: layer 1 takes longer than the task may wait, but honours the timeout it is given."""

    def __init__(self) -> None:
        self.timeouts: list[int | None] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.timeouts.append(timeout_in_millis)
        if layer_index == 1:
            time.sleep(min(2.0, (timeout_in_millis or 0) / 1000 + 0.1))
        return True


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["explicit timeout, LayerEvents", "SyncKvCacheWaitTime per layer, blocking"])
async def test_deadline(peers: Any, how: str) -> None:
    peer = peers["tcp"][0]
    explicit = how.startswith("explicit")
    async with Prefill([peer], options=None if explicit else {"llm.SyncKvCacheWaitTime": "100"}) as pf:
        dst = await peer.register(16)
        cfg = TransferConfig(CacheIndex(peer.cluster, dst), (0, 3), (0, 3))
        t0 = time.perf_counter()
        if explicit:
            events = LayerEvents(8)
            events.mark_ready(0)
            events.mark_ready(1)  # layer 2 never comes
            task = pf.dd.transfer_cache_async(pf.cache, events, [cfg], SRC_BLOCKS, DST_BLOCKS, timeout_in_millis=300)
            assert task.timeout_s == pytest.approx(0.3)
            sent = {0: 0, 1: 1}
        else:
            sync = _SlowBlocking()
            task = pf.dd.transfer_cache_async(pf.cache, sync, [cfg], SRC_BLOCKS, DST_BLOCKS)
            assert task.timeout_s == pytest.approx(0.4)  # 100 ms per layer, 4 layers
            sent = {0: 0}
        with pytest.raises(LLMTimeoutError) as info:
            await asyncio.wait_for(task, WAIT)
        elapsed = time.perf_counter() - t0
        assert isinstance(info.value, TimeoutError) and info.value.status_code == S.LLM_TIMEOUT
        assert task.timeout_s <= elapsed < task.timeout_s + 1.0
        assert task.get_results() == [S.LLM_TIMEOUT]
        if not explicit:
            assert all(t is not None and 0 < t <= 400 for t in sync.timeouts)
            await asyncio.sleep(0.2)  # the synchronizer's thread gives up by itself; nothing more is sent
        check_layers(await peer.read(dst), pf.src, 2, sent, BLOCK_MAP)
        await _link_still_works(pf, peer)


# ---------------------------------------------------------------------- several destinations
@pytest.mark.asyncio
async def test_two_destinations_one_fails_midway(peers: Any) -> None:
    a, b = peers["tcp"]
    async with Prefill([a, b]) as pf:
        dst_a, dst_b = await a.register(16), await b.register(16)
        events = LayerEvents(8)
        configs = [TransferConfig(CacheIndex(a.cluster, dst_a)), TransferConfig(CacheIndex(b.cluster, dst_b))]
        task = pf.dd.transfer_cache_async(pf.cache, events, configs, SRC_BLOCKS, DST_BLOCKS)
        for layer in range(4):
            events.mark_ready(layer)
        await until(lambda: task.layers_sent == 4, "layers 0..3 at both destinations")
        assert await b.ask({"op": "unregister", "cache_id": dst_b}) == "ok"  # b's cache goes away mid-way
        compute(events, range(4, 8), 0.002)
        with pytest.raises(LLMKvCacheNotExist):
            await asyncio.wait_for(task, WAIT)
        assert task.get_results() == [S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST]
        assert task.config_layers_sent == [8, 4] and task.layers_sent == 8
        check_layers(await a.read(dst_a), pf.src, 2, ALL8, BLOCK_MAP)
        await _link_still_works(pf, b)


@pytest.mark.asyncio
async def test_configs_failing_their_remote_checks_get_no_layer(peers: Any) -> None:
    a, _ = peers["tcp"]
    async with Prefill([a]) as pf:
        good, small = await a.register(16), await a.register(8)
        events = LayerEvents(8)
        configs = [
            TransferConfig(CacheIndex(a.cluster, good)),
            TransferConfig(CacheIndex(a.cluster, 999)),  # no such cache
            TransferConfig(CacheIndex(a.cluster, small), (0, 7), (-1, -1)),  # 8 source layers, 4 destination
            TransferConfig(CacheIndex(a.cluster, small), (4, 7), (1, 4)),  # destination layer 4 does not exist
            TransferConfig(CacheIndex(77, 1)),  # not linked
        ]
        task = pf.dd.transfer_cache_async(pf.cache, events, configs, SRC_BLOCKS, DST_BLOCKS)
        compute(events, range(8), 0.001)
        with pytest.raises(LLMException):
            await asyncio.wait_for(task, WAIT)
        assert task.get_results() == [S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST, S.LLM_PARAM_INVALID,
                                      S.LLM_PARAM_INVALID, S.LLM_NOT_YET_LINK]
        assert task.config_layers_sent == [8, 0, 0, 0, 0]
        check_layers(await a.read(good), pf.src, 2, ALL8, BLOCK_MAP)
        check_layers(await a.read(small), pf.src, 2, {}, BLOCK_MAP)


@pytest.mark.asyncio
async def test_cancel_midway(peers: Any) -> None:
    a, b = peers["tcp"]
    async with Prefill([a, b]) as pf:
        dst_a, dst_b = await a.register(16), await b.register(4)
        events = LayerEvents(8)
        configs = [TransferConfig(CacheIndex(a.cluster, dst_a)),
                   TransferConfig(CacheIndex(b.cluster, dst_b), (6, 7), range(0, 2))]
        task = pf.dd.transfer_cache_async(pf.cache, events, configs, SRC_BLOCKS, DST_BLOCKS)
        for layer in range(3):
            events.mark_ready(layer)
        await until(lambda: task.layers_sent == 3, "layers 0..2 to be sent")
        assert task.cancel() is True and task.cancelled()
        assert task.cancel() is False
        with pytest.raises(LLMFailed, match="cancelled") as info:
            await asyncio.wait_for(task, WAIT)
        assert info.value.status_code == S.LLM_FAILED
        assert task.get_results() == [S.LLM_FAILED, None]  # b's layers (6, 7) were never sent
        for layer in range(3, 8):
            events.mark_ready(layer)  # too late: nothing more goes out
        await asyncio.sleep(0.05)
        assert task.layers_sent == 3
        check_layers(await a.read(dst_a), pf.src, 2, {0: 0, 1: 1, 2: 2}, BLOCK_MAP)
        check_layers(await b.read(dst_b), pf.src, 2, {}, BLOCK_MAP)
        await _link_still_works(pf, a)


# ---------------------------------------------------------------------- layouts
@pytest.mark.asyncio
@pytest.mark.parametrize("per_layer", [1, 3, 4, 12])
async def test_any_tensor_num_per_layer(peers: Any, per_layer: int) -> None:
    peer = peers["tcp"][0]
    layers = 12 // per_layer
    async with Prefill([peer], layers=layers, per_layer=per_layer) as pf:
        dst = await peer.register(12)
        events = LayerEvents(layers)
        # whole-slot transfer: source slot 1 into destination slot 4
        task = pf.dd.transfer_cache_async(pf.cache, events, [TransferConfig(CacheIndex(peer.cluster, dst, 4),
                                                                            src_batch_index=1)],
                                          tensor_num_per_layer=per_layer)
        compute(events, range(layers), 0.001)
        await asyncio.wait_for(task, WAIT)
        assert task.num_layers == task.layers_sent == layers
        check_layers(await peer.read(dst), pf.src, per_layer, {i: i for i in range(layers)}, [(1, 4)])
    with pytest.raises(LLMParamInvalid, match="does not divide"):
        async with Prefill([peer], layers=layers, per_layer=per_layer) as pf:
            pf.dd.transfer_cache_async(pf.cache, LayerEvents(12), [TransferConfig(CacheIndex(peer.cluster, dst))],
                                       tensor_num_per_layer=5)


class _Recording(LayerSynchronizer):
    def __init__(self) -> None:
        self.asked: list[int] = []

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        return True


@pytest.mark.asyncio
async def test_src_and_dst_layer_ranges_differ(peers: Any) -> None:
    peer = peers["tcp"][0]
    async with Prefill([peer]) as pf:
        x, y = await peer.register(8, blocks=8), await peer.register(8, blocks=8)  # 4-layer caches, more blocks
        sync = _Recording()
        configs = [TransferConfig(CacheIndex(peer.cluster, x), (2, 5), range(0, 4)),
                   TransferConfig(CacheIndex(peer.cluster, y), range(6, 8), (1, 2))]
        src_blocks, dst_blocks = [5, 4, 0], [7, 0, 3]
        task = pf.dd.transfer_cache_async(pf.cache, sync, configs, src_blocks, dst_blocks)
        await asyncio.wait_for(task, WAIT)
        assert sync.asked == [2, 3, 4, 5, 6, 7]  # layers 0 and 1 nobody needs are not asked for
        assert task.num_layers == 6
        bm = list(zip(src_blocks, dst_blocks))
        check_layers(await peer.read(x), pf.src, 2, {0: 2, 1: 3, 2: 4, 3: 5}, bm)
        check_layers(await peer.read(y), pf.src, 2, {1: 6, 2: 7}, bm)


# ---------------------------------------------------------------------- bad input
@pytest.mark.asyncio
async def test_bad_input_raises_before_anything_happens(peers: Any) -> None:
    peer = peers["tcp"][0]
    async with Prefill([peer]) as pf:
        dst = await peer.register(16)
        ci = CacheIndex(peer.cluster, dst)
        ok = TransferConfig(ci)
        sync = _Recording()
        go = pf.dd.transfer_cache_async
        cases: list[tuple[str, Any]] = [
            ("does not divide", lambda: go(pf.cache, sync, [ok], SRC_BLOCKS, DST_BLOCKS, 5)),
            ("positive int", lambda: go(pf.cache, sync, [ok], SRC_BLOCKS, DST_BLOCKS, 0)),
            (r"transfer_configs\[0\]: src_layer_range", lambda: go(pf.cache, sync, [TransferConfig(ci, (0, 8), (0, 8))],
                                                                   SRC_BLOCKS, DST_BLOCKS)),
            ("spans 4 layers, dst_layer_range 3", lambda: go(pf.cache, sync, [TransferConfig(ci, (0, 3), (0, 2))],
                                                            SRC_BLOCKS, DST_BLOCKS)),
            ("dst_layer_range", lambda: go(pf.cache, sync, [TransferConfig(ci, (0, 3), range(0, 8, 2))],
                                           SRC_BLOCKS, DST_BLOCKS)),
            ("src_blocks: block 6", lambda: go(pf.cache, sync, [ok], [6], [0])),
            ("names a block more than once", lambda: go(pf.cache, sync, [ok], [0, 1], [2, 2])),
            ("entries", lambda: go(pf.cache, sync, [ok], [0, 1], [2])),
            ("give both", lambda: go(pf.cache, sync, [ok], [0, 1], None)),
            ("empty", lambda: go(pf.cache, sync, [], SRC_BLOCKS, DST_BLOCKS)),
            ("list of TransferConfig", lambda: go(pf.cache, sync, ok, SRC_BLOCKS, DST_BLOCKS)),
            ("expected a TransferConfig", lambda: go(pf.cache, sync, [KvCacheExtParam()], SRC_BLOCKS, DST_BLOCKS)),
            ("LayerSynchronizer", lambda: go(pf.cache, object(), [ok], SRC_BLOCKS, DST_BLOCKS)),
            ("batch_index must be 0", lambda: go(pf.cache, sync, [TransferConfig(CacheIndex(peer.cluster, dst, 1))],
                                                 SRC_BLOCKS, DST_BLOCKS)),
            ("src_batch_index must be 0", lambda: go(pf.cache, sync, [TransferConfig(ci, src_batch_index=1)],
                                                     SRC_BLOCKS, DST_BLOCKS)),
            ("src_batch_index", lambda: go(pf.cache, sync, [TransferConfig(ci, src_batch_index=6)])),
            ("LayerEvents has 4 layers", lambda: go(pf.cache, LayerEvents(4), [ok], SRC_BLOCKS, DST_BLOCKS)),
            ("timeout_in_millis", lambda: go(pf.cache, sync, [ok], SRC_BLOCKS, DST_BLOCKS, timeout_in_millis=0)),
        ]
        for match, call in cases:
            with pytest.raises(LLMParamInvalid, match=match):
                call()
        assert sync.asked == []
        check_layers(await peer.read(dst), pf.src, 2, {}, BLOCK_MAP)  # no byte moved
        with pytest.raises(LLMParamInvalid):
            LayerEvents(0)
        with pytest.raises(LLMParamInvalid):
            LayerEvents(2).mark_ready(2)


@pytest.mark.asyncio
async def test_bad_long_block_lists_fail_the_task_before_anything_is_sent(peers: Any) -> None:
    """Block lists longer than 2048 entries are checked in slices as the task starts (the call
    returns at once): a bad one fails the task with LLMParamInvalid for every config, before the
    synchronizer is asked for a layer or a byte moves."""
    peer = peers["tcp"][0]
    n = 3000
    async with Prefill([peer]) as pf:
        dst = await peer.register(16)
        ci = CacheIndex(peer.cluster, dst)
        sync = _Recording()
        cases: list[tuple[str, list[int], list[int]]] = [
            ("src_block_indices: block 6 is outside", [0] * (n - 1) + [6], list(range(n))),
            ("names a block more than once", [0] * n, [*range(n - 1), 0]),
            ("3000 entries, dst_block_indices has 2999", [0] * n, list(range(n - 1))),
        ]
        for match, src_blocks, dst_blocks in cases:
            task = pf.dd.transfer_cache_async(pf.cache, sync, [TransferConfig(ci), TransferConfig(ci, (0, 2))],
                                              src_blocks, dst_blocks)
            with pytest.raises(LLMParamInvalid, match=match):
                await task
            assert task.get_results() == [S.LLM_PARAM_INVALID, S.LLM_PARAM_INVALID]
        assert sync.asked == []
        check_layers(await peer.read(dst), pf.src, 2, {}, BLOCK_MAP)  # no byte moved


@pytest.mark.asyncio
async def test_finalize_stops_a_running_task(peers: Any) -> None:
    peer = peers["tcp"][0]
    pf = Prefill([peer])
    await pf.__aenter__()
    try:
        dst = await peer.register(16)
        events = LayerEvents(8)
        events.mark_ready(0)
        task = pf.dd.transfer_cache_async(pf.cache, events, [TransferConfig(CacheIndex(peer.cluster, dst))],
                                          SRC_BLOCKS, DST_BLOCKS)
        await until(lambda: task.layers_sent == 1, "layer 0 to be sent")
    finally:
        await pf.__aexit__()
    with pytest.raises(LLMFailed, match="finalized"):
        await asyncio.wait_for(task, WAIT)
    assert task.get_results() == [S.LLM_FAILED]


# ---------------------------------------------------------------------- example and benchmark, as a user runs them
ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_example_layerwise_push() -> None:
    r = _run(sys.executable, str(ROOT / "examples" / "layerwise_push.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every byte checked" in r.stdout and "16/16 layers sent" in r.stdout


def test_bench_layerwise_tiny_run(tmp_path: Path) -> None:
    """A tiny run prints and writes one row per compute time and place (a thread, the caller's loop),
    and exits by the documented rule (docs/benchmarks.md): 1 when a row whose per-layer compute is at
    least one layer's transfer misses its target, else 0. A thread row's target is on the exposed
    median (1.5 x one layer alone + 2 ms), a loop row's on the total (compute alone + 1.1 x one layer
    + 1 ms). The 0 ms rows are below any transfer: reported, but they never decide the exit code."""
    out = tmp_path / "lw.json"
    r = subprocess.run([sys.executable, "-m", "kvflow._cli", "bench-layerwise", "--transport", "tcp", "--layers", "16",
                        "--layer-mib", "1", "--compute-ms", "0,2", "--repeat", "1", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 2 (bad arguments) or a crash: wrong either way
    rows = json.loads(out.read_text())["rows"]
    assert [(row["transport"], row["layers"], row["layer_mib"], row["compute_ms"], row["where"]) for row in rows] == [
        ("tcp", 16, 1.0, 0.0, "thread"), ("tcp", 16, 1.0, 2.0, "thread"),
        ("tcp", 16, 1.0, 0.0, "loop"), ("tcp", 16, 1.0, 2.0, "loop")]
    for row in rows:
        assert all(row[k] > 0 for k in ("layer_transfer_ms", "compute_total_ms", "serial_ms", "layerwise_ms",
                                        "exposed_ms")), row
        assert row["exposed_max_ms"] >= row["exposed_ms"]
        if row["where"] == "thread":
            assert row["target_ms"] == pytest.approx(1.5 * row["layer_transfer_ms"] + 2.0)
            assert row["ok"] == (row["exposed_ms"] <= row["target_ms"])
        else:
            assert row["target_ms"] == pytest.approx(row["compute_total_ms"] + 1.1 * row["layer_transfer_ms"] + 1.0)
            assert row["ok"] == (row["layerwise_ms"] <= row["target_ms"])
    gating = [row for row in rows if row["compute_ms"] >= row["layer_transfer_ms"]]
    assert rows[0] not in gating and rows[2] not in gating
    missed = [row for row in gating if not row["ok"]]
    assert r.returncode == (1 if missed else 0), (r.returncode, missed, r.stdout)
    # the printed table has the same rows, with the same verdicts
    table = [[c.strip() for c in line.strip().strip("│").split("│")] for line in r.stdout.splitlines()
             if line.startswith("│")]
    assert [(c[0], c[1], c[2], c[-1]) for c in table] == [
        ("tcp", f"{row['compute_ms']:.2f}", row["where"], "yes" if row["ok"] else "no") for row in rows], r.stdout
