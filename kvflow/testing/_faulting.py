"""Memory whose pages fault until the test says so: a peer's cache that stalls a copy mid-syscall.

A copy from (``process_vm_readv``, UCX over shared memory) or into such memory waits inside the
kernel until ``resolve`` fills the pages, which is how tests hold a transfer in flight on demand
and check what cancel, close or unregister do meanwhile. Linux userfaultfd, "missing pages" mode;
it needs root, ``CAP_SYS_PTRACE`` or ``vm.unprivileged_userfaultfd=1``."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine, -1)
_UFFDIO_API, _UFFDIO_REGISTER, _UFFDIO_COPY = 0xC018AA3F, 0xC020AA00, 0xC028AA03


class FaultingMemory:
    """``nbytes`` of anonymous memory at ``addr`` whose every page faults until resolved.
    Raises OSError where userfaultfd is not allowed (tests skip then)."""

    def __init__(self, nbytes: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        self._libc = libc
        fd = libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK) if _SYS_USERFAULTFD > 0 else -1
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"userfaultfd: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        self._map = mmap.mmap(-1, nbytes)
        self.nbytes = nbytes
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        api = ctypes.create_string_buffer(struct.pack("QQQ", 0xAA, 0, 0), 24)
        reg = ctypes.create_string_buffer(struct.pack("QQQQ", self.addr, nbytes, 1, 0), 32)  # missing pages
        if libc.ioctl(fd, _UFFDIO_API, api) != 0 or libc.ioctl(fd, _UFFDIO_REGISTER, reg) != 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"userfaultfd ioctl: {os.strerror(err)}")

    def resolve(self, value: int, lo: int = 0, hi: int | None = None) -> int:
        """Fill the pages of bytes ``lo``..``hi`` (page-aligned; default all) with ``value``: a copy
        stalled on them goes on. Returns the ioctl's result (0 on success)."""
        hi = self.nbytes if hi is None else hi
        n = hi - lo
        src = ctypes.create_string_buffer(bytes([value]) * n, n)
        copy = ctypes.create_string_buffer(struct.pack("QQQQq", self.addr + lo, ctypes.addressof(src), n, 0, 0), 40)
        return int(self._libc.ioctl(self._fd, _UFFDIO_COPY, copy))
