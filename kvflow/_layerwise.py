"""Layer-wise overlapped push: ``LlmDataDist.transfer_cache_async``, ``CacheTask``, ``LayerSynchronizer``.

While the prefill side computes layer ``l+1``, layer ``l`` is already on its way. One coroutine asks
the synchronizer about the needed source layers in order; one sender per destination (config) sends
its layers in order, each as soon as it is ready, so the send of layer ``l`` overlaps waiting for
layer ``l+1``. Layers that became ready while a send was in flight go out together in the next send.
A destination that fails stops getting layers and keeps its status; the others go on. The whole
task has one deadline. Decisions (status codes, cancellation) are written down in docs/layerwise.md.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, cast

import numpy as np

from ._checks import MAX_TIMEOUT_MS, blocks_precheck, cache_precheck, check_index, check_int
from ._plan import (
    CALL_CHECK_BLOCKS,
    Plan,
    Steps,
    block_list,
    block_list_steps,
    duplicates_steps,
    has_duplicates,
    is_long,
    layer_tensors,
    plan_blocks,
    plan_cache,
    run_steps_async,
    side_tensors,
)
from ._status import LLMException, LLMFailed, LLMParamInvalid, LLMStatusCode, LLMTimeoutError
from ._synchronizer import LayerEvents, LayerSynchronizer, _Worker
from ._types import CacheDesc, CacheIndex, KvCacheExtParam, LayerRange

if TYPE_CHECKING:
    from ._engine import TransferEngine
    from ._memory import LocalCache
    from .transport import RemoteCache

__all__ = ["CacheTask", "LayerEvents", "LayerSynchronizer", "TransferConfig"]

@dataclass(frozen=True)
class TransferConfig:
    """One destination of ``transfer_cache_async``.

    ``dst_cache_index`` names the peer's cache (its ``batch_index`` is the destination slot of a
    whole-slot transfer; 0 for block transfers). Layer ranges are inclusive ``(first, last)`` pairs or
    ``range`` objects, ``(-1, -1)`` = all layers; both must span the same number of layers.
    ``src_batch_index`` is the local slot of a whole-slot transfer (0 with block indices)."""

    dst_cache_index: CacheIndex
    src_layer_range: LayerRange = (-1, -1)
    dst_layer_range: LayerRange = (-1, -1)
    src_batch_index: int = 0


# ---------------------------------------------------------------------- the task
class _Dest:
    """One config's destination and its progress."""

    __slots__ = ("busy", "ci", "error", "index", "layers", "planner", "ready", "sent", "status", "wake")

    def __init__(self, index: int, ci: CacheIndex, layers: list[int],
                 planner: Callable[[RemoteCache], Plan]) -> None:
        self.index = index
        self.ci = ci
        self.layers = layers  # absolute source layers, ascending and contiguous
        self.planner = planner
        self.ready = 0  # how many of ``layers`` the synchronizer confirmed
        self.sent = 0  # how many of ``layers`` reached the destination
        self.busy = False  # a send is in flight
        self.status: LLMStatusCode | None = None
        self.error: LLMException | None = None
        self.wake = asyncio.Event()

    def needs(self, layer: int) -> bool:
        return self.layers[0] <= layer <= self.layers[-1]


class CacheTask:
    """A running ``transfer_cache_async``.

    ``await task`` returns on success and raises the typed error of the first failure;
    ``await task.synchronize(timeout_in_millis)`` returns an ``LLMStatusCode`` instead;
    ``get_results()`` has one status per config (None: no layer of that config was sent);
    ``cancel()`` stops sending further layers. Progress and timestamps (``time.perf_counter()``)
    are plain attributes: ``num_layers``, ``layers_ready``, ``layers_sent``, ``config_layers_sent``,
    ``layer_ready_at``, ``layer_sent_at``, ``started_at``, ``finished_at``, ``exposed_seconds``.
    Cancelling a coroutine that awaits the task does not cancel the task."""

    def __init__(self, engine: TransferEngine, local: LocalCache, synchronizer: LayerSynchronizer, dests: list[_Dest],
                 per_layer: int, timeout_s: float, checks: Steps | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._checks = checks  # long block lists: checked in slices before anything is sent
        self._engine = engine
        self._local = local
        self._sync = synchronizer
        self._sync_async = inspect.iscoroutinefunction(synchronizer.synchronize_layer)
        self._worker: _Worker | None = None
        self._dests = dests
        self._per_layer = per_layer
        self.timeout_s = timeout_s
        self._deadline = self._loop.time() + timeout_s
        needed = sorted({layer for d in dests for layer in d.layers})
        self._needed = needed
        #: Source layers that at least one config needs, and how many of them the synchronizer confirmed.
        self.num_layers = len(needed)
        self.layers_ready = 0
        #: Layers that reached every destination that needs them (failed destinations aside).
        self.layers_sent = 0
        self.layer_ready_at: dict[int, float] = {}
        self.layer_sent_at: dict[int, float] = {}
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self._outstanding = {layer: 0 for layer in needed}
        self._delivered = {layer: 0 for layer in needed}
        for d in dests:
            for layer in d.layers:
                self._outstanding[layer] += 1
        self._error: LLMException | None = None  # the first failure
        self._stop: LLMException | None = None  # cancel(): no further layer is sent
        self._cancelled = False
        self._sync_over = False
        self._waiting: asyncio.Future[Any] | None = None
        self._done = asyncio.Event()
        engine.tasks.add(self)  # the engine holds the task while it runs
        self._main = self._loop.create_task(self._run())

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return (f"<CacheTask {state} {self.layers_sent}/{self.num_layers} layers sent, "
                f"results={[r.name if r is not None else None for r in self.get_results()]}>")

    # ------------------------------------------------------------------ public
    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> None:
        await self._done.wait()
        if self._error is not None:
            raise self._error

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the task (at most ``timeout_in_millis``); LLM_SUCCESS, the first failure's code,
        or LLM_TIMEOUT if it is still running (it goes on running, as in LLM-DataDist)."""
        if timeout_in_millis is not None:
            if (isinstance(timeout_in_millis, bool) or not isinstance(timeout_in_millis, int)
                    or timeout_in_millis < 0):
                raise LLMParamInvalid(f"timeout_in_millis must be a non-negative int, got {timeout_in_millis!r}")
            waiter = asyncio.ensure_future(self._done.wait())
            try:
                done, _ = await asyncio.wait({waiter}, timeout=timeout_in_millis / 1000)
            finally:
                waiter.cancel()
            if not done:
                return LLMStatusCode.LLM_TIMEOUT
        else:
            await self._done.wait()
        return self._error.status_code if self._error is not None else LLMStatusCode.LLM_SUCCESS

    def get_results(self) -> list[LLMStatusCode | None]:
        """One status per config, in order; None for a config none of whose layers was sent.
        Final once the task is done; before that None also means "not finished yet"."""
        return [d.status for d in self._dests]

    def cancel(self) -> bool:
        """Stop sending further layers (a send in flight completes); awaiting the task then raises
        ``LLMFailed`` unless an earlier failure is to be reported. False if the task already ended."""
        if self._done.is_set() or self._stop is not None:
            return False
        self._cancelled = True
        self._halt(LLMFailed(f"transfer_cache_async cancelled after {self.layers_sent} of "
                             f"{self.num_layers} layers"))
        return True

    def done(self) -> bool:
        """Whether the task has ended (nothing of it is in flight any more)."""
        return self._done.is_set()

    def cancelled(self) -> bool:
        """Whether ``cancel()`` stopped the task."""
        return self._cancelled

    def exception(self) -> LLMException | None:
        """The first failure so far (None if there was none); final once the task is done."""
        return self._error

    @property
    def config_layers_sent(self) -> list[int]:
        """Per config: how many of its layers reached the destination."""
        return [d.sent for d in self._dests]

    @property
    def exposed_seconds(self) -> float | None:
        """Time from the last layer becoming ready to the end of the task (None if it never was): the
        transfer time that overlap did not hide. Ready means marked (``LayerEvents``), returned on its
        own thread (a blocking synchronizer) or returned (a coroutine synchronizer), not the later
        moment at which the task's loop got round to it."""
        if self.finished_at is None or not self._needed or self._needed[-1] not in self.layer_ready_at:
            return None
        return self.finished_at - self.layer_ready_at[self._needed[-1]]

    # ------------------------------------------------------------------ bookkeeping
    def _note(self, exc: LLMException) -> None:
        if self._error is None:
            self._error = exc

    def _halt(self, exc: LLMException) -> None:
        """No further layer is sent by anyone (cancel)."""
        if self._stop is None:
            self._stop = exc
            self._note(exc)
        self._interrupt_sync()
        for d in self._dests:
            d.wake.set()

    def _abort(self, reason: str) -> None:
        """Stop the task as ``cancel()`` does, because ``reason`` (its engine is closing)."""
        self._halt(LLMFailed(f"transfer_cache_async stopped: {reason}"))

    def _interrupt_sync(self) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.cancel()

    def _count(self, layer: int, delivered: bool, now: float) -> None:
        self._outstanding[layer] -= 1
        if delivered:
            self._delivered[layer] += 1
        if self._outstanding[layer] == 0 and self._delivered[layer]:
            self.layer_sent_at[layer] = now
            self.layers_sent += 1

    def _fail(self, d: _Dest, exc: LLMException) -> None:
        if d.status is not None:
            return
        d.status = exc.status_code
        d.error = exc
        self._note(exc)
        now = time.perf_counter()
        for layer in d.layers[d.sent:]:
            self._count(layer, False, now)
        d.wake.set()
        if not any(x.status is None and x.ready < len(x.layers) for x in self._dests):
            self._interrupt_sync()  # nobody needs another layer: stop waiting for one

    # ------------------------------------------------------------------ the coroutines
    async def _run(self) -> None:
        senders: list[asyncio.Future[None]] = []
        try:
            checks, self._checks = self._checks, None
            if checks is not None:
                try:
                    await run_steps_async(checks)
                except LLMParamInvalid as exc:
                    for d in self._dests:
                        self._fail(d, exc)
                    return
            senders = [asyncio.ensure_future(self._send(d)) for d in self._dests]
            await self._sync_loop()
            self._sync_over = True
            for d in self._dests:
                d.wake.set()
            await asyncio.gather(*senders)
        except asyncio.CancelledError:  # our own asyncio task was cancelled (event loop shutting down)
            for s in senders:
                s.cancel()
            self._halt(LLMFailed("transfer_cache_async: its event loop task was cancelled"))
            raise
        finally:
            self._finish()

    def _finish(self) -> None:
        self.finished_at = time.perf_counter()
        for d in self._dests:
            if d.status is None and (d.sent or d.busy):  # cut short part-way
                exc = self._stop or self._error or LLMFailed("transfer_cache_async ended early")
                d.status, d.error = exc.status_code, exc
                self._note(exc)
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        exposed = self.exposed_seconds
        if self._error is None and exposed is not None:
            self._engine.metrics.observe_exposed(exposed)
        self._engine.tasks.discard(self)
        self._done.set()

    async def _call_sync(self, layer: int, ms: int) -> tuple[Any, float]:
        """The synchronizer's answer for ``layer`` and when the layer became ready: ``LayerEvents``
        knows when it was marked; a blocking synchronizer is timed on its own thread when it
        returns; a coroutine synchronizer when it returns on the loop."""
        fn = self._sync.synchronize_layer
        if self._sync_async:
            result = await cast("Awaitable[bool]", fn(layer, ms))
            at = time.perf_counter()
        else:
            if self._worker is None:
                self._worker = _Worker()
            result, at = await self._worker.submit(self._loop, fn, layer, ms)
            if inspect.isawaitable(result):
                result = await result
                at = time.perf_counter()
        if isinstance(self._sync, LayerEvents) and result is True:
            marked = self._sync.ready_at[layer] if 0 <= layer < self._sync.num_layers else None
            if marked is not None:
                at = min(at, marked)
        return result, at

    async def _sync_loop(self) -> None:
        loop = self._loop
        for layer in self._needed:
            if self._stop is not None:
                return
            users = [d for d in self._dests if d.status is None and d.needs(layer)]
            if not users:
                if not any(d.status is None and d.layers[-1] > layer for d in self._dests):
                    return
                continue  # LLM-DataDist skips layers that no config needs
            remaining = self._deadline - loop.time()
            if remaining <= 0:
                self._sync_failed(layer, self._timeout(f"layer {layer} was not ready"))
                return
            waiter = asyncio.ensure_future(self._call_sync(layer, max(1, int(remaining * 1000))))
            self._waiting = waiter
            try:
                done, _ = await asyncio.wait({waiter}, timeout=remaining)
            finally:
                self._waiting = None
            if not done:
                waiter.cancel()
                self._sync_failed(layer, self._timeout(f"layer {layer} was not ready"))
                return
            if waiter.cancelled():  # cancel(), or no destination needs another layer
                return
            exc = waiter.exception()
            if exc is not None:
                if isinstance(exc, LLMException):
                    err = exc
                else:
                    err = LLMFailed(f"layer synchronizer raised at layer {layer}: {exc!r}")
                    err.__cause__ = exc
                self._sync_failed(layer, err)
                return
            ok, ready_at = waiter.result()
            if not ok:
                self._sync_failed(layer, LLMFailed(
                    f"layer synchronizer returned {ok!r} for layer {layer}: it will never be ready"))
                return
            self.layer_ready_at[layer] = ready_at
            self.layers_ready += 1
            for d in users:
                if d.status is None:
                    d.ready += 1
                    d.wake.set()

    def _timeout(self, what: str) -> LLMTimeoutError:
        return LLMTimeoutError(f"{what} within the transfer's deadline of {self.timeout_s * 1000:.0f} ms")

    def _sync_failed(self, layer: int, exc: LLMException) -> None:
        """The synchronizer cannot give ``layer``: the configs that need it fail; the others finish
        the layers they already have."""
        for d in self._dests:
            if d.status is None and d.needs(layer):
                self._fail(d, exc)
        self._note(exc)

    async def _send(self, d: _Dest) -> None:
        try:
            await self._send_layers(d)
        except LLMException as exc:
            self._fail(d, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not leave the task hanging
            err = LLMFailed(f"sending to cluster {d.ci.cluster_id}: {exc!r}")
            err.__cause__ = exc
            self._fail(d, err)

    async def _send_layers(self, d: _Dest) -> None:
        loop = self._loop
        link, remote, plan = await self._engine.target(d.ci, d.planner, self._deadline - loop.time())
        n = self._per_layer
        bounds = plan.tensor_columns(np.arange(d.layers[0], d.layers[-1] + 2) * n)
        while d.status is None:
            while d.ready == d.sent and not self._sync_over and self._stop is None and d.status is None:
                d.wake.clear()
                await d.wake.wait()
            if d.status is not None or self._stop is not None or d.ready == d.sent:
                return
            k0, k1 = d.sent, d.ready  # every layer that is ready and not yet sent, in one batch
            a, b = bounds[k0], bounds[k1]
            remaining = self._deadline - loop.time()
            if remaining <= 0:
                raise self._timeout(f"layers {d.layers[k0]}..{d.layers[k1 - 1]} were not sent")
            d.busy = True
            try:
                await self._engine.push_runs(link, d.ci, self._local, remote, plan, (a, b), remaining)
            finally:
                d.busy = False
            if d.status is not None:  # failed meanwhile (synchronizer): the layers count for nothing
                return
            now = time.perf_counter()
            d.sent = k1
            for k in range(k0, k1):
                self._count(d.layers[k], True, now)
            self._engine.metrics.observe_layers(k1 - k0)
            if d.sent == len(d.layers):
                d.status = LLMStatusCode.LLM_SUCCESS


# ---------------------------------------------------------------------- checks and start
def _dst_span(rng: Any) -> int | None:
    """Number of layers of a destination range (None for (-1, -1)); syntax checked only."""
    if isinstance(rng, range):
        if rng.step != 1 or len(rng) == 0 or rng.start < 0:
            raise LLMParamInvalid(f"dst_layer_range: a range must be non-empty, non-negative, step 1, got {rng!r}")
        return len(rng)
    try:
        first, last = (int(v) for v in rng)
    except (TypeError, ValueError):
        raise LLMParamInvalid(f"dst_layer_range: expected (first, last) or a range, got {rng!r}") from None
    if (first, last) == (-1, -1):
        return None
    if not 0 <= first <= last:
        raise LLMParamInvalid(f"dst_layer_range: {rng!r} is not an inclusive (first, last) layer range")
    return last - first + 1


def _planner(desc: CacheDesc, addrs: np.ndarray, ext: KvCacheExtParam, cfg: TransferConfig, ci: CacheIndex,
             src_blocks: Any = None, dst_blocks: Any = None) -> Callable[[RemoteCache], Plan]:
    """How one config's runs are planned once the destination's cache is known."""
    if src_blocks is not None:
        return lambda remote: plan_blocks(desc, addrs, remote.desc, remote.addrs, src_blocks, dst_blocks, ext)
    return lambda remote: plan_cache(desc, addrs, cfg.src_batch_index, remote.desc, remote.addrs, ci.batch_index,
                                     -1, ext)


def start_transfer(engine: TransferEngine, local: LocalCache, synchronizer: Any,
                   transfer_configs: Sequence[TransferConfig], src_block_indices: Any, dst_block_indices: Any,
                   tensor_num_per_layer: Any, timeout_in_millis: int | None) -> CacheTask:
    """Check everything that needs only local state (LLMParamInvalid), then start the task."""

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise LLMFailed("transfer_cache_async must be called from the event loop that runs LlmDataDist") from None
    if engine.loop is not None and loop is not engine.loop:
        raise LLMFailed("transfer_cache_async must be called from the event loop that runs LlmDataDist")
    if not callable(getattr(synchronizer, "synchronize_layer", None)):
        raise LLMParamInvalid("layer_synchronizer must be a LayerSynchronizer (an object with synchronize_layer)")
    n = tensor_num_per_layer
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise LLMParamInvalid(f"tensor_num_per_layer must be a positive int, got {n!r}")
    n = int(n)
    desc = local.desc
    if desc.num_tensors % n:
        raise LLMParamInvalid(f"tensor_num_per_layer={n} does not divide the source's num_tensors={desc.num_tensors}")
    if isinstance(transfer_configs, TransferConfig) or not isinstance(transfer_configs, Sequence):
        raise LLMParamInvalid("transfer_configs must be a list of TransferConfig")
    if not transfer_configs:
        raise LLMParamInvalid("transfer_configs is empty")
    blocks = src_block_indices is not None or dst_block_indices is not None
    if blocks and (src_block_indices is None or dst_block_indices is None):
        raise LLMParamInvalid("give both src_block_indices and dst_block_indices, or neither (whole slots)")
    long = blocks and any(is_long(b, CALL_CHECK_BLOCKS) for b in (src_block_indices, dst_block_indices))
    if blocks and not long:
        db = block_list(dst_block_indices, 1 << 62, "dst_block_indices")
        if has_duplicates(db, 1 << 62):
            raise LLMParamInvalid("dst_block_indices names a block more than once")
    if timeout_in_millis is not None:
        check_int("timeout_in_millis", timeout_in_millis, 1, MAX_TIMEOUT_MS)
    addrs = local.addrs
    dests: list[_Dest] = []
    for i, cfg in enumerate(transfer_configs):
        try:
            if not isinstance(cfg, TransferConfig):
                raise LLMParamInvalid(f"expected a TransferConfig, got {type(cfg).__name__}")
            ci = check_index(cfg.dst_cache_index, blocks=blocks)
            ext = KvCacheExtParam(cfg.src_layer_range, cfg.dst_layer_range, n)
            if blocks:
                if cfg.src_batch_index != 0:
                    raise LLMParamInvalid("src_batch_index must be 0 with block indices")
                if long:
                    side_tensors(ext, desc, True)  # the lists themselves: in slices, as the task starts
                else:
                    blocks_precheck(desc, src_block_indices, dst_block_indices, ext, True)
            else:
                cache_precheck(desc, cfg.src_batch_index, -1, ext, True)
            tensors = layer_tensors(cfg.src_layer_range, desc.num_tensors, n, "src_layer_range")
            layers = list(range(int(tensors[0]) // n, int(tensors[-1]) // n + 1))
            span = _dst_span(cfg.dst_layer_range)
            if span is not None and span != len(layers):
                raise LLMParamInvalid(f"src_layer_range spans {len(layers)} layers, dst_layer_range {span}")
        except LLMParamInvalid as exc:
            raise LLMParamInvalid(f"transfer_configs[{i}]: {exc.args[0]}") from None
        dests.append(_Dest(i, ci, layers, _planner(desc, addrs, ext, cfg, ci, src_block_indices, dst_block_indices)
                           if blocks else _planner(desc, addrs, ext, cfg, ci)))
    top = max(d.layers[-1] for d in dests)
    known = getattr(synchronizer, "num_layers", None)
    if isinstance(synchronizer, LayerEvents) and top >= synchronizer.num_layers:
        raise LLMParamInvalid(f"the configs need source layer {top}; the LayerEvents has {known} layers")
    num_layers = len({layer for d in dests for layer in d.layers})
    if timeout_in_millis is not None:
        timeout_s = timeout_in_millis / 1000
    else:
        timeout_s = engine.sync_wait_s * num_layers
    checks = _list_checks(desc, src_block_indices, dst_block_indices) if long else None
    return CacheTask(engine, local, synchronizer, dests, n, timeout_s, checks)


def _list_checks(desc: CacheDesc, src_blocks: Any, dst_blocks: Any) -> Steps:
    """The checks of long block lists, in steps that the task runs before it sends anything: one
    100k-entry list took 13-16 ms to check at once, all of it on the caller's loop."""
    sb = yield from block_list_steps(src_blocks, desc.num_blocks, "src_block_indices")
    db = yield from block_list_steps(dst_blocks, 1 << 62, "dst_block_indices")
    if sb.size != db.size:
        raise LLMParamInvalid(f"src_block_indices has {sb.size} entries, dst_block_indices has {db.size}")
    if (yield from duplicates_steps(db, 1 << 62)):
        raise LLMParamInvalid("dst_block_indices names a block more than once")
