"""api_keys, requests, daily_usage and the indexes the dashboard reads through.

Indexes, by the query they serve:
- ix_requests_created_at: the request log over a time range (newest first), and retention deletes.
- ix_requests_tenant_feature_created_at: one tenant's (or tenant+feature's) requests over a time range.
- ix_requests_tier_created_at: per-tier latency and error views over a time range.
- ix_requests_key_id_created_at: one virtual key's recent usage (admin key view).
- pk_daily_usage (day, tenant, feature, tier): spend, escalation rate (escalations / requests) and
  cache-hit rate (cache_hits / requests) for all tenants over a date range; also the rollup upsert.
- ix_daily_usage_tenant_feature_day: the same figures for one tenant or feature over a date range.
- ix_daily_usage_tier_day: the same figures for one tier over a date range.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), server_default="", nullable=False),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("key_id", sa.String(length=36), nullable=True),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("model_requested", sa.String(length=128), server_default="", nullable=False),
        sa.Column("route", sa.String(length=32), nullable=True),
        sa.Column("route_score", sa.Float(), nullable=True),
        sa.Column("tier", sa.String(length=32), nullable=True),
        sa.Column("escalated", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("fallback", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=True),
        sa.Column("cache_status", sa.String(length=16), server_default="miss", nullable=False),
        sa.Column("stream", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cached_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Float(), server_default="0", nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), server_default="0", nullable=False),
        sa.Column("itl_ms_mean", sa.Float(), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_requests")),
    )
    op.create_index(op.f("ix_requests_created_at"), "requests", ["created_at"])
    op.create_index(op.f("ix_requests_tenant_feature_created_at"), "requests", ["tenant", "feature", "created_at"])
    op.create_index(op.f("ix_requests_tier_created_at"), "requests", ["tier", "created_at"])
    op.create_index(op.f("ix_requests_key_id_created_at"), "requests", ["key_id", "created_at"])
    op.create_table(
        "daily_usage",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("requests", sa.Integer(), server_default="0", nullable=False),
        sa.Column("errors", sa.Integer(), server_default="0", nullable=False),
        sa.Column("escalations", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cache_hits", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Float(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("day", "tenant", "feature", "tier", name=op.f("pk_daily_usage")),
    )
    op.create_index(op.f("ix_daily_usage_tenant_feature_day"), "daily_usage", ["tenant", "feature", "day"])
    op.create_index(op.f("ix_daily_usage_tier_day"), "daily_usage", ["tier", "day"])


def downgrade() -> None:
    op.drop_index(op.f("ix_daily_usage_tier_day"), table_name="daily_usage")
    op.drop_index(op.f("ix_daily_usage_tenant_feature_day"), table_name="daily_usage")
    op.drop_table("daily_usage")
    op.drop_index(op.f("ix_requests_key_id_created_at"), table_name="requests")
    op.drop_index(op.f("ix_requests_tier_created_at"), table_name="requests")
    op.drop_index(op.f("ix_requests_tenant_feature_created_at"), table_name="requests")
    op.drop_index(op.f("ix_requests_created_at"), table_name="requests")
    op.drop_table("requests")
    op.drop_table("api_keys")
