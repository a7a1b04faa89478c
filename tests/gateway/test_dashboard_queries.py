"""The dashboard's numbers equal what the seeded rows add up to, computed here independently (loops over
the records, no SQL), on Postgres and SQLite, for a 30-day range and for a filtered 24-hour range."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from gateway.accounting import RequestRecord
from gateway.admin import queries
from gateway.admin.queries import Scope
from gateway.config import PolicyConfig
from gateway.db import histogram
from gateway.db.database import make_database
from gateway.db.migrate import upgrade_async
from tests.conftest import _new_postgres_database
from tests.dashboard_data import seed
from tests.gateway.conftest import make_settings

END = datetime(2026, 11, 30, tzinfo=UTC)
SETTINGS = make_settings()
SCOPES = {
    "30 days": Scope(start=END - timedelta(days=30), end=END),
    "one feature, 24 hours": Scope(start=END - timedelta(hours=24), end=END, feature="code-review"),
    "one tenant, 7 days": Scope(start=END - timedelta(days=7), end=END, tenant="globex"),
}


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
async def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple]:
    if request.param == "postgres":
        async with _new_postgres_database(migrated=True) as url:
            engine = make_database(url)
            yield engine, await seed(engine, SETTINGS, end=END)
            await engine.dispose()
    else:
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('dash') / 'sluice.db'}"
        await upgrade_async(url)
        engine = make_database(url)
        yield engine, await seed(engine, SETTINGS, end=END)
        await engine.dispose()


@pytest.fixture(params=list(SCOPES))
def scope(request: pytest.FixtureRequest) -> Scope:
    return SCOPES[request.param]


def in_scope(records: list[RequestRecord], scope: Scope) -> list[RequestRecord]:
    return [
        r
        for r in records
        if scope.start <= r.created_at < scope.end
        and scope.feature in (None, r.feature)
        and scope.tenant in (None, r.tenant)
    ]


def bucket_of(r: RequestRecord, scope: Scope) -> int:
    return int((r.created_at - scope.start).total_seconds() // scope.bucket.total_seconds())


async def test_escalation_rate_per_feature_and_bucket(seeded: tuple, scope: Scope) -> None:
    engine, data = seeded
    panel = await queries.escalation(engine, scope)
    rows = in_scope(data.records, scope)
    width = math.ceil((scope.end - scope.start) / scope.bucket)
    assert len(panel.axis.buckets) == width
    routed: dict[str, list[int]] = defaultdict(lambda: [0] * width)
    escalated: dict[str, list[int]] = defaultdict(lambda: [0] * width)
    for r in rows:
        if r.tier is not None:
            routed[r.feature][bucket_of(r, scope)] += 1
            escalated[r.feature][bucket_of(r, scope)] += r.escalated
    by_feature = {row.feature: row for row in panel.features}
    assert set(by_feature) == {r.feature for r in rows}
    for feature, row in by_feature.items():
        assert row.requests == sum(r.feature == feature for r in rows)
        assert row.routed == sum(routed[feature]) and row.escalations == sum(escalated[feature])
        assert row.escalation_rate == pytest.approx(sum(escalated[feature]) / sum(routed[feature]))
        assert row.cost_usd == pytest.approx(sum(r.cost_usd for r in rows if r.feature == feature))
    rates = [row.escalation_rate for row in panel.features]
    assert rates == sorted(rates, reverse=True)  # the feature that escalates most comes first
    for series in panel.series:
        expected = [e / n if n else None for e, n in zip(escalated[series.name], routed[series.name], strict=True)]
        assert series.values == pytest.approx(expected)


async def test_cost_per_feature_and_bucket_and_per_tier_against_the_large_tier(seeded: tuple, scope: Scope) -> None:
    engine, data = seeded
    panel = await queries.cost(engine, scope, SETTINGS)
    rows = in_scope(data.records, scope)
    for series in panel.series:
        expected = [0.0] * len(panel.axis.buckets)
        for r in rows:
            if r.feature == series.name:
                expected[bucket_of(r, scope)] += r.cost_usd
        assert series.values == pytest.approx(expected)
    large = SETTINGS.tiers["large"]
    all_large = 0.0
    for tier in panel.tiers:
        served = [r for r in rows if r.tier == tier.tier]
        tokens = sum(r.prompt_tokens + r.completion_tokens for r in served)
        spent = sum(r.cost_usd for r in served)
        assert (tier.requests, tier.cost_usd) == (len(served), pytest.approx(spent))
        assert tier.cost_per_mtok_usd == pytest.approx(spent / tokens * 1e6)
        at_large = sum(
            (r.prompt_tokens - r.cached_tokens) * large.price_input_per_mtok / 1e6
            + r.cached_tokens * large.price_cached_input_per_mtok / 1e6
            + r.completion_tokens * large.price_output_per_mtok / 1e6
            for r in served
        )
        assert tier.all_large_cost_usd == pytest.approx(at_large)
        all_large += at_large
    assert {t.tier for t in panel.tiers} == {r.tier for r in rows if r.tier}
    assert panel.savings_usd == pytest.approx(all_large - sum(r.cost_usd for r in rows))
    assert panel.savings_usd > 0  # the seeded cascade sends most traffic to the cheaper tier


async def test_cache_hit_rates_and_savings(seeded: tuple, scope: Scope) -> None:
    engine, data = seeded
    panel = await queries.cache(engine, scope)
    rows = in_scope(data.records, scope)
    exact = sum(r.cache_status == "exact" for r in rows)
    semantic = sum(r.cache_status == "semantic" for r in rows)
    assert (panel.requests, panel.exact_hits, panel.semantic_hits) == (len(rows), exact, semantic)
    assert panel.hit_rate == pytest.approx((exact + semantic) / len(rows))
    assert panel.total_cost_saved_usd == pytest.approx(sum(r.cost_saved_usd for r in rows))
    assert sum(panel.cost_saved_usd) == pytest.approx(panel.total_cost_saved_usd)
    per_bucket = defaultdict(lambda: [0, 0])
    for r in rows:
        per_bucket[bucket_of(r, scope)][0] += 1
        per_bucket[bucket_of(r, scope)][1] += r.cache_status == "semantic"
    for index, rate in enumerate(panel.semantic_hit_rate):
        count, hits = per_bucket.get(index, (0, 0))
        assert rate == (pytest.approx(hits / count) if count else None)


async def test_latency_percentiles_per_tier_are_within_one_histogram_bucket_of_the_exact_ones(
    seeded: tuple, scope: Scope
) -> None:
    engine, data = seeded
    panel = await queries.latency(engine, scope, SETTINGS)
    rows = in_scope(data.records, scope)
    assert {t.tier for t in panel.tiers} == {r.tier for r in rows if r.tier}
    for tier in panel.tiers:
        for metric, field in (("ttft", "ttft_ms"), ("itl", "itl_ms_mean")):
            values = sorted(getattr(r, field) for r in rows if r.tier == tier.tier and getattr(r, field) is not None)
            assert getattr(tier, f"{metric}_count") == len(values)
            for q in (50, 99):
                exact = values[math.ceil(q / 100 * len(values)) - 1]
                got = getattr(tier, f"{metric}_p{q}_ms")
                # The value at this rank lies in the bucket the estimate lies in.
                assert histogram.bucket_of(got) == histogram.bucket_of(exact) or math.isclose(
                    got, histogram.bucket_bounds(histogram.bucket_of(exact))[1]
                ), (tier.tier, metric, q, got, exact)
        config = SETTINGS.tiers[tier.tier]
        assert (tier.slo_ttft_p99_ms, tier.slo_itl_p99_ms) == (config.slo_ttft_p99_ms, config.slo_itl_p99_ms)
        assert tier.ttft_within_slo == (tier.ttft_p99_ms <= config.slo_ttft_p99_ms)


async def test_quality_delta_per_feature_and_evaluation_runs(seeded: tuple, scope: Scope) -> None:
    engine, data = seeded
    panel = await queries.quality(engine, scope, SETTINGS)
    shadows = [
        s
        for s in data.shadows
        if scope.start <= s["created_at"] < scope.end
        and scope.feature in (None, s["feature"])
        and scope.tenant in (None, s["tenant"])
    ]
    assert {f.feature for f in panel.features} == {s["feature"] for s in shadows}
    for row in panel.features:
        mine = [s["agreement"] for s in shadows if s["feature"] == row.feature]
        assert row.shadow_runs == len(mine)
        assert row.quality_delta == pytest.approx(1 - sum(mine) / len(mine))
    evals = sorted((e for e in data.evals if scope.start <= e["created_at"] < scope.end), key=lambda e: e["created_at"])
    assert [run.id for run in panel.eval_runs] == [e["id"] for e in reversed(evals)]
    assert panel.disagreements == []  # no feature logs content in these settings


async def test_prompt_text_is_shown_only_for_features_that_log_content(seeded: tuple) -> None:
    engine, _ = seeded
    settings = msgspec.structs.replace(
        SETTINGS, policies={"default": PolicyConfig(), "code-review": PolicyConfig(log_content=True)}
    )
    panel = await queries.quality(engine, SCOPES["30 days"], settings)
    assert panel.disagreements and {d.feature for d in panel.disagreements} == {"code-review"}
    assert all(d.agreement < 1 and d.prompt.startswith("prompt of ") for d in panel.disagreements)


async def test_top_keys_by_spend_with_budget_status(seeded: tuple, scope: Scope) -> None:
    engine, data = seeded
    now = END - timedelta(minutes=1)
    panel = await queries.top_keys(engine, scope, SETTINGS, now=now, limit=5)
    rows = in_scope(data.records, scope)
    spend: dict[str, float] = defaultdict(float)
    for r in rows:
        spend[r.key_id] += r.cost_usd
    expected = sorted(spend.items(), key=lambda item: (-item[1], item[0]))[:5]
    assert [k.id for k in panel.keys] == [key_id for key_id, _ in expected]
    keys = {key.id: key for key in data.keys}
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    for row in panel.keys:
        assert row.cost_usd == pytest.approx(spend[row.id])
        day = sum(r.cost_usd for r in data.records if r.key_id == row.id and r.created_at >= today)
        assert row.spent_today_usd == pytest.approx(day)
        budget = keys[row.id].policy.get("spend_per_day_usd")
        assert row.spend_per_day_usd == budget
        if budget is None:
            assert row.budget_status == "none"
        else:
            assert row.budget_status == ("exhausted" if day >= budget else "warning" if day >= 0.8 * budget else "ok")


async def test_error_counts_by_code(seeded: tuple, scope: Scope) -> None:
    engine, data = seeded
    panel = await queries.errors(engine, scope)
    rows = in_scope(data.records, scope)
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for r in rows:
        if r.status >= 400:
            counts[r.error_code, r.status] += 1
    assert {(c.code, c.status): c.count for c in panel.codes} == counts
    assert panel.requests == len(rows) and panel.errors == sum(counts.values())
    assert [c.count for c in panel.codes] == sorted((c.count for c in panel.codes), reverse=True)


async def test_filter_choices_are_the_tenants_and_features_with_traffic(seeded: tuple) -> None:
    engine, data = seeded
    choices = await queries.choices(engine, SCOPES["30 days"])
    assert choices.features == sorted({r.feature for r in data.records})
    assert choices.tenants == sorted({r.tenant for r in data.records})


async def test_an_empty_range_gives_empty_panels(seeded: tuple) -> None:
    engine, _ = seeded
    scope = Scope(start=datetime(2020, 1, 1, tzinfo=UTC), end=datetime(2020, 1, 2, tzinfo=UTC))
    assert (await queries.escalation(engine, scope)).features == []
    assert (await queries.cost(engine, scope, SETTINGS)).savings_usd == 0
    assert (await queries.cache(engine, scope)).hit_rate is None
    assert (await queries.latency(engine, scope, SETTINGS)).tiers == []
    assert (await queries.quality(engine, scope, SETTINGS)).features == []
    assert (await queries.top_keys(engine, scope, SETTINGS)).keys == []
    assert (await queries.errors(engine, scope)).error_rate is None


def test_a_range_of_up_to_two_days_is_bucketed_by_hour_and_longer_ones_by_day() -> None:
    now = datetime(2026, 5, 4, 13, 20, tzinfo=UTC)
    day = Scope.last(timedelta(hours=24), now=now)
    assert (day.start, day.end, day.bucket) == (
        datetime(2026, 5, 3, 14, tzinfo=UTC),
        datetime(2026, 5, 4, 14, tzinfo=UTC),
        timedelta(hours=1),
    )
    week = Scope.last(timedelta(days=7), now=now)
    assert (week.start, week.bucket, len(week.bucket_starts())) == (
        datetime(2026, 4, 27, tzinfo=UTC),
        timedelta(days=1),
        8,
    )
