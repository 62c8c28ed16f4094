"""The link handshake: mutual authentication, then transport negotiation, over the control connection.

Message order (initiator ``C``, acceptor ``S``); ``[...]`` only with ``kvflow.AuthKey``. A listener
at its bound of handshakes answers the hello with a ``reject`` of code LLM_LINK_BUSY instead (see
``first_answer``); the dialer then tries again within its timeout::

    C -> S  hello      version, cluster ids, instance, nonce, transport *names* only
    [S -> C challenge  nonce]
    [C -> S auth       MAC over the transcript so far]
    S -> C  welcome    sealed: cluster, instance, data token, the offered transports' descriptions,
                       its heartbeat interval and timeout
    C -> S  choose     sealed: one transport, this side's description of it, its heartbeat settings
    S -> C  accept     sealed (or ``retry`` with a reason: C then chooses the next transport)
    S -> C  ready      sealed, once both sides connected the chosen transport

Nothing transport-specific leaves a side before the other proved the key: the acceptor's
descriptions go out only after ``auth`` checked, the initiator's only after the welcome's MAC
checked. Every sealed message carries an HMAC over the running SHA-256 of every frame before
it plus its own body, so nothing of the hello, the welcome, the choice or the token can be
changed on the way without the next check failing. Without a key the same messages flow,
unsealed: see docs/security.md for what that exposes.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack

from . import _wire as wire
from ._link import StreamChannel
from ._status import LLMException, LLMLinkBusy, LLMLinkFailed, LLMStatusCode, error_for
from .transport import Endpoint, Transport

log = logging.getLogger("kvflow.link")

NONCE_SIZE = 32
MAX_TRANSPORTS = 16  # names in a hello; more is a protocol error
MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS = 10, 600_000  # a peer's heartbeat settings outside these are ignored
_KDF_SALT = b"kvflow-auth-v2"
_KDF_ROUNDS = 100_000


@functools.lru_cache(maxsize=8)
def derive_key(secret: bytes) -> bytes:
    """The MAC key for a shared secret: PBKDF2-SHA256, so that an offline guess costs ~20 ms."""
    return hashlib.pbkdf2_hmac("sha256", secret, _KDF_SALT, _KDF_ROUNDS)


class Transcript:
    """The running hash of every control frame body sent and received during one handshake."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(b"kvflow-handshake-v2")

    def add(self, body: bytes) -> None:
        self._h.update(len(body).to_bytes(4, "little"))
        self._h.update(body)

    def digest(self) -> bytes:
        return self._h.copy().digest()


@dataclass
class Session:
    """One side of a handshake: the connection, the transcript and the key."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    key: bytes | None  # derived MAC key, or None without kvflow.AuthKey
    transcript: Transcript = field(default_factory=Transcript)
    received: int = 0  # frames received so far

    def send(self, msg: dict[str, Any]) -> None:
        frame = wire.pack(msg)
        self.transcript.add(frame[4:])
        self.writer.write(frame)

    async def recv(self) -> dict[str, Any]:
        msg, body = await wire.read_frame_raw(self.reader)
        self.transcript.add(body)
        self.received += 1
        return msg

    def mac(self, label: bytes, body: bytes = b"") -> bytes:
        assert self.key is not None
        return hmac.new(self.key, label + self.transcript.digest() + body, "sha256").digest()

    def send_sealed(self, t: str, inner: dict[str, Any]) -> None:
        """Send ``inner`` as message ``t``, MACed over the transcript so far and its own bytes."""
        body = msgpack.packb(inner, use_bin_type=True)
        msg: dict[str, Any] = {"t": t, "m": body}
        if self.key is not None:
            msg["mac"] = self.mac(t.encode(), body)
        self.send(msg)

    async def recv_sealed(self, *expected: str) -> tuple[str, dict[str, Any]]:
        """The next message, which must be one of ``expected`` (sealed) or ``reject``."""
        before = self.transcript.digest()
        return self.open_sealed(await self.recv(), before, *expected)

    def open_sealed(self, msg: dict[str, Any], before: bytes, *expected: str) -> tuple[str, dict[str, Any]]:
        """Check and unwrap a sealed message received when the transcript's digest was ``before``."""
        t = msg["t"]
        if t == "reject":
            raise rejected(msg)
        if t not in expected:
            raise wire.ProtocolError(f"expected {' or '.join(expected)}, got {t!r}")
        body = wire.field(msg, "m", bytes)
        if self.key is not None:
            mac = msg.get("mac")
            want = hmac.new(self.key, t.encode() + before + body, "sha256").digest()
            if not isinstance(mac, bytes) or not hmac.compare_digest(mac, want):
                raise LLMLinkFailed(f"the peer's {t!r} failed authentication (another or no kvflow.AuthKey, "
                                    "or the handshake was altered on the way)")
        return t, wire.unpack_map(body)

    def binding(self) -> bytes:
        """A per-link value only the two ends know (with a key): transports bind side channels to it."""
        return hmac.new(self.key or b"", b"bind" + self.transcript.digest(), "sha256").digest()

    def reject(self, code: LLMStatusCode, message: str) -> None:
        self.writer.write(wire.pack({"t": "reject", "code": int(code), "msg": message[:500]}))
        self.writer.close()


class ListenerBusy(LLMLinkBusy):
    """The listener did not take our hello: it answered busy (``explicit``), or reset the connection
    before answering. Nothing was agreed; the dialer may try again."""

    def __init__(self, message: str = "", status_code: LLMStatusCode | None = None, *,
                 explicit: bool = False) -> None:
        super().__init__(message, status_code)
        self.explicit = explicit


async def first_answer(session: Session) -> dict[str, Any]:
    """The listener's answer to our hello; ListenerBusy if it answered busy or reset the connection."""
    try:
        msg = await session.recv()
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        raise ListenerBusy("the listener reset the connection before answering the hello") from None
    code = msg.get("code")
    if msg["t"] == "reject" and isinstance(code, int) and code == LLMStatusCode.LLM_LINK_BUSY:
        raise ListenerBusy(str(msg.get("msg", ""))[:200] or "listener busy", explicit=True)
    return msg


def rejected(msg: Mapping[str, Any]) -> LLMException:
    """The typed error for a peer's ``reject`` frame (a refusal never claims success)."""
    code = msg.get("code")
    status = LLMStatusCode.of(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if status is None or status == LLMStatusCode.LLM_SUCCESS:
        status = LLMStatusCode.LLM_LINK_FAILED
    return error_for(int(status), str(msg.get("msg", ""))[:500] or status.name)


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


@dataclass
class Agreed:
    """What a completed handshake leaves: the peer, the chosen transport and its open endpoint."""

    peer_cluster: int
    peer_instance: str
    transport: str
    endpoint: Endpoint
    channel: StreamChannel
    fallbacks: dict[str, str]
    peer_heartbeat: tuple[float, float] | None = None  # its (interval, timeout) in s; None: not said (wants pongs)


def _descriptions(msg: Mapping[str, Any], key: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for entry in wire.field(msg, key, list)[:MAX_TRANSPORTS]:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], dict)):
            raise wire.ProtocolError(f"malformed transport entry in {key!r}")
        out.append((entry[0], entry[1]))
    return out


def heartbeat_settings(msg: Mapping[str, Any]) -> tuple[float, float] | None:
    """The peer's heartbeat (interval, timeout) in seconds from its welcome or choice, if it says them."""
    hb = msg.get("hb")
    if not (isinstance(hb, list) and len(hb) == 2 and all(type(ms) is int for ms in hb)):
        return None
    interval, timeout = hb
    if not MIN_HEARTBEAT_MS <= interval < timeout <= MAX_HEARTBEAT_MS:
        return None
    return interval / 1000, timeout / 1000


async def dial(session: Session, *, cluster_id: int, expect: int, instance: str,
               transports: Mapping[str, Transport], unavailable: Mapping[str, str],
               address: tuple[str, int], heartbeat_ms: tuple[int, int]) -> Agreed:
    """The initiator's side of the handshake, on a fresh control connection to ``address``.

    On failure the caller closes the connection; an endpoint already opened is closed here."""
    session.writer.write(wire.MAGIC_CONTROL)
    cnonce = new_nonce()
    session.send({"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": cluster_id, "expect": expect,
                  "instance": instance, "auth": session.key is not None, "cnonce": cnonce,
                  "transports": list(transports)})
    before = session.transcript.digest()
    msg = await first_answer(session)
    if msg["t"] == "challenge":
        if session.key is None:
            raise LLMLinkFailed(f"cluster {expect} requires authentication: set the same kvflow.AuthKey "
                                "on both sides")
        wire.field(msg, "nonce", bytes)
        session.send({"t": "auth", "mac": session.mac(b"auth")})
        _, welcome = await session.recv_sealed("welcome")
    elif msg["t"] == "welcome" and session.key is not None and "mac" not in msg:
        raise LLMLinkFailed(f"cluster {expect} did not authenticate (it has no kvflow.AuthKey)")
    else:
        _, welcome = session.open_sealed(msg, before, "welcome")
    if welcome.get("v") != wire.PROTOCOL_VERSION:
        raise LLMLinkFailed(f"protocol version mismatch: peer speaks {welcome.get('v')!r}, "
                            f"we speak {wire.PROTOCOL_VERSION}")
    peer = wire.field(welcome, "cluster", int)
    if peer != expect:
        raise LLMLinkFailed(f"peer at {address[0]}:{address[1]} is cluster {peer}, not {expect}")
    token = wire.field(welcome, "token", bytes)
    if len(token) != wire.TOKEN_SIZE:
        raise wire.ProtocolError("malformed data token in welcome")
    peer_instance = str(wire.field(welcome, "instance", str))[:64]
    offered = dict(_descriptions(welcome, "offer"))
    fallbacks = dict(unavailable)
    for name, t in transports.items():
        info = offered.get(name)
        if info is None:
            fallbacks[name] = "the peer does not offer it"
            continue
        reason = t.check_peer(info)
        if reason is not None:
            fallbacks[name] = reason
            continue
        session.send_sealed("choose", {"transport": name, "info": t.describe(), "hb": list(heartbeat_ms)})
        kind, answer = await session.recv_sealed("accept", "retry")
        if kind == "retry":
            fallbacks[name] = f"the peer cannot use it: {str(answer.get('why', '?'))[:200]}"
            continue
        channel = StreamChannel(True, expect, token, address=address, binding=session.binding())
        try:
            endpoint: Endpoint | None = await t.connect(info, channel)
            session.send_sealed("connected", {"ok": True})
        except LLMException as exc:  # this transport cannot reach the peer after all: tell it, go on
            endpoint = None
            fallbacks[name] = str(exc.args[0])[:200]
            session.send_sealed("connected", {"ok": False, "why": fallbacks[name]})
        try:
            kind, answer = await session.recv_sealed("ready", "retry")
        except BaseException:
            if endpoint is not None:
                endpoint.abort(LLMLinkFailed(f"link to cluster {expect} was not completed"))
                await close_quietly(endpoint)
            raise
        if kind == "retry":
            if endpoint is not None:
                fallbacks[name] = f"the peer could not connect it: {str(answer.get('why', '?'))[:200]}"
                endpoint.abort(LLMLinkFailed("transport not used"))
                await close_quietly(endpoint)
            continue
        if endpoint is None:
            raise wire.ProtocolError("peer reported ready for a transport that failed here")
        return Agreed(peer, peer_instance, name, endpoint, channel, fallbacks, heartbeat_settings(welcome))
    session.send_sealed("choose", {"transport": None})
    raise LLMLinkFailed(f"no transport both sides can use ({fallbacks})")



Admit = Callable[[int, int], "tuple[LLMStatusCode, str] | None"]


async def accept(session: Session, *, cluster_id: int, instance: str, transports: Mapping[str, Transport],
                 admit: Admit, token: bytes, waiter: asyncio.Future[socket.socket],
                 heartbeat_ms: tuple[int, int]) -> Agreed | None:
    """The acceptor's side of the handshake (after the control magic). ``admit(peer, expect)`` says
    why a peer may not link, or None. Returns None when the peer was refused or gave up; the caller
    then closes the connection, and sends the sealed ``ready`` once it installed the link."""
    hello = await session.recv()
    if hello["t"] != "hello":
        raise wire.ProtocolError(f"expected hello, got {hello['t']!r}")
    if hello.get("v") != wire.PROTOCOL_VERSION:
        session.reject(LLMStatusCode.LLM_LINK_FAILED, f"protocol version mismatch: we speak "
                       f"{wire.PROTOCOL_VERSION}, you speak {hello.get('v')!r}")
        return None
    if session.key is not None:
        session.send({"t": "challenge", "nonce": new_nonce()})
        want = session.mac(b"auth")
        answer = await session.recv()
        mac = answer.get("mac") if answer["t"] == "auth" else None
        if not (isinstance(mac, bytes) and hmac.compare_digest(mac, want)):
            log.warning("rejected a link attempt that failed authentication")
            session.reject(LLMStatusCode.LLM_LINK_FAILED, "authentication failed")
            return None
    peer = wire.field(hello, "cluster", int)
    refusal = admit(peer, wire.field(hello, "expect", int))
    if refusal is not None:
        session.reject(*refusal)
        return None
    peer_instance = str(wire.field(hello, "instance", str))[:64]
    names = wire.field(hello, "transports", list)
    if len(names) > MAX_TRANSPORTS or not all(isinstance(n, str) for n in names):
        raise wire.ProtocolError("malformed transport list in hello")
    offer = [[n, transports[n].describe()] for n in dict.fromkeys(names) if n in transports]
    session.send_sealed("welcome", {"v": wire.PROTOCOL_VERSION, "cluster": cluster_id, "instance": instance,
                                    "token": token, "offer": offer, "hb": list(heartbeat_ms)})
    refused: dict[str, str] = {}
    for _ in range(len(offer) + 1):
        _, choice = await session.recv_sealed("choose")
        name = choice.get("transport")
        if name is None:
            return None
        if not isinstance(name, str) or name not in transports or name not in names or name in refused:
            raise wire.ProtocolError(f"peer chose a transport we did not offer: {name!r}")
        info = wire.field(choice, "info", dict)
        t = transports[name]
        try:
            reason = t.check_peer(info)
        except Exception as exc:  # a malformed description from the peer
            reason = f"unusable peer description ({type(exc).__name__})"
        if reason is not None:
            refused[name] = str(reason)
            session.send_sealed("retry", {"why": str(reason)[:200]})
            continue
        session.send_sealed("accept", {})
        channel = StreamChannel(False, peer, token, waiter=waiter, binding=session.binding())
        endpoint, why = await _connect_beside(session, t, info, channel)
        if endpoint is None:
            refused[name] = why
            session.send_sealed("retry", {"why": why[:200]})
            continue
        return Agreed(peer, peer_instance, name, endpoint, channel, refused, heartbeat_settings(choice))
    raise wire.ProtocolError("too many transport choices")


async def _connect_beside(session: Session, t: Transport, info: Mapping[str, Any],
                          channel: StreamChannel) -> tuple[Endpoint | None, str]:
    """The acceptor's connect, run beside the initiator's ``connected`` report: the endpoint if both
    sides connected, else None and why (an endpoint opened here is then closed)."""
    connecting = asyncio.ensure_future(t.connect(info, channel))
    report = asyncio.ensure_future(session.recv_sealed("connected"))
    try:
        await asyncio.wait((connecting, report), return_when=asyncio.FIRST_COMPLETED)
        if report.done() and not connecting.done() and not report.exception():
            if not report.result()[1].get("ok"):  # the initiator failed: ours would wait in vain
                connecting.cancel()
        await asyncio.wait((connecting, report))
    except BaseException:
        connecting.cancel()
        report.cancel()
        raise
    if report.cancelled() or report.exception() is not None:  # the handshake ends: drop what we opened
        if not connecting.cancelled() and connecting.exception() is None:
            opened = connecting.result()
            opened.abort(LLMLinkFailed("link not completed"))
            await close_quietly(opened)
    _, rep = report.result()  # re-raises the protocol error or the closed connection
    endpoint: Endpoint | None = None
    why = ""
    if connecting.cancelled():
        why = "not connected"
    elif (exc := connecting.exception()) is not None:
        if not isinstance(exc, LLMException):
            log.warning("link from cluster %d: %s connect failed: %r", channel.peer_cluster_id, t.name, exc)
        why = str(exc.args[0]) if isinstance(exc, LLMException) else f"{t.name} connect failed"
    else:
        endpoint = connecting.result()
    if not rep.get("ok"):
        why = f"the peer could not connect it: {str(rep.get('why', '?'))[:200]}"
        if endpoint is not None:
            endpoint.abort(LLMLinkFailed("transport not used"))
            await close_quietly(endpoint)
            endpoint = None
    return endpoint, why


async def close_quietly(endpoint: Endpoint) -> None:
    """Close an endpoint whose link was never made; errors are only logged."""
    try:
        await endpoint.close()
    except Exception:
        log.debug("closing endpoint failed", exc_info=True)
