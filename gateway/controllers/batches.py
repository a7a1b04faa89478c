"""The OpenAI Batch API: `/v1/files` and `/v1/batches`. Thin: `gateway.batches.service` does the work."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from litestar import Controller, Request, delete, get, post
from litestar.datastructures import State, UploadFile
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import File

from engines.api.errors import invalid
from gateway.auth import Principal
from gateway.batches.service import MAX_FILE_LIST_LIMIT, BatchService
from gateway.batches.wire import Batch, BatchList, CreateBatch, FileDeleted, FileList, FileObject
from gateway.controllers.openai import authenticated


async def authenticated_unrecorded(request: Request[Any, Any, Any]) -> None:
    """Authenticated like the completions endpoints; managing files and batches leaves no accounting row
    (each batch line leaves its own)."""
    await authenticated(request)
    request.state.sluice.finished = True


def provide_batches(state: State) -> BatchService:
    return state.batches


def _principal(request: Request[Any, Any, Any]) -> Principal:
    principal: Principal = request.state.sluice.principal
    return principal


class FilesController(Controller):
    """`/v1/files` itself, where uploads come: mounted under a router whose body bound is `batch.max_file_bytes`,
    while every other endpoint keeps `server.max_body_bytes`."""

    path = "/v1"
    before_request = authenticated_unrecorded

    @get("/files", summary="The caller's files, newest first")
    async def list_files(self, request: Request[Any, Any, Any], batches: NamedDependency[BatchService],
                         purpose: FromQuery[str | None] = None, after: FromQuery[str | None] = None,
                         limit: FromQuery[int] = MAX_FILE_LIST_LIMIT,
                         order: FromQuery[str] = "desc") -> FileList:  # fmt: skip
        return await batches.list_files(_principal(request), purpose, after, limit, order)

    @post("/files", status_code=200, summary="Upload a batch input file (multipart: file, purpose)")
    async def upload(self, request: Request[Any, Any, Any], batches: NamedDependency[BatchService]) -> FileObject:
        form = await request.form()  # the file part spools to disk as it arrives
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise invalid("Send the file as the multipart field `file`.", "file", "missing_required_parameter")
        if not isinstance(purpose, str):
            raise invalid("Send the multipart field `purpose` (batch).", "purpose", "missing_required_parameter")
        return await batches.upload(_principal(request), upload.filename, purpose, _chunks(upload))


def _chunks(upload: UploadFile, size: int = 1 << 20) -> Iterator[bytes]:
    """The uploaded bytes in pieces, read where they are written (off the event loop): never whole in memory."""
    upload.file.seek(0)
    while chunk := upload.file.read(size):
        yield chunk


class BatchController(Controller):
    path = "/v1"
    before_request = authenticated_unrecorded

    @delete("/files/{file_id:str}", status_code=200, summary="Delete a file")
    async def delete_file(self, request: Request[Any, Any, Any], file_id: FromPath[str],
                          batches: NamedDependency[BatchService]) -> FileDeleted:  # fmt: skip
        return await batches.delete_file(_principal(request), file_id)

    @get("/files/{file_id:str}", summary="A file's description")
    async def file(self, request: Request[Any, Any, Any], file_id: FromPath[str],
                   batches: NamedDependency[BatchService]) -> FileObject:  # fmt: skip
        return await batches.file(_principal(request), file_id)

    @get("/files/{file_id:str}/content", summary="A file's bytes")
    async def content(self, request: Request[Any, Any, Any], file_id: FromPath[str],
                      batches: NamedDependency[BatchService]) -> File:  # fmt: skip
        path = await batches.content(_principal(request), file_id)
        return File(path=path, filename=f"{file_id}.jsonl", media_type="application/octet-stream")

    @post("/batches", status_code=200, summary="Create a batch from an uploaded input file")
    async def create(self, request: Request[Any, Any, Any], data: JSONBody[CreateBatch],
                     batches: NamedDependency[BatchService]) -> Batch:  # fmt: skip
        return await batches.create(_principal(request), data)

    @get("/batches", summary="The caller's batches, newest first")
    async def list_batches(self, request: Request[Any, Any, Any], batches: NamedDependency[BatchService],
                           after: FromQuery[str | None] = None, limit: FromQuery[int] = 20) -> BatchList:  # fmt: skip
        return await batches.list(_principal(request), after, limit)

    @get("/batches/{batch_id:str}", summary="A batch")
    async def retrieve(self, request: Request[Any, Any, Any], batch_id: FromPath[str],
                       batches: NamedDependency[BatchService]) -> Batch:  # fmt: skip
        return await batches.retrieve(_principal(request), batch_id)

    @post("/batches/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
    async def cancel(self, request: Request[Any, Any, Any], batch_id: FromPath[str],
                     batches: NamedDependency[BatchService]) -> Batch:  # fmt: skip
        return await batches.cancel(_principal(request), batch_id)
