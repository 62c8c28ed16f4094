"""Notifications: small messages between linked clusters, over the link's control channel.

``send_notification(cluster_id, payload)`` hands ``payload`` (bytes) to the peer, which keeps it
until its application calls ``get_notifications()``. It is the side channel that a transfer needs
around it ("the blocks of request R are yours now", "you may free R"), carried by the link that
was authenticated in the handshake rather than by a second, unauthenticated socket. The sender's
call returns once the peer has queued the message, in order with its other notifications.

Bounded on the receiving side: a payload is at most :data:`MAX_PAYLOAD` bytes, and a process
keeps at most :data:`MAX_QUEUED` messages or :data:`MAX_QUEUED_BYTES` bytes that its application
has not taken; beyond either, a sender gets ``LLMLinkBusy`` (retryable) and nothing is queued.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from . import _wire as wire
from ._status import LLMLinkBusy, LLMParamInvalid

MAX_PAYLOAD = 64 * 1024
MAX_QUEUED = 65536
MAX_QUEUED_BYTES = 64 * 1024 * 1024


def check_payload(payload: Any) -> bytes:
    """``payload`` as bytes if it is bytes-like and at most MAX_PAYLOAD long, else LLMParamInvalid."""
    if isinstance(payload, (bytearray, memoryview)):
        payload = bytes(payload)
    if not isinstance(payload, bytes):
        raise LLMParamInvalid(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD:
        raise LLMParamInvalid(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return payload


class Inbox:
    """The notifications that peers sent and the application has not taken yet.

    Filled on the loop thread, drained from any thread (``kvflow.sync`` callers): a lock keeps the
    byte count true."""

    def __init__(self) -> None:
        self._items: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def answer(self, cluster_id: int, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Queue a peer's ``{"op": "note", "payload": b}``; LLMLinkBusy when full."""
        payload = wire.field(msg, "payload", bytes)
        if len(payload) > MAX_PAYLOAD:
            raise wire.ProtocolError(f"notification of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        with self._lock:
            if len(self._items) >= MAX_QUEUED or self._bytes + len(payload) > MAX_QUEUED_BYTES:
                raise LLMLinkBusy(f"notification inbox full ({len(self._items)} messages, {self._bytes} "
                                  "bytes not yet taken by the application)")
            self._items.append((cluster_id, payload))
            self._bytes += len(payload)
        return {}

    def take(self) -> list[tuple[int, bytes]]:
        """Every queued (cluster id, payload), oldest first; the inbox is then empty."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._bytes = 0
        return items
