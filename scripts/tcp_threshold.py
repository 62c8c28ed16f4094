"""Latency of single tcp pulls of 256 KiB to 16 MiB, for choosing ``kvflow.tcp.ThreadBytes``.

    python scripts/tcp_threshold.py 0          # every payload on the event loop
    python scripts/tcp_threshold.py 1048576    # payloads of 1 MiB and more on worker threads

A child process serves ``kvflow bench``'s 1 GiB caches; this process pulls 1 and 4 blocks of
256 KiB and of 4 MiB, 230 times each, and prints the p50 of the last 200 in µs. Run several values
one after the other, several times: the machine drifts more than most thresholds differ.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvflow import CacheIndex, ClusterInfo, IpInfo, LlmDataDist, LlmRole
from kvflow import _bench as b
from kvflow._proc import PeerProcess
from kvflow._run import run


async def main(thread_bytes: str) -> None:
    total = 1 << 30
    peer = PeerProcess(b._serve)
    try:
        peer.send({"total": total, "transports": ["tcp"]})
        info = await peer.recv(60)
        await peer.recv(60)
        buf = np.zeros(total, dtype=np.uint8)
        dd = LlmDataDist(2, LlmRole.DECODER)
        await dd.initialize({"kvflow.Transports": "tcp", "kvflow.tcp.ThreadBytes": thread_bytes})
        caches = dict(b._caches(total))
        assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*info["address"])])], 5000) == [0]
        out = []
        for name, nblk in (("256 KiB", 1), ("256 KiB", 4), ("4 MiB", 1), ("4 MiB", 4)):
            desc = caches[name]
            local = await dd.register_kv_cache(desc, [buf])
            ci = CacheIndex(1, info["caches"][name])
            times = []
            for i in range(230):
                blocks = [(i * 4 + k) % desc.num_blocks for k in range(nblk)]
                t0 = time.perf_counter()
                await dd.pull_kv_blocks(ci, local, blocks, blocks)
                times.append(time.perf_counter() - t0)
            out.append(f"{nblk} x {name}: p50 {np.percentile(np.array(times[30:]) * 1e6, 50):.0f} us")
            await dd.unregister_kv_cache(local.cache_id)
        print(f"ThreadBytes={thread_bytes}: " + ", ".join(out), flush=True)
        await dd.finalize()
    finally:
        peer.stop()


if __name__ == "__main__":
    run(main(sys.argv[1]))
