"""Autoscaling signals: a tier's queue depth by priority class, running sequences and KV utilisation, from
the engine's scheduler through the client to the gateway's /metrics."""

from __future__ import annotations

from engines.api.client import TierLoad
from engines.serving import InProcessEngineClient, OpenAIServing
from gateway.metrics import Metrics


class _Loaded:
    """A tier reporting a fixed load (the exporter's input, not an engine)."""

    def __init__(self, load: TierLoad | None) -> None:
        self._load = load

    def load(self) -> TierLoad | None:
        return self._load


def test_the_gateway_exports_each_reporting_tiers_load_at_scrape_time() -> None:
    metrics = Metrics()
    tiers = {"small": _Loaded(TierLoad(3, 5, 2, 0.25)), "up": _Loaded(None)}
    metrics.watch_tiers(tiers, {"small": 1.5, "up": 0.0}.__getitem__)  # type: ignore[arg-type]
    text = metrics.render().decode()
    assert 'sluice_tier_waiting_sequences{priority="interactive",tier="small"} 3.0' in text
    assert 'sluice_tier_waiting_sequences{priority="batch",tier="small"} 5.0' in text
    assert 'sluice_tier_running_sequences{tier="small"} 2.0' in text
    assert 'sluice_tier_kv_cache_utilisation{tier="small"} 0.25' in text
    assert 'sluice_tier_slo_pressure{tier="small"} 1.5' in text
    assert 'sluice_tier_waiting_sequences{priority="batch",tier="up"}' not in text  # an upstream reports its own


async def test_an_in_process_tier_reports_its_engines_load(serving: OpenAIServing) -> None:
    client = InProcessEngineClient(serving)
    stats = serving.engine.stats()
    load = client.load()
    assert (load.waiting_interactive + load.waiting_batch, load.waiting_batch) == (stats.num_waiting,
                                                                                 stats.num_waiting_batch)
    assert load.running == stats.num_running
    assert load.kv_utilisation == stats.kv_blocks_used / stats.kv_blocks_total
