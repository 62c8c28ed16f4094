"""Layer-wise overlapped push: prefill pushes each layer's KV while it computes the next one.

The prefill process "computes" a request layer by layer on a compute thread (it writes the layer's
K and V blocks, then sleeps as if the accelerator were busy) and marks each layer ready on a
``LayerEvents``. ``transfer_cache_async`` sends every layer as soon as it is ready, so when the last
layer is computed only that layer is left to send. The decode process (this one) linked to prefill,
told it where the request goes in its paged cache, and checks every byte afterwards.
Run: ``python examples/layerwise_push.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from multiprocessing.connection import Connection

import numpy as np

import kvflow
from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LayerEvents,
    LlmDataDist,
    LLMException,
    LlmRole,
    TransferConfig,
)
from kvflow._proc import PeerProcess, recv_from_parent

PREFILL_CLUSTER_ID, DECODE_CLUSTER_ID = 1, 2
LAYERS = 16
BLOCK = (16, 4, 64)  # tokens per block, KV heads, head dim (fp16)
NUM_BLOCKS = 48
DESC = CacheDesc(num_tensors=2 * LAYERS, data_type=DataType.DT_FLOAT16, shape=[NUM_BLOCKS, *BLOCK])
PROMPT_BLOCKS = list(range(3, 23))  # the request on prefill: 20 blocks = 320 tokens
COMPUTE_SECONDS = 0.004  # per layer


def layer_kv(tensor: int, blocks: int) -> np.ndarray:
    """What prefill computes for one tensor (K or V of a layer) of the request: deterministic."""
    rng = np.random.default_rng(tensor)
    return rng.standard_normal((blocks, *BLOCK)).astype(np.float16)


def new_cache() -> list[np.ndarray]:
    return [np.zeros((NUM_BLOCKS, *BLOCK), dtype=np.float16) for _ in range(DESC.num_tensors)]


async def prefill(conn: Connection) -> None:
    dd = LlmDataDist(PREFILL_CLUSTER_ID, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": "5000"})
    tensors = new_cache()
    try:
        cache = await dd.register_kv_cache(DESC, tensors)
        conn.send(dd.listen_address)
        msg = await recv_from_parent(conn)  # decode has linked: its cache and block table for the request
        events = LayerEvents(LAYERS)

        def compute() -> None:  # the model's forward pass, one layer after another
            for layer in range(LAYERS):
                time.sleep(COMPUTE_SECONDS)  # the accelerator is busy; the host is not
                for t in (2 * layer, 2 * layer + 1):  # K and V of this layer land in the paged cache
                    tensors[t][PROMPT_BLOCKS] = layer_kv(t, len(PROMPT_BLOCKS))
                events.mark_ready(layer)

        task = dd.transfer_cache_async(cache, events, [TransferConfig(CacheIndex(DECODE_CLUSTER_ID, msg["cache_id"]))],
                                       src_block_indices=PROMPT_BLOCKS, dst_block_indices=msg["blocks"])
        t0 = time.perf_counter()
        threading.Thread(target=compute, daemon=True).start()
        try:
            await task  # typed error of the first failure, if any
        finally:
            names = [None if r is None else r.name for r in task.get_results()]
            print(f"prefill: {task.layers_sent}/{task.num_layers} layers sent, results {names}")
        last_ready, last_sent = events.ready_at[LAYERS - 1], max(task.layer_sent_at.values())
        conn.send({"compute_ms": (last_ready - t0) * 1e3, "total_ms": (last_sent - t0) * 1e3})
        await recv_from_parent(conn)
    except LLMException as exc:
        print(f"[ERROR] prefill failed, ret = {exc.status_code:#x} ({exc})", file=sys.stderr)
        conn.send({"failed": str(exc)})
    finally:
        await dd.finalize()


async def decode() -> int:
    peer = PeerProcess(prefill)
    dd = LlmDataDist(DECODE_CLUSTER_ID, LlmRole.DECODER)
    await dd.initialize({"llm.SyncKvCacheWaitTime": "5000"})
    try:
        ip, port = await peer.recv()
        tensors = new_cache()
        cache = await dd.register_kv_cache(DESC, tensors)
        rets = await dd.link_llm_clusters([ClusterInfo(PREFILL_CLUSTER_ID, [IpInfo(ip, port)])], 1000)
        if rets[0] != kvflow.LLMStatusCode.LLM_SUCCESS:
            print(f"[ERROR] link failed, ret = {rets[0]:#x}", file=sys.stderr)
            return 1
        blocks = np.random.default_rng(0).permutation(NUM_BLOCKS)[: len(PROMPT_BLOCKS)].tolist()  # free blocks
        peer.send({"cache_id": cache.cache_id, "blocks": blocks})
        res = await peer.recv(60)
        if "failed" in res:
            return 1
        checked = 0
        for t, arr in enumerate(tensors):
            want = layer_kv(t, len(blocks))
            assert np.array_equal(arr[blocks].view(np.uint16), want.view(np.uint16)), f"tensor {t} differs"
            others = np.setdiff1d(np.arange(NUM_BLOCKS), blocks)
            assert not arr[others].view(np.uint16).any(), f"tensor {t}: a block outside the table changed"
            checked += arr.nbytes
        await dd.unlink_llm_clusters([ClusterInfo(PREFILL_CLUSTER_ID, [IpInfo(ip, port)])])
        peer.send("done")
        print(f"layer-wise push of {LAYERS} layers: last layer computed at {res['compute_ms']:.1f} ms, last byte "
              f"acknowledged at {res['total_ms']:.1f} ms; every byte checked ({checked:,} bytes)")
    except LLMException as exc:
        print(f"[ERROR] decode failed, ret = {exc.status_code:#x} ({exc})", file=sys.stderr)
        return 1
    finally:
        peer.stop()
        await dd.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(kvflow.run(decode()))
