"""SLO-aware admission: batch work stops first when a tier's interactive latency nears its objectives, then
new interactive requests for that tier get 429 + Retry-After; goodput counts requests within the SLOs."""

from __future__ import annotations

import pytest

from engines.api.errors import APIError
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from gateway.slo import SloTracker
from tests.gateway.conftest import chat, make_settings, start


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tracker(clock: Clock) -> SloTracker:
    return SloTracker(make_settings().tiers, clock=clock, window_s=30.0, min_samples=20)  # small: 1500 / 150 ms


def test_pressure_is_the_worse_p99_over_its_objective_and_ages_out_of_the_window():
    clock = Clock()
    slo = tracker(clock)
    for _ in range(19):
        slo.observe("small", 3000.0, 10.0)
    assert slo.pressure("small") == 0.0  # too few samples for a verdict
    clock.now += 1
    slo.observe("small", 3000.0, 10.0)
    assert slo.pressure("small") == pytest.approx(2.0) and slo.overloaded("small") and not slo.batch_may_run()
    clock.now += 31
    assert slo.pressure("small") == 0.0 and slo.batch_may_run()


def test_batch_work_stops_before_interactive_requests_are_refused():
    clock = Clock()
    slo = tracker(clock)
    for _ in range(100):
        slo.observe("small", 1300.0, 50.0)  # p99 TTFT at 87% of 1500 ms: at risk, not over
    assert not slo.batch_may_run() and not slo.overloaded("small")
    assert slo.observe("small", 1300.0, 50.0) and not slo.observe("small", 1600.0, 50.0)  # within the SLOs?


async def test_an_overloaded_tier_refuses_new_interactive_requests_with_retry_after(tiers, records):
    clock = Clock()
    slo = tracker(clock)
    metrics = Metrics()
    gateway = Gateway(make_settings(), tiers, _counters(), records.append, metrics, slo=slo)
    await gateway.chat(await start(gateway), chat(model="sluice-small"))  # non-streamed: nothing to judge
    for _ in range(30):
        slo.observe("small", 2000.0, 20.0)
    clock.now += 1
    with pytest.raises(APIError) as refused:
        await gateway.chat(await start(gateway), chat(model="sluice-small"))
    assert (refused.value.status_code, refused.value.code, refused.value.headers) == (
        429, "slo_overloaded", {"Retry-After": "1"})
    state = await start(gateway)
    state.priority = "batch"  # a Batch API line: its worker stops claiming lines instead (batch_may_run)
    await gateway.chat(state, chat(model="sluice-small"))
    await gateway.chat(await start(gateway), chat(model="sluice-large"))  # the other tier is fine
    assert [r.status for r in records] == [200, 429, 200, 200]
    assert 'sluice_goodput_requests_total{tier="small"} 1.0' in metrics.render().decode()


def _counters():
    from gateway.counters import InProcessCounterStore

    return InProcessCounterStore()
