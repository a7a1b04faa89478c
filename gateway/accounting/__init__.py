"""Request accounting off the request path: one `requests` row per request plus the rollups the dashboard
reads (`daily_usage`, `hourly_usage` with latency histograms, `key_hourly_usage`, `daily_errors`).

The gateway builds a `RequestRecord` per request and calls `AccountingWriter.submit`, which only
appends to an in-memory queue. A background task writes batches: a multi-row INSERT … ON CONFLICT
(request_id) DO NOTHING RETURNING request_id, and the rollup upsert for exactly the rows returned, in
one transaction (on Postgres one prepared statement with one array parameter per column, so a flush
is one round trip whatever its size). Replaying a batch is therefore idempotent: rows already
present are neither inserted again nor counted again.

When the database is unreachable, batches go to a bounded spool of append-only JSONL segments
(fsync'd) and are replayed, oldest first, once it is back; a segment is deleted only after all its
rows are committed. `close()` writes or spools everything still queued.

The package: `record` (the row and its rollup), `sql` (the SQL writer), `spool` (records on disk
while the database is down) and `writer` (the queue and the background loop).
"""

from gateway.accounting.record import NO_TIER, RequestRecord, rollup_contribution, rollup_deltas
from gateway.accounting.spool import Spool
from gateway.accounting.sql import write_batch
from gateway.accounting.writer import AccountingStats, AccountingWriter

__all__ = [
    "NO_TIER",
    "AccountingStats",
    "AccountingWriter",
    "RequestRecord",
    "Spool",
    "rollup_contribution",
    "rollup_deltas",
    "write_batch",
]
