"""The dashboard's rollups: the accounting writer keeps `hourly_usage` and `daily_usage` (counters and
latency histograms) and `key_hourly_usage` equal to what its rows add up to, replays count once, and
revision 0003 rolls up the rows recorded before it. Postgres and SQLite."""

from __future__ import annotations

import math
import random
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting import RequestRecord, rollup_deltas, write_batch
from gateway.db import histogram, migrate
from gateway.db.database import make_database
from gateway.db.schema import daily_errors, daily_usage, hourly_usage, key_hourly_usage, requests

START = datetime(2026, 3, 1, 22, 10, tzinfo=UTC)


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("postgres_url" if request.param == "postgres" else "sqlite_url")


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_database(database_url)
    yield engine
    await engine.dispose()


def seeded_records(tenant: str, count: int = 300) -> list[RequestRecord]:
    rng = random.Random(7)
    records = []
    for number in range(count):
        tier = rng.choice(["small", "large", None])
        records.append(
            RequestRecord(
                request_id=f"{tenant}-{number}",
                created_at=START + timedelta(minutes=rng.randrange(0, 180)),
                tenant=tenant,
                feature=rng.choice(["chat", "search"]),
                key_id=rng.choice([f"{tenant}-a", f"{tenant}-b", None]),
                tier=tier,
                escalated=tier == "large" and rng.random() < 0.5,
                cache_status="miss" if tier else rng.choice(["exact", "semantic", "miss"]),
                status=(status := rng.choice([200, 200, 200, 429, 502])),
                error_code={200: None, 429: "rate_limit_exceeded", 502: rng.choice(["upstream_error", None])}[status],
                prompt_tokens=rng.randrange(0, 500),
                completion_tokens=rng.randrange(0, 200),
                cost_usd=rng.random() / 100,
                cost_saved_usd=0.0 if tier else rng.random() / 100,
                ttft_ms=rng.choice([None, rng.lognormvariate(5, 1), 0.2, 10**6]),
                itl_ms_mean=rng.choice([None, rng.lognormvariate(3, 0.7)]),
            )
        )
    return records


def expected_rollup(records: list[RequestRecord], *, daily: bool = False) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Computed here from the records, independently of the writer's code."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(Counter)
    for r in records:
        at = r.created_at.astimezone(UTC)
        when = at.date() if daily else at.replace(minute=0, second=0, microsecond=0)
        key = (when, r.feature, r.tier or "")
        row = rows[key]
        row["requests"] += 1
        row["errors"] += r.status >= 400
        row["escalations"] += r.escalated
        row["cache_hits"] += r.cache_status in ("exact", "semantic")
        row["semantic_cache_hits"] += r.cache_status == "semantic"
        row["prompt_tokens"] += r.prompt_tokens
        row["completion_tokens"] += r.completion_tokens
        row["cost_usd"] += r.cost_usd
        row["cost_saved_usd"] += r.cost_saved_usd
        for metric, value in (("ttft", r.ttft_ms), ("itl", r.itl_ms_mean)):
            if value is not None:
                # The bucket by its definition: the first upper edge above the value.
                bucket = next((i for i, edge in enumerate(histogram.EDGES_MS) if value < edge), histogram.BUCKETS - 1)
                row[f"{metric}_b{bucket:02d}"] += 1
    return rows


def expected_key_usage(records: list[RequestRecord]) -> dict[tuple[Any, ...], dict[str, Any]]:
    rows: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(Counter)
    for r in records:
        if r.key_id:
            row = rows[r.created_at.astimezone(UTC).replace(minute=0, second=0, microsecond=0), r.key_id]
            row["requests"] += 1
            row["cost_usd"] += r.cost_usd
    return rows


async def stored_rollup(
    engine: AsyncEngine, tenant: str, *, daily: bool = False
) -> dict[tuple[Any, ...], dict[str, Any]]:
    table, when = (daily_usage, "day") if daily else (hourly_usage, "hour")
    async with engine.connect() as connection:
        rows = (await connection.execute(sa.select(table).where(table.c.tenant == tenant))).mappings()
        result = {}
        for row in rows:
            moment = row[when] if daily or row[when].tzinfo else row[when].replace(tzinfo=UTC)
            result[moment, row["feature"], row["tier"]] = {k: v for k, v in row.items() if v}
        return result


def expected_errors(records: list[RequestRecord]) -> dict[tuple[Any, ...], int]:
    counts: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in records:
        if r.status >= 400:
            counts[r.created_at.astimezone(UTC).date(), r.feature, r.status, r.error_code or ""] += 1
    return dict(counts)


async def stored_errors(engine: AsyncEngine, tenant: str) -> dict[tuple[Any, ...], int]:
    async with engine.connect() as connection:
        query = sa.select(daily_errors).where(daily_errors.c.tenant == tenant)
        return {
            (row.day, row.feature, row.status, row.error_code): row.requests
            for row in (await connection.execute(query)).all()
        }


async def stored_key_usage(engine: AsyncEngine, key_ids: set[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    async with engine.connect() as connection:
        query = sa.select(key_hourly_usage).where(key_hourly_usage.c.key_id.in_(key_ids))
        return {
            (row["hour"] if row["hour"].tzinfo else row["hour"].replace(tzinfo=UTC), row["key_id"]): dict(row)
            for row in (await connection.execute(query)).mappings()
        }


def assert_same(stored: dict[tuple[Any, ...], dict[str, Any]], expected: dict[tuple[Any, ...], Any]) -> None:
    assert set(stored) == set(expected)
    for key, row in expected.items():
        got = {k: v for k, v in stored[key].items() if k not in ("hour", "day", "tenant", "feature", "tier", "key_id")}
        assert set(got) == {k for k, v in row.items() if v}, key
        for name, value in row.items():
            assert got.get(name, 0) == pytest.approx(value), (key, name)


async def test_the_writer_rolls_up_by_utc_hour_and_key_with_latency_histograms(engine: AsyncEngine) -> None:
    tenant = f"hourly-{uuid.uuid4().hex[:8]}"
    records = seeded_records(tenant)
    await write_batch(engine, records[:200])
    await write_batch(engine, records[100:])  # overlaps: rows already present must not count twice
    assert_same(await stored_rollup(engine, tenant), expected_rollup(records))
    assert_same(await stored_rollup(engine, tenant, daily=True), expected_rollup(records, daily=True))
    assert_same(await stored_key_usage(engine, {f"{tenant}-a", f"{tenant}-b"}), expected_key_usage(records))
    assert await stored_errors(engine, tenant) == expected_errors(records)


async def test_a_request_counts_towards_its_utc_hour(engine: AsyncEngine) -> None:
    tenant = f"hourly-{uuid.uuid4().hex[:8]}"
    new_york = timezone(timedelta(hours=-5))
    await write_batch(
        engine,
        [
            RequestRecord(
                request_id=f"{tenant}-1",
                tenant=tenant,
                feature="f",
                created_at=datetime(2026, 3, 1, 22, 59, tzinfo=new_york),
            )
        ],
    )
    assert set(await stored_rollup(engine, tenant)) == {(datetime(2026, 3, 2, 3, tzinfo=UTC), "f", "")}


@pytest.fixture(params=["postgres", "sqlite"])
def empty_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("empty_postgres_url" if request.param == "postgres" else "empty_sqlite_url")


async def test_revision_0003_rolls_up_the_requests_recorded_before_it(empty_url: str) -> None:
    url = empty_url
    await migrate.upgrade_async(url, "0002")
    tenant = "before-0003"
    records = seeded_records(tenant, 200)
    engine = make_database(url)
    try:
        async with engine.begin() as connection:
            await connection.execute(requests.insert(), [r.row() for r in records])
            await connection.execute(
                daily_usage.insert(),
                [
                    {k: v for k, v in row.items() if not k.startswith(("ttft_b", "itl_b"))}
                    for row in rollup_deltas(records)
                ],
            )  # what the writer of revision 0002 kept: counters only
        await migrate.upgrade_async(url)
        assert_same(await stored_rollup(engine, tenant), expected_rollup(records))
        assert_same(await stored_rollup(engine, tenant, daily=True), expected_rollup(records, daily=True))
        assert_same(await stored_key_usage(engine, {f"{tenant}-a", f"{tenant}-b"}), expected_key_usage(records))
        assert await stored_errors(engine, tenant) == expected_errors(records)
    finally:
        await engine.dispose()


def test_bucket_edges_are_three_per_octave_from_one_millisecond() -> None:
    assert histogram.bucket_of(0.0) == 0 and histogram.bucket_of(0.999) == 0
    assert histogram.bucket_of(1.0) == 1 and histogram.bucket_of(2.0) == 4 and histogram.bucket_of(1024.0) == 31
    assert histogram.bucket_of(-5) == 0 and histogram.bucket_of(1e9) == histogram.BUCKETS - 1


def test_a_percentile_read_from_the_histogram_is_within_one_bucket_of_the_exact_one() -> None:
    rng = random.Random(3)
    values = sorted(rng.lognormvariate(5, 1.2) for _ in range(5000))
    counts = [0] * histogram.BUCKETS
    for value in values:
        counts[histogram.bucket_of(value)] += 1
    for q in (0.5, 0.9, 0.99):
        exact = values[math.ceil(q * len(values)) - 1]
        estimate = histogram.percentile(counts, q)
        assert estimate is not None and abs(math.log2(estimate / exact)) <= 1 / histogram.PER_OCTAVE
    assert histogram.percentile([0] * histogram.BUCKETS, 0.5) is None
