"""The one interface through which the gateway talks to a tier, and the tier client over HTTP.

A tier is our engine in this process (`engines.serving.InProcessEngineClient`), our engine server,
or anyone's OpenAI-compatible server (`HttpEngineClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import httpx
import msgspec

from engines.api.errors import APIError
from engines.api.http1 import HttpClientError, HttpPool
from engines.api.prompts import PromptTokenizer, count_prompt_tokens
from engines.api.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    StreamOptions,
    encode,
)

logger = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The tier could not serve: down, timed out, or refused. The gateway may fall back."""


@dataclass(frozen=True, slots=True)
class TierLoad:
    """How loaded a tier is now, as an autoscaler reads it: sequences waiting to be scheduled (by priority
    class), sequences running, and the share of the KV cache held."""

    waiting_interactive: int
    waiting_batch: int
    running: int
    kv_utilisation: float


class EngineClient(Protocol):
    """An OpenAI-compatible tier. Streams yield chunks; the last chunk carries `usage`.

    Refused requests raise `engines.api.errors.APIError` (carrying the OpenAI error body and status);
    a tier that cannot serve raises `EngineUnavailable`.
    """

    model_name: str

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        """Prompt tokens exactly as this tier will count them (chat template applied)."""
        ...

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion: ...

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]: ...

    async def complete(self, request: CompletionRequest) -> Completion: ...

    def complete_stream(self, request: CompletionRequest) -> AsyncIterator[Completion]: ...

    async def ready(self) -> bool: ...

    def load(self) -> TierLoad | None:
        """The tier's scheduler state (an in-process engine); None where only the tier knows it (an
        upstream: its own /metrics has it)."""
        ...

    async def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Over HTTP
# ---------------------------------------------------------------------------------------------

ChunkT = TypeVar("ChunkT", ChatCompletionChunk, Completion)

# Without the tier's tokenizer, prompts are estimated: ~4 characters per token for English and
# code, plus the tokens a ChatML-style template adds around each message and the reply header.
CHARS_PER_TOKEN = 4
TEMPLATE_TOKENS_PER_MESSAGE = 4
TEMPLATE_TOKENS_PER_REPLY = 3

END_OF_STREAM_WAIT_S = 1.0  # after `data: [DONE]`, for the end of the body

_error_decoder = msgspec.json.Decoder(ErrorResponse)


def to_body(request: ChatCompletionRequest | CompletionRequest, **changes: Any) -> bytes:
    """The request as JSON with the upstream model name, leaving out unset fields; the fields no OpenAI
    type names go along untouched (`engines.api.fields`: the upstream answers for them)."""
    fields = msgspec.to_builtins(msgspec.structs.replace(request, **changes))
    extras = fields.pop("extra_fields", None) or {}
    return encode({**extras, **{k: v for k, v in fields.items() if v is not None}})


UpstreamPriority = Literal["none", "sluice", "vllm"]
VLLM_PRIORITY = {"interactive": 0, "batch": 1}  # vLLM schedules lower values first


def upstream_priority(priority: str | None, field: UpstreamPriority) -> str | int | None:
    """The request's scheduling class as the upstream takes it: our engine server's string, vLLM's integer
    (honoured with `--scheduling-policy priority`), or None (left out: other servers reject the field)."""
    if priority is None or field == "none":
        return None
    return VLLM_PRIORITY[priority] if field == "vllm" else priority


def _estimate_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def _raise_for_status(status_code: int, body: bytes, base_url: str) -> None:
    """4xx → the upstream's own OpenAI error; 429 and 5xx → EngineUnavailable (the gateway may fall back)."""
    if status_code < 400:
        return
    if status_code == 429 or status_code >= 500:
        raise EngineUnavailable(f"{base_url} answered {status_code}: {body[:200].decode(errors='replace')}")
    try:
        detail = _error_decoder.decode(body).error
    except msgspec.MsgspecError:
        # Not an OpenAI error (a proxy's HTML page, a stack trace): its text stays out of the answer.
        logger.warning("%s answered %d with a non-OpenAI body: %r", base_url, status_code, body[:200])
        message = f"The upstream refused the request ({status_code}) without an OpenAI error body."
        raise APIError(status_code, message) from None
    raise APIError.from_detail(detail, status_code)


class HttpEngineClient:
    """A tier behind an OpenAI-compatible HTTP server (ours, or vLLM and the like).

    Requests go out under `model` (the upstream's model name). Streams always ask the upstream for
    `include_usage`, so they end with the usage chunk the gateway charges from. One pooled
    keep-alive connection per concurrent request, up to `max_connections`, on the lean client of
    `engines.api.http1` (httpx costs several times its CPU per call); an injected httpx `transport`
    (in-memory ASGI apps, mocks) goes through httpx instead.

    Timeouts: `connect_timeout` to open a connection, `pool_timeout` to wait for a free one,
    `read_timeout` of silence between bytes, and `request_timeout` for the whole request, a stream to
    its last event included (on httpx, non-streamed requests only). Each ends the request with
    `EngineUnavailable`, never a hang.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "",
        tokenizer: PromptTokenizer | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 120.0,
        *,
        pool_timeout: float = 5.0,
        request_timeout: float = 600.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        priority_field: UpstreamPriority = "none",
    ) -> None:
        root = base_url.rstrip("/")
        self.priority_field = priority_field
        self.base_url = root if root.endswith("/v1") else f"{root}/v1"
        self.model_name = model
        self.tokenizer = tokenizer
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._pool: HttpPool | None = None
        self._client: httpx.AsyncClient | None = None
        self._request_timeout = request_timeout
        if transport is None:
            self._pool = HttpPool(self.base_url, headers=headers, connect_timeout=connect_timeout,
                                  read_timeout=read_timeout, pool_timeout=pool_timeout, total_timeout=request_timeout,
                                  max_connections=max_connections)  # fmt: skip
        else:
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=pool_timeout),
                limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
                transport=transport,
            )

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        """Exact with the tier's tokenizer; otherwise an estimate (see CHARS_PER_TOKEN)."""
        if self.tokenizer is not None:
            return count_prompt_tokens(self.tokenizer, request)
        if isinstance(request, ChatCompletionRequest):
            return TEMPLATE_TOKENS_PER_REPLY + sum(
                TEMPLATE_TOKENS_PER_MESSAGE + _estimate_tokens(m.text()) for m in request.messages
            )
        prompt = request.prompt
        if isinstance(prompt, str):
            return _estimate_tokens(prompt)
        return sum(_estimate_tokens(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 1 for p in prompt)

    async def _post(self, path: str, body: bytes) -> bytes:
        try:
            if self._pool is not None:
                status, content = await self._pool.request("POST", path, body)
            else:
                assert self._client is not None
                async with asyncio.timeout(self._request_timeout):
                    response = await self._client.post(path, content=body)
                status, content = response.status_code, response.content
        except (HttpClientError, httpx.TransportError, TimeoutError) as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        _raise_for_status(status, content, self.base_url)
        return content

    async def _stream(self, path: str, body: bytes, chunk_type: type[ChunkT]) -> AsyncGenerator[ChunkT, None]:
        """Chunks as each SSE line arrives. Closing this generator closes the upstream response,
        and the upstream aborts the request."""
        decoder = msgspec.json.Decoder(chunk_type)
        if self._pool is not None:
            async for chunk in self._stream_http1(self._pool, path, body, decoder):
                yield chunk
            return
        assert self._client is not None
        try:
            response = await self._client.send(self._client.build_request("POST", path, content=body), stream=True)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            if response.status_code >= 400:
                _raise_for_status(response.status_code, await response.aread(), self.base_url)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield _decode_event(decoder, data)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            await response.aclose()

    async def _stream_http1(
        self, pool: HttpPool, path: str, body: bytes, decoder: msgspec.json.Decoder[ChunkT]
    ) -> AsyncGenerator[ChunkT, None]:
        try:
            response = await pool.open("POST", path, body)
        except HttpClientError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            if response.status >= 400:
                _raise_for_status(response.status, await response.read(), self.base_url)
            lines = response.iter_lines()
            async for line in lines:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, keep-alives
                data = line[5:].strip()
                if data == b"[DONE]":
                    # Read the end of the body so that the connection is reused; an upstream that
                    # does not end it soon loses the connection instead of holding up the stream.
                    with contextlib.suppress(TimeoutError, HttpClientError):
                        async with asyncio.timeout(END_OF_STREAM_WAIT_S):
                            async for _ in lines:
                                pass
                    return
                yield _decode_event(decoder, data)
        except HttpClientError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            response.close()  # before the end: closes the connection, and the upstream aborts

    def _body(self, request: ChatCompletionRequest | CompletionRequest, stream: bool) -> bytes:
        return to_body(request, model=self.model_name, stream=stream,
                       stream_options=StreamOptions(include_usage=True) if stream else None,
                       priority=upstream_priority(request.priority, self.priority_field))  # fmt: skip

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        body = self._body(request, stream=False)
        return msgspec.json.decode(await self._post("/chat/completions", body), type=ChatCompletion)

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[ChatCompletionChunk, None]:
        return self._stream("/chat/completions", self._body(request, stream=True), ChatCompletionChunk)

    async def complete(self, request: CompletionRequest) -> Completion:
        body = self._body(request, stream=False)
        return msgspec.json.decode(await self._post("/completions", body), type=Completion)

    def complete_stream(self, request: CompletionRequest) -> AsyncGenerator[Completion, None]:
        return self._stream("/completions", self._body(request, stream=True), Completion)

    async def ready(self) -> bool:
        """The upstream answers `GET /v1/models` (every OpenAI-compatible server has it)."""
        try:
            if self._pool is not None:
                status, _ = await self._pool.request("GET", "/models")
                return status == 200
            assert self._client is not None
            response = await self._client.get("/models")
        except (HttpClientError, httpx.TransportError):
            return False
        return response.status_code == 200

    def load(self) -> TierLoad | None:
        return None

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self._client is not None:
            await self._client.aclose()


def _decode_event(decoder: msgspec.json.Decoder[ChunkT], data: str | bytes) -> ChunkT:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError:
        pass  # not a chunk: an in-band error sent after the stream had started
    try:
        detail = _error_decoder.decode(data).error
    except msgspec.MsgspecError as exc:
        raise EngineUnavailable(f"upstream sent an unreadable event: {data[:200]!r}") from exc
    raise APIError.from_detail(detail, 500 if detail.type == "server_error" else 400)
