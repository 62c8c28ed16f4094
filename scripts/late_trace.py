"""Where a loop's late ticks go: one ``kvflow bench`` row under ``perf``'s scheduler trace.

    python scripts/late_trace.py tcp 256k push 3 [THRESHOLD_MS] [kvflow.tcp.NativePump=0 ...]

Runs the row as ``scripts/lateness.py`` does (a child process serves the bench's 1 GiB caches; this
process moves every block, 3 tries, with the timerfd ticker on both loops; options after the tries
go to ``initialize``), while
``perf record -a -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_waking`` traces both cores.
For every tick of this side's loop later than THRESHOLD_MS (default 0.3), the time from its expiry
to its reader callback is cut by what the loop thread was doing, from the trace:

- ``timer not delivered``: the thread still slept in epoll; nothing woke it (on a VM, the vCPU did
  not run or the interrupt came late; split by whether the trace shows the core idle meanwhile);
- ``waiting for a core, behind X``: woken, runnable, the cores busy with X (this process's worker
  threads, the peer process, a kernel thread, ...);
- ``blocked after waking, woken by X``: it ran, then slept again before the tick's callback (the
  GIL or a lock), until X woke it;
- ``running``: on a core (the loop's own callbacks, Python).

Needs ``perf`` and the right to trace the scheduler on all cores (root, or
``kernel.perf_event_paranoid`` at -1). Only this side's ticks are traced (its loop thread's id is the
process id).
"""

from __future__ import annotations

import asyncio
import bisect
import os
import re
import signal
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

from _bench_pair import ROW_BLOCKS, row_pair

from kvflow._run import run
from kvflow._ticker import FdTicker


class _Recording(FdTicker):
    """The timerfd ticker, keeping each late tick's expiry and callback time (CLOCK_MONOTONIC)."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.ticks: list[tuple[float, float]] = []

    def _on_tick(self) -> None:
        now = time.clock_gettime(time.CLOCK_MONOTONIC)
        before = self._expired
        super()._on_tick()
        for k in range(before + 1, self._expired + 1):
            due = self._t0 + k * self.period
            if now - due > self.threshold:
                self.ticks.append((due, now))


async def _row(transport: str, block: str, op: str, tries: int, threshold: float,
               opts: dict[str, str]) -> tuple[list[Any], int]:
    """Run the row's tries under the trace; the late ticks and the trace as text, and the peer's pid."""
    late: list[tuple[float, float]] = []
    async with row_pair(transport, block, op, opts) as (_, peer, move):
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "sched.data")
            perf = await asyncio.create_subprocess_exec(
                "perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-e", "sched:sched_switch",
                "-e", "sched:sched_waking", "-o", data, stdout=asyncio.subprocess.DEVNULL)
            await asyncio.sleep(0.5)  # perf's start
            for _ in range(tries):
                ticker = _Recording(threshold)
                peer.send("tick fd")
                ticker.start()
                gib = await move()
                mine = await ticker.stop()
                peer.send("tock")
                theirs = await peer.recv(60)
                late += ticker.ticks
                print(f"{transport} {op} {ROW_BLOCKS[block]}: {gib:.2f} GiB/s  late (ms) this side "
                      f"{mine['worst_ms']:.2f} / {mine['p99_ms']:.2f}  peer {theirs['worst_ms']:.2f} / "
                      f"{theirs['p99_ms']:.2f}", flush=True)
            perf.send_signal(signal.SIGINT)
            await asyncio.wait_for(perf.wait(), 60)
            dump = await asyncio.create_subprocess_exec(
                "perf", "script", "-i", data, "-F", "pid,tid,cpu,time,event,trace",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
            script = (await asyncio.wait_for(dump.communicate(), 120))[0].decode()
        return [late, script], peer.proc.pid or 0


_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
_SWITCH = re.compile(r"prev_comm=(.*?) prev_pid=(\d+) .*prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")
_WAKE = re.compile(r"comm=(.*?) pid=(\d+) ")


def _events(script: str) -> tuple[list[float], list[tuple[Any, ...]], dict[int, int], dict[int, str]]:
    """The trace as (time, kind, cpu, current tid, data) in time order, each tid's process, names."""
    times, evs, proc, names = [], [], {}, {}
    for line in script.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        pid, tid, cpu, t, kind, rest = int(m[1]), int(m[2]), int(m[3]), float(m[4]), m[5], m[6]
        proc[tid] = pid
        if kind == "sched_switch":
            s = _SWITCH.search(rest)
            if s is None:
                continue
            names[int(s[2])], names[int(s[5])] = s[1], s[4]
            evs.append((t, "switch", cpu, tid, (int(s[2]), s[3], int(s[5]))))
        elif kind == "sched_waking":
            w = _WAKE.search(rest)
            if w is None:
                continue
            names[int(w[2])] = w[1]
            evs.append((t, "wake", cpu, tid, int(w[2])))
        else:
            continue
        times.append(t)
    order = sorted(range(len(times)), key=times.__getitem__)
    return [times[i] for i in order], [evs[i] for i in order], proc, names


def _who(tid: int, me: int, peer: int, proc: dict[int, int], names: dict[int, str]) -> str:
    if tid == 0:
        return "an idle core"
    owner = proc.get(tid)
    if owner == me:
        return "this process's threads"
    if owner == peer:
        return "the peer process"
    name = re.sub(r"[/:]\d+.*$|-\d+$", "", names.get(tid, "?"))
    return f"other: {name}"


def attribute(late: list[tuple[float, float]], script: str, me: int, peer: int) -> dict[str, float]:
    """Seconds of lateness by cause, summed over the late ticks (see the module's docstring)."""
    times, evs, proc, names = _events(script)
    out: dict[str, float] = defaultdict(float)
    ncpu = 1 + max((e[2] for e in evs), default=0)

    def who(tid: int) -> str:
        return _who(tid, me, peer, proc, names)

    for due, ran in late:
        on_cpu = [0] * ncpu  # each core's task, replayed from 50 ms before the tick
        state, ran_since, blocked = "sleep", False, 0.0
        t_prev = due
        for k in range(bisect.bisect_left(times, due - 0.05), bisect.bisect_right(times, ran)):
            t, kind, cpu, cur, data = evs[k]
            if t > t_prev >= due or (t > due > t_prev):
                dt, t_prev = t - max(t_prev, due), t
                if state == "running":
                    out["running"] += dt
                elif state == "runnable":
                    for tid in on_cpu:  # the cores' time, shared between what held them
                        out[f"waiting for a core, behind {who(tid)}"] += dt / ncpu
                elif state == "blocked":
                    blocked += dt
                else:
                    out["timer not delivered, " + ("cores idle" if not any(on_cpu) else "cores busy")] += dt
            t_prev = max(t_prev, t)
            if kind == "switch":
                prev, prev_state, nxt = data
                on_cpu[cpu] = nxt
                if prev == me:
                    state = "runnable" if prev_state.startswith("R") else ("blocked" if ran_since else "sleep")
                if nxt == me:
                    state = "running"
                    ran_since = ran_since or t >= due
            elif data == me:
                if state == "blocked" and blocked:
                    out[f"blocked after waking, woken by {who(cur)}"] += blocked
                    blocked = 0.0
                state = "runnable"
        tail = ran - max(t_prev, due)
        if state == "running":
            out["running"] += tail
        elif tail > 0:
            out[f"{state} at the callback (trace ends)"] += tail
        if blocked:
            out["blocked after waking, not woken in the trace"] += blocked
    return out


def main() -> None:
    transport, block, op, tries = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rest = sys.argv[5:]
    opts = dict(a.split("=", 1) for a in rest if "=" in a)
    threshold = next((float(a) / 1e3 for a in rest if "=" not in a), 0.3e-3)
    (late, script), peer = run(_row(transport, block, op, tries, threshold, opts))
    causes = attribute(late, script, os.getpid(), peer)
    total = sum(n - d for d, n in late)
    print(f"{len(late)} ticks later than {threshold * 1e3:.2f} ms, {total * 1e3:.2f} ms of lateness in all:")
    for cause, secs in sorted(causes.items(), key=lambda kv: -kv[1]):
        print(f"  {secs * 1e3:8.2f} ms  {100 * secs / total if total else 0:5.1f} %  {cause}")


if __name__ == "__main__":
    main()
