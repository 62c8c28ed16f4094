"""UcxTransport and UcxEndpoint: one-sided RMA through UCP, driven from the asyncio loop.

One UCP context per transport (that is, per ``LlmDataDist``) with two workers: ours, which
opens our endpoints and issues our operations, and the target, whose address peers connect to.
``register`` maps each tensor with ``ucp_mem_map`` and hands peers its packed rkey; ``connect``
creates an endpoint from the peer's target address with peer error handling; ``read``/``write``
issue a ``ucp_get_nbx``/``ucp_put_nbx`` per run from C, in chunks that each end (for puts) with
one ``ucp_ep_flush_nbx``, a bounded number of bytes in flight per worker, and await one
completion per batch.

A cancelled transfer (its deadline passed) stops issuing and waits for what it issued; if that
takes more than ``CANCEL_SETTLE_S``, it replaces the link's UCP endpoint (``UcxEndpoint._reset``):
the old one is force-closed, which completes its requests as cancelled, and the link stays up.

Progress is event driven: each worker's event fd sits in the loop (``add_reader``); when it is
readable, or after work is issued, the loop progresses the worker for at most half a
millisecond, dispatches completions, and re-arms. ``UCS_ERR_BUSY`` from the arm means there is
more to do, so it progresses again on the next loop iteration; otherwise it sleeps until the
fd fires. An idle linked pair therefore costs no CPU.

Over shared memory (CMA, knem, xpmem) progress is where the bytes are copied, so a batch of at
least ``HELPER_BYTES`` is progressed by the worker's helper thread instead (C, no GIL, under
``SCHED_IDLE`` unless ``kvflow.WorkerPriority=normal``): the loop issues it, stops watching UCX's
fd, and drains the events the helper announces through its own eventfd; the helper stops once no
byte is in flight, and the loop takes over again. One lock per UCP context serializes every call
into UCX between the two threads.

Small batches over shared memory skip all of that: ``read_now``/``write_now`` check, issue and
complete a batch of at most ``NOW_BYTES`` in one C call that polls the worker until it is done,
when the endpoint's RMA lanes are ones this process carries out itself (CMA, knem, xpmem), so that
it completes within microseconds whatever the peer does. Only the loop thread takes this path
(``now_threadsafe`` is False): its events and futures are the loop's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np
from kvflow import LLMException, LLMKvCacheNotExist, LLMLinkFailed, LLMOutOfMemory, LLMParamInvalid, Placement
from kvflow.transport import Endpoint, LinkChannel, LocalCache, RemoteCache, RunBatch, Transport

from . import _lowlevel as ll

log = logging.getLogger("kvflow.ucx")

__all__ = ["UcxEndpoint", "UcxTransport"]

#: Flow control: (bytes of get/put in flight per worker, bytes issued per call into C, largest
#: piece a long run is cut into, runs issued per call into C). Over TCP, UCX emulates RMA with
#: messages and one progress call drains whatever it holds (on either side), so the window bounds
#: the time one call (and so the event loop) can take to about a millisecond; and each get or put
#: is a message sent then and there, so 1024 runs of 512 bytes issued in one call held the loop
#: 7-10 ms (tests/test_loop_hold.py, ucx-tcp): a call issues at most TCP_RUNS runs (0.3 ms or so).
#: Over shared memory (CMA moves one 512 KiB segment per progress call) and RDMA (the NIC moves
#: the bytes) a deep window costs nothing and keeps the pipe full. A put chunk ends with a flush,
#: so put bytes count until the peer has them.
TCP_RUNS = 32
LIMITS_TCP = (4 << 20, 1 << 20, 1 << 20, TCP_RUNS)
#: While get/put bytes are in flight (and no completion is ready), a progress pass keeps polling
#: this long after the last work before it re-arms and sleeps: waking through the fd costs more
#: than a short spin when the next completion is microseconds away. Idle, nothing spins.
SPIN_US = 50
#: How long a cancelled transfer waits for its issued operations to complete before it resets
#: the endpoint. UCX cannot retract a get or put it has started (``ucp_request_cancel`` cancels
#: only tag receives), so the alternative to waiting is force-closing the UCP endpoint: that
#: completes every request on it as cancelled, and nothing lands through it afterwards. Where UCX
#: moves the bytes itself (CMA, RDMA) the issued window drains at copy speed whatever the peer
#: does (up to ``HELPER_WINDOW`` of it: some 200 ms); where it emulates RMA with messages (TCP) a
#: stalled peer holds them until it resumes.
CANCEL_SETTLE_S = 0.05
#: After a reset, how long the cancelled transfer waits for UCX to complete its purged requests.
RESET_PURGE_S = 1.0
#: While operations are in flight and the worker sleeps on its fd, wake up this often anyway
#: (a safety net: UCX signals completions through the fd; ``rescues`` counts the times it did not).
WATCHDOG_S = 0.05
#: A batch of at least this many bytes over lanes where this process moves the bytes itself (CMA,
#: knem, xpmem) is progressed by the worker's helper thread, not on the loop: there each progress
#: call is a copy, and a large transfer held the caller's loop in 0.5 ms passes, back to back.
#: Smaller ones are progressed on the loop: handing over costs about 100 us (the thread's and the
#: loop's wake-ups), so one pull of 1 MiB took 156 us on the loop and 216-226 us through the helper,
#: and the two meet at 2 MiB (265-340 against 297-306 us; docs/benchmarks.md).
HELPER_BYTES = 2 << 20
#: Every batch over other lanes than TCP's is issued in calls of at most HELPER_RUNS runs: a
#: 65536-run batch of 16-byte runs in one call held the loop 15-18 ms (tests/test_loop_hold.py,
#: ucx-sm). One that the helper progresses is issued with a window of HELPER_WINDOW bytes, in such
#: calls (about 0.1 ms of the loop each), and the loop is told only once half the window is free: each
#: time it has to wake to issue more, a host's ``asyncio.sleep`` due after it can fire up to 1 ms
#: late under uvloop's whole-millisecond timers, and 16 MiB chunks in a 64 MiB window woke it every
#: 3 ms of a 1 GiB pull (docs/benchmarks.md). A cancelled batch with more in flight than
#: CANCEL_SETTLE_S drains resets the endpoint instead of waiting.
HELPER_WINDOW = 1 << 30
HELPER_RUNS = 1024
LIMITS_FAST = (64 << 20, 16 << 20, 8 << 20, HELPER_RUNS)
#: ``read_now``/``write_now``: a batch of at most this many bytes is issued and completed on the
#: spot, without the event fd, when the endpoint's RMA lanes are ones where the initiator's own
#: process moves the bytes (cross-memory attach, knem, xpmem: the peer takes no part).
NOW_BYTES = 64 << 10
#: The now-path waits at most this long for its operation, polling the worker on the spot; past it
#: the endpoint is failed (force-closed, so nothing lands later) and the link breaks.
NOW_POLL_S = 0.01
#: ... of which the first part is spent inside the C call, polling without Python.
NOW_SPIN_NS = 200_000
#: UCX transports whose RMA the initiator's process carries out itself.
_LOCAL_RMA_TLS = ("cma/", "knem/", "xpmem/")
#: UCX settings kvflow changes from UCX's defaults unless the environment (``UCX_<VAR>``) or an
#: option sets them. Shared-memory transports offer peer error handling only with
#: MM_ERROR_HANDLING, and (UCX >= 1.22 here) CMA serves one-sided RMA in that mode only with
#: CMA_MEMORY_INVALIDATE; UCX's TCP moves RMA in segments of TCP_*SEG_SIZE (8 KiB by default,
#: several times slower than 256 KiB on loopback). Older UCX names the TCP segment size differently.
UCX_DEFAULTS = {
    "MM_ERROR_HANDLING": "y",
    "CMA_MEMORY_INVALIDATE": "y",
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
}
UCX_DEFAULTS_BEFORE_1_22 = {"MM_ERROR_HANDLING": "y"}
_ENV_ALIASES = {
    "MM_ERROR_HANDLING": ("MM_ERROR_HANDLING", "POSIX_ERROR_HANDLING", "SYSV_ERROR_HANDLING"),
    "TCP_TX_SEG_SIZE": ("TCP_TX_SEG_SIZE", "TCP_SEG_SIZE"),
    "TCP_RX_SEG_SIZE": ("TCP_RX_SEG_SIZE", "TCP_SEG_SIZE"),
}
#: The UCX_TLS names that bring in the transport each default is for (a default for a transport
#: that UCX_TLS leaves out is not set: UCX would warn that it is unused).
_DEFAULT_FOR = {
    "MM_ERROR_HANDLING": {"sm", "shm", "mm", "posix", "sysv"},
    "CMA_MEMORY_INVALIDATE": {"sm", "shm", "cma"},
    "TCP_TX_SEG_SIZE": {"tcp"},
    "TCP_RX_SEG_SIZE": {"tcp"},
}


def _uses(tls: str, names: set[str]) -> bool:
    """Whether a UCX_TLS value (``all``, ``tcp,sm``, ``^ud``...) may bring in one of ``names``."""
    tokens = {t.strip() for t in tls.split(",") if t.strip()}
    if not tokens or "all" in tokens:
        return True
    if any(t.startswith("^") for t in tokens):
        return not {t.lstrip("^") for t in tokens} >= names
    return bool(tokens & names)
_OPTION_PREFIX = "kvflow.ucx."
#: kvflow-ucx's own options (``kvflow.ucx.<Name>``); all-capital names are UCX variables.
KNOWN_OPTIONS = {"RequireRdma": ("auto", "yes", "no")}
#: UCX transport names that are RDMA (InfiniBand / RoCE verbs and their accelerated variants).
RDMA_TLS = ("rc_", "dc_", "ud_", "rc/", "dc/", "ud/", "gga", "srd")


def _ucx_config(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """(UCX settings for one worker, kvflow-ucx options, the settings that are kvflow's defaults)
    from ``kvflow.ucx.*`` options.

    ``kvflow.ucx.TLS=tcp`` sets UCX_TLS for this instance only; kvflow's defaults apply unless
    the environment or an option sets the variable."""
    cfg: dict[str, str] = {}
    own = {name: choices[0] for name, choices in KNOWN_OPTIONS.items()}
    lib = tuple(int(x) for x in ll.versions()["library"].split(".")[:2])
    tls = str(options.get(_OPTION_PREFIX + "TLS", options.get(_OPTION_PREFIX + "UCX_TLS",
                                                                 os.environ.get("UCX_TLS", "all"))))
    for key, value in (UCX_DEFAULTS if lib >= (1, 22) else UCX_DEFAULTS_BEFORE_1_22).items():
        if not _uses(tls, _DEFAULT_FOR[key]):
            continue
        if not any(f"UCX_{n}" in os.environ for n in _ENV_ALIASES.get(key, (key,))):
            cfg[key] = value
    defaults = set(cfg)
    for key, value in options.items():
        if not key.startswith(_OPTION_PREFIX):
            continue
        name = key[len(_OPTION_PREFIX):]
        if name in KNOWN_OPTIONS:
            v = str(value).strip().lower()
            v = {"1": "yes", "true": "yes", "0": "no", "false": "no"}.get(v, v)
            if v not in KNOWN_OPTIONS[name]:
                choices = ", ".join(KNOWN_OPTIONS[name])
                raise LLMParamInvalid(f"option {key}={value!r}: expected one of {choices}")
            own[name] = v
            continue
        var = name.removeprefix("UCX_")
        if not var or var.upper() != var or not var.replace("_", "").isalnum():
            raise LLMParamInvalid(
                f"unknown option {key!r}: expected kvflow.ucx.<UCX variable without UCX_, e.g. TLS> "
                f"or one of {', '.join('kvflow.ucx.' + k for k in KNOWN_OPTIONS)}")
        cfg[var] = str(value)
        defaults.discard(var)
    return cfg, own, defaults


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Done callback: mark a future's exception as retrieved (nobody awaits it)."""
    if not fut.cancelled():
        fut.exception()


def _host_id() -> str:
    """This host: hostname and boot id (two containers on one kernel share shared memory and CMA)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _split(laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray, lidx: np.ndarray, ridx: np.ndarray,
           piece: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The runs cut into pieces of at most ``piece`` bytes (so that a long run is pipelined within
    the in-flight window like many short ones)."""
    p = np.uint64(piece)
    counts = ((lengths + p - np.uint64(1)) // p).astype(np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    k = (np.arange(int(counts.sum()), dtype=np.int64) - first).astype(np.uint64)  # piece number in its run
    rep = np.repeat(np.arange(lengths.size), counts)
    off = k * p
    return (laddr[rep] + off, raddr[rep] + off, np.minimum(lengths[rep] - off, p), lidx[rep], ridx[rep])


class _Progress:
    """Drives one worker from the event loop and turns completion events into futures."""

    def __init__(self, worker: ll.Worker, loop: asyncio.AbstractEventLoop, idle_helper: bool = True) -> None:
        self.worker = worker
        self.idle_helper = idle_helper  # the helper thread runs under SCHED_IDLE (kvflow.WorkerPriority)
        self.loop = loop
        self.ops: dict[int, asyncio.Future[None]] = {}  # op id -> future, until the op's event arrives
        self.what: dict[int, str] = {}
        self.ep_handlers: dict[int, UcxEndpoint] = {}
        self.idle_hooks: list[Any] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._scheduled = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._fd = worker.efd
        self.closed = False
        self.rescues = 0  # completions found by the watchdog, not announced by the fd
        self.wakeups = 0
        self.helper = False  # the worker's helper thread progresses it; the loop only drains events
        self.handovers = 0  # times a batch was handed to the helper thread
        self.notices = 0  # times the helper thread woke the loop (events, freed window, its stop)
        loop.add_reader(self._fd, self._on_readable)
        loop.add_reader(worker.notify_fd, self._on_notify)
        worker.wake_below(0)  # the helper tells the loop of freed window only while it waits for it
        self.kick()

    def track(self, op: ll.Op, what: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self.loop.create_future()
        self.ops[op.id] = fut
        self.what[op.id] = what
        return fut

    def kick(self) -> None:
        """Progress on the next loop iteration."""
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self.loop.call_soon(self._run)

    def next_run(self) -> asyncio.Future[None]:
        """A future resolved after the next progress pass."""
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(fut)
        return fut

    def hand_over(self) -> None:
        """Let the worker's helper thread progress it (and so move the bytes over shared memory)
        until no get/put byte is in flight; meanwhile the loop drains the events it announces."""
        if not self.helper:
            self.helper = True
            self.handovers += 1
            self.loop.remove_reader(self._fd)  # UCX's fd: the helper progresses what wakes it
        self.worker.helper_start(self.idle_helper)

    def _on_readable(self) -> None:
        self.wakeups += 1
        self._run()

    def _on_notify(self) -> None:
        self.notices += 1
        try:
            os.read(self.worker.notify_fd, 8)
        except BlockingIOError:
            pass
        self._run()

    def _watch(self) -> None:
        self._watchdog = None
        if self.closed or not self.ops:
            return
        before = len(self.ops)
        self._run()
        if len(self.ops) < before:
            self.rescues += 1

    def _run(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        w = self.worker
        if self.helper:
            events = w.events()  # draining re-arms the helper's notice: asked after it, no stop is missed
            if w.helper_busy():
                self.dispatch(events)
                self._wake_waiters()
                return
            self.helper = False  # it stopped: nothing is in flight; progress and sleep as usual
            self.loop.add_reader(self._fd, self._on_readable)
            self.dispatch(events)
        more = w.progress(spin_us=SPIN_US)
        self.dispatch(w.events())
        self._wake_waiters()
        if more or w.arm() == ll.UCS_ERR_BUSY:
            self.kick()
        elif (self.ops or self._waiters) and self._watchdog is None:
            self._watchdog = self.loop.call_later(WATCHDOG_S, self._watch)

    def _wake_waiters(self) -> None:
        if self._waiters:
            self.worker.wake_below(0)  # a waiter that still needs window asks again
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def finish(self, op: ll.Op, fut: asyncio.Future[None], what: str) -> None:
        """Stop issuing into ``op``; resolve ``fut`` now if it already completed, else on its event."""
        status = op.finish()
        if status is None:
            self._run()  # progress at once: a shared-memory copy often completes right here
            return
        self.ops.pop(op.id, None)
        self.what.pop(op.id, None)
        self._resolve(fut, status, what)

    @staticmethod
    def _resolve(fut: asyncio.Future[None], status: int, what: str) -> None:
        if fut.done():
            return
        if status == ll.UCS_OK:
            fut.set_result(None)
        else:
            fut.set_exception(ll.ucx_error(status, what))

    def dispatch(self, events: list[tuple[int, int, int]]) -> None:
        for ev_id, kind, status in events:
            if kind == ll.EV_OP:
                fut = self.ops.pop(ev_id, None)
                what = self.what.pop(ev_id, "ucx")
                if fut is not None:
                    self._resolve(fut, status, what)
            elif kind == ll.EV_EP_ERROR:
                ep = self.ep_handlers.get(ev_id)
                if ep is not None:
                    ep._on_error(ev_id, status)
        if not self.ops and self.idle_hooks:
            hooks, self.idle_hooks = self.idle_hooks, []
            for hook in hooks:
                hook()

    def drive(self, until: asyncio.Future[Any] | None, max_s: float) -> None:
        """Progress synchronously (no loop) until ``until`` is done or ``max_s`` pass (teardown only)."""
        deadline = self.loop.time() + max_s
        while (until is None or not until.done()) and self.loop.time() < deadline:
            self.worker.progress()
            self.dispatch(self.worker.events())
            if until is None and not self.ops:
                return

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for fd in (self._fd, self.worker.notify_fd):
            try:
                self.loop.remove_reader(fd)
            except Exception:  # loop already closed
                pass


@dataclass
class _RemoteKeys:
    """A peer cache's unpacked rkeys on one UCP endpoint (generation ``gen``), and its regions' bounds."""

    gen: int
    rkeys: list[Any]
    table: Any
    bounds: np.ndarray


@dataclass
class _Mapped:
    """A local cache's ``ucp_mem_map`` handles, by tensor."""

    maps: list[ll.MemMap]
    table: Any
    bounds: np.ndarray


BlockInts = list[int] | tuple[int, ...]


class _Replaced(Exception):
    """The UCP endpoint was reset while a transfer used it (internal: the transfer issues again)."""


class UcxEndpoint(Endpoint):
    """One link's UCX endpoint.

    The UCP endpoint under it can be replaced (:meth:`_reset`) without the link going down, when a
    cancelled transfer's operations do not complete within ``CANCEL_SETTLE_S``. A UCX error on the
    endpoint (the peer died, the connection broke) still breaks the link. ``_gen`` counts the
    replacements (``resets`` too); rkeys are unpacked per UCP endpoint, so per generation."""

    #: A batch is checked in one C call and issued HELPER_RUNS runs (TCP_RUNS over TCP) per loop
    #: turn: a larger one wakes the loop no more often, and a plan of fewer batches fewer times.
    max_runs = 65536

    def __init__(self, transport: UcxTransport, ep: ll.Endpoint, channel: LinkChannel,
                 address: bytes) -> None:
        self._t = transport
        self._ep = ep
        self._address = address  # the peer's target worker address, to replace the UCP endpoint
        self._gen = 0
        self.resets = 0
        self._channel = channel
        progress = transport._progress
        assert progress is not None  # connect() binds the loop first
        self._progress: _Progress = progress
        self._dead: BaseException | None = None
        self._inflight: set[asyncio.Future[None]] = set()
        self._keys: list[_RemoteKeys] = []
        self._garbage: list[Any] = []  # rkeys of dropped remote caches, destroyed when idle
        self._closing: asyncio.Future[None] | None = None
        self._key = f"ucx:{id(self)}"
        self._lim: tuple[int, int, int, int] | None = None
        self._now: tuple[int, bool] | None = None  # (generation, whether the now-path applies)
        self.moved_now = 0  # batches read_now/write_now moved
        self._progress.ep_handlers[ep.id] = self

    def __repr__(self) -> str:
        state = "dead" if self._dead else "closed" if self._closing else "open"
        return (f"<UcxEndpoint cluster={self._channel.peer_cluster_id} {state} "
                f"inflight={len(self._inflight)} resets={self.resets}>")

    def info(self) -> str:
        """UCX's description of the endpoint's lanes (which transports and devices it uses)."""
        return self._ep.info()

    # ---------------------------------------------------------------- remote keys
    def _remote(self, remote: RemoteCache) -> _RemoteKeys:
        keys = remote.cache.get(self._key)
        if keys is not None and keys.gen == self._gen:
            return keys
        rkeys: list[Any] = []
        try:
            for i, r in enumerate(remote.regions):
                if not r.desc:
                    raise LLMKvCacheNotExist(
                        f"remote cache {remote.cache_id} tensor {i} was not registered with ucx on the peer")
                rkeys.append(self._ep.rkey_unpack(r.desc))
        except BaseException:
            for k in rkeys:
                self._t._worker.rkey_destroy(k)
            raise
        rb = ll.bounds([r.addr for r in remote.regions], [r.nbytes for r in remote.regions])
        keys = _RemoteKeys(self._gen, rkeys, self._t._worker.rkey_table(rkeys), rb)
        remote.cache[self._key] = keys
        self._keys.append(keys)
        weakref.finalize(remote, self._drop_keys, keys)
        return keys

    def _drop_keys(self, keys: _RemoteKeys) -> None:
        if keys in self._keys:
            self._keys.remove(keys)
            self._garbage.extend(keys.rkeys)
            self._collect()

    def _collect(self) -> None:
        """Destroy dropped rkeys once no operation can still use them."""
        if not self._garbage or not self._t._worker.alive:
            return
        if self._progress.ops:
            if self._collect not in self._progress.idle_hooks:
                self._progress.idle_hooks.append(self._collect)
            return
        garbage, self._garbage = self._garbage, []
        for k in garbage:
            self._t._worker.rkey_destroy(k)
        self._maybe_forget()

    def _maybe_forget(self) -> None:
        """Leave the transport's set once closed with nothing left to release."""
        if self._closing is not None and self._closing.done() and not self._keys and not self._garbage:
            self._t._endpoints.discard(self)

    # ---------------------------------------------------------------- transfers
    async def read(self, batch: RunBatch) -> None:
        await self._move(batch, False)

    async def write(self, batch: RunBatch) -> None:
        await self._move(batch, True)

    def _limits(self) -> tuple[int, int, int, int]:
        """Flow-control limits for this endpoint's lanes (TCP's until UCX has wired it up)."""
        if self._lim is None:
            info = self._ep.info()
            if "lane[" not in info:
                return LIMITS_TCP
            self._lim = LIMITS_TCP if "tcp/" in info else LIMITS_FAST
        return self._lim

    def _local_rma(self) -> bool:
        """Whether every RMA lane of the current UCP endpoint is one where this process moves the
        bytes itself (then a small get or put completes within microseconds whatever the peer does)."""
        if self._now is None or self._now[0] != self._gen:
            info = self._ep.info()
            if "lane[" not in info:
                return False  # not wired up yet: ask again next time
            rma = [line for line in info.splitlines() if "lane[" in line and " rma" in line]
            self._now = (self._gen, bool(rma) and all(any(t in line for t in _LOCAL_RMA_TLS) for line in rma))
        return self._now[1]

    def read_now(self, batch: RunBatch, write: bool = False) -> bool:
        """A batch of at most ``NOW_BYTES`` over shared memory: checked, issued and completed in one
        C call that polls the worker (no event fd, no task switch). Else move nothing and return False."""
        if self._dead is not None or self._closing is not None or not self._local_rma():
            return False
        mapped = self._t._mapped.get(batch.local_cache.cache_id)
        if mapped is None:
            return False  # the path through read() says why
        keys = self._remote(batch.remote_cache)
        r, status, nev, op = self._ep.rma_now(write, batch.table, mapped.table, mapped.bounds, keys.table,
                                              keys.bounds, NOW_BYTES, NOW_SPIN_NS)
        if r >= 0:  # a run out of bounds: nothing was issued
            self._prepare(batch)  # raises what is out of bounds
            raise LLMParamInvalid(f"run {r // 2} lies outside its region")  # (not reached)
        return self._now_done(write, r, status, nev, op)

    def write_now(self, batch: RunBatch) -> bool:
        return self.read_now(batch, True)

    def blocks_now(self, write: bool, local: LocalCache, remote: RemoteCache, src_blocks: BlockInts,
                   dst_blocks: BlockInts) -> tuple[int, int] | None:
        """One block pair over every tensor, planned and moved in one C call (``kvf_rma_block1``) on
        the terms of ``read_now``; anything else, or anything out of bounds, is declined (the core
        then plans in Python, and ``read_now`` or its planner says what is wrong)."""
        if len(src_blocks) != 1 or len(dst_blocks) != 1:
            return None
        if self._dead is not None or self._closing is not None or not self._local_rma():
            return None
        ld, rd = local.desc, remote.desc
        lb, rb = (src_blocks[0], dst_blocks[0]) if write else (dst_blocks[0], src_blocks[0])
        if (ld.num_tensors != rd.num_tensors or ld.stride != rd.stride or not 0 <= lb < ld.num_blocks
                or not 0 <= rb < rd.num_blocks):
            return None
        mapped = self._t._mapped.get(local.cache_id)
        if mapped is None:
            return None
        keys = self._remote(remote)
        r, status, nev, op = self._ep.rma_block1(write, local.addrs, remote.addrs, ld.stride, lb, rb,
                                                 mapped.table, mapped.bounds, keys.table, keys.bounds,
                                                 NOW_BYTES, NOW_SPIN_NS)
        if r >= 0 or not self._now_done(write, r, status, nev, op):
            return None
        return ld.stride * ld.num_tensors, ld.num_tensors

    def _now_done(self, write: bool, r: int, status: int, nev: int, op: ll.Op | None) -> bool:
        """The end of an on-the-spot RMA call that was not refused for bounds: True once it moved the
        batch, False if it was too large to try (nothing issued); a failure raises."""
        if nev:
            self._progress.kick()  # other operations' completions came in meanwhile
        what = "ucp_put_nbx" if write else "ucp_get_nbx"
        if op is not None:  # still in flight: wait on the spot, with the events
            done = op.finish()
            status = done if done is not None else self._poll_now(op.id, what)
        elif r != -1:  # nothing was issued
            if r == -3:
                return False
            raise LLMOutOfMemory("kvf_op_new: out of memory")
        if status != ll.UCS_OK:
            raise ll.ucx_error(status, what)
        self.moved_now += 1
        return True

    def _poll_now(self, op_id: int, what: str) -> int:
        """Progress the worker on the spot until op ``op_id`` completes; its status. Other events go
        where they belong. Past ``NOW_POLL_S`` the endpoint is failed (force-closed: UCX then
        completes the request as cancelled), so nothing lands after this returns."""
        progress = self._progress
        worker = self._t._worker
        deadline = progress.loop.time() + NOW_POLL_S
        failed = False
        while True:
            worker.progress(max_rounds=64, max_us=100)
            events = worker.events()
            status = next((st for ev_id, kind, st in events if ev_id == op_id and kind == ll.EV_OP), None)
            if events:
                progress.dispatch([ev for ev in events if ev[0] != op_id or ev[1] != ll.EV_OP])
            if status is not None:
                if progress.ops:
                    progress.kick()  # we took their events; the loop's pass re-arms the worker
                return status
            if not failed and progress.loop.time() > deadline:
                failed = True
                exc = LLMLinkFailed(f"ucx: a {what} of a small batch over shared memory did not complete "
                                    f"within {NOW_POLL_S * 1000:.0f} ms")
                self._fail(exc)
                self._channel.broken(exc)
                deadline = progress.loop.time() + RESET_PURGE_S
            elif failed and progress.loop.time() > deadline:
                raise LLMLinkFailed(f"ucx: a {what} did not complete after its endpoint was closed")

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise LLMLinkFailed(f"ucx endpoint is broken: {self._dead}")
        if self._closing is not None:
            raise LLMLinkFailed("ucx endpoint is closed")

    async def _move(self, batch: RunBatch, put: bool) -> None:
        self._check_usable()
        if len(batch) == 0:
            return
        laddr, raddr, lengths, lidx, ridx, mapped, keys = self._prepare(batch)
        piece = self._limits()[2]
        if int(lengths.max()) > piece:
            laddr, raddr, lengths, lidx, ridx = _split(laddr, raddr, lengths, lidx, ridx, piece)
        while True:
            try:
                await self._issue(put, laddr, raddr, lengths, lidx, ridx, mapped, keys)
                return
            except _Replaced:
                # Another transfer's cancel reset the UCP endpoint under this one: every request
                # this one had issued has completed, so issue the whole batch again on the new
                # endpoint (a get or put of the same runs lands the same bytes). Each reset needs a
                # transfer that passed its deadline, and this one's own deadline bounds the loop.
                self._check_usable()
                keys = self._remote(batch.remote_cache)

    def _prepare(self, batch: RunBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                  _Mapped, _RemoteKeys]:
        """The batch's runs as C arrays, with the local mappings and remote keys, once every run is
        checked against both sides' regions."""
        n = len(batch)
        u64, i64 = np.uint64, np.int64
        lengths = np.ascontiguousarray(batch.lengths, dtype=u64)
        laddr = np.ascontiguousarray(batch.local_addrs, dtype=u64)
        raddr = np.ascontiguousarray(batch.remote_addrs, dtype=u64)
        lidx = np.ascontiguousarray(batch.local_tensor, dtype=i64)
        ridx = np.ascontiguousarray(batch.remote_tensor, dtype=i64)
        if not laddr.size == raddr.size == lidx.size == ridx.size == n:
            raise LLMParamInvalid("run arrays of different lengths")
        mapped = self._t._mapped.get(batch.local_cache.cache_id)
        if mapped is None:
            raise LLMKvCacheNotExist(f"cache {batch.local_cache.cache_id} is not registered with ucx")
        keys = self._remote(batch.remote_cache)
        bad = ll.check_runs(laddr, raddr, lengths, lidx, mapped.bounds, ridx, keys.bounds)
        if bad >= 0:
            i, remote = divmod(bad, 2)
            where = (f"remote cache {batch.remote_cache.cache_id}" if remote
                     else f"cache {batch.local_cache.cache_id}")
            raise LLMParamInvalid(f"run {i} ({int(lengths[i])} bytes) lies outside {where}")
        return laddr, raddr, lengths, lidx, ridx, mapped, keys

    async def _issue(self, put: bool, laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray,
                     lidx: np.ndarray, ridx: np.ndarray, mapped: _Mapped, keys: _RemoteKeys) -> None:
        """Issue the runs on the current UCP endpoint, a window at a time, and await their completion.
        Raises :class:`_Replaced` when the endpoint was reset before they all completed."""
        ep = self._ep
        n = lengths.size
        window, chunk, _, runs = self._limits()
        worker = self._t._worker
        op = worker.new_op()
        what = "ucp_put_nbx" if put else "ucp_get_nbx"
        progress = self._progress
        # Over shared memory the progress calls copy the bytes: past HELPER_BYTES they run on the
        # worker's helper thread, not on the loop.
        threaded = self._local_rma() and int(lengths.sum()) >= HELPER_BYTES
        wake = progress.hand_over if threaded else progress.kick
        low = window  # wait for in-flight bytes below low
        if threaded:
            window = chunk = HELPER_WINDOW
            low = HELPER_WINDOW // 2
        fut = progress.track(op, what)
        self._inflight.add(fut)
        cancelled: asyncio.CancelledError | None = None
        try:
            i = 0
            while i < n:
                room = min(window - worker.inflight(), chunk)
                if room > 0:
                    j = min(n, i + runs)
                    i += ep.rma(op, put, laddr[i:j], raddr[i:j], lengths[i:j], lidx[i:j], mapped.table,
                                ridx[i:j], keys.table, room)
                    if op.status() != ll.UCS_OK or i >= n:
                        break
                wake()
                try:  # let completions in (and other tasks run) before issuing more
                    if worker.inflight() >= window:
                        worker.wake_below(low)  # first, then look: a chunk completing between is seen
                        if worker.inflight() >= low:
                            await progress.next_run()
                    else:
                        await asyncio.sleep(0)
                except asyncio.CancelledError as exc:  # stop issuing; what was issued still completes
                    cancelled = exc
                    break
                if self._ep is not ep or self._dead is not None or self._closing is not None:
                    break
            wake()
            progress.finish(op, fut, what)
            if cancelled is not None:
                await self._settle(fut, ep)
                try:
                    raise cancelled
                finally:  # this frame, held by the traceback, must not hold the exception back
                    cancelled = None
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                await self._settle(fut, ep)
                raise
            except LLMException:
                if self._replaced(ep):
                    raise _Replaced from None
                raise
        finally:
            self._inflight.discard(fut)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: a cancelled caller does not see it
        if i < n:  # stopped issuing: the endpoint was reset, broke or closed under us
            if self._replaced(ep):
                raise _Replaced
            raise LLMLinkFailed(f"ucx endpoint {'broke' if self._dead else 'closed'} during the transfer"
                                + (f": {self._dead}" if self._dead else ""))

    def _replaced(self, ep: ll.Endpoint) -> bool:
        """Whether ``ep`` was reset (replaced) while the endpoint as a whole is still usable."""
        return self._ep is not ep and self._dead is None and self._closing is None

    async def _settle(self, fut: asyncio.Future[None], ep: ll.Endpoint) -> None:
        """After a cancel: return only once no issued operation can still land a byte. Wait a
        little for them; if some are still outstanding, reset the endpoint (UCX then completes them
        as cancelled) rather than wait for a peer that may be stalled."""
        await self._wait_done(fut, CANCEL_SETTLE_S)
        if fut.done():
            return
        if self._ep is ep and self._dead is None and self._closing is None:
            self._reset(f"a cancelled transfer's operations were outstanding after "
                        f"{CANCEL_SETTLE_S * 1000:.0f} ms")
        await self._wait_done(fut, RESET_PURGE_S)
        if not fut.done():  # the UCP endpoint is force-closed: UCX delivers nothing more through it
            log.warning("ucx: a cancelled transfer's requests did not complete within %.1f s of the "
                        "endpoint's reset", RESET_PURGE_S)

    @staticmethod
    async def _wait_done(fut: asyncio.Future[None], timeout: float) -> None:
        """Wait up to ``timeout`` s for ``fut``; a further cancel does not cut the wait short
        (returning early could let bytes land after the caller raised)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not fut.done():
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait([fut], timeout=left)
            except asyncio.CancelledError:
                continue

    def _reset(self, reason: str) -> None:
        """Replace the UCP endpoint by a new one to the same peer worker; the link stays up.

        The old one is force-closed: UCX completes every request still on it (as cancelled) and
        nothing lands through it afterwards. Transfers that were using it issue again on the new one
        (:class:`_Replaced`). rkeys were unpacked on the old endpoint: they are unpacked again."""
        old = self._ep
        worker = self._t._worker
        try:
            new = worker.connect(self._address)
        except LLMException as exc:  # cannot even create an endpoint: the link's data path is gone
            self._fail(exc)
            self._channel.broken(exc)
            return
        self._ep = new
        self._gen += 1
        self.resets += 1
        self._progress.ep_handlers.pop(old.id, None)
        self._progress.ep_handlers[new.id] = self
        op = worker.new_op()
        closing = self._progress.track(op, "ucp_ep_close_nbx")
        closing.add_done_callback(_retrieve)
        old.close(op, True)
        self._progress.finish(op, closing, "ucp_ep_close_nbx")
        self._release_keys()
        log.info("ucx endpoint to cluster %d reset (%s); the link stays up", self._channel.peer_cluster_id,
                 reason)
        self._progress.kick()

    # ---------------------------------------------------------------- failure and close
    def _on_error(self, ep_id: int, status: int) -> None:
        """UCX reported the endpoint failed (peer died, connection reset...)."""
        if self._dead is not None or self._closing is not None or ep_id != self._ep.id:
            return  # gone already, or an endpoint that a reset replaced
        exc = ll.ucx_error(status, "ucx endpoint")
        log.info("ucx endpoint to cluster %d failed: %s", self._channel.peer_cluster_id, exc)
        self._fail(exc)
        self._channel.broken(exc)

    def _fail(self, exc: BaseException) -> None:
        """Force-close the UCX endpoint; in-flight transfers fail (their operations are cancelled)."""
        if self._closing is not None:
            if self._dead is None:
                self._dead = exc
            return
        self._dead = exc
        self._start_close(force=True)
        inflight = [f for f in self._inflight if not f.done()]
        if inflight:  # cancelled requests normally complete inside the close; give them a moment
            self._progress.drive(None, 0.01)
        for f in inflight:
            if not f.done():
                f.set_exception(LLMLinkFailed(str(exc)) if not isinstance(exc, LLMException) else exc)

    def _start_close(self, force: bool) -> None:
        worker = self._t._worker
        if not worker.alive:  # the transport was closed first: UCX released everything already
            self._closing = self._progress.loop.create_future()
            self._closing.set_result(None)
            return
        op = worker.new_op()
        self._closing = self._progress.track(op, "ucp_ep_close_nbx")
        self._progress.ep_handlers.pop(self._ep.id, None)
        self._ep.close(op, force)
        self._progress.finish(op, self._closing, "ucp_ep_close_nbx")

    def _destroy_keys(self) -> None:
        """Destroy every rkey now (transport teardown: nothing is in flight any more)."""
        for keys in self._keys:
            self._garbage.extend(keys.rkeys)
        self._keys.clear()
        garbage, self._garbage = self._garbage, []
        for k in garbage:
            self._t._worker.rkey_destroy(k)

    def _release_keys(self) -> None:
        for keys in self._keys:
            self._garbage.extend(keys.rkeys)
        self._keys.clear()
        self._collect()

    def abort(self, exc: BaseException) -> None:
        self._fail(exc)
        self._release_keys()

    async def close(self) -> None:
        if self._closing is None:
            if self._inflight:
                self._fail(LLMLinkFailed("ucx endpoint closed"))
            else:
                self._release_keys()
                self._start_close(force=False)
        assert self._closing is not None
        done, _ = await asyncio.wait([self._closing], timeout=1.0)
        if not done:  # a graceful close waits for the peer; do not let a dead one hold us
            log.debug("ucx endpoint close timed out; forcing")
        elif not self._closing.cancelled():
            self._closing.exception()
        self._release_keys()
        self._maybe_forget()


class UcxTransport(Transport):
    """One-sided RMA through UCX: RoCE/InfiniBand verbs, shared memory (CMA) or TCP, as UCX picks."""

    name = "ucx"
    supports_device_memory: ClassVar[bool] = True  # through UCX's memory-type detection; unverified here

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.config, self.settings, defaults = _ucx_config(ctx.options)
        try:
            self._worker = ll.Worker(self.config)
        except LLMParamInvalid as exc:
            if not defaults:
                raise
            log.warning("UCX refused kvflow's default settings (%s); using UCX's own: %s",
                        ", ".join(sorted(defaults)), exc)
            self.config = {k: v for k, v in self.config.items() if k not in defaults}
            self._worker = ll.Worker(self.config)
        # Peers connect to a second worker on the same context (the target: it serves their
        # emulated RMA and wire-up), ours connect from this one. Two workers keep UCX from pairing
        # our endpoint to a peer with the peer's endpoint to us (it pairs endpoints that two workers
        # create to each other), so that resetting ours (UcxEndpoint._reset) leaves theirs intact.
        self._target = self._worker.sibling()
        self.rdma = sorted(t for t in self._worker.transports() if t.startswith(RDMA_TLS))
        self._host = _host_id()
        self._progress: _Progress | None = None
        self._target_progress: _Progress | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mapped: dict[int, _Mapped] = {}
        self._endpoints: set[UcxEndpoint] = set()
        try:
            self._bind_loop()
        except RuntimeError:  # no running loop yet: bound at connect
            pass

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            ll.load()
        except ImportError as exc:
            return str(exc)
        return None

    def _bind_loop(self) -> _Progress:
        loop = asyncio.get_running_loop()
        if self._progress is None:
            self._loop = loop
            self._progress = _Progress(self._worker, loop, self.ctx.worker_priority == "idle")
            self._target_progress = _Progress(self._target, loop)
        elif self._loop is not loop:
            raise LLMParamInvalid("a ucx transport is bound to the event loop it was started on")
        return self._progress

    def __repr__(self) -> str:
        return (f"<UcxTransport cluster={self.ctx.cluster_id} caches={len(self._mapped)} "
                f"endpoints={len(self._endpoints)}>")

    def info(self) -> str:
        """UCX's description of the workers (``ucp_worker_print_info``): ours, then the target's."""
        return self._worker.info() + self._target.info()

    def describe(self) -> dict[str, Any]:
        return {"address": self._target.address, "version": ll.versions()["library"], "host": self._host,
                "rdma": self.rdma}

    def check_peer(self, info: Mapping[str, Any]) -> str | None:
        """Accept a peer on this host (UCX moves data through CMA or shared memory) or, by default, a
        peer on another host only when both sides have an RDMA transport: without one, UCX falls back
        to TCP, which kvflow's own tcp transport does faster (``kvflow.ucx.RequireRdma=no`` overrides)."""
        addr = info.get("address")
        if not isinstance(addr, (bytes, bytearray)) or not addr:
            return "the peer sent no UCX worker address"
        require = self.settings["RequireRdma"]
        if require == "no" or (require == "auto" and info.get("host") == self._host):
            return None
        peer_rdma = info.get("rdma") or []
        if self.rdma and peer_rdma:
            return None
        if not self.rdma and not peer_rdma:
            side = "either side"
        else:
            side = "this side" if not self.rdma else "the peer"
        return (f"no RDMA transport on {side} (UCX would use TCP; kvflow's tcp transport is faster there; "
                "kvflow.ucx.RequireRdma=no uses UCX anyway)")

    def register(self, cache: LocalCache) -> list[bytes | None]:
        maps: list[ll.MemMap] = []
        try:
            for r in cache.regions:
                maps.append(self._worker.mem_map(r.addr, r.nbytes, host=r.placement == Placement.HOST))
        except BaseException:
            for m in maps:
                self._worker.mem_unmap(m)
            raise
        self._mapped[cache.cache_id] = _Mapped(maps, self._worker.memh_table(maps),
                                               ll.bounds([m.addr for m in maps], [m.nbytes for m in maps]))
        return [m.rkey for m in maps]

    def unregister(self, cache: LocalCache) -> None:
        mapped = self._mapped.pop(cache.cache_id, None)
        if mapped is None or not self._worker.alive:
            return
        for m in mapped.maps:
            self._worker.mem_unmap(m)

    async def connect(self, info: Mapping[str, Any], channel: LinkChannel) -> Endpoint:
        progress = self._bind_loop()
        reason = self.check_peer(info)
        if reason:
            raise LLMLinkFailed(f"ucx: {reason}")
        address = bytes(info["address"])
        ep = UcxEndpoint(self, self._worker.connect(address), channel, address)
        self._endpoints.add(ep)
        progress.kick()
        return ep

    async def close(self) -> None:
        if not self._worker.alive:
            return
        for ep in list(self._endpoints):
            ep.abort(LLMLinkFailed("ucx transport closed"))
        progress = self._progress
        if progress is not None:
            if progress.ops:
                await asyncio.wait(list(progress.ops.values()), timeout=1.0)
            progress.drive(None, 0.2)
            progress.close()
        if self._target_progress is not None:
            self._target_progress.close()
        for ep in self._endpoints:
            ep._destroy_keys()
        self._endpoints.clear()
        for cache_id in list(self._mapped):
            for m in self._mapped.pop(cache_id).maps:
                self._worker.mem_unmap(m)
        self._worker.destroy()  # the target worker first
