"""Loop lateness on both sides of a TCP copy between two ticking processes, without kvflow.

    python scripts/lateness_pair.py thread 1024   # copy threads, 1 MiB per send/recv syscall
    python scripts/lateness_pair.py thread 64     # the same with 64 KiB syscalls
    python scripts/lateness_pair.py proc 64       # the copy in a child process of each (no GIL)
    python scripts/lateness_pair.py none          # both loops tick, nothing is copied
    FD=1 python scripts/lateness_pair.py proc 64  # ticked by a timerfd (kvflow._ticker.FdTicker)

The shape of a tcp pull in ``kvflow bench``: two processes each run the bench's 1 ms ticker on
uvloop for 3 s; one sends over loopback TCP from a 4 MiB buffer as fast as it can, in syscalls of
the given size, the other receives into a buffer of that size. The copy runs in a SCHED_IDLE thread
of each ticking process (``thread``) or in a SCHED_IDLE child process of each (``proc``). Prints
the receive rate and each side's worst and p99 lateness (ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from typing import Any

import uvloop

from kvflow._ticker import FdTicker, Ticker

SECONDS = 3.0


def _copy(role: str, sock: socket.socket, chunk: int, done: Any, out: Any) -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if role == "send":
        buf = memoryview(bytearray(4 << 20))
        parts = [buf[i:i + chunk] for i in range(0, len(buf), chunk)]
        try:
            while not done.is_set():
                for part in parts:
                    sock.sendall(part)
        except OSError:
            pass  # the receiver went first
        return
    into = memoryview(bytearray(chunk))
    got, t0 = 0, time.perf_counter()
    while not done.is_set() and time.perf_counter() - t0 < SECONDS:
        n = sock.recv_into(into)
        if n == 0:
            break
        got += n
    out.put(("rate", got / (time.perf_counter() - t0) / 2**30))


async def _tick() -> dict[str, Any]:
    ticker = FdTicker() if os.environ.get("FD") else Ticker()
    ticker.start()
    await asyncio.sleep(SECONDS)
    return await ticker.stop()


def _side(role: str, mode: str, chunk: int, port: int, out: Any) -> None:
    if role == "send":
        lsock = socket.create_server(("127.0.0.1", port))
        out.put(("ready", 0.0))
        sock, _ = lsock.accept()
    else:
        sock = socket.create_connection(("127.0.0.1", port))
    if mode == "proc":
        done: Any = mp.Event()
        copier: Any = mp.Process(target=_copy, args=(role, sock, chunk, done, out))
    else:
        done = threading.Event()
        copier = threading.Thread(target=_copy, args=(role, sock, chunk, done, out))
    if mode != "none":
        copier.start()
    time.sleep(0.3)
    late = uvloop.run(_tick())
    done.set()
    with contextlib.suppress(OSError):  # the other side may have closed first
        sock.shutdown(socket.SHUT_RDWR)
    if mode != "none":
        copier.join(10)
    out.put((role, late["worst_ms"], late["p99_ms"]))


def main(mode: str, chunk_kib: int) -> None:
    out: Any = mp.Queue()
    port = 20000 + os.getpid() % 20000
    sender = mp.Process(target=_side, args=("send", mode, chunk_kib << 10, port, out))
    sender.start()
    out.get(timeout=30)
    receiver = mp.Process(target=_side, args=("recv", mode, chunk_kib << 10, port, out))
    receiver.start()
    lines = [] if mode != "none" else ["none: both loops tick, nothing is copied"]
    for _ in range(2 if mode == "none" else 3):
        item = out.get(timeout=60)
        if item[0] == "rate":
            lines.insert(0, f"{mode} {chunk_kib} KiB: {item[1]:.2f} GiB/s")
        else:
            lines.append(f"  {item[0]}: late (ms) worst {item[1]:.2f} / p99 {item[2]:.2f}")
    for p in (sender, receiver):
        p.join(10)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1024)
