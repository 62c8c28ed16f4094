"""``kvflow demo``: a prefill and a decode process move a realistic KV cache and check every byte."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ._datadist import LlmDataDist
from ._proc import PeerProcess, recv_from_parent
from ._types import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmRole

PREFILL, DECODE = 1, 2
DTYPES = {"fp16": (DataType.DT_FLOAT16, np.float16), "bf16": (DataType.DT_BF16, np.uint16),
          "fp32": (DataType.DT_FLOAT, np.float32)}


@dataclass
class Shape:
    """The model's KV layout: ``layers`` x (K, V) tensors of [blocks, block_tokens, kv_heads, head_dim]."""

    layers: int = 32
    block_tokens: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    prompt_tokens: int = 4096
    dtype: str = "fp16"

    @property
    def prompt_blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_tokens)

    @property
    def num_blocks(self) -> int:
        return 2 * self.prompt_blocks + 8  # room for two requests

    def desc(self) -> CacheDesc:
        return CacheDesc(2 * self.layers, DTYPES[self.dtype][0],
                         [self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim])

    @property
    def block_bytes(self) -> int:
        return self.desc().stride

    @property
    def request_bytes(self) -> int:
        return self.prompt_blocks * self.block_bytes * 2 * self.layers


def _alloc(shape: Shape) -> list[np.ndarray]:
    d = shape.desc()
    out = [np.empty(d.tensor_bytes, dtype=np.uint8) for _ in range(d.num_tensors)]
    for a in out:
        a.fill(0)  # touch every page now, as a serving engine's preallocated cache is
    return out


def _fill(tensors: list[np.ndarray], shape: Shape, blocks: np.ndarray, seed: int) -> None:
    """Deterministic contents for ``blocks`` of every tensor (what 'prefill computed')."""
    bb = shape.block_bytes
    for t, arr in enumerate(tensors):
        rng = np.random.default_rng((seed, t))
        data = rng.integers(0, 256, size=(blocks.size, bb), dtype=np.uint8)
        arr.reshape(-1, bb)[blocks] = data


async def _prefill(conn: Connection) -> None:
    args = conn.recv()
    shape: Shape = args["shape"]
    tensors = _alloc(shape)
    dd = LlmDataDist(PREFILL, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "kvflow.Transports": args["transport"],
                         "llm.SyncKvCacheWaitTime": "30000"})
    cache = await dd.register_kv_cache(shape.desc(), tensors)
    conn.send({"address": dd.listen_address, "cache_id": cache.cache_id})
    msg = await recv_from_parent(conn)  # decode has linked and says where to push
    if msg != "stop":
        src = np.asarray(msg["src_blocks"])
        dst = np.asarray(msg["dst_blocks"])
        # "compute" both requests off the event loop, which must keep answering heartbeats
        await asyncio.to_thread(_fill, tensors, shape, src, 1)
        await asyncio.to_thread(_fill, tensors, shape, np.asarray(msg["pull_blocks"]), 2)
        dst_index = CacheIndex(DECODE, msg["cache_id"])
        conn.send({"filled": True})
        await recv_from_parent(conn)
        for layer in range(shape.layers):
            t0 = time.perf_counter()
            await dd.push_kv_blocks(cache, dst_index, src, dst, KvCacheExtParam((layer, layer), (layer, layer), 2))
            conn.send({"layer": layer, "seconds": time.perf_counter() - t0})
        conn.send({"done": True, "transport": dd.link_info(DECODE).transport})
        await recv_from_parent(conn)
    await dd.finalize()


async def run_demo(shape: Shape, transport: str, progress: Any = None) -> dict[str, Any]:
    """Run both sides; returns the figures (raises if any byte differs).

    ``progress(step, done, total)`` is called with ``done == 0`` as a step ("push", "pull") starts,
    then as it advances. A step's seconds run from its first request to its last acknowledged byte;
    ``setup_seconds`` (process start, memory, link, filling both requests) is in neither."""
    t_setup = time.perf_counter()
    peer = PeerProcess(_prefill)
    try:
        peer.send({"shape": shape, "transport": transport})
        hello = await peer.recv(60)
        tensors = _alloc(shape)
        dd = LlmDataDist(DECODE, LlmRole.DECODER)
        await dd.initialize({"kvflow.Transports": transport, "llm.SyncKvCacheWaitTime": "30000"})
        cache = await dd.register_kv_cache(shape.desc(), tensors)
        ret = await dd.link_llm_clusters([ClusterInfo(PREFILL, [IpInfo(*hello["address"])])], 5000)
        if ret[0] != 0:
            raise RuntimeError(f"link failed: {ret[0].name}")
        n = shape.prompt_blocks
        rng = np.random.default_rng(7)
        p_src = rng.permutation(shape.num_blocks)[:n]  # prefill's block table for request 1
        d_dst = rng.permutation(shape.num_blocks)[:n]  # decode's block table for request 1
        p_pull = np.setdiff1d(np.arange(shape.num_blocks), p_src)[:n]  # request 2 on prefill
        d_pull = np.setdiff1d(np.arange(shape.num_blocks), d_dst)[:n]  # free blocks on decode
        peer.send({"cache_id": cache.cache_id, "src_blocks": p_src.tolist(), "dst_blocks": d_dst.tolist(),
                   "pull_blocks": p_pull.tolist()})
        await peer.recv(120)  # prefill has "computed" (filled) both requests
        t0 = time.perf_counter()
        setup_s = t0 - t_setup
        if progress:
            progress("push", 0, shape.layers)
        peer.send("go")
        layer_times = []
        while True:
            msg = await peer.recv(120)
            if "layer" in msg:
                layer_times.append(msg["seconds"])
                if progress:
                    progress("push", msg["layer"] + 1, shape.layers)
            else:
                break
        push_s = time.perf_counter() - t0
        used = dd.link_info(PREFILL).transport
        if progress:
            progress("pull", 0, 1)
        t1 = time.perf_counter()
        await dd.pull_kv_blocks(CacheIndex(PREFILL, hello["cache_id"]), cache, p_pull, d_pull,
                                timeout_in_millis=60_000)
        pull_s = time.perf_counter() - t1
        if progress:
            progress("pull", 1, 1)
        await dd.unlink_llm_clusters([ClusterInfo(PREFILL, [IpInfo(*hello["address"])])])
        bad = await asyncio.to_thread(_verify, tensors, shape, d_dst, d_pull)
        peer.send("stop")
        await dd.finalize()
        if bad:
            raise AssertionError(f"{bad} bytes differ after the transfer")
        lat = np.array(layer_times) * 1e3
        return {
            "transport": used,
            "request_bytes": shape.request_bytes,
            "push_seconds": push_s,
            "push_gib_s": shape.request_bytes / push_s / (1 << 30),
            "layer_push_ms_p50": float(np.percentile(lat, 50)),
            "layer_push_ms_p99": float(np.percentile(lat, 99)),
            "pull_seconds": pull_s,
            "pull_gib_s": shape.request_bytes / pull_s / (1 << 30),
            "bytes_checked": 2 * shape.request_bytes,
            "setup_seconds": setup_s,
        }
    finally:
        peer.stop()


def _verify(tensors: list[np.ndarray], shape: Shape, d_dst: np.ndarray, d_pull: np.ndarray) -> int:
    """Bytes that differ from what prefill wrote (both requests), plus any byte written elsewhere."""
    bb = shape.block_bytes
    bad = 0
    for seed, dst in ((1, d_dst), (2, d_pull)):
        for t, arr in enumerate(tensors):
            rng = np.random.default_rng((seed, t))
            want = rng.integers(0, 256, size=(dst.size, bb), dtype=np.uint8)
            bad += int(np.count_nonzero(arr.reshape(-1, bb)[dst] != want))
    untouched = np.setdiff1d(np.arange(shape.num_blocks), np.concatenate([d_dst, d_pull]))
    for arr in tensors:
        bad += int(np.count_nonzero(arr.reshape(-1, bb)[untouched]))
    return bad
