"""The transfer engine: one way to run a batch of runs against a peer's cache, for the API calls
(pull/push of blocks or slots) and for ``CacheTask`` (layer-wise push).

A batch runs once: find the peer's cache (looked up once per link), plan, pin the local cache,
arm the deadline, mark the remote cache in use, move, count it in ``stats()``; a peer cache that
vanished is forgotten. Small batches that a transport can move on the spot skip the deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Coroutine, Protocol

import numpy as np

from ._checks import MAX_TIMEOUT_MS, check_int
from ._deadline import Deadline
from ._guard import GUARD
from ._link import Link
from ._links import LinkTable
from ._memory import LocalCache, Registry
from ._metrics import LOG_FOLD, Metrics
from ._metrics import now as metrics_now
from ._plan import PIECE_RUNS, Plan, Steps, run_steps_async
from ._status import LLMKvCacheNotExist, LLMTimeoutError
from ._types import Cache, CacheIndex
from .transport import Endpoint, RemoteCache, RunBatch, Started

PULL, PUSH = "pull", "push"
#: Block lists longer than this never take ``blocks_now`` (each entry's type is checked in Python).
FAST_BLOCKS = 64
Planner = Callable[[RemoteCache], Plan]


#: One pull or push of blocks or slots, checked as far as local state allows: (direction, the peer's
#: cache index, the local cache, the planner, the precheck). The precheck holds the checks that need
#: only the local cache; they run before the peer is first asked for its cache (once it is known, the
#: planner checks everything; for long block lists it returns them as steps to run, ``kvflow._plan``).
#: A plain tuple: a NamedTuple costs 0.27 µs per 4 KiB pull to build.
Request = tuple[str, CacheIndex, LocalCache, Planner, Callable[[], Steps | None]]


#: Batches of a large plan in flight at once: the next is made and handed over while one moves.
DEPTH = 2
#: A batch planned in the loop callback that would also hand it to the transport is handed over in a
#: callback of its own when it has at least this many bytes or more than ``SPLIT_RUNS`` runs: planning
#: and a transport's first step (framing, starting a copy thread) together held the loop for up to
#: 1.1 ms on a slow host, for a 256 MiB push (tests/test_loop_hold.py). One more loop turn is
#: microseconds against the transfer's milliseconds.
SPLIT_BYTES = 1 << 20
SPLIT_RUNS = 1024


#: The most runs in one batch of a large plan, whatever ``Endpoint.max_runs`` says: its table is made on
#: the loop thread (``_batch``), and ``DEPTH + 1`` of them may be alive at once (2.5 MiB each).
MAX_BATCH_RUNS = 65536


async def _batch(plan: Plan, local: LocalCache, remote: RemoteCache, a: int, b: int) -> RunBatch:
    """Runs ``a..b-1`` of ``plan`` as one batch. A table of more than ``PIECE_RUNS`` columns is made
    that many at a time, with a loop turn between (65536 columns at once held the loop 1.4 ms)."""
    if b - a <= PIECE_RUNS:
        return plan.batch(local, remote, a, b)
    table = np.empty((5, b - a), dtype=np.uint64)
    for c in range(a, b, PIECE_RUNS):
        e = min(b, c + PIECE_RUNS)
        plan.columns(c, e, table[:, c - a:e - a])
        await asyncio.sleep(0)
    return RunBatch.of_table(table, local, remote)


async def _move_pieces(endpoint: Endpoint, direction: str, plan: Plan, local: LocalCache, remote: RemoteCache,
                       a: int, b: int) -> None:
    """Move runs ``a..b-1`` of ``plan`` as batches of at most ``endpoint.max_runs`` runs (and at most
    ``MAX_BATCH_RUNS``), ``DEPTH`` at a time: each table is made just before its batch starts
    (memory: ``DEPTH + 1`` tables), and no call of the transport's sees more runs than it asked for
    (its per-batch work stays short).

    Returns or raises only once no batch is in flight: on failure or cancellation the others are
    cancelled and awaited, and each transport's ``read`` re-raises only once no byte of it can land."""
    move = endpoint.read if direction is PULL else endpoint.write
    step = max(1, min(endpoint.max_runs, MAX_BATCH_RUNS))
    tasks: list[asyncio.Task[None]] = []
    try:
        for c in range(a, b, step):
            batch = await _batch(plan, local, remote, c, min(b, c + step))
            tasks.append(asyncio.ensure_future(move(batch)))
            if len(tasks) >= DEPTH:
                await tasks[0]
                del tasks[0]
        while tasks:
            await tasks[0]
            del tasks[0]
    except BaseException:
        for t in tasks:
            t.cancel()
        for t in tasks:  # through any further cancellation: nothing may still be moving when we raise
            while not t.done():
                try:
                    await asyncio.wait((t,))
                except asyncio.CancelledError:
                    continue
            if not t.cancelled():
                t.exception()  # retrieved: the first failure is what the caller sees
        raise


def _done(metrics: Metrics, direction: str, peer: int, transport: str, moved: RunBatch | Plan, seconds: float,
          span: Any) -> None:
    """Count a finished transfer: a batch, or a plan moved in batches."""
    if isinstance(moved, RunBatch):
        metrics.done(direction, peer, transport, moved, seconds, span)
    else:
        metrics.done_runs(direction, peer, transport, len(moved), moved.nbytes, seconds, span)


#: How long a task may go on starting transfers that finish inside the call (and so never suspend)
#: before its next call first yields one turn to the loop (``LoopTurns``).
INLINE_TURN_S = 0.5e-3


class LoopTurns:
    """Whether the caller's task owes the event loop a turn.

    A small transfer that a transport finishes inside the call returns without suspending, so a
    task that awaits such transfers back to back never lets the loop run: its other tasks, its
    timers and kvflow's own heartbeats wait until the task suspends for another reason (shm pulls
    back to back held a loop for seconds, until the peer dropped the link for lack of heartbeats).
    A marker callback queued on the loop tells whether a turn came since it was queued; when
    transfers have been started for ``INLINE_TURN_S`` with the marker still queued, the next one
    yields first. The marker is queued again at most every ``INLINE_TURN_S / 2``, so that transfers
    that suspend anyway pay one ``call_soon`` per that interval, not one each; a stretch without a
    turn lasts at most about 1.5 times ``INLINE_TURN_S`` plus one transfer."""

    __slots__ = ("_queued", "_since")

    def __init__(self) -> None:
        self._since = -1.0  # when the marker was last queued
        self._queued = False

    def owed(self) -> bool:
        """Called on the loop thread as a transfer starts: True if it should first yield a turn."""
        now = time.perf_counter()
        if self._queued:
            return now - self._since > INLINE_TURN_S
        if now - self._since > INLINE_TURN_S / 2:
            self._queued = True
            self._since = now
            asyncio.get_running_loop().call_soon(self._turned)
        return False

    def _turned(self) -> None:
        self._queued = False


class RunningTask(Protocol):
    """A layer-wise task the engine holds while it runs (``_layerwise.CacheTask``)."""

    def _abort(self, reason: str) -> None: ...


class TransferEngine:
    """Runs transfers over the links of ``table``; owns the running layer-wise tasks."""

    def __init__(self, table: LinkTable, registry: Registry, metrics: Metrics) -> None:
        self._table = table
        self._registry = registry
        self.metrics = metrics
        self.tasks: set[RunningTask] = set()  # running CacheTasks (the loop keeps only weak references)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.turns = LoopTurns()  # the loop thread's: kvflow.sync's own-thread calls do not use it

    @property
    def sync_wait_s(self) -> float:
        """``llm.SyncKvCacheWaitTime`` in seconds: the deadline of one transfer."""
        return self._table.local.opts.sync_wait_ms / 1000

    def deadline(self, timeout_in_millis: int | None) -> float:
        """Seconds a transfer may take: ``timeout_in_millis`` if given, else ``llm.SyncKvCacheWaitTime``."""
        if timeout_in_millis is None:
            return self.sync_wait_s
        return check_int("timeout_in_millis", timeout_in_millis, 1, MAX_TIMEOUT_MS) / 1000

    async def run(self, req: Request, timeout_in_millis: int | None) -> None:
        """Plan against the peer's cache and move the batch within the deadline, counted in ``stats()``."""
        direction, ci, local, planner, precheck = req
        timeout = self.deadline(timeout_in_millis)
        if self.turns.owed():  # before anything moves: a caller cancelled meanwhile has moved nothing
            await asyncio.sleep(0)
        metrics = self.metrics
        span = metrics.start_span(direction, ci.cluster_id, ci.cache_id)
        t0 = metrics_now()
        link = self._table.links.get(ci.cluster_id)
        try:
            remote = link.remotes.get(ci.cache_id) if link is not None else None
            batch = plan = started = None
            if remote is not None:
                assert link is not None
                endpoint = link.check()
                plan = planner(remote)
                if plan.whole:
                    batch = plan.batch(local, remote)
                    # no pin/begin needed: nothing (an unregister, a peer's "gone") runs during this call
                    try:
                        now = endpoint.read_now(batch) if direction is PULL else endpoint.write_now(batch)
                    except LLMKvCacheNotExist:  # a two-sided peer's answer: it no longer has the cache
                        link.forget(ci.cache_id)
                        raise
                    if now is True:
                        metrics.done(direction, ci.cluster_id, link.transport, batch, metrics_now() - t0, span)
                        return
                    if now is not False:  # begun, not finished: awaited below with the deadline
                        started = now.done
            else:
                steps = precheck()
                if steps is not None:  # long block lists: checked in slices
                    await run_steps_async(steps)
                link = self._table.get(ci.cluster_id)
            moved = await self._move(direction, ci, link, local, remote, batch, plan, planner, timeout,
                                     started=started)
            assert moved is not None
        except BaseException as exc:
            metrics.failed(direction, ci.cluster_id, self._table.links.get(ci.cluster_id), exc, metrics_now() - t0,
                           span)
            raise
        _done(metrics, direction, ci.cluster_id, link.transport, moved, metrics_now() - t0, span)

    def run_now(self, req: Request) -> bool:
        """On a caller's own thread (``kvflow.sync``): move the batch at once and return True when the
        link's endpoint can do so from any thread, the peer's cache is already known, the batch is
        small enough and no trace span is wanted; else move nothing and return False (then ``run``
        it on the loop). Raises what ``run`` would raise for a bad request or a broken link.

        The copy holds ``GUARD`` from its last check to its end: an unregister, a peer's "gone", an
        unlink or a broken link wait for it on the loop thread, and one that came first is seen."""
        direction, ci, local, planner, _ = req
        link = self._table.links.get(ci.cluster_id)
        remote = link.remotes.get(ci.cache_id) if link is not None else None
        if link is None or remote is None or link.endpoint is None or not link.endpoint.now_threadsafe:
            return False
        metrics = self.metrics
        if metrics.tracing:
            return False
        t0 = metrics_now()
        try:
            batch = planner(remote).batch(local, remote)
            with GUARD:
                if link.closing or local.closing or link.remotes.get(ci.cache_id) is not remote:
                    return False
                endpoint = link.check()
                now = endpoint.read_now(batch) if direction is PULL else endpoint.write_now(batch)
                if now is not True:
                    if now is not False:
                        raise RuntimeError(f"{type(endpoint).__name__} is now_threadsafe but left a batch Started")
                    return False
        except BaseException as exc:
            metrics.failed(direction, ci.cluster_id, link, exc, metrics_now() - t0, None)
            raise
        metrics.done(direction, ci.cluster_id, link.transport, batch, metrics_now() - t0, None)
        return True

    def blocks_now(self, direction: str, ci: CacheIndex, cache: Cache, src_blocks: Any, dst_blocks: Any,
                   timeout_in_millis: int | None, threaded: bool) -> bool | Coroutine[Any, Any, None]:
        """The native fast path of a block pull or push over every tensor (no ``ext_param``): when the
        link's endpoint offers ``blocks_now``, the peer's cache is known, the lists are short lists
        of plain ints and no trace span is wanted, the endpoint checks, plans and moves the request in
        one call; counted in ``stats()``, True. Otherwise nothing moved and False: take ``run`` (or
        ``run_now``), which raises the typed error for bad input. ``threaded``: on a caller's own
        thread (``kvflow.sync``), under ``GUARD`` as in ``run_now``; else on the loop thread.

        Only the checks that decide whether to try are made here, cheaply; every other one is the
        endpoint's, which declines what it does not take. ``timeout_in_millis`` is only checked: the
        copy takes microseconds, like ``read_now``'s."""
        t = timeout_in_millis
        if t is not None and (type(t) is not int or not 0 < t <= MAX_TIMEOUT_MS):
            return False
        ts, td = type(src_blocks), type(dst_blocks)
        if (ts is not list and ts is not tuple) or (td is not list and td is not tuple) or type(ci) is not CacheIndex:
            return False
        n = len(src_blocks)
        if not 0 < n <= FAST_BLOCKS or len(dst_blocks) != n:
            return False
        if n == 1:
            if type(src_blocks[0]) is not int or type(dst_blocks[0]) is not int:  # a bool: 0 or 1 in C
                return False
        else:
            for v in src_blocks:
                if type(v) is not int:
                    return False
            for v in dst_blocks:
                if type(v) is not int:
                    return False
        peer, cache_id, b = ci.cluster_id, ci.cache_id, ci.batch_index
        if type(peer) is not int or type(cache_id) is not int or type(b) is not int or b != 0:
            return False
        link = self._table.links.get(peer)
        if link is None or not isinstance(cache, Cache):
            return False
        remote = link.remotes.get(cache_id)
        endpoint = link.endpoint
        if remote is None or endpoint is None or (threaded and not endpoint.now_threadsafe):
            return False
        local = self._registry.lookup(cache.cache_id)
        metrics = self.metrics
        if local is None or metrics.tracing:
            return False
        t0 = metrics_now()
        try:
            if threaded:
                with GUARD:
                    if link.closing or local.closing or link.remotes.get(cache_id) is not remote:
                        return False
                    moved = link.check().blocks_now(direction is PUSH, local, remote, src_blocks, dst_blocks)
            else:
                moved = link.check().blocks_now(direction is PUSH, local, remote, src_blocks, dst_blocks)
        except BaseException as exc:
            if isinstance(exc, LLMKvCacheNotExist):  # a two-sided peer's answer: it no longer has the cache
                link.forget(cache_id)
            metrics.failed(direction, peer, link, exc, metrics_now() - t0, None)
            raise
        if moved is None:
            return False
        if isinstance(moved, Started):
            if threaded:
                raise RuntimeError(f"{type(endpoint).__name__} is now_threadsafe but left a batch Started")
            return self._finish(direction, ci, link, local, remote, moved, t, t0)
        series = link.counters.get(direction)
        if series is None:
            series = link.counters[direction] = metrics.series_of(direction, peer, link.transport)
        log = series.log  # Metrics.add, inline: this runs once per small transfer
        log.append((moved, metrics_now() - t0))
        if len(log) >= LOG_FOLD:
            metrics.fold(series)
        return True

    async def _finish(self, direction: str, ci: CacheIndex, link: Link, local: LocalCache, remote: RemoteCache,
                      started: Started, timeout_in_millis: int | None, t0: float) -> None:
        """Await a block transfer that ``blocks_now``'s endpoint began, under the transfer's deadline."""
        try:
            await self._move(direction, ci, link, local, remote, None, None, None, self.deadline(timeout_in_millis),
                             started=started.done)
        except BaseException as exc:
            self.metrics.failed(direction, ci.cluster_id, link, exc, metrics_now() - t0, None)
            raise
        self.metrics.count(direction, ci.cluster_id, link.transport, started.nbytes, started.runs, metrics_now() - t0)

    async def _move(self, direction: str, ci: CacheIndex, link: Link, local: LocalCache, remote: RemoteCache | None,
                    batch: RunBatch | None, plan: Plan | None, planner: Planner | None, timeout: float,
                    part: tuple[int, int] | None = None,
                    started: Awaitable[None] | None = None) -> RunBatch | Plan | None:
        """Pin, arm the deadline, look the peer's cache up and plan if need be, move, unpin. A plan that
        is still pending is made in slices; one of more than ``PIECE_RUNS`` runs (or its columns
        ``part``) moves in batches of up to the endpoint's ``max_runs`` (``_move_pieces``).
        ``started``: the batch is already moving (an endpoint's ``Started``); only wait for it."""
        local.pin()
        deadline = Deadline(timeout)
        try:
            if started is not None:
                assert remote is not None
                remote.begin()
                try:
                    await started
                finally:
                    remote.end()
                return batch
            if remote is None:
                remote = await link.remote_cache(ci.cache_id, timeout)
            if batch is None:
                if plan is None:
                    assert planner is not None
                    plan = planner(remote)
                if plan.pending:
                    await run_steps_async(plan.steps())
                a, b = part if part is not None else (0, len(plan))
                if b - a <= PIECE_RUNS:
                    batch = plan.batch(local, remote, a, b)
            if batch is not None and (len(batch) > SPLIT_RUNS or batch.nbytes >= SPLIT_BYTES):
                await asyncio.sleep(0)
            endpoint = link.check()
            remote.begin()
            try:
                if batch is not None:
                    if direction is PULL:
                        await endpoint.read(batch)
                    else:
                        await endpoint.write(batch)
                else:
                    assert plan is not None
                    await _move_pieces(endpoint, direction, plan, local, remote, a, b)
            finally:
                remote.end()
            if batch is not None:
                return batch
            assert plan is not None
            return plan
        except asyncio.CancelledError:
            if deadline.stop():
                raise LLMTimeoutError(
                    f"{direction} with cluster {ci.cluster_id} cache {ci.cache_id} did not finish within "
                    f"{timeout * 1000:.0f} ms") from None
            raise
        except LLMKvCacheNotExist:
            link.forget(ci.cache_id)
            raise
        finally:
            deadline.stop()
            local.unpin()

    # ------------------------------------------------------------------ for CacheTask
    async def target(self, ci: CacheIndex, planner: Planner, timeout: float) -> tuple[Link, RemoteCache, Plan]:
        """Look up the peer's cache and plan every layer of one ``transfer_cache_async`` config."""
        link = self._table.get(ci.cluster_id)
        if timeout <= 0:
            raise LLMTimeoutError(f"no time left to look up cache {ci.cache_id} on cluster {ci.cluster_id}")
        deadline = Deadline(timeout)
        try:
            remote = await link.remote_cache(ci.cache_id, timeout)
            plan = planner(remote)
            if plan.pending:  # long block lists: made in slices, within the same deadline
                await run_steps_async(plan.steps())
        except asyncio.CancelledError:
            if deadline.stop():
                raise LLMTimeoutError(f"cluster {ci.cluster_id} did not describe cache {ci.cache_id} within "
                                      f"{timeout * 1000:.0f} ms") from None
            raise
        finally:
            deadline.stop()
        return link, remote, plan

    async def push_runs(self, link: Link, ci: CacheIndex, local: LocalCache, remote: RemoteCache, plan: Plan,
                        part: tuple[int, int], timeout: float) -> None:
        """Push the runs ``part`` (columns a..b-1) of a ``transfer_cache_async`` config's plan, counted
        in ``stats()`` as a push."""
        metrics = self.metrics
        span = metrics.start_span(PUSH, ci.cluster_id, ci.cache_id)
        t0 = metrics_now()
        try:
            if local.closing or self._registry.lookup(local.cache_id) is not local:
                raise LLMKvCacheNotExist(f"cache {local.cache_id} was unregistered during the transfer")
            if link.remotes.get(ci.cache_id) is not remote:
                raise LLMKvCacheNotExist(f"cache {ci.cache_id} on cluster {ci.cluster_id} was unregistered "
                                         "during the transfer")
            link.check()
            a, b = part
            batch = plan.batch(local, remote, a, b) if b - a <= PIECE_RUNS else None
            await self._move(PUSH, ci, link, local, remote, batch, plan, None, timeout, part)
        except BaseException as exc:
            metrics.failed(PUSH, ci.cluster_id, link, exc, metrics_now() - t0, span)
            raise
        if batch is not None:
            metrics.done(PUSH, ci.cluster_id, link.transport, batch, metrics_now() - t0, span)
        else:
            metrics.done_runs(PUSH, ci.cluster_id, link.transport, b - a, plan.nbytes_of(a, b), metrics_now() - t0,
                              span)

    def abort_tasks(self, reason: str) -> None:
        """Stop every running layer-wise task (at finalize), as ``cancel()`` does."""
        for task in list(self.tasks):
            task._abort(reason)
