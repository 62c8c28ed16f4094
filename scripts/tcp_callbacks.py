"""How long the tcp channel's loop entry points hold this side's loop (uvloop) during one
``kvflow bench`` throughput row, repeated: count, total, longest and 90th percentile per entry.

    python scripts/tcp_callbacks.py 16k push 5
    KVFLOW_AB_TREE=/tmp/head PYTHONPATH=/tmp/abhook python scripts/tcp_callbacks.py 16k push 5  # another checkout

The entry points are ``TcpChannel``'s reader and writer callbacks and its worker threads'
hand-backs, timed by wrapping them (wall time, so a loop thread waiting for a lock or a core counts).
The serving side runs in a child process and is not timed.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

import uvloop
from _bench_pair import row_pair

from kvflow import _tcp

ENTRIES = ("_on_readable", "_flush", "_tx_back", "_rx_back")
_TIMES: dict[str, list[float]] = {}


def _timed(name: str) -> None:
    f = getattr(_tcp.TcpChannel, name)

    @functools.wraps(f)
    def wrapper(self: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return f(self, *args)
        finally:
            _TIMES.setdefault(name, []).append(time.perf_counter() - t0)

    setattr(_tcp.TcpChannel, name, wrapper)


async def main(block: str, op: str, tries: int) -> None:
    async with row_pair("tcp", block, op, {}) as (_, _peer, move):
        _TIMES.clear()
        for _ in range(tries):
            await move()
    parts = []
    for name, times in sorted(_TIMES.items()):
        times.sort()
        parts.append(f"{name} n={len(times)} total={sum(times) * 1e3:.1f} max={times[-1] * 1e3:.2f} "
                     f"p90={times[int(len(times) * 0.9)] * 1e3:.2f}")
    print(f"tcp {op} {block} ms: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    for entry in ENTRIES:
        _timed(entry)
    uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
