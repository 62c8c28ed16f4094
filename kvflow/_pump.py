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

By default (``kvflow.tcp.NativePump=1``) and where ``kvflow._pumpc`` was built (a C file compiled at
install; see setup.py), the thread runs that loop in C, called once per payload through ctypes with
the GIL released throughout, so no Python runs between its syscalls; the loop thread takes the socket
from it (``Job.hold``) for its own reads and sends on that socket. Otherwise (``NativePump=0``, or
no C part) the same loop runs in Python. Why: docs/decisions.md, "tcp payloads: the socket loop in C".

Every syscall runs under the job's lock: ``Job.stop()`` takes it, so once ``stop()`` returns the
thread touches neither that memory nor the socket again, and the job's cursor and ``left`` say
exactly how far it got. That is what cancellation, unregistration and teardown rely on.

A job in the C loop may span several frames (docs/decisions.md, "tcp: one worker job across
frames"): a receive reads the headers of the frames it expects into slots and checks each before
reading on (``Job.marks``), and the loop thread may end a send early at a frame's end (``Job.cut``).
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import numpy as np

from ._iov import IovCursor

#: Seconds of a quiet socket after which a worker hands its payload back if another one waits.
WAIT_S = 0.002
#: Seconds of a quiet socket after which a worker hands its payload back in any case.
HOLD_S = 0.1


def _load() -> Any:
    """``kvflow._pumpc`` through ctypes, its functions typed; None where it was not built."""
    try:
        from . import _pumpc  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = ctypes.CDLL(_pumpc.__file__)
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvf_job_size.restype = ctypes.c_size_t
    lib.kvf_job_size.argtypes = []
    lib.kvf_job_init.argtypes = [ptr]
    lib.kvf_job_hold.argtypes = [ptr]
    lib.kvf_job_release.argtypes = [ptr]
    lib.kvf_job_nudge.argtypes = [ptr]
    lib.kvf_job_unnudge.argtypes = [ptr]
    lib.kvf_job_stop.argtypes = [ptr]
    lib.kvf_job_stop.restype = i64
    lib.kvf_job_cut.argtypes = [ptr, i64]
    lib.kvf_job_moved.argtypes = [ptr, ptr]
    lib.kvf_job_moved.restype = i64
    lib.kvf_move.argtypes = [cint, ptr, i64, i64, i64, cint, ptr, cint, cint, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr]
    lib.kvf_move.restype = i64
    lib.kvf_serve.argtypes = [cint, ptr, i64, i64, i64, ptr, cint, cint, ptr, ptr, ptr, ptr]
    lib.kvf_serve.restype = i64
    return lib


class Serve(ctypes.Structure):
    """kvf_serve's bounds and buffers (``kvf_serve_t`` in kvflow/_pumpc.c): a receive job that goes
    on through the peer's writes into one cache. ``keep`` holds the arrays its pointers name."""

    _fields_ = [("cache_id", ctypes.c_uint64), ("starts", ctypes.c_void_p), ("sizes", ctypes.c_void_p),
                ("ntensors", ctypes.c_int64), ("max_frames", ctypes.c_int64), ("max_runs", ctypes.c_int64),
                ("max_bytes", ctypes.c_int64), ("min_frame", ctypes.c_int64), ("max_frame", ctypes.c_int64),
                ("frame_runs", ctypes.c_int64), ("hdrs", ctypes.c_void_p), ("runs", ctypes.c_void_p),
                ("scratch", ctypes.c_void_p), ("closing", ctypes.c_void_p)]

    keep: tuple[Any, ...] = ()


_C = _load()
#: Whether the C socket loop is there (built at install).
NATIVE = _C is not None
#: Memory for one kvf_job (its type made once: a ctypes array type made per call is cyclic garbage)
_JobMemory: Any = ctypes.c_char * (_C.kvf_job_size() if _C is not None else 1)
_DONE, _STOPPED, _QUIET, _CLOSED, _ERROR, _MISMATCH = range(6)  # kvf_move's statuses
_NO_MARKS = np.zeros(0, np.int64)


class Cursor(Protocol):
    """A position in a payload's buffers (``kvflow._tcp._Cursor`` or ``kvflow._iov.IovCursor``)."""

    @property
    def done(self) -> bool: ...

    def as_iov(self) -> IovCursor: ...

    def recv(self, sock: socket.socket) -> int: ...

    def send(self, sock: socket.socket) -> tuple[int, int]: ...

    def advance(self, n: int) -> None: ...


class Job:
    """One payload on a worker thread: its cursor, the bytes left, and the stop switch.

    A receive in the C loop may carry ``marks``: the byte counts at which frame headers end, each
    read into ``slots[k]`` (an address) and compared with ``expect[k]`` before any byte after it
    is read. ``passed`` counts the headers found equal; the first that differs ends the job
    (``mismatch``). That is how one job reads several frames of a stream without the loop thread."""

    __slots__ = ("_applied", "_c", "_iov", "_total", "cursor", "expect", "left", "lock", "marks", "mismatch",
                 "passed", "serve", "slots", "stopped")

    def __init__(self, cursor: Cursor, left: int, marks: np.ndarray = _NO_MARKS, slots: np.ndarray = _NO_MARKS,
                 expect: bytes = b"", serve: Serve | None = None) -> None:
        self.cursor = cursor
        self.left = left
        self._total = left
        #: a receive that goes on through the peer's next writes (kvf_serve): ``cursor`` and ``left``
        #: count the first payload only; ``moved()`` counts all
        self.serve = serve
        self.lock = threading.Lock()
        self.stopped = False
        self.marks = marks  # int64 byte counts from the job's first byte
        self.slots = slots  # uint64 addresses, one per mark
        self.expect = expect  # the headers expected, end to end
        self.passed = 0
        self.mismatch = False
        self._c: Any = None  # the C loop's job (kvf_job), once the job goes to it
        self._iov: IovCursor | None = None  # the table the C loop moves through
        self._applied = 0  # of the C loop's bytes, those already counted in cursor and left

    def stop(self) -> None:
        """Stop the thread at its next syscall boundary; waits out a syscall in progress."""
        if self._c is not None:
            _C.kvf_job_stop(self._c)  # through ctypes: the GIL is released while it waits
            with self.lock:
                self.stopped = True
            self.sync()
            return
        with self.lock:
            self.stopped = True

    def sync(self) -> None:
        """Count the C loop's bytes so far in ``cursor``, ``left`` and ``passed``. Only once the C loop
        is done or stopped: advancing the cursor rewrites the iovec the worker may be moving through."""
        if self._c is not None:
            passed = ctypes.c_int64(0)
            moved = _C.kvf_job_moved(self._c, ctypes.byref(passed))
            with self.lock:
                self._apply(moved)
                self.passed = passed.value

    def moved(self) -> int:
        """Bytes the C loop has moved so far, counted nowhere else (the loop thread may read it while
        the worker goes on: it writes nothing the worker uses, unlike ``sync``); -1 for a job that
        is not in the C loop."""
        if self._c is None:
            return -1
        passed = ctypes.c_int64(0)
        return int(_C.kvf_job_moved(self._c, ctypes.byref(passed)))

    def cut(self, at: int) -> None:
        """End the job once ``at`` bytes of it are moved (or now, if more are); the C loop only."""
        if self._c is not None:
            _C.kvf_job_cut(self._c, at)

    @property
    def native(self) -> bool:
        """Whether the C loop moves this job (then ``hold`` and ``release`` mean something)."""
        return self._c is not None

    def hold(self) -> None:
        """The calling (loop) thread is about to use the socket: the C loop pauses after its syscall
        in progress and stays paused until ``release``. Without it a worker that takes the kernel's
        socket lock again right after each syscall kept the loop's reads waiting for milliseconds."""
        if self._c is not None:
            _C.kvf_job_hold(self._c)

    def release(self) -> None:
        if self._c is not None:
            _C.kvf_job_release(self._c)

    def nudge(self) -> None:
        """The calling (loop) thread is about to use the socket in the direction the worker does not:
        the C loop makes no syscall from now until ``unnudge``, but unlike ``hold`` this does not wait
        for the worker to come back from the one in progress (the kernel's socket lock orders the two
        syscalls). A worker off its core with the job's lock held kept ``hold`` waiting up to 0.6 ms."""
        if self._c is not None:
            _C.kvf_job_nudge(self._c)

    def unnudge(self) -> None:
        if self._c is not None:
            _C.kvf_job_unnudge(self._c)

    def _to_c(self) -> None:
        self._iov = self.cursor.as_iov()
        self._c = _JobMemory()
        _C.kvf_job_init(self._c)

    def _apply(self, moved: int) -> None:
        """Count the C loop's bytes up to ``moved`` in the cursor and ``left`` (under ``lock``)."""
        if self.serve is not None:
            moved = min(moved, self._total)  # bytes past the first payload are the loop thread's to place
        n = moved - self._applied
        if n > 0:
            self._applied = moved
            self.left -= n
            self.cursor.advance(n)
            if self._iov is not self.cursor:
                assert self._iov is not None
                self._iov.advance(n)


class Pool:
    """Worker threads that move payloads, and how many payloads wait for one of them."""

    __slots__ = ("_executor", "_lock", "_waiting_c", "native", "waiting")

    def __init__(self, executor: ThreadPoolExecutor, native: bool = False) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self.waiting = 0  # submitted, not yet started
        self._waiting_c = ctypes.c_long(0)  # the same, where the C loop reads it
        #: whether payloads move in the C loop (asked for, and built)
        self.native = native and NATIVE

    def receive(self, sock: socket.socket, job: Job) -> Future[None]:
        """Read ``job.left`` bytes into the cursor's buffers, until done, stopped or handed back."""
        return self._start(sock, job, select.POLLIN, job.cursor.recv)

    def send(self, sock: socket.socket, job: Job) -> Future[None]:
        """Send the rest of the cursor's buffers, until done, stopped or handed back."""
        return self._start(sock, job, select.POLLOUT, lambda s: job.cursor.send(s)[0])

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)

    def _start(self, sock: socket.socket, job: Job, event: int, step: Callable[[socket.socket], int]) -> Future[None]:
        if self.native:
            job._to_c()
        with self._lock:
            self.waiting += 1
            self._waiting_c.value = self.waiting
        return self._executor.submit(self._run, sock, job, event, step)

    def _run(self, sock: socket.socket, job: Job, event: int, step: Callable[[socket.socket], int]) -> None:
        with self._lock:
            self.waiting -= 1
            self._waiting_c.value = self.waiting
        if job._c is not None:
            _move_c(sock, job, event, self._waiting_c)
        else:
            _move(sock, job, event, step, self)


def _move_c(sock: socket.socket, job: Job, event: int, waiting: ctypes.c_long) -> None:
    """``_move`` in C: one ctypes call for the whole payload, then its bytes counted."""
    with job.lock:
        if job.stopped:
            return
        limit = job.left
    table = job._iov
    assert table is not None
    address, count = table.table()
    status, err = ctypes.c_int(0), ctypes.c_int(0)
    marks, slots = job.marks, job.slots
    wait_ms, hold_ms = max(1, round(WAIT_S * 1000)), max(1, round(HOLD_S * 1000))
    if job.serve is not None:
        _C.kvf_serve(sock.fileno(), address, count, limit, table.chunk_bytes, job._c, wait_ms, hold_ms,
                     ctypes.byref(waiting), ctypes.byref(job.serve), ctypes.byref(status), ctypes.byref(err))
    else:
        _C.kvf_move(sock.fileno(), address, count, limit, table.chunk_bytes, event == select.POLLOUT, job._c, wait_ms,
                    hold_ms, ctypes.byref(waiting), marks.ctypes.data, marks.size, slots.ctypes.data, job.expect,
                    len(job.expect) // marks.size if marks.size else 0, ctypes.byref(status), ctypes.byref(err))
    job.sync()
    job.mismatch = status.value == _MISMATCH
    if status.value == _CLOSED:
        raise ConnectionResetError("peer closed the data connection")
    if status.value == _ERROR:
        raise OSError(err.value, os.strerror(err.value))


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
