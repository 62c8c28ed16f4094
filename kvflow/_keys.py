"""Caches named by a key: ``register_kv_cache(..., key=k)`` and ``resolve_cache_key(cluster_id, k)``.

A key is an int chosen by the application (LLM-DataDist's ``BlocksCacheKey.model_id``). It names at
most one registered cache of an LlmDataDist at a time, so a peer can find that cache without
learning its id out of band. A peer resolves a key with the control request
``{"op": "cache", "key": k}``, answered with ``{"cache_id": id}`` only: the cache's description
comes from the usual lookup by id, which is also what grants one-sided access to it.

Bindings live beside the :class:`~kvflow._memory.Registry` they belong to and resolutions beside
the :class:`~kvflow._link.Link` they were made over (weak maps: nothing here outlives either). A
binding counts only while its cache is registered; a resolution is reused only while the link
still holds the peer's description of that cache (a peer's unregister or a
``LLM_KV_CACHE_NOT_EXIST`` drops it), so a stale id is never handed out twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from . import _wire as wire
from ._status import LLMKvCacheNotExist, LLMParamInvalid

if TYPE_CHECKING:
    from ._link import Link
    from ._memory import Registry

MAX_KEY = (1 << 64) - 1

_BOUND: WeakKeyDictionary[Registry, dict[int, int]] = WeakKeyDictionary()  # key -> cache id
_RESOLVED: WeakKeyDictionary[Link, dict[int, int]] = WeakKeyDictionary()  # peer's key -> peer's cache id


def check_key(key: Any) -> int:
    """``key`` as an int in 0..2**64-1, else LLMParamInvalid."""
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= MAX_KEY:
        raise LLMParamInvalid(f"key must be an int in 0..{MAX_KEY}, got {key!r}")
    return key


def _live(registry: Registry, cache_id: int) -> bool:
    return registry._caches.get(cache_id) is not None


def reserve(registry: Registry, key: Any) -> int | None:
    """Check ``key`` before a registration: None, or a valid key that names no registered cache."""
    if key is None:
        return None
    key = check_key(key)
    owner = _BOUND.get(registry, {}).get(key)
    if owner is not None and _live(registry, owner):
        raise LLMParamInvalid(f"key {key} already names cache {owner}; unregister it first")
    return key


def bind(registry: Registry, cache_id: int, key: int | None) -> None:
    """Let ``key`` name ``cache_id`` (after a successful registration; None does nothing)."""
    if key is None:
        return
    table = _BOUND.setdefault(registry, {})
    for k in [k for k, cid in table.items() if not _live(registry, cid)]:  # unregistered meanwhile
        del table[k]
    table[key] = cache_id


def lookup(registry: Registry, key: int) -> int:
    """The id of the registered cache ``key`` names, else LLMKvCacheNotExist."""
    cache_id = _BOUND.get(registry, {}).get(key)
    local = registry._caches.get(cache_id) if cache_id is not None else None
    if local is None or local.closing:
        raise LLMKvCacheNotExist(f"no cache registered with key {key}")
    return local.cache_id


def answer(registry: Registry, msg: Mapping[str, Any]) -> dict[str, Any]:
    """The reply to a peer's ``{"op": "cache", "key": k}``."""
    key = wire.field(msg, "key", int)
    if not 0 <= key <= MAX_KEY:
        raise wire.ProtocolError(f"key {key} out of range")
    return {"cache_id": lookup(registry, key)}


async def resolve(link: Link, key: int, timeout: float) -> int:
    """The peer's cache id for ``key``: asked over ``link`` (bounded by ``timeout`` s) unless this
    link already resolved it and still holds that cache's description."""
    known = _RESOLVED.get(link)
    if known is not None:
        cache_id = known.get(key)
        if cache_id is not None and cache_id in link.remotes:
            return cache_id
    rsp = await link.request({"op": "cache", "key": key}, timeout)
    cache_id = wire.field(rsp, "cache_id", int)
    if not 0 < cache_id <= MAX_KEY:
        raise wire.ProtocolError(f"cluster {link.remote_cluster_id} answered key {key} with cache id {cache_id}")
    _RESOLVED.setdefault(link, {})[key] = cache_id
    return cache_id
