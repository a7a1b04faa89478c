"""The Batch API's operations, as the controllers call them: files in, batches created, read, listed
and cancelled, each scoped to the caller's tenant."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.errors import APIError, invalid
from gateway.auth import Principal
from gateway.batches import store
from gateway.batches.files import FileStore
from gateway.batches.wire import (
    COMPLETION_WINDOW,
    COMPLETION_WINDOW_S,
    ENDPOINTS,
    Batch,
    BatchError,
    BatchErrors,
    BatchList,
    CreateBatch,
    FileDeleted,
    FileList,
    FileObject,
    RequestCounts,
    new_id,
    parse_input,
)
from gateway.batches.worker import BatchWorker

MAX_FILENAME_LEN = 256
MAX_LIST_LIMIT = 100
MAX_FILE_LIST_LIMIT = 10_000  # OpenAI's bound for GET /v1/files


def _epoch(moment: datetime | None) -> int | None:
    return None if moment is None else int(store.utc(moment).timestamp())  # type: ignore[union-attr]


def _not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No {kind} with id `{object_id}`.", code="not_found", param="id")


def file_object(row: Any) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=_epoch(row.created_at) or 0, filename=row.filename,
                      purpose=row.purpose)  # fmt: skip


def batch_object(row: Any, counts: store.LineCounts) -> Batch:
    errors = BatchErrors(data=[BatchError(**e) for e in row.errors]) if row.errors else None
    moments = {name: _epoch(getattr(row, name)) for name in (
        "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
        "cancelling_at", "cancelled_at")}  # fmt: skip
    return Batch(
        id=row.id, endpoint=row.endpoint, input_file_id=row.input_file_id, completion_window=row.completion_window,
        status=row.status, created_at=_epoch(row.created_at) or 0, errors=errors, output_file_id=row.output_file_id,
        error_file_id=row.error_file_id, metadata=row.metadata,
        request_counts=RequestCounts(total=counts.total, completed=counts.done, failed=counts.failed), **moments,
    )  # fmt: skip


class BatchService:
    def __init__(self, db: AsyncEngine, files: FileStore, worker: BatchWorker | None) -> None:
        self.db = db
        self.files = files
        self.worker = worker

    async def upload(self, principal: Principal, filename: str, purpose: str, chunks: Iterable[bytes]) -> FileObject:
        if purpose != "batch":
            raise invalid("Only files of purpose `batch` can be uploaded here.", "purpose")
        file_id, now = new_id("file-"), datetime.now(UTC)
        size = await self.files.write(file_id, chunks)
        name = "".join(c for c in filename if c.isprintable())[:MAX_FILENAME_LEN] or "upload.jsonl"
        row = {"id": file_id, "created_at": now, "tenant": principal.tenant, "filename": name,
               "purpose": purpose, "bytes": size}  # fmt: skip
        await store.insert_file(self.db, row)
        return FileObject(id=file_id, bytes=size, created_at=_epoch(now) or 0, filename=name, purpose=purpose)

    async def file(self, principal: Principal, file_id: str) -> FileObject:
        return file_object(await self._file_row(principal, file_id))

    async def list_files(self, principal: Principal, purpose: str | None, after: str | None, limit: int,
                         order: str) -> FileList:
        if not 1 <= limit <= MAX_FILE_LIST_LIMIT:
            raise invalid(f"`limit` must be between 1 and {MAX_FILE_LIST_LIMIT}.", "limit")
        if order not in ("asc", "desc"):
            raise invalid("`order` must be `asc` or `desc`.", "order", "unsupported_value")
        rows = await store.list_files(self.db, principal.tenant, purpose, after, limit, newest_first=order == "desc")
        data = [file_object(row) for row in rows[:limit]]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return FileList(data=data, has_more=len(rows) > limit, first_id=first, last_id=last)

    async def delete_file(self, principal: Principal, file_id: str) -> FileDeleted:
        """The row first, then the bytes: a file is gone for the API as soon as its row is. A batch keeps
        running after its input file is deleted (its lines were copied when it was created)."""
        if not await store.delete_file(self.db, file_id, principal.tenant):
            raise _not_found("file", file_id)
        await self.files.delete(file_id)
        return FileDeleted(id=file_id)

    async def content(self, principal: Principal, file_id: str) -> Path:
        await self._file_row(principal, file_id)
        return self.files.path(file_id)

    async def create(self, principal: Principal, body: CreateBatch) -> Batch:
        if body.endpoint not in ENDPOINTS:
            raise invalid(f"`endpoint` must be one of {', '.join(ENDPOINTS)}.", "endpoint", "unsupported_value")
        if body.completion_window != COMPLETION_WINDOW:
            raise invalid(f"`completion_window` must be {COMPLETION_WINDOW}.", "completion_window")
        source = await self._file_row(principal, body.input_file_id)
        if source.purpose != "batch":
            raise invalid("The input file's purpose must be `batch`.", "input_file_id")
        data = await self.files.read(source.id)
        lines, errors = await asyncio.to_thread(parse_input, data, body.endpoint)
        now = datetime.now(UTC)
        row = {"id": new_id("batch_"), "created_at": now, "tenant": principal.tenant, "feature": principal.feature,
               "key_id": principal.key_id, "endpoint": body.endpoint, "input_file_id": source.id,
               "completion_window": body.completion_window, "metadata": body.metadata,
               "expires_at": now + timedelta(seconds=COMPLETION_WINDOW_S),
               "status": "failed" if errors else "validating", "failed_at": now if errors else None,
               "errors": [msgspec.to_builtins(e) for e in errors] or None}  # fmt: skip
        await store.insert_batch(self.db, row, [] if errors else lines)
        if self.worker is not None and not errors:
            self.worker.wake()
        return await self.retrieve(principal, row["id"])

    async def retrieve(self, principal: Principal, batch_id: str) -> Batch:
        row = await store.find_batch(self.db, batch_id, principal.tenant)
        if row is None:
            raise _not_found("batch", batch_id)
        return batch_object(row, (await store.line_counts(self.db, [row.id]))[row.id])

    async def list(self, principal: Principal, after: str | None, limit: int) -> BatchList:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise invalid(f"`limit` must be between 1 and {MAX_LIST_LIMIT}.", "limit")
        rows = await store.list_batches(self.db, principal.tenant, after, limit)
        page = rows[:limit]
        counts = await store.line_counts(self.db, [row.id for row in page]) if page else {}
        data = [batch_object(row, counts[row.id]) for row in page]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return BatchList(data=data, has_more=len(rows) > limit, first_id=first, last_id=last)

    async def cancel(self, principal: Principal, batch_id: str) -> Batch:
        await self.retrieve(principal, batch_id)  # 404 for another tenant's batch
        await store.request_cancel(self.db, batch_id, principal.tenant, datetime.now(UTC))
        if self.worker is not None:
            self.worker.wake()
        return await self.retrieve(principal, batch_id)

    async def _file_row(self, principal: Principal, file_id: str) -> Any:
        row = await store.find_file(self.db, file_id, principal.tenant)
        if row is None:
            raise _not_found("file", file_id)
        return row
