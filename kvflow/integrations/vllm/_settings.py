"""The connector's settings (``kv_connector_extra_config``), the messages its workers exchange, and
the metadata that its scheduler side hands to its worker side each step."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvflow import LLMParamInvalid

#: The key under which every worker registers its KV cache; peers resolve it to the cache's id.
CACHE_KEY = 0x6B76666C6F77  # "kvflow"
MODES = ("pull", "push")
LOADS = ("async", "layer")
MAX_TP = 64  # ranks per engine: a rank's cluster id is the engine's base id + its rank


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked. See docs/vllm.md for each key."""

    host: str = "127.0.0.1"
    port: int = 0  # base port: rank r listens on port + r; 0 = no listener (a consumer that only dials)
    cluster_id: int = 0  # base cluster id: rank r is cluster_id + r
    mode: str = "pull"  # pull-on-decode, or layer-wise push from the prefill
    load: str = "async"  # decode side: load between steps, or layer by layer inside the step
    transport: str = "auto"
    release_timeout_s: float = 120.0  # prefill side: free a finished request's blocks after this long
    load_timeout_ms: int = 30_000  # decode side: a pull (or the pushes it waits for) fails after this long
    options: dict[str, str] = field(default_factory=dict)  # more kvflow options, passed to initialize

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, engine_id: str) -> Settings:
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise LLMParamInvalid(f"kvflow connector: unknown kv_connector_extra_config keys {unknown}; "
                                  f"known: {sorted(known)}")
        s = cls(**extra)
        if s.mode not in MODES:
            raise LLMParamInvalid(f"kvflow connector: mode must be one of {MODES}, got {s.mode!r}")
        if s.load not in LOADS:
            raise LLMParamInvalid(f"kvflow connector: load must be one of {LOADS}, got {s.load!r}")
        if s.transport not in ("auto", "tcp", "shm", "ucx"):
            raise LLMParamInvalid(f"kvflow connector: transport must be auto, tcp, shm or ucx, got {s.transport!r}")
        if not isinstance(s.port, int) or not 0 <= s.port <= 65535 - MAX_TP:
            raise LLMParamInvalid(f"kvflow connector: port must be an int in 0..{65535 - MAX_TP}, got {s.port!r}")
        if s.release_timeout_s <= 0 or s.load_timeout_ms <= 0:
            raise LLMParamInvalid("kvflow connector: release_timeout_s and load_timeout_ms must be positive")
        if not isinstance(s.options, dict) or not all(isinstance(v, str) for v in s.options.values()):
            raise LLMParamInvalid("kvflow connector: options must map kvflow option names to strings")
        if s.cluster_id == 0:  # derived from the engine id: stable for an engine, distinct between engines
            s = cls(**{**extra, "cluster_id": (zlib.crc32(engine_id.encode()) & 0x0FFFFFFF) * MAX_TP + MAX_TP})
        return s

    def kvflow_options(self, rank: int) -> dict[str, str]:
        opts = dict(self.options)
        if self.port:
            opts["llm.ListenIpInfo"] = f"{self.host}:{self.port + rank}"
        if self.transport != "auto":
            opts["kvflow.Transports"] = self.transport
        return opts


# ---------------------------------------------------------------------- scheduler -> worker, each step
@dataclass
class Recv:
    """Decode side: pull (or await the pushes of) ``remote_blocks`` into ``local_blocks``."""

    req_id: str
    remote_req_id: str
    cluster_id: int  # the prefill engine's base cluster id
    host: str
    port: int
    remote_blocks: list[int]
    local_blocks: list[int]
    first_block: int  # index in the request of local_blocks[0] (blocks before it were cached locally)
    mode: str


@dataclass
class Push:
    """Prefill side, push mode: blocks ``first..first+len(block_ids)`` of the request, computed this step."""

    req_id: str
    key: str  # what the decode side's "want" names: kvflow_transfer_id, else the request id
    block_ids: list[int]
    first: int
    last: bool  # the prompt is complete after this step


@dataclass
class StepMeta:
    recv: list[Recv] = field(default_factory=list)
    send: list[str] = field(default_factory=list)  # prefill: requests whose blocks wait for the decode side
    push: list[Push] = field(default_factory=list)


# ---------------------------------------------------------------------- worker <-> worker notifications
def pack(op: str, **fields: Any) -> bytes:
    return msgpack.packb({"op": op, **fields}, use_bin_type=True)


def unpack(payload: bytes) -> dict[str, Any] | None:
    """A peer's message, or None if it is not one of ours (ignored, never trusted further)."""
    try:
        msg = msgpack.unpackb(payload, raw=False)
    except Exception:
        return None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str) or not isinstance(msg.get("req"), str):
        return None
    return msg
