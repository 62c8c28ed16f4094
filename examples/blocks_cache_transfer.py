"""The blocks cache transmission scenario of LLM-DataDist's KV cache management guide, as two processes.

Both sides register a paged KV cache (``shape[0]`` = number of blocks). The prefill side has
computed a request into blocks [0, 1, 2, 3]; decode pulls them into its blocks [3, 2, 1, 0] with
``pull_kv_blocks``. Then prefill pushes one layer of blocks with ``push_kv_blocks``. Errors are
handled as in the guide's example. Run: ``python examples/blocks_cache_transfer.py``.
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
    LLMKvCacheNotExist,
    LlmRole,
)
from kvflow._proc import PeerProcess, recv_from_parent

PROMPT_CLUSTER_ID, DECODE_CLUSTER_ID = 1, 2
NUM_TENSORS = 4  # 2 layers x (K, V)
DESC = CacheDesc(num_tensors=NUM_TENSORS, data_type=DataType.DT_INT32, shape=[8, 16])  # 8 blocks of 16 ints
PROMPT_BLOCKS = [0, 1, 2, 3]
DECODER_BLOCKS = [3, 2, 1, 0]


def block_value(tensor: int, block: int) -> int:
    return 100 * tensor + block + 1


async def prefill(conn: Connection) -> None:
    dd = LlmDataDist(PROMPT_CLUSTER_ID, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": "5000"})
    tensors = [np.zeros((8, 16), dtype=np.int32) for _ in range(NUM_TENSORS)]
    for t in range(NUM_TENSORS):
        for b in PROMPT_BLOCKS:
            tensors[t][b] = block_value(t, b)  # the request's KV, as inference left it
    cache_id = -1
    try:
        cache = await dd.register_kv_cache(DESC, tensors)
        cache_id = cache.cache_id
        conn.send((dd.listen_address, cache_id))
        decode_cache_id = await recv_from_parent(conn)
        # Push layer 1 (tensors 2, 3) of blocks [0, 1] into decode's blocks [6, 7].
        ext = KvCacheExtParam(src_layer_range=(1, 1), dst_layer_range=(1, 1), tensor_num_per_layer=2)
        await dd.push_kv_blocks(cache, CacheIndex(DECODE_CLUSTER_ID, decode_cache_id), [0, 1], [6, 7], ext)
        conn.send("pushed")
        await recv_from_parent(conn)
    except LLMException as exc:
        print(f"[ERROR] prefill failed, ret = {exc.status_code:#x} ({exc})", file=sys.stderr)
        conn.send("failed")
    finally:
        if cache_id > 0:
            await dd.unregister_kv_cache(cache_id)
        await dd.finalize()


async def decode() -> int:
    peer = PeerProcess(prefill)
    dd = LlmDataDist(DECODE_CLUSTER_ID, LlmRole.DECODER)
    await dd.initialize({"llm.SyncKvCacheWaitTime": "5000"})
    cache_id = -1
    try:
        (ip, port), prompt_cache_id = await peer.recv()
        tensors = [np.zeros((8, 16), dtype=np.int32) for _ in range(NUM_TENSORS)]
        cache = await dd.register_kv_cache(DESC, tensors)
        cache_id = cache.cache_id
        rets = await dd.link_llm_clusters([ClusterInfo(PROMPT_CLUSTER_ID, [IpInfo(ip, port)])], 1000)
        if rets[0] != kvflow.LLMStatusCode.LLM_SUCCESS:
            print(f"[ERROR] link failed, ret = {rets[0]:#x}", file=sys.stderr)
            return 1
        await dd.pull_kv_blocks(CacheIndex(PROMPT_CLUSTER_ID, prompt_cache_id), cache, PROMPT_BLOCKS, DECODER_BLOCKS)
        for t in range(NUM_TENSORS):
            for s, d in zip(PROMPT_BLOCKS, DECODER_BLOCKS):
                assert (tensors[t][d] == block_value(t, s)).all(), f"tensor {t} block {d}"
            assert not tensors[t][4:].any(), "blocks outside the list changed"
        # A cache the prompt side never registered: LLM_KV_CACHE_NOT_EXIST, and the link stays usable.
        try:
            await dd.pull_kv_blocks(CacheIndex(PROMPT_CLUSTER_ID, prompt_cache_id + 100), cache, [0], [0])
        except LLMKvCacheNotExist as exc:
            print(f"expected: {exc}")
        peer.send(cache_id)
        assert await peer.recv() == "pushed"
        for t in range(NUM_TENSORS):
            for s, d in zip([0, 1], [6, 7]):
                want = block_value(t, s) if t >= 2 else 0
                assert (tensors[t][d] == want).all(), f"tensor {t} block {d} after the layer-1 push"
        peer.send("done")
        await dd.unlink_llm_clusters([ClusterInfo(PROMPT_CLUSTER_ID, [IpInfo(ip, port)])])
    except LLMException as exc:
        print(f"[ERROR] decode failed, ret = {exc.status_code:#x} ({exc})", file=sys.stderr)
        return 1
    finally:
        peer.stop()
        if cache_id > 0:
            await dd.unregister_kv_cache(cache_id)
        await dd.finalize()
    print("blocks cache transfer: pull_kv_blocks [0,1,2,3] -> [3,2,1,0] and push_kv_blocks OK, every byte checked")
    return 0


if __name__ == "__main__":
    sys.exit(kvflow.run(decode()))
