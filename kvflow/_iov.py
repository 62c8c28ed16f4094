"""Scatter-gather socket I/O straight from a run table, through libc (ctypes).

``socket.sendmsg`` / ``recvmsg_into`` need one Python buffer object per iovec: a memoryview slice
per run, about 0.4 us each to make and to hand over. A 1 GiB transfer in 16 KiB blocks is 65,536
runs, so both sides spent tens of milliseconds per GiB on objects. Here the iovecs are a numpy
table of (address, length) built from the already checked runs, and ``readv`` / ``sendmsg`` are
called through ctypes (which releases the GIL): no Python object per run.

Only for runs inside registered host memory that the caller has checked; where libc cannot be
loaded (not Linux), ``AVAILABLE`` is False and the TCP channel keeps to memoryviews.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from bisect import bisect_left, bisect_right
from typing import Any

import numpy as np

IOV_MAX = 1024
_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


def _load() -> tuple[Any, Any] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv, sendmsg = libc.readv, libc.sendmsg
    except (OSError, AttributeError):
        return None
    readv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    readv.restype = ctypes.c_ssize_t
    sendmsg.argtypes = (ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int)
    sendmsg.restype = ctypes.c_ssize_t
    return readv, sendmsg


_FUNCS = _load() if os.name == "posix" else None
AVAILABLE = _FUNCS is not None


def _raise(op: str) -> None:
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK):
        raise BlockingIOError  # the common case while polling: no message to build
    if err == errno.EINTR:
        raise InterruptedError
    raise OSError(err, f"{op}: {os.strerror(err)}")


#: Average run size (bytes) up to which a cursor keeps its run ends in numpy and searches them there:
#: such runs are many per syscall, and turning 2048 ends into a list of ints cost 60-75 µs on the
#: loop thread for a 32 KiB frame (one syscall); larger runs take a list (bisect: 0.4 vs 4 µs a search).
SEARCH_RUN_BYTES = 256


class IovCursor:
    """A position in a table of runs (address, length); each syscall takes up to IOV_MAX of them
    and about ``chunk_bytes``, straight from the table. Same interface as the channel's list cursor.
    ``keep`` holds the objects whose memory some of the addresses point into (a frame's header).
    ``few_searches``: a C loop moves through it, so ``advance`` runs a few times at most and the run
    ends stay in numpy (a list of 65,536 ends took milliseconds of the loop thread to make)."""

    __slots__ = ("_addrs", "_base", "_ends", "_hdr", "_iov", "_keep", "_lens", "_slots", "chunk_bytes", "i", "n",
                 "pos")

    def __init__(self, addrs: np.ndarray, lens: np.ndarray, chunk_bytes: int, keep: object = None,
                 few_searches: bool = False, arena: np.ndarray | None = None) -> None:
        n = int(lens.size)
        # struct iovec {void *base; size_t len;}[n], then the run ends: in ``arena`` (uint64, at least
        # 3n) when given, memory the caller reuses while no other cursor uses it
        if arena is None:
            self._iov = np.empty(2 * n, dtype=np.uint64)
            ends = np.cumsum(lens, dtype=np.uint64)
        else:
            self._iov = arena[: 2 * n]
            ends = np.cumsum(lens, dtype=np.uint64, out=arena[2 * n : 3 * n])
        self._iov[0::2] = addrs
        self._iov[1::2] = lens
        self._slots = self._iov.data  # a memoryview: sets one field without a numpy call
        self._base = int(self._iov.__array_interface__["data"][0])
        self._keep = keep
        # the runs as given (the table's first iovec of a cut run is rewritten as it is consumed);
        # read only where a run is cut, once per syscall at most
        self._addrs, self._lens = addrs, lens
        few = few_searches or (n and int(ends[-1]) <= n * SEARCH_RUN_BYTES)
        self._ends: list[int] | np.ndarray = ends if few else ends.tolist()
        self._hdr = _MsgHdr()
        self.chunk_bytes = chunk_bytes
        self.n = n
        self.i = 0  # first run not wholly consumed
        self.pos = 0  # bytes consumed

    def _find(self, value: int, right: bool) -> int:
        """The first run from ``i`` whose end is at least (``right``: past) ``value``."""
        ends = self._ends
        if isinstance(ends, list):
            return (bisect_right if right else bisect_left)(ends, value, self.i)
        return max(self.i, int(ends.searchsorted(value, "right" if right else "left")))

    def _end(self, k: int) -> int:
        """Where run ``k`` ends, in bytes from the start; 0 for ``k`` = -1."""
        return int(self._ends[k]) if k >= 0 else 0

    @property
    def done(self) -> bool:
        return self.i >= self.n

    @property
    def left(self) -> int:
        """Bytes not yet consumed."""
        return self._end(self.n - 1) - self.pos

    @property
    def runs_left(self) -> int:
        """Runs not wholly consumed."""
        return self.n - self.i

    def _window(self) -> tuple[int, int]:
        """The end (exclusive) of the runs the next syscall takes, from ``i``, and how many bytes
        the last of them reaches past ``chunk_bytes`` (its iovec is cut short for the call)."""
        j = min(self._find(self.pos + self.chunk_bytes, False) + 1, self.i + IOV_MAX, self.n)
        return j, self._end(j - 1) - self.pos - self.chunk_bytes

    def recv(self, sock: socket.socket) -> int:
        """``readv`` into the next runs; 0 means the peer closed; BlockingIOError when nothing waits."""
        assert _FUNCS is not None
        j, over = self._window()
        slot, full = 2 * j - 1, self._slots[2 * j - 1]
        if over > 0:  # the ctypes call cannot raise, so the iovec is always restored below
            self._slots[slot] = full - over
        n = _FUNCS[0](sock.fileno(), self._base + 16 * self.i, j - self.i)
        self._slots[slot] = full
        if n < 0:
            _raise("readv")
        return n

    def send(self, sock: socket.socket) -> tuple[int, int]:
        """``sendmsg`` (MSG_NOSIGNAL) from the next runs: (bytes sent, bytes offered);
        BlockingIOError when the socket is full."""
        assert _FUNCS is not None
        j, over = self._window()
        slot, full = 2 * j - 1, self._slots[2 * j - 1]
        if over > 0:
            self._slots[slot] = full - over
        hdr = self._hdr
        hdr.msg_iov = self._base + 16 * self.i
        hdr.msg_iovlen = j - self.i
        n = _FUNCS[1](sock.fileno(), ctypes.byref(hdr), _MSG_NOSIGNAL)
        self._slots[slot] = full
        if n < 0:
            _raise("sendmsg")
        return n, self._end(j - 1) - self.pos - max(over, 0)

    def table(self) -> tuple[int, int]:
        """The iovecs left, for a C loop: the address of the first one, and how many there are.
        The first may be rewritten in place as it is consumed; ``advance`` agrees with that."""
        return self._base + 16 * self.i, self.n - self.i

    def as_iov(self) -> IovCursor:
        return self

    def rest(self) -> tuple[np.ndarray, np.ndarray]:
        """The runs not yet consumed, as (addresses, lengths); the first may start part way in."""
        i = self.i
        addrs, lens = self._addrs[i:].copy(), self._lens[i:].copy()
        off = self.pos - self._end(i - 1)
        if off and lens.size:
            addrs[0] += np.uint64(off)
            lens[0] -= np.uint64(off)
        return addrs, lens

    def advance(self, n: int) -> None:
        pos = self.pos = self.pos + n
        i = self.i = self._find(pos, True)
        if i < self.n:  # run i may be partly done: its iovec starts at the first byte left
            off = pos - self._end(i - 1)
            if off:
                self._slots[2 * i] = int(self._addrs[i]) + off
                self._slots[2 * i + 1] = int(self._lens[i]) - off
