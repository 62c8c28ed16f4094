"""LlmDataDist: the public API. It checks arguments and delegates: links to the link table
(``_links``), incoming links to the listener (``_listener``), transfers to the engine (``_engine``)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Mapping, Sequence

from . import _handshake as handshake
from . import _keys as keys
from . import _notes as notes
from ._checks import blocks_precheck_steps, cache_precheck, check_clusters, check_index, check_int
from ._compat import TIMEOUT_ERRORS
from ._compat import timeout as timeout_after
from ._discovery import load_transport
from ._engine import PULL, PUSH, Request, TransferEngine
from ._guard import GUARD
from ._layerwise import CacheTask, LayerSynchronizer, TransferConfig, start_transfer
from ._links import LinkInfo, LinkTable, LocalSide
from ._listener import Listener
from ._memory import LocalCache, Registry
from ._metrics import Metrics, event
from ._options import check_transport_keys, parse_options
from ._plan import Plan, plan_blocks, plan_cache
from ._status import (
    LinkResults,
    LLMException,
    LLMFailed,
    LLMFeatureNotEnabled,
    LLMKvCacheNotExist,
    LLMParamInvalid,
    LLMStatusCode,
    LLMWaitProcessTimeout,
)
from ._types import BlockList, Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, LlmRole
from .transport import RemoteCache, Transport, TransportContext

log = logging.getLogger("kvflow")

__all__ = ["LinkInfo", "LlmDataDist"]


class LlmDataDist:
    """Moves KV cache between this process and linked peers.

    ``cluster_id`` must be unique among linked peers; ``role`` is a label only.
    """

    def __init__(self, cluster_id: int, role: LlmRole = LlmRole.MIX, *,
                 options: Mapping[str, str] | None = None) -> None:
        self.cluster_id = check_int("cluster_id", cluster_id)
        try:
            self.role = LlmRole(role)
        except ValueError:
            raise LLMParamInvalid(f"unknown role {role!r}") from None
        self._init_options = options
        self._registry = Registry()
        self._metrics = Metrics(self.cluster_id, self)
        self._side = LocalSide(self.cluster_id, os.urandom(8).hex())
        self._table = LinkTable(self._side, self._registry, self._metrics)
        self._engine = TransferEngine(self._table, self._registry, self._metrics)
        self._listener: Listener | None = None
        self._initialized = False
        self._finalized = False

    def __repr__(self) -> str:
        state = "ready" if self._initialized else ("finalized" if self._finalized else "new")
        return (f"<LlmDataDist cluster={self.cluster_id} {self.role.name} {state} "
                f"links={len(self._table.links)} caches={len(self._registry)}>")

    # ------------------------------------------------------------------ lifecycle
    async def initialize(self, options: Mapping[str, str] | None = None) -> None:
        """Parse options, start the transports and (with ``llm.ListenIpInfo``) the listener.

        A second call is a no-op, as in LLM-DataDist."""
        if self._initialized:
            return
        if self._finalized:
            raise LLMFailed("this LlmDataDist was finalized; create a new one")
        opts = parse_options(options if options is not None else self._init_options)
        side = self._side
        ctx_opts = dict(opts.transport_options)
        transports: dict[str, Transport] = {}
        for name in opts.transports:
            try:
                cls = load_transport(name)
            except LLMFeatureNotEnabled as exc:
                if opts.transports_pinned and len(opts.transports) == 1:
                    raise
                event("transport_unavailable", cluster=self.cluster_id, transport=name, reason=exc.args[0])
                side.unavailable[name] = str(exc.args[0]).removeprefix(f"{name}: ")
                continue
            check_transport_keys(name, cls.option_keys, ctx_opts)
            transports[name] = cls(TransportContext(self.cluster_id, ctx_opts, self._registry, side.instance,
                                                        opts.worker_priority))
        if not transports:
            raise LLMFeatureNotEnabled(f"none of the transports {', '.join(opts.transports)} can run here")
        side.opts = opts
        side.mac_key = handshake.derive_key(opts.auth_key) if opts.auth_key is not None else None
        side.transports = transports
        self._engine.loop = asyncio.get_running_loop()
        if opts.listen is not None:
            self._listener = Listener(self._table, opts.listen)
        self._initialized = True
        listen = self.listen_address
        event("initialized", cluster=self.cluster_id, role=self.role.name, transports=",".join(transports),
              listen=f"{listen[0]}:{listen[1]}" if listen else "-")

    async def finalize(self) -> None:
        """Close every link (telling each peer, bounded), the listener, the transports; unregister
        every cache."""
        if not self._initialized:
            self._finalized = True
            return
        self._initialized = False
        self._finalized = True
        self._engine.abort_tasks("LlmDataDist finalized")
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._table.close_all()
        for local in list(self._registry):
            self._drop_cache(local)
        for t in self._side.transports.values():
            try:
                await t.close()
            except Exception:
                log.exception("closing transport %s", t.name)
        self._side.transports = {}

    async def __aenter__(self) -> LlmDataDist:
        await self.initialize()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.finalize()

    def _ready(self) -> None:
        if not self._initialized:
            if self._finalized:
                raise LLMFailed("LlmDataDist was finalized; create a new one")
            raise LLMFailed("LlmDataDist is not initialized (call initialize first)")

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """(ip, port) the instance listens on, once initialized with ``llm.ListenIpInfo``."""
        return self._listener.address if self._listener is not None else None

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports this instance offers, in order of preference."""
        return tuple(self._side.transports)

    # ------------------------------------------------------------------ caches
    async def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                                cfg: object | None = None, *, key: int | None = None) -> Cache:
        """Register ``num_tensors`` tensors (int addresses, buffers or ``data_ptr()`` objects);
        ``key`` (an int no other registered cache has) lets peers find it by ``resolve_cache_key``."""
        self._ready()
        if not isinstance(cache_desc, CacheDesc):
            raise LLMParamInvalid(f"cache_desc must be a CacheDesc, got {type(cache_desc).__name__}")
        key = keys.reserve(self._registry, key)
        local = self._registry.add(cache_desc, addrs)
        try:
            for name, t in self._side.transports.items():
                if cache_desc.placement and not t.supports_device_memory:
                    local.descs[name] = [None] * len(local.regions)
                    continue
                descs = t.register(local)
                if len(descs) != len(local.regions):
                    raise LLMFailed(f"transport {name} returned {len(descs)} descriptors")
                local.descs[name] = list(descs)
        except BaseException:
            self._drop_cache(local)
            raise
        keys.bind(self._registry, local.cache_id, key)
        return local.cache

    async def resolve_cache_key(self, cluster_id: int, key: int, *, timeout_in_millis: int | None = None) -> int:
        """The id of the cache that cluster ``cluster_id`` registered with ``key`` (asked over the link,
        reused while that cache stays registered there): LLMKvCacheNotExist if none, LLMNotYetLink."""
        self._ready()
        return await keys.resolve(self._table.get(cluster_id), keys.check_key(key),
                                  self._engine.deadline(timeout_in_millis))

    # ------------------------------------------------------------------ notifications
    async def send_notification(self, cluster_id: int, payload: bytes, *,
                                timeout_in_millis: int | None = None) -> None:
        """Hand ``payload`` (bytes, at most 64 KiB) to linked cluster ``cluster_id``; returns once the
        peer has queued it for its ``get_notifications``. LLMLinkBusy if the peer's queue is full."""
        self._ready()
        data = notes.check_payload(payload)
        link = self._table.get(cluster_id)
        await link.request({"op": "note", "payload": data}, self._engine.deadline(timeout_in_millis))

    def get_notifications(self) -> list[tuple[int, bytes]]:
        """Take the notifications that linked peers sent: (cluster id, payload) pairs, oldest first."""
        return self._table.inbox.take()

    async def unregister_kv_cache(self, cache_id: int, *, timeout_in_millis: int | None = None) -> None:
        """Unregister a cache once no peer can touch its memory any more. Unknown ids succeed.

        Every peer that can reach the memory itself (shm, ucx) must confirm within the timeout that
        it stopped and forgot the cache, or be known dead. Otherwise LLMWaitProcessTimeout names
        it, its link is broken, and the cache stays registered (do not free the memory)."""
        self._ready()
        check_int("cache_id", cache_id, 1)
        timeout = self._engine.deadline(timeout_in_millis)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        local = self._registry.get_any(cache_id)
        while local is not None and local.closing:
            under_way = local.unregistering
            if under_way is None:
                return  # closing and unregistering are set in one step: no call left to wait for
            # Another call is unregistering it: its success is ours; if it fails the cache stays
            # registered, and this call tries again (returning at once told a caller to free memory
            # that the first call was still waiting to stop using).
            await asyncio.wait([under_way], timeout=max(0.0, deadline - loop.time()))
            if not under_way.done():
                raise LLMWaitProcessTimeout(f"cache {cache_id} is still being unregistered by another call; "
                                            "it stays registered until that call ends: do not free the memory")
            local = self._registry.get_any(cache_id)
        if local is None:
            return
        with GUARD:  # a copy on a caller's thread that uses it has ended; none starts from now on
            local.closing = True  # new peer requests now get LLM_KV_CACHE_NOT_EXIST
        under_way = local.unregistering = loop.create_future()
        try:
            holders = await self._table.revoke_peers(cache_id, timeout)
            if local.inflight:
                await self._wait_local(local, max(0.0, deadline - loop.time()))
            if holders:
                for link, why in holders.items():
                    if link.healthy:
                        link.mark_broken(LLMWaitProcessTimeout(
                            f"cluster {link.remote_cluster_id} did not release cache {cache_id}: {why}"))
                names = "; ".join(f"cluster {link.remote_cluster_id} over {link.transport} ({why})"
                                  for link, why in holders.items())
                raise LLMWaitProcessTimeout(
                    f"cache {cache_id} is still reachable by {names}; its link was broken and the cache stays "
                    "registered: do not free the memory (unregister again once that peer has exited)")
        except BaseException:
            with GUARD:
                local.closing = False  # not unregistered: the cache stays usable
            local.idle = None
            raise
        else:
            self._table.forget_cache(cache_id)
            self._drop_cache(local)
        finally:
            local.unregistering = None
            under_way.set_result(None)

    async def _wait_local(self, local: LocalCache, budget: float) -> None:
        """Wait for the operations that run in this process on the cache; then stop them (typed errors on
        both sides) rather than free memory under a transfer. Our own transfers end at their deadline."""
        local.idle = asyncio.Event()
        try:
            async with timeout_after(budget):
                await local.idle.wait()
            return
        except TIMEOUT_ERRORS:
            pass
        users = [u for u in local.pins if u is not None]
        log.warning("unregister of cache %d: %d transfer(s) still running; failing them", local.cache_id,
                    local.inflight)
        gone = LLMKvCacheNotExist(f"cache {local.cache_id} was unregistered during the transfer")
        for user in users:
            user.revoke(local, gone)
        if local.inflight:
            raise LLMWaitProcessTimeout(
                f"cache {local.cache_id} is still in use by {local.inflight} local transfer(s)") from None

    def _drop_cache(self, local: LocalCache) -> None:
        for t in self._side.transports.values():
            try:
                t.unregister(local)
            except Exception:
                log.exception("transport %s failed to unregister cache %d", t.name, local.cache_id)
        self._registry.pop(local.cache_id)

    def _local(self, cache: Cache, what: str) -> LocalCache:
        if not isinstance(cache, Cache):
            raise LLMParamInvalid(f"{what} must be a Cache returned by register_kv_cache")
        return self._registry.get(cache.cache_id)

    # ------------------------------------------------------------------ links
    async def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000
                                ) -> LinkResults:
        """Link to each cluster's listen address; one status per cluster (never raises on link
        failure), and in ``.errors``, by cluster id, the exception that says why one did not link."""
        self._ready()
        clusters = check_clusters(clusters)
        timeout = check_int("timeout_in_millis", timeout_in_millis, 1, 3_600_000) / 1000
        errors: dict[int, LLMException] = {}
        codes = await asyncio.gather(*(self._table.link_one(c, timeout, errors) for c in clusters))
        return LinkResults(codes, {c.remote_cluster_id: errors[c.remote_cluster_id]
                                   for c in clusters if c.remote_cluster_id in errors})

    async def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000,
                                  force: bool = False) -> list[LLMStatusCode]:
        """Tear links down; non-force tells the peer, force closes only this side."""
        self._ready()
        clusters = check_clusters(clusters)
        timeout = check_int("timeout_in_millis", timeout_in_millis, 1, 3_600_000) / 1000
        return list(await asyncio.gather(*(self._table.unlink_one(c.remote_cluster_id, timeout, force)
                                           for c in clusters)))

    def stats(self) -> dict[str, Any]:
        """A snapshot of this instance's counters, as plain data (see docs/observability.md).

        ``total``/``ops``/``links[peer]["series"][transport][op]`` hold ``transfers``, ``bytes``,
        ``runs`` (successful transfers), ``errors`` (failed transfers by status name) and the
        ``latency`` histogram of successful transfers; ``link_events`` counts links up and down."""
        states = {cid: (link.transport, link.state.value) for cid, link in self._table.links.items()}
        return self._metrics.snapshot(states)

    def link_info(self, cluster_id: int) -> LinkInfo:
        """State and transport of the link to ``cluster_id`` (LLMNotYetLink if there is none)."""
        link = self._table.links.get(cluster_id)
        if link is None:
            from ._status import LLMNotYetLink

            raise LLMNotYetLink(f"no link to cluster {cluster_id}")
        return self._table.info(link)

    def links(self) -> dict[int, LinkInfo]:
        """Every link this instance holds, by peer cluster id (a snapshot; read-only)."""
        return {cid: self._table.info(link) for cid, link in self._table.links.items()}

    def local_caches(self) -> dict[int, Cache]:
        """Every cache registered here and not being unregistered, by cache id (a snapshot)."""
        return {local.cache_id: local.cache for local in self._registry if not local.closing}

    # ------------------------------------------------------------------ transfers
    async def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                            timeout_in_millis: int | None = None) -> None:
        """Copy a peer's batch slot ``src_cache_index.batch_index`` into local slot ``batch_index``."""
        await self._engine.run(self._pull_cache(src_cache_index, dst_cache, batch_index, size, ext_param),
                               timeout_in_millis)

    async def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: BlockList,
                             dst_blocks: BlockList, ext_param: KvCacheExtParam | None = None, *,
                             timeout_in_millis: int | None = None) -> None:
        """Copy the peer's ``src_blocks`` into local ``dst_blocks`` (pairwise)."""
        if ext_param is None and self._initialized:
            if self._engine.turns.owed():  # transfers finished inside their calls back to back (LoopTurns)
                await asyncio.sleep(0)
            now = self._engine.blocks_now(PULL, src_cache_index, dst_cache, src_blocks, dst_blocks, timeout_in_millis,
                                          False)
            if now is not False:
                if now is not True:  # begun, not finished at once
                    await now
                return
        await self._engine.run(self._pull_blocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param),
                               timeout_in_millis)

    async def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                            timeout_in_millis: int | None = None) -> None:
        """Copy local slot ``src_batch_index`` into the peer's slot ``dst_cache_index.batch_index``."""
        await self._engine.run(self._push_cache(src_cache, dst_cache_index, src_batch_index, size, ext_param),
                               timeout_in_millis)

    async def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: BlockList,
                             dst_blocks: BlockList, ext_param: KvCacheExtParam | None = None, *,
                             timeout_in_millis: int | None = None) -> None:
        """Copy local ``src_blocks`` into the peer's ``dst_blocks`` (pairwise)."""
        if ext_param is None and self._initialized:
            if self._engine.turns.owed():  # transfers finished inside their calls back to back (LoopTurns)
                await asyncio.sleep(0)
            now = self._engine.blocks_now(PUSH, dst_cache_index, src_cache, src_blocks, dst_blocks, timeout_in_millis,
                                          False)
            if now is not False:
                if now is not True:  # begun, not finished at once
                    await now
                return
        await self._engine.run(self._push_blocks(src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param),
                               timeout_in_millis)

    # The four requests, checked as far as local state allows (shared with kvflow.sync's fast path).
    def _pull_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int, size: int,
                    ext_param: KvCacheExtParam | None) -> Request:
        self._ready()
        local = self._local(dst_cache, "dst_cache")
        ci = check_index(src_cache_index, blocks=False)

        def plan(remote: RemoteCache) -> Plan:
            return plan_cache(remote.desc, remote.addrs, ci.batch_index, local.desc, local.addrs,
                              batch_index, size, ext_param, False)

        return (PULL, ci, local, plan,
                lambda: cache_precheck(local.desc, batch_index, size, ext_param, False))

    def _pull_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: BlockList,
                     dst_blocks: BlockList, ext_param: KvCacheExtParam | None) -> Request:
        self._ready()
        local = self._local(dst_cache, "dst_cache")
        ci = check_index(src_cache_index, blocks=True)

        def plan(remote: RemoteCache) -> Plan:
            return plan_blocks(remote.desc, remote.addrs, local.desc, local.addrs, src_blocks, dst_blocks,
                               ext_param, False)

        return (PULL, ci, local, plan,
                lambda: blocks_precheck_steps(local.desc, dst_blocks, src_blocks, ext_param, False))

    def _push_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int, size: int,
                    ext_param: KvCacheExtParam | None) -> Request:
        self._ready()
        local = self._local(src_cache, "src_cache")
        ci = check_index(dst_cache_index, blocks=False)

        def plan(remote: RemoteCache) -> Plan:
            return plan_cache(local.desc, local.addrs, src_batch_index, remote.desc, remote.addrs,
                              ci.batch_index, size, ext_param)

        return (PUSH, ci, local, plan,
                lambda: cache_precheck(local.desc, src_batch_index, size, ext_param, True))

    def _push_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: BlockList,
                     dst_blocks: BlockList, ext_param: KvCacheExtParam | None) -> Request:
        self._ready()
        local = self._local(src_cache, "src_cache")
        ci = check_index(dst_cache_index, blocks=True)

        def plan(remote: RemoteCache) -> Plan:
            return plan_blocks(local.desc, local.addrs, remote.desc, remote.addrs, src_blocks, dst_blocks,
                               ext_param)

        return (PUSH, ci, local, plan,
                lambda: blocks_precheck_steps(local.desc, src_blocks, dst_blocks, ext_param, True))

    # ------------------------------------------------------------------ layer-wise push
    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig], src_block_indices: BlockList | None = None,
                             dst_block_indices: BlockList | None = None, tensor_num_per_layer: int = 2, *,
                             timeout_in_millis: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer to every config's destination, each layer as soon as
        ``layer_synchronizer`` says it is ready; returns a :class:`CacheTask` at once (``await`` it).

        With block indices: block push; without: whole-slot push (``src_batch_index`` to
        ``dst_cache_index.batch_index``). Checks that need only local state raise ``LLMParamInvalid``
        here, except for block lists of more than 2048 entries: the task checks those in slices
        first, and a bad one fails it. Deadline: ``timeout_in_millis`` for the whole task, else
        ``llm.SyncKvCacheWaitTime`` per layer. See docs/layerwise.md."""
        self._ready()
        local = self._local(src_cache, "src_cache")
        return start_transfer(self._engine, local, layer_synchronizer, transfer_configs, src_block_indices,
                              dst_block_indices, tensor_num_per_layer, timeout_in_millis)
