"""The relational schema (SQLAlchemy 2 Core tables). Changed only together with an Alembic revision
in `migrations/`. Portable between Postgres (production) and SQLite (embedded default)."""

from __future__ import annotations

import sqlalchemy as sa

from gateway.db import histogram


def _latency_histogram() -> list[sa.Column[int]]:
    """TTFT and mean-ITL counts per bucket (gateway/db/histogram.py): percentiles from a rollup."""
    return [
        sa.Column(name, sa.Integer, nullable=False, server_default="0")
        for metric in histogram.METRICS
        for name in histogram.COLUMNS[metric]
    ]


metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# Virtual API keys. Only a SHA-256 of the secret is stored; `prefix` (first characters) lets people
# recognise a key in listings. `policy` holds per-key overrides of the feature's policy (JSON).
api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("prefix", sa.String(16), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("feature", sa.String(128), nullable=False),
    sa.Column("name", sa.String(256), nullable=False, server_default=""),
    sa.Column("policy", sa.JSON, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
)

# One row per request, written in batches off the request path.
requests = sa.Table(
    "requests",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("feature", sa.String(128), nullable=False),
    sa.Column("key_id", sa.String(36), nullable=True),
    sa.Column("endpoint", sa.String(32), nullable=False),  # chat | completions
    sa.Column("model_requested", sa.String(128), nullable=False, server_default=""),
    sa.Column("route", sa.String(32), nullable=True),  # tier the router chose
    sa.Column("route_score", sa.Float, nullable=True),  # classifier difficulty score
    sa.Column("tier", sa.String(32), nullable=True),  # tier that served
    sa.Column("escalated", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("fallback", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("confidence", sa.Float, nullable=True),  # small tier's: answer_/stream_confidence by `stream`
    sa.Column("cache_status", sa.String(16), nullable=False, server_default="miss"),  # miss|exact|semantic|off
    sa.Column("stream", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cached_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cost_usd", sa.Float, nullable=False, server_default="0"),
    sa.Column("ttft_ms", sa.Float, nullable=True),
    sa.Column("latency_ms", sa.Float, nullable=False, server_default="0"),
    sa.Column("itl_ms_mean", sa.Float, nullable=True),
    sa.Column("status", sa.Integer, nullable=False),  # HTTP status returned
    sa.Column("error_code", sa.String(64), nullable=True),
    # Response cache: similarity of a semantic hit, and what the hit saved (the cost of generating it).
    sa.Column("cache_similarity", sa.Float, nullable=True),
    sa.Column("cost_saved_usd", sa.Float, nullable=False, server_default="0"),
    # Which API capabilities the request used: tools, and response_format (json_object | json_schema).
    sa.Column("used_tools", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("response_format", sa.String(16), nullable=True),
    # interactive | batch (scheduling class).
    sa.Column("priority", sa.String(16), nullable=False, server_default="interactive"),
    # Indexes serve the dashboard and admin queries; see the first migration for which query uses which.
    sa.Index(None, "created_at"),
    sa.Index(None, "tenant", "feature", "created_at"),
    sa.Index(None, "tier", "created_at"),
    sa.Index(None, "key_id", "created_at"),
    # The dashboard's error panel reads only failed requests: a partial index covering what it reads.
    sa.Index(
        "ix_requests_errors_created_at",
        "created_at",
        "tenant",
        "feature",
        "status",
        "error_code",
        postgresql_where=sa.text("status >= 400"),
        sqlite_where=sa.text("status >= 400"),
    ),
)

# Daily rollups per tenant and feature, maintained by the accounting writer.
daily_usage = sa.Table(
    "daily_usage",
    metadata,
    sa.Column("day", sa.Date, primary_key=True),
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("feature", sa.String(128), primary_key=True),
    sa.Column("tier", sa.String(32), primary_key=True),
    sa.Column("requests", sa.Integer, nullable=False, server_default="0"),
    sa.Column("errors", sa.Integer, nullable=False, server_default="0"),
    sa.Column("escalations", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cache_hits", sa.Integer, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cost_usd", sa.Float, nullable=False, server_default="0"),
    sa.Column("semantic_cache_hits", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cost_saved_usd", sa.Float, nullable=False, server_default="0"),
    *_latency_histogram(),
    # The primary key (day first) serves "all tenants over a date range"; these serve one tenant or
    # feature over a range, and one tier over a range.
    sa.Index(None, "tenant", "feature", "day"),
    sa.Index(None, "tier", "day"),
)

# The same rollup by UTC hour (ranges of up to two days are drawn by hour), maintained by the accounting
# writer. Primary key (hour first): all tenants over a range; the indexes: one feature or one tenant.
hourly_usage = sa.Table(
    "hourly_usage",
    metadata,
    sa.Column("hour", sa.DateTime(timezone=True), primary_key=True),  # start of the UTC hour
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("feature", sa.String(128), primary_key=True),
    sa.Column("tier", sa.String(32), primary_key=True),
    sa.Column("requests", sa.Integer, nullable=False, server_default="0"),
    sa.Column("errors", sa.Integer, nullable=False, server_default="0"),
    sa.Column("escalations", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cache_hits", sa.Integer, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cost_usd", sa.Float, nullable=False, server_default="0"),
    sa.Column("semantic_cache_hits", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cost_saved_usd", sa.Float, nullable=False, server_default="0"),
    *_latency_histogram(),
    sa.Index(None, "feature", "hour"),
    sa.Index(None, "tenant", "hour"),
)

# Requests and spend per key and UTC hour (requests made with a key only), maintained by the accounting
# writer: top keys over a range (primary key, hour first) and one key's spend today and this month.
key_hourly_usage = sa.Table(
    "key_hourly_usage",
    metadata,
    sa.Column("hour", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("key_id", sa.String(36), primary_key=True),
    sa.Column("requests", sa.Integer, nullable=False, server_default="0"),
    sa.Column("cost_usd", sa.Float, nullable=False, server_default="0"),
    sa.Index(None, "key_id", "hour"),
)

# Failed requests per UTC day, tenant, feature, status and error code ("" when none was recorded),
# maintained by the accounting writer: the dashboard's errors over ranges longer than two days.
daily_errors = sa.Table(
    "daily_errors",
    metadata,
    sa.Column("day", sa.Date, primary_key=True),
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("feature", sa.String(128), primary_key=True),
    sa.Column("status", sa.Integer, primary_key=True),
    sa.Column("error_code", sa.String(64), primary_key=True),
    sa.Column("requests", sa.Integer, nullable=False, server_default="0"),
    sa.Index(None, "feature", "day"),
    sa.Index(None, "tenant", "day"),
)

# Router artifacts that were trained (the files live on disk; this is their record).
router_versions = sa.Table(
    "router_versions",
    metadata,
    sa.Column("version", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("artifact_path", sa.String(1024), nullable=False),
    sa.Column("training_fingerprint", sa.String(64), nullable=False),
    sa.Column("operating_point", sa.JSON, nullable=False),  # thresholds, expected escalation rate, ...
    sa.Column("metrics", sa.JSON, nullable=False),
)

# One row per `sluice router eval` run.
eval_runs = sa.Table(
    "eval_runs",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("router_version", sa.String(64), nullable=True),
    sa.Column("dataset", sa.String(512), nullable=False),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=False),  # apgr, cpt50, cpt80, qualities, escalation rate, cost, ...
    sa.Column("plot_path", sa.String(1024), nullable=True),
    sa.Index(None, "created_at"),
)

# Background large-tier answers to a sample of requests the small tier served: the online quality delta.
shadow_runs = sa.Table(
    "shadow_runs",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("request_id", sa.String(64), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("feature", sa.String(128), nullable=False),
    sa.Column("router_version", sa.String(64), nullable=True),
    sa.Column("route_score", sa.Float, nullable=True),
    sa.Column("confidence", sa.Float, nullable=True),
    sa.Column("prompt", sa.Text, nullable=False),
    sa.Column("small_answer", sa.Text, nullable=False),
    sa.Column("large_answer", sa.Text, nullable=False),
    sa.Column("agreement", sa.Float, nullable=False),  # 1 = same answer, 0 = different
    sa.Column("agreement_method", sa.String(16), nullable=False),  # final_answer | embedding
    sa.Column("large_cost_usd", sa.Float, nullable=False, server_default="0"),
    sa.Index(None, "created_at"),
    sa.Index(None, "feature", "created_at"),
)

# Batch API: uploaded input files and the output and error files the batches write (bytes on disk under
# `batch.dir`, named by id). Each belongs to the tenant that uploaded it (or whose batch wrote it).
files = sa.Table(
    "files",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # file-<time-ordered hex>
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("filename", sa.String(256), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),  # batch | batch_output
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Index(None, "tenant", "id"),
)

# One row per batch job. `worker` and `lease_until`: the gateway process running it and until when its
# claim holds without a heartbeat (a batch whose worker died is taken over after that).
batches = sa.Table(
    "batches",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # batch_<time-ordered hex>
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("feature", sa.String(128), nullable=False),
    sa.Column("key_id", sa.String(36), nullable=True),  # the key that created it: its lines run as that key
    sa.Column("endpoint", sa.String(64), nullable=False),  # /v1/chat/completions | /v1/completions
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("completion_window", sa.String(16), nullable=False),
    # validating | failed | in_progress | finalizing | completed | expired | cancelling | cancelled
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("errors", sa.JSON, nullable=True),  # input validation errors of a failed batch
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("in_progress_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("finalizing_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("worker", sa.String(64), nullable=True),
    sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
    sa.Index(None, "tenant", "id"),  # a tenant's batches, newest first
    sa.Index(None, "status"),  # the workers' search for unfinished batches
)

# One row per request line of a batch, its state committed as it changes: pending → running (claimed by a
# worker, `attempts` counted) → done | failed (the answer recorded; never run again) | cancelled | expired.
batch_lines = sa.Table(
    "batch_lines",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("line", sa.Integer, primary_key=True),  # 0-based position in the input file
    sa.Column("custom_id", sa.String(512), nullable=False),
    sa.Column("body", sa.Text, nullable=False),  # the request body as JSON
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("worker", sa.String(64), nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("request_id", sa.String(64), nullable=True),  # the accounting row of the recorded attempt
    sa.Column("status_code", sa.Integer, nullable=True),
    sa.Column("response", sa.Text, nullable=True),  # the answer's (or error's) JSON body
    sa.Index(None, "batch_id", "state", "line"),
)
