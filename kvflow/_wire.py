"""Control-plane framing: a connection starts with an 8-byte magic, then length-prefixed msgpack maps."""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Mapping

import msgpack

from ._status import LLMLinkFailed

PROTOCOL_VERSION = 2  # 2: sealed handshake (kvflow._handshake)
MAGIC_CONTROL = b"KVFLOW\x01C"
MAGIC_DATA = b"KVFLOW\x01D"
MAGIC_SIZE = 8
TOKEN_SIZE = 16
MAX_FRAME = 1 << 20  # a control frame; cache descriptions of thousands of tensors fit
_LEN = struct.Struct("<I")


class ProtocolError(LLMLinkFailed):
    """The peer sent something that breaks the protocol; the link is closed."""


def pack(msg: dict[str, Any]) -> bytes:
    """One frame: length prefix and msgpack body."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def unpack_map(body: bytes) -> dict[str, Any]:
    """Decode a msgpack map with string keys; ProtocolError otherwise."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types on garbage
        raise ProtocolError(f"undecodable control frame: {exc.__class__.__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("control frame is not a map")
    return msg


def unpack(body: bytes) -> dict[str, Any]:
    """Decode one frame body; anything but a map with a string ``t`` is a ProtocolError."""
    msg = unpack_map(body)
    if not isinstance(msg.get("t"), str):
        raise ProtocolError("control frame is not a map with a type")
    return msg


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """Read one frame; ProtocolError on an oversized or malformed one, IncompleteReadError at EOF."""
    return (await read_frame_raw(reader))[0]


async def read_frame_raw(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """``read_frame``, with the frame's body as received (for the handshake transcript)."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"control frame of {n} bytes exceeds {MAX_FRAME}")
    body = await reader.readexactly(n)
    return unpack(body), body


def field(msg: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``msg[name]`` if present and of ``kind``, else ProtocolError."""
    value = msg.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"control frame {msg.get('t')!r}: field {name!r} missing or malformed")
    return value
