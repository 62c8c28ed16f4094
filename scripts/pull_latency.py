"""4 KiB pull latency of one checkout, for A/B comparisons between commits in alternation.

    PYTHONPATH=<checkout> python scripts/pull_latency.py shm 10000

A child process serves ``kvflow bench``'s 4 KiB-block cache; this process links over the given
transport and times ``pull_kv_blocks`` of one block, ``n`` times after 500 warm-up pulls, then
prints the p50 and p99 in µs. Run two checkouts one after the other, several times, and compare
pairs: a shared machine drifts by more than most changes cost.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from kvflow import CacheIndex, ClusterInfo, IpInfo, LlmDataDist, LlmRole
from kvflow._bench import _caches, _serve
from kvflow._proc import PeerProcess

TOTAL = 4 << 20


async def main(transport: str, n: int) -> None:
    peer = PeerProcess(_serve)
    desc = dict(_caches(TOTAL))["lat"]
    try:
        peer.send({"total": TOTAL, "transports": [transport]})
        info = await peer.recv(60)
        await peer.recv(60)  # the raw baseline's details, unused
        remote = CacheIndex(1, info["caches"]["lat"])
        dd = LlmDataDist(2, LlmRole.DECODER)
        await dd.initialize({"kvflow.Transports": transport})
        cache = await dd.register_kv_cache(desc, [np.zeros(desc.tensor_bytes, np.uint8)])
        ret = await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*info["address"])])], 5000)
        assert ret[0] == 0, ret
        nb = desc.num_blocks
        lat = []
        for i in range(500 + n):
            t0 = time.perf_counter()
            await dd.pull_kv_blocks(remote, cache, [i % nb], [(i * 7) % nb])
            if i >= 500:
                lat.append(time.perf_counter() - t0)
        a = np.array(lat) * 1e6
        print(f"{transport} p50 {np.percentile(a, 50):.2f} p99 {np.percentile(a, 99):.2f}")
        await dd.finalize()
    finally:
        peer.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "shm", int(sys.argv[2]) if len(sys.argv) > 2 else 10000))
