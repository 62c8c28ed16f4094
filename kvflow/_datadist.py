"""LlmDataDist: the public API (argument checks, links, transfers)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import _handshake as handshake
from . import _keys as keys
from . import _wire as wire
from ._compat import TIMEOUT_ERRORS
from ._compat import timeout as timeout_after
from ._deadline import Deadline
from ._layerwise import CacheTask, LayerSynchronizer, TransferConfig, abort_tasks, start_transfer
from ._link import Link, LinkState, describe_local, open_socket
from ._memory import LocalCache, Registry
from ._metrics import Metrics, end_span, event, link_span
from ._metrics import now as metrics_now
from ._options import Options, parse_options
from ._plan import Plan, block_list, plan_blocks, plan_cache, side_tensors
from ._status import (
    LLMClusterNumExceedLimit,
    LLMException,
    LLMFailed,
    LLMFeatureNotEnabled,
    LLMKvCacheNotExist,
    LLMNotYetLink,
    LLMParamInvalid,
    LLMStatusCode,
    LLMTimeoutError,
    LLMWaitProcessTimeout,
)
from ._types import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, LlmRole
from .transport import RemoteCache, RunBatch, Transport, TransportContext, load_transport

log = logging.getLogger("kvflow")

MAX_CLUSTERS_PER_CALL = 16
_FINALIZE_BYE_S = 0.5  # how long finalize waits for each peer to confirm it dropped the link
MAX_HANDSHAKES = 512  # incoming connections in their handshake at once; more are refused
_PULL, _PUSH = "pull", "push"


@dataclass(frozen=True)
class LinkInfo:
    """What kvflow knows about one link (``LlmDataDist.link_info``)."""

    remote_cluster_id: int
    transport: str
    state: str
    initiator: bool
    fallbacks: dict[str, str] = field(default_factory=dict)  # transport -> why it was not used


def _check_int(name: str, value: Any, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise LLMParamInvalid(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return int(value)


class LlmDataDist:
    """Moves KV cache between this process and linked peers.

    ``cluster_id`` must be unique among linked peers; ``role`` is a label only.
    """

    def __init__(self, cluster_id: int, role: LlmRole = LlmRole.MIX, *,
                 options: Mapping[str, str] | None = None) -> None:
        self.cluster_id = _check_int("cluster_id", cluster_id)
        try:
            self.role = LlmRole(role)
        except ValueError:
            raise LLMParamInvalid(f"unknown role {role!r}") from None
        self._init_options = options
        self._opts = Options()
        self._registry = Registry()
        self._links: dict[int, Link] = {}
        self._linking: set[int] = set()
        self._transports: dict[str, Transport] = {}
        self._unavailable: dict[str, str] = {}  # transport -> why it cannot run here
        # cache id -> links over which a peer learned its addresses and can touch it itself (one-sided)
        self._granted: dict[int, set[Link]] = {}
        self._retired: list[Link] = []  # replaced or purged links whose endpoints may still unwind
        self._mac_key: bytes | None = None
        self._order: tuple[str, ...] = ()
        self._server: socket.socket | None = None
        self._accepting: set[asyncio.Task[Any]] = set()
        self._data_waiters: dict[bytes, asyncio.Future[socket.socket]] = {}
        self._instance = os.urandom(8).hex()
        self._initialized = False
        self._finalized = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metrics = Metrics(self.cluster_id, self)

    def __repr__(self) -> str:
        state = "ready" if self._initialized else ("finalized" if self._finalized else "new")
        return (f"<LlmDataDist cluster={self.cluster_id} {self.role.name} {state} "
                f"links={len(self._links)} caches={len(self._registry)}>")

    # ------------------------------------------------------------------ lifecycle
    async def initialize(self, options: Mapping[str, str] | None = None) -> None:
        """Parse options, start the transports and (with ``llm.ListenIpInfo``) the listener.

        A second call is a no-op, as in LLM-DataDist."""
        if self._initialized:
            return
        if self._finalized:
            raise LLMFailed("this LlmDataDist was finalized; create a new one")
        opts = parse_options(options if options is not None else self._init_options)
        self._loop = asyncio.get_running_loop()
        ctx_opts = {k: v for k, v in opts.transport_options.items()}
        transports: dict[str, Transport] = {}
        for name in opts.transports:
            try:
                cls = load_transport(name)
            except LLMFeatureNotEnabled as exc:
                if opts.transports_pinned and len(opts.transports) == 1:
                    raise
                event("transport_unavailable", cluster=self.cluster_id, transport=name, reason=exc.args[0])
                self._unavailable[name] = str(exc.args[0]).removeprefix(f"{name}: ")
                continue
            transports[name] = cls(TransportContext(self.cluster_id, ctx_opts, self._registry, self._instance))
        if not transports:
            raise LLMFeatureNotEnabled(f"none of the transports {', '.join(opts.transports)} can run here")
        self._opts = opts
        self._mac_key = handshake.derive_key(opts.auth_key) if opts.auth_key is not None else None
        self._transports = transports
        self._order = tuple(transports)
        if opts.listen is not None:
            self._server = self._listen(opts.listen)
        self._initialized = True
        listen = self.listen_address
        event("initialized", cluster=self.cluster_id, role=self.role.name, transports=",".join(self._order),
              listen=f"{listen[0]}:{listen[1]}" if listen else "-")

    async def finalize(self) -> None:
        """Close every link (locally), the listener, the transports; unregister every cache."""
        if not self._initialized:
            self._finalized = True
            return
        self._initialized = False
        self._finalized = True
        abort_tasks(self, "LlmDataDist finalized")
        if self._server is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._server.fileno())
            self._server.close()
            self._server = None
        for task in list(self._accepting):
            task.cancel()
        for fut in self._data_waiters.values():
            fut.cancel()
        # tell each peer (bounded), so that it drops its side quietly rather than see a dead link
        await asyncio.gather(*(self._unlink_one(cid, _FINALIZE_BYE_S, force=False) for cid in list(self._links)))
        self._links.clear()
        for local in list(self._registry):
            self._drop_cache(local)
        for t in self._transports.values():
            try:
                await t.close()
            except Exception:
                log.exception("closing transport %s", t.name)
        self._transports.clear()

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
        if self._server is None:
            return None
        host, port = self._server.getsockname()[:2]
        return host, port

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports this instance offers, in order of preference."""
        return self._order

    def _deadline(self, timeout_in_millis: int | None) -> float:
        if timeout_in_millis is None:
            return self._opts.sync_wait_ms / 1000
        return _check_int("timeout_in_millis", timeout_in_millis, 1, 24 * 3600 * 1000) / 1000

    # ------------------------------------------------------------------ caches
    async def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                                cfg: Any = None, *, key: int | None = None) -> Cache:
        """Register ``num_tensors`` tensors (int addresses, buffers or ``data_ptr()`` objects);
        ``key`` (an int no other registered cache has) lets peers find it by ``resolve_cache_key``."""
        self._ready()
        if not isinstance(cache_desc, CacheDesc):
            raise LLMParamInvalid(f"cache_desc must be a CacheDesc, got {type(cache_desc).__name__}")
        key = keys.reserve(self._registry, key)
        local = self._registry.add(cache_desc, addrs)
        try:
            for name, t in self._transports.items():
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
        return await keys.resolve(self._link(cluster_id), keys.check_key(key), self._deadline(timeout_in_millis))

    async def unregister_kv_cache(self, cache_id: int, *, timeout_in_millis: int | None = None) -> None:
        """Unregister a cache once no peer can touch its memory any more. Unknown ids succeed.

        Every peer that can reach the memory itself (shm, ucx) must confirm within the timeout that
        it stopped and forgot the cache, or be known dead. Otherwise LLMWaitProcessTimeout names
        it, its link is broken, and the cache stays registered (do not free the memory)."""
        self._ready()
        _check_int("cache_id", cache_id, 1)
        local = self._registry._caches.get(cache_id)
        if local is None or local.closing:
            return
        local.closing = True  # new peer requests now get LLM_KV_CACHE_NOT_EXIST
        timeout = self._deadline(timeout_in_millis)
        assert self._loop is not None
        deadline = self._loop.time() + timeout
        try:
            holders = await self._revoke_peers(cache_id, timeout)
            if local.inflight:
                await self._wait_local(local, max(0.0, deadline - self._loop.time()))
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
            local.closing = False  # not unregistered: the cache stays usable
            local.idle = None
            raise
        self._granted.pop(cache_id, None)
        self._drop_cache(local)

    async def _revoke_peers(self, cache_id: int, timeout: float) -> dict[Link, str]:
        """Tell every linked peer that the cache is gone; the peers that can still reach it, with why."""
        granted = self._granted.get(cache_id, set())
        healthy = [link for link in self._links.values() if link.healthy]
        results = await asyncio.gather(
            *(link.request({"op": "gone", "cache_id": cache_id, "ms": int(timeout * 1000)}, timeout)
              for link in healthy), return_exceptions=True)
        holders: dict[Link, str] = {}
        for link, r in zip(healthy, results):
            if isinstance(r, BaseException) and not isinstance(r, LLMException):
                raise r
            if isinstance(r, LLMException):
                if link in granted:
                    holders[link] = f"no confirmation: {r.args[0]}"
                continue
            # confirmed: that peer's live and retired links no longer touch the cache
            for g in list(granted):
                if g.remote_cluster_id == link.remote_cluster_id and g.peer_instance == link.peer_instance:
                    granted.discard(g)
        for link in list(granted):
            if link in holders:
                continue
            if link.endpoint is not None and link.endpoint.peer_exited():
                granted.discard(link)
            else:
                holders[link] = f"link {link.state.value}, peer process not known to have exited"
        return holders

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
        owners = [o for o in local.pins if o is not None]
        log.warning("unregister of cache %d: %d transfer(s) still running; failing them", local.cache_id,
                    local.inflight)
        gone = LLMKvCacheNotExist(f"cache {local.cache_id} was unregistered during the transfer")
        for owner in owners:
            owner.revoke(local, gone)
        if local.inflight:
            raise LLMWaitProcessTimeout(
                f"cache {local.cache_id} is still in use by {local.inflight} local transfer(s)") from None

    def _drop_cache(self, local: LocalCache) -> None:
        for t in self._transports.values():
            try:
                t.unregister(local)
            except Exception:
                log.exception("transport %s failed to unregister cache %d", t.name, local.cache_id)
        self._registry.pop(local.cache_id)

    def _local(self, cache: Cache, what: str) -> LocalCache:
        if not isinstance(cache, Cache):
            raise LLMParamInvalid(f"{what} must be a Cache returned by register_kv_cache")
        local = self._registry.get(cache.cache_id)
        return local

    # ------------------------------------------------------------------ links
    async def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000
                                ) -> list[LLMStatusCode]:
        """Link to each cluster's listen address; one status per cluster (never raises on link failure)."""
        self._ready()
        clusters = self._check_clusters(clusters)
        timeout = _check_int("timeout_in_millis", timeout_in_millis, 1, 3_600_000) / 1000
        results = await asyncio.gather(*(self._link_one(c, timeout) for c in clusters))
        return list(results)

    def _check_clusters(self, clusters: Sequence[ClusterInfo]) -> list[ClusterInfo]:
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, Sequence):
            raise LLMParamInvalid("clusters must be a list of ClusterInfo")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            raise LLMClusterNumExceedLimit(
                f"{len(clusters)} clusters in one call; at most {MAX_CLUSTERS_PER_CALL}")
        seen: set[int] = set()
        for c in clusters:
            if not isinstance(c, ClusterInfo):
                raise LLMParamInvalid(f"expected ClusterInfo, got {type(c).__name__}")
            _check_int("remote_cluster_id", c.remote_cluster_id)
            if c.remote_cluster_id in seen:
                raise LLMParamInvalid(f"cluster {c.remote_cluster_id} appears twice in one call")
            seen.add(c.remote_cluster_id)
        return list(clusters)

    async def _link_one(self, info: ClusterInfo, timeout: float) -> LLMStatusCode:
        cid = info.remote_cluster_id
        if len(info.remote_ip_infos) != 1:
            log.warning("link to cluster %d: exactly one remote_ip_infos entry is needed", cid)
            return LLMStatusCode.LLM_PARAM_INVALID
        ip = info.remote_ip_infos[0]
        try:
            address = wire_address(ip.ip, ip.port)
        except LLMParamInvalid as exc:
            log.warning("link to cluster %d: %s", cid, exc)
            return LLMStatusCode.LLM_PARAM_INVALID
        existing = self._links.get(cid)
        if existing is not None and existing.healthy:
            return LLMStatusCode.LLM_ALREADY_LINK
        if cid in self._linking:
            return LLMStatusCode.LLM_PROCESSING_LINK
        if cid == self.cluster_id:
            log.warning("refusing to link cluster %d to itself", cid)
            return LLMStatusCode.LLM_PARAM_INVALID
        self._linking.add(cid)
        span = link_span(self.cluster_id, cid, address)
        code, why = LLMStatusCode.LLM_LINK_FAILED, ""
        try:
            async with timeout_after(timeout):
                link = await self._dial(cid, address, info.local_ip_infos[0].ip if info.local_ip_infos else None,
                                        timeout)
        except TIMEOUT_ERRORS:
            why = f"timed out after {timeout:.3f} s"
        except LLMException as exc:
            code, why = exc.status_code, str(exc)
        except (OSError, asyncio.IncompleteReadError) as exc:
            why = str(exc) or type(exc).__name__
        except BaseException:
            end_span(span, "CANCELLED")
            raise
        finally:
            self._linking.discard(cid)
        if why:
            self._metrics.link_failed(cid, address, code.name, why)
            end_span(span, code.name)
            return code
        self._install(link)
        end_span(span, None, transport=link.transport)
        return LLMStatusCode.LLM_SUCCESS

    async def _dial(self, cid: int, address: tuple[str, int], local_ip: str | None, timeout: float) -> Link:
        sock = await open_socket(address, local_ip)
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            agreed = await handshake.dial(handshake.Session(reader, writer, self._mac_key),
                                          cluster_id=self.cluster_id, expect=cid, instance=self._instance,
                                          transports=self._transports, unavailable=self._unavailable,
                                          address=address)
        except BaseException:
            writer.close()
            raise
        event("transport_chosen", cluster=self.cluster_id, peer=cid, transport=agreed.transport, initiator=True,
              skipped=";".join(f"{k}:{v}" for k, v in agreed.fallbacks.items()) or "-")
        link = self._new_link(agreed, True, reader, writer)
        self._start_link(link, agreed)
        return link

    def _new_link(self, agreed: handshake.Agreed, initiator: bool, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> Link:
        link = Link(remote_cluster_id=agreed.peer_cluster, peer_instance=agreed.peer_instance, initiator=initiator,
                    transport=agreed.transport, reader=reader, writer=writer, handler=self._handle,
                    heartbeat_interval=self._opts.heartbeat_interval_ms / 1000,
                    heartbeat_timeout=self._opts.heartbeat_timeout_ms / 1000, fallbacks=agreed.fallbacks)
        agreed.channel.link = link
        return link

    def _start_link(self, link: Link, agreed: handshake.Agreed) -> None:
        link.start(agreed.endpoint)
        if agreed.channel.early_failure is not None:
            link.mark_broken(agreed.channel.early_failure)

    def _install(self, link: Link) -> None:
        old = self._links.get(link.remote_cluster_id)
        if old is not None and old is not link:
            self._retire(old, "replaced by a new link")
        self._links[link.remote_cluster_id] = link
        link.on_closed = self._metrics.link_down
        self._metrics.link_up(link)

    def _purge_broken(self) -> None:
        """Forget broken links (to make room under kvflow.MaxLinks)."""
        for cid, link in list(self._links.items()):
            if link.state is LinkState.BROKEN:
                del self._links[cid]
                self._retire(link, "purged")

    def _retire(self, link: Link, reason: str) -> None:
        """Close a link that is no longer in the table; keep it while its operations may still unwind."""
        link.close(reason)
        task = asyncio.ensure_future(link.wait_closed())
        self._accepting.add(task)
        task.add_done_callback(self._accepting.discard)
        self._retired = [r for r in self._retired if r.busy] + [link]

    async def _quiesce_retired(self, cid: int, budget: float) -> None:
        """Wait until no retired link to ``cid`` can touch that peer's memory (LLMWaitProcessTimeout if
        one still can): a peer's ``gone`` covers every link it ever had to us, not only the live one."""
        for old in [r for r in self._retired if r.remote_cluster_id == cid]:
            await old.quiesce(budget)
        self._retired = [r for r in self._retired if r.busy]

    def _ungrant(self, link: Link) -> None:
        """``link``'s peer confirmed it can no longer touch any of our caches."""
        for links in self._granted.values():
            links.discard(link)

    async def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_in_millis: int = 1000,
                                  force: bool = False) -> list[LLMStatusCode]:
        """Tear links down; non-force tells the peer, force closes only this side."""
        self._ready()
        clusters = self._check_clusters(clusters)
        timeout = _check_int("timeout_in_millis", timeout_in_millis, 1, 3_600_000) / 1000
        return list(await asyncio.gather(*(self._unlink_one(c.remote_cluster_id, timeout, force)
                                           for c in clusters)))

    async def _unlink_one(self, cid: int, timeout: float, force: bool) -> LLMStatusCode:
        link = self._links.get(cid)
        if link is None:
            return LLMStatusCode.LLM_NOT_YET_LINK
        status = LLMStatusCode.LLM_SUCCESS
        link.closing = True
        if not force and link.healthy:
            try:
                await link.quiesce(timeout)  # "bye" tells the peer that we no longer touch its memory
                await link.request({"op": "bye"}, timeout)
                self._ungrant(link)
            except LLMException as exc:
                log.warning("unlink of cluster %d: peer did not confirm: %s", cid, exc)
                status = LLMStatusCode.LLM_UNLINK_FAILED
        if self._links.get(cid) is link:
            del self._links[cid]
        link.close("unlinked")
        await link.wait_closed()
        return status

    def stats(self) -> dict[str, Any]:
        """A snapshot of this instance's counters, as plain data (see docs/observability.md).

        ``total``/``ops``/``links[peer]["series"][transport][op]`` hold ``transfers``, ``bytes``,
        ``runs`` (successful transfers), ``errors`` (failed transfers by status name) and the
        ``latency`` histogram of successful transfers; ``link_events`` counts links up and down."""
        states = {cid: (link.transport, link.state.value) for cid, link in self._links.items()}
        return self._metrics.snapshot(states)

    def link_info(self, cluster_id: int) -> LinkInfo:
        """State and transport of the link to ``cluster_id`` (LLMNotYetLink if there is none)."""
        link = self._links.get(cluster_id)
        if link is None:
            raise LLMNotYetLink(f"no link to cluster {cluster_id}")
        return LinkInfo(link.remote_cluster_id, link.transport, link.state.value, link.initiator,
                        dict(link.fallbacks))

    def _link(self, cluster_id: int) -> Link:
        link = self._links.get(cluster_id)
        if link is None:
            raise LLMNotYetLink(f"no link to cluster {cluster_id}")
        link.check()
        return link

    # ------------------------------------------------------------------ serving peers
    def _listen(self, address: tuple[str, int]) -> socket.socket:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        srv = socket.socket(family, socket.SOCK_STREAM)
        try:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(address)
            srv.listen(128)
            srv.setblocking(False)
        except OSError as exc:
            srv.close()
            raise LLMParamInvalid(f"option llm.ListenIpInfo: cannot listen on {address[0]}:{address[1]}: "
                                  f"{exc.strerror}") from None
        assert self._loop is not None
        self._loop.add_reader(srv.fileno(), self._accept, srv)
        return srv

    def _accept(self, srv: socket.socket) -> None:
        for _ in range(16):
            try:
                sock, _addr = srv.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            if len(self._accepting) >= MAX_HANDSHAKES:  # a flood of connections: refuse, do not queue
                log.warning("refusing a connection: %d handshakes in progress", len(self._accepting))
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._serve(sock))
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        handed_off = False
        try:
            async with timeout_after(max(1.0, self._opts.heartbeat_timeout_ms / 1000)):
                magic = await _recv_exactly(loop, sock, wire.MAGIC_SIZE)
                if magic == wire.MAGIC_DATA:
                    token = await _recv_exactly(loop, sock, wire.TOKEN_SIZE)
                    fut = self._data_waiters.pop(token, None)
                    if fut is not None and not fut.done():
                        fut.set_result(sock)
                        handed_off = True
                    return
                if magic != wire.MAGIC_CONTROL:
                    return
            handed_off = True
            await self._serve_control(sock)
        except (*TIMEOUT_ERRORS, OSError, asyncio.IncompleteReadError, LLMException) as exc:
            log.info("incoming connection dropped: %s", exc)
        except Exception:  # whatever a peer sends must not take the listener down
            log.exception("incoming connection dropped")
        finally:
            if not handed_off:
                sock.close()

    async def _serve_control(self, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        session = handshake.Session(reader, writer, self._mac_key)
        token = os.urandom(wire.TOKEN_SIZE)
        waiter: asyncio.Future[socket.socket] = asyncio.get_running_loop().create_future()
        self._data_waiters[token] = waiter
        admitted: list[int] = []
        try:
            async with timeout_after(max(1.0, self._opts.heartbeat_timeout_ms / 1000)):
                agreed = await handshake.accept(session, cluster_id=self.cluster_id, instance=self._instance,
                                                transports=self._transports, token=token, waiter=waiter,
                                                admit=lambda peer, expect: self._admit(peer, expect, admitted))
        except TIMEOUT_ERRORS:
            log.info("incoming link handshake timed out")
            writer.close()
            return None
        except LLMException as exc:  # refused (a bad MAC, a protocol error): say why, then hang up
            log.info("incoming link refused: %s", exc)
            session.reject(exc.status_code, str(exc.args[0]))
            return None
        except BaseException:
            writer.close()
            raise
        finally:
            for peer in admitted:
                self._linking.discard(peer)
            self._data_waiters.pop(token, None)
        if agreed is None:
            writer.close()
            return None
        event("transport_chosen", cluster=self.cluster_id, peer=agreed.peer_cluster, transport=agreed.transport,
              initiator=False, skipped=";".join(f"{k}:{v}" for k, v in agreed.fallbacks.items()) or "-")
        link = self._new_link(agreed, False, reader, writer)
        self._install(link)
        session.send_sealed("ready", {})
        self._start_link(link, agreed)
        return None

    def _admit(self, peer: int, expect: int, admitted: list[int]) -> tuple[LLMStatusCode, str] | None:
        """Why an authenticated peer may not link now, or None (it then counts as linking)."""
        _check_int("cluster", peer)
        if expect != self.cluster_id:
            return LLMStatusCode.LLM_LINK_FAILED, f"this is cluster {self.cluster_id}, not {expect}"
        if peer == self.cluster_id:
            return LLMStatusCode.LLM_LINK_FAILED, "peer has our cluster id"
        # A link from this cluster that we still hold is replaced: the peer dials only when it
        # has no usable link (it restarted, or its side of the link broke before ours).
        if peer in self._linking:
            return LLMStatusCode.LLM_PROCESSING_LINK, "a link is being made"
        if len(self._links) >= self._opts.max_links and peer not in self._links:
            self._purge_broken()
            if len(self._links) >= self._opts.max_links:
                return LLMStatusCode.LLM_LINK_FAILED, f"too many links (kvflow.MaxLinks={self._opts.max_links})"
        self._linking.add(peer)
        admitted.append(peer)
        return None

    async def _handle(self, link: Link, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one request a peer sent over a link."""
        op = msg.get("op")
        if op == "cache" and "key" in msg:
            return keys.answer(self._registry, msg)
        if op == "cache":
            cache_id = wire.field(msg, "cache_id", int)
            local = self._registry._caches.get(cache_id)
            if local is None or local.closing:
                raise LLMKvCacheNotExist(f"cache {cache_id} is not registered on cluster {self.cluster_id}")
            if link.endpoint is not None and link.endpoint.one_sided:  # the peer will touch it itself
                self._granted.setdefault(cache_id, set()).add(link)
            return {"cache": describe_local(local, link.transport)}
        if op == "gone":
            remote = link.forget(wire.field(msg, "cache_id", int))
            budget = msg.get("ms")
            budget_s = budget / 1000 if isinstance(budget, int) and 0 < budget <= 3_600_000 else 1.0
            if remote is not None:
                await link.drain_remote(remote, budget_s)
            await self._quiesce_retired(link.remote_cluster_id, budget_s)
            return {}
        if op == "bye":
            await link.quiesce(1.0)  # answered only once none of our operations can touch the peer's memory
            self._ungrant(link)
            link.closing = True
            if self._links.get(link.remote_cluster_id) is link:
                del self._links[link.remote_cluster_id]
            # the peer hangs up once it has our answer; its hang-up then closes this side quietly
            return {}
        raise LLMParamInvalid(f"unknown request {op!r}")

    # ------------------------------------------------------------------ transfers
    async def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                            timeout_in_millis: int | None = None) -> None:
        """Copy a peer's batch slot ``src_cache_index.batch_index`` into local slot ``batch_index``."""
        self._ready()
        local = self._local(dst_cache, "dst_cache")
        ci = _check_index(src_cache_index, blocks=False)

        def plan(remote: RemoteCache) -> Plan:
            return plan_cache(remote.desc, remote.addrs, ci.batch_index, local.desc, local.addrs,
                              batch_index, size, ext_param, False)

        await self._transfer(_PULL, ci, local, plan, timeout_in_millis,
                             lambda: _cache_precheck(local.desc, batch_index, size, ext_param, False))

    async def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None, *,
                             timeout_in_millis: int | None = None) -> None:
        """Copy the peer's ``src_blocks`` into local ``dst_blocks`` (pairwise)."""
        self._ready()
        local = self._local(dst_cache, "dst_cache")
        ci = _check_index(src_cache_index, blocks=True)

        def plan(remote: RemoteCache) -> Plan:
            return plan_blocks(remote.desc, remote.addrs, local.desc, local.addrs, src_blocks, dst_blocks,
                               ext_param, False)

        await self._transfer(_PULL, ci, local, plan, timeout_in_millis,
                             lambda: _blocks_precheck(local.desc, dst_blocks, src_blocks, ext_param, False))

    async def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                            timeout_in_millis: int | None = None) -> None:
        """Copy local slot ``src_batch_index`` into the peer's slot ``dst_cache_index.batch_index``."""
        self._ready()
        local = self._local(src_cache, "src_cache")
        ci = _check_index(dst_cache_index, blocks=False)

        def plan(remote: RemoteCache) -> Plan:
            return plan_cache(local.desc, local.addrs, src_batch_index, remote.desc, remote.addrs,
                              ci.batch_index, size, ext_param)

        await self._transfer(_PUSH, ci, local, plan, timeout_in_millis,
                             lambda: _cache_precheck(local.desc, src_batch_index, size, ext_param, True))

    async def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None, *,
                             timeout_in_millis: int | None = None) -> None:
        """Copy local ``src_blocks`` into the peer's ``dst_blocks`` (pairwise)."""
        self._ready()
        local = self._local(src_cache, "src_cache")
        ci = _check_index(dst_cache_index, blocks=True)

        def plan(remote: RemoteCache) -> Plan:
            return plan_blocks(local.desc, local.addrs, remote.desc, remote.addrs, src_blocks, dst_blocks,
                               ext_param)

        await self._transfer(_PUSH, ci, local, plan, timeout_in_millis,
                             lambda: _blocks_precheck(local.desc, src_blocks, dst_blocks, ext_param, True))

    async def _transfer(self, direction: str, ci: CacheIndex, local: LocalCache,
                        planner: Callable[[RemoteCache], Plan], timeout_in_millis: int | None,
                        precheck: Callable[[], None]) -> None:
        """Plan against the peer's cache and move the batch within the deadline, counted in
        ``stats()`` (and traced when OpenTelemetry is set up).

        ``precheck`` holds the checks that need only the local cache; they run before the peer is
        first asked for its cache (once it is known, ``planner`` checks everything). A batch the
        endpoint can move at once (``read_now``/``write_now``) needs no deadline."""
        timeout = self._deadline(timeout_in_millis)
        metrics = self._metrics
        span = metrics.start_span(direction, ci.cluster_id, ci.cache_id)
        t0 = metrics_now()
        link = self._links.get(ci.cluster_id)
        try:
            remote = link.remotes.get(ci.cache_id) if link is not None else None
            batch = None
            if remote is not None:
                assert link is not None
                endpoint = link.check()
                batch = planner(remote).batch(local, remote)
                # no pin/begin needed: nothing (an unregister, a peer's "gone") runs during this call
                if endpoint.read_now(batch) if direction is _PULL else endpoint.write_now(batch):
                    metrics.done(direction, ci.cluster_id, link.transport, batch, metrics_now() - t0, span)
                    return
            else:
                precheck()
                link = self._link(ci.cluster_id)
            batch = await self._transfer_awaited(direction, ci, link, local, remote, batch, planner, timeout)
        except BaseException as exc:
            metrics.failed(direction, ci.cluster_id, self._links.get(ci.cluster_id), exc, metrics_now() - t0, span)
            raise
        metrics.done(direction, ci.cluster_id, link.transport, batch, metrics_now() - t0, span)

    async def _transfer_awaited(self, direction: str, ci: CacheIndex, link: Link, local: LocalCache,
                                remote: RemoteCache | None, batch: RunBatch | None,
                                planner: Callable[[RemoteCache], Plan], timeout: float) -> RunBatch:
        """The rest of ``_transfer``: look the peer's cache up if need be, plan, run the batch."""
        local.pin()
        deadline = Deadline(timeout)
        try:
            if remote is None:
                remote = await link.remote_cache(ci.cache_id, timeout)
            if batch is None:
                batch = planner(remote).batch(local, remote)
            endpoint = link.check()
            remote.begin()
            try:
                if direction is _PULL:
                    await endpoint.read(batch)
                else:
                    await endpoint.write(batch)
            finally:
                remote.end()
            return batch
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

    # ------------------------------------------------------------------ layer-wise push
    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig], src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None, tensor_num_per_layer: int = 2, *,
                             timeout_in_millis: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer to every config's destination, each layer as soon as
        ``layer_synchronizer`` says it is ready; returns a :class:`CacheTask` at once (``await`` it).

        With block indices: block push; without: whole-slot push (``src_batch_index`` to
        ``dst_cache_index.batch_index``). Checks that need only local state raise ``LLMParamInvalid``
        here. Deadline: ``timeout_in_millis`` for the whole task, else ``llm.SyncKvCacheWaitTime`` per
        layer. See docs/layerwise.md."""
        self._ready()
        local = self._local(src_cache, "src_cache")
        return start_transfer(self, local, layer_synchronizer, transfer_configs, src_block_indices,
                              dst_block_indices, tensor_num_per_layer, timeout_in_millis)

    async def _layerwise_target(self, ci: CacheIndex, local: LocalCache, planner: Callable[[RemoteCache], Plan],
                                timeout: float) -> tuple[Link, RemoteCache, Plan]:
        """Look up the peer's cache and plan every layer of one ``transfer_cache_async`` config."""
        link = self._link(ci.cluster_id)
        if timeout <= 0:
            raise LLMTimeoutError(f"no time left to look up cache {ci.cache_id} on cluster {ci.cluster_id}")
        try:
            async with timeout_after(timeout):
                remote = await link.remote_cache(ci.cache_id, timeout)
        except TIMEOUT_ERRORS as exc:
            if isinstance(exc, LLMException):
                raise
            raise LLMTimeoutError(f"cluster {ci.cluster_id} did not describe cache {ci.cache_id} within "
                                  f"{timeout * 1000:.0f} ms") from None
        return link, remote, planner(remote)

    async def _layerwise_write(self, link: Link, ci: CacheIndex, local: LocalCache, remote: RemoteCache,
                               batch: RunBatch, timeout: float) -> None:
        """Write some planned runs of a ``transfer_cache_async`` config (the push half of ``_transfer``),
        counted in ``stats()`` as a push."""
        metrics = self._metrics
        span = metrics.start_span(_PUSH, ci.cluster_id, ci.cache_id)
        t0 = metrics_now()
        try:
            await self._layerwise_write_once(link, ci, local, remote, batch, timeout)
        except BaseException as exc:
            metrics.failed(_PUSH, ci.cluster_id, link, exc, metrics_now() - t0, span)
            raise
        metrics.done(_PUSH, ci.cluster_id, link.transport, batch, metrics_now() - t0, span)

    async def _layerwise_write_once(self, link: Link, ci: CacheIndex, local: LocalCache, remote: RemoteCache,
                                    batch: RunBatch, timeout: float) -> None:
        if local.closing or self._registry._caches.get(local.cache_id) is not local:
            raise LLMKvCacheNotExist(f"cache {local.cache_id} was unregistered during the transfer")
        if link.remotes.get(ci.cache_id) is not remote:
            raise LLMKvCacheNotExist(f"cache {ci.cache_id} on cluster {ci.cluster_id} was unregistered "
                                     "during the transfer")
        endpoint = link.check()
        local.pin()
        try:
            async with timeout_after(timeout):
                remote.begin()
                try:
                    await endpoint.write(batch)
                finally:
                    remote.end()
        except TIMEOUT_ERRORS as exc:
            if isinstance(exc, LLMException):
                raise
            raise LLMTimeoutError(f"push to cluster {ci.cluster_id} cache {ci.cache_id} did not finish within "
                                  f"the transfer's deadline") from None
        except LLMKvCacheNotExist:
            link.forget(ci.cache_id)
            raise
        finally:
            local.unpin()


# ---------------------------------------------------------------------- helpers
def _blocks_precheck(desc: CacheDesc, local_blocks: Any, remote_blocks: Any, ext: KvCacheExtParam | None,
                     local_is_src: bool) -> None:
    """The checks of a block transfer that need only the local cache."""
    side_tensors(ext, desc, local_is_src)
    lb = block_list(local_blocks, desc.num_blocks, "src_blocks" if local_is_src else "dst_blocks")
    rb = block_list(remote_blocks, 1 << 62, "dst_blocks" if local_is_src else "src_blocks")
    if lb.size != rb.size:
        raise LLMParamInvalid(f"src_blocks has {(lb if local_is_src else rb).size} entries, "
                              f"dst_blocks has {(rb if local_is_src else lb).size}")
    if not local_is_src and np.unique(lb).size != lb.size:
        raise LLMParamInvalid("dst_blocks names a block more than once")


def _cache_precheck(desc: CacheDesc, batch_index: Any, size: Any, ext: KvCacheExtParam | None,
                    local_is_src: bool) -> None:
    """The checks of a whole-slot transfer that need only the local cache."""
    side_tensors(ext, desc, local_is_src)
    what = "src_batch_index" if local_is_src else "batch_index"
    _check_int(what, batch_index, 0, desc.num_blocks - 1)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise LLMParamInvalid(f"size must be an int, got {size!r}")
    if size != -1 and not 0 < size <= desc.stride:
        raise LLMParamInvalid(f"size {size} must be -1 or in 1..{desc.stride} (bytes per tensor slot)")


def _check_index(ci: CacheIndex, blocks: bool) -> CacheIndex:
    if type(ci) is CacheIndex:  # the common case, checked without calls
        c, k, b = ci.cluster_id, ci.cache_id, ci.batch_index
        if (type(c) is int and type(k) is int and type(b) is int
                and 0 <= c < 1 << 64 and 0 < k < 1 << 64 and (b == 0 or (not blocks and 0 < b < 1 << 32))):
            return ci
    if not isinstance(ci, CacheIndex):
        raise LLMParamInvalid(f"expected a CacheIndex, got {type(ci).__name__}")
    _check_int("cluster_id", ci.cluster_id)
    _check_int("cache_id", ci.cache_id, 1)
    _check_int("batch_index", ci.batch_index, 0, (1 << 32) - 1)
    if blocks and ci.batch_index != 0:
        raise LLMParamInvalid("batch_index must be 0 for block transfers")
    return ci


def wire_address(ip: str, port: int) -> tuple[str, int]:
    from ._options import parse_address

    host = ip if ":" not in ip else f"[{ip}]"
    return parse_address("remote_ip_infos", f"{host}:{port}")


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), n)
        buf += chunk
    return bytes(buf)
