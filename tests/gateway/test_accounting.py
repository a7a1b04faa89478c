"""Accounting: every request becomes one `requests` row and counts once in `daily_usage`, on
Postgres and SQLite, whether the database is up, down, or comes back after a restart."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting import NO_TIER, AccountingWriter, RequestRecord, Spool, write_batch
from gateway.db.database import make_database
from gateway.db.schema import daily_usage, requests

# Nothing listens on port 1: connecting fails at once, like a database that is down.
UNREACHABLE_URL = "postgresql+asyncpg://postgres@127.0.0.1:1/sluice"


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("postgres_url" if request.param == "postgres" else "sqlite_url")


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_database(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def tenant() -> str:
    """The Postgres database is shared by the whole run: each test accounts under its own tenant."""
    return f"tenant-{uuid.uuid4().hex[:12]}"


def record(tenant: str, number: int, **fields: Any) -> RequestRecord:
    defaults: dict[str, Any] = {
        "feature": "chat",
        "tier": "small",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "cost_usd": 0.001,
    }
    return RequestRecord(request_id=f"{tenant}-{number}", tenant=tenant, **(defaults | fields))


async def request_ids(engine: AsyncEngine, tenant: str) -> list[str]:
    async with engine.connect() as connection:
        query = sa.select(requests.c.request_id).where(requests.c.tenant == tenant)
        return sorted((await connection.execute(query)).scalars())


async def rollups(engine: AsyncEngine, tenant: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """daily_usage rows of `tenant`, keyed by (day, feature, tier)."""
    async with engine.connect() as connection:
        rows = (await connection.execute(sa.select(daily_usage).where(daily_usage.c.tenant == tenant))).mappings()
        return {(row["day"], row["feature"], row["tier"]): dict(row) for row in rows}


def test_a_request_record_has_exactly_the_columns_of_the_requests_table() -> None:
    assert [field.name for field in dataclasses.fields(RequestRecord)] == [column.name for column in requests.columns]


def test_a_request_record_is_stamped_with_an_aware_utc_time() -> None:
    created_at = RequestRecord(request_id="r", tenant="t", feature="f").created_at
    assert created_at.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - created_at) < timedelta(minutes=1)


async def test_submitted_records_are_written_with_their_fields(
    engine: AsyncEngine, tenant: str, tmp_path: Path
) -> None:
    writer = AccountingWriter(engine, tmp_path / "spool", flush_interval_s=0.01)
    await writer.start()
    sent = record(tenant, 1, route="large", route_score=0.8, confidence=0.4, stream=True, ttft_ms=12.5, status=200)
    writer.submit(sent)
    await writer.close()

    async with engine.connect() as connection:
        row = (await connection.execute(sa.select(requests).where(requests.c.tenant == tenant))).mappings().one()
    stored = dict(row) | {"created_at": row["created_at"].replace(tzinfo=UTC)}
    assert stored == sent.row()
    assert writer.stats().written == 1 and writer.stats().pending == 0


async def test_rollups_count_requests_errors_escalations_cache_hits_tokens_and_cost(
    engine: AsyncEngine, tenant: str, tmp_path: Path
) -> None:
    writer = AccountingWriter(engine, tmp_path / "spool", flush_interval_s=0.01)
    await writer.start()
    writer.submit(record(tenant, 1, prompt_tokens=100, completion_tokens=20, cached_tokens=64, cost_usd=0.5))
    writer.submit(record(tenant, 2, escalated=True, tier="large", cost_usd=2.0))
    writer.submit(record(tenant, 3, status=429, error_code="rate_limited", tier=None, prompt_tokens=0, cost_usd=0.0))
    writer.submit(record(tenant, 4, cache_status="exact", tier=None, completion_tokens=7, cost_usd=0.0))
    writer.submit(record(tenant, 5, cache_status="semantic", prompt_tokens=1, completion_tokens=1, cost_usd=0.25))
    await writer.close()

    today = datetime.now(UTC).date()
    usage = await rollups(engine, tenant)
    assert set(usage) == {(today, "chat", "small"), (today, "chat", "large"), (today, "chat", NO_TIER)}
    small, large, no_tier = (usage[today, "chat", tier] for tier in ("small", "large", NO_TIER))
    assert (small["requests"], small["errors"], small["escalations"], small["cache_hits"]) == (2, 0, 0, 1)
    assert (small["prompt_tokens"], small["completion_tokens"], small["cached_tokens"]) == (101, 21, 64)
    assert small["cost_usd"] == pytest.approx(0.75)
    assert (large["requests"], large["escalations"], large["cost_usd"]) == (1, 1, pytest.approx(2.0))
    assert (no_tier["requests"], no_tier["errors"], no_tier["cache_hits"]) == (2, 1, 1)


async def test_requests_count_towards_their_utc_day(engine: AsyncEngine, tenant: str) -> None:
    new_york = timezone(timedelta(hours=-5))
    late_evening_in_new_york = datetime(2026, 3, 1, 22, 0, tzinfo=new_york)  # 03:00 UTC on March 2nd
    await write_batch(engine, [record(tenant, 1, created_at=late_evening_in_new_york)])
    assert set(await rollups(engine, tenant)) == {(date(2026, 3, 2), "chat", "small")}


async def test_a_time_without_offset_is_taken_as_utc(engine: AsyncEngine, tenant: str) -> None:
    await write_batch(engine, [record(tenant, 1, created_at=datetime(2026, 3, 1, 23, 30))])
    assert set(await rollups(engine, tenant)) == {(date(2026, 3, 1), "chat", "small")}
    async with engine.connect() as connection:
        query = sa.select(requests.c.created_at).where(requests.c.tenant == tenant)
        stored = (await connection.execute(query)).scalar_one()
    assert stored.replace(tzinfo=stored.tzinfo or UTC) == datetime(2026, 3, 1, 23, 30, tzinfo=UTC)


async def test_writing_a_batch_again_adds_no_rows_and_counts_nothing_twice(engine: AsyncEngine, tenant: str) -> None:
    first_half = [record(tenant, n) for n in range(5)]
    everything = [record(tenant, n) for n in range(10)]
    assert await write_batch(engine, first_half) == 5
    # A replay after a partial success: half of the batch is already in the database.
    assert await write_batch(engine, everything) == 5
    assert await write_batch(engine, everything) == 0

    assert len(await request_ids(engine, tenant)) == 10
    (usage,) = (await rollups(engine, tenant)).values()
    assert usage["requests"] == 10
    assert usage["prompt_tokens"] == 100
    assert usage["cost_usd"] == pytest.approx(0.01)


async def test_a_batch_larger_than_one_statement_allows_is_written_whole(engine: AsyncEngine, tenant: str) -> None:
    batch = [record(tenant, n) for n in range(3000)]  # 3000 rows x 24 columns > 32767 parameters
    assert await write_batch(engine, batch) == 3000
    (usage,) = (await rollups(engine, tenant)).values()
    assert usage["requests"] == 3000


async def test_a_row_the_database_refuses_does_not_hold_back_the_others(
    engine: AsyncEngine, tenant: str, tmp_path: Path
) -> None:
    writer = AccountingWriter(engine, tmp_path / "spool", flush_interval_s=0.01)
    await writer.start()
    writer.submit(record(tenant, 1))
    writer.submit(record(tenant, 2, endpoint=None))  # violates NOT NULL
    writer.submit(record(tenant, 3))
    await writer.close()

    assert await request_ids(engine, tenant) == [f"{tenant}-1", f"{tenant}-3"]
    assert writer.stats().rejected == 1
    assert writer.stats().spooled == 0


async def test_while_the_database_is_down_records_are_spooled_and_a_restarted_writer_replays_them(
    engine: AsyncEngine, tenant: str, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    unreachable = make_database(UNREACHABLE_URL)
    down = AccountingWriter(unreachable, spool_dir, batch_size=50, flush_interval_s=0.01)
    await down.start()
    for n in range(120):
        down.submit(record(tenant, n))
    await down.close()
    await unreachable.dispose()
    assert down.stats().spooled == 120
    assert down.stats().database_up is False
    assert list(spool_dir.glob("*.jsonl"))

    restarted = AccountingWriter(engine, spool_dir, flush_interval_s=0.01)
    await restarted.start()
    await restarted.close()

    assert len(await request_ids(engine, tenant)) == 120
    (usage,) = (await rollups(engine, tenant)).values()
    assert usage["requests"] == 120
    assert restarted.stats().replayed == 120
    assert list(spool_dir.glob("*.jsonl")) == []
    assert restarted.stats().spool_bytes == 0


async def test_replaying_a_spool_whose_rows_were_partly_written_counts_each_row_once(
    engine: AsyncEngine, tenant: str, tmp_path: Path
) -> None:
    # The database committed the first 30 rows but the writer never heard back, so it spooled all 60.
    everything = [record(tenant, n) for n in range(60)]
    await write_batch(engine, everything[:30])
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20, segment_bytes=1 << 20)
    spool.append(everything)
    spool.seal()

    writer = AccountingWriter(engine, tmp_path / "spool", batch_size=25, flush_interval_s=0.01)
    await writer.start()
    await writer.close()

    assert len(await request_ids(engine, tenant)) == 60
    (usage,) = (await rollups(engine, tenant)).values()
    assert usage["requests"] == 60
    assert writer.stats().written == 30


async def test_a_torn_last_line_in_the_spool_is_skipped_and_the_rest_replayed(
    engine: AsyncEngine, tenant: str, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20, segment_bytes=1 << 20)
    spool.append([record(tenant, n) for n in range(3)])
    spool.seal()
    (segment,) = (tmp_path / "spool").glob("*.jsonl")
    with segment.open("ab") as file:
        file.write(b'{"request_id": "half-writ')  # the process died mid-write

    writer = AccountingWriter(engine, tmp_path / "spool", flush_interval_s=0.01)
    await writer.start()
    await writer.close()

    assert len(await request_ids(engine, tenant)) == 3
    assert not segment.exists()


async def test_a_full_spool_drops_rows_with_a_clear_log_line(
    tenant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unreachable = make_database(UNREACHABLE_URL)
    writer = AccountingWriter(
        unreachable, tmp_path / "spool", batch_size=10, flush_interval_s=0.01, max_spool_bytes=4096
    )
    await writer.start()
    with caplog.at_level(logging.ERROR, logger="gateway.accounting"):
        for n in range(100):
            writer.submit(record(tenant, n))
        await writer.close()
    await unreachable.dispose()

    stats = writer.stats()
    assert 0 < stats.spooled < 100
    assert stats.spooled + stats.dropped == 100
    assert stats.spool_bytes <= 4096
    assert sum("spool" in message and "is full" in message for message in caplog.messages) == 1


async def test_submit_never_raises_and_counts_what_a_full_queue_drops(tenant: str, tmp_path: Path) -> None:
    unreachable = make_database(UNREACHABLE_URL)
    writer = AccountingWriter(unreachable, tmp_path / "spool", max_pending=10)  # not started: nothing drains
    for n in range(15):
        writer.submit(record(tenant, n))
    assert writer.stats().pending == 10
    assert writer.stats().dropped == 5
    await writer.close()
    await unreachable.dispose()
    assert writer.stats().spooled == 10


async def test_a_record_submitted_after_close_is_spooled_not_lost(tenant: str, tmp_path: Path) -> None:
    unreachable = make_database(UNREACHABLE_URL)
    writer = AccountingWriter(unreachable, tmp_path / "spool")
    await writer.start()
    await writer.close()
    writer.submit(record(tenant, 1))
    await unreachable.dispose()
    assert writer.stats().spooled == 1
