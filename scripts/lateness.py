"""Loop lateness of one ``kvflow bench`` throughput row, several tries, for A/B comparisons.

    python scripts/lateness.py shm 16k pull 3 [kvflow.WorkerPriority=normal ...]
    CALLBACKS=1 python scripts/lateness.py tcp 4m push 3   # also list kvflow's longest callbacks
    FD=1 python scripts/lateness.py tcp 4m push 3          # ticked by a timerfd (kvflow._ticker.FdTicker)

A child process serves the bench's 1 GiB caches; this process links over the given transport and
moves every block (16k: 16 KiB blocks in shuffled order; 256k, 4m: in order) with a 1 ms ticker on
both loops, as ``kvflow bench`` does, printing GiB/s and the worst / p99 lateness (ms) of each side,
then the idle loop's floor. With ``CALLBACKS=1`` the loop is asyncio's (instrumented: each
callback's wall and thread CPU time), not uvloop. Options after the tries go to both sides'
``initialize``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from _bench_pair import ROW_BLOCKS, row_pair

from kvflow import _bench as b
from kvflow._run import run

BLOCKS = ROW_BLOCKS
_ACTIVE = [False]
FD = bool(os.environ.get("FD"))  # the timerfd ticker instead of the sleeping one


async def main(transport: str, block: str, op: str, tries: int, opts: dict[str, str]) -> None:
    async with row_pair(transport, block, op, opts) as (_, peer, move):
        for _ in range(tries):
            _ACTIVE[0] = True
            gib, mine, theirs = await b._ticked(peer, move, fd=FD)
            _ACTIVE[0] = False
            print(f"{transport} {op} {BLOCKS[block]}: {gib:.2f} GiB/s  late (ms) this side {mine['worst_ms']:.2f} / "
                  f"{mine['p99_ms']:.2f}  peer {theirs['worst_ms']:.2f} / {theirs['p99_ms']:.2f}", flush=True)
        idle = await b.idle_lateness(1.0, fd=FD)
        print(f"idle loop floor: {idle['worst_ms']:.2f} / {idle['p99_ms']:.2f} ms")


def _where(handle: asyncio.Handle) -> str:
    task = getattr(getattr(handle, "_callback", None), "__self__", None)
    if task is not None and hasattr(task, "get_coro"):
        chain = []  # the task's await chain, innermost last (where the callback left off)
        coro: Any = task.get_coro()
        while coro is not None and hasattr(coro, "cr_frame"):
            frame = coro.cr_frame
            chain.append(f"{coro.__qualname__}:{frame.f_lineno if frame else '-'}")
            coro = coro.cr_await
        return " > ".join(chain[-3:])
    return repr(handle)[:120]


def instrumented(coro: Any) -> None:
    """Run ``coro`` on asyncio's loop, then print the longest callbacks of the ticked transfers."""
    recs: list[tuple[float, float, str]] = []
    orig = asyncio.Handle._run

    def timed(handle: asyncio.Handle) -> None:
        if not _ACTIVE[0]:
            orig(handle)
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            orig(handle)
        finally:
            wall = time.perf_counter() - t0
            if wall > 2e-4:
                recs.append((wall, time.thread_time() - c0, _where(handle)))

    asyncio.Handle._run = timed  # type: ignore[method-assign,assignment]
    asyncio.run(coro)
    for wall, cpu, where in sorted(recs, reverse=True)[:10]:
        print(f"callback: wall {wall * 1e3:.2f} ms, cpu {cpu * 1e3:.2f} ms, {where}")


if __name__ == "__main__":
    args = sys.argv[1:]
    job = main(args[0], args[1], args[2], int(args[3]), dict(a.split("=", 1) for a in args[4:]))
    if os.environ.get("CALLBACKS"):
        instrumented(job)
    else:
        run(job)
