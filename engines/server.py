"""The HTTP server of one engine: OpenAI chat and text completions, models, health and metrics.

Controllers only parse, delegate to `OpenAIServing` and encode; streams are server-sent events
ending in `data: [DONE]`. A client that goes away mid-stream closes the stream, which aborts its
engine requests and frees their KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import secrets
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import uvicorn
from litestar import Litestar, Request, get, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException
from litestar.response import Response, Stream

from engines.api.errors import APIError
from engines.api.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    encode,
    wants_stream_usage,
)
from engines.api.rules import check_request, decode_request
from engines.api.sse import sse_events
from engines.metrics import EngineMetrics
from engines.serving import OpenAIServing
from engines.tiers import TierSpec

logger = logging.getLogger(__name__)

JSON = "application/json"


def _error_response(status_code: int, detail: ErrorDetail) -> Response[bytes]:
    return Response(encode(ErrorResponse(error=detail)), status_code=status_code, media_type=JSON)


def _api_error_handler(_: Request, exc: APIError) -> Response[bytes]:
    response = _error_response(exc.status_code, exc.detail)
    response.headers.update(exc.headers)  # Retry-After of a 503
    return response


def _http_error_handler(request: Request, exc: HTTPException) -> Response[bytes]:
    if exc.status_code >= 500:
        return _internal_error_handler(request, exc)
    return _error_response(exc.status_code, ErrorDetail(message=exc.detail, type="invalid_request_error"))


def _internal_error(exc: BaseException, what: str) -> ErrorDetail:
    """The error a client sees for a failure of ours: an id to quote, never the exception's text
    (paths, addresses, internals); the log line under that id has the details."""
    error_id = f"err-{secrets.token_hex(8)}"
    logger.error("%s (%s)", what, error_id, exc_info=exc)
    return ErrorDetail(message=f"The engine failed ({error_id}).", type="server_error", code="internal_error")


def _internal_error_handler(_: Request, exc: Exception) -> Response[bytes]:
    return _error_response(500, _internal_error(exc, "unhandled error"))


async def _sse(stream: AsyncGenerator[ChatCompletionChunk | Completion, None], include_usage: bool) -> Stream:
    """Server-sent events of a stream. Its first chunk is awaited before the response starts, so a
    request the engine refuses still gets a plain JSON error with its status code."""
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()
        raise
    body = sse_events(first, stream, include_usage)
    # Litestar stops iterating on disconnect but leaves the generator suspended; closing it right
    # after the response ends is what aborts the engine requests deterministically.
    return Stream(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(body.aclose),
    )


def _check_model(requested: str, serving: OpenAIServing) -> None:
    if requested != serving.model_name:
        raise APIError(
            404,
            f"The model {requested!r} does not exist on this server; it serves {serving.model_name!r}",
            param="model",
            code="model_not_found",
        )


@post("/v1/chat/completions", status_code=200)
async def chat_completions(
    request: Request[Any, Any, Any], serving: NamedDependency[OpenAIServing]
) -> Response[Any]:
    body = decode_request(await request.body(), ChatCompletionRequest)
    _check_model(body.model, serving)
    check_request(body)
    if body.stream:
        return await _sse(serving.chat_stream(body), wants_stream_usage(body.stream_options))
    completion: ChatCompletion = await serving.chat(body)
    return Response(encode(completion), media_type=JSON)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any], serving: NamedDependency[OpenAIServing]) -> Response[Any]:
    body = decode_request(await request.body(), CompletionRequest)
    _check_model(body.model, serving)
    check_request(body)
    if body.stream:
        return await _sse(serving.complete_stream(body), wants_stream_usage(body.stream_options))
    completion: Completion = await serving.complete(body)
    return Response(encode(completion), media_type=JSON)


@get("/v1/models")
async def list_models(serving: NamedDependency[OpenAIServing]) -> ModelList:
    return ModelList(data=[ModelCard(id=serving.model_name)])


@get("/healthz")
async def healthz(serving: NamedDependency[OpenAIServing]) -> Response[bytes]:
    # Unhealthy for a while after a failed step: load balancers and the gateway send work elsewhere.
    if not getattr(serving.engine, "healthy", True):
        return Response(b'{"status":"unhealthy"}', status_code=503, media_type=JSON)
    return Response(b'{"status":"ok"}', media_type=JSON)


@get("/metrics")
async def metrics_endpoint(metrics: NamedDependency[EngineMetrics]) -> Response[bytes]:
    text, content_type = metrics.render()
    return Response(text, media_type=content_type)


def _api_key_guard(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    async def before_request(request: Request[Any, Any, Any]) -> None:
        if request.url.path in ("/healthz", "/metrics"):
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return before_request


def create_engine_app(
    serving: OpenAIServing,
    metrics: EngineMetrics,
    *,
    api_key: str | None = None,
    on_shutdown: Sequence[Any] = (),
) -> Litestar:
    """The Litestar app of one engine. With `api_key`, the OpenAI routes require `Bearer <api_key>`."""
    return Litestar(
        route_handlers=[chat_completions, completions, list_models, healthz, metrics_endpoint],
        dependencies={
            "serving": Provide(lambda: serving, sync_to_thread=False),
            "metrics": Provide(lambda: metrics, sync_to_thread=False),
        },
        exception_handlers={
            APIError: _api_error_handler,
            HTTPException: _http_error_handler,
            Exception: _internal_error_handler,
        },
        before_request=_api_key_guard(api_key) if api_key else None,
        on_shutdown=list(on_shutdown),
        openapi_config=None,
    )


def build_serving(async_engine: Any, spec: TierSpec) -> tuple[OpenAIServing, EngineMetrics]:
    """The OpenAI layer and metrics over a started `AsyncLLMEngine`, for the tier `spec`."""
    metrics = EngineMetrics(spec.served_name, async_engine.stats, async_engine.engine.precision())
    return OpenAIServing(async_engine, spec.served_name, metrics=metrics), metrics


def run_engine_server(
    spec: TierSpec,
    host: str = "127.0.0.1",
    port: int = 8100,
    *,
    api_key: str | None = None,
    cache_dir: str | None = None,
) -> None:
    """Load the tier's model (slow) and serve it until interrupted."""
    from engines.llm_engine import AsyncLLMEngine

    logger.info("loading %s (%s)", spec.name, spec.model)
    async_engine = AsyncLLMEngine.build(spec.engine_config(cache_dir))

    async def serve() -> None:
        serving, metrics = build_serving(async_engine, spec)
        app = create_engine_app(serving, metrics, api_key=api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
        try:
            await server.serve()
        finally:
            await async_engine.shutdown()

    asyncio.run(serve())


def launch(spec: TierSpec, argv: Sequence[str] | None = None) -> None:
    """`python -m engines.small|large`: serve the tier, flags overriding its spec."""
    parser = argparse.ArgumentParser(prog=f"python -m engines.{spec.name}", description=f"Serve the {spec.name} tier.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", help=f"demo model name or model path (default {spec.model})")
    parser.add_argument("--served-model-name", help=f"model name clients send (default {spec.served_name})")
    parser.add_argument("--device", help="cpu (default) or cuda[:N]")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", choices=["none", "auto", "w8a8", "int8", "int4", "fp8"])
    parser.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--w8a8-attention-passes", type=int, choices=[1, 2],
                        help="w8a8: int8 passes over the attention projections' inputs (default 2)")
    parser.add_argument("--kv-cache-mb", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-batch-tokens-beside-interactive", type=int,
                        help="batch-priority tokens a step takes beside interactive decodes")  # fmt: skip
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--batch-invariant", action="store_true", default=None,
                        help="a request's tokens and logprobs the same bits whatever its batch, chunking or cache")
    parser.add_argument("--speculative-draft", help="demo model name or path of a drafter sharing the tokenizer")
    parser.add_argument("--num-speculative-tokens", type=int, help="most drafts per decode step")
    parser.add_argument("--api-key", help="require `Authorization: Bearer <key>` on the OpenAI routes")
    args = parser.parse_args(argv)
    overridden = spec.replace(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        w8a8_attention_passes=args.w8a8_attention_passes,
        kv_cache_mb=args.kv_cache_mb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_batch_tokens_beside_interactive=args.max_batch_tokens_beside_interactive,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        batch_invariant=args.batch_invariant,
        speculative_draft=args.speculative_draft,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    if args.quantization is not None:
        overridden = overridden.replace(quantization=None if args.quantization == "none" else args.quantization)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_engine_server(overridden, args.host, args.port, api_key=args.api_key)
    except FileNotFoundError as exc:
        parser.exit(2, f"error: {exc}\n")
