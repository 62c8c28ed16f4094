"""Large socket payloads moved on a worker thread, so that the event loop thread stays free.

The TCP channel hands a frame's payload (reading it into registered memory, or sending it from
there) to a worker thread once at least ``kvflow.tcp.ThreadBytes`` of it are left. The thread
loops over non-blocking ``readv``/``sendmsg`` calls of at most 1 MiB (each releases the GIL) and
waits for the socket with ``poll``; when the socket stays quiet for ``WAIT_S`` it gives the payload
back to the loop, whose reader or writer resumes it, so a slow peer never holds a thread for long
(and threads shared by many links cannot wait on each other for ever).

Every syscall runs under the job's lock: ``Job.stop()`` takes it, so once ``stop()`` returns the
thread touches neither that memory nor the socket again. That is what cancellation, unregistration
and teardown rely on.
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Callable, Protocol

#: Seconds a worker waits for a quiet socket before it hands the payload back to the event loop.
WAIT_S = 0.002


class Cursor(Protocol):
    """A position in a payload's buffers (``kvflow._tcp._Cursor`` or ``kvflow._iov.IovCursor``)."""

    @property
    def done(self) -> bool: ...

    def recv(self, sock: socket.socket) -> int: ...

    def send(self, sock: socket.socket) -> tuple[int, int]: ...

    def advance(self, n: int) -> None: ...


class Job:
    """One payload on a worker thread: its cursor, the bytes left, and the stop switch."""

    __slots__ = ("cursor", "left", "lock", "stopped")

    def __init__(self, cursor: Cursor, left: int) -> None:
        self.cursor = cursor
        self.left = left
        self.lock = threading.Lock()
        self.stopped = False

    def stop(self) -> None:
        """Stop the thread at its next syscall boundary; waits out a syscall in progress."""
        with self.lock:
            self.stopped = True


def receive(sock: socket.socket, job: Job) -> None:
    """Read ``job.left`` bytes into the cursor's buffers, until done, stopped or quiet."""
    _move(sock, job, select.POLLIN, job.cursor.recv)


def send(sock: socket.socket, job: Job) -> None:
    """Send the rest of the cursor's buffers, until done, stopped or the socket stays full."""
    _move(sock, job, select.POLLOUT, lambda s: job.cursor.send(s)[0])


def _move(sock: socket.socket, job: Job, event: int, step: Callable[[socket.socket], int]) -> None:
    poller = select.poll()
    poller.register(sock.fileno(), event)
    while True:
        with job.lock:
            if job.stopped or job.left == 0:
                return
            try:
                n = step(sock)
            except (BlockingIOError, InterruptedError):
                n = -1
            if n == 0 and event == select.POLLIN:
                raise ConnectionResetError("peer closed the data connection")
            if n > 0:
                job.left -= n
                job.cursor.advance(n)
                continue
        if not poller.poll(WAIT_S * 1000):
            return
