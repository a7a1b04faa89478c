"""Dashboard: latency histograms in the daily rollup, the same rollup by hour, spend per key and hour, and
a partial index over failed requests. Existing `requests` rows are rolled up once here; from then on the
accounting writer maintains all three rollups in the statement that inserts the rows.

Indexes, by the query they serve:
- pk_hourly_usage (hour, tenant, feature, tier): the dashboard's panels for ranges of up to two days;
  ix_hourly_usage_feature_hour, ix_hourly_usage_tenant_hour: the same for one feature or tenant.
  (Longer ranges read daily_usage through its existing primary key and indexes.)
- pk_key_hourly_usage (hour, key_id): top keys by spend over a range; ix_key_hourly_usage_key_id_hour:
  given keys' spend today and this month (budget status).
- pk_daily_errors (day, tenant, feature, status, error_code), ix_daily_errors_feature_day,
  ix_daily_errors_tenant_day: errors by code over ranges longer than two days.
- ix_requests_errors_created_at (partial, status >= 400; created_at, tenant, feature, status,
  error_code): error counts by code over ranges of up to two days, read from the index alone.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of gateway/db/histogram.py at this revision: 50 buckets, three per octave from 1 ms.
BUCKETS = 50
EDGES_MS = [2 ** (i / 3) for i in range(BUCKETS - 1)]
METRICS = ("ttft", "itl")
COUNTERS = (
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


def _histogram_columns() -> list[str]:
    return [f"{metric}_b{bucket:02d}" for metric in METRICS for bucket in range(BUCKETS)]


def _histogram() -> list[sa.Column]:
    return [sa.Column(name, sa.Integer(), server_default="0", nullable=False) for name in _histogram_columns()]


def _counters() -> list[sa.Column]:
    return [
        sa.Column("requests", sa.Integer(), server_default="0", nullable=False),
        sa.Column("errors", sa.Integer(), server_default="0", nullable=False),
        sa.Column("escalations", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cache_hits", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Float(), server_default="0", nullable=False),
        sa.Column("semantic_cache_hits", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cost_saved_usd", sa.Float(), server_default="0", nullable=False),
    ]


def upgrade() -> None:
    with op.batch_alter_table("daily_usage") as batch:
        for column in _histogram():
            batch.add_column(column)
    op.create_table(
        "hourly_usage",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        *_counters(),
        *_histogram(),
        sa.PrimaryKeyConstraint("hour", "tenant", "feature", "tier", name=op.f("pk_hourly_usage")),
    )
    op.create_index(op.f("ix_hourly_usage_feature_hour"), "hourly_usage", ["feature", "hour"])
    op.create_index(op.f("ix_hourly_usage_tenant_hour"), "hourly_usage", ["tenant", "hour"])
    op.create_table(
        "key_hourly_usage",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(length=36), nullable=False),
        sa.Column("requests", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Float(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("hour", "key_id", name=op.f("pk_key_hourly_usage")),
    )
    op.create_index(op.f("ix_key_hourly_usage_key_id_hour"), "key_hourly_usage", ["key_id", "hour"])
    op.create_table(
        "daily_errors",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(length=64), nullable=False),
        sa.Column("requests", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("day", "tenant", "feature", "status", "error_code", name=op.f("pk_daily_errors")),
    )
    op.create_index(op.f("ix_daily_errors_feature_day"), "daily_errors", ["feature", "day"])
    op.create_index(op.f("ix_daily_errors_tenant_day"), "daily_errors", ["tenant", "day"])
    op.create_index(
        "ix_requests_errors_created_at",
        "requests",
        ["created_at", "tenant", "feature", "status", "error_code"],
        postgresql_where=sa.text("status >= 400"),
        sqlite_where=sa.text("status >= 400"),
    )
    for statement in backfill_statements(op.get_bind().dialect.name):
        op.execute(statement)


def _bucket(value: str, dialect: str) -> str:
    """The histogram bucket of `value` (ms), -1 when NULL: the number of edges at or below it."""
    if dialect == "postgresql":  # a binary search over float8 edges
        return f"coalesce(width_bucket({value}, ARRAY[{', '.join(map(repr, EDGES_MS))}]::float8[]), -1)"
    cases = " ".join(f"WHEN {value} < {edge!r} THEN {bucket}" for bucket, edge in enumerate(EDGES_MS))
    return f"CASE WHEN {value} IS NULL THEN -1 {cases} ELSE {BUCKETS - 1} END"


def backfill_statements(dialect: str) -> list[str]:
    """Roll up the requests recorded before this revision: histograms into daily_usage (its counters
    are kept as they are), and hourly_usage and key_hourly_usage in full. bench/dashboard.py builds its
    rollups with these too. Failed requests go to daily_errors."""
    if dialect == "postgresql":
        hour = "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
        day = "(created_at AT TIME ZONE 'UTC')::date"
    else:  # SQLAlchemy stores SQLite datetimes as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC, see accounting)
        hour = "substr(created_at, 1, 13) || ':00:00.000000'"
        day = "substr(created_at, 1, 10)"
    rows = (
        f"SELECT {hour} AS hour, {day} AS day, tenant, feature, coalesce(tier, '') AS tier, key_id, status,"
        " coalesce(error_code, '') AS error_code,"
        " 1 AS requests, CASE WHEN status >= 400 THEN 1 ELSE 0 END AS errors,"
        " CASE WHEN escalated THEN 1 ELSE 0 END AS escalations,"
        " CASE WHEN cache_status IN ('exact', 'semantic') THEN 1 ELSE 0 END AS cache_hits,"
        " prompt_tokens, completion_tokens, cached_tokens, cost_usd,"
        " CASE WHEN cache_status = 'semantic' THEN 1 ELSE 0 END AS semantic_cache_hits, cost_saved_usd,"
        f" {_bucket('ttft_ms', dialect)} AS ttft_bucket, {_bucket('itl_ms_mean', dialect)} AS itl_bucket"
        " FROM requests"
    )
    histograms = [
        f"sum(CASE WHEN {metric}_bucket = {bucket} THEN 1 ELSE 0 END)"
        for metric in METRICS
        for bucket in range(BUCKETS)
    ]
    usage = "hour, tenant, feature, tier"
    daily = "day, tenant, feature, tier"
    names = _histogram_columns()
    return [
        # MATERIALIZED: each row's buckets are computed once, not inlined into each of the bucket sums.
        f"WITH r AS MATERIALIZED ({rows})"
        f" INSERT INTO hourly_usage ({usage}, {', '.join(COUNTERS)}, {', '.join(names)})"
        f" SELECT {usage}, {', '.join([f'sum({name})' for name in COUNTERS] + histograms)}"
        f" FROM r GROUP BY {usage}",
        "INSERT INTO key_hourly_usage (hour, key_id, requests, cost_usd)"
        f" SELECT hour, key_id, count(*), sum(cost_usd) FROM ({rows}) AS r WHERE key_id IS NOT NULL"
        " GROUP BY hour, key_id",
        "INSERT INTO daily_errors (day, tenant, feature, status, error_code, requests)"
        f" SELECT day, tenant, feature, status, error_code, count(*) FROM ({rows}) AS r WHERE status >= 400"
        " GROUP BY day, tenant, feature, status, error_code",
        # daily_usage's histograms from hourly_usage, now complete: hours sum to days.
        f"UPDATE daily_usage SET {', '.join(f'{name} = h.{name}' for name in names)}"
        f" FROM (SELECT {day.replace('created_at', 'hour')} AS day, tenant, feature, tier,"
        f" {', '.join(f'sum({name}) AS {name}' for name in names)} FROM hourly_usage GROUP BY {daily}) AS h"
        " WHERE daily_usage.day = h.day AND daily_usage.tenant = h.tenant AND daily_usage.feature = h.feature"
        " AND daily_usage.tier = h.tier",
    ]


def downgrade() -> None:
    op.drop_index("ix_requests_errors_created_at", table_name="requests")
    op.drop_index(op.f("ix_daily_errors_tenant_day"), table_name="daily_errors")
    op.drop_index(op.f("ix_daily_errors_feature_day"), table_name="daily_errors")
    op.drop_table("daily_errors")
    op.drop_index(op.f("ix_key_hourly_usage_key_id_hour"), table_name="key_hourly_usage")
    op.drop_table("key_hourly_usage")
    op.drop_index(op.f("ix_hourly_usage_tenant_hour"), table_name="hourly_usage")
    op.drop_index(op.f("ix_hourly_usage_feature_hour"), table_name="hourly_usage")
    op.drop_table("hourly_usage")
    with op.batch_alter_table("daily_usage") as batch:
        for name in reversed(_histogram_columns()):
            batch.drop_column(name)
