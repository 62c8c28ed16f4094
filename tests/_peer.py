"""A command-driven peer process for the API tests: it owns an LlmDataDist and does what the test asks."""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvflow import CacheDesc, CacheIndex, DataType, KvCacheExtParam, LlmDataDist, LLMException, LlmRole
from kvflow._proc import recv_from_parent

PEER_CLUSTER = 1


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for one tensor."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


async def peer_main(conn: Connection) -> None:
    options = conn.recv()
    dd = LlmDataDist(PEER_CLUSTER, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", **options})
    buffers: dict[int, list[np.ndarray]] = {}
    conn.send(dd.listen_address)
    while True:
        msg = await recv_from_parent(conn)
        if msg == "stop":
            break
        op, args = msg
        try:
            result = await _do(dd, buffers, op, *args)
            conn.send(("ok", result))
        except LLMException as exc:
            conn.send(("err", exc))
        except Exception:
            conn.send(("crash", traceback.format_exc()))
    await dd.finalize()


async def _do(dd: LlmDataDist, buffers: dict[int, list[np.ndarray]], op: str, *args: Any) -> Any:
    if op == "register":
        num_tensors, dtype, shape, seed = args
        desc = CacheDesc(num_tensors, DataType(dtype), list(shape))
        arrs = [pattern(seed + t, desc.tensor_bytes) if seed is not None
                else np.zeros(desc.tensor_bytes, np.uint8) for t in range(num_tensors)]
        cache = await dd.register_kv_cache(desc, arrs)
        buffers[cache.cache_id] = arrs
        return cache.cache_id
    if op == "read":
        return [a.copy() for a in buffers[args[0]]]
    if op == "unregister":
        await dd.unregister_kv_cache(args[0])
        buffers.pop(args[0], None)
        return None
    if op in ("push_blocks", "pull_blocks", "push_cache", "pull_cache"):
        cache_id, cluster, remote_id, a, b, ext = args
        local = next(c for c in [_cache(dd, cache_id)])
        ext_p = KvCacheExtParam(*ext) if ext else None
        if op == "push_blocks":
            await dd.push_kv_blocks(local, CacheIndex(cluster, remote_id), a, b, ext_p)
        elif op == "pull_blocks":
            await dd.pull_kv_blocks(CacheIndex(cluster, remote_id), local, a, b, ext_p)
        elif op == "push_cache":
            await dd.push_kv_cache(local, CacheIndex(cluster, remote_id, b), a, -1, ext_p)
        else:
            await dd.pull_kv_cache(CacheIndex(cluster, remote_id, a), local, b, -1, ext_p)
        return None
    if op == "links":
        return {cid: dd.link_info(cid).state for cid in list(dd._links)}
    raise ValueError(f"unknown op {op}")


def _cache(dd: LlmDataDist, cache_id: int):
    return dd._registry.get(cache_id).cache
