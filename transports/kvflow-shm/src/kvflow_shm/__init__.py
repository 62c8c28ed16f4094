"""kvflow transport ``shm``: zero-copy KV cache moves between processes on one Linux host.

One ``process_vm_readv`` / ``process_vm_writev`` syscall copies a whole batch of runs straight
between the two processes' registered memory (Linux cross-memory attach): no socket, no
staging buffer, no shared mapping. It needs the same kernel and PID namespace and
ptrace-class access to the peer (same uid, or CAP_SYS_PTRACE; see ``docs/shm.md``).

Importing this package never fails; a missing native module or an unusable syscall is
reported by :meth:`ShmTransport.unavailable_reason`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import logging
import os
import socket
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from kvflow import LLMException, LLMLinkFailed, LLMParamInvalid, Placement
from kvflow.transport import (
    Endpoint,
    LinkChannel,
    LocalCache,
    RemoteCache,
    RunBatch,
    Transport,
    TransportContext,
)

from . import _lowlevel as ll

__all__ = ["ShmEndpoint", "ShmTransport"]
__version__ = "0.1.0"

log = logging.getLogger("kvflow.shm")

#: Batches of at most this many bytes are copied on the event loop thread (option ``kvflow.shm.InlineBytes``).
DEFAULT_INLINE_BYTES = 256 << 10
#: Copy threads per LlmDataDist (option ``kvflow.shm.Threads``).
DEFAULT_THREADS = 2
#: A batch is split over the worker threads only into parts of at least this many bytes.
SPLIT_BYTES = 4 << 20
#: Environment switch that turns the transport off on this machine.
DISABLE_ENV = "KVFLOW_SHM_DISABLE"
PROBE_BYTES = 16


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@functools.lru_cache(maxsize=1)
def _self_probe() -> str | None:
    """Why the syscall cannot be used in this process, or None (probes our own memory once)."""
    reason = ll.native_error()
    if reason:
        return reason
    want = os.urandom(PROBE_BYTES)
    buf = ctypes.create_string_buffer(want, PROBE_BYTES)
    try:
        got = ll.probe_read(os.getpid(), ctypes.addressof(buf), PROBE_BYTES)
    except LLMException as exc:
        return f"process_vm_readv unusable here (seccomp or kernel config?): {exc.args[0]}"
    if got != want:
        return "process_vm_readv self-probe returned wrong bytes"
    return None


def _int_option(options: Mapping[str, str], key: str, default: int, lo: int) -> int:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw), 0)
    except ValueError:
        raise LLMParamInvalid(f"option {key}={raw!r} is not an integer") from None
    if value < lo:
        raise LLMParamInvalid(f"option {key}={raw!r} must be >= {lo}")
    return value


class _Op:
    """A copy running in worker threads: its parts and their shared stop flag."""

    __slots__ = ("futs", "stop")

    def __init__(self, stop: ll.StopFlag, futs: list[asyncio.Future[int]]) -> None:
        self.stop = stop
        self.futs = futs


async def _settle(futs: list[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, whatever cancellations arrive meanwhile."""
    for fut in futs:
        while not fut.done():
            try:
                await asyncio.wait((fut,))
            except asyncio.CancelledError:
                continue
        if not fut.cancelled():
            fut.exception()  # retrieved: the caller raises its own error


def _split(args: tuple[Any, ...], total: int, threads: int) -> list[tuple[Any, ...]]:
    """``transfer`` arguments cut at run boundaries into up to ``threads`` parts of similar size."""
    lens = args[4]
    k = min(threads, total // SPLIT_BYTES, lens.size)
    if k < 2:
        return [args]
    cum = np.cumsum(lens, dtype=np.uint64)
    cuts = np.searchsorted(cum, (np.arange(1, k, dtype=np.uint64) * np.uint64(total // k)), side="left") + 1
    bounds = [0, *sorted({int(c) for c in cuts if 0 < c < lens.size}), lens.size]
    head, arrays, tail = args[:2], args[2:7], args[7:]
    return [(*head, *(a[lo:hi] for a in arrays), *tail) for lo, hi in itertools.pairwise(bounds)]


class ShmEndpoint(Endpoint):
    """The data path to one peer process: every run is checked, then moved by one syscall batch."""

    def __init__(self, transport: ShmTransport, pid: int, pidfd: int | None, channel: LinkChannel) -> None:
        self._transport = transport
        self.pid = pid
        self._pidfd = pidfd
        self._channel = channel
        self._loop = asyncio.get_running_loop()
        self._closed: LLMException | None = None
        self._inflight: set[_Op] = set()
        self._watching = False
        self._out = ll.scratch()  # for copies on the loop thread
        if pidfd is not None:
            try:
                self._loop.add_reader(pidfd, self._on_peer_exit)
                self._watching = True
            except (NotImplementedError, OSError, ValueError) as exc:  # loop without fd readers
                log.debug("shm: cannot watch pid %d for exit: %s", pid, exc)

    def __repr__(self) -> str:
        state = f"CLOSED ({self._closed.args[0]})" if self._closed else "OPEN"
        return f"<ShmEndpoint pid={self.pid} {state} inflight={len(self._inflight)}>"

    def read_now(self, batch: RunBatch, write: bool = False) -> bool:
        """Check every run, then copy the batch here if it is at most ``kvflow.shm.InlineBytes``."""
        if self._closed is not None:
            raise LLMLinkFailed(f"shm endpoint to pid {self.pid} is closed: {self._closed.args[0]}")
        t = self._transport
        try:
            moved = ll.transfer_table(self.pid, write, batch.table, t._local_regions(batch.local_cache),
                                      _remote_regions(batch.remote_cache), t.inline_bytes, self._out)
        except ll.RunOutOfBounds as exc:
            raise _out_of_bounds(batch, exc) from None
        except LLMLinkFailed as exc:
            self._broken(exc)
            raise
        return moved >= 0

    def write_now(self, batch: RunBatch) -> bool:
        return self.read_now(batch, True)

    async def read(self, batch: RunBatch) -> None:
        await self._run(False, batch)

    async def write(self, batch: RunBatch) -> None:
        await self._run(True, batch)

    async def _run(self, write: bool, batch: RunBatch) -> None:
        if self.read_now(batch, write):
            return
        t = self._transport
        args = (self.pid, write, batch.local_addrs, batch.remote_addrs, batch.lengths, batch.local_tensor,
                batch.remote_tensor, t._local_regions(batch.local_cache), _remote_regions(batch.remote_cache))
        # Too large for the loop thread: copy in worker threads with the GIL released, a big
        # batch split by bytes over the threads. One stop flag covers every part.
        stop = ll.StopFlag()
        pool = t._executor()
        cfs: list[Future[int]] = [pool.submit(ll.transfer, *part, stop=stop)
                                  for part in _split(args, batch.nbytes, t.threads)]
        futs = [asyncio.wrap_future(cf, loop=self._loop) for cf in cfs]
        op = _Op(stop, futs)
        self._inflight.add(op)
        try:
            await asyncio.wait(futs, return_when=asyncio.FIRST_EXCEPTION)
            if not all(f.done() for f in futs):  # one part failed: stop the others first
                stop.set()
                await _settle(futs)
            errors = [e for f in futs if not f.cancelled() and (e := f.exception()) is not None]
            if errors:
                raise next((e for e in errors if not isinstance(e, ll.CopyStopped)), errors[0])
        except asyncio.CancelledError:
            # No byte may land after we raise: stop each copy loop at its next syscall boundary
            # (or before it starts) and wait for the threads to let go of our memory.
            stop.set()
            for cf in cfs:
                cf.cancel()
            await _settle(futs)
            raise
        except ll.CopyStopped:
            raise (self._closed or LLMLinkFailed("shm copy stopped")) from None
        except LLMLinkFailed as exc:
            self._broken(exc)
            raise
        finally:
            self._inflight.discard(op)

    def _broken(self, exc: LLMException) -> None:
        if self._closed is None:
            self.abort(exc)
            self._loop.call_soon(self._channel.broken, exc)

    def _on_peer_exit(self) -> None:
        self._broken(LLMLinkFailed(f"peer process {self.pid} exited"))

    def abort(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc if isinstance(exc, LLMException) else LLMLinkFailed(str(exc) or type(exc).__name__)
        for op in self._inflight:
            op.stop.set()
        if self._pidfd is not None:
            if self._watching:
                with contextlib.suppress(RuntimeError):  # the loop is already closed
                    self._loop.remove_reader(self._pidfd)
                self._watching = False
            os.close(self._pidfd)
            self._pidfd = None

    async def close(self) -> None:
        self.abort(LLMLinkFailed("link closed"))
        self._transport._endpoints.discard(self)
        pending = [f for op in self._inflight for f in op.futs]
        if pending:
            await asyncio.wait(pending, timeout=10)


def _regions(regions: Any) -> ll.Regions:
    bases = np.fromiter((r.addr for r in regions), dtype=np.uint64, count=len(regions))
    sizes = np.fromiter((r.nbytes for r in regions), dtype=np.uint64, count=len(regions))
    return ll.Regions(bases, sizes)


def _remote_regions(remote: RemoteCache) -> ll.Regions:
    regs = remote.cache.get("shm")
    if regs is None:
        if remote.desc.placement != Placement.HOST:
            raise LLMParamInvalid(f"remote cache {remote.cache_id} is device memory; shm moves host memory only")
        regs = remote.cache["shm"] = _regions(remote.regions)
    return regs


def _out_of_bounds(batch: RunBatch, exc: ll.RunOutOfBounds) -> LLMParamInvalid:
    i = exc.index
    if exc.side == "local":
        where, addr = f"local cache {batch.local_cache.cache_id}", batch.local_addrs[i]
    else:
        rc = batch.remote_cache
        where, addr = f"remote cache {rc.cache_id} of cluster {rc.cluster_id}", batch.remote_addrs[i]
    return LLMParamInvalid(f"run {i} ({int(addr):#x}+{int(batch.lengths[i])}) is outside {where}")


class ShmTransport(Transport):
    """Cross-memory attach (``process_vm_readv``/``writev``) between processes of one host."""

    name = "shm"
    supports_device_memory = False

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.inline_bytes = _int_option(ctx.options, "kvflow.shm.InlineBytes", DEFAULT_INLINE_BYTES, 0)
        self.threads = _int_option(ctx.options, "kvflow.shm.Threads", DEFAULT_THREADS, 1)
        self._nonce = os.urandom(PROBE_BYTES)
        self._probe = ctypes.create_string_buffer(self._nonce, PROBE_BYTES)
        self._pool: ThreadPoolExecutor | None = None
        self._local: dict[int, tuple[LocalCache, ll.Regions]] = {}
        self._endpoints: set[ShmEndpoint] = set()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        return _self_probe()

    # ------------------------------------------------------------------ registration
    def register(self, cache: LocalCache) -> list[bytes | None]:
        self._local_regions(cache)
        return [None] * len(cache.regions)

    def unregister(self, cache: LocalCache) -> None:
        self._local.pop(cache.cache_id, None)

    def _local_regions(self, cache: LocalCache) -> ll.Regions:
        entry = self._local.get(cache.cache_id)
        if entry is None or entry[0] is not cache:
            if any(r.placement != Placement.HOST for r in cache.regions):
                raise LLMParamInvalid(f"cache {cache.cache_id} is device memory; shm moves host memory only")
            entry = self._local[cache.cache_id] = (cache, _regions(cache.regions))
        return entry[1]

    # ------------------------------------------------------------------ handshake
    def describe(self) -> dict[str, Any]:
        return {
            "boot_id": _boot_id(),
            "hostname": socket.gethostname(),
            "pid_ns": _pid_ns(),
            "pid": os.getpid(),
            "uid": os.getuid(),
            "probe_addr": ctypes.addressof(self._probe),
            "probe_len": PROBE_BYTES,
            "nonce": self._nonce,
        }

    def check_peer(self, info: Mapping[str, Any]) -> str | None:
        try:
            boot_id, pid_ns, pid = str(info["boot_id"]), int(info["pid_ns"]), int(info["pid"])
            addr, n, nonce = int(info["probe_addr"]), int(info["probe_len"]), bytes(info["nonce"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"peer sent an incomplete shm description ({exc!r})"
        host = info.get("hostname", "?")
        if not boot_id or boot_id != _boot_id():
            return f"different host (peer {host} boot id {boot_id or '?'})"
        if pid_ns != _pid_ns():
            return f"different PID namespace (peer pid {pid} in pid ns {pid_ns}, ours {_pid_ns()})"
        if not 0 < n <= 64 or len(nonce) != n:
            return "peer sent a malformed probe region"
        try:
            got = ll.probe_read(pid, addr, n)
        except LLMException as exc:
            return f"probe read failed: {exc.args[0]}"
        if got != nonce:
            return f"probe read of pid {pid} returned other bytes (not the peer process)"
        return None

    async def connect(self, info: Mapping[str, Any], channel: LinkChannel) -> Endpoint:
        reason = self.check_peer(info)
        if reason is not None:
            raise LLMLinkFailed(f"shm: {reason}")
        pid = int(info["pid"])
        pidfd: int | None = None
        if pid != os.getpid():
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                raise LLMLinkFailed(f"shm: peer process {pid} is gone") from None
            except (OSError, AttributeError) as exc:  # old kernel: no exit watch
                log.debug("shm: pidfd_open(%d) failed: %s", pid, exc)
            # The pidfd pins the identity of whatever process has this pid now: prove it is the peer.
            reason = self.check_peer(info)
            if reason is not None:
                if pidfd is not None:
                    os.close(pidfd)
                raise LLMLinkFailed(f"shm: {reason}")
        ep = ShmEndpoint(self, pid, pidfd, channel)
        self._endpoints.add(ep)
        return ep

    # ------------------------------------------------------------------ threads
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvflow-shm")
        return self._pool

    async def close(self) -> None:
        endpoints, self._endpoints = self._endpoints, set()
        for ep in endpoints:
            await ep.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._local.clear()
