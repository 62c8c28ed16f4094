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
from _bench_pair import bench_pair

from kvflow._run import run


async def main() -> None:
    async with bench_pair("tcp") as (dd, cache, remote, _pid):
        lat = []
        for r in range(300):
            t0 = time.perf_counter()
            await asyncio.gather(*(dd.pull_kv_blocks(remote, cache, [(r + k) % 256], [k]) for k in range(16)))
            lat.append(time.perf_counter() - t0)
        a = np.array(lat[50:]) * 1e6
        print(f"16 concurrent pulls p50 {np.percentile(a, 50):.0f} p99 {np.percentile(a, 99):.0f} us")


if __name__ == "__main__":
    run(main())
