"""16 concurrent one-block pulls on one tcp link, timed per round: what serialising small transfers costs.

    PYTHONPATH=<checkout> python scripts/gather_latency.py

A child process serves ``kvflow bench``'s 4 KiB-block cache; this process starts 16 one-block
``pull_kv_blocks`` at once with ``asyncio.gather``, 300 rounds, and prints the p50 and p99 of a
round after 50 warm-up rounds. Run two checkouts in alternation, as with scripts/pull_latency.py.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from kvflow import CacheIndex, ClusterInfo, IpInfo, LlmDataDist, LlmRole
from kvflow._bench import _caches, _serve
from kvflow._proc import PeerProcess
from kvflow._run import run

TOTAL = 4 << 20


async def main() -> None:
    peer = PeerProcess(_serve)
    desc = dict(_caches(TOTAL))["lat"]
    try:
        peer.send({"total": TOTAL, "transports": ["tcp"]})
        info = await peer.recv(60)
        await peer.recv(60)  # the raw baseline's details, unused
        remote = CacheIndex(1, info["caches"]["lat"])
        dd = LlmDataDist(2, LlmRole.DECODER)
        await dd.initialize({"kvflow.Transports": "tcp"})
        cache = await dd.register_kv_cache(desc, [np.zeros(desc.tensor_bytes, np.uint8)])
        await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*info["address"])])], 5000)
        lat = []
        for r in range(300):
            t0 = time.perf_counter()
            await asyncio.gather(*(dd.pull_kv_blocks(remote, cache, [(r + k) % 256], [k]) for k in range(16)))
            lat.append(time.perf_counter() - t0)
        a = np.array(lat[50:]) * 1e6
        print(f"16 concurrent pulls p50 {np.percentile(a, 50):.0f} p99 {np.percentile(a, 99):.0f} us")
        await dd.finalize()
    finally:
        peer.stop()


if __name__ == "__main__":
    run(main())
