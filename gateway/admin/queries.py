"""The dashboard's numbers: SQL aggregations over the rollups (`daily_usage`, `hourly_usage`,
`key_hourly_usage`), `requests`, `shadow_runs`, `eval_runs` and `api_keys`, one function per panel, the
same on Postgres and SQLite.

Ranges of up to two days read the hourly rollup and are drawn by hour; longer ones read the daily
rollup and are drawn by day. Either way a panel reads a few rows per (day or hour, tenant, feature,
tier), whatever the request volume; latency percentiles come from the rollups' histogram columns.
Only the error panel reads `requests`, through a partial index covering the failed ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config import Settings, TierConfig
from gateway.cost import TOKENS_PER_PRICE_UNIT
from gateway.db import histogram
from gateway.db.schema import (
    api_keys,
    daily_errors,
    daily_usage,
    eval_runs,
    hourly_usage,
    key_hourly_usage,
    requests,
    shadow_runs,
)
from gateway.keys import effective_policy

HOURLY_BUCKETS_UP_TO = timedelta(hours=48)  # longer ranges are bucketed by day
RANGES = {"24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30), "90d": timedelta(days=90)}
NO_TIER = ""  # hourly_usage.tier of requests no tier served (cache hits, rejections)
BUDGET_WARNING_SHARE = 0.8


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """A time range [start, end) in UTC, and optionally one feature and/or one tenant."""

    start: datetime
    end: datetime
    feature: str | None = None
    tenant: str | None = None

    @classmethod
    def last(cls, span: timedelta, *, now: datetime | None = None, **filters: str | None) -> Scope:
        """The `span` up to the end of the current hour; daily ranges start at midnight."""
        now = (now or datetime.now(UTC)).astimezone(UTC)
        end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        start = end - span
        if span > HOURLY_BUCKETS_UP_TO:
            start = start.replace(hour=0)
        return cls(start=start, end=end, **filters)

    @property
    def bucket(self) -> timedelta:
        return timedelta(hours=1) if self.end - self.start <= HOURLY_BUCKETS_UP_TO else timedelta(days=1)

    def bucket_starts(self) -> list[datetime]:
        count = math.ceil((self.end - self.start) / self.bucket)
        return [self.start + i * self.bucket for i in range(count)]

    @property
    def daily(self) -> bool:
        return self.bucket == timedelta(days=1)

    def bucket_index(self, moment: datetime | date) -> int:
        if not isinstance(moment, datetime):
            moment = datetime.combine(moment, time(), UTC)
        return int((_utc(moment) - self.start) // self.bucket)

    def where(self, table: sa.Table, time_column: str) -> list[sa.ColumnElement[bool]]:
        column = table.c[time_column]
        conditions = [column >= self.start, column < self.end]
        if self.feature:
            conditions.append(table.c.feature == self.feature)
        if self.tenant:
            conditions.append(table.c.tenant == self.tenant)
        return conditions


def _utc(moment: datetime) -> datetime:
    """SQLite hands datetimes back without offset; they are UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


class Series(msgspec.Struct, kw_only=True):
    name: str
    values: list[float | None]  # one per bucket; None where there is nothing to divide


class TimeAxis(msgspec.Struct, kw_only=True):
    start: datetime
    end: datetime
    bucket_s: int
    buckets: list[int]  # bucket starts, Unix seconds (what uPlot reads)

    @classmethod
    def of(cls, scope: Scope) -> TimeAxis:
        starts = scope.bucket_starts()
        return cls(
            start=scope.start,
            end=scope.end,
            bucket_s=int(scope.bucket.total_seconds()),
            buckets=[int(s.timestamp()) for s in starts],
        )


async def _rows(engine: AsyncEngine, query: sa.Select[Any]) -> Sequence[sa.Row[Any]]:
    async with engine.connect() as connection:
        return (await connection.execute(query)).all()


def _usage(scope: Scope) -> sa.Table:
    """The rollup a scope reads: by day for long ranges, by hour for short ones."""
    return daily_usage if scope.daily else hourly_usage


def _when(usage: sa.Table) -> sa.ColumnElement[Any]:
    return usage.c.day if usage is daily_usage else usage.c.hour


def _usage_where(scope: Scope, usage: sa.Table) -> list[sa.ColumnElement[bool]]:
    """The scope's conditions on a rollup keyed by `hour` or (daily_usage, daily_errors) by `day`."""
    if "day" not in usage.c:
        return scope.where(usage, "hour")
    last = (scope.end - timedelta(microseconds=1)).date()  # the day holding the range's last moment
    conditions = [usage.c.day >= scope.start.date(), usage.c.day <= last]
    if scope.feature:
        conditions.append(usage.c.feature == scope.feature)
    if scope.tenant:
        conditions.append(usage.c.tenant == scope.tenant)
    return conditions


def _sum(usage: sa.Table, column: str) -> sa.ColumnElement[Any]:
    return sa.func.coalesce(sa.func.sum(usage.c[column]), 0)


def _routed_requests(usage: sa.Table) -> sa.ColumnElement[Any]:
    """Requests a tier served or attempted (the denominator of the escalation rate)."""
    return sa.func.coalesce(sa.func.sum(sa.case((usage.c.tier != NO_TIER, usage.c.requests), else_=0)), 0)


# -- escalation: the headline -------------------------------------------------------------------


class FeatureEscalation(msgspec.Struct, kw_only=True):
    feature: str
    requests: int
    routed: int  # requests a tier served (cache hits and refusals excluded)
    escalations: int
    escalation_rate: float | None  # escalations / routed
    cost_usd: float


class EscalationPanel(msgspec.Struct, kw_only=True):
    axis: TimeAxis
    series: list[Series]  # escalation rate per bucket, one series per feature
    features: list[FeatureEscalation]  # highest escalation rate first


async def escalation(engine: AsyncEngine, scope: Scope) -> EscalationPanel:
    usage = _usage(scope)
    query = (
        sa.select(
            _when(usage),
            usage.c.feature,
            _sum(usage, "requests"),
            _routed_requests(usage),
            _sum(usage, "escalations"),
            _sum(usage, "cost_usd"),
        )
        .where(*_usage_where(scope, usage))
        .group_by(_when(usage), usage.c.feature)
    )
    axis = TimeAxis.of(scope)
    width = len(axis.buckets)
    per_bucket: dict[str, list[list[int]]] = defaultdict(lambda: [[0, 0] for _ in range(width)])
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
    for hour, feature, count, routed, escalations, cost in await _rows(engine, query):
        cell = per_bucket[feature][scope.bucket_index(hour)]
        cell[0] += routed
        cell[1] += escalations
        total = totals[feature]
        for index, value in enumerate((count, routed, escalations, cost)):
            total[index] += value
    features = sorted(
        (
            FeatureEscalation(
                feature=feature,
                requests=int(count),
                routed=int(routed),
                escalations=int(escalations),
                escalation_rate=_ratio(escalations, routed),
                cost_usd=float(cost),
            )
            for feature, (count, routed, escalations, cost) in totals.items()
        ),
        key=lambda row: (-(row.escalation_rate or 0.0), row.feature),
    )
    series = [Series(name=row.feature, values=[_ratio(e, r) for r, e in per_bucket[row.feature]]) for row in features]
    return EscalationPanel(axis=axis, series=series, features=features)


# -- cost -------------------------------------------------------------------------------------------


class TierCost(msgspec.Struct, kw_only=True):
    tier: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_usd: float
    cost_per_mtok_usd: float | None  # per million tokens (prompt + completion)
    all_large_cost_usd: float  # the same tokens at the large tier's prices


class CostPanel(msgspec.Struct, kw_only=True):
    axis: TimeAxis
    series: list[Series]  # cost (USD) per bucket, one series per feature, most expensive first
    tiers: list[TierCost]
    large_tier: str | None
    cost_usd: float  # everything the tiers cost in the range
    all_large_cost_usd: float  # had every served request gone to the large tier
    savings_usd: float  # all_large_cost_usd - cost_usd


def large_tier(settings: Settings) -> str | None:
    """The tier everything would go to without a cascade: `large` when configured, else the dearest."""
    if "large" in settings.tiers:
        return "large"
    if not settings.tiers:
        return None
    return max(settings.tiers, key=lambda name: settings.tiers[name].price_output_per_mtok)


def _price(tier: TierConfig, prompt: int, completion: int, cached: int) -> float:
    return (
        (prompt - cached) * tier.price_input_per_mtok
        + cached * tier.price_cached_input_per_mtok
        + completion * tier.price_output_per_mtok
    ) / TOKENS_PER_PRICE_UNIT


async def cost(engine: AsyncEngine, scope: Scope, settings: Settings) -> CostPanel:
    usage = _usage(scope)
    by_feature = (
        sa.select(_when(usage), usage.c.feature, _sum(usage, "cost_usd"))
        .where(*_usage_where(scope, usage))
        .group_by(_when(usage), usage.c.feature)
    )
    by_tier = (
        sa.select(
            usage.c.tier,
            *(
                _sum(usage, name)
                for name in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost_usd")
            ),
        )
        .where(*_usage_where(scope, usage), usage.c.tier != NO_TIER)
        .group_by(usage.c.tier)
    )
    axis = TimeAxis.of(scope)
    per_feature: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(axis.buckets))
    for hour, feature, spent in await _rows(engine, by_feature):
        per_feature[feature][scope.bucket_index(hour)] += spent
    series = sorted(
        (Series(name=name, values=list(values)) for name, values in per_feature.items()),
        key=lambda s: (-sum(v or 0.0 for v in s.values), s.name),
    )
    large_name = large_tier(settings)
    large = settings.tiers.get(large_name) if large_name else None
    tiers = []
    for tier, count, *token_sums, spent in await _rows(engine, by_tier):
        prompt, completion, cached = (int(n) for n in token_sums)  # Postgres sums bigints as numeric
        tokens = prompt + completion
        tiers.append(
            TierCost(
                tier=tier,
                requests=int(count),
                prompt_tokens=int(prompt),
                completion_tokens=int(completion),
                cached_tokens=int(cached),
                cost_usd=float(spent),
                cost_per_mtok_usd=spent * TOKENS_PER_PRICE_UNIT / tokens if tokens else None,
                all_large_cost_usd=_price(large, prompt, completion, cached) if large else float(spent),
            )
        )
    tiers.sort(key=lambda row: row.tier)
    total = sum(row.cost_usd for row in tiers)
    all_large = sum(row.all_large_cost_usd for row in tiers)
    return CostPanel(
        axis=axis,
        series=series,
        tiers=tiers,
        large_tier=large_name,
        cost_usd=total,
        all_large_cost_usd=all_large,
        savings_usd=all_large - total,
    )


# -- response cache ------------------------------------------------------------------------------------


class CachePanel(msgspec.Struct, kw_only=True):
    axis: TimeAxis
    exact_hit_rate: list[float | None]  # per bucket: exact hits / requests
    semantic_hit_rate: list[float | None]
    cost_saved_usd: list[float]  # per bucket
    requests: int
    exact_hits: int
    semantic_hits: int
    hit_rate: float | None
    total_cost_saved_usd: float


async def cache(engine: AsyncEngine, scope: Scope) -> CachePanel:
    usage = _usage(scope)
    query = (
        sa.select(
            _when(usage),
            _sum(usage, "requests"),
            _sum(usage, "cache_hits"),
            _sum(usage, "semantic_cache_hits"),
            _sum(usage, "cost_saved_usd"),
        )
        .where(*_usage_where(scope, usage))
        .group_by(_when(usage))
    )
    axis = TimeAxis.of(scope)
    cells = [[0, 0, 0, 0.0] for _ in axis.buckets]  # requests, exact, semantic, saved
    for hour, count, hits, semantic, saved in await _rows(engine, query):
        cell = cells[scope.bucket_index(hour)]
        cell[0] += count
        cell[1] += hits - semantic
        cell[2] += semantic
        cell[3] += saved
    count, exact, semantic, saved = (sum(cell[i] for cell in cells) for i in range(4))
    return CachePanel(
        axis=axis,
        exact_hit_rate=[_ratio(cell[1], cell[0]) for cell in cells],
        semantic_hit_rate=[_ratio(cell[2], cell[0]) for cell in cells],
        cost_saved_usd=[float(cell[3]) for cell in cells],
        requests=int(count),
        exact_hits=int(exact),
        semantic_hits=int(semantic),
        hit_rate=_ratio(exact + semantic, count),
        total_cost_saved_usd=float(saved),
    )


# -- latency against the SLOs ---------------------------------------------------------------------------


class TierLatency(msgspec.Struct, kw_only=True):
    tier: str
    ttft_count: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    slo_ttft_p99_ms: float | None
    itl_count: int
    itl_p50_ms: float | None  # of each request's mean inter-token latency
    itl_p99_ms: float | None
    slo_itl_p99_ms: float | None
    ttft_within_slo: bool | None
    itl_within_slo: bool | None


class LatencyPanel(msgspec.Struct, kw_only=True):
    axis: TimeAxis
    ttft_p99_ms: list[Series]  # per bucket, one series per tier
    itl_p99_ms: list[Series]
    tiers: list[TierLatency]
    resolution: float  # a percentile is within this factor of the exact value (one histogram bucket)


def _within(value: float | None, slo: float | None) -> bool | None:
    return None if value is None or slo is None else value <= slo


async def latency(engine: AsyncEngine, scope: Scope, settings: Settings) -> LatencyPanel:
    usage = _usage(scope)
    columns = [_sum(usage, name) for metric in histogram.METRICS for name in histogram.COLUMNS[metric]]
    query = (
        sa.select(_when(usage), usage.c.tier, *columns)
        .where(*_usage_where(scope, usage), usage.c.tier != NO_TIER)
        .group_by(_when(usage), usage.c.tier)
    )
    axis = TimeAxis.of(scope)
    width, n = len(axis.buckets), histogram.BUCKETS
    per_bucket: dict[str, list[list[int]]] = defaultdict(lambda: [[0] * (2 * n) for _ in range(width)])
    for hour, tier, *counts in await _rows(engine, query):
        cell = per_bucket[tier][scope.bucket_index(hour)]
        for index, count in enumerate(counts):
            cell[index] += count
    tiers, ttft_series, itl_series = [], [], []
    for tier in sorted(per_bucket):
        cells = per_bucket[tier]
        total = [sum(column) for column in zip(*cells, strict=True)]
        ttft, itl = total[:n], total[n:]
        config = settings.tiers.get(tier)
        slo_ttft = config.slo_ttft_p99_ms if config else None
        slo_itl = config.slo_itl_p99_ms if config else None
        ttft_p99, itl_p99 = histogram.percentile(ttft, 0.99), histogram.percentile(itl, 0.99)
        tiers.append(
            TierLatency(
                tier=tier,
                ttft_count=sum(ttft),
                ttft_p50_ms=histogram.percentile(ttft, 0.5),
                ttft_p99_ms=ttft_p99,
                slo_ttft_p99_ms=slo_ttft,
                itl_count=sum(itl),
                itl_p50_ms=histogram.percentile(itl, 0.5),
                itl_p99_ms=itl_p99,
                slo_itl_p99_ms=slo_itl,
                ttft_within_slo=_within(ttft_p99, slo_ttft),
                itl_within_slo=_within(itl_p99, slo_itl),
            )
        )
        ttft_series.append(Series(name=tier, values=[histogram.percentile(c[:n], 0.99) for c in cells]))
        itl_series.append(Series(name=tier, values=[histogram.percentile(c[n:], 0.99) for c in cells]))
    return LatencyPanel(
        axis=axis,
        ttft_p99_ms=ttft_series,
        itl_p99_ms=itl_series,
        tiers=tiers,
        resolution=2 ** (1 / histogram.PER_OCTAVE),
    )


# -- quality: is the small tier hurting anyone? -----------------------------------------------------------


class FeatureQuality(msgspec.Struct, kw_only=True):
    feature: str
    shadow_runs: int  # small-tier answers compared against the large tier's
    agreement: float  # mean agreement, 1 = always the same answer
    quality_delta: float  # 1 - agreement: the share of answers the small tier got differently
    large_cost_usd: float  # what the shadow answers cost


class Disagreement(msgspec.Struct, kw_only=True):
    """A shadow comparison the small tier lost; only for features whose policy logs content."""

    created_at: datetime
    feature: str
    agreement: float
    prompt: str
    small_answer: str
    large_answer: str


class EvalRun(msgspec.Struct, kw_only=True):
    id: str
    created_at: datetime
    router_version: str | None
    dataset: str
    rows: int
    metrics: dict[str, Any]


class QualityPanel(msgspec.Struct, kw_only=True):
    features: list[FeatureQuality]  # largest quality delta first
    eval_runs: list[EvalRun]  # newest first, within the range
    disagreements: list[Disagreement]


DISAGREEMENTS_SHOWN = 5
EVAL_RUNS_SHOWN = 10


async def quality(engine: AsyncEngine, scope: Scope, settings: Settings) -> QualityPanel:
    by_feature = (
        sa.select(
            shadow_runs.c.feature,
            sa.func.count(),
            sa.func.avg(shadow_runs.c.agreement),
            sa.func.coalesce(sa.func.sum(shadow_runs.c.large_cost_usd), 0),
        )
        .where(*scope.where(shadow_runs, "created_at"))
        .group_by(shadow_runs.c.feature)
    )
    runs = (
        sa.select(eval_runs)
        .where(eval_runs.c.created_at >= scope.start, eval_runs.c.created_at < scope.end)
        .order_by(eval_runs.c.created_at.desc())
        .limit(EVAL_RUNS_SHOWN)
    )
    features = sorted(
        (
            FeatureQuality(
                feature=feature,
                shadow_runs=int(count),
                agreement=float(agreement),
                quality_delta=1.0 - float(agreement),
                large_cost_usd=float(spent),
            )
            for feature, count, agreement, spent in await _rows(engine, by_feature)
        ),
        key=lambda row: (-row.quality_delta, row.feature),
    )
    logged = sorted(f for f in {row.feature for row in features} if settings.policy_for(f).log_content)
    return QualityPanel(
        features=features,
        eval_runs=[
            EvalRun(
                id=row.id,
                created_at=_utc(row.created_at),
                router_version=row.router_version,
                dataset=row.dataset,
                rows=row.rows,
                metrics=dict(row.metrics or {}),
            )
            for row in await _rows(engine, runs)
        ],
        disagreements=await _disagreements(engine, scope, logged),
    )


async def _disagreements(engine: AsyncEngine, scope: Scope, features: list[str]) -> list[Disagreement]:
    """Prompt text is read only for features whose policy sets `log_content`."""
    if not features:
        return []
    query = (
        sa.select(
            shadow_runs.c.created_at,
            shadow_runs.c.feature,
            shadow_runs.c.agreement,
            shadow_runs.c.prompt,
            shadow_runs.c.small_answer,
            shadow_runs.c.large_answer,
        )
        .where(*scope.where(shadow_runs, "created_at"), shadow_runs.c.feature.in_(features))
        .where(shadow_runs.c.agreement < 1.0)
        .order_by(shadow_runs.c.created_at.desc())
        .limit(DISAGREEMENTS_SHOWN)
    )
    return [
        Disagreement(
            created_at=_utc(row.created_at),
            feature=row.feature,
            agreement=row.agreement,
            prompt=row.prompt,
            small_answer=row.small_answer,
            large_answer=row.large_answer,
        )
        for row in await _rows(engine, query)
    ]


# -- keys: top spenders and their budgets -------------------------------------------------------------------


class KeySpend(msgspec.Struct, kw_only=True):
    id: str
    prefix: str
    tenant: str
    feature: str
    name: str
    revoked: bool
    requests: int  # in the range
    cost_usd: float  # in the range
    spent_today_usd: float  # this UTC day, whatever the range
    spent_this_month_usd: float
    spend_per_day_usd: float | None  # the effective budget (feature policy with the key's overrides)
    spend_per_month_usd: float | None
    budget_status: str  # none | ok | warning (≥ 80 % of a budget) | exhausted


class KeysPanel(msgspec.Struct, kw_only=True):
    keys: list[KeySpend]  # most spent first


TOP_KEYS = 10


def _key_where(scope: Scope) -> list[sa.ColumnElement[bool]]:
    """Keys in range; a feature or tenant filter through the keys' own tenant and feature."""
    conditions = [key_hourly_usage.c.hour >= scope.start, key_hourly_usage.c.hour < scope.end]
    if scope.feature or scope.tenant:
        keys = sa.select(api_keys.c.id)
        if scope.feature:
            keys = keys.where(api_keys.c.feature == scope.feature)
        if scope.tenant:
            keys = keys.where(api_keys.c.tenant == scope.tenant)
        conditions.append(key_hourly_usage.c.key_id.in_(keys.scalar_subquery()))
    return conditions


def budget_status(spent: Iterable[tuple[float, float | None]]) -> str:
    """The worst state over (spent, budget) pairs; `none` when no budget is set."""
    shares = [amount / budget for amount, budget in spent if budget is not None and budget > 0]
    if not shares:
        return "none"
    worst = max(shares)
    return "exhausted" if worst >= 1.0 else "warning" if worst >= BUDGET_WARNING_SHARE else "ok"


async def top_keys(
    engine: AsyncEngine, scope: Scope, settings: Settings, *, now: datetime | None = None, limit: int = TOP_KEYS
) -> KeysPanel:
    spent = sa.func.coalesce(sa.func.sum(key_hourly_usage.c.cost_usd), 0).label("spent")
    top = (
        sa.select(key_hourly_usage.c.key_id, sa.func.coalesce(sa.func.sum(key_hourly_usage.c.requests), 0), spent)
        .where(*_key_where(scope))
        .group_by(key_hourly_usage.c.key_id)
        .order_by(spent.desc(), key_hourly_usage.c.key_id)
        .limit(limit)
    )
    ranked = await _rows(engine, top)
    if not ranked:
        return KeysPanel(keys=[])
    ids = [row[0] for row in ranked]
    now = (now or datetime.now(UTC)).astimezone(UTC)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = today.replace(day=1)
    budgets = (
        sa.select(
            key_hourly_usage.c.key_id,
            sa.func.coalesce(
                sa.func.sum(sa.case((key_hourly_usage.c.hour >= today, key_hourly_usage.c.cost_usd), else_=0.0)), 0
            ),
            sa.func.coalesce(sa.func.sum(key_hourly_usage.c.cost_usd), 0),
        )
        .where(key_hourly_usage.c.key_id.in_(ids), key_hourly_usage.c.hour >= month)
        .group_by(key_hourly_usage.c.key_id)
    )
    recent = {key_id: (float(day), float(month_total)) for key_id, day, month_total in await _rows(engine, budgets)}
    keys = {row.id: row for row in await _rows(engine, sa.select(api_keys).where(api_keys.c.id.in_(ids)))}
    rows = []
    for key_id, count, total in ranked:
        key = keys.get(key_id)
        day, month_total = recent.get(key_id, (0.0, 0.0))
        policy = effective_policy(settings, key.feature, key.policy or {}) if key else None
        per_day = policy.spend_per_day_usd if policy else None
        per_month = policy.spend_per_month_usd if policy else None
        rows.append(
            KeySpend(
                id=key_id,
                prefix=key.prefix if key else "",
                tenant=key.tenant if key else "",
                feature=key.feature if key else "",
                name=key.name if key else "(deleted key)",
                revoked=key is None or key.revoked_at is not None,
                requests=int(count),
                cost_usd=float(total),
                spent_today_usd=day,
                spent_this_month_usd=month_total,
                spend_per_day_usd=per_day,
                spend_per_month_usd=per_month,
                budget_status=budget_status([(day, per_day), (month_total, per_month)]),
            )
        )
    return KeysPanel(keys=rows)


# -- errors ---------------------------------------------------------------------------------------------


class ErrorCode(msgspec.Struct, kw_only=True):
    code: str  # the OpenAI-style error code; "http_<status>" when none was recorded
    status: int
    count: int
    rate: float | None  # of all requests in the range


class ErrorsPanel(msgspec.Struct, kw_only=True):
    requests: int
    errors: int
    error_rate: float | None
    codes: list[ErrorCode]  # most frequent first


def _failed(scope: Scope) -> sa.Select[Any]:
    """(error code, status, count) of the failed requests: from the daily rollup for long ranges, from
    `requests` through its partial index for short ones."""
    if scope.daily:
        return (
            sa.select(daily_errors.c.error_code, daily_errors.c.status, sa.func.sum(daily_errors.c.requests))
            .where(*_usage_where(scope, daily_errors))
            .group_by(daily_errors.c.error_code, daily_errors.c.status)
        )
    # `status >= 400` spelled exactly as in the partial index's predicate, so that the planner uses it.
    return (
        sa.select(requests.c.error_code, requests.c.status, sa.func.count())
        .where(*scope.where(requests, "created_at"), sa.text("status >= 400"))
        .group_by(requests.c.error_code, requests.c.status)
    )


async def errors(engine: AsyncEngine, scope: Scope) -> ErrorsPanel:
    failed = _failed(scope)
    usage = _usage(scope)
    total = sa.select(_sum(usage, "requests")).where(*_usage_where(scope, usage))
    count = int((await _rows(engine, total))[0][0])
    codes = sorted(
        (
            ErrorCode(code=code or f"http_{status}", status=int(status), count=int(n), rate=_ratio(n, count))
            for code, status, n in await _rows(engine, failed)
        ),
        key=lambda row: (-row.count, row.code, row.status),
    )
    failures = sum(row.count for row in codes)
    return ErrorsPanel(requests=count, errors=failures, error_rate=_ratio(failures, count), codes=codes)


# -- filter choices ---------------------------------------------------------------------------------------


class Choices(msgspec.Struct, kw_only=True):
    features: list[str]
    tenants: list[str]


async def choices(engine: AsyncEngine, scope: Scope) -> Choices:
    """Features and tenants with traffic in the range (the filter's options; other filters ignored)."""
    usage = _usage(scope)
    query = (
        sa.select(usage.c.tenant, usage.c.feature)
        .where(*_usage_where(msgspec.structs.replace(scope, feature=None, tenant=None), usage))
        .distinct()
    )
    rows = await _rows(engine, query)
    return Choices(features=sorted({row[1] for row in rows}), tenants=sorted({row[0] for row in rows}))
