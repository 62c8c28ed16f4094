"""The heartbeats of every link on an event loop, on one timer.

Each side of a link tells the other its ``kvflow.HeartbeatInterval`` and ``kvflow.HeartbeatTimeout``
in the handshake, and sends a ``ping`` whenever it has sent nothing for the shorter of the two
intervals, so that each side hears from the other at least as often as it asked. Either side
breaks the link once it has heard nothing for its own timeout. A peer that did not say its
settings (an older kvflow) gets a ``pong`` for each of its pings, as before.

One timer per event loop visits each link when its next ping is due (at most a quarter of the
interval late, or of the margin to the shorter timeout if that is smaller). The pings due together
go out together, so that the peer's process wakes once for many of them: an idle link costs one
visit and one ping per interval, a busy one a visit. A link whose timeout could pass before its
next visit gets a timer of its own at that moment, so a silent peer is still detected at its
timeout plus scheduling delay.

A ping that arrives on its own, at a frame boundary, never reaches the link's reader: the control
connection's protocol (:class:`ControlProtocol`) notes when bytes last arrived and drops it.
"""

from __future__ import annotations

import asyncio
import math
import socket
import weakref
from typing import Protocol

from . import _wire as wire

PING = wire.pack({"t": "ping"})
_LEN_SIZE = 4


class Beating(Protocol):
    """What the walker needs of a link (kvflow._link.Link)."""

    heartbeat_grain: float  # how late a visit may come

    def beat(self, now: float) -> float | None:
        """Visit: ping or break as due; when to visit next (None: no more)."""
        ...


class Heartbeats:
    """One timer for the links of one loop. A link is visited when it said it would next need a
    ping; the visits due within one ``grain`` of each other share a callback, and a link whose
    traffic made its ping unneeded is only moved to its new time."""

    def __init__(self) -> None:
        self._slots: dict[float, list[Beating]] = {}  # visit time (a multiple of a grain) -> links
        self._grain = float("inf")
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = float("inf")
        self.visits = 0  # link visits so far

    def __len__(self) -> int:
        return sum(len(links) for links in self._slots.values())

    def add(self, link: Beating, when: float) -> None:
        """Visit ``link`` at ``when`` (or up to one grain later) and then as it says."""
        self._grain = min(self._grain, link.heartbeat_grain)
        self._put(link, when, asyncio.get_running_loop())

    def _put(self, link: Beating, when: float, loop: asyncio.AbstractEventLoop) -> None:
        grain = self._grain
        slot = max(math.ceil(when / grain), math.floor(loop.time() / grain) + 1) * grain  # never now again
        self._slots.setdefault(slot, []).append(link)
        if slot < self._armed_at:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = loop.call_at(slot, self._fire)
            self._armed_at = slot

    def _fire(self) -> None:
        loop = asyncio.get_running_loop()
        self._handle, self._armed_at = None, float("inf")
        now = loop.time()
        for slot in sorted(s for s in self._slots if s <= now):
            for link in self._slots.pop(slot):
                self.visits += 1
                when = link.beat(now)  # may break the link: it then says None
                if when is not None:
                    self._put(link, when, loop)
        if not self._slots:
            self._grain = float("inf")
            return
        first = min(self._slots)
        if first < self._armed_at:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = loop.call_at(first, self._fire)
            self._armed_at = first


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Heartbeats] = weakref.WeakKeyDictionary()


def heartbeats() -> Heartbeats:
    """The walker of the running loop (made on first use)."""
    loop = asyncio.get_running_loop()
    hb = _BY_LOOP.get(loop)
    if hb is None:
        hb = _BY_LOOP[loop] = Heartbeats()  # holds no reference to the loop: the entry goes with it
    return hb


class ControlProtocol(asyncio.StreamReaderProtocol):
    """The protocol of a control connection: what arrives goes to its StreamReader, except, once
    ``drop_pings`` is set, a ping that arrives alone at a frame boundary. ``heard`` is the loop
    time at which the last bytes arrived, whether or not anything has read them yet."""

    def __init__(self, reader: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, loop=loop)
        self._clock = loop.time
        self.heard = loop.time()
        self.drop_pings = False
        self._header = b""  # the part of the next frame's length prefix seen so far
        self._left = 0  # bytes of the current frame's body not seen yet

    def data_received(self, data: bytes) -> None:
        self.heard = self._clock()
        if self.drop_pings and data == PING and not self._left and not self._header:
            return
        self._follow(data)
        super().data_received(data)

    def _follow(self, data: bytes) -> None:
        """Keep track of where frames end in what passes to the reader."""
        i, n = 0, len(data)
        while i < n:
            if self._left:
                step = min(self._left, n - i)
                self._left -= step
                i += step
                continue
            part = data[i:i + _LEN_SIZE - len(self._header)]
            self._header += part
            i += len(part)
            if len(self._header) == _LEN_SIZE:
                self._left = int.from_bytes(self._header, "little")
                self._header = b""


async def open_control(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over a connected control socket, with a :class:`ControlProtocol` under them."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    protocol = ControlProtocol(reader, loop)
    transport, _ = await loop.create_connection(lambda: protocol, sock=sock)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
