"""4 KiB pull latency of one checkout, for A/B comparisons between commits in alternation.

    PYTHONPATH=<checkout> python scripts/pull_latency.py shm 10000 [push] [kvflow.Option=value ...]

A child process serves ``kvflow bench``'s 4 KiB-block cache; this process links over the given
transport and times ``pull_kv_blocks`` of one block, ``n`` times after 500 warm-up pulls, then
prints the p50 and p99 in µs (``push``: ``push_kv_blocks`` instead). Options given as
``key=value`` go to this side's ``initialize``; the serving side keeps the defaults. It runs on
uvloop, as ``kvflow bench`` does. ``every=MS``: instead, one transfer every MS milliseconds
for 3 s, and the CPU both processes spent meanwhile (what polling costs at that rate).

Run two checkouts one after the other, several times, and compare pairs: a shared machine
drifts by more than most changes cost.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np
from _bench_pair import bench_pair

from kvflow import Cache, CacheIndex, LlmDataDist
from kvflow._run import run

OPTS = dict(a.split("=", 1) for a in sys.argv[3:] if "=" in a)  # kvflow options of this side
PUSH = "push" in sys.argv[3:]
EVERY_MS = float(OPTS.pop("every", 0))


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(transport: str, n: int) -> None:
    async with bench_pair(transport, OPTS) as (dd, cache, remote, peer_pid):
        nb = cache.cache_desc.num_blocks
        if EVERY_MS:
            await _every(dd, remote, cache, nb, peer_pid, transport)
            return
        lat = []
        for i in range(500 + n):
            t0 = time.perf_counter()
            if PUSH:
                await dd.push_kv_blocks(cache, remote, [(i * 7) % nb], [i % nb])
            else:
                await dd.pull_kv_blocks(remote, cache, [i % nb], [(i * 7) % nb])
            if i >= 500:
                lat.append(time.perf_counter() - t0)
        a = np.array(lat) * 1e6
        print(f"{transport} {'push' if PUSH else 'pull'} p50 {np.percentile(a, 50):.2f} p99 {np.percentile(a, 99):.2f}")


async def _every(dd: LlmDataDist, remote: CacheIndex, cache: Cache, nb: int, peer_pid: int,
                 transport: str) -> None:
    for i in range(200):
        await dd.pull_kv_blocks(remote, cache, [i % nb], [i % nb])
    await asyncio.sleep(0.5)
    mine, theirs, t0 = _cpu_s(os.getpid()), _cpu_s(peer_pid), time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 3:
        if PUSH:
            await dd.push_kv_blocks(cache, remote, [n % nb], [n % nb])
        else:
            await dd.pull_kv_blocks(remote, cache, [n % nb], [n % nb])
        n += 1
        await asyncio.sleep(EVERY_MS / 1000)
    dt = time.perf_counter() - t0
    here, there = 100 * (_cpu_s(os.getpid()) - mine) / dt, 100 * (_cpu_s(peer_pid) - theirs) / dt
    print(f"{transport} {n / dt:.0f} {'pushes' if PUSH else 'pulls'}/s: this side {here:.1f} % of a core, "
          f"serving side {there:.1f} %")


if __name__ == "__main__":
    run(main(sys.argv[1] if len(sys.argv) > 1 else "shm", int(sys.argv[2]) if len(sys.argv) > 2 else 10000))
