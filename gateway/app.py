"""The Litestar application: wiring only. The request path lives in `gateway.pipeline`."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, Router
from litestar.di import Provide
from litestar.exceptions import HTTPException, SerializationException, ValidationException
from litestar.openapi import OpenAPIConfig
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.client import EngineClient
from engines.api.errors import APIError, validation_error
from gateway.assembly import build_client
from gateway.batches.execute import line_runner
from gateway.batches.files import FileStore
from gateway.batches.service import BatchService
from gateway.batches.worker import BatchWorker
from gateway.cache.hook import build_cache, cache_models
from gateway.config import Settings
from gateway.controllers import dashboard
from gateway.controllers.admin import AdminCacheController, AdminKeysController, bearer_key, provide_db
from gateway.controllers.batches import BatchController, FilesController, provide_batches
from gateway.controllers.http import provide_gateway
from gateway.controllers.openai import OpenAIController
from gateway.controllers.ops import OpsController
from gateway.counters import (
    CircuitBreakerCounterStore,
    CounterStore,
    InProcessCounterStore,
    LocalFallbackCounterStore,
    RedisCounterStore,
)
from gateway.db.database import make_database
from gateway.keys import DEFAULT_KEY_CACHE_TTL_S, KeyCache
from gateway.metrics import Metrics
from gateway.pipeline import Gateway, RecordSink, RequestState, request_ids
from gateway.routing import build_router
from gateway.shadow import ShadowSampler

log = logging.getLogger("sluice.gateway")


def _as_gateway_error(exc: Exception, request_id: str) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationException):
        # Litestar reports body decoding problems here: malformed JSON, wrong types, missing fields.
        for item in exc.extra if isinstance(exc.extra, list) else []:
            if isinstance(item, dict) and item.get("message"):
                error = validation_error(str(item["message"]))
                if error.param is None and item.get("key") not in (None, "data"):
                    error.param = str(item["key"])
                return error
        return APIError(400, exc.detail or "Invalid request body.", code="invalid_request")
    if isinstance(exc, HTTPException):
        # Litestar turns a body msgspec cannot parse ("Input data was truncated", "JSON is malformed: ...")
        # into a 400 whose cause is its SerializationException.
        if exc.status_code == 400 and isinstance(exc.__cause__, SerializationException):
            return APIError(400, f"The request body is not valid JSON: {exc.detail}", code="invalid_json")
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        if exc.status_code < 500:
            return APIError(exc.status_code, exc.detail, code=code, headers=exc.headers)
    # Ours to fix, not the client's: its text (paths, addresses, internals) goes to the log under
    # the request id, and the client gets only that id to quote.
    log.error("unhandled error in request %s", request_id, exc_info=exc)
    return APIError(
        500, f"The gateway failed to handle the request (request id {request_id}).", code="internal_error"
    )


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Every failure as an OpenAI error body, recorded once when the request had started a record."""
    state: RequestState | None = request.state.get("sluice")
    request_id = state.request_id if state is not None else request_ids(request.headers.get("x-request-id"))[0]
    error = _as_gateway_error(exc, request_id)
    headers = dict(error.headers)
    if state is not None:
        headers["x-request-id"] = state.reply_request_id
        gateway: Gateway | None = request.app.state.get("gateway")
        if gateway is not None:
            gateway.finish(state, error.status_code, error.code)
    return Response(error.body(), status_code=error.status_code, media_type="application/json", headers=headers)


async def start_batches(settings: Settings, gateway: Gateway, db: AsyncEngine, stack: AsyncExitStack) -> BatchService:
    """The Batch API and its worker, stopped (its batch handed back) before the gateway drains."""
    files = FileStore(Path(settings.batch.dir))
    worker = BatchWorker(db, files, line_runner(gateway, db), settings.batch, may_claim=gateway.slo.batch_may_run)
    worker.start()
    stack.push_async_callback(worker.close)
    return BatchService(db, files, worker)


def create_app(
    settings: Settings,
    tiers: Mapping[str, EngineClient] | None = None,
    *,
    record_sink: RecordSink | None = None,
    redis_prefix: str = "sluice",
    key_cache_ttl_s: float = DEFAULT_KEY_CACHE_TTL_S,
) -> Litestar:
    """The gateway. `tiers` None: clients are built from `settings.tiers` (and closed) by the app.
    `record_sink` None: records go to an `AccountingWriter` on `settings.database.url`."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if not settings.server.admin_key:
            log.warning("admin API disabled: server.admin_key is empty (keys can be managed with `sluice keys`)")
        async with AsyncExitStack() as stack:
            db = make_database(settings.database.url, pool_size=settings.database.pool_size)
            stack.push_async_callback(db.dispose)
            sink = record_sink
            if sink is None:
                from gateway.accounting import AccountingWriter

                writer = AccountingWriter(
                    db,
                    Path(settings.server.spool_dir),
                    batch_size=settings.database.flush_batch_size,
                    flush_interval_s=settings.database.flush_interval_ms / 1000,
                )
                await writer.start()
                stack.push_async_callback(writer.close)
                sink = writer.submit
            counters: CounterStore
            if settings.redis.url:
                redis = Redis.from_url(settings.redis.url)
                stack.push_async_callback(redis.aclose)
                shared = RedisCounterStore(redis, redis_prefix)
                stack.push_async_callback(shared.aclose)
                refuse = settings.redis.when_unavailable == "refuse"
                counters = CircuitBreakerCounterStore(shared) if refuse else LocalFallbackCounterStore(shared)
            else:
                counters = InProcessCounterStore()
            clients = tiers
            if clients is None:
                built: dict[str, EngineClient] = {}
                for name, tier in settings.tiers.items():
                    built[name] = await asyncio.to_thread(build_client, name, tier, settings)
                    stack.push_async_callback(built[name].close)
                clients = built
            key_cache = KeyCache(db, ttl_s=key_cache_ttl_s)
            stack.push_async_callback(key_cache.aclose)
            router = await asyncio.to_thread(build_router, settings)
            metrics = Metrics()
            shadow = ShadowSampler(settings, clients, db, metrics, router.embedder)
            stack.push_async_callback(shadow.close)
            models = cache_models(settings, router.embedder)
            cache = build_cache(settings, models, redis_prefix)
            stack.push_async_callback(cache.aclose)
            charge_spool = Path(settings.server.spool_dir) / "charges"  # settlements Redis could not take
            gateway = Gateway(
                settings, clients, counters, sink, metrics, keys=key_cache, router=router, shadow=shadow,
                cache=cache, embedder=models.embedder, charge_spool=charge_spool,
            )
            gateway.charges.start()
            stack.push_async_callback(gateway.drain)
            metrics.watch_tiers(clients, gateway.slo.pressure)
            metrics.watch_cache(cache)
            app.state.batches = await start_batches(settings, gateway, db, stack)
            app.state.gateway = gateway
            app.state.db = db
            # Everything built so far lives as long as the app: out of the collector's sight, so
            # that full collections (pauses of milliseconds, a p99 figure) scan only request garbage.
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                gc.unfreeze()

    return Litestar(
        route_handlers=[OpenAIController, BatchController, AdminKeysController, AdminCacheController, OpsController,
                        Router("/", route_handlers=[FilesController],
                               request_max_body_size=settings.batch.max_file_bytes),
                        *dashboard.route_handlers],
        dependencies={
            "gateway": Provide(provide_gateway, sync_to_thread=False),
            "db": Provide(provide_db, sync_to_thread=False),
            "batches": Provide(provide_batches, sync_to_thread=False),
            **dashboard.dependencies,
        },
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        openapi_config=OpenAPIConfig(
            title="Sluice",
            version="0.1.0",
            openapi_router=Router("/openapi", route_handlers=[], guards=[bearer_key("openapi_key")]),
        ),
        logging_config=None,
        request_max_body_size=settings.server.max_body_bytes,
    )
