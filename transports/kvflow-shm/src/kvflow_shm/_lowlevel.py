"""Typed wrapper over ``kvflow_shm._native``: the only module that touches ``ffi`` / ``lib``.

Hazardous: these calls read and write another process's memory at raw addresses.
:func:`transfer` checks every run against region tables before a byte moves; :func:`vm_copy`
is the unchecked raw path for probes and benchmarks.
Failures raise kvflow exceptions; ``OSError`` and cffi errors never escape.
"""

from __future__ import annotations

import errno
import functools
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
    "FAST_MAX_BLOCKS",
    "IOV_MAX",
    "MAX_CHUNK",
    "CopyStopped",
    "Pair",
    "Regions",
    "RunOutOfBounds",
    "StopFlag",
    "blocks_result",
    "error_for_errno",
    "native_error",
    "plan_blocks",
    "probe_read",
    "ptrace_hint",
    "scratch",
    "transfer",
    "transfer_blocks",
    "transfer_table",
    "vm_copy",
]

IOV_MAX = 1024
#: Block lists longer than this never take the one-call fast path (:func:`transfer_blocks`).
FAST_MAX_BLOCKS = 64
#: Nor do transfers of more runs than this: an iovec costs about 0.6 µs in the syscall, and the
#: copy runs on the caller's (the event loop's) thread.
FAST_MAX_RUNS = 256
#: Bytes per syscall at most; the stop flag is polled between syscalls. A kernel without preemption
#: (``PREEMPT_NONE``, common on servers) runs a syscall to its end before a waking event loop thread
#: may have the core: 8 MiB syscalls (about 1 ms) made 1 ms ticks 3-5 ms late; 256 KiB ones took
#: the p99 of 4 MiB pulls from 0.27-0.33 ms (1 MiB) to 0.16-0.20, at the same copy throughput
#: (docs/decisions.md, "Copy threads yield to event loops", issue 13).
MAX_CHUNK = 256 << 10

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


class Pair:
    """One (local cache, remote cache) pair over one link, described once for :func:`transfer_blocks`:
    the peer's pid, the block size and count of each side, and each side's tensor regions (base,
    size) in tensor order, which every run is checked against (local: what we registered; remote:
    what the peer described). Tensor ``t`` pairs with tensor ``t``: both sides have as many."""

    __slots__ = ("_keep", "c", "copy", "copy1")

    def __init__(self, pid: int, stride: int, local_blocks: int, remote_blocks: int, local: Regions,
                 remote: Regions, inline_limit: int) -> None:
        ffi, _ = _native()
        if local.n != remote.n or local.n == 0:
            raise LLMParamInvalid(f"a pair needs as many tensors on both sides, got {local.n} and {remote.n}")
        c = ffi.new("struct kvf_pair *")
        c.pid = pid
        c.ntensors = local.n
        c.stride = stride
        c.lblocks = local_blocks
        c.rblocks = remote_blocks
        c.lbase, c.lsize, c.rbase, c.rsize = local._cb, local._cs, remote._cb, remote._cs
        c.inline_limit = min(inline_limit, _NO_LIMIT)
        c.max_runs = FAST_MAX_RUNS
        self.c = c
        self._keep = (local, remote)  # the C struct points into their arrays
        #: ``kvf_blocks`` bound to this pair: ``copy(write, src, len(src), dst, len(dst), out)``, with
        #: no Python frame in between (see :func:`transfer_blocks` for what it returns)
        self.copy = functools.partial(_lib.kvf_blocks, c)
        #: ``kvf_block1`` bound to this pair: ``copy1(write, src, dst, out)`` for a single block
        self.copy1 = functools.partial(_lib.kvf_block1, c)


def transfer_blocks(pair: Pair, write: bool, src: list[int], dst: list[int], out: Any) -> int:
    """Check, plan and copy a block transfer over every tensor of ``pair`` in one C call:
    ``src[i]`` to ``dst[i]`` (pull: remote to local; push, ``write``: local to remote). The lists
    must hold plain ints (the caller checks ``type(b) is int``: a bool would pass as 0 or 1).

    Returns the bytes moved (the runs are in ``out[1]``), or 0 when the fast path declines (bad
    input or a batch too large for it): then nothing moved, and the caller takes the Python path,
    which raises the typed error or moves the batch elsewhere. Raises like :func:`transfer` when the
    copy itself fails. ``out``: a :func:`scratch`. The hot path calls ``pair.copy`` itself and
    :func:`blocks_result` only when it did not return a positive count."""
    try:
        if len(src) == 1 and len(dst) == 1:
            r = pair.copy1(write, src[0], dst[0], out)
        else:
            r = pair.copy(write, src, len(src), dst, len(dst), out)
    except OverflowError:  # an index beyond int64
        return 0
    return r if r > 0 else blocks_result(pair, r, write, out)


def blocks_result(pair: Pair, r: int, write: bool, out: Any) -> int:
    """What a ``pair.copy`` result ``r`` that is not positive means: 0 if declined, else the error."""
    if r == -_lib.KVF_DECLINED:
        return 0
    return _failed(_lib, -r, write, pair.c.pid, out)


def plan_blocks(pair: Pair, write: bool, src: list[int], dst: list[int]) -> np.ndarray | None:
    """The runs that :func:`transfer_blocks` would move, as a (5, n) ``RunBatch`` table (local
    address, remote address, length, local tensor, remote tensor), or None when it would decline.
    Moves nothing: for tests that hold the C planner to kvflow's."""
    ffi, lib = _native()
    cap = IOV_MAX
    rows = np.zeros((4, cap), dtype=np.uint64)
    ptrs = [ffi.from_buffer("uint64_t[]", rows[i]) for i in range(4)]
    try:
        n = lib.kvf_plan_blocks(pair.c, 1 if write else 0, src, len(src), dst, len(dst), *ptrs, cap)
    except OverflowError:
        return None
    if n < 0:
        return None
    return np.stack([rows[0, :n], rows[1, :n], rows[2, :n], rows[3, :n], rows[3, :n]])


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
