"""OpenAI-style errors: every failure leaves the gateway as `{"error": {message, type, param, code}}`.

Modules on the request path raise `GatewayError`; the app's exception handlers turn it (and
Litestar's own validation / routing errors) into the one error body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from engines.protocol import ErrorDetail, ErrorResponse, encode

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


class GatewayError(Exception):
    """A failure to report to the client, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or _TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return encode(
            ErrorResponse(
                error=ErrorDetail(message=self.message, type=self.error_type, param=self.param, code=self.code)
            )
        )


# Seconds a client is told to wait when a tier, the key store or the shared counters are unreachable.
RETRY_AFTER_UNAVAILABLE_S = 5


def service_unavailable(message: str, code: str) -> GatewayError:
    """503 with Retry-After: a dependency is down, the request may succeed later."""
    return GatewayError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


def invalid_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


_MSGSPEC_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`")


def from_validation_message(message: str) -> GatewayError:
    """A msgspec validation message ("Expected `int`, got `str` - at `$.n`") as a 400 naming the param."""
    match = _MSGSPEC_PATH_RE.search(message)
    param = match.group("path") or None if match else None
    if match:
        message = message[: match.start()]
    code = "missing_required_parameter" if message.startswith("Object missing required field") else "invalid_type"
    if param is None and (missing := re.search(r"required field `([^`]*)`", message)):
        param = missing.group(1)
    return GatewayError(400, message, code=code, param=param)
