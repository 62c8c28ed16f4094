"""A 1 ms ticker on an event loop: how late each tick fires while kvflow works on that loop.

``kvflow bench`` runs one on each side's loop during every throughput row. A tick is due one period
after the previous one fired; its lateness is the time past that (``time.perf_counter``; an early
tick counts 0), so a loop held by a long callback shows as late ticks. An idle loop has a floor of
its own (timer granularity, the machine's other work), which the bench measures in the same run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np


class Ticker:
    """Ticks every ``period`` seconds on the running loop from ``start()`` until ``stop()``."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.late: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.late.clear()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        period, late = self.period, self.late
        while True:
            due = time.perf_counter() + period
            await asyncio.sleep(period)
            late.append(max(0.0, time.perf_counter() - due))  # uvloop's ms timers may fire a little early

    async def stop(self) -> dict[str, Any]:
        """Stop ticking; the worst and p99 lateness in ms and the number of ticks."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        return summary(self.late)


def summary(late: list[float]) -> dict[str, Any]:
    """Worst and p99 of lateness samples (seconds), in ms."""
    if not late:
        return {"worst_ms": 0.0, "p99_ms": 0.0, "ticks": 0}
    a = np.array(late) * 1e3
    return {"worst_ms": float(a.max()), "p99_ms": float(np.percentile(a, 99)), "ticks": int(a.size)}
