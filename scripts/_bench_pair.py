"""The setup the latency scripts share: a child serving ``kvflow bench``'s 4 KiB-block cache, and
this process registered and linked to it over one transport.

    async with bench_pair("tcp") as (dd, cache, remote, peer_pid):
        await dd.pull_kv_blocks(remote, cache, [0], [0])
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

import numpy as np

from kvflow import Cache, CacheIndex, ClusterInfo, IpInfo, LlmDataDist, LlmRole
from kvflow._bench import _caches, _serve
from kvflow._proc import PeerProcess

TOTAL = 4 << 20


@contextlib.asynccontextmanager
async def bench_pair(transport: str, options: dict[str, Any] | None = None
                     ) -> AsyncIterator[tuple[LlmDataDist, Cache, CacheIndex, int]]:
    """This side's ``LlmDataDist`` (``options`` go to its ``initialize``), its registered cache, the
    peer's cache and the peer's pid; finalized and the child stopped on the way out."""
    peer = PeerProcess(_serve)
    desc = dict(_caches(TOTAL))["lat"]
    try:
        peer.send({"total": TOTAL, "transports": [transport]})
        info = await peer.recv(60)
        await peer.recv(60)  # the raw baseline's details, unused
        remote = CacheIndex(1, info["caches"]["lat"])
        dd = LlmDataDist(2, LlmRole.DECODER)
        await dd.initialize({"kvflow.Transports": transport, **(options or {})})
        try:
            cache = await dd.register_kv_cache(desc, [np.zeros(desc.tensor_bytes, np.uint8)])
            ret = await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*info["address"])])], 5000)
            assert ret[0] == 0, ret
            yield dd, cache, remote, peer.pid
        finally:
            await dd.finalize()
    finally:
        peer.stop()


ROW_BLOCKS = {"16k": "16 KiB", "256k": "256 KiB", "4m": "4 MiB"}


@contextlib.asynccontextmanager
async def row_pair(transport: str, block: str, op: str, options: dict[str, str]
                   ) -> AsyncIterator[tuple[LlmDataDist, PeerProcess, Any]]:
    """One ``kvflow bench`` throughput row's setup: the child serving the bench's 1 GiB caches (with
    ``options`` too), this side linked to it, and the row's transfer warmed up once. Yields this
    side's ``LlmDataDist``, the child, and ``move(warm)``, which awaits the row's whole transfer."""
    from kvflow import _bench as b

    total = 1 << 30
    peer = PeerProcess(_serve)
    try:
        peer.send({"total": total, "transports": [transport], "options": options})  # both sides
        info = await peer.recv(60)
        await peer.recv(60)
        buf = np.zeros(total, dtype=np.uint8)
        dd = LlmDataDist(2, LlmRole.DECODER)
        await dd.initialize({"kvflow.Transports": transport, **options})
        try:
            name = ROW_BLOCKS[block]
            desc = dict(_caches(total))[name]
            local = await dd.register_kv_cache(desc, [buf])
            ret = await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*info["address"])])], 5000)
            assert ret[0] == 0, ret
            ci = CacheIndex(1, info["caches"][name])
            blocks = b._block_lists(desc, desc.stride == b.BLOCK_SIZES[0])

            def move(warm: bool = False) -> Any:
                return b._kv_throughput(dd, ci, local, desc, op, blocks, 1, warm=warm)

            await move(True)  # warm-up
            yield dd, peer, move
        finally:
            await dd.finalize()
    finally:
        peer.stop()
