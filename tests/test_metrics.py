"""Observability: dd.stats(), the Prometheus exposition, OpenTelemetry spans, structured log lines.

The transfers run between this process and a prefill process (the plugin's ``kvflow_pair``)."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import numpy as np
import pytest

import kvflow.metrics
from kvflow import CacheIndex, ClusterInfo, IpInfo, KvCacheExtParam, LlmDataDist, LLMKvCacheNotExist, LLMParamInvalid
from kvflow import _metrics as metrics_impl
from kvflow.testing import KvPair, inspect

# heartbeats are not under test here: a loaded CI machine must not break the link mid-test
PATIENT = {"kvflow.HeartbeatInterval": "1000", "kvflow.HeartbeatTimeout": "20000"}


def _prometheus() -> Any:
    return pytest.importorskip("prometheus_client", reason="prometheus-client is not installed")


def _scrape(registry: Any) -> dict[str, list[Any]]:
    """Samples by name, from the text exposition format (what a Prometheus server reads)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _prometheus().generate_latest(registry).decode()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    hits = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


@pytest.mark.asyncio
@pytest.mark.kvflow_pair(transport="tcp", options=PATIENT)
async def test_prometheus_counters_match_what_was_moved(kvflow_pair: KvPair) -> None:
    p, desc = kvflow_pair, kvflow_pair.desc
    registry = _prometheus().CollectorRegistry()
    assert kvflow.metrics.register_prometheus(registry) is kvflow.metrics.register_prometheus(registry)

    moved = {"pull": 0, "push": 0}
    runs = {"pull": 0, "push": 0}
    # pulls: 3 separate blocks (3 runs per tensor), 2 contiguous blocks (1 run per tensor), a whole slot
    await p.dd.pull_kv_blocks(p.remote, p.cache, [0, 2, 4], [7, 5, 3])
    moved["pull"] += 3 * desc.stride * desc.num_tensors
    runs["pull"] += 3 * desc.num_tensors
    await p.dd.pull_kv_blocks(p.remote, p.cache, [1, 2], [0, 1])
    moved["pull"] += 2 * desc.stride * desc.num_tensors
    runs["pull"] += desc.num_tensors
    await p.dd.pull_kv_cache(CacheIndex(p.remote_cluster_id, p.remote.cache_id, 6), p.cache, 6)
    moved["pull"] += desc.stride * desc.num_tensors
    # pushes: layers 1..1 (tensors 2, 3) of blocks 0..3 (contiguous: one run per tensor)
    await p.dd.push_kv_blocks(p.cache, p.remote, [0, 1, 2, 3], [0, 1, 2, 3],
                              KvCacheExtParam((1, 1), (1, 1), 2))
    moved["push"] += 4 * desc.stride * 2
    runs["push"] += 2
    # failures: a missing remote cache twice, a bad block index once (never reaches the peer)
    for _ in range(2):
        with pytest.raises(LLMKvCacheNotExist):
            await p.dd.pull_kv_blocks(CacheIndex(p.remote_cluster_id, 4242), p.cache, [0], [0])
    with pytest.raises(LLMParamInvalid):
        await p.dd.pull_kv_blocks(p.remote, p.cache, [0], [99])

    got = await p.remote_read()
    assert np.array_equal(p.blocks(p.local[0])[[7, 5, 3]], p.blocks(got[0])[[0, 2, 4]])

    s = _scrape(registry)
    lbl = {"cluster": "2", "peer": "1", "transport": "tcp"}
    for op in ("pull", "push"):
        assert _value(s, "kvflow_bytes_total", op=op, **lbl) == moved[op]
        assert _value(s, "kvflow_transfers_total", op=op, **lbl) == (3 if op == "pull" else 1)
        assert _value(s, "kvflow_transfer_seconds_count", op=op, **lbl) == (3 if op == "pull" else 1)
        assert 0 < _value(s, "kvflow_transfer_seconds_sum", op=op, **lbl) < 30
        assert _value(s, "kvflow_transfer_seconds_bucket", op=op, le="+Inf", **lbl) == (3 if op == "pull" else 1)
    assert _value(s, "kvflow_runs_total", op="pull", **lbl) == runs["pull"] + desc.num_tensors
    assert _value(s, "kvflow_runs_total", op="push", **lbl) == runs["push"]
    assert _value(s, "kvflow_errors_total", op="pull", status="LLM_KV_CACHE_NOT_EXIST", **lbl) == 2
    assert _value(s, "kvflow_errors_total", op="pull", status="LLM_PARAM_INVALID", **lbl) == 1
    assert _value(s, "kvflow_links", cluster="2", transport="tcp") == 1
    assert _value(s, "kvflow_link_events_total", cluster="2", event="up") == 1

    # dd.stats() says the same
    st = p.dd.stats()
    assert st["total"]["bytes"] == moved["pull"] + moved["push"]
    assert st["ops"]["pull"]["errors"] == {"LLM_KV_CACHE_NOT_EXIST": 2, "LLM_PARAM_INVALID": 1}
    link = st["links"][p.remote_cluster_id]
    assert (link["transport"], link["state"]) == ("tcp", "linked")
    assert link["series"]["tcp"]["push"]["bytes"] == moved["push"]
    assert link["series"]["tcp"]["pull"]["latency"]["count"] == 3

    # the serving side counts what it initiated (nothing), and its link
    remote = await p.remote_stats()
    assert remote["total"]["transfers"] == 0
    assert remote["link_events"]["up"] == 1


@pytest.mark.asyncio
@pytest.mark.kvflow_pair(transport="tcp", options=PATIENT)
async def test_link_down_and_layerwise_hook_are_exported(kvflow_pair: KvPair) -> None:
    registry = _prometheus().CollectorRegistry()
    kvflow.metrics.register_prometheus(registry)
    m = inspect.metrics(kvflow_pair.dd)
    m.observe_exposed(0.0004)
    m.observe_exposed(0.003)
    m.observe_layers(32)
    rets = await kvflow_pair.dd.unlink_llm_clusters([ClusterInfo(kvflow_pair.remote_cluster_id, [])], 2000)
    assert [int(r) for r in rets] == [0]
    s = _scrape(registry)
    assert _value(s, "kvflow_link_events_total", cluster="2", event="down") == 1
    assert not [x for x in s.get("kvflow_links", []) if x.labels["cluster"] == "2"]
    assert _value(s, "kvflow_layerwise_exposed_seconds_count", cluster="2") == 2
    assert _value(s, "kvflow_layerwise_exposed_seconds_bucket", cluster="2", le="0.0005") == 1
    assert _value(s, "kvflow_layerwise_layers_total", cluster="2") == 32
    assert kvflow_pair.dd.stats()["links"] == {}


def test_finalized_instances_are_not_exported() -> None:
    dd = LlmDataDist(31337)
    assert inspect.metrics(dd) not in metrics_impl.live()  # not initialized


@pytest.mark.parametrize("fold_at", [3, metrics_impl.LOG_FOLD])
def test_counts_from_many_threads_with_reads_meanwhile_are_exact(monkeypatch: pytest.MonkeyPatch,
                                                                 fold_at: int) -> None:
    """Transfers are appended to a series' log without a lock and folded in under it: with four
    threads counting while another keeps reading, no transfer is lost or counted twice, and the
    histogram holds every one of them. Folding every 3 transfers gives thousands of folds while
    other threads append; a short switch interval makes the threads interleave finely."""
    monkeypatch.setattr(metrics_impl, "LOG_FOLD", fold_at)
    m = metrics_impl.Metrics(7)
    s = m.series_of("pull", 8, "shm")
    per_thread, threads = 3 * metrics_impl.LOG_FOLD + 17 if fold_at > 3 else 5000, 4
    done = threading.Event()
    reads: list[int] = []

    def count(i: int) -> None:
        for k in range(per_thread):
            m.add(s, 4096 + i, 1 + k % 3, 1e-6 * (1 + k % 50))

    def read() -> None:
        while not done.is_set():
            reads.append(sum(stats.transfers for *_, stats in m.iter_series()))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns far more often than every 5 ms
    try:
        reader = threading.Thread(target=read)
        reader.start()
        workers = [threading.Thread(target=count, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        done.set()
        reader.join(60)
    finally:
        sys.setswitchinterval(interval)
    [(_, _, _, got)] = list(m.iter_series())
    n = per_thread * threads
    assert got.transfers == n and got.latency.count == n
    assert got.bytes == sum((4096 + i) * per_thread for i in range(threads))
    assert got.runs == threads * sum(1 + k % 3 for k in range(per_thread))
    assert got.latency.sum == pytest.approx(threads * sum(1e-6 * (1 + k % 50) for k in range(per_thread)))
    assert reads == sorted(reads) and all(r <= n for r in reads)  # reads never go back or overshoot


# ---------------------------------------------------------------------- tracing
class _Span:
    def __init__(self, name: str, attributes: Any) -> None:
        self.name, self.attributes = name, dict(attributes or {})
        self.status: Any = None
        self.exceptions: list[BaseException] = []
        self.ended = False

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def record_exception(self, exc: BaseException, *a: Any, **k: Any) -> None:
        self.exceptions.append(exc)

    def set_status(self, status: Any, *a: Any) -> None:
        self.status = status

    def end(self, *a: Any) -> None:
        self.ended = True


def _fake_provider(spans: list[_Span]) -> Any:
    trace = pytest.importorskip("opentelemetry.trace")

    class Tracer(trace.Tracer):
        def start_span(self, name: str, context: Any = None, kind: Any = None, attributes: Any = None,
                       *a: Any, **k: Any) -> Any:
            spans.append(_Span(name, attributes))
            return spans[-1]

        def start_as_current_span(self, *a: Any, **k: Any) -> Any:  # pragma: no cover - kvflow does not use it
            raise NotImplementedError

    class Provider(trace.TracerProvider):
        def get_tracer(self, *a: Any, **k: Any) -> Any:
            return Tracer()

    return Provider()


@pytest.mark.asyncio
@pytest.mark.kvflow_pair(transport="tcp", options=PATIENT)
async def test_spans_when_a_tracer_provider_is_installed(kvflow_pair: KvPair,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    trace = pytest.importorskip("opentelemetry.trace")
    p = kvflow_pair
    assert inspect.metrics(p.dd).start_span("pull", 1, 1) is None  # no provider installed: no span, no cost
    spans: list[_Span] = []
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", _fake_provider(spans))
    await p.dd.pull_kv_blocks(p.remote, p.cache, [0, 1], [0, 1])
    with pytest.raises(LLMKvCacheNotExist):
        await p.dd.push_kv_blocks(p.cache, CacheIndex(p.remote_cluster_id, 4242), [0], [0])
    ok, bad = spans
    assert (ok.name, ok.ended, ok.status) == ("kvflow.pull", True, None)
    assert ok.attributes["kvflow.bytes"] == 2 * p.desc.stride * p.desc.num_tensors
    assert ok.attributes["kvflow.peer_cluster"] == p.remote_cluster_id
    assert (bad.name, bad.ended) == ("kvflow.push", True)
    assert bad.attributes["kvflow.status"] == "LLM_KV_CACHE_NOT_EXIST"
    assert bad.status.status_code == trace.StatusCode.ERROR
    assert isinstance(bad.exceptions[0], LLMKvCacheNotExist)


@pytest.mark.asyncio
async def test_tracing_is_a_no_op_without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_impl, "_ot", None)
    assert metrics_impl.Metrics(5).start_span("pull", 1, 1) is None
    assert metrics_impl.link_span(5, 1, ("127.0.0.1", 1)) is None
    metrics_impl.end_span(None, "LLM_LINK_FAILED")


# ---------------------------------------------------------------------- logs
@pytest.mark.asyncio
@pytest.mark.kvflow_pair(transport="tcp", options=PATIENT)
async def test_structured_log_lines(kvflow_pair: KvPair, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvflow")
    p = kvflow_pair
    rets = await p.dd.unlink_llm_clusters([ClusterInfo(p.remote_cluster_id, [])], 2000)
    assert [int(r) for r in rets] == [0]
    async with LlmDataDist(77, options={"kvflow.Transports": "tcp"}) as other:
        # a link to a port nobody listens on fails, with a structured line
        rets = await other.link_llm_clusters([ClusterInfo(p.remote_cluster_id, [IpInfo("127.0.0.1", 1)])], 2000)
        assert [int(r) for r in rets] != [0]
        rets = await other.link_llm_clusters([ClusterInfo(p.remote_cluster_id, [IpInfo(*p.address)])], 5000)
        assert [int(r) for r in rets] == [0]
    events = {}
    for r in caplog.records:
        name = getattr(r, "kvflow_event", None)
        if name:
            events.setdefault(name, []).append(r)
    down = events["link_down"][0]
    assert down.kvflow["peer"] == p.remote_cluster_id and down.kvflow["transport"] == "tcp"
    assert down.getMessage().startswith("link_down cluster=2 peer=1 transport=tcp")
    failed = events["link_failed"][0]
    assert failed.levelno == logging.WARNING and failed.kvflow["status"] == "LLM_LINK_FAILED"
    up = [r for r in events["link_up"] if r.kvflow["cluster"] == 77]
    assert up and up[0].kvflow["transport"] == "tcp"
    assert [r for r in events["transport_chosen"] if r.kvflow["cluster"] == 77]
