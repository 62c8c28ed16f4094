"""The one-shot calls behind ``kvflow.sync``: a blocking call started on the loop thread and waited
for by its caller (``_Call``), and a ``concurrent.futures.Future`` fed by a task on that loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, TypeVar

from ._status import LLMFailed

T = TypeVar("T")


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
        except BaseException:  # KeyboardInterrupt in the caller: stop the call, as cancelling an awaiter does,
            self._cancel(loop)  # and return only once it has stopped (its memory is then no longer used)
            self._wait_stopped(loop)
            raise
        exc = self.exc
        if exc is None:
            return self.result
        self.exc = None
        try:
            raise exc
        finally:
            del exc

    def _wait_stopped(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a cancel: wait until the call has ended on the loop, through further interrupts; stop
        waiting only if the loop is closed (then nothing of it runs any more)."""
        while True:
            try:
                if self.lock.acquire(timeout=0.25):
                    return
            except BaseException:  # another Ctrl-C: the transfer may still write into the caller's memory
                continue
            if loop.is_closed():
                return

    def _cancel(self, loop: asyncio.AbstractEventLoop) -> None:
        def cancel() -> None:
            if self.task is not None:
                self.task.cancel()

        try:
            loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the loop is closed: nothing runs any more
            pass


class OpFuture(concurrent.futures.Future[T]):
    """The future of a ``submit_*`` call. ``cancel()`` of one not yet done also stops the operation on
    the loop and returns once nothing of it runs any more, so that no byte of it lands in the
    caller's memory afterwards (on the loop thread itself it cannot wait for the loop, and does not)."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        super().__init__()
        self.stopped = threading.Event()  # set once the operation has ended, or will never start
        self._loop_thread = loop_thread

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        if threading.current_thread() is not self._loop_thread:
            while not self.stopped.wait(0.25) and self._loop_thread.is_alive():
                pass
        return True


def _start_future(loop: asyncio.AbstractEventLoop, fut: OpFuture[Any], fn: Callable[..., Any],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """On the loop thread: run ``fn(*args, **kwargs)`` as a task whose outcome settles ``fut``;
    cancelling ``fut`` cancels the task (``fut.stopped`` is set once it has ended)."""
    if fut.cancelled():
        fut.stopped.set()
        return
    try:
        task = loop.create_task(fn(*args, **kwargs))
    except BaseException as exc:
        _settle(fut, None, exc)
        fut.stopped.set()
        return

    def copy(t: asyncio.Future[Any]) -> None:
        if t.cancelled():
            if not fut.cancelled():  # cancelled by close(), not through the future
                _settle(fut, None, _closed_while_running())
        elif t.exception() is not None:
            _settle(fut, None, t.exception())
        else:
            _settle(fut, t.result(), None)
        fut.stopped.set()

    def on_cancel(f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop is closed: the task runs no more
                fut.stopped.set()

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
