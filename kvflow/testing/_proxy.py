"""A fault-injecting TCP proxy for reliability tests: put it between two peers, then break things.

::

    async with FaultProxy(("127.0.0.1", peer_port)) as proxy:
        await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*proxy.address)])])
        proxy.stall()                 # stop forwarding (both ways, every connection)
        proxy.resume()                # forward again; what was held back flows on
        proxy.truncate(4096)          # forward 4096 more bytes per direction, then cut
        proxy.drop()                  # cut every connection now (RST with ``reset=True``)

Every mode applies to the connections selected by ``conns`` (indices in accept order,
``None`` = all current and future ones) and the direction ``"up"`` (client to server),
``"down"`` (server to client) or ``"both"``. A link of kvflow's opens its control
connection first and its data connection second, so for a single link index 0 is
control and index 1 is data (``proxy.connections[i].index``).

The proxy holds at most one chunk (``chunk`` bytes) per direction per connection: while it
stalls it stops reading, so the sender's socket buffers fill and TCP pushes back. Its own
sockets' receive buffers are fixed at ``rcvbuf`` bytes (the kernel doubles the figure), so
what a stalled direction absorbs stays bounded: loopback's autotuning would otherwise grow
them to ``net.ipv4.tcp_rmem``'s maximum (32 MiB here) and swallow a whole transfer. A close
(FIN) that reaches a stalled direction is held too, as a cut cable would: a stalled peer that
gives up on the link is noticed by heartbeats, not by its close.
Connections are bounded by ``max_connections``; beyond that new ones are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("kvflow.testing.proxy")

__all__ = ["FaultProxy", "ProxyConnection"]

_PASS, _STALL, _CLOSE = "pass", "stall", "close"


class _Pump:
    """One direction of one connection: read a chunk, pass the gate, write it on."""

    def __init__(self, conn: ProxyConnection, direction: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.conn = conn
        self.direction = direction
        self.reader = reader
        self.writer = writer
        self.forwarded = 0
        self.action = _PASS  # what happens once ``budget`` is spent
        self.budget: int | None = None  # bytes still forwarded before ``action``; None: no limit
        self.changed = asyncio.Event()

    def set(self, action: str, budget: int | None) -> None:
        self.action = action
        self.budget = budget
        self.changed.set()

    async def run(self, chunk: int) -> None:
        try:
            while True:
                await self._gate()
                data = await self.reader.read(chunk)
                if not data:
                    await self._gate()  # a stalled direction holds the sender's close too
                    break
                while data:
                    await self._gate()
                    n = len(data) if self.budget is None else min(len(data), self.budget)
                    if n:
                        self.writer.write(data[:n])
                        self.forwarded += n
                        self.conn.proxy.forwarded[self.direction] += n
                        if self.budget is not None:
                            self.budget -= n
                        data = data[n:]
                        await self.writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.conn.close(reset=False)

    async def _gate(self) -> None:
        """Return when the next byte may be forwarded; closes the connection for a spent ``close``."""
        while self.budget is not None and self.budget <= 0:
            if self.action == _CLOSE:
                self.conn.close(reset=self.conn.proxy.reset)
                raise ConnectionError("cut by the proxy")
            if self.action == _PASS:
                self.budget = None
                break
            self.changed.clear()
            await self.changed.wait()  # stalled until the mode changes


class ProxyConnection:
    """One client connection through the proxy and its two pumps."""

    def __init__(self, proxy: FaultProxy, index: int, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 server: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.proxy = proxy
        self.index = index
        self._writers = (client[1], server[1])
        self.up = _Pump(self, "up", client[0], server[1])
        self.down = _Pump(self, "down", server[0], client[1])
        self.closed = False
        self.tasks: list[asyncio.Task[None]] = []

    def pumps(self, direction: str) -> list[_Pump]:
        return {"up": [self.up], "down": [self.down], "both": [self.up, self.down]}[direction]

    def close(self, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self._writers:
            transport = w.transport
            if reset:
                sock = transport.get_extra_info("socket")
                if sock is not None:  # RST instead of FIN
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            else:
                transport.close()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.proxy._conns.discard(self)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``target`` whose forwarding can be stalled, truncated or cut.

    Use as ``async with FaultProxy(target) as proxy`` (or ``await start()`` / ``await close()``)."""

    def __init__(self, target: tuple[str, int], *, host: str = "127.0.0.1", chunk: int = 64 << 10,
                 max_connections: int = 256, connect_timeout: float = 5.0, rcvbuf: int | None = 256 << 10) -> None:
        self.target = (target[0], int(target[1]))
        self.rcvbuf = rcvbuf
        self.host = host
        self.chunk = chunk
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.connections: list[ProxyConnection] = []  # every connection ever accepted, by index
        self.forwarded = {"up": 0, "down": 0}
        self.refused = 0
        self.reset = False
        self._conns: set[ProxyConnection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._default: tuple[str, int | None, str, Callable[[int], bool] | None] = (_PASS, None, "both", None)
        self._handlers: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> FaultProxy:
        sock = socket.create_server((self.host, 0))  # accepted sockets inherit the buffer set here
        try:
            self._fix_rcvbuf(sock)
            self._server = await asyncio.start_server(self._accept, sock=sock)
        except BaseException:
            sock.close()
            raise
        return self

    def _fix_rcvbuf(self, sock: socket.socket) -> None:
        if self.rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)

    async def _connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket(socket.AF_INET6 if ":" in self.target[0] else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            self._fix_rcvbuf(sock)  # before connect, so the window scale fits it
            await asyncio.get_running_loop().sock_connect(sock, self.target)
            return await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "start the proxy first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for c in list(self._conns):
            c.close(reset=True)
        pumps = [t for c in self.connections for t in c.tasks]
        for t in pumps:
            t.cancel()
        waiting = pumps + list(self._handlers)
        if waiting:
            await asyncio.wait(waiting, timeout=2.0)
        for t in list(self._handlers):  # still connecting upstream
            t.cancel()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def live(self) -> list[ProxyConnection]:
        """Connections still open, in accept order."""
        return [c for c in self.connections if not c.closed]

    # ------------------------------------------------------------------ faults
    def _apply(self, action: str, budget: int | None, direction: str, conns: Iterable[int] | None,
               future: bool) -> None:
        if direction not in ("up", "down", "both"):
            raise ValueError(f"direction must be up, down or both, not {direction!r}")
        chosen = None if conns is None else set(conns)
        for c in self.connections:
            if not c.closed and (chosen is None or c.index in chosen):
                for p in c.pumps(direction):
                    p.set(action, budget)
        if future:
            pred = None if chosen is None else chosen.__contains__
            self._default = (action, budget, direction, pred)

    def resume(self, *, conns: Iterable[int] | None = None) -> None:
        """Forward everything again (held-back bytes flow on); new connections pass."""
        self._apply(_PASS, None, "both", conns, future=conns is None)

    def stall(self, after: int = 0, *, direction: str = "both", conns: Iterable[int] | None = None) -> None:
        """Forward ``after`` more bytes per direction, then stop forwarding (the connection stays open)."""
        self._apply(_STALL, after, direction, conns, future=conns is None)

    def truncate(self, after: int, *, direction: str = "both", conns: Iterable[int] | None = None,
                 reset: bool = False) -> None:
        """Forward ``after`` more bytes per direction, then cut the connection."""
        self.reset = reset
        self._apply(_CLOSE, after, direction, conns, future=conns is None)

    def drop(self, *, conns: Iterable[int] | None = None, reset: bool = False, refuse_new: bool = False) -> None:
        """Cut the selected connections now; with ``refuse_new`` later ones are cut as they arrive
        (until ``resume``)."""
        chosen = None if conns is None else set(conns)
        for c in list(self._conns):
            if chosen is None or c.index in chosen:
                c.close(reset=reset)
        if refuse_new:
            self.reset = reset
            self._default = (_CLOSE, 0, "both", None)

    # ------------------------------------------------------------------ forwarding
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:  # closing the proxy; asyncio would log it from this callback
            writer.transport.abort()
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._conns) >= self.max_connections:
            self.refused += 1
            writer.transport.abort()
            return
        action, budget, direction, pred = self._default
        index = len(self.connections)
        if action == _CLOSE and budget == 0 and pred is None:
            self.connections.append(_closed_placeholder(self, index))
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up = await asyncio.wait_for(self._connect_upstream(), self.connect_timeout)
        except (TimeoutError, OSError):
            writer.transport.abort()
            return
        conn = ProxyConnection(self, index, (reader, writer), up)
        self.connections.append(conn)
        self._conns.add(conn)
        if action != _PASS and (pred is None or pred(index)):
            for p in conn.pumps(direction):
                p.set(action, budget)
        conn.tasks = [asyncio.ensure_future(conn.up.run(self.chunk)), asyncio.ensure_future(conn.down.run(self.chunk))]
        await asyncio.gather(*conn.tasks, return_exceptions=True)


def _closed_placeholder(proxy: FaultProxy, index: int) -> ProxyConnection:
    """A connection slot for one refused at accept (keeps indices in accept order)."""
    conn = ProxyConnection.__new__(ProxyConnection)
    conn.proxy = proxy
    conn.index = index
    conn.closed = True
    conn.tasks = []
    conn._writers = ()  # type: ignore[assignment]
    return conn
