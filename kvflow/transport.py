"""The transport plugin contract, and finding transports by name.

A transport moves bytes between registered memory here and registered memory on a linked
peer. The core owns everything else: the control connection, cache lookup, planning,
deadlines. A transport implements :class:`Transport` (one instance per ``LlmDataDist``) and
:class:`Endpoint` (one per link), and is found through the entry-point group
``kvflow.transports``::

    [project.entry-points."kvflow.transports"]
    shm = "kvflow_shm:ShmTransport"

The life of a transport on one ``LlmDataDist``:

1. ``unavailable_reason()`` (class method): ``None`` if it can run on this machine, else one line.
2. ``Transport(ctx)``; ``describe()`` goes into the link handshake.
3. ``register(cache)`` / ``unregister(cache)`` for every cache; ``register`` returns one
   descriptor per tensor (``bytes`` or ``None``) that peers receive with the cache's description.
4. At link time both sides call ``check_peer(peer_info)`` on the other's ``describe()``; the first
   transport in the initiator's preference order that both accept is chosen, then each side calls
   ``connect(peer_info, channel)`` and gets an :class:`Endpoint`.
5. ``Endpoint.read(batch)`` / ``write(batch)`` move a :class:`RunBatch`; ``close()`` at unlink.
   ``read_now`` / ``write_now`` (optional) move a tiny batch on the spot, with no deadline;
   ``blocks_now`` (optional) checks, plans and moves a small block transfer in one go.

Rules every transport keeps (``kvflow.testing.check_transport`` checks them):

- Never block the event loop for more than about a millisecond: large copies run in a thread
  (``TransportContext.worker_pool``) or in bounded chunks. A copy thread's syscalls stay short
  (about 1 MiB each): a kernel without preemption runs a syscall to its end before another
  thread may have the core.
- ``read``/``write`` raise an ``LLMException`` subclass on failure (``LLMLinkFailed`` when the
  link itself is gone, ``LLMKvCacheNotExist`` when the peer no longer has the cache).
- When the task awaiting ``read`` is cancelled, ``read`` re-raises only once no further byte of
  that read can land in local memory.
- Report a broken endpoint with ``channel.broken(exc)`` so the core fails the link's futures.

This module is the whole contract: a plugin imports nothing else from kvflow but ``kvflow``
itself. The errors and value types a transport needs are re-exported here, with
:func:`stop_child` for benches that run a peer process. A plugin's raw-baseline bench is found
through the entry-point group ``kvflow.benches`` (a module with ``BASELINE_NAME`` and
``baseline(pid, buf, repeat, remote_addr=)``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Awaitable, ClassVar, Mapping

import numpy as np

from ._memory import CacheUser, LocalCache, Region, Registry
from ._proc import stop_child
from ._status import (
    LLMException,
    LLMFeatureNotEnabled,
    LLMKvCacheNotExist,
    LLMLinkFailed,
    LLMParamInvalid,
    LLMStatusCode,
    LLMTimeoutError,
    error_for,
)
from ._types import CacheDesc, DataType, Placement
from ._workers import DEFAULT_PRIORITY, worker_pool

if TYPE_CHECKING:
    import socket

__all__ = [
    "CacheDesc",
    "CacheUser",
    "DataType",
    "Endpoint",
    "LLMException",
    "LLMFeatureNotEnabled",
    "LLMKvCacheNotExist",
    "LLMLinkFailed",
    "LLMParamInvalid",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LinkChannel",
    "Placement",
    "LocalCache",
    "Region",
    "RemoteCache",
    "RemoteRegion",
    "RunBatch",
    "Started",
    "Transport",
    "TransportContext",
    "error_for",
    "stop_child",
]

log = logging.getLogger("kvflow.transport")


@dataclass(frozen=True)
class RemoteRegion:
    """One tensor of a peer's cache: address, size, and the peer transport's descriptor."""

    addr: int
    nbytes: int
    desc: bytes | None = None


@dataclass(frozen=True)
class Started:
    """What ``read_now`` / ``write_now`` / ``blocks_now`` return for a batch they began on the spot
    but could not finish there (a two-sided transport whose peer had not answered within its poll):
    the core awaits ``done`` as it would ``read``, under the transfer's deadline and with the same
    rules on cancellation. ``nbytes`` and ``runs`` are what ``blocks_now`` moves (for ``stats()``).
    Only endpoints whose ``now_threadsafe`` is False may return one."""

    done: Awaitable[None]
    nbytes: int = 0
    runs: int = 0


@dataclass
class RemoteCache:
    """A peer's cache as seen over one link."""

    cluster_id: int
    cache_id: int
    desc: CacheDesc
    regions: tuple[RemoteRegion, ...]
    inflight: int = 0  # our operations using it; see begin() / end()
    cache: dict[str, Any] = field(default_factory=dict)  # per-transport state (e.g. unpacked rkeys)
    idle: asyncio.Event | None = None

    def begin(self) -> None:
        """An operation of ours starts using this cache's memory."""
        self.inflight += 1

    def end(self) -> None:
        """That operation can no longer touch the peer's memory."""
        self.inflight -= 1
        if self.inflight == 0 and self.idle is not None:
            self.idle.set()

    @cached_property
    def addrs(self) -> np.ndarray:
        """Start address of each tensor, as uint64."""
        return np.fromiter((r.addr for r in self.regions), dtype=np.uint64, count=len(self.regions))


class RunBatch:
    """Runs of one transfer, all in one direction: ``lengths[i]`` bytes between
    ``local_addrs[i]`` (inside ``local_cache`` tensor ``local_tensor[i]``) and ``remote_addrs[i]``
    (inside ``remote_cache`` tensor ``remote_tensor[i]``).

    The runs are one C-contiguous uint64 ``table`` of shape (5, n), rows in the order of
    :data:`ROWS`, so that a native transport can hand all of them over as one buffer; the five
    properties are views of its rows (the tensor rows as int64)."""

    __slots__ = ("local_cache", "remote_cache", "table")

    #: The rows of ``table``.
    ROWS: ClassVar[tuple[str, ...]] = ("local_addrs", "remote_addrs", "lengths", "local_tensor", "remote_tensor")

    def __init__(self, local_addrs: np.ndarray, remote_addrs: np.ndarray, lengths: np.ndarray,
                 local_tensor: np.ndarray, remote_tensor: np.ndarray, local_cache: LocalCache,
                 remote_cache: RemoteCache) -> None:
        n = np.shape(lengths)[0]
        table = np.empty((5, n), dtype=np.uint64)
        for i, row in enumerate((local_addrs, remote_addrs, lengths, local_tensor, remote_tensor)):
            table[i] = row
        self.table = table
        self.local_cache = local_cache
        self.remote_cache = remote_cache

    @classmethod
    def of_table(cls, table: np.ndarray, local_cache: LocalCache, remote_cache: RemoteCache) -> RunBatch:
        """A batch over an existing (5, n) uint64 table (not copied)."""
        batch = cls.__new__(cls)
        batch.table = table
        batch.local_cache = local_cache
        batch.remote_cache = remote_cache
        return batch

    @property
    def local_addrs(self) -> np.ndarray:
        return self.table[0]

    @property
    def remote_addrs(self) -> np.ndarray:
        return self.table[1]

    @property
    def lengths(self) -> np.ndarray:
        return self.table[2]

    @property
    def local_tensor(self) -> np.ndarray:
        return self.table[3].view(np.int64)

    @property
    def remote_tensor(self) -> np.ndarray:
        return self.table[4].view(np.int64)

    @property
    def nbytes(self) -> int:
        lengths = self.table[2]
        return sum(lengths.tolist()) if lengths.size <= 64 else int(lengths.sum())  # numpy's sum: ~1 us

    def __len__(self) -> int:
        return self.table.shape[1]

    def __getitem__(self, part: slice) -> RunBatch:
        """The runs ``part`` (a slice) as a batch of their own (a copy of those columns)."""
        return RunBatch.of_table(np.ascontiguousarray(self.table[:, part]), self.local_cache, self.remote_cache)

    def __repr__(self) -> str:
        return (f"<RunBatch {len(self)} runs, local cache {self.local_cache.cache_id}, "
                f"remote cache {self.remote_cache.cache_id}>")


@dataclass
class TransportContext:
    """What the core hands a transport: who we are, our options, our registered caches."""

    cluster_id: int
    options: Mapping[str, str]
    registry: Registry
    instance: str  # random per LlmDataDist; distinguishes restarts
    #: ``kvflow.WorkerPriority``: the scheduling priority of the threads ``worker_pool`` makes.
    worker_priority: str = DEFAULT_PRIORITY

    def int_option(self, key: str, default: int, lo: int, hi: int | None = None) -> int:
        """The integer option ``key`` (decimal or ``0x``), ``default`` when absent or empty;
        ``LLMParamInvalid`` naming the key when it is not an integer in ``lo..hi``."""
        raw = self.options.get(key)
        if raw is None or raw == "":
            return default
        try:
            value = int(str(raw), 0)
        except ValueError:
            raise LLMParamInvalid(f"option {key}={raw!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise LLMParamInvalid(f"option {key}={raw!r}: expected an integer in {lo}..{'' if hi is None else hi}")
        return value

    def worker_pool(self, name: str, threads: int) -> ThreadPoolExecutor:
        """Threads for bulk copies, at ``worker_priority``: by default ``SCHED_IDLE`` on Linux, so
        that they take only cores that no event loop (nor any other thread) wants."""
        return worker_pool(name, threads, self.worker_priority)


class LinkChannel(abc.ABC):
    """What the core offers a transport while it connects one link."""

    initiator: bool
    peer_cluster_id: int
    #: 32 bytes that only the two ends of this link know (derived from the authenticated
    #: handshake): a transport that opens a side channel (a Unix socket, say) proves with it that
    #: the other end belongs to this link.
    binding: bytes

    @abc.abstractmethod
    async def open_stream(self) -> socket.socket:
        """A connected, non-blocking TCP socket to the peer, dedicated to this link's transport.

        The initiator dials the peer's listen address; the acceptor receives the socket."""

    @abc.abstractmethod
    def broken(self, exc: BaseException) -> None:
        """Report that the endpoint can no longer move data; the core fails the link."""


class Endpoint(abc.ABC):
    """One link's data path."""

    #: True when this side touches the peer's memory itself (shm, ucx): before the peer frees a
    #: cache, the core waits for (and if need be aborts) our operations on it. False when the peer
    #: serves every request itself and checks it against its own registrations (tcp).
    one_sided: ClassVar[bool] = True
    #: True when ``read_now`` / ``write_now`` may also be called from threads other than the event
    #: loop's (``kvflow.sync`` callers), one at a time across the process: they must then reach the
    #: loop only through ``call_soon_threadsafe``. The core retires nothing under such a call.
    now_threadsafe: ClassVar[bool] = False
    #: The most runs the core hands to one ``read`` / ``write`` when it moves a large plan in
    #: batches (capped at 65536: the core makes each batch's table on the loop thread). A transport
    #: that checks and copies a large batch off the loop may raise it, so that a plan wakes the loop
    #: once per batch fewer times; one that does per-run work on the loop keeps the default.
    max_runs: ClassVar[int] = 8192

    @abc.abstractmethod
    async def read(self, batch: RunBatch) -> None:
        """Copy each remote run into its local run."""

    @abc.abstractmethod
    async def write(self, batch: RunBatch) -> None:
        """Copy each local run into its remote run."""

    def read_now(self, batch: RunBatch) -> bool | Started:
        """Optional fast path: do ``read(batch)`` on the calling thread and return True, or move
        nothing and return False (then the core awaits ``read``). The call itself must end within
        microseconds whatever the peer does: the core sets no deadline around it. A batch begun
        here that the peer has not finished by then is returned as a :class:`Started`."""
        return False

    def write_now(self, batch: RunBatch) -> bool | Started:
        """``read_now`` for ``write``."""
        return False

    def blocks_now(self, write: bool, local: LocalCache, remote: RemoteCache, src_blocks: list[int] | tuple[int, ...],
                   dst_blocks: list[int] | tuple[int, ...]) -> tuple[int, int] | Started | None:
        """Optional fastest path of a block transfer over every tensor (no ``ext_param``): check, plan
        and move it on the calling thread at once, and return (bytes moved, runs); or move nothing
        and return None, and the core plans in Python and calls ``read_now`` / ``read``. ``write``:
        push ``local`` to ``remote``, else pull. The block lists hold plain ints (the core checked
        their types, nothing else): every other check is the transport's, and any request it does
        not take, bad input included, is declined: the core's planner then raises the typed error.
        The planning rules must be the core's (``kvflow._plan.plan_blocks``). Same threading and
        size rules as ``read_now``, :class:`Started` included."""
        return None

    def peer_exited(self) -> bool:
        """True once the peer process is known to have exited (so it can no longer touch our memory),
        also after ``abort``. One-sided transports that can tell (shm: a pidfd) say so; the core then
        lets a cache be unregistered without that peer's confirmation."""
        return False

    def abort(self, exc: BaseException) -> None:  # noqa: B027 - optional hook
        """Fail everything in flight at once (the link is gone); must not block."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the endpoint; in-flight operations fail with ``LLMLinkFailed``."""


class Transport(abc.ABC):
    """A way of moving bytes; one instance per LlmDataDist."""

    name: ClassVar[str]
    #: Whether device (GPU/NPU) memory can be registered with this transport.
    supports_device_memory: ClassVar[bool] = False
    #: The keys this transport reads as ``kvflow.<name>.<key>`` options: ``initialize`` refuses any
    #: other key under its name (LLMParamInvalid), so a misspelt option is not silently ignored.
    #: ``None``: the transport checks its own keys (kvflow-ucx passes UCX variables through).
    option_keys: ClassVar[frozenset[str] | None] = None

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` if the transport can run on this machine, else why not, in one line."""
        return None

    def register(self, cache: LocalCache) -> list[bytes | None]:
        """Prepare a newly registered cache; return one descriptor per tensor for peers."""
        return [None] * len(cache.regions)

    def unregister(self, cache: LocalCache) -> None:  # noqa: B027 - optional hook
        """Release what ``register`` prepared."""

    def describe(self) -> dict[str, Any]:
        """This side's handshake information (msgpack-serialisable)."""
        return {}

    def check_peer(self, info: Mapping[str, Any]) -> str | None:
        """``None`` if this transport can reach the peer described by ``info``, else why not."""
        return None

    @abc.abstractmethod
    async def connect(self, info: Mapping[str, Any], channel: LinkChannel) -> Endpoint:
        """Open this link's endpoint to the peer described by ``info``."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport (at finalize)."""
