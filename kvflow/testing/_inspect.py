"""Read-only views of an LlmDataDist's internals, for white-box tests.

kvflow's own tests look at live links, handshakes and pins through these functions rather than
through private attribute names, so that the internals can change in one place. The objects
returned are live: read them, do not change them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import socket

    from .._datadist import LlmDataDist
    from .._link import Link
    from .._memory import LocalCache
    from .._metrics import Metrics
    from ..transport import Transport

__all__ = ["busy_answers", "control_handshakes", "data_waiters", "handler", "handshakes", "link", "linking", "links",
           "local_cache", "local_caches", "metrics", "transport"]


def links(dd: LlmDataDist) -> dict[int, Link]:
    """The live link objects, by peer cluster id."""
    return dd._table.links


def link(dd: LlmDataDist, cluster_id: int) -> Link:
    """The live link object to ``cluster_id`` (KeyError if there is none)."""
    return dd._table.links[cluster_id]


def linking(dd: LlmDataDist) -> set[int]:
    """Cluster ids with a handshake under way."""
    return dd._table.linking


def handshakes(dd: LlmDataDist) -> int:
    """Incoming connections in their handshake now."""
    return dd._listener.handshakes if dd._listener is not None else 0


def control_handshakes(dd: LlmDataDist) -> int:
    """Incoming control connections past their magic, in their handshake now."""
    return dd._listener.control_handshakes if dd._listener is not None else 0


def busy_answers(dd: LlmDataDist) -> int:
    """Link attempts the listener answered busy since it started listening."""
    return dd._listener.busy_answers if dd._listener is not None else 0


def data_waiters(dd: LlmDataDist) -> dict[bytes, asyncio.Future[socket.socket]]:
    """Accepted links waiting for their data connection, by token."""
    return dd._listener.data_waiters if dd._listener is not None else {}


def local_cache(dd: LlmDataDist, cache_id: int) -> LocalCache | None:
    """The registered cache ``cache_id`` with its pins, also while it is being unregistered."""
    return dd._registry.get_any(cache_id)


def local_caches(dd: LlmDataDist) -> list[LocalCache]:
    """Every registered cache with its pins."""
    return list(dd._registry)


def transport(dd: LlmDataDist, name: str) -> Transport:
    """The running transport ``name`` of ``dd`` (KeyError if it is not running)."""
    return dd._side.transports[name]


def metrics(dd: LlmDataDist) -> Metrics:
    """The counters behind ``dd.stats()``."""
    return dd._metrics


def handler(dd: LlmDataDist) -> Any:
    """The coroutine function that answers peers' control requests: ``await handler(link, msg)``."""
    return dd._table.handle


def replace_handler(dd: LlmDataDist, fn: Any) -> None:
    """Answer peers' control requests of links made from now on with ``fn`` (a test's stand-in)."""
    dd._table.handle = fn  # type: ignore[method-assign]
