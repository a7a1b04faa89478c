"""Router, response cache and API capabilities: router_versions, eval_runs, shadow_runs; the cache's
similarity and savings, tool / response_format use and priority class on each request; semantic hits
and savings in the daily rollup.

Indexes, by the query they serve:
- ix_eval_runs_created_at: the dashboard's latest evaluation runs.
- ix_shadow_runs_created_at, ix_shadow_runs_feature_created_at: the quality delta over a time range,
  for all features or one; `sluice router train --from-db` reads a range.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("cache_similarity", sa.Float(), nullable=True))
        batch.add_column(sa.Column("cost_saved_usd", sa.Float(), server_default="0", nullable=False))
        batch.add_column(sa.Column("used_tools", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch.add_column(sa.Column("response_format", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("priority", sa.String(length=16), server_default="interactive", nullable=False))
    with op.batch_alter_table("daily_usage") as batch:
        batch.add_column(sa.Column("semantic_cache_hits", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("cost_saved_usd", sa.Float(), server_default="0", nullable=False))
    op.create_table(
        "router_versions",
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("artifact_path", sa.String(length=1024), nullable=False),
        sa.Column("training_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("operating_point", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_router_versions")),
    )
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("router_version", sa.String(length=64), nullable=True),
        sa.Column("dataset", sa.String(length=512), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("plot_path", sa.String(length=1024), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eval_runs")),
    )
    op.create_index(op.f("ix_eval_runs_created_at"), "eval_runs", ["created_at"])
    op.create_table(
        "shadow_runs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("router_version", sa.String(length=64), nullable=True),
        sa.Column("route_score", sa.Float(), nullable=True),
        sa.Column("confidence", sa.Float(), nullable=True),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("small_answer", sa.Text(), nullable=False),
        sa.Column("large_answer", sa.Text(), nullable=False),
        sa.Column("agreement", sa.Float(), nullable=False),
        sa.Column("agreement_method", sa.String(length=16), nullable=False),
        sa.Column("large_cost_usd", sa.Float(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_shadow_runs")),
    )
    op.create_index(op.f("ix_shadow_runs_created_at"), "shadow_runs", ["created_at"])
    op.create_index(op.f("ix_shadow_runs_feature_created_at"), "shadow_runs", ["feature", "created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_shadow_runs_feature_created_at"), table_name="shadow_runs")
    op.drop_index(op.f("ix_shadow_runs_created_at"), table_name="shadow_runs")
    op.drop_table("shadow_runs")
    op.drop_index(op.f("ix_eval_runs_created_at"), table_name="eval_runs")
    op.drop_table("eval_runs")
    op.drop_table("router_versions")
    with op.batch_alter_table("daily_usage") as batch:
        batch.drop_column("cost_saved_usd")
        batch.drop_column("semantic_cache_hits")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("priority")
        batch.drop_column("response_format")
        batch.drop_column("used_tools")
        batch.drop_column("cost_saved_usd")
        batch.drop_column("cache_similarity")
