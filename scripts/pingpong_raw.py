"""The floor under a 4 KiB tcp pull on this machine: a raw loopback ping-pong, no kvflow.

    python scripts/pingpong_raw.py poll 3000    # both sides spin on non-blocking sockets
    python scripts/pingpong_raw.py block 3000   # both sides sleep in blocking recv

A forked child answers each 16-byte request with 4 KiB; the parent times N round trips after 300
warm-up ones and prints p50 and p99 in µs. ``poll`` is what a busy-polling library can reach (NIXL
over UCX tcp, kvflow's polling window at best); ``block`` pays a wake-up on each side per request.
Compare it with ``scripts/pull_latency.py tcp`` run in the same sitting.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

REQ, REPLY, WARM = 16, 4096, 300


def _serve(ls: socket.socket, poll: bool) -> None:
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.setblocking(not poll)
    reply, hdr = bytes(REPLY), bytearray(REQ)
    view = memoryview(hdr)
    while True:
        got = 0
        while got < REQ:
            try:
                n = c.recv_into(view[got:])
            except BlockingIOError:
                continue
            if n == 0:
                return
            got += n
        sent = 0
        while sent < REPLY:
            try:
                sent += c.send(reply[sent:])
            except BlockingIOError:
                continue


def main(mode: str, n: int) -> None:
    poll = mode == "poll"
    ls = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:
        try:
            _serve(ls, poll)
        finally:
            os._exit(0)
    s = socket.create_connection(ls.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(not poll)
    buf = memoryview(bytearray(REPLY))
    times = []
    try:
        for _ in range(WARM + n):
            t0 = time.perf_counter()
            s.send(bytes(REQ))
            got = 0
            while got < REPLY:
                try:
                    got += s.recv_into(buf[got:])
                except BlockingIOError:
                    continue
            times.append(time.perf_counter() - t0)
    finally:
        s.close()
        os.waitpid(pid, 0)
    us = np.array(times[WARM:]) * 1e6
    print(f"raw tcp {mode} 4 KiB round trip p50 {np.percentile(us, 50):.1f} p99 {np.percentile(us, 99):.1f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "poll", int(sys.argv[2]) if len(sys.argv) > 2 else 3000)
