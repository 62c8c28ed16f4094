"""The typical cache transmission scenario of LLM-DataDist's KV cache management guide, as two processes.

Prefill (cluster 1) registers a cache and listens; decode (cluster 2) registers its own, links,
pulls a whole batch slot with ``pull_kv_cache``; then prefill pushes layer 0 into decode with
``push_kv_cache`` (the transfer that the guide overlaps with computing the next layer). Both sides
handle errors as the guide's example does: on failure, unregister and finalize.
Run: ``python examples/typical_cache_transfer.py``.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

import numpy as np

import kvflow
from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmDataDist,
    LLMException,
    LlmRole,
)
from kvflow._proc import PeerProcess, recv_from_parent

PROMPT_CLUSTER_ID, DECODE_CLUSTER_ID = 1, 2
NUM_TENSORS = 4
DESC = CacheDesc(num_tensors=NUM_TENSORS, data_type=DataType.DT_INT32, shape=[8, 16])


async def on_error(dd: LlmDataDist, cache_id: int) -> None:
    """The guide's OnError: unregister what was registered, then finalize."""
    if cache_id > 0:
        await dd.unregister_kv_cache(cache_id)
    await dd.finalize()


async def prefill(conn: Connection) -> None:
    dd = LlmDataDist(PROMPT_CLUSTER_ID, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": "5000"})
    tensors = [np.arange(8 * 16, dtype=np.int32) + 1000 * t for t in range(NUM_TENSORS)]  # "inference results"
    cache_id = -1
    try:
        cache = await dd.register_kv_cache(DESC, tensors)
        cache_id = cache.cache_id
        conn.send((dd.listen_address, cache_id))
        decode_cache_id = await recv_from_parent(conn)  # decode has pulled and tells us where to push
        ext = KvCacheExtParam(src_layer_range=(0, 0), dst_layer_range=(0, 0), tensor_num_per_layer=2)
        await dd.push_kv_cache(cache, CacheIndex(DECODE_CLUSTER_ID, decode_cache_id, 0), 0, -1, ext)
        conn.send("pushed")
        await recv_from_parent(conn)
    except LLMException as exc:
        print(f"[ERROR] prefill failed, ret = {exc.status_code:#x} ({exc})", file=sys.stderr)
        conn.send("failed")
        await on_error(dd, cache_id)
        return
    await dd.unregister_kv_cache(cache_id)
    await dd.finalize()


async def decode() -> int:
    peer = PeerProcess(prefill)
    dd = LlmDataDist(DECODE_CLUSTER_ID, LlmRole.DECODER)
    await dd.initialize({"llm.SyncKvCacheWaitTime": "5000"})
    cache_id = -1
    try:
        (ip, port), prompt_cache_id = await peer.recv()
        tensors = [np.zeros(8 * 16, dtype=np.int32) for _ in range(NUM_TENSORS)]
        cache = await dd.register_kv_cache(DESC, tensors)
        cache_id = cache.cache_id
        rets = await dd.link_llm_clusters([ClusterInfo(PROMPT_CLUSTER_ID, [IpInfo(ip, port)])], 1000)
        if rets[0] != kvflow.LLMStatusCode.LLM_SUCCESS:
            print(f"[ERROR] link failed, ret = {rets[0]:#x}", file=sys.stderr)
            await on_error(dd, cache_id)
            return 1
        # Pull batch slot 0 of the prompt cache into our slot 0.
        await dd.pull_kv_cache(CacheIndex(PROMPT_CLUSTER_ID, prompt_cache_id, 0), cache, 0)
        for t in range(NUM_TENSORS):
            assert np.array_equal(tensors[t][:16], np.arange(16, dtype=np.int32) + 1000 * t), "pulled bytes differ"
            assert not tensors[t][16:].any(), "bytes outside slot 0 changed"
        # Prefill pushes layer 0 (tensors 0 and 1), batch slot 0, into our slot 0 again: zero it first.
        for t in tensors:
            t[:] = 0
        peer.send(cache_id)
        assert await peer.recv() == "pushed"
        for t in range(NUM_TENSORS):
            want = np.arange(16, dtype=np.int32) + 1000 * t if t < 2 else np.zeros(16, np.int32)
            assert np.array_equal(tensors[t][:16], want), f"tensor {t} after the layer-0 push"
        peer.send("done")
        await dd.unlink_llm_clusters([ClusterInfo(PROMPT_CLUSTER_ID, [IpInfo(ip, port)])])
    except LLMException as exc:
        print(f"[ERROR] decode failed, ret = {exc.status_code:#x} ({exc})", file=sys.stderr)
        await on_error(dd, cache_id)
        return 1
    finally:
        peer.stop()
    await dd.unregister_kv_cache(cache_id)
    await dd.finalize()
    print("typical cache transfer: pull_kv_cache and push_kv_cache OK, every byte checked")
    return 0


if __name__ == "__main__":
    sys.exit(kvflow.run(decode()))
