"""Parsing ``initialize`` options: LLM-DataDist's ``llm.*`` keys and kvflow's own ``kvflow.*`` keys."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Mapping

from ._status import LLMParamInvalid
from ._workers import DEFAULT_PRIORITY, PRIORITIES

DEFAULT_TRANSPORTS = ("shm", "ucx", "tcp")
#: Heartbeat defaults (ms): the interval is a third of the timeout, at most ``MAX_DEFAULT_INTERVAL_MS``.
#: An idle link sends a ping each way per interval: 1024 idle links cost a listener 2.2 % of a core at
#: 500 ms and 1.6 % at 666 ms; a peer's loop may stall about timeout - 1.25 x interval (1.17 s) before
#: its links break (docs/decisions.md).
HEARTBEAT_TIMEOUT_MS, MAX_DEFAULT_INTERVAL_MS = 2000, 1000


def default_interval_ms(timeout_ms: int) -> int:
    """The heartbeat interval when only the timeout is known: a third of it, 10 ms to 1 s."""
    return max(10, min(MAX_DEFAULT_INTERVAL_MS, timeout_ms // 3))


HEARTBEAT_INTERVAL_MS = default_interval_ms(HEARTBEAT_TIMEOUT_MS)
MIN_KEY_BYTES = 16  # shorter shared secrets are refused: one sniffed handshake must not let them be guessed


@dataclass
class Options:
    """Parsed options; see docs/api.md for each key."""

    listen: tuple[str, int] | None = None
    sync_wait_ms: int = 5000
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    transports_pinned: bool = False
    heartbeat_interval_ms: int = HEARTBEAT_INTERVAL_MS
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS
    auth_key: bytes | None = None
    max_links: int = 1024
    worker_priority: str = DEFAULT_PRIORITY
    transport_options: dict[str, str] = field(default_factory=dict)

    @property
    def heartbeat_ms(self) -> tuple[int, int]:
        """(interval, timeout) of heartbeats in ms, as a link's handshake tells the peer."""
        return self.heartbeat_interval_ms, self.heartbeat_timeout_ms


def _ms(key: str, value: str, lo: int = 1, hi: int = 24 * 3600 * 1000) -> int:
    try:
        ms = int(str(value).strip())
    except ValueError:
        raise LLMParamInvalid(f"option {key}={value!r}: expected an integer number of milliseconds") from None
    if not lo <= ms <= hi:
        raise LLMParamInvalid(f"option {key}={value!r}: must be within {lo}..{hi}")
    return ms


def parse_address(key: str, value: str) -> tuple[str, int]:
    """``"ip:port"`` or ``"[v6]:port"`` -> (ip, port); LLMParamInvalid naming ``key`` otherwise."""
    text = str(value).strip()
    host, sep, port_s = text.rpartition(":")
    if not sep:
        raise LLMParamInvalid(f"option {key}={value!r}: expected ip:port")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        port = int(port_s)
    except ValueError:
        raise LLMParamInvalid(f"option {key}={value!r}: expected a numeric ip:port") from None
    if not 0 <= port <= 65535:
        raise LLMParamInvalid(f"option {key}={value!r}: port out of range")
    return host, port


def option_pairs(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings of a command line's ``--option`` as a dict; ValueError names a bad one."""
    out: dict[str, str] = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {kv!r}: expected KEY=VALUE")
        out[key] = value
    return out


def parse_options(options: Mapping[str, Any] | None) -> Options:
    """Check every key and value; unknown or malformed ones raise LLMParamInvalid naming the key."""
    opts = Options()
    if options is None:
        return opts
    if not isinstance(options, Mapping):
        raise LLMParamInvalid(f"options must be a mapping of str to str, got {type(options).__name__}")
    for key, value in options.items():
        if not isinstance(key, str):
            raise LLMParamInvalid(f"option key {key!r} is not a string")
        if key == "llm.ListenIpInfo":
            opts.listen = parse_address(key, value)
        elif key == "llm.SyncKvCacheWaitTime":
            opts.sync_wait_ms = _ms(key, value)
        elif key == "llm.DeviceId":
            try:
                int(str(value))
            except ValueError:
                raise LLMParamInvalid(f"option {key}={value!r}: expected an integer") from None
        elif key == "kvflow.Transports":
            names = tuple(n.strip() for n in str(value).split(",") if n.strip())
            if not names or any(not n.isidentifier() for n in names) or len(set(names)) != len(names):
                raise LLMParamInvalid(f"option {key}={value!r}: expected a comma list of transport names")
            opts.transports = names
            opts.transports_pinned = True
        elif key == "kvflow.HeartbeatInterval":
            opts.heartbeat_interval_ms = _ms(key, value, 10, 60_000)
        elif key == "kvflow.HeartbeatTimeout":
            opts.heartbeat_timeout_ms = _ms(key, value, 50, 600_000)
        elif key == "kvflow.AuthKey":
            secret = str(value).encode()
            if len(secret) < MIN_KEY_BYTES:
                raise LLMParamInvalid(f"option {key}: the shared secret must be at least {MIN_KEY_BYTES} bytes "
                                      "(use a random one, e.g. secrets.token_urlsafe(32))")
            opts.auth_key = secret
        elif key == "kvflow.MaxLinks":
            opts.max_links = _ms(key, value, 1, 65536)
        elif key == "kvflow.WorkerPriority":
            if str(value) not in PRIORITIES:
                raise LLMParamInvalid(f"option {key}={value!r}: expected one of {', '.join(PRIORITIES)}")
            opts.worker_priority = str(value)
        elif key.startswith("kvflow.") and key.count(".") >= 2:
            opts.transport_options[key] = str(value)  # kvflow.<transport>.<key>: the transport's own
        else:
            raise LLMParamInvalid(f"unknown option {key!r}")
    if "kvflow.HeartbeatInterval" not in options:  # three pings per timeout
        opts.heartbeat_interval_ms = default_interval_ms(opts.heartbeat_timeout_ms)
    if opts.heartbeat_timeout_ms <= opts.heartbeat_interval_ms:
        raise LLMParamInvalid("option kvflow.HeartbeatTimeout must exceed kvflow.HeartbeatInterval")
    return opts


def check_transport_keys(name: str, known: frozenset[str] | None, options: Mapping[str, str]) -> None:
    """LLMParamInvalid for a ``kvflow.<name>.<key>`` option whose key is not in ``known`` (``None``:
    the transport checks its own)."""
    if known is None:
        return
    prefix = f"kvflow.{name}."
    for key in sorted(options):
        if key.startswith(prefix) and key[len(prefix):] not in known:
            reads = ", ".join(prefix + k for k in sorted(known)) or "no options"
            raise LLMParamInvalid(f"unknown option {key!r}: the {name} transport reads {reads}")
