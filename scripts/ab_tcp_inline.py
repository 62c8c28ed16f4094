"""In-process A/B of tcp's inline small exchange (``TcpChannel.now_rows``): another checkout's
version against this one, in alternating blocks of 200 transfers on one link.

    python scripts/ab_tcp_inline.py /tmp/base 30 [push]

``/tmp/base`` is a checkout (``git worktree add /tmp/base <commit>``) whose ``kvflow/_tcp.py``
``now_rows`` still works on this checkout's channel. A child serves ``kvflow bench``'s 4 KiB-block
cache; this process pulls (or pushes) one block at a time, switching implementation every 200
transfers, and prints p50 and p99 in µs for each (the first pair of blocks is warm-up). Run
separately, two checkouts differ by more from one minute to the next on a shared host than most
changes to this path cost; alternating inside one process cancels that drift. Only the calling
side's code changes; the serving side is this checkout's.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
from _bench_pair import bench_pair

import kvflow._tcp as tcp
from kvflow._run import run

BLOCK = 200


def _base_now_rows(checkout: str) -> object:
    spec = importlib.util.spec_from_file_location("kvflow._tcp_base", Path(checkout) / "kvflow" / "_tcp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "kvflow"  # its relative imports resolve to this checkout's modules
    spec.loader.exec_module(mod)
    return mod.TcpChannel.now_rows


async def main(checkout: str, blocks: int, push: bool) -> None:
    impls = {"base": _base_now_rows(checkout), "this": tcp.TcpChannel.now_rows}
    async with bench_pair("tcp") as (dd, cache, remote, _pid):
        nb = cache.cache_desc.num_blocks
        times: dict[str, list[float]] = {name: [] for name in impls}
        i = 0
        for b in range(blocks):
            order = list(impls) if b % 2 == 0 else list(impls)[::-1]
            for name in order:
                tcp.TcpChannel.now_rows = impls[name]  # type: ignore[method-assign]
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    if push:
                        await dd.push_kv_blocks(cache, remote, [(i * 7) % nb], [i % nb])
                    else:
                        await dd.pull_kv_blocks(remote, cache, [i % nb], [(i * 7) % nb])
                    if b > 0:
                        times[name].append(time.perf_counter() - t0)
                    i += 1
        tcp.TcpChannel.now_rows = impls["this"]  # type: ignore[method-assign]
        for name, v in times.items():
            a = np.array(v) * 1e6
            print(f"{name} {'push' if push else 'pull'} n={a.size} "
                  f"p50 {np.percentile(a, 50):.2f} p99 {np.percentile(a, 99):.2f}")


if __name__ == "__main__":
    run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30, "push" in sys.argv[3:]))
