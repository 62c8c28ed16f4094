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
import hmac
import itertools
import logging
import os
import random
import select
import socket
import struct
import threading
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
#: Batches of more runs than this are never copied on the event loop thread, whatever their size: an
#: iovec costs about 0.6 us in the syscall (16,384 runs of 16 bytes held the loop for 10 ms).
INLINE_RUNS = 256
#: Copy threads per LlmDataDist (option ``kvflow.shm.Threads``).
DEFAULT_THREADS = 2
#: A batch is split over the worker threads only into parts of at least this many bytes.
SPLIT_BYTES = 4 << 20
#: Environment switch that turns the transport off on this machine.
#: Seconds between the warnings of a close() that waits for a copy stalled inside its syscall.
CLOSE_WARN_S = 10.0
DISABLE_ENV = "KVFLOW_SHM_DISABLE"
PROBE_BYTES = 16
_CAP_SYS_PTRACE = 19
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+
_UDS_PREFIX = "kvflow-shm-"
_BINDING = 32
_RENDEZVOUS_S = 5.0  # a paired Unix connection must show its binding within this
#: Rendezvous connections accepted and being paired at once; beyond it they wait in the listen
#: backlog (as long as the kernel's somaxconn allows), where further dialers get EAGAIN and retry.
_MAX_PAIRING = 4096
_RETRY_FIRST_S = 0.001  # first pause of a dialer that found the rendezvous backlog full; doubles per try
_RETRY_MAX_S = 0.1
_MAX_PAIRS = 1024  # (remote, local) cache pairs described for blocks_now per endpoint; then start over


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def _yama_reason(path: str = "/proc/sys/kernel/yama/ptrace_scope", status: str = "/proc/self/status") -> str | None:
    """Why Yama keeps this process from reading a peer that is not its descendant, or None."""
    scope = _read(path)
    if scope in ("", "0"):
        return None
    if scope == "3":
        return "Yama ptrace_scope=3 forbids process_vm_readv between processes (fall back to tcp)"
    cap_eff = next((line.split()[1] for line in _read(status).splitlines() if line.startswith("CapEff:")), "0")
    if int(cap_eff, 16) & (1 << _CAP_SYS_PTRACE):
        return None
    return (f"Yama ptrace_scope={scope} lets a process read only its descendants without CAP_SYS_PTRACE "
            "(set it to 0, or grant CAP_SYS_PTRACE; kvflow falls back to tcp)")


@functools.lru_cache(maxsize=1)
def _self_probe() -> str | None:
    """Why the syscall cannot be used in this process, or None (probes our own memory once)."""
    reason = ll.native_error() or _yama_reason()
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


class _Rendezvous:
    """An abstract-namespace Unix socket on which the two ends of a link meet, so that each learns
    the other's process from the kernel. A connection is paired only if it presents the link's
    binding (known to the two ends alone), and answered with a proof of the same binding."""

    def __init__(self) -> None:
        self.name = _UDS_PREFIX + os.urandom(12).hex()
        self._loop = asyncio.get_running_loop()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(_MAX_PAIRING)
            self._sock.setblocking(False)
            self._loop.add_reader(self._sock.fileno(), self._accept)
        except BaseException:
            self._sock.close()
            raise
        self._waiters: dict[bytes, asyncio.Future[socket.socket]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._paused = False  # at _MAX_PAIRING: not accepting until a pairing ends

    @staticmethod
    def _proof(binding: bytes) -> bytes:
        return hmac.new(binding, b"kvflow-shm-rendezvous", "sha256").digest()

    async def dial(self, name: str, binding: bytes) -> socket.socket:
        """The initiator's side: connect to the peer's rendezvous and pair with ``binding``. While
        the peer's backlog is full, tried again after a jittered pause, until the caller's timeout
        cancels it."""
        full = 0
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect("\0" + name)  # a Unix socket connects at once, or fails
                break
            except BlockingIOError:  # EAGAIN: the backlog is full (a link storm)
                sock.close()
            except OSError as exc:
                sock.close()
                tried = f" after its backlog was full {full} times" if full else ""
                raise LLMLinkFailed(f"shm: cannot reach the peer's rendezvous socket{tried}: "
                                    f"{exc.strerror or exc}") from None
            except BaseException:
                sock.close()
                raise
            full += 1
            await asyncio.sleep(random.uniform(0.0, min(_RETRY_MAX_S, _RETRY_FIRST_S * 2 ** min(full, 16))))
        try:
            await self._loop.sock_sendall(sock, binding)
            proof = await _recv_exact(self._loop, sock, 32)
            if not hmac.compare_digest(proof, self._proof(binding)):
                raise LLMLinkFailed("shm: the rendezvous socket did not prove that it belongs to the peer")
        except OSError as exc:
            sock.close()
            raise LLMLinkFailed(f"shm: cannot reach the peer's rendezvous socket: {exc.strerror or exc}") from None
        except BaseException:
            sock.close()
            raise
        return sock

    async def wait(self, binding: bytes) -> socket.socket:
        """The acceptor's side: the connection that pairs with ``binding``."""
        fut = self._waiters[binding] = self._loop.create_future()
        try:
            return await fut
        finally:
            if self._waiters.get(binding) is fut:
                del self._waiters[binding]

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("shm rendezvous: accept failed: %s", exc)
                return
            sock.setblocking(False)
            task = self._loop.create_task(self._pair(sock))
            self._tasks.add(task)
            task.add_done_callback(self._paired)
            if len(self._tasks) >= _MAX_PAIRING:  # a flood: leave the rest in the backlog
                self._loop.remove_reader(self._sock.fileno())
                self._paused = True
                return

    def _paired(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._paused and self._sock.fileno() >= 0:
            self._paused = False
            self._loop.add_reader(self._sock.fileno(), self._accept)

    async def _pair(self, sock: socket.socket) -> None:
        try:
            async with asyncio.timeout(_RENDEZVOUS_S):
                binding = await _recv_exact(self._loop, sock, _BINDING)
            fut = self._waiters.get(binding)
            if fut is None or fut.done():
                sock.close()
                return
            await self._loop.sock_sendall(sock, self._proof(binding))
            if fut.done():  # the link gave up meanwhile
                sock.close()
                return
            fut.set_result(sock)
        except (OSError, TimeoutError, LLMException):
            sock.close()

    async def identify(self, sock: socket.socket) -> tuple[int, int | None]:
        """The peer process behind a paired socket, from the kernel: (pid, pidfd or None), once we
        know that we may read and write its memory."""
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if pid <= 0:
            raise LLMLinkFailed("shm: the peer's process is not visible from here (another PID namespace)")
        pidfd: int | None = None
        if pid != os.getpid():
            try:
                pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
            except OSError:
                try:  # older kernel: a pidfd by number, confirmed below while the peer is still connected
                    pidfd = os.pidfd_open(pid)
                except OSError as exc:
                    raise LLMLinkFailed(f"shm: peer process {pid} is gone ({exc.strerror})") from None
            try:
                _check_access(pid)
                # Each side answers only after it holds its pidfd: the peer is then alive, so the
                # pid was not reused in between.
                await self._loop.sock_sendall(sock, b"\1")
                if await _recv_exact(self._loop, sock, 1) != b"\1":
                    raise LLMLinkFailed("shm: the peer broke off the rendezvous")
            except OSError as exc:
                os.close(pidfd)
                raise LLMLinkFailed(f"shm: the peer broke off the rendezvous ({exc.strerror or exc})") from None
            except BaseException:
                os.close(pidfd)
                raise
        return pid, pidfd

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for task in self._tasks:
            task.cancel()
        for fut in self._waiters.values():
            fut.cancel()


def _check_access(pid: int) -> None:
    """LLMLinkFailed unless the kernel lets us access process ``pid``'s memory (the ptrace access
    check behind process_vm_readv, made by opening /proc/PID/mem: nothing is read)."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # no /proc here: the first copy will tell
    except PermissionError as exc:
        raise LLMLinkFailed(f"shm: no access to the memory of peer process {pid} ({exc.strerror}: another "
                            "uid, or Yama ptrace_scope; see docs/shm.md)") from None
    os.close(fd)


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise LLMLinkFailed("shm: the peer closed the rendezvous socket")
        buf += chunk
    return buf


class _Op:
    """A copy running in worker threads: the stop flag its parts share, and a future done once
    none of them can write any more (``close`` waits for it)."""

    __slots__ = ("finished", "stop")

    def __init__(self, stop: ll.StopFlag, finished: asyncio.Future[None]) -> None:
        self.stop = stop
        self.finished = finished


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


class _Parts:
    """One batch's copy on the copy threads: its parts share ``stop``, and the last part to end sets
    ``done`` to the error to raise (None: every byte moved). One future per batch, so the event loop
    is woken once when the batch is over, not once per part and once more for its check."""

    __slots__ = ("_errors", "_left", "_lock", "done", "stop")

    def __init__(self, stop: ll.StopFlag) -> None:
        self.stop = stop
        self.done: Future[BaseException | None] = Future()
        self._lock = threading.Lock()
        self._left = 0
        self._errors: list[BaseException] = []

    def start(self, pool: ThreadPoolExecutor, args: tuple[Any, ...], total: int, threads: int) -> None:
        """Submit the copy, split by bytes over the threads."""
        self._submit(pool, _split(args, total, threads))

    def check_and_start(self, pool: ThreadPoolExecutor, table: np.ndarray, args: tuple[Any, ...], total: int,
                        threads: int) -> None:
        """On a copy thread: check every run of the batch (RunOutOfBounds before any byte moves),
        then submit its copy, split by bytes over the threads."""
        pid, write, *_, lregions, rregions = args
        try:
            if self.stop.is_set():
                raise ll.CopyStopped(0)
            ll.transfer_table(pid, write, table, lregions, rregions, 0, ll.scratch())  # checks; moves nothing
            parts = _split(args, total, threads)
        except BaseException as exc:  # noqa: BLE001 - the batch's result: raised on the loop
            self._left = 1
            self._end(exc)
            return
        self._submit(pool, parts)

    def _submit(self, pool: ThreadPoolExecutor, parts: list[tuple[Any, ...]]) -> None:
        self._left = len(parts)
        for i, part in enumerate(parts):
            try:
                pool.submit(self._copy, part)
            except RuntimeError:  # the pool is shutting down: the parts submitted stop early
                self.stop.set()
                for _ in parts[i:]:
                    self._end(LLMLinkFailed("shm transport is closing: its copy threads are shut down"))
                return

    def _copy(self, part: tuple[Any, ...]) -> None:
        try:
            if self.stop.is_set():  # cancelled, or another part failed, before this one began
                raise ll.CopyStopped(0)
            ll.transfer(*part, stop=self.stop)
        except BaseException as exc:  # noqa: BLE001 - the batch's result: raised on the loop
            if not isinstance(exc, ll.CopyStopped):
                self.stop.set()  # the other parts stop at their next syscall
            self._end(exc)
        else:
            self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        with self._lock:
            if exc is not None:
                if isinstance(exc, (ll.CopyStopped, LLMException)):  # raised again on the loop: its
                    exc.__traceback__ = None  # thread frames (which hold self) would make a cycle
                self._errors.append(exc)
            self._left -= 1
            if self._left:
                return
            errors = self._errors
        self.done.set_result(next((e for e in errors if not isinstance(e, ll.CopyStopped)), errors[0])
                             if errors else None)


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

    now_threadsafe = True  # read_now: one C call; off the loop thread it reaches the loop thread-safely
    max_runs = 65536  # a large batch is checked, split and copied on the copy threads: the loop is woken
    # once per batch, so a 1 GiB plan of 16 KiB blocks wakes it once, not eight times

    def __init__(self, transport: ShmTransport, pid: int, pidfd: int | None, channel: LinkChannel) -> None:
        self._transport = transport
        self.pid = pid
        self._pidfd = pidfd
        self._channel = channel
        self._loop = asyncio.get_running_loop()
        self._closed: LLMException | None = None
        self._inflight: set[_Op] = set()
        self._watching = False
        self._exited = False
        self._out = ll.scratch()  # for copies on the loop thread
        # (remote, local cache id) -> (local, remote, blocks_now's description or None: never applies)
        self._pairs: dict[tuple[int, int], tuple[LocalCache, RemoteCache, ll.Pair | None]] = {}
        self._loop_thread = threading.get_ident()
        if pidfd is not None:
            try:
                self._loop.add_reader(pidfd, self._on_peer_exit)
                self._watching = True
            except (NotImplementedError, OSError, ValueError) as exc:  # loop without fd readers
                log.debug("shm: cannot watch pid %d for exit: %s", pid, exc)

    def __repr__(self) -> str:
        state = f"CLOSED ({self._closed.args[0]})" if self._closed else "OPEN"
        return f"<ShmEndpoint pid={self.pid} {state} inflight={len(self._inflight)}>"

    def _check_open(self) -> None:
        if self._closed is not None:
            raise LLMLinkFailed(f"shm endpoint to pid {self.pid} is closed: {self._closed.args[0]}")

    def read_now(self, batch: RunBatch, write: bool = False) -> bool:
        """Check every run, then copy the batch here if it is at most ``kvflow.shm.InlineBytes`` in at
        most ``INLINE_RUNS`` runs."""
        self._check_open()
        t = self._transport
        out = self._out if threading.get_ident() == self._loop_thread else ll.scratch()
        try:
            table = batch.table  # every run is checked here (batches of more runs: on a copy thread)
            moved = ll.transfer_table(self.pid, write, table, t._local_regions(batch.local_cache),
                                      _remote_regions(batch.remote_cache),
                                      t.inline_bytes if table.shape[1] <= INLINE_RUNS else 0, out)
        except ll.RunOutOfBounds as exc:
            raise _out_of_bounds(batch, exc) from None
        except LLMLinkFailed as exc:
            self._broken(exc)
            raise
        return moved >= 0

    def write_now(self, batch: RunBatch) -> bool:
        return self.read_now(batch, True)

    def blocks_now(self, write: bool, local: LocalCache, remote: RemoteCache, src_blocks: list[int] | tuple[int, ...],
                   dst_blocks: list[int] | tuple[int, ...]) -> tuple[int, int] | None:
        """Check, plan and copy a block transfer over every tensor in one C call (``ll.transfer_blocks``);
        None when it declines (then the core plans in Python: a typed error, or ``read_now``/``read``)."""
        if self._closed is not None:
            return None  # the core's path raises
        entry = self._pairs.get((remote.cache_id, local.cache_id))
        if entry is None or entry[0] is not local or entry[1] is not remote:
            entry = self._pair(local, remote)
        pair = entry[2]
        if pair is None:
            return None
        out = self._out if threading.get_ident() == self._loop_thread else ll.scratch()
        try:
            n = len(src_blocks)
            if n == 1 and len(dst_blocks) == 1:  # the common tiny pull: no lists to convert
                r = pair.copy1(write, src_blocks[0], dst_blocks[0], out)
            else:
                r = pair.copy(write, src_blocks, n, dst_blocks, len(dst_blocks), out)
            if r > 0:
                return r, out[1]
            if not ll.blocks_result(pair, r, write, out):
                return None
        except OverflowError:  # an index beyond int64: the core's path says so
            return None
        except LLMLinkFailed as exc:
            self._broken(exc)
            raise
        raise AssertionError("kvf_blocks moved nothing without an error")  # pragma: no cover

    def _pair(self, local: LocalCache, remote: RemoteCache) -> tuple[LocalCache, RemoteCache, ll.Pair | None]:
        """The C description of (local, remote) for ``blocks_now``, None where the fast path never
        applies (tensor counts or block sizes differ, device memory: the core's path says why)."""
        key = (remote.cache_id, local.cache_id)
        ld, rd = local.desc, remote.desc
        if (ld.num_tensors != rd.num_tensors or ld.stride != rd.stride or len(local.regions) != ld.num_tensors
                or len(remote.regions) != rd.num_tensors or rd.placement != Placement.HOST):
            pair = None
        else:
            try:
                lregs, rregs = self._transport._local_regions(local), _remote_regions(remote)
            except LLMParamInvalid:
                pair = None
            else:
                pair = ll.Pair(self.pid, ld.stride, ld.num_blocks, rd.num_blocks, lregs, rregs,
                               self._transport.inline_bytes)
        if len(self._pairs) >= _MAX_PAIRS:
            self._pairs.clear()
        entry = self._pairs[key] = (local, remote, pair)
        return entry

    def forget_local(self, cache_id: int) -> None:
        """Drop the pairs of local cache ``cache_id`` (unregistered). A kvflow.sync caller's thread may
        add pairs meanwhile (under GUARD, which the loop does not take here): iterate over a copy."""
        for key in [k for k in list(self._pairs) if k[1] == cache_id]:
            self._pairs.pop(key, None)

    async def read(self, batch: RunBatch) -> None:
        await self._run(False, batch)

    async def write(self, batch: RunBatch) -> None:
        await self._run(True, batch)

    async def _run(self, write: bool, batch: RunBatch) -> None:
        if len(batch) <= INLINE_RUNS and self.read_now(batch, write):
            return
        self._check_open()
        t = self._transport
        args = (self.pid, write, batch.local_addrs, batch.remote_addrs, batch.lengths, batch.local_tensor,
                batch.remote_tensor, t._local_regions(batch.local_cache), _remote_regions(batch.remote_cache))
        stop = ll.StopFlag()
        op = _Op(stop, self._loop.create_future())
        self._inflight.add(op)
        try:
            err = await self._copy(batch, args, stop)
        finally:
            self._inflight.discard(op)
            op.finished.set_result(None)
        if err is None:
            return
        try:  # raised here, from no frame that holds it: no reference cycle for the collector
            if isinstance(err, ll.RunOutOfBounds):
                raise _out_of_bounds(batch, err) from None
            if isinstance(err, ll.CopyStopped):
                raise (_fresh(self._closed) if self._closed else LLMLinkFailed("shm copy stopped")) from None
            if isinstance(err, LLMLinkFailed):
                self._broken(err)
            raise err
        finally:
            err = None

    async def _copy(self, batch: RunBatch, args: tuple[Any, ...], stop: ll.StopFlag) -> BaseException | None:
        """Copy ``batch`` on the copy threads, split by bytes; the error to raise (None: all copied).
        Too large for the loop thread: a batch of more than ``INLINE_RUNS`` runs is also checked and
        split by a copy thread (``_Parts.check_and_start``), so the loop only hands it over. Returns
        only once no part can write any more: on cancellation each part stops at its next syscall
        boundary (or before it starts), and the copy is waited for before the cancellation is raised."""
        t = self._transport
        pool = t._executor()
        parts = _Parts(stop)
        if len(batch) > INLINE_RUNS:
            try:
                pool.submit(parts.check_and_start, pool, batch.table, args, batch.nbytes, t.threads)
            except RuntimeError:  # the pool is shut down: the transport is closing
                return LLMLinkFailed("shm transport is closing: its copy threads are shut down")
        else:  # read_now has checked it
            parts.start(pool, args, batch.nbytes, t.threads)
        done = asyncio.wrap_future(parts.done, loop=self._loop)
        try:
            await asyncio.wait((done,))  # a cancel leaves the copy alone: it is stopped, then waited for
        except asyncio.CancelledError:
            stop.set()
            await _settle([done])
            raise
        return done.result()

    def _broken(self, exc: LLMException) -> None:
        if threading.get_ident() != self._loop_thread:  # a kvflow.sync caller's copy failed
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is left to fail
                self._loop.call_soon_threadsafe(self._broken, exc)
            return
        if self._closed is None:
            self.abort(exc)
            self._loop.call_soon(self._channel.broken, exc)

    def _on_peer_exit(self) -> None:
        self._exited = True
        self._broken(LLMLinkFailed(f"peer process {self.pid} exited"))

    def abort(self, exc: BaseException) -> None:
        if self._closed is None:
            # a copy that was never raised: raising the stored one would give it a traceback holding
            # the raising frame, which holds this endpoint (a cycle left to the collector)
            self._closed = _fresh(exc) if isinstance(exc, LLMException) else LLMLinkFailed(str(exc) or type(exc).__name__)
        for op in self._inflight:
            op.stop.set()
        if self._watching and self._pidfd is not None:  # the pidfd stays open until close(): peer_exited()
            with contextlib.suppress(RuntimeError, ValueError):  # the loop is already closed
                self._loop.remove_reader(self._pidfd)
            self._watching = False

    def peer_exited(self) -> bool:
        if self._pidfd is None:
            return self._exited
        if not self._exited and select.select([self._pidfd], [], [], 0)[0]:  # a pidfd reads ready at exit
            self._exited = True
        return self._exited

    async def close(self) -> None:
        self.abort(LLMLinkFailed("link closed"))
        if self._pidfd is not None:
            self.peer_exited()  # remembered once the fd is gone
            os.close(self._pidfd)
            self._pidfd = None
        self._transport._endpoints.discard(self)
        # No bound on this wait: a copy stalled inside its syscall (a peer whose pages fault slowly)
        # can still write into our memory, so close() returns only once none can. Say so meanwhile.
        pending = {op.finished for op in self._inflight}
        while pending:
            try:
                _, pending = await asyncio.wait(pending, timeout=CLOSE_WARN_S)
            except asyncio.CancelledError:
                continue  # cancelling close() does not release the memory sooner
            if pending:
                log.warning("shm endpoint to pid %d: %d copies still inside a syscall after close; waiting "
                            "for them (their memory stays in use until then)", self.pid, len(pending))


def _fresh(exc: LLMException) -> LLMException:
    """A new exception of the same type, message and status, with no traceback."""
    return type(exc)(exc.args[0] if exc.args else "", exc.status_code)


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
    option_keys = frozenset({"InlineBytes", "Threads"})

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.inline_bytes = ctx.int_option("kvflow.shm.InlineBytes", DEFAULT_INLINE_BYTES, 0)
        self.threads = ctx.int_option("kvflow.shm.Threads", DEFAULT_THREADS, 1)
        self._rv: _Rendezvous | None = None
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
        for ep in self._endpoints:
            ep.forget_local(cache.cache_id)

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
            "pid_ns": _ns_inode("pid"),
            "net_ns": _ns_inode("net"),
            "uds": self._rendezvous().name,
        }

    def check_peer(self, info: Mapping[str, Any]) -> str | None:
        """Whether the peer can be on this host, in this PID and network namespace (no probe of the
        peer: its identity is proven in :meth:`connect`)."""
        try:
            boot_id, pid_ns, net_ns = str(info["boot_id"]), int(info["pid_ns"]), int(info["net_ns"])
            uds = str(info["uds"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"peer sent an incomplete shm description ({exc!r})"
        host = info.get("hostname", "?")
        if not boot_id or boot_id != _boot_id():
            return f"different host (peer {host} boot id {boot_id or '?'})"
        if pid_ns != _ns_inode("pid"):
            return f"different PID namespace (peer's pid ns {pid_ns}, ours {_ns_inode('pid')})"
        if net_ns != _ns_inode("net"):
            return "different network namespace (the shm identity check needs one abstract Unix socket namespace)"
        if not uds.startswith(_UDS_PREFIX) or len(uds) > 100:
            return "peer sent a malformed rendezvous name"
        return None

    async def connect(self, info: Mapping[str, Any], channel: LinkChannel) -> Endpoint:
        """Prove who the peer is through the kernel (``SO_PEERCRED``/``SO_PEERPIDFD`` on a Unix socket
        that only this link's two ends can pair on), check that we may access its memory, and open
        the endpoint to that process: never to a pid the peer claimed."""
        reason = self.check_peer(info)
        if reason is not None:
            raise LLMLinkFailed(f"shm: {reason}")
        rv = self._rendezvous()
        if channel.initiator:
            sock = await rv.dial(str(info["uds"]), channel.binding)
        else:
            sock = await rv.wait(channel.binding)
        try:
            pid, pidfd = await rv.identify(sock)
        finally:
            sock.close()
        ep = ShmEndpoint(self, pid, pidfd, channel)
        self._endpoints.add(ep)
        return ep

    def _rendezvous(self) -> _Rendezvous:
        if self._rv is None:
            self._rv = _Rendezvous()
        return self._rv

    # ------------------------------------------------------------------ threads
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = self.ctx.worker_pool("kvflow-shm", self.threads)
        return self._pool

    async def close(self) -> None:
        endpoints, self._endpoints = self._endpoints, set()
        for ep in endpoints:
            await ep.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._rv is not None:
            self._rv.close()
            self._rv = None
        self._local.clear()
