"""The one error type of the contract: every refusal, in the gateway or in a tier, is an `APIError`
and leaves as OpenAI's `{"error": {message, type, param, code}}` with its HTTP status.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from engines.api.protocol import ErrorDetail, ErrorResponse, encode

# The `type` OpenAI's API returns for each status; clients branch on status and `code`.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

# Seconds a client is told to wait when a tier, the key store or the shared counters are unreachable.
RETRY_AFTER_UNAVAILABLE_S = 5


def default_type(status_code: int) -> str:
    return _TYPE_BY_STATUS.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")


class APIError(Exception):
    """A request refused or failed, with its HTTP status, OpenAI error fields and response headers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.type = type or default_type(status_code)
        self.headers = dict(headers or {})

    @classmethod
    def from_detail(cls, detail: ErrorDetail, status_code: int) -> APIError:
        """An error another server reported in an OpenAI error body."""
        return cls(status_code, detail.message, code=detail.code, param=detail.param, type=detail.type)

    @property
    def detail(self) -> ErrorDetail:
        return ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=self.detail)

    def body(self) -> bytes:
        return encode(self.response())


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """400: the request breaks a rule of the API."""
    return APIError(400, message, code=code, param=param)


def service_unavailable(message: str, code: str) -> APIError:
    """503 with Retry-After: a dependency is down, the request may succeed later."""
    return APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


_MSGSPEC_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`")
_MISSING_FIELD = re.compile(r"required field `([^`]*)`")


def validation_error(message: str) -> APIError:
    """A msgspec validation message ("Expected `int`, got `str` - at `$.n`") as a 400 naming the param.

    The one reader of msgspec's error paths: the engine server's body decoding and the gateway's
    (through Litestar) both report a mistyped or missing field through it."""
    match = _MSGSPEC_PATH.search(message)
    param = (match.group("path") or None) if match else None
    if match:
        message = message[: match.start()]
    code = "missing_required_parameter" if message.startswith("Object missing required field") else "invalid_type"
    if param is None and (missing := _MISSING_FIELD.search(message)):
        param = missing.group(1)
    return APIError(400, message, code=code, param=param)
