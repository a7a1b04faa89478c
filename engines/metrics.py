"""Prometheus metrics of one engine: scheduler and KV-cache state read at scrape time, latencies
and generated tokens observed as requests stream.

Each `EngineMetrics` owns its registry (two in-process tiers never collide); every series carries a
`model` label. Throughput is `rate(sluice_engine_generated_tokens_total[1m])`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# CPU decoding sits in the tens to hundreds of milliseconds per token; prefill of long prompts in seconds.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class EngineStatsView(Protocol):
    """The fields of `engines.llm_engine.EngineStats` exported here."""

    num_waiting: int
    num_running: int
    num_waiting_batch: int
    num_running_batch: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_queries_tokens: int
    prefix_cache_hit_tokens: int


class _EngineStateCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], EngineStatsView]) -> None:
        self._model = model
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = {
            "sluice_engine_waiting_sequences": ("Sequences waiting to be scheduled.", stats.num_waiting),
            "sluice_engine_running_sequences": ("Sequences in the running batch.", stats.num_running),
            "sluice_engine_waiting_batch_sequences": (
                "Of the waiting sequences, those of batch priority.", stats.num_waiting_batch),
            "sluice_engine_running_batch_sequences": (
                "Of the running sequences, those of batch priority.", stats.num_running_batch),
            "sluice_engine_kv_cache_utilisation": (
                "KV-cache blocks held by sequences / blocks allocated (0..1).",
                stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0),
            "sluice_engine_kv_blocks_total": ("KV-cache blocks allocated at start.", stats.kv_blocks_total),
            "sluice_engine_kv_blocks_used": ("KV-cache blocks held by sequences.", stats.kv_blocks_used),
            "sluice_engine_kv_blocks_free": ("KV-cache blocks free or evictable.", stats.kv_blocks_free),
            "sluice_engine_prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.",
                stats.prefix_cache_hit_tokens / stats.prefix_cache_queries_tokens
                if stats.prefix_cache_queries_tokens
                else 0.0,
            ),
        }
        for name, (documentation, value) in gauges.items():
            gauge = GaugeMetricFamily(name, documentation, labels=["model"])
            gauge.add_metric([self._model], float(value))
            yield gauge
        counters = {
            "sluice_engine_prefix_cache_queries_tokens": (
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries_tokens,
            ),
            "sluice_engine_prefix_cache_hit_tokens": (
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hit_tokens,
            ),
        }
        for name, (documentation, value) in counters.items():
            counter = CounterMetricFamily(name, documentation, labels=["model"])
            counter.add_metric([self._model], float(value))
            yield counter


class EngineMetrics:
    def __init__(
        self, model: str, stats: Callable[[], EngineStatsView], precision: Mapping[str, str] | None = None
    ) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(model, stats))
        if precision:  # what `auto` settings resolved to on this machine: sluice_engine_info{...} 1
            Info("sluice_engine", "How the engine computes.", ["model"], registry=self.registry).labels(model).info(
                dict(precision)
            )
        self._ttft = Histogram(
            "sluice_engine_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self._itl = Histogram(
            "sluice_engine_inter_token_latency_seconds",
            "Between consecutive generated tokens of one sequence.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self._generated = Counter(
            "sluice_engine_generated_tokens", "Tokens generated.", ["model"], registry=self.registry
        ).labels(model)

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token_latency(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived together after `seconds`: each counts as one gap of the average length."""
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)

    def count_generated_tokens(self, num_tokens: int) -> None:
        self._generated.inc(num_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
