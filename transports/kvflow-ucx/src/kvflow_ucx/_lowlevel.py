"""Typed wrapper over ``kvflow_ucx._native``: workers, memory maps, endpoints, batched RMA.

Nothing outside this module touches ``ffi`` or ``lib``. Every UCS status other than ``UCS_OK``
becomes a kvflow exception whose message names the operation and the UCS status
(``ucp_get_nbx: Connection reset by remote peer (UCS_ERR_CONNECTION_RESET)``).

Completions are not Python callbacks: the C shim appends ``(id, kind, status)`` events to the
worker, and :meth:`Worker.events` drains them after :meth:`Worker.progress`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from kvflow import (
    LLMException,
    LLMFailed,
    LLMFeatureNotEnabled,
    LLMLinkFailed,
    LLMOutOfMemory,
    LLMParamInvalid,
    LLMTimeoutError,
)

__all__ = [
    "EV_EP_ERROR",
    "EV_OP",
    "UCS_ERR_BUSY",
    "UCS_OK",
    "Endpoint",
    "MemMap",
    "Op",
    "Worker",
    "load",
    "status_name",
    "ucx_error",
    "versions",
]

_native: Any = None
_load_error: str | None = None


def _built_against_wheel() -> bool:
    """Whether the extension was built against the libucx wheel (its marker string says so)."""
    spec = importlib.util.find_spec(f"{__package__}._native")
    if spec is None or not spec.origin:
        return False
    try:
        with open(spec.origin, "rb") as f:
            return b"KVFLOW_UCX_ORIGIN=wheel\0" in f.read()
    except OSError:
        return False


def _preload_wheel() -> bool:
    try:
        import libucx
    except ImportError:
        return False
    libucx.load_library()
    return True


def _import_native() -> Any:
    """Import the extension. Built against the libucx wheel, the wheel's libraries are loaded
    first (as ucxx does), so that a system libucp.so.0 on the default path is never picked."""
    wheel = _built_against_wheel()
    if wheel and not _preload_wheel():
        raise ImportError("kvflow-ucx was built against libucx-cu12, which is not installed "
                          "(pip install libucx-cu12, or rebuild with KVFLOW_UCX_PREFIX)")
    try:
        from . import _native as mod  # type: ignore[attr-defined,unused-ignore]  # built by cffi
    except ModuleNotFoundError as exc:
        if exc.name == f"{__package__}._native":
            raise ImportError(
                "the native extension kvflow_ucx._native is not built "
                "(pip install ./transports/kvflow-ucx, or python src/kvflow_ucx/_build.py)"
            ) from exc
        raise
    except ImportError as exc:
        raise ImportError(f"cannot load UCX: {exc}; rebuild kvflow-ucx, or fix KVFLOW_UCX_PREFIX's "
                          "library path") from exc
    return mod


def load() -> Any:
    """The native module; ImportError with a remedy if UCX cannot be loaded or is too old."""
    global _native, _load_error
    if _native is not None:
        return _native
    if _load_error is not None:
        raise ImportError(_load_error)
    try:
        mod = _import_native()
        p = mod.ffi.new("unsigned[5]")
        mod.lib.kvf_versions(p + 0, p + 1, p + 2, p + 3, p + 4)
        if (p[2], p[3]) < (p[0], p[1]):
            raise ImportError(
                f"UCX library {p[2]}.{p[3]}.{p[4]} is older than the headers kvflow-ucx was built "
                f"against ({p[0]}.{p[1]}); rebuild kvflow-ucx or fix the library path"
            )
    except ImportError as exc:
        _load_error = str(exc)
        raise
    _native = mod
    _init_constants(mod.lib)
    return mod


_STATUS_NAMES: dict[int, str] = {}
UCS_OK = 0
UCS_ERR_BUSY = -15
EV_OP = 1
EV_EP_ERROR = 2

_LINK_ERRORS = {
    "UCS_ERR_CONNECTION_RESET",
    "UCS_ERR_ENDPOINT_TIMEOUT",
    "UCS_ERR_UNREACHABLE",
    "UCS_ERR_NOT_CONNECTED",
    "UCS_ERR_REJECTED",
    "UCS_ERR_CANCELED",
    "UCS_ERR_IO_ERROR",
    "UCS_ERR_SOME_CONNECTS_FAILED",
    "UCS_ERR_SHMEM_SEGMENT",
    "UCS_ERR_NO_PROGRESS",
}
_BY_NAME: dict[str, type[LLMException]] = {
    "UCS_ERR_NO_MEMORY": LLMOutOfMemory,
    "UCS_ERR_EXCEEDS_LIMIT": LLMOutOfMemory,
    "UCS_ERR_TIMED_OUT": LLMTimeoutError,
    "UCS_ERR_INVALID_PARAM": LLMParamInvalid,
    "UCS_ERR_INVALID_ADDR": LLMParamInvalid,
    "UCS_ERR_OUT_OF_RANGE": LLMParamInvalid,
    "UCS_ERR_MESSAGE_TRUNCATED": LLMParamInvalid,
    "UCS_ERR_BUFFER_TOO_SMALL": LLMParamInvalid,
    "UCS_ERR_NO_ELEM": LLMParamInvalid,
    "UCS_ERR_UNSUPPORTED": LLMFeatureNotEnabled,
    "UCS_ERR_NOT_IMPLEMENTED": LLMFeatureNotEnabled,
    "UCS_ERR_NO_DEVICE": LLMFeatureNotEnabled,
    **{name: LLMLinkFailed for name in _LINK_ERRORS},
}


def _init_constants(lib: Any) -> None:
    global UCS_OK, UCS_ERR_BUSY, EV_OP, EV_EP_ERROR
    for name in dir(lib):
        if name == "UCS_OK" or (name.startswith("UCS_ERR_") and not name.startswith(("UCS_ERR_FIRST",
                                                                                    "UCS_ERR_LAST"))):
            _STATUS_NAMES.setdefault(int(getattr(lib, name)), name)
    UCS_OK = lib.UCS_OK
    UCS_ERR_BUSY = lib.UCS_ERR_BUSY
    EV_OP = lib.KVF_EV_OP
    EV_EP_ERROR = lib.KVF_EV_EP_ERROR


def status_name(status: int) -> str:
    """``UCS_ERR_...`` for a status (link and endpoint failure ranges are named by range)."""
    name = _STATUS_NAMES.get(status)
    if name is not None:
        return name
    if -59 <= status <= -40:
        return f"UCS_ERR_LINK_FAILURE({status})"
    if -89 <= status <= -60:
        return f"UCS_ERR_ENDPOINT_FAILURE({status})"
    return f"UCS_STATUS({status})"


def ucx_error(status: int, what: str) -> LLMException:
    """The kvflow exception for a failed UCX call ``what`` that returned ``status``."""
    name = status_name(status)
    text = _native.ffi.string(_native.lib.kvf_status_string(status)).decode() if _native else name
    cls = _BY_NAME.get(name)
    if cls is None:
        cls = LLMLinkFailed if -89 <= status <= -40 else LLMFailed
    return cls(f"{what}: {text} ({name})")


def _check(status: int, what: str) -> None:
    if status != UCS_OK:
        raise ucx_error(status, what)


def versions() -> dict[str, str]:
    """UCX versions: the headers built against, the library loaded, and where the build's UCX came
    from (``wheel`` for libucx-cu12, else the KVFLOW_UCX_PREFIX it was built with)."""
    mod = load()
    p = mod.ffi.new("unsigned[5]")
    mod.lib.kvf_versions(p + 0, p + 1, p + 2, p + 3, p + 4)
    return {"headers": f"{p[0]}.{p[1]}", "library": f"{p[2]}.{p[3]}.{p[4]}",
            "origin": mod.ffi.string(mod.lib.kvf_origin()).decode()}


def _take_string(ptr: Any) -> str:
    if ptr == _native.ffi.NULL:
        return ""
    try:
        return _native.ffi.string(ptr).decode(errors="replace")
    finally:
        _native.lib.kvf_free(ptr)


@dataclass
class MemMap:
    """One ``ucp_mem_map`` of a registered region and its packed remote key."""

    memh: Any
    rkey: bytes
    addr: int
    nbytes: int


class Op:
    """One batch of RMA (or one close) in flight; completes with one ``EV_OP`` event."""

    __slots__ = ("_op", "id")

    def __init__(self, worker: Worker, op_id: int) -> None:
        self.id = op_id
        self._op = worker.lib.kvf_op_new(worker._h, op_id)
        if self._op == worker.ffi.NULL:
            raise LLMOutOfMemory("kvf_op_new: out of memory")

    def status(self) -> int:
        """The first error of the op so far (``UCS_OK`` if none)."""
        return _native.lib.kvf_op_status(self._op)

    def finish(self) -> int | None:
        """Stop issuing. The final status if everything already completed, else None (an event follows)."""
        st = _native.ffi.new("int *")
        done = _native.lib.kvf_op_finish(self._op, st)
        self._op = None
        return int(st[0]) if done else None


def check_runs(laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray, lidx: np.ndarray,
               lbounds: np.ndarray, ridx: np.ndarray, rbounds: np.ndarray) -> int:
    """-1 if every run lies inside its region on both sides, else ``2*i`` (run ``i``'s local side is
    outside) or ``2*i + 1`` (its remote side). Bounds are uint64 ``[start0, end0, start1, ...]``."""
    ffi = _native.ffi
    return _native.lib.kvf_check_runs(
        lengths.size, ffi.from_buffer("uint64_t[]", laddr), ffi.from_buffer("uint64_t[]", raddr),
        ffi.from_buffer("uint64_t[]", lengths), ffi.from_buffer("int64_t[]", lidx),
        ffi.from_buffer("uint64_t[]", lbounds), lbounds.size // 2, ffi.from_buffer("int64_t[]", ridx),
        ffi.from_buffer("uint64_t[]", rbounds), rbounds.size // 2,
    )


def block1_table(lbase: np.ndarray, rbase: np.ndarray, stride: int, lblock: int, rblock: int) -> np.ndarray:
    """``kvf_block1_table``: the (5, n) run table ``rma_block1`` moves (for the planner tests)."""
    ffi = _native.ffi
    out = np.empty((5, lbase.size), dtype=np.uint64)
    _native.lib.kvf_block1_table(lbase.size, ffi.from_buffer("uint64_t[]", lbase),
                                 ffi.from_buffer("uint64_t[]", rbase), stride, lblock, rblock,
                                 ffi.from_buffer("uint64_t[]", out))
    return out


def bounds(starts: list[int], sizes: list[int]) -> np.ndarray:
    """``[start0, end0, start1, end1, ...]`` as uint64, for :func:`check_runs`."""
    out = np.empty(2 * len(starts), dtype=np.uint64)
    out[0::2] = starts
    out[1::2] = np.array(starts, dtype=np.uint64) + np.array(sizes, dtype=np.uint64)
    return out


class Endpoint:
    """A ``ucp_ep_h`` created from a peer's worker address, with peer error handling."""

    def __init__(self, worker: Worker, address: bytes, ep_id: int) -> None:
        self.worker = worker
        self.id = ep_id
        out = worker.ffi.new("kvf_ep **")
        _check(worker.lib.kvf_ep_create(worker._h, address, ep_id, out), "ucp_ep_create")
        self._e = out[0]

    @property
    def _h(self) -> Any:
        """The native endpoint; LLMLinkFailed once closed (never a NULL into C)."""
        if self._e is None:
            raise LLMLinkFailed("the ucx endpoint is closed")
        return self._e

    def rkey_unpack(self, packed: bytes) -> Any:
        """An unpacked remote key (``ucp_rkey_h``); destroy with :meth:`Worker.rkey_destroy`."""
        out = self.worker.ffi.new("ucp_rkey_h *")
        _check(self.worker.lib.kvf_ep_rkey_unpack(self._h, packed, out), "ucp_ep_rkey_unpack")
        return out[0]

    def rma(self, op: Op, is_put: bool, laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray,
            lidx: np.ndarray, memh_tab: Any, ridx: np.ndarray, rkey_tab: Any, max_bytes: int) -> int:
        """Issue ``ucp_put_nbx``/``ucp_get_nbx`` for runs from the start of the arrays until
        ``max_bytes`` are issued (puts then get one ``ucp_ep_flush_nbx``, so they complete once
        the peer has the bytes); returns the number issued. Arrays: uint64 addresses and lengths,
        int64 indices into ``memh_tab`` and ``rkey_tab``. An error is left in ``op.status()``."""
        ffi = _native.ffi
        return _native.lib.kvf_rma(
            op._op, self._h, 1 if is_put else 0, lengths.size,
            ffi.from_buffer("uint64_t[]", laddr), ffi.from_buffer("uint64_t[]", raddr),
            ffi.from_buffer("uint64_t[]", lengths), ffi.from_buffer("int64_t[]", lidx),
            memh_tab, ffi.from_buffer("int64_t[]", ridx), rkey_tab, max_bytes,
        )

    def rma_now(self, is_put: bool, table: np.ndarray, memh_tab: Any, lbounds: np.ndarray, rkey_tab: Any,
                rbounds: np.ndarray, max_bytes: int, max_ns: int) -> tuple[int, int, int, Op | None]:
        """``kvf_rma_now``: check, issue and complete the runs of a (5, n) uint64 ``RunBatch.table``
        on the spot if they total at most ``max_bytes``. Returns (result, status, events waiting,
        op): result -1 (done, with that status), -3 (too large), -4 (out of memory), 2*i or 2*i + 1
        (run i out of bounds locally / remotely; nothing issued for any of these) or -2 (still in
        flight after ``max_ns``: the op, to ``finish()``)."""
        ffi = _native.ffi
        w = self.worker
        st, nev, left = w._now_out
        op_id = w.next_id()
        r = int(_native.lib.kvf_rma_now(
            self._h, op_id, 1 if is_put else 0, table.shape[1], ffi.from_buffer("uint64_t[]", table),
            ffi.from_buffer("uint64_t[]", lbounds), lbounds.size // 2, memh_tab,
            ffi.from_buffer("uint64_t[]", rbounds), rbounds.size // 2, rkey_tab, max_bytes, max_ns, st, nev,
            left))
        op = None
        if r == -2:
            op = Op.__new__(Op)
            op.id, op._op = op_id, left[0]
        return r, int(st[0]), int(nev[0]), op

    def rma_block1(self, is_put: bool, lbase: np.ndarray, rbase: np.ndarray, stride: int, lblock: int,
                   rblock: int, memh_tab: Any, lbounds: np.ndarray, rkey_tab: Any,
                   rbounds: np.ndarray, max_bytes: int, max_ns: int) -> tuple[int, int, int, Op | None]:
        """``kvf_rma_block1``: ``rma_now`` of block ``lblock`` of every local tensor and block
        ``rblock`` of the same remote tensor (``*base``: the tensors' uint64 start addresses), planned
        in C. Same results as ``rma_now``."""
        ffi = _native.ffi
        w = self.worker
        st, nev, left = w._now_out
        op_id = w.next_id()
        r = int(_native.lib.kvf_rma_block1(
            self._h, op_id, 1 if is_put else 0, lbase.size, ffi.from_buffer("uint64_t[]", lbase),
            ffi.from_buffer("uint64_t[]", rbase), stride, lblock, rblock,
            ffi.from_buffer("uint64_t[]", lbounds), lbounds.size // 2, memh_tab,
            ffi.from_buffer("uint64_t[]", rbounds), rbounds.size // 2, rkey_tab, max_bytes, max_ns, st, nev,
            left))
        op = None
        if r == -2:
            op = Op.__new__(Op)
            op.id, op._op = op_id, left[0]
        return r, int(st[0]), int(nev[0]), op

    def flush(self, op: Op) -> None:
        """Add a ``ucp_ep_flush_nbx`` to ``op`` (remote completion of its puts)."""
        _native.lib.kvf_op_flush(op._op, self._h)

    def close(self, op: Op, force: bool) -> None:
        """Start ``ucp_ep_close_nbx``; ``op`` completes when the endpoint is released."""
        _native.lib.kvf_ep_close(self._h, 1 if force else 0, op._op)
        self._e = None

    def info(self) -> str:
        """``ucp_ep_print_info``: the lanes and transports this endpoint uses."""
        return _take_string(_native.lib.kvf_ep_info(self._e)) if self._e is not None else ""


class Worker:
    """A UCP context (features RMA and WAKEUP) and one worker on it, or (``parent``) another worker on
    the parent's context. Every call takes the context's lock, so the loop thread and the worker's
    helper thread (:meth:`helper_start`) take turns.

    ``config`` entries are UCX variables without the ``UCX_`` prefix (``{"TLS": "tcp"}``) and
    override the environment for this worker only."""

    EVENT_BATCH = 256

    def __init__(self, config: Mapping[str, str] | None = None, *, parent: Worker | None = None) -> None:
        mod = load()
        self.ffi = ffi = mod.ffi
        self.lib = lib = mod.lib
        out = ffi.new("kvf_worker **")
        if parent is not None:
            _check(lib.kvf_worker_sibling(parent._h, out), "ucp_worker_create")
        else:
            items = [(k.encode(), str(v).encode()) for k, v in (config or {}).items()]
            keep = [ffi.new("char[]", s) for kv in items for s in kv]
            keys = ffi.new("const char *[]", [keep[2 * i] for i in range(len(items))] or [ffi.NULL])
            vals = ffi.new("const char *[]", [keep[2 * i + 1] for i in range(len(items))] or [ffi.NULL])
            st = lib.kvf_worker_create(keys, vals, len(items), out)
            if st != UCS_OK:
                bad = ", ".join(f"UCX_{k.decode()}={v.decode()}" for k, v in items)
                raise ucx_error(st, f"ucp_init/ucp_worker_create{' (' + bad + ')' if bad else ''}")
        self._w = out[0]
        self._siblings: list[Worker] = []
        if parent is not None:
            parent._siblings.append(self)
        self.efd: int = lib.kvf_worker_efd(self._w)
        self.notify_fd: int = lib.kvf_worker_notify_fd(self._w)
        buf = ffi.new("void **")
        n = ffi.new("size_t *")
        _check(lib.kvf_worker_address(self._w, buf, n), "ucp_worker_query")
        try:
            self.address: bytes = bytes(ffi.buffer(buf[0], n[0]))
        finally:
            lib.kvf_free(buf[0])
        self._ev = ffi.new("kvf_event[]", self.EVENT_BATCH)
        self._more = ffi.new("int *")
        self._now_out = (ffi.new("int *"), ffi.new("int *"), ffi.new("kvf_op **"))
        self._next_id = 1

    @property
    def alive(self) -> bool:
        return self._w is not None

    @property
    def _h(self) -> Any:
        """The native worker; LLMLinkFailed once destroyed (never a NULL into C)."""
        if self._w is None:
            raise LLMLinkFailed("the ucx worker is closed")
        return self._w

    def next_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def new_op(self) -> Op:
        return Op(self, self.next_id())

    def progress(self, max_rounds: int = 1024, max_us: int = 500, spin_us: int = 0) -> bool:
        """``ucp_worker_progress`` until it reports no work (for ``spin_us``: keep polling that long
        for more), ``max_rounds`` calls or ``max_us`` pass. True if it stopped with work left."""
        more = self._more
        self.lib.kvf_worker_progress(self._h, max_rounds, max_us * 1000, spin_us * 1000, more)
        return bool(more[0])

    def events(self) -> list[tuple[int, int, int]]:
        """Completions since the last call, as ``(id, kind, status)``."""
        out: list[tuple[int, int, int]] = []
        ev = self._ev
        while True:
            n = self.lib.kvf_worker_events(self._h, ev, self.EVENT_BATCH)
            out.extend((ev[i].id, ev[i].kind, ev[i].status) for i in range(n))
            if n < self.EVENT_BATCH:
                return out

    def inflight(self) -> int:
        """Bytes of get/put issued on this worker that have not completed yet."""
        return self.lib.kvf_worker_inflight(self._h)

    def wake_below(self, nbytes: int) -> None:
        """Have the helper thread tell the loop (:attr:`notify_fd`) each time a completed chunk
        leaves fewer than ``nbytes`` in flight; 0 for only events and its stop."""
        self.lib.kvf_worker_wake_below(self._h, nbytes)

    def helper_start(self, idle: bool = True) -> None:
        """Have the worker's helper thread progress it until no RMA byte is in flight; it writes to
        :attr:`notify_fd` when there are events to drain or window freed (:meth:`wake_below`), and
        once when it stops.
        ``idle``: the thread, when first started, runs under ``SCHED_IDLE``."""
        _check(self.lib.kvf_helper_start(self._h, 1 if idle else 0), "pthread_create")

    def helper_busy(self) -> bool:
        """Whether the helper thread is progressing the worker (the loop then only drains events)."""
        return bool(self.lib.kvf_helper_busy(self._h))

    def rkey_destroy(self, rkey: Any) -> None:
        """Destroy an rkey unpacked on one of this worker's endpoints."""
        self.lib.kvf_rkey_destroy(self._h, rkey)

    def arm(self) -> int:
        """``ucp_worker_arm``: ``UCS_OK`` (safe to sleep on ``efd``) or ``UCS_ERR_BUSY`` (progress again)."""
        st = self.lib.kvf_worker_arm(self._h)
        if st not in (UCS_OK, UCS_ERR_BUSY):
            raise ucx_error(st, "ucp_worker_arm")
        return st

    def mem_map(self, addr: int, nbytes: int, host: bool = True) -> MemMap:
        """``ucp_mem_map`` an existing buffer (host memory, or detected, e.g. CUDA) and pack its rkey."""
        ffi, lib = self.ffi, self.lib
        out = ffi.new("ucp_mem_h *")
        mem_type = lib.KVF_MEM_HOST if host else lib.KVF_MEM_AUTO
        _check(lib.kvf_mem_map(self._h, addr, nbytes, mem_type, out), "ucp_mem_map")
        memh = out[0]
        buf = ffi.new("void **")
        n = ffi.new("size_t *")
        st = lib.kvf_rkey_pack(self._h, memh, buf, n)
        if st != UCS_OK:
            lib.kvf_mem_unmap(self._h, memh)
            raise ucx_error(st, "ucp_rkey_pack")
        try:
            rkey = bytes(ffi.buffer(buf[0], n[0]))
        finally:
            lib.kvf_free(buf[0])
        return MemMap(memh, rkey, addr, nbytes)

    def mem_unmap(self, m: MemMap) -> None:
        _check(self.lib.kvf_mem_unmap(self._h, m.memh), "ucp_mem_unmap")

    def memh_table(self, maps: list[MemMap]) -> Any:
        """A C array of memory handles, indexed like ``maps``."""
        return self.ffi.new("ucp_mem_h[]", [m.memh for m in maps])

    def rkey_table(self, rkeys: list[Any]) -> Any:
        return self.ffi.new("ucp_rkey_h[]", rkeys)

    def connect(self, address: bytes) -> Endpoint:
        return Endpoint(self, address, self.next_id())

    def info(self) -> str:
        """``ucp_worker_print_info``."""
        return _take_string(self.lib.kvf_worker_info(self._h))

    def context_info(self) -> str:
        """``ucp_context_print_info``: the memory domains and transport resources UCX opened."""
        return _take_string(self.lib.kvf_context_info(self._h))

    def transports(self) -> list[str]:
        """The transport resources of the context, as ``tl/device`` (``rc_mlx5/mlx5_0:1``, ``tcp/lo``...)."""
        out = []
        for line in self.context_info().splitlines():
            if "resource" in line and "/" in line:
                out.append(line.rsplit(None, 1)[-1])
        return out

    def sibling(self) -> Worker:
        """Another worker on this worker's UCP context: memory maps and packed rkeys serve both.
        :meth:`destroy` destroys it first."""
        return Worker(parent=self)

    def destroy(self) -> None:
        """Destroy the worker, and its context unless it is a sibling (endpoints must be closed
        first; siblings go first)."""
        for sib in self._siblings:
            sib.destroy()
        self._siblings.clear()
        if self._w is not None:
            self.lib.kvf_worker_destroy(self._w)
            self._w = None

