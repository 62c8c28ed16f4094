"""Exporting kvflow's counters: Prometheus, and the bounds of its histograms.

Every ``LlmDataDist`` counts its transfers, per peer cluster, transport and direction, whether
or not anything exports them; ``LlmDataDist.stats()`` returns them as a plain dict. This module
adds the Prometheus exporter:

```python
from prometheus_client import start_http_server
import kvflow.metrics

kvflow.metrics.register_prometheus()      # the default registry; once per process
start_http_server(9400)
```

Series (``cluster`` is the exporting instance's cluster id, ``peer`` the linked cluster's):

- ``kvflow_transfers_total{cluster, peer, transport, op}``: transfers that finished
- ``kvflow_bytes_total{...}``, ``kvflow_runs_total{...}``: bytes and coalesced runs they moved
- ``kvflow_errors_total{cluster, peer, transport, op, status}``: failed transfers
- ``kvflow_transfer_seconds{...}``: histogram, latency of finished transfers
- ``kvflow_links{cluster, transport}``: gauge, live links
- ``kvflow_link_events_total{cluster, event}``: links that came up / went down
- ``kvflow_link_failures_total{cluster, status}``: link attempts that failed
- ``kvflow_layerwise_exposed_seconds{cluster}``: histogram, layer-wise time not hidden by compute
- ``kvflow_layerwise_layers_total{cluster}``: layers handed over by layer-wise pushes

OpenTelemetry spans (``kvflow.pull``, ``kvflow.push``, ``kvflow.link``) are made automatically
once an application installs a tracer provider (``opentelemetry-api`` present); nothing to call.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterator

from ._metrics import EXPOSED_BUCKETS, LATENCY_BUCKETS, Histogram, live

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["EXPOSED_BUCKETS", "LATENCY_BUCKETS", "KvflowCollector", "register_prometheus"]

_LABELS = ["cluster", "peer", "transport", "op"]


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    return [("+Inf" if b == float("inf") else repr(float(b)), float(c)) for b, c in h.cumulative()]


class KvflowCollector:
    """A ``prometheus_client`` collector over every live ``LlmDataDist`` of the process.

    It reads the counters at scrape time; registering it costs nothing on the transfer path."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        transfers = CounterMetricFamily("kvflow_transfers", "KV cache transfers that finished", labels=_LABELS)
        nbytes = CounterMetricFamily("kvflow_bytes", "Bytes moved by finished transfers", labels=_LABELS)
        runs = CounterMetricFamily("kvflow_runs", "Coalesced runs moved by finished transfers", labels=_LABELS)
        errors = CounterMetricFamily("kvflow_errors", "Failed transfers, by status", labels=[*_LABELS, "status"])
        latency = HistogramMetricFamily("kvflow_transfer_seconds", "Latency of finished transfers",
                                        labels=_LABELS)
        links = GaugeMetricFamily("kvflow_links", "Live links", labels=["cluster", "transport"])
        events = CounterMetricFamily("kvflow_link_events", "Links that came up or went down",
                                     labels=["cluster", "event"])
        link_failures = CounterMetricFamily("kvflow_link_failures", "Link attempts that failed, by status",
                                            labels=["cluster", "status"])
        exposed = HistogramMetricFamily("kvflow_layerwise_exposed_seconds",
                                        "Layer-wise transfer time not hidden behind compute", labels=["cluster"])
        layers = CounterMetricFamily("kvflow_layerwise_layers", "Layers handed over by layer-wise pushes",
                                     labels=["cluster"])
        for m in live():
            cluster = str(m.cluster_id)
            for peer, transport, op, s in m.iter_series():
                labels = [cluster, str(peer), transport or "none", op]
                transfers.add_metric(labels, s.transfers)
                nbytes.add_metric(labels, s.bytes)
                runs.add_metric(labels, s.runs)
                for status, n in list(s.errors.items()):
                    errors.add_metric([*labels, status], n)
                latency.add_metric(labels, _buckets(s.latency), s.latency.sum)
            per_transport: dict[str, int] = {}
            for transport, _since in list(m.links_up.values()):
                per_transport[transport] = per_transport.get(transport, 0) + 1
            for transport, n in per_transport.items():
                links.add_metric([cluster, transport], n)
            for ev, n in m.link_events.items():
                events.add_metric([cluster, ev], n)
            for status, n in list(m.link_failures.items()):
                link_failures.add_metric([cluster, status], n)
            exposed.add_metric([cluster], _buckets(m.exposed), m.exposed.sum)
            layers.add_metric([cluster], m.layers)
        yield from (transfers, nbytes, runs, errors, latency, links, events, link_failures, exposed, layers)


_registered: weakref.WeakKeyDictionary[Any, KvflowCollector] = weakref.WeakKeyDictionary()


def register_prometheus(registry: CollectorRegistry | None = None) -> KvflowCollector:
    """Export kvflow's counters through ``prometheus_client`` (its default registry unless given).

    Idempotent per registry. Raises ``ImportError`` naming the package when
    ``prometheus-client`` is not installed."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError("kvflow.metrics.register_prometheus needs prometheus-client: "
                          "pip install 'kvflow[metrics]'") from exc
    reg = registry if registry is not None else prometheus_client.REGISTRY
    collector = _registered.get(reg)
    if collector is None:
        collector = KvflowCollector()
        reg.register(collector)
        _registered[reg] = collector
    return collector
