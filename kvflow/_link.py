"""One link to a peer: its control connection, heartbeats, remote-cache lookups and data endpoint."""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from . import _wire as wire
from ._compat import TIMEOUT_ERRORS
from ._compat import timeout as timeout_after
from ._guard import GUARD
from ._heartbeat import PING, ControlProtocol, heartbeats
from ._status import (
    LLMException,
    LLMKvCacheNotExist,
    LLMLinkFailed,
    LLMNotYetLink,
    LLMStatusCode,
    LLMTimeoutError,
    LLMWaitProcessTimeout,
    error_for,
)
from ._types import CacheDesc, DataType, Placement
from .transport import Endpoint, LinkChannel, RemoteCache, RemoteRegion

if TYPE_CHECKING:
    from ._memory import LocalCache

log = logging.getLogger("kvflow.link")

MAX_SERVING = 64  # a peer's control requests still waiting on something; more are refused with LLM_LINK_BUSY
MAX_WRITE_BUFFER = 32 << 20  # control bytes queued for a peer that does not read them: then the link breaks


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    LINKED = "linked"
    BROKEN = "broken"
    CLOSED = "closed"


# A member looked up on its enum class goes through the metaclass (about 75 ns on CPython 3.11,
# against 14 for a global): ``check()`` runs once per transfer.
_LINKED = LinkState.LINKED


class StreamChannel(LinkChannel):
    """LinkChannel over the peer's listen port: the initiator dials, the acceptor waits for a token."""

    def __init__(self, initiator: bool, peer_cluster_id: int, token: bytes,
                 address: tuple[str, int] | None = None,
                 waiter: asyncio.Future[socket.socket] | None = None, binding: bytes = b"") -> None:
        self.initiator = initiator
        self.peer_cluster_id = peer_cluster_id
        self.binding = binding
        self._token = token
        self._address = address
        self._waiter = waiter
        self.link: Link | None = None
        self.early_failure: BaseException | None = None

    async def open_stream(self) -> socket.socket:
        if not self.initiator:
            assert self._waiter is not None
            return await self._waiter
        assert self._address is not None
        sock = await open_socket(self._address)
        try:
            await asyncio.get_running_loop().sock_sendall(sock, wire.MAGIC_DATA + self._token)
        except BaseException:
            sock.close()
            raise
        return sock

    def broken(self, exc: BaseException) -> None:
        if self.link is not None:
            self.link.mark_broken(exc)
        else:
            self.early_failure = exc


async def open_socket(address: tuple[str, int], local_ip: str | None = None) -> socket.socket:
    """A connected non-blocking TCP socket with TCP_NODELAY."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if local_ip:
            sock.bind((local_ip, 0))
        await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


Handler = Callable[["Link", dict[str, Any]], Awaitable[dict[str, Any]]]


class Link:
    """A live link to one peer cluster (either side may have made it)."""

    def __init__(self, *, remote_cluster_id: int, peer_instance: str, initiator: bool, transport: str,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler,
                 heartbeat_interval: float, heartbeat_timeout: float,
                 peer_heartbeat: tuple[float, float] | None = None,
                 fallbacks: dict[str, str] | None = None) -> None:
        self.remote_cluster_id = remote_cluster_id
        self.peer_instance = peer_instance
        self.initiator = initiator
        self.transport = transport
        self.fallbacks = dict(fallbacks or {})
        self.state = LinkState.CONNECTING
        self.endpoint: Endpoint | None = None
        self.error: BaseException | None = None
        self.remotes: dict[int, RemoteCache] = {}
        # the engine's metric series (OpStats) of this link, by op; Any because _metrics imports this module
        self.counters: dict[str, Any] = {}
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._writer = writer
        self._handler = handler
        # heartbeats (kvflow._heartbeat): ping once we sent nothing for the shorter of the two sides'
        # intervals; pong only a peer that did not say its settings; break once silent for _hb_timeout
        self._hb_timeout = heartbeat_timeout
        self._pong = peer_heartbeat is None
        peer_interval, peer_timeout = peer_heartbeat or (heartbeat_interval, heartbeat_timeout)
        self._ping_every = min(heartbeat_interval, peer_interval)
        # how late a ping may go out: a quarter of the interval, or of the smaller margin to a timeout
        self.heartbeat_grain = min(self._ping_every, min(heartbeat_timeout, peer_timeout) - self._ping_every) / 4
        self._heartbeats = heartbeats()
        self._expiry: asyncio.TimerHandle | None = None  # armed when the timeout may pass before the next walk
        self._last_rx = self._last_tx = self._loop.time()
        proto = writer.transport.get_protocol()
        self._control = proto if isinstance(proto, ControlProtocol) else None  # it notes when bytes arrive
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 1
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lookups: dict[int, asyncio.Future[RemoteCache]] = {}
        self._serving = 0
        self.on_closed: Callable[[Link], None] | None = None
        self._closing = False

    @property
    def closing(self) -> bool:
        """Set while unlinking: the peer's hang-up is expected, and no copy starts on a caller's thread."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        with GUARD:
            self._closing = value

    def __repr__(self) -> str:
        return f"<Link cluster={self.remote_cluster_id} {self.transport} {self.state.value}>"

    @property
    def healthy(self) -> bool:
        return self.state is _LINKED

    @property
    def busy(self) -> bool:
        """Whether an operation of ours may still touch the peer's memory over this link."""
        return any(r.inflight for r in self.remotes.values())

    def start(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.state = LinkState.LINKED
        self._last_rx = self._loop.time()
        if self._control is not None:
            self._control.heard = self._last_rx
            self._control.drop_pings = not self._pong  # nothing to answer: the reader need not see them
        self._spawn(self._read_loop())
        self._heartbeats.add(self, self._last_rx + self._ping_every)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check(self) -> Endpoint:
        """The endpoint, or the typed error that says why the link cannot be used."""
        if self.state is _LINKED and self.endpoint is not None:
            return self.endpoint
        raise LLMNotYetLink(
            f"link to cluster {self.remote_cluster_id} is {self.state.value}"
            + (f" ({self.error}); unlink and link again" if self.error else "")
        )

    # ------------------------------------------------------------------ control messages
    def send(self, msg: dict[str, Any] | bytes) -> None:
        """Send one control frame (a message, or one already packed)."""
        if self.state in (LinkState.LINKED, LinkState.CONNECTING) and not self._writer.is_closing():
            self._writer.write(msg if isinstance(msg, bytes) else wire.pack(msg))
            self._last_tx = self._loop.time()
            if self._writer.transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
                self.mark_broken(LLMLinkFailed(
                    f"cluster {self.remote_cluster_id} does not read its control connection "
                    f"({MAX_WRITE_BUFFER >> 20} MiB queued)"))

    async def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send a request and wait for the peer's answer; typed errors for its non-zero codes."""
        self.check()
        req_id = self._next_id
        self._next_id += 1
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[req_id] = fut
        try:
            self.send({**msg, "t": "req", "id": req_id})
            async with timeout_after(timeout):
                rsp = await fut
        except TIMEOUT_ERRORS as exc:
            if isinstance(exc, LLMException):
                raise
            raise LLMTimeoutError(
                f"cluster {self.remote_cluster_id} did not answer {msg.get('op')!r} within {timeout:.3f} s"
            ) from None
        finally:
            self._pending.pop(req_id, None)
        code = rsp.get("code", 0)
        if code:
            raise error_for(code, str(rsp.get("msg", "")))
        return rsp

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await wire.read_frame(self._reader)
                self._last_rx = self._loop.time()
                t = msg["t"]
                if t == "ping":
                    if self._pong:
                        self.send({"t": "pong"})
                elif t == "pong":
                    pass
                elif t == "rsp":
                    fut = self._pending.get(wire.field(msg, "id", int))
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif t == "req":
                    req_id = wire.field(msg, "id", int)
                    if self._serving >= MAX_SERVING:
                        self.send({"t": "rsp", "id": req_id, "code": int(LLMStatusCode.LLM_LINK_BUSY),
                                   "msg": f"more than {MAX_SERVING} requests at once"})
                    else:
                        self._serving += 1
                        self._spawn(self._answer(req_id, msg))
                        # let it run before the next frame: a request answered at once (a lookup) never
                        # counts against the bound, however many arrive together; only waiting ones do
                        await asyncio.sleep(0)
                else:
                    raise wire.ProtocolError(f"unexpected control frame {t!r}")
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self.mark_broken(LLMLinkFailed(f"control connection to cluster {self.remote_cluster_id} closed"))
        except LLMException as exc:
            log.warning("link to cluster %d: %s", self.remote_cluster_id, exc)
            self.mark_broken(exc)

    async def _answer(self, req_id: int, msg: dict[str, Any]) -> None:
        try:
            body = await self._handler(self, msg)
            rsp: dict[str, Any] = {"t": "rsp", "id": req_id, "code": 0, **body}
        except LLMException as exc:
            rsp = {"t": "rsp", "id": req_id, "code": int(exc.status_code), "msg": str(exc.args[0])[:500]}
        except Exception as exc:  # never let a peer's request crash us
            log.exception("error answering %r from cluster %d", msg.get("op"), self.remote_cluster_id)
            rsp = {"t": "rsp", "id": req_id, "code": int(LLMStatusCode.LLM_FAILED), "msg": type(exc).__name__}
        finally:
            self._serving -= 1
        self.send(rsp)

    def beat(self, now: float) -> float | None:
        """The heartbeat walker's visit: ping if we sent nothing for our ping interval; break the link
        if the peer was silent for the timeout, or watch that moment itself if it may come before
        the next visit. When to visit next, or None once the link is down."""
        if self.state is not LinkState.LINKED:
            return None
        expiry = self._heard() + self._hb_timeout
        if now >= expiry:
            self._expire(now)
            return None
        if now - self._last_tx >= self._ping_every:
            self.send(PING)
        due = self._last_tx + self._ping_every  # (the walker never visits sooner than its next grain)
        if expiry < due + self.heartbeat_grain and self._expiry is None:
            self._expiry = self._loop.call_at(expiry + 0.001, self._check_expiry)
        return due

    def _heard(self) -> float:
        """When the peer last sent us anything (on arrival, before any task reads it)."""
        return self._control.heard if self._control is not None else self._last_rx

    def _check_expiry(self) -> None:
        self._expiry = None
        now = self._loop.time()
        if self.state is LinkState.LINKED and now >= self._heard() + self._hb_timeout:
            self._expire(now)

    def _expire(self, now: float) -> None:
        self.mark_broken(LLMTimeoutError(
            f"no heartbeat from cluster {self.remote_cluster_id} for {now - self._heard():.1f} s"))

    # ------------------------------------------------------------------ remote caches
    async def remote_cache(self, cache_id: int, timeout: float) -> RemoteCache:
        """The peer's cache ``cache_id`` (looked up once, then kept until the peer drops it).

        Concurrent callers share one lookup, which runs as its own task (bounded by ``timeout``):
        cancelling one caller neither cancels the lookup nor hands the others a CancelledError."""
        remote = self.remotes.get(cache_id)
        if remote is not None:
            return remote
        deadline = self._loop.time() + timeout
        while True:
            task = self._lookups.get(cache_id)
            joined = task is not None
            if task is None:
                task = asyncio.ensure_future(self._lookup(cache_id, deadline - self._loop.time()))
                self._lookups[cache_id] = task
                task.add_done_callback(lambda t: self._lookup_done(cache_id, t))
            try:
                return await asyncio.shield(task)
            except LLMTimeoutError:
                # a lookup started by a caller with an earlier deadline timed out: ours is not spent yet
                if self._lookups.get(cache_id) is task:
                    del self._lookups[cache_id]
                if not joined or deadline - self._loop.time() < 0.001:
                    raise

    def _lookup_done(self, cache_id: int, task: asyncio.Future[RemoteCache]) -> None:
        if self._lookups.get(cache_id) is task:
            del self._lookups[cache_id]
        if not task.cancelled():
            task.exception()  # retrieved: every caller that still waits got it

    async def _lookup(self, cache_id: int, timeout: float) -> RemoteCache:
        rsp = await self.request({"op": "cache", "cache_id": cache_id}, timeout)
        remote = self._parse_cache(cache_id, rsp)
        if self.state is LinkState.LINKED:
            self.remotes[cache_id] = remote
        return remote

    def _parse_cache(self, cache_id: int, rsp: dict[str, Any]) -> RemoteCache:
        c = wire.field(rsp, "cache", dict)
        try:
            desc = CacheDesc(
                num_tensors=wire.field(c, "num_tensors", int),
                data_type=DataType(wire.field(c, "data_type", int)),
                shape=[int(d) for d in wire.field(c, "shape", list)],
                placement=Placement(wire.field(c, "placement", int)),
            )
            desc.validate()
            addrs = wire.field(c, "addrs", list)
            descs = wire.field(c, "descs", list)
            if len(addrs) != desc.num_tensors or len(descs) != desc.num_tensors:
                raise ValueError("tensor count mismatch")
            regions = tuple(
                RemoteRegion(int(a), desc.tensor_bytes, d if isinstance(d, bytes) else None)
                for a, d in zip(addrs, descs)
            )
        except (ValueError, TypeError, LLMException) as exc:
            raise wire.ProtocolError(f"malformed description of remote cache {cache_id}: {exc}") from None
        return RemoteCache(self.remote_cluster_id, cache_id, desc, regions)

    def forget(self, cache_id: int) -> RemoteCache | None:
        with GUARD:  # a copy on a caller's thread that still uses it has ended
            return self.remotes.pop(cache_id, None)

    async def drain_remote(self, remote: RemoteCache, budget: float) -> None:
        """Return once no operation of ours can touch ``remote``'s memory, within ``budget`` seconds.

        The peer is about to free that memory. Our operations get most of the budget to finish;
        then the endpoint is aborted (a one-sided copy stops within one bounded chunk) and we wait
        for them to unwind before answering."""
        if not remote.inflight:
            return
        remote.idle = asyncio.Event()
        try:
            async with timeout_after(budget * 0.7):
                await remote.idle.wait()
            return
        except TIMEOUT_ERRORS:
            pass
        if self.endpoint is not None and not self.endpoint.one_sided:
            # The peer itself moves the bytes of our operations (TCP): its unregister stops them on its
            # side (pins, then typed errors). Aborting our endpoint would only break the whole link.
            return
        log.warning("peer cluster %d unregisters cache %d while %d transfer(s) use it: aborting them",
                    self.remote_cluster_id, remote.cache_id, remote.inflight)
        if self.endpoint is not None:
            self.endpoint.abort(LLMKvCacheNotExist(
                f"cache {remote.cache_id} was unregistered on cluster {self.remote_cluster_id} during the transfer"))
        try:
            async with timeout_after(budget * 0.25):
                await remote.idle.wait()
        except TIMEOUT_ERRORS:
            log.error("transfers on cache %d of cluster %d did not stop after abort", remote.cache_id,
                      self.remote_cluster_id)
            raise LLMWaitProcessTimeout(f"{remote.inflight} transfer(s) on cache {remote.cache_id} did not stop "
                                        "after abort") from None

    async def quiesce(self, budget: float) -> None:
        """Stop every operation of ours on the peer's memory and wait (bounded) until none can touch it;
        LLMWaitProcessTimeout if some still could. Used before telling the peer we are gone."""
        busy = [r for r in self.remotes.values() if r.inflight]
        if not busy:
            return
        if self.endpoint is not None:
            self.endpoint.abort(LLMLinkFailed(f"link to cluster {self.remote_cluster_id} is being closed"))
        for r in busy:
            r.idle = r.idle or asyncio.Event()
        try:
            async with timeout_after(budget):
                for r in busy:
                    if r.inflight:
                        await r.idle.wait()  # type: ignore[union-attr]
        except TIMEOUT_ERRORS:
            raise LLMWaitProcessTimeout(f"transfers to cluster {self.remote_cluster_id} did not stop within "
                                        f"{budget:.3f} s") from None

    # ------------------------------------------------------------------ teardown
    def mark_broken(self, exc: BaseException) -> None:
        """The link can no longer be used: fail everything in flight, at once."""
        if self.state in (LinkState.BROKEN, LinkState.CLOSED):
            return
        if self.closing:  # an unlink or finalize under way: the hang-up was expected
            log.debug("link to cluster %d closed by the peer: %s", self.remote_cluster_id, exc)
            self.close(str(exc))
            return
        with GUARD:
            self.state = LinkState.BROKEN  # on_closed logs the structured link_down line
        self.error = exc
        self._shutdown(exc)

    def close(self, reason: str = "link closed") -> None:
        """Close the link locally (unlink / finalize); in-flight operations fail with LLMLinkFailed."""
        if self.state is LinkState.CLOSED:
            return
        was_broken = self.state is LinkState.BROKEN
        with GUARD:
            self.state = LinkState.CLOSED
        if not was_broken:
            self._shutdown(LLMLinkFailed(f"link to cluster {self.remote_cluster_id}: {reason}"))

    def _shutdown(self, exc: BaseException) -> None:
        if self._expiry is not None:  # (the walker drops the link at its next visit)
            self._expiry.cancel()
            self._expiry = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
        if self.endpoint is not None:
            self.endpoint.abort(exc)
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        self._writer.close()
        if self.on_closed is not None:
            self.on_closed(self)

    async def wait_closed(self) -> None:
        if self.endpoint is not None:
            try:
                await self.endpoint.close()
            except Exception:  # closing a broken endpoint may fail; nothing is left to release
                log.debug("endpoint close failed", exc_info=True)
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (TimeoutError, Exception):
            pass


def describe_local(local: LocalCache, transport: str) -> dict[str, Any]:
    """A local cache as a peer receives it over a link using ``transport``."""
    d = local.desc
    return {
        "cache_id": local.cache_id,
        "num_tensors": d.num_tensors,
        "data_type": int(d.data_type),
        "shape": [int(x) for x in d.shape],
        "placement": int(d.placement),
        "addrs": [r.addr for r in local.regions],
        "descs": list(local.descs.get(transport) or [None] * len(local.regions)),
    }
