"""A fast OpenAI-compatible fake upstream on loopback, for benchmarks only (never used by the product).

It answers every chat or text completion with the same fixed text, plain or as a server-sent event
stream (with a usage chunk when `stream_options.include_usage` is set), and lists the models it was
started with. It is a raw `asyncio.Protocol` HTTP/1.1 server with keep-alive, so that it is never the
bottleneck of a gateway benchmark: a gateway measured against it pays only for its own work.

    python -m bench.fake_upstream --port 9100 [--models small,large] [--token-interval-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec

from engines.api.protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    encode,
    new_id,
    now,
    sse_event,
)

ANSWER_PIECES = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")
ANSWER = "".join(ANSWER_PIECES)
DEFAULT_MODELS = ("small", "large")
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def prompt_tokens_of(request: ChatCompletionRequest | CompletionRequest) -> int:
    """A deterministic stand-in for tokenisation: whitespace-separated words of the prompt."""
    if isinstance(request, ChatCompletionRequest):
        return sum(len(message.text().split()) for message in request.messages)
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt.split())
    return sum(len(p.split()) if isinstance(p, str) else 1 for p in prompt)


def usage_of(request: ChatCompletionRequest | CompletionRequest) -> Usage:
    return Usage.of(prompt_tokens_of(request), len(ANSWER_PIECES))


def chat_completion(request: ChatCompletionRequest) -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=now(),
        model=request.model,
        choices=[
            ChatChoice(index=i, message=AssistantMessage(content=ANSWER), finish_reason="stop")
            for i in range(request.n)
        ],
        usage=usage_of(request),
    )


def chat_stream_events(request: ChatCompletionRequest) -> list[bytes]:
    """The events of one streamed chat completion, `[DONE]` included, as OpenAI orders them."""
    completion_id, created = new_id("chatcmpl"), now()

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> bytes:
        choices = [ChatChunkChoice(index=i, delta=delta, finish_reason=finish_reason) for i in range(request.n)]
        return sse_event(ChatCompletionChunk(id=completion_id, created=created, model=request.model, choices=choices))

    events = [chunk(DeltaMessage(role="assistant", content=""))]
    events += [chunk(DeltaMessage(content=piece)) for piece in ANSWER_PIECES]
    events.append(chunk(DeltaMessage(), finish_reason="stop"))
    if request.stream_options is not None and request.stream_options.include_usage:
        usage_chunk = ChatCompletionChunk(
            id=completion_id, created=created, model=request.model, choices=[], usage=usage_of(request)
        )
        events.append(sse_event(usage_chunk))
    events.append(SSE_DONE)
    return events


def text_completion(request: CompletionRequest) -> Completion:
    return Completion(
        id=new_id("cmpl"),
        created=now(),
        model=request.model,
        choices=[CompletionChoice(index=i, text=ANSWER, finish_reason="stop") for i in range(request.n)],
        usage=usage_of(request),
    )


def text_stream_events(request: CompletionRequest) -> list[bytes]:
    completion_id, created = new_id("cmpl"), now()

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choices = [CompletionChoice(index=i, text=text, finish_reason=finish_reason) for i in range(request.n)]
        return sse_event(Completion(id=completion_id, created=created, model=request.model, choices=choices))

    events = [chunk(piece) for piece in ANSWER_PIECES]
    events.append(chunk("", finish_reason="stop"))
    if request.stream_options is not None and request.stream_options.include_usage:
        usage_chunk = Completion(
            id=completion_id, created=created, model=request.model, choices=[], usage=usage_of(request)
        )
        events.append(sse_event(usage_chunk))
    events.append(SSE_DONE)
    return events


# --- HTTP/1.1 ------------------------------------------------------------------------------------


def _head(status: int, content_type: bytes, extra: bytes) -> bytes:
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n%s\r\n" % (
        status,
        HTTPStatus(status).phrase.encode(),
        content_type,
        extra,
    )


def json_response(status: int, body: bytes, keep_alive: bool = True) -> bytes:
    connection = b"" if keep_alive else b"connection: close\r\n"
    return _head(status, b"application/json", b"content-length: %d\r\n%s" % (len(body), connection)) + body


def error_response(status: int, message: str, error_type: str = "invalid_request_error") -> bytes:
    return json_response(status, encode(ErrorResponse(error=ErrorDetail(message=message, type=error_type))))


def _chunk(data: bytes) -> bytes:
    """One piece of a `transfer-encoding: chunked` body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = _head(200, b"text/event-stream", b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n")
CHUNKED_END = b"0\r\n\r\n"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeUpstream:
    """What the server answers; shared by every connection."""

    models: tuple[str, ...] = DEFAULT_MODELS
    token_interval_s: float = 0.0
    requests_served: int = field(default=0, init=False)

    def models_body(self) -> bytes:
        return encode(ModelList(data=[ModelCard(id=m, owned_by="fake-upstream") for m in self.models]))

    def respond(self, request: Request) -> bytes | list[bytes]:
        """A whole response, or the SSE events of a stream (the protocol frames and paces them)."""
        self.requests_served += 1
        path = request.path.split("?", 1)[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            if request.method != "GET":
                return error_response(405, f"{request.method} not allowed on {path}")
            return json_response(200, self.models_body())
        if path in ("/health", "/healthz"):
            return json_response(200, b'{"status":"ok"}')
        if path in ("/v1/chat/completions", "/chat/completions"):
            return self._completion(request, _chat_decoder, chat_completion, chat_stream_events)
        if path in ("/v1/completions", "/completions"):
            return self._completion(request, _completion_decoder, text_completion, text_stream_events)
        return error_response(404, f"no route {request.method} {path}")

    @staticmethod
    def _completion(request: Request, decoder: msgspec.json.Decoder, whole: Any, stream: Any) -> bytes | list[bytes]:
        if request.method != "POST":
            return error_response(405, f"{request.method} not allowed; use POST")
        try:
            parsed = decoder.decode(request.body)
        except msgspec.DecodeError as exc:
            return error_response(400, f"invalid request body: {exc}")
        if parsed.stream:
            return stream(parsed)
        return json_response(200, encode(whole(parsed)))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; requests are answered in order (pipelining works)."""

    def __init__(self, upstream: FakeUpstream) -> None:
        self.upstream = upstream
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.streaming: asyncio.Task[None] | None = None
        self.pending: list[Request] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := self._parse_one()) is not None:
            self.pending.append(request)
        self._answer_pending()

    def _parse_one(self) -> Request | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:
                self._fail(400, "request headers too large")
            return None
        try:
            head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            method, target, _version = head[0].split(" ", 2)
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
        except ValueError:
            self._fail(400, "malformed HTTP request")
            return None
        if length > MAX_BODY_BYTES:
            self._fail(413, "request body too large")
            return None
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", ""):
            parsed = _dechunk(self.buffer, start)
            if parsed is None:
                return None
            body, consumed = parsed
        else:
            if len(self.buffer) < start + length:
                return None
            body, consumed = bytes(self.buffer[start : start + length]), start + length
        del self.buffer[:consumed]
        return Request(method=method, path=target, headers=headers, body=body)

    def _fail(self, status: int, message: str) -> None:
        self.buffer.clear()
        if self.transport is not None:
            body = encode(ErrorResponse(error=ErrorDetail(message=message, type="invalid_request_error")))
            self.transport.write(json_response(status, body, keep_alive=False))
            self.transport.close()

    def _answer_pending(self) -> None:
        # A stream being paced owns the connection until it ends; later requests wait their turn.
        while self.pending and self.streaming is None and self.transport is not None:
            request = self.pending.pop(0)
            response = self.upstream.respond(request)
            if isinstance(response, bytes):
                self.transport.write(response)
            elif self.upstream.token_interval_s <= 0:
                self.transport.write(SSE_HEAD + b"".join(_chunk(e) for e in response) + CHUNKED_END)
            else:
                self.streaming = asyncio.get_running_loop().create_task(self._paced(response))
            if request.headers.get("connection", "").lower() == "close" and self.transport is not None:
                self.transport.close()

    async def _paced(self, events: list[bytes]) -> None:
        try:
            assert self.transport is not None
            self.transport.write(SSE_HEAD + _chunk(events[0]))
            for event in events[1:]:
                await asyncio.sleep(self.upstream.token_interval_s)
                if self.transport is None:
                    return
                self.transport.write(_chunk(event))
            self.transport.write(CHUNKED_END)
        finally:
            self.streaming = None
        self._answer_pending()


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a complete chunked body starting at `start`: (body, bytes consumed), or None if incomplete."""
    body = bytearray()
    pos = start
    while True:
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(bytes(buffer[pos:line_end]).split(b";", 1)[0], 16)
        pos = line_end + 2
        if size == 0:
            trailer_end = buffer.find(b"\r\n", pos)
            return (bytes(body), trailer_end + 2) if trailer_end >= 0 else None
        if len(buffer) < pos + size + 2:
            return None
        body += buffer[pos : pos + size]
        pos += size + 2


async def start_server(
    host: str = "127.0.0.1", port: int = 0, upstream: FakeUpstream | None = None
) -> tuple[asyncio.Server, str]:
    """Serve on the running loop; returns the server and its base URL (port 0 picks a free port)."""
    upstream = upstream or FakeUpstream()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(upstream), host, port, reuse_address=True, backlog=1024)
    bound_port = server.sockets[0].getsockname()[1]
    return server, f"http://{host}:{bound_port}"


@contextlib.contextmanager
def serving_in_thread(upstream: FakeUpstream | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """Run the fake upstream on its own event loop in a daemon thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["server"], box["url"] = await start_server(host, 0, upstream)
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("fake upstream did not start")
    try:
        yield box["url"]
    finally:

        async def stop() -> None:
            box["server"].close()
            await box["server"].wait_closed()
            loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), loop)
        thread.join(5)
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated model names to list")
    parser.add_argument(
        "--token-interval-ms", type=float, default=0.0, help="pause between streamed events (0: send at once)"
    )
    args = parser.parse_args()
    upstream = FakeUpstream(models=tuple(args.models.split(",")), token_interval_s=args.token_interval_ms / 1000)

    async def serve() -> None:
        server, url = await start_server(args.host, args.port, upstream)
        print(f"fake upstream on {url}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        import uvloop

        uvloop.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
