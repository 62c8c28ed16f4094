"""What each of the bench's 1 ms tickers reports for a loop that kvflow does not touch.

    python scripts/ticker_floor.py [rounds]
    MEANS=0,9000,40000,100000 python scripts/ticker_floor.py 2   # no-op wake-ups at these means (µs)

For 3 s per case, on uvloop, a thread wakes this process's loop with ``call_soon_threadsafe``
at random intervals (0.5 to 1.5 times the mean of each case), with a callback that does nothing or holds the
loop 0.3 ms, while one ticker runs: ``Ticker`` (``asyncio.sleep``) or ``FdTicker`` (``timerfd``).
Prints worst / p99 lateness (ms) of each. Nothing else runs: the difference between the two
tickers for no-op wake-ups is the timer rounding of the loop, not work on it.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time

import uvloop

from kvflow._ticker import FdTicker, Ticker

CASES = ((0, 0.0), (700, 0.0), (2000, 0.0), (2000, 0.3))  # (mean µs between wake-ups, ms held by each)
if os.environ.get("MEANS"):  # no-op wake-ups only, at the given means
    CASES = tuple((int(m), 0.0) for m in os.environ["MEANS"].split(","))


async def case(kind: str, mean_us: int, hold_ms: float) -> str:
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def hold() -> None:
        if hold_ms:
            time.sleep(hold_ms / 1e3)

    def waker() -> None:
        rnd = random.Random(1)
        while not stop.wait(rnd.uniform(0.5, 1.5) * mean_us * 1e-6):
            loop.call_soon_threadsafe(hold)

    thread = threading.Thread(target=waker, daemon=True)
    if mean_us:
        thread.start()
    ticker = FdTicker() if kind == "fd" else Ticker()
    ticker.start()
    await asyncio.sleep(3)
    s = await ticker.stop()
    stop.set()
    if mean_us:
        thread.join(5)
    what = f"wake-ups every ~{mean_us} µs holding {hold_ms} ms" if mean_us else "no wake-ups"
    return f"{kind:5} {what:38} worst {s['worst_ms']:.2f} p99 {s['p99_ms']:.2f} ms ({s['ticks']} ticks)"


async def main(rounds: int) -> None:
    for _ in range(rounds):
        for mean_us, hold_ms in CASES:
            for kind in ("sleep", "fd"):
                print(await case(kind, mean_us, hold_ms), flush=True)


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
