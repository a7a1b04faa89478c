"""Prometheus metrics, one registry per app (so several apps in one process stay apart)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.api.client import EngineClient
from gateway.accounting import RequestRecord
from gateway.cache.service import ResponseCache
from gateway.cache.store import MemoryCacheStore

__all__ = ["CONTENT_TYPE", "Metrics"]

_GOODPUT_HELP = "Successful interactive requests within their tier's TTFT and ITL objectives (rate(): goodput)"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sluice_requests", "Requests by tier served and HTTP status", ["tier", "status"], registry=r
        )
        self.errors = Counter("sluice_errors", "Failed requests by error code", ["code"], registry=r)
        self.latency = Histogram(
            "sluice_request_latency_seconds", "Total request latency", ["tier"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "sluice_ttft_seconds", "Time to first token (streams)", ["tier"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter(
            "sluice_tokens", "Tokens by tier and direction (prompt|completion)", ["tier", "direction"], registry=r
        )
        self.cost = Counter("sluice_cost_usd", "Spend in USD by tier", ["tier"], registry=r)
        self.cache = Counter("sluice_cache_lookups", "Response cache lookups by result", ["result"], registry=r)
        self.cache_saved = Counter("sluice_cache_saved_usd", "What cache hits saved, in USD", registry=r)
        self.escalations = Counter("sluice_escalations", "Requests escalated from small to large", registry=r)
        self.fallbacks = Counter(
            "sluice_fallbacks", "Requests served by another tier because theirs was down", ["tier"], registry=r
        )
        self.unauthenticated = Counter(
            "sluice_unauthenticated_requests",
            "Requests refused before a caller was known (no accounting row), by error code",
            ["code"],
            registry=r,
        )
        self.shadow_runs = Counter(
            "sluice_shadow_runs", "Shadow runs of the large tier by outcome (recorded|dropped|failed)", ["outcome"],
            registry=r,
        )
        self.shadow_agreement = Histogram(
            "sluice_shadow_agreement", "Agreement of the small tier's answer with the large tier's, per shadow run",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0), registry=r,
        )
        self.goodput = Counter("sluice_goodput_requests", _GOODPUT_HELP, ["tier"], registry=r)
        self.in_flight = Gauge("sluice_in_flight_requests", "Requests being served, by tier", ["tier"], registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: `labels()` validates and locks on every call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_unauthenticated(self, code: str) -> None:
        self._child(self.unauthenticated, code).inc()

    def count_goodput(self, tier: str) -> None:
        self._child(self.goodput, tier).inc()

    def in_flight_of(self, tier: str) -> Any:
        return self._child(self.in_flight, tier)

    def observe(self, record: RequestRecord) -> None:
        """Count one finished request."""
        tier = record.tier or "none"
        child = self._child
        child(self.requests, tier, str(record.status)).inc()
        if record.status == 200:
            child(self.cache, record.cache_status).inc()
            if record.cost_saved_usd:
                self.cache_saved.inc(record.cost_saved_usd)
        if record.error_code:
            child(self.errors, record.error_code).inc()
        child(self.latency, tier).observe(record.latency_ms / 1000)
        if record.ttft_ms is not None:
            child(self.ttft, tier).observe(record.ttft_ms / 1000)
        if record.tier is not None:
            child(self.tokens, tier, "prompt").inc(record.prompt_tokens)
            child(self.tokens, tier, "completion").inc(record.completion_tokens)
            child(self.cost, tier).inc(record.cost_usd)
        if record.escalated:
            self.escalations.inc()
        if record.fallback:
            child(self.fallbacks, tier).inc()

    def watch_tiers(self, clients: Mapping[str, EngineClient], slo_pressure: Callable[[str], float]) -> None:
        """Export each tier's load and SLO pressure (read at scrape time): what an autoscaler scales on."""
        self.registry.register(_TierLoadCollector(clients, slo_pressure))

    def watch_cache(self, cache: ResponseCache) -> None:
        """Export what the response cache holds in this process (read at scrape time): its memory bounds at work."""
        self.registry.register(_CacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector(Collector):
    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        footprint = self.cache.replica_index
        vectors = GaugeMetricFamily("sluice_cache_index_vectors", "Question vectors in this replica's semantic "
                                    "indexes: live entries, and rows allocated (bounded by "
                                    "cache.replica_index_max_entries)", labels=["kind"])  # fmt: skip
        vectors.add_metric(["entries"], footprint.entries)
        vectors.add_metric(["rows"], footprint.rows)
        yield vectors
        yield GaugeMetricFamily("sluice_cache_index_scopes", "Scopes this replica keeps a semantic index of",
                                value=footprint.scopes)
        if isinstance(self.cache.backend, MemoryCacheStore):
            yield GaugeMetricFamily("sluice_cache_in_process_entries", "Answers the in-process store holds "
                                    "(bounded by cache.max_entries_in_process)", value=len(self.cache.backend))


class _TierLoadCollector(Collector):
    """Queue depth by priority class, running sequences and KV-cache utilisation of every tier that
    reports them (in-process engines; an upstream engine server exports the same on its own /metrics)."""

    def __init__(self, clients: Mapping[str, EngineClient], slo_pressure: Callable[[str], float]) -> None:
        self.clients = clients
        self.slo_pressure = slo_pressure

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("sluice_tier_waiting_sequences", "Sequences waiting to be scheduled, by tier "
                                    "and priority class (the queue depth to scale on)", labels=["tier", "priority"])
        running = GaugeMetricFamily("sluice_tier_running_sequences", "Sequences being generated, by tier",
                                    labels=["tier"])
        kv = GaugeMetricFamily("sluice_tier_kv_cache_utilisation", "Share of the KV cache held, by tier (0..1)",
                               labels=["tier"])  # fmt: skip
        pressure = GaugeMetricFamily("sluice_tier_slo_pressure", "Worse of recent p99 TTFT and ITL over the tier's "
                                     "objective (1: at the SLO; interactive requests are refused above)",
                                     labels=["tier"])  # fmt: skip
        for tier, client in self.clients.items():
            pressure.add_metric([tier], self.slo_pressure(tier))
            load = client.load()
            if load is None:
                continue
            waiting.add_metric([tier, "interactive"], load.waiting_interactive)
            waiting.add_metric([tier, "batch"], load.waiting_batch)
            running.add_metric([tier], load.running)
            kv.add_metric([tier], load.kv_utilisation)
        yield from (waiting, running, kv, pressure)
