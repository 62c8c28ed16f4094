"""How often each side's loop thread wakes from ``epoll`` during one ``kvflow bench`` throughput row.

    python scripts/loop_wakes.py tcp 16k pull 2 [kvflow.tcp.Threads=1 ...]
    TIMES=1 python scripts/loop_wakes.py tcp 16k pull 1     # also each wake-up's time (ms into the transfer)

Same setup as scripts/lateness.py, but no ticker: ``perf record`` traces the ``epoll_wait`` /
``epoll_pwait`` syscalls of both loop threads (this process's and the serving child's main thread)
during the transfer, and a call that returned more than 50 µs after it was entered counts as one
wake-up of a sleeping loop (a timer's too; a call preempted for that long would count as well).
On uvloop every such wake-up between two ticks can make a 1 ms ``asyncio.sleep`` ticker fire up to
1 ms late (docs/decisions.md, "Two tickers"): the sleeping ticker's p99 largely follows this count.
Needs ``perf`` and tracepoint access (perf_event_paranoid).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from _bench_pair import row_pair

from kvflow._run import run

EVENTS = ",".join(f"syscalls:sys_{edge}_{call}" for call in ("epoll_wait", "epoll_pwait") for edge in ("enter", "exit"))
SLEPT_S = 50e-6


def wakeups(path: str, t0: float, t1: float) -> list[float]:
    """Times (ms after ``t0``) at which a traced epoll call that slept returned, within [t0, t1]."""
    out = subprocess.run(["perf", "script", "-i", path, "-F", "time,event"], capture_output=True, text=True,
                         check=True).stdout
    entered: float | None = None
    times = []
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+):\s+(\S+)", line)
        if m is None:
            continue
        t, event = float(m.group(1)), m.group(2)
        if "enter" in event:
            entered = t
        elif entered is not None:
            if t - entered > SLEPT_S and t0 <= t <= t1:
                times.append(round((t - t0) * 1e3, 1))
            entered = None
    return times


async def main(transport: str, block: str, op: str, tries: int, opts: dict[str, str]) -> None:
    if shutil.which("perf") is None:
        sys.exit("loop_wakes.py needs perf (linux-perf)")
    async with row_pair(transport, block, op, opts) as (_, peer, move):
        for _ in range(tries):
            with tempfile.TemporaryDirectory() as tmp:
                paths = [os.path.join(tmp, f"{side}.data") for side in ("this", "peer")]
                perfs = []
                try:
                    for path, tid in zip(paths, (os.getpid(), peer.pid)):
                        perfs.append(await asyncio.create_subprocess_exec(
                            "perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-o", path, "-e", EVENTS, "-t", str(tid),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    await asyncio.sleep(0.5)  # perf's start, as in scripts/late_trace.py
                    if any(p.returncode is not None for p in perfs):
                        sys.exit("perf record exited early (tracepoints need perf_event_paranoid <= 1 or root)")
                    t0 = time.monotonic()
                    await move()
                    t1 = time.monotonic()
                finally:
                    for p in perfs:
                        with contextlib.suppress(ProcessLookupError):
                            p.send_signal(signal.SIGINT)  # perf writes its file out
                    for p in perfs:
                        await asyncio.wait_for(p.wait(), 60)
                mine, theirs = (wakeups(path, t0, t1) for path in paths)
            print(f"{transport} {op} {block}: {(t1 - t0) * 1e3:.0f} ms, wake-ups this side {len(mine)}, "
                  f"peer {len(theirs)}", flush=True)
            if os.environ.get("TIMES"):
                print(f"  this side at {mine}\n  peer at {theirs}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    run(main(args[0], args[1], args[2], int(args[3]), dict(a.split("=", 1) for a in args[4:])))
