"""The one-shot calls behind ``kvflow.sync``: a blocking call started on the loop thread and waited
for by its caller (``_Call``), and a ``concurrent.futures.Future`` fed by a task on that loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine

from ._status import LLMFailed


def _closed_while_running() -> LLMFailed:
    return LLMFailed("the call was cancelled: its kvflow.sync.LlmDataDist was closed while it ran")


class _Call:
    """One blocking call: started on the loop thread, waited for by the caller (a one-shot lock)."""

    __slots__ = ("exc", "lock", "result", "task")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.result: Any = None
        self.exc: BaseException | None = None
        self.task: asyncio.Future[Any] | None = None

    # on the loop thread
    def start(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        try:
            res = fn(*args, **kwargs)
        except BaseException as exc:
            self.exc = exc
            self.lock.release()
            return
        if asyncio.iscoroutine(res):
            self.task = loop.create_task(self._run(res))
        else:  # a plain method (stats, link_info): its value is the result
            self.result = res
            self.lock.release()

    async def _run(self, coro: Coroutine[Any, Any, Any]) -> None:
        # the outcome is recorded and the caller released inside the task's own step (no done
        # callback: that would take one more turn of the loop before the caller wakes)
        try:
            self.result = await coro
        except asyncio.CancelledError:
            self.exc = _closed_while_running()
        except BaseException as exc:
            self.exc = exc
        finally:
            self.lock.release()

    # on the caller's thread
    def wait(self, loop: asyncio.AbstractEventLoop) -> Any:
        try:
            self.lock.acquire()
        except BaseException:  # KeyboardInterrupt in the caller: stop the call, as cancelling an awaiter does
            self._cancel(loop)
            raise
        exc = self.exc
        if exc is None:
            return self.result
        self.exc = None
        try:
            raise exc
        finally:
            del exc

    def _cancel(self, loop: asyncio.AbstractEventLoop) -> None:
        def cancel() -> None:
            if self.task is not None:
                self.task.cancel()

        try:
            loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the loop is closed: nothing runs any more
            pass


def _start_future(loop: asyncio.AbstractEventLoop, fut: concurrent.futures.Future[Any], fn: Callable[..., Any],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """On the loop thread: run ``fn(*args, **kwargs)`` as a task whose outcome settles ``fut``;
    cancelling ``fut`` cancels the task."""
    if fut.cancelled():
        return
    try:
        task = loop.create_task(fn(*args, **kwargs))
    except BaseException as exc:
        _settle(fut, None, exc)
        return

    def copy(t: asyncio.Future[Any]) -> None:
        if t.cancelled():
            if not fut.cancelled():  # cancelled by close(), not through the future
                _settle(fut, None, _closed_while_running())
        elif t.exception() is not None:
            _settle(fut, None, t.exception())
        else:
            _settle(fut, t.result(), None)

    def on_cancel(f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass

    task.add_done_callback(copy)
    fut.add_done_callback(on_cancel)


def _settle(fut: concurrent.futures.Future[Any], result: Any, exc: BaseException | None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # the caller cancelled it meanwhile
        pass
