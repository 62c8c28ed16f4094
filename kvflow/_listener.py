"""The listen socket of one LlmDataDist: accepting control connections (the acceptor's side of the
handshake) and the data connections that transports ask for (``LinkChannel.open_stream``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from typing import Any

from . import _handshake as handshake
from . import _wire as wire
from ._compat import TIMEOUT_ERRORS
from ._compat import timeout as timeout_after
from ._heartbeat import open_control
from ._links import LinkTable
from ._metrics import event
from ._status import LLMException, LLMParamInvalid, LLMStatusCode

log = logging.getLogger("kvflow")

BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
MAX_CONNECTIONS = 4096  # accepted connections not yet sorted or linked; more are reset at once
MAX_HANDSHAKES = 512  # control connections in their handshake at once; more are answered busy
MAX_BUSY_HELLO = 64 << 10  # a hello longer than this is not read before the busy answer
ACCEPTS_PER_WAKEUP = 64
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset: a dialer reads that as "not taken, try again", never as a refusal."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    sock.close()


class Listener:
    """Accepts links for ``table`` on ``address``."""

    def __init__(self, table: LinkTable, address: tuple[str, int]) -> None:
        self._table = table
        self._loop = asyncio.get_running_loop()
        self._handshakes: set[asyncio.Task[Any]] = set()
        self._controls = 0  # of those, control connections past their magic
        self.busy_answers = 0  # control connections answered busy since listening
        self.data_waiters: dict[bytes, asyncio.Future[socket.socket]] = {}
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        srv = socket.socket(family, socket.SOCK_STREAM)
        try:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(address)
            srv.listen(BACKLOG)
            srv.setblocking(False)
        except OSError as exc:
            srv.close()
            raise LLMParamInvalid(f"option llm.ListenIpInfo: cannot listen on {address[0]}:{address[1]}: "
                                  f"{exc.strerror}") from None
        self._sock = srv
        self._loop.add_reader(srv.fileno(), self._accept)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def handshakes(self) -> int:
        """Connections in their handshake now."""
        return len(self._handshakes)

    @property
    def control_handshakes(self) -> int:
        """Of those, control connections past their magic (at MAX_HANDSHAKES, more are answered busy)."""
        return self._controls

    def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for task in list(self._handshakes):
            task.cancel()
        for fut in self.data_waiters.values():
            fut.cancel()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            if len(self._handshakes) >= MAX_CONNECTIONS:  # a flood of connections: reset, do not queue
                log.warning("resetting a connection: %d incoming connections in progress", len(self._handshakes))
                reset(sock)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._serve(sock))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _handshake_timeout(self) -> float:
        return max(1.0, self._table.local.opts.heartbeat_timeout_ms / 1000)

    async def _serve(self, sock: socket.socket) -> None:
        handed_off = False
        try:
            async with timeout_after(self._handshake_timeout()):
                magic = await _recv_exactly(self._loop, sock, wire.MAGIC_SIZE)
                if magic == wire.MAGIC_DATA:
                    token = await _recv_exactly(self._loop, sock, wire.TOKEN_SIZE)
                    fut = self.data_waiters.pop(token, None)
                    if fut is not None and not fut.done():
                        fut.set_result(sock)
                        handed_off = True
                    return
                if magic != wire.MAGIC_CONTROL:
                    return
                if self._controls >= MAX_HANDSHAKES:
                    await self._answer_busy(sock)
                    return
            handed_off = True
            self._controls += 1
            try:
                await self._serve_control(sock)
            finally:
                self._controls -= 1
        except (TimeoutError, OSError, asyncio.IncompleteReadError, LLMException) as exc:
            log.info("incoming connection dropped: %s", exc)
        except Exception:  # whatever a peer sends must not take the listener down
            log.exception("incoming connection dropped")
        finally:
            if not handed_off:
                sock.close()

    async def _answer_busy(self, sock: socket.socket) -> None:
        """Read the hello (so that closing sends no reset), then answer that the listener is busy.

        The answer is a ``reject`` with LLM_LINK_BUSY, before any authentication: it carries no more
        than the bound, and the dialer retries it within its own timeout."""
        (n,) = struct.unpack("<I", await _recv_exactly(self._loop, sock, 4))
        if n > MAX_BUSY_HELLO:
            return
        await _recv_exactly(self._loop, sock, n)
        self.busy_answers += 1
        if self.busy_answers in (1, 100) or self.busy_answers % 10_000 == 0:
            log.warning("listener busy: %d link handshakes in progress; answered %d dialers to retry",
                        MAX_HANDSHAKES, self.busy_answers)
        await self._loop.sock_sendall(sock, wire.pack({
            "t": "reject", "code": int(LLMStatusCode.LLM_LINK_BUSY),
            "msg": f"listener busy: {MAX_HANDSHAKES} link handshakes in progress, retry"}))

    async def _serve_control(self, sock: socket.socket) -> None:
        reader, writer = await open_control(sock)
        table, me = self._table, self._table.local
        session = handshake.Session(reader, writer, me.mac_key)
        token = os.urandom(wire.TOKEN_SIZE)
        waiter: asyncio.Future[socket.socket] = self._loop.create_future()
        self.data_waiters[token] = waiter
        admitted: list[int] = []
        try:
            async with timeout_after(self._handshake_timeout()):
                agreed = await handshake.accept(session, cluster_id=me.cluster_id, instance=me.instance,
                                                transports=me.transports, token=token, waiter=waiter,
                                                heartbeat_ms=me.opts.heartbeat_ms,
                                                admit=lambda peer, expect: table.admit(peer, expect, admitted))
        except TIMEOUT_ERRORS:
            log.info("incoming link handshake timed out")
            session.reject(LLMStatusCode.LLM_LINK_BUSY, f"the link handshake did not complete within the "
                           f"listener's {self._handshake_timeout():.1f} s, retry")
            return
        except LLMException as exc:  # refused (a bad MAC, a protocol error): say why, then hang up
            log.info("incoming link refused: %s", exc)
            session.reject(exc.status_code, str(exc.args[0]))
            return
        except BaseException:
            writer.close()
            raise
        finally:
            for peer in admitted:
                table.linking.discard(peer)
            self.data_waiters.pop(token, None)
        if agreed is None:
            writer.close()
            return
        event("transport_chosen", cluster=me.cluster_id, peer=agreed.peer_cluster, transport=agreed.transport,
              initiator=False, skipped=";".join(f"{k}:{v}" for k, v in agreed.fallbacks.items()) or "-")
        link = table.new_link(agreed, False, reader, writer)
        table.install(link)
        session.send_sealed("ready", {})
        table.start(link, agreed)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), n)
        buf += chunk
    return bytes(buf)
