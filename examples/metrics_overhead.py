"""What kvflow's counters cost a transfer, measured two ways on this machine.

1. In-process: ``LlmDataDist._transfer`` (counting, tracing check) around a transfer that does
   nothing, against the same call without the wrapper: the per-transfer overhead alone.
2. End to end: the 4 KiB pull latency loop of ``kvflow bench`` (tcp, two processes), in rounds of
   one run with the counters on and one with them off (which goes first alternates), same tree.

    python examples/metrics_overhead.py [rounds]
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from kvflow import CacheIndex, LlmDataDist
from kvflow._bench import run_bench
from kvflow._run import run
from kvflow.transport import RunBatch


def in_process(n: int = 200_000) -> tuple[float, float]:
    batch = RunBatch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.full(1, 4096, np.uint64),
                     np.zeros(1, np.int64), np.zeros(1, np.int64), None, None)  # type: ignore[arg-type]

    class Fake(LlmDataDist):
        async def _transfer_once(self, *args):  # type: ignore[override]
            return "tcp", batch

    dd, ci = Fake(2), CacheIndex(1, 1)

    async def loop() -> tuple[float, float]:
        best = {}
        for name in ("counted", "bare"):
            fn = dd._transfer if name == "counted" else dd._transfer_once
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    await fn("pull", ci, None, None, None, None)
                times.append((time.perf_counter() - t0) / n * 1e6)
            best[name] = min(times)
        return best["counted"], best["bare"]

    return asyncio.run(loop())


async def _bare(self: LlmDataDist, *args: object) -> None:
    await self._transfer_once(*args)


def end_to_end(rounds: int) -> dict[str, list[tuple[float, float]]]:
    counted = LlmDataDist._transfer
    res: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for i in range(rounds):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):  # alternate which goes first
            LlmDataDist._transfer = counted if mode == "on" else _bare  # type: ignore[method-assign]
            rows = run(run_bench(["tcp"], 4 << 20, 1, lat_iters=5000))
            p = {r.op: r.kvflow for r in rows if r.unit == "us"}
            res[mode].append((p["4 KiB pull p50"], p["4 KiB pull p99"]))
            print(f"  metrics {mode:3}: p50 {res[mode][-1][0]:6.1f} us  p99 {res[mode][-1][1]:6.1f} us", flush=True)
    LlmDataDist._transfer = counted  # type: ignore[method-assign]
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
