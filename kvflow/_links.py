"""The link table of one LlmDataDist: making links (dial), admitting them (accept), the requests
peers send over them, and who may still touch which registered cache."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import _handshake as handshake
from . import _keys as keys
from . import _notes as notes
from . import _wire as wire
from ._checks import check_int, wire_address
from ._compat import TIMEOUT_ERRORS
from ._heartbeat import open_control
from ._link import Link, LinkState, describe_local, open_socket
from ._memory import Registry
from ._metrics import Metrics, end_span, event, link_span
from ._options import Options
from ._status import (
    LLMException,
    LLMKvCacheNotExist,
    LLMLinkBusy,
    LLMLinkFailed,
    LLMNotYetLink,
    LLMParamInvalid,
    LLMStatusCode,
    LLMTimeoutError,
    error_for,
)
from ._types import ClusterInfo
from .transport import Transport

log = logging.getLogger("kvflow")

FINALIZE_BYE_S = 0.5  # how long finalize waits for each peer to confirm it dropped the link
BACKOFF_FIRST_S = 0.02  # a busy listener is tried again after up to this, doubling per attempt ...
BACKOFF_MAX_S = 1.0  # ... up to this (full jitter: a uniform wait below the bound)
REFUSED_RETRIES = 2  # a refused connect (nothing listens yet) is tried this many more times


class Attempts:
    """The tries of one link: how long to wait before the next, and what to say if none succeeds."""

    def __init__(self, address: tuple[str, int], start: float) -> None:
        self.address = address
        self.start = start
        self.tries = 0
        self.busy = 0  # busy answers or resets before an answer
        self.refused = 0
        self.last = ""
        self.session: handshake.Session | None = None  # the latest try's, once connected

    def wait(self, exc: BaseException) -> float | None:
        """Seconds to wait before trying again after ``exc``, or None to give up now."""
        self.tries += 1
        if isinstance(exc, ConnectionRefusedError):
            self.refused += 1
            if self.busy == 0 and self.refused > REFUSED_RETRIES:
                return None
        else:
            self.busy += 1
            self.last = str(exc.args[0]) if isinstance(exc, LLMException) else str(exc)
        bound = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.tries - 1))
        return random.uniform(bound / 2 if self.refused == self.tries else 0.0, bound)

    def failure(self, now: float, timed_out: bool) -> LLMException:
        """The typed error that says what happened over every try (``timed_out``: the last one ran out of time)."""
        host, port = self.address
        took = now - self.start
        if self.busy:
            return LLMLinkBusy(
                f"listener backlog full: {host}:{port} answered busy or reset the connection {self.busy} "
                f"times; retried {self.tries} times over {took:.2f} s"
                + (" until the timeout" if timed_out else "") + f" (last: {self.last})")
        if timed_out:
            if self.session is None:
                where = f"connecting to {host}:{port}"
            elif self.session.received:
                where = f"in the handshake with {host}:{port}, which answered but did not finish it in time"
            else:
                where = f"waiting for {host}:{port} to answer the hello"
            return LLMTimeoutError(f"timed out after {took:.3f} s {where} (an overloaded or stalled listener, "
                                   "or not a kvflow one)")
        return LLMLinkFailed(f"connection refused by {host}:{port}, {self.tries} times over {took:.2f} s: "
                             "nothing listens there")


@dataclass(frozen=True)
class LinkInfo:
    """What kvflow knows about one link (``LlmDataDist.link_info``, ``LlmDataDist.links``)."""

    remote_cluster_id: int
    transport: str
    state: str
    initiator: bool
    fallbacks: dict[str, str] = field(default_factory=dict)  # transport -> why it was not used


@dataclass
class LocalSide:
    """Who we are in a handshake: set when the LlmDataDist is initialized."""

    cluster_id: int
    instance: str
    opts: Options = field(default_factory=Options)
    transports: dict[str, Transport] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # transport -> why it cannot run here
    mac_key: bytes | None = None


class LinkTable:
    """The links to peer clusters, by cluster id, and everything that changes them."""

    def __init__(self, local: LocalSide, registry: Registry, metrics: Metrics) -> None:
        self.local = local
        self.links: dict[int, Link] = {}
        self.linking: set[int] = set()  # cluster ids with a handshake under way
        self._registry = registry
        self._metrics = metrics
        # cache id -> links over which a peer learned its addresses and can touch it itself (one-sided)
        self._granted: dict[int, set[Link]] = {}
        self._retired: list[Link] = []  # replaced or purged links whose endpoints may still unwind
        self._tasks: set[asyncio.Task[Any]] = set()
        self.inbox = notes.Inbox()  # peers' notifications, until the application takes them

    def info(self, link: Link) -> LinkInfo:
        return LinkInfo(link.remote_cluster_id, link.transport, link.state.value, link.initiator,
                        dict(link.fallbacks))

    def get(self, cluster_id: int) -> Link:
        """The usable link to ``cluster_id``, or LLMNotYetLink saying why there is none."""
        link = self.links.get(cluster_id)
        if link is None:
            raise LLMNotYetLink(f"no link to cluster {cluster_id}")
        link.check()
        return link

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ making links
    async def link_one(self, info: ClusterInfo, timeout: float,
                       errors: dict[int, LLMException] | None = None) -> LLMStatusCode:
        """Dial one cluster; its status (never raises on link failure). Unless it links, the
        exception that says why goes into ``errors`` under the cluster id."""
        cid = info.remote_cluster_id
        code, why = self._link_precheck(info)
        err: LLMException | None = None
        if code is None:
            self.linking.add(cid)
            address = wire_address(info.remote_ip_infos[0].ip, info.remote_ip_infos[0].port)
            span = link_span(self.local.cluster_id, cid, address)
            code, why = LLMStatusCode.LLM_LINK_FAILED, ""
            try:
                link = await self._dial_retrying(cid, address,
                                                 info.local_ip_infos[0].ip if info.local_ip_infos else None, timeout)
            except LLMException as exc:
                code, why, err = exc.status_code, str(exc), exc
            except asyncio.IncompleteReadError:
                why = "the peer closed the connection during the handshake"
            except ConnectionResetError:
                why = "the peer reset the connection during the handshake"
            except OSError as exc:
                why = f"{exc.strerror or type(exc).__name__} ({address[0]}:{address[1]})"
            except BaseException:
                end_span(span, "CANCELLED")
                raise
            finally:
                self.linking.discard(cid)
            if not why:
                self.install(link)
                end_span(span, None, transport=link.transport)
                return LLMStatusCode.LLM_SUCCESS
            self._metrics.link_failed(cid, address, code.name, why)
            end_span(span, code.name)
            if err is not None:
                err.__traceback__ = None  # kept by the caller: no frames of the dial
        if errors is not None:
            errors[cid] = err or error_for(code, why)
        return code

    def _link_precheck(self, info: ClusterInfo) -> tuple[LLMStatusCode | None, str]:
        """Why ``info`` is not dialed (a status and its message), or (None, "") to dial it."""
        cid = info.remote_cluster_id
        if len(info.remote_ip_infos) != 1:
            why = f"link to cluster {cid}: exactly one remote_ip_infos entry is needed"
            log.warning("%s", why)
            return LLMStatusCode.LLM_PARAM_INVALID, why
        ip = info.remote_ip_infos[0]
        try:
            wire_address(ip.ip, ip.port)
        except LLMParamInvalid as exc:
            log.warning("link to cluster %d: %s", cid, exc)
            return LLMStatusCode.LLM_PARAM_INVALID, f"link to cluster {cid}: {exc.args[0]}"
        existing = self.links.get(cid)
        if existing is not None and existing.healthy:
            return LLMStatusCode.LLM_ALREADY_LINK, f"a healthy link to cluster {cid} exists"
        if cid in self.linking:
            return LLMStatusCode.LLM_PROCESSING_LINK, f"a link to cluster {cid} is being made right now"
        if cid == self.local.cluster_id:
            why = f"refusing to link cluster {cid} to itself"
            log.warning("%s", why)
            return LLMStatusCode.LLM_PARAM_INVALID, why
        return None, ""

    async def _dial_retrying(self, cid: int, address: tuple[str, int], local_ip: str | None,
                             timeout: float) -> Link:
        """``_dial`` within ``timeout``; tried again, with backoff, while the listener is busy (it
        answers so, resets the connection before answering, or gives up on our handshake as too slow)
        and, a few times, when it refuses."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempts = Attempts(address, loop.time())
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    return await self._dial(cid, address, local_ip, attempts)
            except TIMEOUT_ERRORS:
                raise attempts.failure(loop.time(), True) from None
            except (LLMLinkBusy, ConnectionRefusedError) as exc:  # ListenerBusy, or timed out by a busy listener
                wait = attempts.wait(exc)
                if wait is None or (not attempts.busy and loop.time() + wait >= deadline):
                    raise attempts.failure(loop.time(), False) from None
                if loop.time() >= deadline:
                    raise attempts.failure(loop.time(), True) from None
                await asyncio.sleep(min(wait, deadline - loop.time()))

    async def _dial(self, cid: int, address: tuple[str, int], local_ip: str | None, attempts: Attempts) -> Link:
        attempts.session = None
        try:
            sock = await open_socket(address, local_ip)
        except (ConnectionResetError, ConnectionAbortedError):  # accepted, then reset at once: not taken
            raise handshake.ListenerBusy("the listener reset the connection before answering the hello") from None
        reader, writer = await open_control(sock)
        me = self.local
        attempts.session = handshake.Session(reader, writer, me.mac_key)
        try:
            agreed = await handshake.dial(attempts.session,
                                          cluster_id=me.cluster_id, expect=cid, instance=me.instance,
                                          transports=me.transports, unavailable=me.unavailable, address=address,
                                          heartbeat_ms=me.opts.heartbeat_ms)
        except BaseException:
            writer.close()
            raise
        event("transport_chosen", cluster=me.cluster_id, peer=cid, transport=agreed.transport, initiator=True,
              skipped=";".join(f"{k}:{v}" for k, v in agreed.fallbacks.items()) or "-")
        link = self.new_link(agreed, True, reader, writer)
        self.start(link, agreed)
        return link

    def new_link(self, agreed: handshake.Agreed, initiator: bool, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> Link:
        opts = self.local.opts
        link = Link(remote_cluster_id=agreed.peer_cluster, peer_instance=agreed.peer_instance, initiator=initiator,
                    transport=agreed.transport, reader=reader, writer=writer, handler=self.handle,
                    heartbeat_interval=opts.heartbeat_interval_ms / 1000,
                    heartbeat_timeout=opts.heartbeat_timeout_ms / 1000,
                    peer_heartbeat=agreed.peer_heartbeat, fallbacks=agreed.fallbacks)
        agreed.channel.link = link
        return link

    @staticmethod
    def start(link: Link, agreed: handshake.Agreed) -> None:
        link.start(agreed.endpoint)
        if agreed.channel.early_failure is not None:
            link.mark_broken(agreed.channel.early_failure)

    def admit(self, peer: int, expect: int, admitted: list[int]) -> tuple[LLMStatusCode, str] | None:
        """Why an authenticated peer may not link now, or None (it then counts as linking)."""
        check_int("cluster", peer)
        me = self.local
        if expect != me.cluster_id:
            return LLMStatusCode.LLM_LINK_FAILED, f"this is cluster {me.cluster_id}, not {expect}"
        if peer == me.cluster_id:
            return LLMStatusCode.LLM_LINK_FAILED, "peer has our cluster id"
        # A link from this cluster that we still hold is replaced: the peer dials only when it
        # has no usable link (it restarted, or its side of the link broke before ours).
        if peer in self.linking:
            return LLMStatusCode.LLM_PROCESSING_LINK, "a link is being made"
        if len(self.links) >= me.opts.max_links and peer not in self.links:
            self.purge_broken()
            if len(self.links) >= me.opts.max_links:
                return LLMStatusCode.LLM_LINK_FAILED, f"too many links (kvflow.MaxLinks={me.opts.max_links})"
        self.linking.add(peer)
        admitted.append(peer)
        return None

    def install(self, link: Link) -> None:
        old = self.links.get(link.remote_cluster_id)
        if old is not None and old is not link:
            self.retire(old, "replaced by a new link")
        self.links[link.remote_cluster_id] = link
        link.on_closed = self._metrics.link_down
        self._metrics.link_up(link)

    def purge_broken(self) -> None:
        """Forget broken links (to make room under kvflow.MaxLinks)."""
        for cid, link in list(self.links.items()):
            if link.state is LinkState.BROKEN:
                del self.links[cid]
                self.retire(link, "purged")

    def retire(self, link: Link, reason: str) -> None:
        """Close a link that is no longer in the table; keep it while its operations may still unwind."""
        link.close(reason)
        self._spawn(link.wait_closed())
        self._retired = [r for r in self._retired if r.busy] + [link]

    # ------------------------------------------------------------------ unlinking
    async def unlink_one(self, cid: int, timeout: float, force: bool) -> LLMStatusCode:
        link = self.links.get(cid)
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
        if self.links.get(cid) is link:
            del self.links[cid]
        link.close("unlinked")
        await link.wait_closed()
        return status

    async def close_all(self) -> None:
        """Unlink every peer (telling each, bounded), at finalize."""
        await asyncio.gather(*(self.unlink_one(cid, FINALIZE_BYE_S, force=False) for cid in list(self.links)))
        self.links.clear()
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------------ who can touch a cache
    def _ungrant(self, link: Link) -> None:
        """``link``'s peer confirmed it can no longer touch any of our caches."""
        for links in self._granted.values():
            links.discard(link)

    def forget_cache(self, cache_id: int) -> None:
        self._granted.pop(cache_id, None)

    async def _quiesce_retired(self, cid: int, budget: float) -> None:
        """Wait until no retired link to ``cid`` can touch that peer's memory (LLMWaitProcessTimeout if
        one still can): a peer's ``gone`` covers every link it ever had to us, not only the live one."""
        for old in [r for r in self._retired if r.remote_cluster_id == cid]:
            await old.quiesce(budget)
        self._retired = [r for r in self._retired if r.busy]

    async def revoke_peers(self, cache_id: int, timeout: float) -> dict[Link, str]:
        """Tell every linked peer that the cache is gone; the peers that can still reach it, with why."""
        granted = self._granted.get(cache_id, set())
        healthy = [link for link in self.links.values() if link.healthy]
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

    # ------------------------------------------------------------------ serving peers' requests
    async def handle(self, link: Link, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one request a peer sent over a link."""
        op = msg.get("op")
        if op == "cache" and "key" in msg:
            return keys.answer(self._registry, msg)
        if op == "cache":
            cache_id = wire.field(msg, "cache_id", int)
            local = self._registry.lookup(cache_id)
            if local is None:
                raise LLMKvCacheNotExist(f"cache {cache_id} is not registered on cluster {self.local.cluster_id}")
            if link.endpoint is not None and link.endpoint.one_sided:  # the peer will touch it itself
                self._granted.setdefault(cache_id, set()).add(link)
            return {"cache": describe_local(local, link.transport)}
        if op == "note":
            return self.inbox.answer(link.remote_cluster_id, msg)
        if op == "gone":
            remote = link.forget(wire.field(msg, "cache_id", int))
            budget = msg.get("ms")
            budget_s = budget / 1000 if isinstance(budget, int) and 0 < budget <= 3_600_000 else 1.0
            if remote is not None:
                await link.drain_remote(remote, budget_s)
            await self._quiesce_retired(link.remote_cluster_id, budget_s)
            return {}
        if op == "bye":
            link.closing = True  # from here on no copy starts on a caller's thread (kvflow.sync)
            await link.quiesce(1.0)  # answered only once none of our operations can touch the peer's memory
            self._ungrant(link)
            if self.links.get(link.remote_cluster_id) is link:
                del self.links[link.remote_cluster_id]
            # the peer hangs up once it has our answer; its hang-up then closes this side quietly
            return {}
        raise LLMParamInvalid(f"unknown request {op!r}")
