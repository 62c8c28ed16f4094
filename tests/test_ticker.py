"""The bench's two 1 ms tickers count a loop that is held as late ticks.

Only lower bounds are checked: a loop held for 20 ms must show ticks at least 18 ms late. How late
an unheld loop's ticks are is a benchmark figure (``kvflow bench``), not a test."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from kvflow._ticker import FdTicker, Ticker, fd_ticker_available

HOLD_S = 0.020


async def _hold_once(ticker: Ticker | FdTicker) -> dict[str, float]:
    ticker.start()
    await asyncio.sleep(0.005)
    time.sleep(HOLD_S)  # noqa: ASYNC251 - the point: the loop is held, no tick can be handled meanwhile
    await asyncio.sleep(0.005)
    return await ticker.stop()


@pytest.mark.asyncio
async def test_sleeping_ticker_reports_a_held_loop() -> None:
    s = await _hold_once(Ticker())
    assert s["worst_ms"] >= (HOLD_S - 0.002) * 1e3, s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
@pytest.mark.asyncio
async def test_fd_ticker_counts_every_expiry_of_a_held_loop_as_late() -> None:
    assert fd_ticker_available()
    ticker = FdTicker()
    s = await _hold_once(ticker)
    # the first expiry inside the hold was due at most 1 ms after it began and handled after it ended
    assert s["worst_ms"] >= (HOLD_S - 0.002) * 1e3, s
    # each expiry during the hold is counted, not only the one that woke the loop: at least 10 of
    # the ~20 were due 5 ms or more before the hold ended
    assert sum(late >= 0.005 for late in ticker.late) >= 10, ticker.late
    assert s["ticks"] >= 20, s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
@pytest.mark.asyncio
async def test_fd_ticker_stops_reading_at_stop() -> None:
    ticker = FdTicker()
    ticker.start()
    fd = ticker._fd
    await asyncio.sleep(0.003)
    await ticker.stop()
    n = len(ticker.late)
    await asyncio.sleep(0.003)
    assert len(ticker.late) == n  # no tick after stop()
    assert not asyncio.get_running_loop().remove_reader(fd)  # its reader is gone
