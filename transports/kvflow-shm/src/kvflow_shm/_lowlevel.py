"""Typed wrapper over ``kvflow_shm._native``: the only module that touches ``ffi`` / ``lib``.

Hazardous: these calls read and write another process's memory at raw addresses.
:func:`transfer` checks every run against region tables before a byte moves; :func:`vm_copy`
is the unchecked raw path for probes and benchmarks.
Failures raise kvflow exceptions; ``OSError`` and cffi errors never escape.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

import numpy as np
from kvflow import (
    LLMException,
    LLMFailed,
    LLMKvCacheNotExist,
    LLMLinkFailed,
    LLMOutOfMemory,
    LLMParamInvalid,
)

__all__ = [
    "IOV_MAX",
    "MAX_CHUNK",
    "CopyStopped",
    "Regions",
    "RunOutOfBounds",
    "StopFlag",
    "error_for_errno",
    "native_error",
    "probe_read",
    "ptrace_hint",
    "scratch",
    "transfer",
    "transfer_table",
    "vm_copy",
]

IOV_MAX = 1024
#: Bytes per syscall at most; the stop flag is polled between syscalls.
MAX_CHUNK = 8 << 20

_ffi: Any = None
_lib: Any = None
_load_error: str | None = None


def _load() -> None:
    global _ffi, _lib, _load_error
    if _lib is not None or _load_error is not None:
        return
    if not sys.platform.startswith("linux"):
        _load_error = f"process_vm_readv needs Linux, this is {sys.platform}"
        return
    try:
        from ._native import ffi, lib
    except ImportError as exc:
        _load_error = f"kvflow_shm native module not built: {exc} (reinstall kvflow-shm with a C compiler)"
        return
    _ffi, _lib = ffi, lib


def native_error() -> str | None:
    """``None`` if the native module is loaded, else why not, in one line."""
    _load()
    return _load_error


def _native() -> tuple[Any, Any]:
    _load()
    if _lib is None:
        raise LLMFailed(f"shm: {_load_error}")
    return _ffi, _lib


class CopyStopped(Exception):
    """A copy stopped early because its :class:`StopFlag` was set; ``done`` bytes had moved."""

    def __init__(self, done: int) -> None:
        super().__init__(f"stopped after {done} bytes")
        self.done = done


class StopFlag:
    """A flag the copy loop polls between syscalls; ``set()`` is safe from any thread."""

    __slots__ = ("_cell",)

    def __init__(self) -> None:
        ffi, _ = _native()
        self._cell = ffi.new("int *")

    def set(self) -> None:
        self._cell[0] = 1

    def is_set(self) -> bool:
        return bool(self._cell[0])


def ptrace_hint() -> str:
    """Why ptrace-class access may be denied here, for error messages."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        scope = ""
    where = f"kernel.yama.ptrace_scope={scope}" if scope else "see kernel.yama.ptrace_scope"
    return f"ptrace denied: same uid or CAP_SYS_PTRACE needed; {where}"


def error_for_errno(err: int, op: str, pid: int, done: int = 0, total: int = 0) -> LLMException:
    """The kvflow exception for a failed ``process_vm_*`` call."""
    name = errno.errorcode.get(err, str(err))
    where = f"{op} on pid {pid}"
    if err == errno.ESRCH:
        return LLMLinkFailed(f"{where}: ESRCH: the peer process is gone")
    if err == errno.EPERM:
        return LLMLinkFailed(f"{where}: EPERM ({ptrace_hint()})")
    if err == errno.EFAULT:
        return LLMKvCacheNotExist(
            f"{where}: EFAULT after {done} of {total} bytes: remote memory is not mapped "
            "(cache unregistered or freed by the peer?)"
        )
    if err == errno.ENOMEM:
        return LLMOutOfMemory(f"{where}: ENOMEM: no memory for the iovec tables")
    if err == errno.EINVAL:
        return LLMParamInvalid(f"{where}: EINVAL: bad iovec (too many or too long)")
    return LLMFailed(f"{where}: {name}: {os.strerror(err)}")


_U64 = np.dtype(np.uint64)
_I64 = np.dtype(np.int64)
_NO_LIMIT = (1 << 64) - 1


def _buf(ffi: Any, a: np.ndarray, dt: np.dtype, ctype: str) -> Any:
    if a.dtype is not dt:
        a = a.astype(dt)
    try:
        return ffi.from_buffer(ctype, a)
    except (ValueError, TypeError, BufferError):  # not contiguous
        return ffi.from_buffer(ctype, np.ascontiguousarray(a))


def scratch() -> Any:
    """A reusable ``out`` argument for :func:`transfer` (use it from one thread only)."""
    ffi, _ = _native()
    return ffi.new("uint64_t[3]")


class RunOutOfBounds(LLMParamInvalid):
    """Run ``index`` leaves its region on the ``side`` ("local" or "remote"); nothing moved."""

    def __init__(self, side: str, index: int) -> None:
        super().__init__(f"run {index} is outside its {side} region")
        self.side = side
        self.index = index


class Regions:
    """A table of regions (base address, size) that runs are checked against, kept as C arrays."""

    __slots__ = ("_cb", "_cs", "bases", "n", "sizes")

    def __init__(self, bases: np.ndarray, sizes: np.ndarray) -> None:
        ffi, _ = _native()
        self.bases = np.ascontiguousarray(bases, dtype=np.uint64)
        self.sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        if self.bases.size != self.sizes.size:
            raise LLMParamInvalid("region table: bases and sizes differ in length")
        self.n = self.bases.size
        self._cb = ffi.from_buffer("uint64_t[]", self.bases)
        self._cs = ffi.from_buffer("uint64_t[]", self.sizes)


def transfer(pid: int, write: bool, local: np.ndarray, remote: np.ndarray, lens: np.ndarray,
             ltensor: np.ndarray, rtensor: np.ndarray, lregions: Regions | None, rregions: Regions | None,
             *, inline_limit: int | None = None, stop: StopFlag | None = None,
             max_chunk: int = MAX_CHUNK, out: Any = None) -> int:
    """Check every run against ``lregions``/``rregions`` (by ``ltensor``/``rtensor``), then move them.

    Returns the total bytes moved; with ``inline_limit`` set and exceeded, moves nothing and
    returns minus the total. Raises RunOutOfBounds before any byte moves, CopyStopped if
    ``stop`` was set, else a kvflow exception; a short copy never passes as success. ``out``:
    a reusable ``uint64_t[3]`` scratch (:func:`scratch`) for callers on one thread."""
    ffi, lib = _native()
    n = lens.size
    if local.size != n or remote.size != n or ltensor.size != n or rtensor.size != n:
        raise LLMParamInvalid("run arrays differ in length")
    if n == 0:
        raise LLMParamInvalid("empty run list")
    fb = ffi.from_buffer
    try:  # fast path: the planner's arrays already have the right type and layout
        if not (local.dtype is _U64 and remote.dtype is _U64 and lens.dtype is _U64
                and ltensor.dtype is _I64 and rtensor.dtype is _I64):
            raise TypeError
        arrays = (fb("uint64_t[]", local), fb("uint64_t[]", remote), fb("uint64_t[]", lens),
                  fb("int64_t[]", ltensor), fb("int64_t[]", rtensor))
    except (TypeError, ValueError, BufferError):
        arrays = (_buf(ffi, local, _U64, "uint64_t[]"), _buf(ffi, remote, _U64, "uint64_t[]"),
                  _buf(ffi, lens, _U64, "uint64_t[]"), _buf(ffi, ltensor, _I64, "int64_t[]"),
                  _buf(ffi, rtensor, _I64, "int64_t[]"))
    if out is None:
        out = ffi.new("uint64_t[3]")
    null = ffi.NULL
    r = lib.kvf_transfer(
        pid, 1 if write else 0, *arrays, n,
        null if lregions is None else lregions._cb, null if lregions is None else lregions._cs,
        0 if lregions is None else lregions.n,
        null if rregions is None else rregions._cb, null if rregions is None else rregions._cs,
        0 if rregions is None else rregions.n,
        _NO_LIMIT if inline_limit is None else inline_limit, max_chunk,
        null if stop is None else stop._cell, out,
    )
    if r >= 0:
        return r
    return _failed(lib, -r, write, pid, out)


def transfer_table(pid: int, write: bool, table: np.ndarray, lregions: Regions, rregions: Regions,
                   inline_limit: int, out: Any) -> int:
    """:func:`transfer` of a (5, n) uint64 table (``RunBatch.table``), in one call and one buffer:
    the path of small batches copied on the event loop's thread. ``out``: a :func:`scratch`."""
    ffi, lib = _ffi, _lib
    if lib is None:
        ffi, lib = _native()
    shape = table.shape
    if len(shape) != 2 or shape[0] != 5 or shape[1] == 0:
        raise LLMParamInvalid(f"expected a non-empty (5, n) run table, got shape {shape}")
    n = shape[1]
    try:
        if table.dtype is not _U64:
            raise TypeError
        buf = ffi.from_buffer("uint64_t[]", table)
    except (TypeError, ValueError, BufferError):  # another dtype, or not contiguous
        buf = ffi.from_buffer("uint64_t[]", np.ascontiguousarray(table, dtype=_U64))
    r = lib.kvf_transfer_table(pid, 1 if write else 0, buf, n, lregions._cb, lregions._cs, lregions.n,
                               rregions._cb, rregions._cs, rregions.n, inline_limit, out)
    if r >= 0:
        return r
    return _failed(lib, -r, write, pid, out)


def _failed(lib: Any, code: int, write: bool, pid: int, out: Any) -> int:
    if code == lib.KVF_DEFERRED:
        return -int(out[2])
    if code == lib.KVF_BAD_LOCAL:
        raise RunOutOfBounds("local", int(out[1]))
    if code == lib.KVF_BAD_REMOTE:
        raise RunOutOfBounds("remote", int(out[1]))
    if code == lib.KVF_STOPPED:
        raise CopyStopped(int(out[0]))
    op = "process_vm_writev" if write else "process_vm_readv"
    raise error_for_errno(code, op, pid, int(out[0]), int(out[2]))


def vm_copy(pid: int, write: bool, local: np.ndarray, remote: np.ndarray, lens: np.ndarray, *,
            stop: StopFlag | None = None, max_chunk: int = MAX_CHUNK) -> int:
    """Move every run between this process and ``pid`` unchecked (``write``: local -> remote).

    The raw path (probes, benchmarks): same errors as :func:`transfer`, no bounds."""
    ffi, lib = _native()
    n = lens.size
    if local.size != n or remote.size != n:
        raise LLMParamInvalid(f"run arrays differ in length ({local.size}, {remote.size}, {n})")
    done = ffi.new("uint64_t *")
    lens = np.ascontiguousarray(lens, dtype=np.uint64)
    r = lib.kvf_vm_copy(pid, 1 if write else 0, _buf(ffi, local, _U64, "uint64_t[]"),
                        _buf(ffi, remote, _U64, "uint64_t[]"), ffi.from_buffer("uint64_t[]", lens), n,
                        max_chunk, ffi.NULL if stop is None else stop._cell, done)
    if r >= 0:
        return int(r)
    if r == -lib.KVF_STOPPED:
        raise CopyStopped(int(done[0]))
    op = "process_vm_writev" if write else "process_vm_readv"
    raise error_for_errno(-int(r), op, pid, int(done[0]), int(lens.sum()))


def probe_read(pid: int, addr: int, nbytes: int) -> bytes:
    """``nbytes`` read from ``addr`` in process ``pid`` (a small probe; raises like :func:`vm_copy`)."""
    buf = np.zeros(nbytes, dtype=np.uint8)
    one = np.ones(1, dtype=np.uint64)
    vm_copy(pid, False, one * np.uint64(buf.ctypes.data), one * np.uint64(addr), one * np.uint64(nbytes))
    return buf.tobytes()
