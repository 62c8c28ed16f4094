"""In-process A/B of the engine's small-transfer path (``TransferEngine.blocks_now`` and the
metrics counting it calls): a commit's version against this checkout's, on one link.

    python scripts/ab_engine.py 64b8d11 shm 40 [push]

A child serves ``kvflow bench``'s 4 KiB-block cache over the given transport; this process moves
one block at a time, switching implementation every 2000 transfers (the commit's ``_engine.py``
and ``Metrics.count`` are loaded from git beside this checkout's), and prints the median of each
block's median in µs and how often the commit's block was the slower one. Separate runs drift more
on a shared host than this path costs; alternating inside one process cancels that drift.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import types

import numpy as np
import uvloop
from _bench_pair import bench_pair

from kvflow._engine import PULL, PUSH

BLOCK = 2000  # transfers per block


def _module_at(rev: str, mod: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:kvflow/{mod}.py"], capture_output=True, text=True,
                         check=True).stdout
    m = types.ModuleType(f"kvflow.{mod}_ab")
    m.__package__ = "kvflow"
    exec(compile(src, f"{rev}:{mod}", "exec"), m.__dict__)
    return m


async def main(rev: str, transport: str, rounds: int, op: str) -> None:
    old_eng, old_met = _module_at(rev, "_engine"), _module_at(rev, "_metrics")
    async with bench_pair(transport) as (dd, cache, remote, _pid):
        eng = dd._engine
        for i in range(500):
            await dd.pull_kv_blocks(remote, cache, [i % 256], [i % 256])
        fns = {rev: old_eng.TransferEngine.blocks_now, "tree": type(eng).blocks_now}
        d = PULL if op == "pull" else PUSH
        res: dict[str, list[float]] = {rev: [], "tree": []}
        for r in range(rounds):
            for name in ((rev, "tree") if r % 2 else ("tree", rev)):
                if name == rev:
                    eng.metrics.count = types.MethodType(old_met.Metrics.count, eng.metrics)  # type: ignore[method-assign]
                else:
                    eng.metrics.__dict__.pop("count", None)
                fn = fns[name]
                lat = []
                for i in range(BLOCK):
                    if eng.turns.owed():
                        await asyncio.sleep(0)
                    t0 = time.perf_counter()
                    r = fn(eng, d, remote, cache, [i % 256], [(i * 7) % 256], None, False)
                    if r is False:
                        raise RuntimeError("blocks_now declined: the A/B needs its fast path")
                    if r is not True:  # begun, not finished inside the call (tcp's reply came late)
                        await r
                    lat.append(time.perf_counter() - t0)
                res[name].append(float(np.median(lat)) * 1e6)
        eng.metrics.__dict__.pop("count", None)
        for k, v in res.items():
            a = np.array(v)
            print(f"{k} {op}: median of block medians {np.median(a):.3f} us, min {a.min():.3f}")
        diff = np.array(res[rev]) - np.array(res["tree"])
        print(f"{rev} - tree per block: median {np.median(diff):.3f} us, >0 in {int((diff > 0).sum())}/{len(diff)}")


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "pull"))
