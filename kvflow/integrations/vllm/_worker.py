"""The connector's worker side: kvflow on a private event loop thread, driven from vLLM's model runner.

vLLM's worker is not asyncio, and its forward pass must never wait on kvflow's control plane
(linking, resolving a cache, notifications). So each worker owns one daemon thread running an
event loop with an async ``kvflow.LlmDataDist``; the model runner's calls only schedule coroutines
there and read results that those coroutines leave behind (under a lock). The exceptions are
``wait_for_layer_load`` in the ``layer`` load mode, which waits for exactly the layer the model is
about to read, and registration, which happens once at start-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvflow import (
    CacheIndex,
    ClusterInfo,
    IpInfo,
    KvCacheExtParam,
    LayerEvents,
    LlmDataDist,
    LLMException,
    LLMLinkFailed,
    LlmRole,
    LLMStatusCode,
    TransferConfig,
)

from ._layout import Layout, describe
from ._settings import CACHE_KEY, Push, Recv, Settings, StepMeta, pack, unpack

log = logging.getLogger("kvflow.vllm")
T = TypeVar("T")


class _LoopThread:
    """An event loop on a daemon thread; ``submit`` runs a coroutine there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class _Want:
    """Push mode, prefill side: where the decode engine wants a request's blocks."""

    cluster_id: int
    d_req: str
    first: int
    blocks: list[int]


@dataclass
class _PushState:
    pending: list[tuple[int, int]] = field(default_factory=list)  # (index in request, local block) not yet pushed
    tasks: list[concurrent.futures.Future[bool]] = field(default_factory=list)
    last_seen: bool = False  # the step that completes the prompt was scheduled
    failed: bool = False


class WorkerSide:
    def __init__(self, settings: Settings, rank: int, num_blocks: int, producer: bool, consumer: bool) -> None:
        self.s = settings
        self.rank = rank
        self.num_blocks = num_blocks
        self.cluster_id = settings.cluster_id + rank
        self.producer = producer
        self.layout: Layout | None = None
        self._cache: Any = None
        self._thread = _LoopThread(f"kvflow-vllm-{rank}")
        role = LlmRole.PROMPT if producer and not consumer else LlmRole.DECODER if consumer and not producer \
            else LlmRole.MIX
        self.dd = LlmDataDist(self.cluster_id, role)
        self._run(self.dd.initialize(settings.kvflow_options(rank)))
        self._lock = threading.Lock()
        self._links: dict[int, asyncio.Future[None]] = {}  # dials by peer cluster (loop thread only)
        # results left by coroutines, taken by get_finished / get_block_ids_with_load_errors
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()  # layer mode: blocks that failed inside a step
        self._failed: set[str] = set()  # async loads that failed: vLLM recomputes the request
        self._sent: set[str] = set()
        # decode side
        self._layer_futs: dict[int, list[tuple[concurrent.futures.Future[bool], Recv]]] = {}
        self._awaiting_push: dict[str, asyncio.Future[bool]] = {}
        # prefill side
        self._holding: dict[str, float] = {}  # request -> time at which its blocks are freed regardless
        self._released_early: set[str] = set()
        self._wants: dict[str, _Want] = {}  # by the key the decode side names (Push.key)
        self._push_keys: dict[str, str] = {}  # that key -> our request id
        self._pushes: dict[str, _PushState] = {}
        self._step_events: LayerEvents | None = None
        self.expired = 0  # prefill requests freed by the timeout, the decode side never having said so

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._thread.submit(coro).result()

    # ------------------------------------------------------------------ start-up
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> Layout:
        self.layout = describe(kv_caches, self.num_blocks)
        self._cache = self._run(self.dd.register_kv_cache(self.layout.desc, self.layout.tensors, key=CACHE_KEY))
        log.info("kvflow connector: rank %d (cluster %d) registered %d layers as %d tensors of %d blocks x %d bytes",
                 self.rank, self.cluster_id, len(self.layout.layers), self.layout.desc.num_tensors, self.num_blocks,
                 self.layout.block_bytes)
        return self.layout

    @property
    def listen_address(self) -> tuple[str, int] | None:
        return self.dd.listen_address

    def shutdown(self) -> None:
        try:
            self._run(self.dd.finalize())
        finally:
            self._thread.stop()

    # ------------------------------------------------------------------ helpers on the loop
    async def _link(self, cluster_id: int, host: str, port: int) -> None:
        """Link to a peer rank, sharing one dial among concurrent requests; dial again once the link
        failed or broke (a prefill that restarted), so that a dead link is never reused."""
        task = self._links.get(cluster_id)
        if task is None or (task.done() and not self._linked(cluster_id)):
            task = self._links[cluster_id] = asyncio.ensure_future(self._dial(cluster_id, host, port))
        await asyncio.shield(task)  # one caller cancelled does not cancel the others' dial

    def _linked(self, cluster_id: int) -> bool:
        try:
            return self.dd.link_info(cluster_id).state == "linked"
        except LLMException:
            return False

    async def _dial(self, cluster_id: int, host: str, port: int) -> None:
        if self._linked(cluster_id):  # the peer may have dialed us first
            return
        codes = await self.dd.link_llm_clusters([ClusterInfo(cluster_id, [IpInfo(host, port)])],
                                                self.s.load_timeout_ms)
        if codes[0] != 0:  # the typed error that says what happened, else the bare status
            raise codes.errors.get(cluster_id) or LLMLinkFailed(
                f"linking to cluster {cluster_id} at {host}:{port}: {LLMStatusCode(codes[0]).name}")

    def _ext(self, layer: int | None) -> KvCacheExtParam | None:
        if layer is None:
            return None
        assert self.layout is not None
        return KvCacheExtParam((layer, layer), (layer, layer), self.layout.per_layer)

    # ------------------------------------------------------------------ decode side
    def start_load(self, meta: StepMeta) -> None:
        self._layer_futs = {}
        for r in meta.recv:
            if r.mode == "push":
                self._thread.submit(self._await_pushes(r))
            elif self.s.load == "layer" and r.local_blocks:
                assert self.layout is not None
                futs = [self._thread.submit(self._pull(r, layer)) for layer in range(len(self.layout.layers))]
                for layer, f in enumerate(futs):
                    self._layer_futs.setdefault(layer, []).append((f, r))
                self._thread.submit(self._finish_layers(r, futs))
            else:
                self._thread.submit(self._pull_all(r))
        if meta.send or meta.push:
            self._start_prefill_side(meta)

    async def _pull(self, r: Recv, layer: int | None) -> bool:
        """Pull ``r``'s blocks (one layer, or all); True on success. Failures are logged, never raised."""
        cid = r.cluster_id + self.rank
        try:
            await self._link(cid, r.host, r.port + self.rank)
            remote = await self.dd.resolve_cache_key(cid, CACHE_KEY, timeout_in_millis=self.s.load_timeout_ms)
            await self.dd.pull_kv_blocks(CacheIndex(cid, remote), self._cache, r.remote_blocks, r.local_blocks,
                                         self._ext(layer), timeout_in_millis=self.s.load_timeout_ms)
            return True
        except LLMException as exc:
            log.warning("kvflow connector: %s: loading %s from cluster %d failed (%s): vLLM recomputes it",
                        r.req_id, "all layers" if layer is None else f"layer {layer}", cid, exc)
            return False

    async def _pull_all(self, r: Recv) -> None:
        if not r.local_blocks:  # nothing to load (cached here, refused, or aborted): only free the prefill's
            await self._release(r)
            return
        await self._loaded(r, await self._pull(r, None), by_block=False)

    async def _finish_layers(self, r: Recv, futs: list[concurrent.futures.Future[bool]]) -> None:
        oks = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        await self._loaded(r, all(oks), by_block=True)

    async def _loaded(self, r: Recv, ok: bool, by_block: bool) -> None:
        self._done(r, ok, by_block)
        await self._release(r)

    async def _release(self, r: Recv) -> None:
        """Tell the prefill rank that it may free ``r``'s blocks (whether or not they arrived)."""
        await self._notify(r.cluster_id + self.rank, pack("release", req=r.remote_req_id), r)

    async def _notify(self, cid: int, payload: bytes, r: Recv | None = None) -> None:
        try:
            if r is not None:
                await self._link(cid, r.host, r.port + self.rank)
            await self.dd.send_notification(cid, payload, timeout_in_millis=self.s.load_timeout_ms)
        except LLMException as exc:  # that peer frees by its own timeout instead
            log.warning("kvflow connector: could not notify cluster %d: %s", cid, exc)

    def wait_layer(self, layer_name: str) -> None:
        """``layer`` load mode: wait for this layer's pulls of the step (their failures are load errors)."""
        if not self._layer_futs or self.layout is None:
            return
        for f, r in self._layer_futs.get(self.layout.layers.index(layer_name), []):
            if not f.result():  # reported in this very pass, as vLLM asks of loads inside a step
                with self._lock:
                    self._load_errors.update(r.local_blocks)

    async def _await_pushes(self, r: Recv) -> None:
        """Push mode, decode side: tell the prefill rank where the blocks go, then wait for its 'pushed'."""
        cid = r.cluster_id + self.rank
        fut = asyncio.get_running_loop().create_future()
        self._awaiting_push[r.req_id] = fut
        ok = False
        try:
            await self._link(cid, r.host, r.port + self.rank)
            await self.dd.send_notification(cid, pack("want", req=r.remote_req_id, d_req=r.req_id,
                                                      cluster=self.cluster_id, first=r.first_block,
                                                      blocks=r.local_blocks),
                                            timeout_in_millis=self.s.load_timeout_ms)
            deadline = time.monotonic() + self.s.load_timeout_ms / 1000
            while not fut.done() and time.monotonic() < deadline:
                await asyncio.wait({fut}, timeout=0.05)
                if not fut.done() and self.dd.link_info(cid).state != "linked":
                    log.warning("kvflow connector: %s: the link to cluster %d broke before its pushes arrived",
                                r.req_id, cid)
                    break
            ok = fut.done() and fut.result()
        except LLMException as exc:
            log.warning("kvflow connector: %s: waiting for pushes from cluster %d failed: %s", r.req_id, cid, exc)
        finally:
            self._awaiting_push.pop(r.req_id, None)
        self._done(r, ok, by_block=False)

    def _done(self, r: Recv, ok: bool, by_block: bool) -> None:
        """A request's load ended: finished receiving either way; a failure makes vLLM recompute it
        (a whole request that waited between steps, or the blocks of a step that loaded layer by layer)."""
        with self._lock:
            if by_block:  # loaded inside a step: vLLM waits for no "finished receiving"
                if not ok:
                    self._load_errors.update(r.local_blocks)
                return
            if not ok:
                self._failed.add(r.req_id)
            self._recved.add(r.req_id)

    # ------------------------------------------------------------------ prefill side
    def _start_prefill_side(self, meta: StepMeta) -> None:
        now = time.monotonic()
        with self._lock:
            for req in meta.send:
                if req in self._released_early:
                    self._released_early.discard(req)
                    self._sent.add(req)
                else:
                    self._holding[req] = now + self.s.release_timeout_s
        if not meta.push:
            return
        assert self.layout is not None
        self._step_events = LayerEvents(len(self.layout.layers))
        for p in meta.push:
            self._push_step(p, self._step_events)

    def _push_step(self, p: Push, events: LayerEvents) -> None:
        st = self._pushes.setdefault(p.req_id, _PushState())
        st.last_seen = st.last_seen or p.last
        self._push_keys[p.key] = p.req_id
        want = self._wants.get(p.key)
        blocks = list(enumerate(p.block_ids, p.first))
        if want is None:
            st.pending.extend(blocks)  # pushed once the decode side says where, after this step's compute
            return
        st.tasks.append(self._thread.submit(self._push(p.req_id, want, blocks, events)))

    async def _push(self, req: str, want: _Want, blocks: list[tuple[int, int]], events: LayerEvents | None) -> bool:
        """Push ``blocks`` (index in request, local block) to ``want``: layer by layer as ``events`` marks
        them ready, or all layers at once (their compute is done) without events."""
        assert self.layout is not None
        pairs = [(b, want.blocks[i - want.first]) for i, b in blocks if 0 <= i - want.first < len(want.blocks)]
        if not pairs:
            return True
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        try:
            remote = await self.dd.resolve_cache_key(want.cluster_id, CACHE_KEY,
                                                     timeout_in_millis=self.s.load_timeout_ms)
            ci = CacheIndex(want.cluster_id, remote)
            if events is None:
                await self.dd.push_kv_blocks(self._cache, ci, src, dst, timeout_in_millis=self.s.load_timeout_ms)
            else:
                await self.dd.transfer_cache_async(self._cache, events, [TransferConfig(ci)], src, dst,
                                                   self.layout.per_layer, timeout_in_millis=self.s.load_timeout_ms)
            return True
        except LLMException as exc:
            log.warning("kvflow connector: %s: pushing to cluster %d failed: %s", req, want.cluster_id, exc)
            return False

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self._step_events is None or self.layout is None:
            return
        layer = self.layout.layers.index(layer_name)
        if kv_layer.is_cuda:  # the layer's kernels may still run: wait for them off this thread
            event = torch.cuda.Event()
            event.record()
            self._thread.loop.call_soon_threadsafe(self._cuda_ready, event, self._step_events, layer)
        else:
            self._step_events.mark_ready(layer)

    def _cuda_ready(self, event: Any, events: LayerEvents, layer: int) -> None:
        def wait() -> None:
            event.synchronize()
            events.mark_ready(layer)

        asyncio.get_running_loop().run_in_executor(None, wait)

    def end_step(self) -> None:
        """After the forward pass: a layer that was never saved is ready too (its compute is over)."""
        events, self._step_events = self._step_events, None
        if events is not None:
            for layer in range(events.num_layers):
                events.mark_ready(layer)

    # ------------------------------------------------------------------ each step's results
    def _take_notifications(self) -> None:
        for cid, payload in self.dd.get_notifications():
            msg = unpack(payload)
            if msg is None:
                log.warning("kvflow connector: ignored a notification from cluster %d that is not ours", cid)
                continue
            op, req = msg["op"], msg["req"]
            if op == "release":
                with self._lock:
                    if self._holding.pop(req, None) is not None:
                        self._sent.add(req)
                    else:
                        self._released_early.add(req)
            elif op == "want" and isinstance(msg.get("blocks"), list) and msg.get("cluster") == cid:
                want = _Want(cid, str(msg.get("d_req")), int(msg.get("first", 0)), [int(b) for b in msg["blocks"]])
                self._wants[req] = want  # keyed by what the decode side names: see Push.key
                owner = self._push_keys.get(req)
                st = self._pushes.get(owner) if owner is not None else None
                if owner is not None and st is not None and st.pending:  # computed before it said where
                    st.tasks.append(self._thread.submit(self._push(owner, want, st.pending, None)))
                    st.pending = []
            elif op == "pushed":
                fut = self._awaiting_push.get(req)
                if fut is not None:
                    self._thread.loop.call_soon_threadsafe(_settle, fut, bool(msg.get("ok")))

    def _finish_pushes(self) -> None:
        keys = {r: k for k, r in self._push_keys.items()}
        for req, st in list(self._pushes.items()):
            key = keys.get(req, req)
            want = self._wants.get(key)
            if want is None or not st.last_seen or st.pending or not all(t.done() for t in st.tasks):
                continue
            ok = all(t.result() for t in st.tasks)
            self._thread.submit(self._notify(want.cluster_id, pack("pushed", req=want.d_req, ok=ok)))
            del self._pushes[req]
            del self._wants[key]
            self._push_keys.pop(key, None)
            with self._lock:
                if self._holding.pop(req, None) is not None:
                    self._sent.add(req)
                else:
                    self._released_early.add(req)

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed to receive) since the last call."""
        self._take_notifications()
        self._finish_pushes()
        now = time.monotonic()
        with self._lock:
            for req, deadline in list(self._holding.items()):
                if now >= deadline:
                    del self._holding[req]
                    self._sent.add(req)
                    self.expired += 1
                    self._pushes.pop(req, None)
                    for key in [k for k, r in self._push_keys.items() if r == req]:
                        self._push_keys.pop(key)
                        self._wants.pop(key, None)
                    log.warning("kvflow connector: %s: the decode side did not take its blocks within %.0f s; freed",
                                req, self.s.release_timeout_s)
            sent, self._sent = self._sent, set()
            recved, self._recved = self._recved, set()
            failed, self._failed = self._failed, set()
        return sent, recved, failed

    def load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors


def _settle(fut: asyncio.Future[bool], ok: bool) -> None:
    if not fut.done():
        fut.set_result(ok)
