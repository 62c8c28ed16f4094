"""Observability: per-link counters and latency histograms, trace spans, structured log lines.

Every ``LlmDataDist`` owns one :class:`Metrics`. The hot path (one call per finished transfer)
is a dict lookup (none where the caller keeps its series) and one ``list.append`` of the
transfer's counts to its series' log, atomic without a lock from any thread; every
``LOG_FOLD`` entries, and before any read, the log is folded into the counters and the
latency histogram under the lock, in one loop. Readers take snapshots:
``LlmDataDist.stats()`` (a plain dict) and the Prometheus collector in :mod:`kvflow.metrics`,
which walks every live ``Metrics`` of the process.

Trace spans (OpenTelemetry) are made only when ``opentelemetry-api`` is importable *and* an
application has installed a tracer provider; otherwise the check costs one attribute read.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Iterator

from ._status import LLMException

if TYPE_CHECKING:
    from ._link import Link
    from .transport import RunBatch

try:  # guarded once: without opentelemetry-api every tracing call is a no-op
    from opentelemetry import trace as _ot
    from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Status, StatusCode
except ImportError:  # pragma: no cover - depends on the environment
    _ot = None  # type: ignore[assignment]

log = logging.getLogger("kvflow")

#: Upper bounds (seconds) of the transfer latency histogram buckets (an implicit +Inf follows).
LATENCY_BUCKETS: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
)
_FIRST_BOUND = LATENCY_BUCKETS[0]
#: Upper bounds (seconds) of the layer-wise exposed-time histogram buckets.
EXPOSED_BUCKETS: tuple[float, ...] = (
    0.0, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 5.0,
)

_now = time.perf_counter

#: A series' log is folded into its counters when it reaches this many transfers (about 50 µs).
LOG_FOLD = 512


def event(name: str, level: int = logging.INFO, logger: logging.Logger = log, **fields: Any) -> None:
    """One structured log line: ``<name> k=v k=v``, with the fields also in ``record.kvflow``.

    ``record.kvflow_event`` holds ``name``, so a JSON formatter or a filter can use the fields
    without parsing the text."""
    if not logger.isEnabledFor(level):
        return
    text = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
    logger.log(level, "%s %s", name, text, extra={"kvflow_event": name, "kvflow": fields})


def _fmt(v: Any) -> str:
    s = str(v)
    return repr(s) if (" " in s or not s) else s


def status_name(exc: BaseException) -> str:
    """The label a failure is counted under: the LLMStatusCode name, or what else it was."""
    if isinstance(exc, LLMException):
        return exc.status_code.name
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return type(exc).__name__


class Histogram:
    """Fixed-bound histogram: per-bucket counts (not cumulative), count and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound, observations <= bound), ..., (inf, count)]``, as Prometheus wants them."""
        out, acc = [], 0
        for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append((b, acc))
        return out

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile ``q`` (an estimate; None when empty)."""
        n = self.count
        if not n:
            return None
        rank = q * n
        for b, c in self.cumulative():
            if c >= rank:
                return b
        return float("inf")  # pragma: no cover

    def snapshot(self) -> dict[str, Any]:
        n = self.count
        return {"count": n, "sum": self.sum, "mean": self.sum / n if n else None,
                "p50_le": self.quantile(0.5), "p99_le": self.quantile(0.99),
                "buckets": [[b, c] for b, c in self.cumulative()]}


class OpStats:
    """Counters of one (peer, transport, op) series. ``log``: transfers not yet counted, each
    ``((bytes, runs), seconds)``; appended to from any thread, folded in under the lock of the
    owning ``Metrics`` (``Metrics.fold``)."""

    __slots__ = ("bytes", "errors", "latency", "log", "runs", "transfers")

    def __init__(self) -> None:
        self.transfers = 0
        self.bytes = 0
        self.runs = 0
        self.errors: dict[str, int] = {}
        self.latency = Histogram(LATENCY_BUCKETS)
        self.log: list[tuple[tuple[int, int], float]] = []

    def copy(self) -> OpStats:
        c = OpStats()
        c.transfers, c.bytes, c.runs, c.errors = self.transfers, self.bytes, self.runs, dict(self.errors)
        c.latency.counts[:] = self.latency.counts
        c.latency.sum = self.latency.sum
        return c

    def snapshot(self) -> dict[str, Any]:
        return {"transfers": self.transfers, "bytes": self.bytes, "runs": self.runs,
                "errors": dict(self.errors), "latency": self.latency.snapshot()}


_LIVE: weakref.WeakSet[Metrics] = weakref.WeakSet()


def live() -> list[Metrics]:
    """Every ``Metrics`` of this process whose ``LlmDataDist`` is initialized (not yet finalized)."""
    return [m for m in list(_LIVE) if m.active]


class Metrics:
    """Counters of one ``LlmDataDist``: transfers per (peer cluster, transport, op), link events."""

    def __init__(self, cluster_id: int, owner: Any = None) -> None:
        self.cluster_id = cluster_id
        self._owner = weakref.ref(owner) if owner is not None else None
        self.series: dict[tuple[int, str, str], OpStats] = {}
        self.link_events: dict[str, int] = {"up": 0, "down": 0}
        self.link_failures: dict[str, int] = {}  # link attempts that failed, by status
        self.links_up: dict[int, tuple[str, float]] = {}  # peer -> (transport, time.time() it came up)
        self.exposed = Histogram(EXPOSED_BUCKETS)
        self.layers = 0
        self._lock = threading.Lock()  # transfers are also counted from kvflow.sync callers' threads
        _LIVE.add(self)
        if _ot is not None:
            _ot.get_tracer_provider()  # lets OTEL_PYTHON_TRACER_PROVIDER install its provider now

    @property
    def active(self) -> bool:
        """Whether the owning ``LlmDataDist`` is initialized and not finalized (exporters skip others)."""
        if self._owner is None:
            return True
        owner = self._owner()
        return owner is not None and bool(getattr(owner, "_initialized", False))

    # -------------------------------------------------------------- the hot path
    def done(self, op: str, peer: int, transport: str, batch: RunBatch, seconds: float, span: Any) -> None:
        """A transfer finished: count its bytes and runs, observe its latency."""
        table = batch.table
        runs = table.shape[1]
        nbytes = table.item(2, 0) if runs == 1 else int(table[2].sum())  # numpy's sum costs ~1 us
        self.done_runs(op, peer, transport, runs, nbytes, seconds, span)

    def count(self, op: str, peer: int, transport: str, nbytes: int, runs: int, seconds: float) -> None:
        """A transfer of ``nbytes`` in ``runs`` runs finished (``done`` without the batch and the span)."""
        self.add(self.series_of(op, peer, transport), nbytes, runs, seconds)

    def series_of(self, op: str, peer: int, transport: str) -> OpStats:
        """The counters of one (peer, transport, op) series, made if need be. A caller that counts
        into the same series again and again keeps them and calls ``add`` (no key to build)."""
        key = (peer, transport, op)
        s = self.series.get(key)
        if s is None:
            with self._lock:
                s = self.series.setdefault(key, OpStats())
        return s

    def add(self, s: OpStats, nbytes: int, runs: int, seconds: float) -> None:
        """Count one finished transfer into ``s``, a series of this ``Metrics`` (``series_of``). The
        engine's fast path does the same inline: append, and fold at ``LOG_FOLD``."""
        log = s.log
        log.append(((nbytes, runs), seconds))
        if len(log) >= LOG_FOLD:
            self.fold(s)

    def fold(self, s: OpStats) -> None:
        """Count the transfers of ``s.log`` into ``s``'s counters. Only the entries present when it
        starts are taken out, so appends of other threads meanwhile stay for the next fold."""
        with self._lock:
            self._fold(s)

    @staticmethod
    def _fold(s: OpStats) -> None:  # under the lock
        log = s.log
        n = len(log)
        if n:
            entries = log[:n]
            del log[:n]
            nbytes = runs = 0
            total = 0.0
            counts = s.latency.counts
            for (b, r), seconds in entries:
                nbytes += b
                runs += r
                total += seconds
                counts[0 if seconds <= _FIRST_BOUND else bisect_left(LATENCY_BUCKETS, seconds)] += 1
            s.transfers += n
            s.bytes += nbytes
            s.runs += runs
            s.latency.sum += total

    def failed(self, op: str, peer: int, link: Link | None, exc: BaseException, seconds: float,
               span: Any) -> None:
        """A transfer raised ``exc``: count it under its status, log it, close its span."""
        transport = link.transport if link is not None else ""
        key = (peer, transport, op)
        name = status_name(exc)
        with self._lock:
            s = self.series.get(key)
            if s is None:
                s = self.series[key] = OpStats()
            s.errors[name] = s.errors.get(name, 0) + 1
        if span is not None:
            span.set_attribute("kvflow.status", name)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, name))
            span.end()
        quiet = name in ("CANCELLED", "LLM_PARAM_INVALID", "LLM_KV_CACHE_NOT_EXIST")
        event("transfer_failed", logging.DEBUG if quiet else logging.INFO, cluster=self.cluster_id, peer=peer,
              op=op, transport=transport or "-", status=name, ms=round(seconds * 1e3, 3), error=str(exc)[:200])

    def done_runs(self, op: str, peer: int, transport: str, runs: int, nbytes: int, seconds: float,
                  span: Any) -> None:
        """``done`` for a transfer given by its counts (a large plan moved in several batches)."""
        self.count(op, peer, transport, nbytes, runs, seconds)
        if span is not None:
            span.set_attribute("kvflow.bytes", nbytes)
            span.set_attribute("kvflow.runs", runs)
            span.end()

    @property
    def tracing(self) -> bool:
        """Whether transfers get trace spans (``opentelemetry-api`` and an installed provider)."""
        return _ot is not None and _ot._TRACER_PROVIDER is not None and _tracer() is not None

    def start_span(self, op: str, peer: int, cache_id: int) -> Any:
        """An OpenTelemetry span for one transfer, or None (no API, or no provider installed)."""
        if _ot is None or _ot._TRACER_PROVIDER is None:
            return None
        tracer = _tracer()
        if tracer is None:
            return None
        return tracer.start_span(f"kvflow.{op}", attributes={
            "kvflow.cluster": self.cluster_id, "kvflow.peer_cluster": peer, "kvflow.op": op,
            "kvflow.cache_id": cache_id})

    # -------------------------------------------------------------- links and layers
    def link_up(self, link: Link) -> None:
        self.link_events["up"] += 1
        self.links_up[link.remote_cluster_id] = (link.transport, time.time())
        event("link_up", cluster=self.cluster_id, peer=link.remote_cluster_id, transport=link.transport,
              initiator=link.initiator, fallbacks=";".join(f"{k}:{v}" for k, v in link.fallbacks.items()) or "-")

    def link_down(self, link: Link) -> None:
        self.link_events["down"] += 1
        up = self.links_up.get(link.remote_cluster_id)
        if up is not None and up[0] == link.transport:
            del self.links_up[link.remote_cluster_id]
        err = link.error
        reason = status_name(err) if err is not None else "closed"
        event("link_down", logging.WARNING if err is not None and not link.closing else logging.INFO,
              cluster=self.cluster_id, peer=link.remote_cluster_id, transport=link.transport, reason=reason,
              error=str(err)[:200] if err is not None else "-")

    def link_failed(self, peer: int, address: tuple[str, int], status: str, why: str) -> None:
        self.link_failures[status] = self.link_failures.get(status, 0) + 1
        event("link_failed", logging.WARNING, cluster=self.cluster_id, peer=peer,
              address=f"{address[0]}:{address[1]}", status=status, error=why[:200])

    def observe_exposed(self, seconds: float) -> None:
        """Layer-wise push: the time the caller waited for the last layer(s) after its compute ended
        (the transfer time that overlap did not hide). Called once per layer-wise request."""
        self.exposed.observe(max(0.0, seconds))

    def observe_layers(self, n: int = 1) -> None:
        """Layer-wise push: ``n`` more layers reached a peer (their bytes are in the push series)."""
        self.layers += n

    # -------------------------------------------------------------- readers
    def iter_series(self) -> Iterator[tuple[int, str, str, OpStats]]:
        """Each series as (peer, transport, op, a consistent copy of its counters)."""
        with self._lock:
            for s in self.series.values():
                self._fold(s)
            series = [(key, s.copy()) for key, s in self.series.items()]
        for (peer, transport, op), s in series:
            yield peer, transport, op, s

    def snapshot(self, link_states: dict[int, tuple[str, str]]) -> dict[str, Any]:
        """The counters as plain data; ``link_states`` maps peer -> (transport, state) of live links."""
        total: dict[str, Any] = {"transfers": 0, "bytes": 0, "runs": 0, "errors": {}}
        ops: dict[str, dict[str, Any]] = {}
        links: dict[int, dict[str, Any]] = {}
        for peer, transport, op, s in self.iter_series():
            snap = s.snapshot()
            for d in (total, ops.setdefault(op, {"transfers": 0, "bytes": 0, "runs": 0, "errors": {}})):
                d["transfers"] += s.transfers
                d["bytes"] += s.bytes
                d["runs"] += s.runs
                for k, v in s.errors.items():
                    d["errors"][k] = d["errors"].get(k, 0) + v
            entry = links.setdefault(peer, {"transport": None, "state": "none", "series": {}})
            entry["series"].setdefault(transport or "-", {})[op] = snap
        for peer, (transport, state) in link_states.items():
            entry = links.setdefault(peer, {"transport": None, "state": "none", "series": {}})
            entry["transport"], entry["state"] = transport, state
            up = self.links_up.get(peer)
            if up is not None:
                entry["up_since"] = up[1]
        return {
            "cluster_id": self.cluster_id,
            "total": total,
            "ops": ops,
            "links": links,
            "link_events": dict(self.link_events),
            "link_failures": dict(self.link_failures),
            "layerwise": {"layers": self.layers, "exposed_seconds": self.exposed.snapshot()},
        }


# ------------------------------------------------------------------ tracing
_seen_provider: Any = None
_cached_tracer: Any = None


def _tracer() -> Any:
    """The kvflow tracer when an application installed an OpenTelemetry tracer provider, else None."""
    global _seen_provider, _cached_tracer
    if _ot is None:
        return None
    provider = getattr(_ot, "_TRACER_PROVIDER", None)  # set by trace.set_tracer_provider; cheap to read
    if provider is None:
        if hasattr(_ot, "_TRACER_PROVIDER"):
            return None
        provider = _ot.get_tracer_provider()  # pragma: no cover - a future API without the global
    if provider is not _seen_provider:
        _seen_provider = provider
        if isinstance(provider, (ProxyTracerProvider, NoOpTracerProvider)):
            _cached_tracer = None
        else:
            from . import __version__

            _cached_tracer = provider.get_tracer("kvflow", __version__)
    return _cached_tracer


def link_span(cluster_id: int, peer: int, address: tuple[str, int]) -> Any:
    """A span around making one link (None when not tracing); end it with :func:`end_span`."""
    tracer = _tracer()
    if tracer is None:
        return None
    return tracer.start_span("kvflow.link", attributes={
        "kvflow.cluster": cluster_id, "kvflow.peer_cluster": peer,
        "net.peer.name": address[0], "net.peer.port": address[1]})


def end_span(span: Any, status: str | None = None, **attributes: Any) -> None:
    if span is None:
        return
    for k, v in attributes.items():
        span.set_attribute(f"kvflow.{k}", v)
    if status is not None and status != "LLM_SUCCESS":
        span.set_attribute("kvflow.status", status)
        span.set_status(Status(StatusCode.ERROR, status))
    span.end()


__all__ = ["EXPOSED_BUCKETS", "LATENCY_BUCKETS", "Histogram", "Metrics", "OpStats", "event", "live",
           "now", "status_name"]
now = _now
