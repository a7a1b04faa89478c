"""The Batch API's objects as OpenAI's API returns them (what the `openai` SDK parses), and the
request line format of its input and output files."""

from __future__ import annotations

import random
import time
from typing import Any, Literal

import msgspec

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/embeddings": "embeddings"}
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600


def new_id(prefix: str) -> str:
    """A time-ordered id (listings page by id, newest first) with 32 random bits against collisions."""
    return f"{prefix}{time.time_ns():016x}{random.getrandbits(32):08x}"


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct, kw_only=True):
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    line: int | None = None  # 1-based line of the input file
    param: str | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class Batch(msgspec.Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    object: Literal["batch"] = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(msgspec.Struct, kw_only=True):
    data: list[Batch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class CreateBatch(msgspec.Struct, kw_only=True):
    """The body of `POST /v1/batches`."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; files here do not expire


class InputLine(msgspec.Struct, kw_only=True):
    """One request line of an input file, checked; `body` stays the JSON text it was."""

    line: int  # 0-based
    custom_id: str
    body: str


MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 100  # reported of a rejected input file
MAX_CUSTOM_ID_LEN = 512


def parse_input(data: bytes, endpoint: str) -> tuple[list[InputLine], list[BatchError]]:
    """The request lines of a JSONL input file and what is wrong with it (the batch fails when anything is)."""
    lines: list[InputLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = _input_line(raw, endpoint, seen)
        except _LineError as exc:
            errors.append(BatchError(code=exc.code, message=str(exc), line=number, param=exc.param))
            if len(errors) >= MAX_ERRORS:
                break
            continue
        lines.append(InputLine(line=len(lines), custom_id=item[0], body=item[1]))
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="The input file has no request lines."))
    if len(lines) > MAX_LINES:
        errors.append(BatchError(code="too_many_requests", message=f"A batch holds at most {MAX_LINES} requests."))
    return lines, errors


class _LineError(ValueError):
    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def _input_line(raw: bytes, endpoint: str, seen: set[str]) -> tuple[str, str]:
    try:
        item = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise _LineError(f"The line is not valid JSON: {exc}", "invalid_json_line") from None
    if not isinstance(item, dict):
        raise _LineError("The line must be a JSON object.", "invalid_request")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_LEN:
        raise _LineError(f"`custom_id` must be a string of 1 to {MAX_CUSTOM_ID_LEN} characters.",
                         "missing_required_parameter", "custom_id")  # fmt: skip
    if custom_id in seen:
        raise _LineError(f"The custom_id `{custom_id}` is used by another line.", "duplicate_custom_id", "custom_id")
    if item.get("method") != "POST":
        raise _LineError("`method` must be POST.", "invalid_request", "method")
    if item.get("url") != endpoint:
        raise _LineError(f"`url` must be the batch's endpoint {endpoint}.", "mismatched_endpoint", "url")
    if not isinstance(item.get("body"), dict):
        raise _LineError("`body` must be a JSON object.", "missing_required_parameter", "body")
    seen.add(custom_id)
    return custom_id, msgspec.json.encode(item["body"]).decode()
