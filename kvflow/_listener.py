"""The listen socket of one LlmDataDist: accepting control connections (the acceptor's side of the
handshake) and the data connections that transports ask for (``LinkChannel.open_stream``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from . import _handshake as handshake
from . import _wire as wire
from ._compat import TIMEOUT_ERRORS
from ._compat import timeout as timeout_after
from ._links import LinkTable
from ._metrics import event
from ._status import LLMException, LLMParamInvalid

log = logging.getLogger("kvflow")

MAX_HANDSHAKES = 512  # incoming connections in their handshake at once; more are refused
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn


class Listener:
    """Accepts links for ``table`` on ``address``."""

    def __init__(self, table: LinkTable, address: tuple[str, int]) -> None:
        self._table = table
        self._loop = asyncio.get_running_loop()
        self._handshakes: set[asyncio.Task[Any]] = set()
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

    def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for task in list(self._handshakes):
            task.cancel()
        for fut in self.data_waiters.values():
            fut.cancel()

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            if len(self._handshakes) >= MAX_HANDSHAKES:  # a flood of connections: refuse, do not queue
                log.warning("refusing a connection: %d handshakes in progress", len(self._handshakes))
                sock.close()
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
            handed_off = True
            await self._serve_control(sock)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, LLMException) as exc:
            log.info("incoming connection dropped: %s", exc)
        except Exception:  # whatever a peer sends must not take the listener down
            log.exception("incoming connection dropped")
        finally:
            if not handed_off:
                sock.close()

    async def _serve_control(self, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
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
                                                admit=lambda peer, expect: table.admit(peer, expect, admitted))
        except TIMEOUT_ERRORS:
            log.info("incoming link handshake timed out")
            writer.close()
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
