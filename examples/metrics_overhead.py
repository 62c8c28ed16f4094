"""What kvflow's counters cost a transfer, measured two ways on this machine.

1. In-process: the counting a transfer does (``Metrics.start_span``, two clock reads,
   ``Metrics.done``) against the same loop without it: the per-transfer overhead alone.
2. End to end: the 4 KiB pull latency loop of ``kvflow bench`` (tcp, two processes), in rounds of
   one run with the counters on and one with them off (which goes first alternates), same tree.

    python examples/metrics_overhead.py [rounds]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from kvflow._bench import run_bench
from kvflow._metrics import Metrics
from kvflow._metrics import now as metrics_now
from kvflow._run import run
from kvflow.transport import RunBatch


def in_process(n: int = 200_000) -> tuple[float, float]:
    """Best of 3 of µs per call: (counted, bare)."""
    batch = RunBatch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.full(1, 4096, np.uint64),
                     np.zeros(1, np.int64), np.zeros(1, np.int64), None, None)  # type: ignore[arg-type]
    m = Metrics(2)

    def counted() -> None:
        span = m.start_span("pull", 1, 1)
        t0 = metrics_now()
        m.done("pull", 1, "tcp", batch, metrics_now() - t0, span)

    def bare() -> None:
        pass

    best = {}
    for name, fn in (("counted", counted), ("bare", bare)):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n * 1e6)
        best[name] = min(times)
    return best["counted"], best["bare"]


def end_to_end(rounds: int) -> dict[str, list[tuple[float, float]]]:
    saved = (Metrics.start_span, Metrics.done)

    def off(self: Metrics, *args: Any) -> None:
        return None

    res: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for i in range(rounds):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):  # alternate which goes first
            Metrics.start_span, Metrics.done = saved if mode == "on" else (off, off)  # type: ignore[assignment]
            rows = run(run_bench(["tcp"], 4 << 20, 1, lat_iters=5000))
            p = {r.op: r.kvflow for r in rows if r.unit == "us"}
            res[mode].append((p["4 KiB pull p50"], p["4 KiB pull p99"]))
            print(f"  metrics {mode:3}: p50 {res[mode][-1][0]:6.1f} us  p99 {res[mode][-1][1]:6.1f} us", flush=True)
    Metrics.start_span, Metrics.done = saved  # type: ignore[method-assign]
    return res


if __name__ == "__main__":
    counted, bare = in_process()
    print(f"in-process: {counted:.2f} us per counted call, {bare:.2f} us bare: {counted - bare:.2f} us of counting")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(f"end to end, tcp 4 KiB pull latency, {rounds} alternating rounds:")
    res = end_to_end(rounds)
    for mode, v in res.items():
        a = np.array(v)
        print(f"metrics {mode:3}: median p50 {np.median(a[:, 0]):.1f} us, median p99 {np.median(a[:, 1]):.1f} us")
