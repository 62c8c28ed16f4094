"""Large socket payloads moved on a worker thread, so that the event loop thread stays free.

The TCP channel hands a frame's payload (reading it into registered memory, or sending it from
there) to a worker thread once at least ``kvflow.tcp.ThreadBytes`` of it are left. The thread
loops over non-blocking ``readv``/``sendmsg`` calls of at most 64 KiB (each releases the GIL) and
waits for the socket with ``poll``. A thread keeps its payload across a full or empty socket (a peer
that is merely slower than us) as long as no other payload is waiting for a thread of its pool; it
gives the payload back to the loop, whose reader or writer resumes it, once another one waits and
the socket has stayed quiet for ``WAIT_S``, or once the socket has stayed quiet for ``HOLD_S``.
So threads shared by many links cannot wait on each other for ever (two processes whose threads all
send to each other free one within ``WAIT_S``), and a stalled peer does not hold a thread for long.
See docs/decisions.md, "tcp: 64 KiB per socket syscall".

Every syscall runs under the job's lock: ``Job.stop()`` takes it, so once ``stop()`` returns the
thread touches neither that memory nor the socket again. That is what cancellation, unregistration
and teardown rely on.
"""

from __future__ import annotations

import select
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

#: Seconds of a quiet socket after which a worker hands its payload back if another one waits.
WAIT_S = 0.002
#: Seconds of a quiet socket after which a worker hands its payload back in any case.
HOLD_S = 0.1


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


class Pool:
    """Worker threads that move payloads, and how many payloads wait for one of them."""

    __slots__ = ("_executor", "_lock", "waiting")

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self.waiting = 0  # submitted, not yet started

    def receive(self, sock: socket.socket, job: Job) -> Future[None]:
        """Read ``job.left`` bytes into the cursor's buffers, until done, stopped or handed back."""
        return self._start(sock, job, select.POLLIN, job.cursor.recv)

    def send(self, sock: socket.socket, job: Job) -> Future[None]:
        """Send the rest of the cursor's buffers, until done, stopped or handed back."""
        return self._start(sock, job, select.POLLOUT, lambda s: job.cursor.send(s)[0])

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)

    def _start(self, sock: socket.socket, job: Job, event: int, step: Callable[[socket.socket], int]) -> Future[None]:
        with self._lock:
            self.waiting += 1
        return self._executor.submit(self._run, sock, job, event, step)

    def _run(self, sock: socket.socket, job: Job, event: int, step: Callable[[socket.socket], int]) -> None:
        with self._lock:
            self.waiting -= 1
        _move(sock, job, event, step, self)


def _move(sock: socket.socket, job: Job, event: int, step: Callable[[socket.socket], int], pool: Pool) -> None:
    poller = select.poll()
    poller.register(sock.fileno(), event)
    quiet = 0.0  # seconds the socket has been full (sending) or empty (receiving) since the last byte
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
                quiet = 0.0
                continue
        if poller.poll(WAIT_S * 1000):
            continue
        quiet += WAIT_S
        if pool.waiting or quiet >= HOLD_S:
            return
