"""``kvflow.sync``: :class:`kvflow.LlmDataDist` as blocking calls, for threads that do not run asyncio.

Each :class:`LlmDataDist` here owns a private event loop (uvloop when installed) on one background
daemon thread, started by the constructor, and a :class:`kvflow.LlmDataDist` that lives on that loop.
Every method runs its counterpart there and blocks the calling thread until it ends, returning its
value or raising its exception (the same object: type, ``status_code`` and the loop-side traceback).
``submit_<name>`` variants return a :class:`concurrent.futures.Future` instead of blocking. Any
number of threads may call one instance at once.

A blocking method called in a running event loop (any thread's, kvflow's own included) raises
:class:`kvflow.LLMFailed` (a ``RuntimeError``) at once instead of blocking that loop or deadlocking:
use :class:`kvflow.LlmDataDist` and ``await`` there. See docs/sync.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from typing import Any, Callable, Coroutine, Mapping, Sequence, TypeVar

from ._calls import OpFuture, _Call, _start_future
from ._datadist import LinkInfo
from ._datadist import LlmDataDist as _AsyncLlmDataDist
from ._engine import PULL, PUSH, Request
from ._layerwise import CacheTask as _AsyncCacheTask
from ._layerwise import LayerSynchronizer, TransferConfig
from ._status import LinkResults, LLMFailed, LLMStatusCode
from ._types import BlockList, Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, LlmRole

__all__ = ["CacheTask", "LlmDataDist"]

T = TypeVar("T")

_CLOSE_DRAIN_S = 5.0  # at close, how long tasks still on the loop get to end after being cancelled


def _new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed (as :func:`kvflow.run` picks), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# What to do instead, in a coroutine, where it is not "await <name>(...)"
_ASYNC_FORM = {
    "close": "await finalize()",
    "stats": "call stats() (it does not block)",
    "link_info": "call link_info(...) (it does not block)",
    "transfer_cache_async": "call transfer_cache_async(...) (it returns at once)",
    "CacheTask.wait": "await the task",
    "CacheTask.synchronize": "await task.synchronize(...)",
    "CacheTask.cancel": "call task.cancel() (it does not block)",
}


def _in_running_loop(what: str) -> LLMFailed | None:
    """The error for blocking call ``what`` made in a running event loop, or None when there is none."""
    if asyncio._get_running_loop() is None:
        return None
    owner = "" if "." in what else "LlmDataDist."
    form = _ASYNC_FORM.get(what, f"await {what}(...)")
    submit = (f", or await asyncio.wrap_future(dd.submit_{what}(...))"
              if hasattr(LlmDataDist, f"submit_{what}") else "")
    return LLMFailed(f"kvflow.sync.{owner}{what} blocks the calling thread and was called in a running "
                     f"event loop: use kvflow.LlmDataDist and {form} there{submit}")



class _Runner:
    """The private loop and its daemon thread; ``closed`` (under ``lock``) stops new work.

    It holds no reference to the facade, so that an instance dropped without ``close()`` is collected."""

    def __init__(self, name: str) -> None:
        self.loop = _new_loop()
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def schedule(self, what: str, callback: Callable[..., None], *args: Any) -> None:
        """``call_soon_threadsafe`` unless closed (then LLMFailed): nothing is scheduled once the loop
        is being stopped, so every scheduled call runs and its caller is released."""
        with self.lock:
            if self.closed:
                raise LLMFailed(f"{what}: this kvflow.sync.LlmDataDist was closed; create a new one")
            self.loop.call_soon_threadsafe(callback, *args)

    def close_with(self, coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> _Call | None:
        """Mark closed and schedule ``coro_fn()`` as the last call; None if already closed."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            call = _Call()
            self.loop.call_soon_threadsafe(call.start, self.loop, coro_fn, (), {})
            return call

    def stop_and_join(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed already (the loop ended by itself)
            pass
        self.thread.join()

    def _main(self) -> None:
        """Run until stopped; then run what was scheduled before closing, cancel what is left, close."""
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            with self.lock:  # whatever ended the loop, nothing new is scheduled from now on
                self.closed = True
            try:
                loop.run_until_complete(asyncio.sleep(0))  # calls scheduled before: they start their tasks
                tasks = asyncio.all_tasks(loop)
                for t in tasks:
                    t.cancel()  # their callers get LLMFailed (closed while it ran)
                if tasks:
                    loop.run_until_complete(asyncio.wait(tasks, timeout=_CLOSE_DRAIN_S))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                loop.close()


def _abandon(runner: _Runner, dd: _AsyncLlmDataDist) -> None:
    """An instance was garbage-collected without ``close()``: finalize and stop, without waiting."""

    async def finalize() -> None:
        try:
            await dd.finalize()
        finally:
            runner.loop.stop()

    try:
        runner.close_with(finalize)
    except RuntimeError:  # the loop is closed
        pass


class LlmDataDist:
    """:class:`kvflow.LlmDataDist` with blocking methods, for threads that do not run asyncio.

    Same constructor, methods, arguments, return values and exceptions as the async class; each call
    blocks until the operation ends. ``submit_<name>`` runs a coroutine method without blocking and
    returns a :class:`concurrent.futures.Future`. The instance owns one event loop on a daemon thread;
    ``close()`` (or leaving ``with``) finalizes and joins it. Thread-safe.
    """

    def __init__(self, cluster_id: int, role: LlmRole = LlmRole.MIX, *,
                 options: Mapping[str, str] | None = None) -> None:
        self._dd = _AsyncLlmDataDist(cluster_id, role, options=options)  # checks the arguments here
        self._listen: tuple[str, int] | None = None
        self._runner = _Runner(f"kvflow-sync-{self._dd.cluster_id}")
        self._loop = self._runner.loop
        self._thread = self._runner.thread
        self._schedule = self._runner.schedule
        self._close_lock = threading.Lock()
        self._gc = weakref.finalize(self, _abandon, self._runner, self._dd)
        self._gc.atexit = False  # at exit, peers see the connections close, as for any ended process

    def __repr__(self) -> str:
        return f"<kvflow.sync.{self._dd!r}{' closed' if self.closed else ''}>"

    # ------------------------------------------------------------------ plumbing
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` (coroutine function or plain function) on the loop thread; block for its outcome."""
        err = _in_running_loop(what)
        if err is not None:
            raise err
        call = _Call()
        self._schedule(what, call.start, self._loop, fn, args, kwargs)
        return call.wait(self._loop)

    def _now(self, what: str, timeout_in_millis: int | None, build: Callable[..., Request], *args: Any) -> bool:
        """The fast path of a blocking transfer: a small one-sided batch (shm) copied on this very
        thread, with no hand-off to the loop (``TransferEngine.run_now``). False when the loop must
        run it: the link or the peer's cache is not known yet, the batch is large, the transport
        cannot, or this instance is closed. Bad arguments raise here, as the loop would raise them."""
        err = _in_running_loop(what)
        if err is not None:
            raise err
        if self._runner.closed:
            return False  # _call says so
        engine = self._dd._engine
        engine.deadline(timeout_in_millis)  # checked as on the loop, although a copy made here has no deadline
        return engine.run_now(build(*args))

    def _blocks_now(self, direction: str, what: str, timeout_in_millis: int | None, ci: CacheIndex, cache: Cache,
                    src_blocks: BlockList, dst_blocks: BlockList) -> bool:
        """The native fast path of a small block transfer (``TransferEngine.blocks_now``) on this thread;
        False when it does not apply (then ``_now``, then the loop, as before)."""
        if self._runner.closed or not self._dd._initialized:
            return False
        err = _in_running_loop(what)
        if err is not None:
            raise err
        moved = self._dd._engine.blocks_now(direction, ci, cache, src_blocks, dst_blocks, timeout_in_millis, True)
        assert isinstance(moved, bool)  # on a caller's thread nothing is left Started (TransferEngine.blocks_now)
        return moved

    def _submit(self, what: str, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any,
                **kwargs: Any) -> concurrent.futures.Future[T]:
        fut: OpFuture[T] = OpFuture(self._thread)
        self._schedule(f"submit_{what}", _start_future, self._loop, fut, fn, args, kwargs)
        return fut

    # ------------------------------------------------------------------ lifecycle
    async def _initialize(self, options: Mapping[str, str] | None) -> None:
        await self._dd.initialize(options)
        self._listen = self._dd.listen_address

    async def _finalize(self) -> None:
        try:
            await self._dd.finalize()
        finally:
            self._listen = None

    def initialize(self, options: Mapping[str, str] | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.initialize`."""
        self._call("initialize", self._initialize, options)

    def submit_initialize(self, options: Mapping[str, str] | None = None) -> concurrent.futures.Future[None]:
        """:meth:`initialize` without blocking."""
        return self._submit("initialize", self._initialize, options)

    def finalize(self) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.finalize` (the loop thread keeps running: see :meth:`close`)."""
        self._call("finalize", self._finalize)

    def submit_finalize(self) -> concurrent.futures.Future[None]:
        """:meth:`finalize` without blocking."""
        return self._submit("finalize", self._finalize)

    def close(self) -> None:
        """Finalize (if initialized), stop the loop and join its thread. Safe to call twice and from
        several threads (later calls wait for the first); any other call afterwards raises LLMFailed."""
        err = _in_running_loop("close")
        if err is not None:
            raise err
        with self._close_lock:
            if not self._thread.is_alive() and self._runner.closed:
                return
            self._gc.detach()
            try:
                call = self._runner.close_with(self._finalize)
                if call is not None:
                    call.wait(self._loop)
            finally:
                self._runner.stop_and_join()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the loop thread ended)."""
        return self._runner.closed

    def __enter__(self) -> LlmDataDist:
        try:
            self.initialize()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plain attributes
    @property
    def cluster_id(self) -> int:
        """This instance's cluster id."""
        return self._dd.cluster_id

    @property
    def role(self) -> LlmRole:
        """This instance's role (a label)."""
        return self._dd.role

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """(ip, port) the instance listens on, once initialized with ``llm.ListenIpInfo``; None after
        finalize. Does not block."""
        return self._listen

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports this instance offers, in order of preference. Does not block."""
        return self._dd.transports

    def stats(self) -> dict[str, Any]:
        """Blocking :meth:`kvflow.LlmDataDist.stats` (read on the loop thread, so it is consistent)."""
        return self._call("stats", self._dd.stats)

    def link_info(self, cluster_id: int) -> LinkInfo:
        """Blocking :meth:`kvflow.LlmDataDist.link_info`."""
        return self._call("link_info", self._dd.link_info, cluster_id)

    def links(self) -> dict[int, LinkInfo]:
        """Blocking :meth:`kvflow.LlmDataDist.links`."""
        return self._call("links", self._dd.links)

    def local_caches(self) -> dict[int, Cache]:
        """Blocking :meth:`kvflow.LlmDataDist.local_caches`."""
        return self._call("local_caches", self._dd.local_caches)

    # ------------------------------------------------------------------ caches
    def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any], cfg: object | None = None, *,
                          key: int | None = None) -> Cache:
        """Blocking :meth:`kvflow.LlmDataDist.register_kv_cache`."""
        return self._call("register_kv_cache", self._dd.register_kv_cache, cache_desc, addrs, cfg, key=key)

    def submit_register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any], cfg: object | None = None, *,
                                 key: int | None = None) -> concurrent.futures.Future[Cache]:
        """:meth:`register_kv_cache` without blocking."""
        return self._submit("register_kv_cache", self._dd.register_kv_cache, cache_desc, addrs, cfg, key=key)

    def resolve_cache_key(self, cluster_id: int, key: int, *, timeout_in_millis: int | None = None) -> int:
        """Blocking :meth:`kvflow.LlmDataDist.resolve_cache_key`."""
        return self._call("resolve_cache_key", self._dd.resolve_cache_key, cluster_id, key,
                          timeout_in_millis=timeout_in_millis)

    def submit_resolve_cache_key(self, cluster_id: int, key: int, *,
                                 timeout_in_millis: int | None = None) -> concurrent.futures.Future[int]:
        """:meth:`resolve_cache_key` without blocking."""
        return self._submit("resolve_cache_key", self._dd.resolve_cache_key, cluster_id, key,
                            timeout_in_millis=timeout_in_millis)

    def unregister_kv_cache(self, cache_id: int, *, timeout_in_millis: int | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.unregister_kv_cache`."""
        self._call("unregister_kv_cache", self._dd.unregister_kv_cache, cache_id,
                   timeout_in_millis=timeout_in_millis)

    def submit_unregister_kv_cache(self, cache_id: int, *,
                                   timeout_in_millis: int | None = None) -> concurrent.futures.Future[None]:
        """:meth:`unregister_kv_cache` without blocking."""
        return self._submit("unregister_kv_cache", self._dd.unregister_kv_cache, cache_id,
                            timeout_in_millis=timeout_in_millis)

    # ------------------------------------------------------------------ links
    def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000
                          ) -> LinkResults:
        """Blocking :meth:`kvflow.LlmDataDist.link_llm_clusters`."""
        return self._call("link_llm_clusters", self._dd.link_llm_clusters, clusters, timeout_in_millis)

    def submit_link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000
                                 ) -> concurrent.futures.Future[LinkResults]:
        """:meth:`link_llm_clusters` without blocking."""
        return self._submit("link_llm_clusters", self._dd.link_llm_clusters, clusters, timeout_in_millis)

    def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000,
                            force: bool = False) -> list[LLMStatusCode]:
        """Blocking :meth:`kvflow.LlmDataDist.unlink_llm_clusters`."""
        return self._call("unlink_llm_clusters", self._dd.unlink_llm_clusters, clusters, timeout_in_millis, force)

    def submit_unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000,
                                   force: bool = False) -> concurrent.futures.Future[list[LLMStatusCode]]:
        """:meth:`unlink_llm_clusters` without blocking."""
        return self._submit("unlink_llm_clusters", self._dd.unlink_llm_clusters, clusters, timeout_in_millis,
                            force)

    # ------------------------------------------------------------------ notifications
    def send_notification(self, cluster_id: int, payload: bytes, *, timeout_in_millis: int | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.send_notification`."""
        self._call("send_notification", self._dd.send_notification, cluster_id, payload,
                   timeout_in_millis=timeout_in_millis)

    def submit_send_notification(self, cluster_id: int, payload: bytes, *,
                                 timeout_in_millis: int | None = None) -> concurrent.futures.Future[None]:
        """:meth:`send_notification` without blocking."""
        return self._submit("send_notification", self._dd.send_notification, cluster_id, payload,
                            timeout_in_millis=timeout_in_millis)

    def get_notifications(self) -> list[tuple[int, bytes]]:
        """:meth:`kvflow.LlmDataDist.get_notifications`; never blocks (it takes a queue that the loop fills)."""
        return self._dd.get_notifications()

    # ------------------------------------------------------------------ transfers
    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0, size: int = -1,
                      ext_param: KvCacheExtParam | None = None, *, timeout_in_millis: int | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.pull_kv_cache`."""
        args = (src_cache_index, dst_cache, batch_index, size, ext_param)
        if not self._now("pull_kv_cache", timeout_in_millis, self._dd._pull_cache, *args):
            self._call("pull_kv_cache", self._dd.pull_kv_cache, *args, timeout_in_millis=timeout_in_millis)

    def submit_pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                             timeout_in_millis: int | None = None) -> concurrent.futures.Future[None]:
        """:meth:`pull_kv_cache` without blocking."""
        return self._submit("pull_kv_cache", self._dd.pull_kv_cache, src_cache_index, dst_cache, batch_index,
                            size, ext_param, timeout_in_millis=timeout_in_millis)

    def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: BlockList,
                       dst_blocks: BlockList, ext_param: KvCacheExtParam | None = None, *,
                       timeout_in_millis: int | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.pull_kv_blocks`."""
        if ext_param is None and self._blocks_now(PULL, "pull_kv_blocks", timeout_in_millis, src_cache_index,
                                                  dst_cache, src_blocks, dst_blocks):
            return
        args = (src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        if not self._now("pull_kv_blocks", timeout_in_millis, self._dd._pull_blocks, *args):
            self._call("pull_kv_blocks", self._dd.pull_kv_blocks, *args, timeout_in_millis=timeout_in_millis)

    def submit_pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: BlockList,
                              dst_blocks: BlockList, ext_param: KvCacheExtParam | None = None, *,
                              timeout_in_millis: int | None = None) -> concurrent.futures.Future[None]:
        """:meth:`pull_kv_blocks` without blocking."""
        return self._submit("pull_kv_blocks", self._dd.pull_kv_blocks, src_cache_index, dst_cache, src_blocks,
                            dst_blocks, ext_param, timeout_in_millis=timeout_in_millis)

    def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                      timeout_in_millis: int | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.push_kv_cache`."""
        args = (src_cache, dst_cache_index, src_batch_index, size, ext_param)
        if not self._now("push_kv_cache", timeout_in_millis, self._dd._push_cache, *args):
            self._call("push_kv_cache", self._dd.push_kv_cache, *args, timeout_in_millis=timeout_in_millis)

    def submit_push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                             size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                             timeout_in_millis: int | None = None) -> concurrent.futures.Future[None]:
        """:meth:`push_kv_cache` without blocking."""
        return self._submit("push_kv_cache", self._dd.push_kv_cache, src_cache, dst_cache_index,
                            src_batch_index, size, ext_param, timeout_in_millis=timeout_in_millis)

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: BlockList,
                       dst_blocks: BlockList, ext_param: KvCacheExtParam | None = None, *,
                       timeout_in_millis: int | None = None) -> None:
        """Blocking :meth:`kvflow.LlmDataDist.push_kv_blocks`."""
        if ext_param is None and self._blocks_now(PUSH, "push_kv_blocks", timeout_in_millis, dst_cache_index,
                                                  src_cache, src_blocks, dst_blocks):
            return
        args = (src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)
        if not self._now("push_kv_blocks", timeout_in_millis, self._dd._push_blocks, *args):
            self._call("push_kv_blocks", self._dd.push_kv_blocks, *args, timeout_in_millis=timeout_in_millis)

    def submit_push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: BlockList,
                              dst_blocks: BlockList, ext_param: KvCacheExtParam | None = None, *,
                              timeout_in_millis: int | None = None) -> concurrent.futures.Future[None]:
        """:meth:`push_kv_blocks` without blocking."""
        return self._submit("push_kv_blocks", self._dd.push_kv_blocks, src_cache, dst_cache_index, src_blocks,
                            dst_blocks, ext_param, timeout_in_millis=timeout_in_millis)

    # ------------------------------------------------------------------ layer-wise push
    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig], src_block_indices: BlockList | None = None,
                             dst_block_indices: BlockList | None = None, tensor_num_per_layer: int = 2, *,
                             timeout_in_millis: int | None = None) -> CacheTask:
        """:meth:`kvflow.LlmDataDist.transfer_cache_async`: starts the layer-wise push on the loop thread
        and returns a :class:`CacheTask` at once (argument errors are raised here).

        ``layer_synchronizer.synchronize_layer`` may be a coroutine function (awaited on kvflow's loop)
        or a plain blocking function (run on a worker thread of the task, never on the loop)."""
        task = self._call("transfer_cache_async", self._dd.transfer_cache_async, src_cache, layer_synchronizer,
                          transfer_configs, src_block_indices, dst_block_indices, tensor_num_per_layer,
                          timeout_in_millis=timeout_in_millis)
        return CacheTask(self, task)


async def _await(task: _AsyncCacheTask) -> None:
    await task


class CacheTask:
    """A running :meth:`LlmDataDist.transfer_cache_async`, with blocking waits.

    ``wait()`` is ``await task`` of :class:`kvflow.CacheTask`: it returns on success and raises the
    typed error of the first failure. ``synchronize()`` blocks; the other members are those of the
    async task and do not block (progress dicts are copies)."""

    def __init__(self, owner: LlmDataDist, task: _AsyncCacheTask) -> None:
        self._owner = owner
        self._task = task

    def __repr__(self) -> str:
        return f"<kvflow.sync.{self._task!r}>"

    def wait(self) -> None:
        """Block until the task ends (bounded by its deadline); raise the first failure's typed error."""
        if not self._task.done():
            self._owner._call("CacheTask.wait", _await, self._task)
        err = self._task.exception()
        if err is not None:
            raise err

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Block at most ``timeout_in_millis``: LLM_SUCCESS, the first failure's code, or LLM_TIMEOUT
        if the task is still running (it goes on)."""
        if self._task.done():
            err = self._task.exception()
            return err.status_code if err is not None else LLMStatusCode.LLM_SUCCESS
        return self._owner._call("CacheTask.synchronize", self._task.synchronize, timeout_in_millis)

    def cancel(self) -> bool:
        """Stop sending further layers (a send in flight completes); False if the task already ended."""
        if self._task.done():
            return False
        return bool(self._owner._call("CacheTask.cancel", self._task.cancel))

    def get_results(self) -> list[LLMStatusCode | None]:
        """One status per config (None: none of its layers was sent); final once ``done()``."""
        return self._task.get_results()

    def done(self) -> bool:
        """Whether the task has ended."""
        return self._task.done()

    def cancelled(self) -> bool:
        """Whether ``cancel()`` stopped the task."""
        return self._task.cancelled()

    def exception(self) -> BaseException | None:
        """The first failure so far (None if there was none)."""
        return self._task.exception()

    @property
    def num_layers(self) -> int:
        """Source layers that at least one config needs."""
        return self._task.num_layers

    @property
    def layers_ready(self) -> int:
        """Layers the synchronizer confirmed."""
        return self._task.layers_ready

    @property
    def layers_sent(self) -> int:
        """Layers delivered to every destination that needs them (failed destinations aside)."""
        return self._task.layers_sent

    @property
    def config_layers_sent(self) -> list[int]:
        """Per config: how many of its layers reached the destination."""
        return self._task.config_layers_sent

    @property
    def layer_ready_at(self) -> dict[int, float]:
        """A copy: ``time.perf_counter()`` at which the synchronizer returned True, per layer."""
        return dict(self._task.layer_ready_at)

    @property
    def layer_sent_at(self) -> dict[int, float]:
        """A copy: ``time.perf_counter()`` at which each layer reached its last destination."""
        return dict(self._task.layer_sent_at)

    @property
    def started_at(self) -> float:
        """``time.perf_counter()`` when the task started."""
        return self._task.started_at

    @property
    def finished_at(self) -> float | None:
        """``time.perf_counter()`` when the task ended (None while it runs)."""
        return self._task.finished_at

    @property
    def exposed_seconds(self) -> float | None:
        """From the last layer being reported ready to the end of the task."""
        return self._task.exposed_seconds

    @property
    def timeout_s(self) -> float:
        """The task's deadline, in seconds from its start."""
        return self._task.timeout_s

