"""Batch API: files, batches and batch_lines (one row per request line, its state committed as it runs).

Indexes, by the query they serve:
- ix_files_tenant_id, ix_batches_tenant_id: a tenant's files and batches, newest first (ids are time-ordered).
- ix_batches_status: the workers' search for unfinished batches.
- ix_batch_lines_batch_id_state_line: the next pending line of a batch; counts by state.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _moment(name: str, nullable: bool = True) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        _moment("created_at", nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("filename", sa.String(length=256), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index(op.f("ix_files_tenant_id"), "files", ["tenant", "id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        _moment("created_at", nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("feature", sa.String(length=128), nullable=False),
        sa.Column("key_id", sa.String(length=36), nullable=True),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        _moment("expires_at", nullable=False),
        *(_moment(f"{event}_at") for event in
          ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
        sa.Column("worker", sa.String(length=64), nullable=True),
        _moment("lease_until"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index(op.f("ix_batches_tenant_id"), "batches", ["tenant", "id"])
    op.create_index(op.f("ix_batches_status"), "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("worker", sa.String(length=64), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("batch_id", "line", name=op.f("pk_batch_lines")),
    )
    op.create_index(op.f("ix_batch_lines_batch_id_state_line"), "batch_lines", ["batch_id", "state", "line"])


def downgrade() -> None:
    op.drop_index(op.f("ix_batch_lines_batch_id_state_line"), table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index(op.f("ix_batches_status"), table_name="batches")
    op.drop_index(op.f("ix_batches_tenant_id"), table_name="batches")
    op.drop_table("batches")
    op.drop_index(op.f("ix_files_tenant_id"), table_name="files")
    op.drop_table("files")
