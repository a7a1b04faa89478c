"""The record of one request (`RequestRecord`, one `requests` row) and what it adds to the rollups
(`daily_usage`, `hourly_usage`, `key_hourly_usage`, `daily_errors`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import UTC, date, datetime
from typing import Any

from gateway.db import histogram

# daily_usage.tier is part of the primary key; requests no tier served (cache hits, rejections)
# are rolled up under this name.
NO_TIER = ""
CACHE_HIT_STATUSES = frozenset({"exact", "semantic"})
ROLLUP_COUNTERS = (
    "requests",
    "errors",
    "escalations",
    "cache_hits",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_usd",
    "semantic_cache_hits",
    "cost_saved_usd",
)


def utc_now() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """Naive datetimes are taken as UTC (SQLite hands them back without offset)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@dataclasses.dataclass(kw_only=True, slots=True)
class RequestRecord:
    """One row of `requests`: what happened to one request, as the gateway saw it."""

    request_id: str
    created_at: datetime = dataclasses.field(default_factory=utc_now)
    tenant: str
    feature: str
    key_id: str | None = None
    endpoint: str = "chat"  # chat | completions
    model_requested: str = ""
    route: str | None = None  # tier the router chose
    route_score: float | None = None
    tier: str | None = None  # tier that served; None when none did (cache hit, rejected)
    escalated: bool = False
    fallback: bool = False
    confidence: float | None = None
    cache_status: str = "miss"  # miss | exact | semantic | off
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    itl_ms_mean: float | None = None
    status: int = 200  # HTTP status returned
    error_code: str | None = None
    cache_similarity: float | None = None  # of a semantic hit
    cost_saved_usd: float = 0.0  # what a cache hit saved: the cost of generating the answer
    used_tools: bool = False
    response_format: str | None = None  # json_object | json_schema
    priority: str = "interactive"  # interactive | batch

    def row(self) -> dict[str, Any]:
        """The `requests` row; `created_at` normalised to UTC (SQLite stores it without offset)."""
        values = {name: getattr(self, name) for name in RECORD_FIELDS}
        values["created_at"] = as_utc(self.created_at)
        return values

    @property
    def day(self) -> date:
        """The UTC day the request is accounted to."""
        return as_utc(self.created_at).date()

    @property
    def hour(self) -> datetime:
        """The start of the UTC hour the request is accounted to."""
        return as_utc(self.created_at).replace(minute=0, second=0, microsecond=0)


RECORD_FIELDS = tuple(field.name for field in dataclasses.fields(RequestRecord))


ROLLUP_KEY = ("day", "tenant", "feature", "tier")


def rollup_contribution(record: RequestRecord) -> tuple[tuple[date, str, str, str], tuple[int | float, ...]]:
    """The `daily_usage` row `record` counts towards, and what it adds to each of ROLLUP_COUNTERS."""
    key = (record.day, record.tenant, record.feature, record.tier or NO_TIER)
    counts = (
        1,
        int(record.status >= 400),
        int(record.escalated),
        int(record.cache_status in CACHE_HIT_STATUSES),
        record.prompt_tokens,
        record.completion_tokens,
        record.cached_tokens,
        float(record.cost_usd),
        int(record.cache_status == "semantic"),
        float(record.cost_saved_usd),
    )
    return key, counts


HOURLY_KEY = ("hour", "tenant", "feature", "tier")
KEY_USAGE_KEY = ("hour", "key_id")
KEY_USAGE_COUNTERS = ("requests", "cost_usd")
ERRORS_KEY = ("day", "tenant", "feature", "status", "error_code")
HISTOGRAM_COLUMNS = tuple(name for metric in histogram.METRICS for name in histogram.COLUMNS[metric])


def latency_buckets(record: RequestRecord) -> tuple[int, int]:
    """The histogram buckets of the record's TTFT and mean ITL; -1 where it has none."""
    ttft = -1 if record.ttft_ms is None else histogram.bucket_of(record.ttft_ms)
    itl = -1 if record.itl_ms_mean is None else histogram.bucket_of(record.itl_ms_mean)
    return ttft, itl


def _usage_deltas(records: Iterable[RequestRecord], *, hourly: bool) -> list[dict[str, Any]]:
    """Counters and latency histogram counts per (day or hour, tenant, feature, tier)."""
    offset = len(ROLLUP_COUNTERS)
    sums: dict[tuple[Any, ...], list[int | float]] = {}
    for record in records:
        key, counts = rollup_contribution(record)
        if hourly:
            key = (record.hour, *key[1:])
        total = sums.get(key)
        if total is None:
            total = sums[key] = [0] * (offset + len(HISTOGRAM_COLUMNS))
        for index, count in enumerate(counts):
            total[index] += count
        for metric_index, bucket in enumerate(latency_buckets(record)):
            if bucket >= 0:
                total[offset + metric_index * histogram.BUCKETS + bucket] += 1
    names = (*(HOURLY_KEY if hourly else ROLLUP_KEY), *ROLLUP_COUNTERS, *HISTOGRAM_COLUMNS)
    return [dict(zip(names, (*key, *total), strict=True)) for key, total in sums.items()]


def rollup_deltas(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """What `records` add to `daily_usage`, one entry per (day, tenant, feature, tier)."""
    return _usage_deltas(records, hourly=False)


def hourly_deltas(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """What `records` add to `hourly_usage`, one entry per (hour, tenant, feature, tier)."""
    return _usage_deltas(records, hourly=True)


def key_usage_deltas(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """What `records` made with a key add to `key_hourly_usage`, one entry per (hour, key)."""
    sums: dict[tuple[datetime, str], list[float]] = {}
    for record in records:
        if record.key_id:
            total = sums.setdefault((record.hour, record.key_id), [0, 0.0])
            total[0] += 1
            total[1] += float(record.cost_usd)
    return [
        {"hour": hour, "key_id": key_id, "requests": count, "cost_usd": cost}
        for (hour, key_id), (count, cost) in sums.items()
    ]


def error_deltas(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """What the failed ones of `records` add to `daily_errors`, one entry per (day, tenant, feature,
    status, error code)."""
    counts: dict[tuple[Any, ...], int] = {}
    for record in records:
        if record.status >= 400:
            key = (record.day, record.tenant, record.feature, record.status, record.error_code or "")
            counts[key] = counts.get(key, 0) + 1
    return [dict(zip((*ERRORS_KEY, "requests"), (*key, n), strict=True)) for key, n in counts.items()]
