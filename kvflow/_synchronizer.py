"""Layer readiness for ``transfer_cache_async``: the ``LayerSynchronizer`` contract, ``LayerEvents``
(layers marked ready from the loop or from any thread), and the worker thread that runs a blocking
synchronizer off the event loop."""

from __future__ import annotations

import abc
import asyncio
import operator
import queue
import threading
import time
from typing import Any, Awaitable, Callable

from ._status import LLMParamInvalid, LLMTimeoutError

__all__ = ["LayerEvents", "LayerSynchronizer"]


class LayerSynchronizer(abc.ABC):
    """Says when a source layer's KV is ready to be sent.

    ``synchronize_layer`` returns True once layer ``layer_index`` is ready and False if it never
    will be; raising also ends the task. It may be a coroutine function (awaited on the event loop)
    or a plain blocking function (run in a thread of its own, so that it does not block the loop).
    ``timeout_in_millis`` is the time left before the task's deadline: a blocking implementation
    should give up by then, since a thread cannot be interrupted."""

    @abc.abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool | Awaitable[bool]:
        """True when layer ``layer_index`` is ready, False when it never will be."""


class LayerEvents(LayerSynchronizer):
    """A ready-made synchronizer: the compute side (any thread) calls ``mark_ready(layer)`` as each
    layer finishes, or ``fail(exc)`` when the rest never will.

    ``ready_at[layer]`` is the ``time.perf_counter()`` at which the layer was marked ready."""

    def __init__(self, num_layers: int) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise LLMParamInvalid(f"num_layers must be a positive int, got {num_layers!r}")
        self.num_layers = num_layers
        self.ready_at: list[float | None] = [None] * num_layers
        self._lock = threading.Lock()
        self._failed = False
        self._failure: BaseException | None = None
        self._waiters: dict[int, list[asyncio.Future[bool]]] = {}

    def __repr__(self) -> str:
        ready = sum(t is not None for t in self.ready_at)
        return f"<LayerEvents {ready}/{self.num_layers} ready{' failed' if self._failed else ''}>"

    def _check(self, layer: Any) -> int:
        try:
            i = operator.index(layer)
        except TypeError:
            raise LLMParamInvalid(f"layer must be an int, got {layer!r}") from None
        if isinstance(layer, bool) or not 0 <= i < self.num_layers:
            raise LLMParamInvalid(f"layer {layer!r} is outside 0..{self.num_layers - 1}")
        return i

    def mark_ready(self, layer: int) -> None:
        """Layer ``layer`` is computed (thread-safe; marking a layer twice is harmless)."""
        now = time.perf_counter()
        with self._lock:
            i = self._check(layer)
            if self.ready_at[i] is not None:
                return
            self.ready_at[i] = now
            waiters = self._waiters.pop(i, [])
        for fut in waiters:
            _resolve(fut, True, None)

    def fail(self, exc: BaseException | None = None) -> None:
        """Layers not yet marked ready never will be: waiting for one raises ``exc``, or returns False
        without one (thread-safe; only the first call counts)."""
        with self._lock:
            if self._failed:
                return
            self._failed = True
            self._failure = exc
            waiters = [f for fs in self._waiters.values() for f in fs]
            self._waiters.clear()
        for fut in waiters:
            _resolve(fut, False, exc)

    def is_ready(self, layer: int) -> bool:
        """Whether ``layer`` has been marked ready."""
        return self.ready_at[self._check(layer)] is not None

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None = None) -> bool:
        """Wait until ``layer_index`` is marked ready (True) or ``fail`` is called; LLMTimeoutError when
        ``timeout_in_millis`` passes first."""
        loop = asyncio.get_running_loop()
        with self._lock:
            i = self._check(layer_index)
            if self.ready_at[i] is not None:
                return True
            if self._failed:
                if self._failure is not None:
                    raise self._failure
                return False
            fut: asyncio.Future[bool] = loop.create_future()
            self._waiters.setdefault(i, []).append(fut)
        try:
            timeout = None if timeout_in_millis is None else max(0.0, timeout_in_millis / 1000)
            done, _ = await asyncio.wait({fut}, timeout=timeout)
            if not done:
                raise LLMTimeoutError(f"layer {i} was not marked ready within {timeout_in_millis} ms")
            return fut.result()
        finally:
            with self._lock:
                waiting = self._waiters.get(i)
                if waiting is not None and fut in waiting:
                    waiting.remove(fut)
            if not fut.done():
                fut.cancel()


def _resolve(fut: asyncio.Future[bool], ok: bool, exc: BaseException | None) -> None:
    try:
        fut.get_loop().call_soon_threadsafe(_settle, fut, ok, exc)
    except RuntimeError:  # that loop is closed: nobody waits any more
        pass


def _settle(fut: asyncio.Future[bool], ok: bool, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(ok)


class _Worker:
    """One daemon thread that runs a blocking synchronizer's calls, one after another. A daemon,
    so that a synchronizer that never returns cannot hold up the interpreter's exit. A call's future
    resolves to (its value, the ``time.perf_counter()`` at which it returned on the worker thread)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._main, name="kvflow-layer-sync", daemon=True).start()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = loop.create_future()
        self._q.put((loop, fut, fn, args))
        return fut

    def close(self) -> None:
        self._q.put(None)

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            loop, fut, fn, args = item
            try:
                result, exc = (fn(*args), time.perf_counter()), None
            except BaseException as e:  # handed to the event loop, which decides
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(_deliver, fut, result, exc)
            except RuntimeError:  # the loop is closed
                pass


def _deliver(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the task stopped waiting
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
