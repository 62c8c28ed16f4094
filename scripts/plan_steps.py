"""The planner's steps and batch tables for the loop-hold test's largest plan, in CPU time per step.

    PYTHONPATH=<checkout> python scripts/plan_steps.py

Plans 100k scattered blocks of 16 bytes over 64 tensors (6.4M runs, the largest case of
tests/test_loop_hold.py) three times with ``kvflow._plan``'s steps, timing each step in
``time.thread_time``, and prints, per place a step ends, how many there were and their p50 and
longest. Then it times ``Plan.columns`` for the batch tables of 16384 and of 8192 runs. One process,
no transfer: what the planner itself costs the loop, without the transport's callbacks around it.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from kvflow import CacheDesc, DataType
from kvflow._plan import Plan, Steps, _blocks_steps, run_steps

BLOCKS, TENSORS = 100_000, 64


def _inputs() -> tuple[CacheDesc, np.ndarray, list[int], list[int], np.ndarray]:
    desc = CacheDesc(num_tensors=TENSORS, data_type=DataType.DT_UINT8, shape=[BLOCKS, 16])
    addrs = np.arange(TENSORS, dtype=np.uint64) * (1 << 24) + (1 << 30)
    perm = np.random.default_rng(3).permutation(BLOCKS).tolist()
    return desc, addrs, perm, list(range(BLOCKS)), np.arange(TENSORS, dtype=np.int64)


def _steps() -> Steps:
    desc, addrs, perm, ident, tensors = _inputs()
    return _blocks_steps(desc, addrs, desc, addrs, perm, ident, tensors, tensors, False)


def time_steps() -> None:
    steps = _steps()
    per_place: dict[tuple[str, int], list[float]] = defaultdict(list)
    item = next(steps)
    try:
        while True:
            t0 = time.thread_time()
            result = item[0](item[1]) if item is not None else None
            item = steps.send(result)
            spent = time.thread_time() - t0
            inner = steps
            while inner.gi_yieldfrom is not None:  # the innermost generator: where the step ended
                inner = inner.gi_yieldfrom
            line = inner.gi_frame.f_lineno if inner.gi_frame is not None else 0
            per_place[(inner.gi_code.co_name, line)].append(spent)
    except StopIteration:
        pass
    every = np.array([s for v in per_place.values() for s in v]) * 1e6
    print(f"{every.size} steps, {every.sum() / 1e3:.1f} ms in all, p50 {np.median(every):.0f} us, "
          f"longest {every.max():.0f} us")
    for (name, line), spent in sorted(per_place.items(), key=lambda kv: -max(kv[1])):
        a = np.array(spent) * 1e6
        print(f"  ending at {name}:{line}: {a.size} steps, p50 {np.median(a):.0f} us, longest {a.max():.0f} us")


def time_columns(plan: Plan) -> None:
    for piece in (16384, 8192):
        spent = []
        for _ in range(3):
            for c in range(0, len(plan), piece):
                t0 = time.thread_time()
                plan.columns(c, min(len(plan), c + piece))
                spent.append(time.thread_time() - t0)
        a = np.array(spent) * 1e6
        print(f"Plan.columns of {piece} runs: p50 {np.median(a):.0f} us, p99 {np.percentile(a, 99):.0f} us")


def main() -> None:
    for _ in range(3):
        time_steps()
    time_columns(run_steps(_steps()))


if __name__ == "__main__":
    main()
