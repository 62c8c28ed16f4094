"""The loop-lateness floor beside a TCP copy that kvflow does not make, for comparison with lateness.py.

    python scripts/lateness_floor.py pump idle     # sender and receiver in two other processes
    python scripts/lateness_floor.py thread idle   # receiver a thread of the ticking process

A sender process (SCHED_IDLE) streams 1 MiB writes over loopback TCP; the receiver, at the given
policy (idle or normal), reads them into a 1 MiB buffer, as fast as it can. Meanwhile this process
runs the bench's 1 ms ticker on uvloop for 3 s and prints its worst and p99 lateness (ms).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import select
import socket
import sys
import threading
import time
from typing import Any

import uvloop

from kvflow._ticker import Ticker


def _policy(name: str) -> None:
    if name == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _send(lsock: socket.socket, stop: Any) -> None:
    _policy("idle")
    conn, _ = lsock.accept()
    mv = memoryview(bytearray(1 << 20))
    try:
        while not stop.is_set():
            conn.sendall(mv)
    except OSError:
        pass  # the receiver went first
    conn.close()


def _receive(sock: socket.socket, policy: str, done: list[bool]) -> None:
    """Non-blocking reads and a 2 ms poll, as kvflow._pump does."""
    _policy(policy)
    sock.setblocking(False)
    mv = memoryview(bytearray(1 << 20))
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while not done[0]:
        try:
            if sock.recv_into(mv) == 0:
                return
            continue
        except BlockingIOError:
            pass
        poller.poll(2)


def _receive_process(port: int, policy: str) -> None:
    _receive(socket.create_connection(("127.0.0.1", port)), policy, [False])


async def _tick(seconds: float) -> dict[str, Any]:
    ticker = Ticker()
    ticker.start()
    await asyncio.sleep(seconds)
    return await ticker.stop()


def main(where: str, policy: str) -> None:
    stop = mp.Event()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    port = lsock.getsockname()[1]
    procs = [mp.Process(target=_send, args=(lsock, stop))]
    done = [False]
    thread = None
    if where == "pump":
        procs.append(mp.Process(target=_receive_process, args=(port, policy)))
    for p in procs:
        p.start()
    if where == "thread":
        thread = threading.Thread(target=_receive, args=(socket.create_connection(("127.0.0.1", port)), policy, done))
        thread.start()
    time.sleep(0.3)
    try:
        late = uvloop.run(_tick(3.0))
    finally:
        done[0] = True
        stop.set()
        if thread is not None:
            thread.join(5)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    print(f"{where} {policy}: late (ms) worst {late['worst_ms']:.2f} / p99 {late['p99_ms']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
