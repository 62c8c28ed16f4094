"""1 ms tickers on an event loop: how late each tick is handled while kvflow works on that loop.

``kvflow bench`` runs both kinds on each side's loop during every throughput row, in two passes.

- :class:`Ticker` sleeps (``asyncio.sleep``): a tick is due one period after the previous one
  fired; its lateness is the time past that (an early tick counts 0). This is what a coroutine of
  the host sees, including its loop's timer granularity: uvloop's timers count whole milliseconds,
  so once anything else wakes the loop between ticks, a tick can fire up to about 1 ms late with
  the loop idle (docs/decisions.md, "Two tickers").
- :class:`FdTicker` waits for a kernel timer (Linux ``timerfd``, in microseconds) to make a file
  descriptor readable; a tick's lateness is the time from its expiry to the loop's reader callback.
  That is how long the loop kept I/O waiting, which is what a served request arriving on a socket
  sees, without the timer rounding.

An idle loop has a floor of its own (the machine's other work), which the bench measures in the
same run."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
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


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = os.O_NONBLOCK, os.O_CLOEXEC, 1
_libc: Any = None


def _timerfd() -> Any:
    """libc with ``timerfd_create``/``timerfd_settime`` typed, or None (not Linux)."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                         ctypes.POINTER(_Itimerspec)]
        _libc = libc
    return _libc


def fd_ticker_available() -> bool:
    """Whether :class:`FdTicker` can run here (Linux)."""
    return _timerfd() is not None


def _timespec(t: float) -> _Timespec:
    sec = int(t)
    return _Timespec(sec, min(round((t - sec) * 1e9), 999_999_999))


class FdTicker:
    """Ticks every ``period`` seconds from a ``timerfd`` on ``CLOCK_MONOTONIC`` (the clock of
    ``time.perf_counter`` on Linux) from ``start()`` until ``stop()``. The k-th expiry is due at the
    start plus k periods; when the loop's reader runs, every expiry since the last read is counted,
    each late by the time since it was due, so a loop held through several ticks counts each one."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.late: list[float] = []
        self._fd = -1
        self._t0 = 0.0
        self._expired = 0

    def start(self) -> None:
        libc = _timerfd()
        if libc is None:
            raise RuntimeError("FdTicker needs Linux timerfd")
        self.late.clear()
        fd = libc.timerfd_create(time.CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._fd, self._expired = fd, 0
        self._t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
        spec = _Itimerspec(_timespec(self.period), _timespec(self._t0 + self.period))
        if libc.timerfd_settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            os.close(fd)
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        asyncio.get_running_loop().add_reader(fd, self._on_tick)

    def _on_tick(self) -> None:
        now = time.clock_gettime(time.CLOCK_MONOTONIC)
        try:
            n = int.from_bytes(os.read(self._fd, 8), sys.byteorder)
        except BlockingIOError:
            return
        first, self._expired = self._expired + 1, self._expired + n
        due0, period = self._t0, self.period
        self.late.extend(max(0.0, now - (due0 + k * period)) for k in range(first, first + n))

    async def stop(self) -> dict[str, Any]:
        """Stop ticking; the worst and p99 lateness in ms and the number of ticks."""
        if self._fd >= 0:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        return summary(self.late)


def summary(late: list[float]) -> dict[str, Any]:
    """Worst and p99 of lateness samples (seconds), in ms."""
    if not late:
        return {"worst_ms": 0.0, "p99_ms": 0.0, "ticks": 0}
    a = np.array(late) * 1e3
    return {"worst_ms": float(a.max()), "p99_ms": float(np.percentile(a, 99)), "ticks": int(a.size)}
