"""Dashboard: an hourly rollup per tenant, feature, tier and key with latency histograms, and a partial
index over failed requests. Existing `requests` rows are rolled up once here; from then on the
accounting writer maintains `hourly_usage` in the same statement that inserts the rows.

Indexes, by the query they serve:
- pk_hourly_usage (hour, tenant, feature, tier, key_id): every dashboard panel for all tenants over a
  time range; also the rollup upsert.
- ix_hourly_usage_feature_hour, ix_hourly_usage_tenant_hour: the same panels filtered to one feature
  or one tenant.
- ix_hourly_usage_key_id_hour: a key's spend today and this month (budget status).
- ix_requests_errors_created_at (partial, status >= 400): error counts by code over a time range.

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


def upgrade() -> None:
    op.create_table(
        "hourly_usage",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=36), nullable=False),
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
        *(sa.Column(name, sa.Integer(), server_default="0", nullable=False) for name in _histogram_columns()),
        sa.PrimaryKeyConstraint("hour", "tenant", "feature", "tier", "key_id", name=op.f("pk_hourly_usage")),
    )
    op.create_index(op.f("ix_hourly_usage_feature_hour"), "hourly_usage", ["feature", "hour"])
    op.create_index(op.f("ix_hourly_usage_tenant_hour"), "hourly_usage", ["tenant", "hour"])
    op.create_index(op.f("ix_hourly_usage_key_id_hour"), "hourly_usage", ["key_id", "hour"])
    op.create_index(
        "ix_requests_errors_created_at",
        "requests",
        ["created_at", "error_code"],
        postgresql_where=sa.text("status >= 400"),
        sqlite_where=sa.text("status >= 400"),
    )
    _backfill()


def _bucket(value: str) -> str:
    cases = " ".join(f"WHEN {value} < {edge!r} THEN {bucket}" for bucket, edge in enumerate(EDGES_MS))
    return f"CASE WHEN {value} IS NULL THEN -1 {cases} ELSE {BUCKETS - 1} END"


def _backfill() -> None:
    """Roll up the requests recorded before this revision (one INSERT … SELECT)."""
    if op.get_bind().dialect.name == "postgresql":
        hour = "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
    else:  # SQLAlchemy stores SQLite datetimes as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC, see accounting)
        hour = "substr(created_at, 1, 13) || ':00:00.000000'"
    rows = (
        f"SELECT {hour} AS hour, tenant, feature, coalesce(tier, '') AS tier, coalesce(key_id, '') AS key_id,"
        " 1 AS requests, CASE WHEN status >= 400 THEN 1 ELSE 0 END AS errors,"
        " CASE WHEN escalated THEN 1 ELSE 0 END AS escalations,"
        " CASE WHEN cache_status IN ('exact', 'semantic') THEN 1 ELSE 0 END AS cache_hits,"
        " prompt_tokens, completion_tokens, cached_tokens, cost_usd,"
        " CASE WHEN cache_status = 'semantic' THEN 1 ELSE 0 END AS semantic_cache_hits, cost_saved_usd,"
        f" {_bucket('ttft_ms')} AS ttft_bucket, {_bucket('itl_ms_mean')} AS itl_bucket FROM requests"
    )
    key = "hour, tenant, feature, tier, key_id"
    sums = [f"sum({name})" for name in COUNTERS] + [
        f"sum(CASE WHEN {metric}_bucket = {bucket} THEN 1 ELSE 0 END)"
        for metric in METRICS
        for bucket in range(BUCKETS)
    ]
    op.execute(
        f"INSERT INTO hourly_usage ({key}, {', '.join(COUNTERS)}, {', '.join(_histogram_columns())})"
        f" SELECT {key}, {', '.join(sums)} FROM ({rows}) AS r GROUP BY {key}"
    )


def downgrade() -> None:
    op.drop_index("ix_requests_errors_created_at", table_name="requests")
    op.drop_index(op.f("ix_hourly_usage_key_id_hour"), table_name="hourly_usage")
    op.drop_index(op.f("ix_hourly_usage_tenant_hour"), table_name="hourly_usage")
    op.drop_index(op.f("ix_hourly_usage_feature_hour"), table_name="hourly_usage")
    op.drop_table("hourly_usage")
