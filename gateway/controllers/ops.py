"""Health and metrics, for load balancers and Prometheus."""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.controllers.admin import bearer_key
from gateway.metrics import CONTENT_TYPE
from gateway.pipeline import Gateway

READY_TIMEOUT_S = 1.0


class Health(msgspec.Struct, kw_only=True):
    status: str  # ok | degraded | down
    tiers: dict[str, bool]


async def _ready(client: object) -> bool:
    try:
        return bool(await asyncio.wait_for(client.ready(), READY_TIMEOUT_S))  # type: ignore[attr-defined]
    except Exception:
        return False


class OpsController(Controller):
    @get("/healthz", summary="Liveness and tier readiness")
    async def healthz(self, gateway: NamedDependency[Gateway]) -> Response[Health]:
        names = list(gateway.clients)
        ready = await asyncio.gather(*(_ready(gateway.clients[n]) for n in names))
        tiers = dict(zip(names, ready, strict=True))
        status = "ok" if all(ready) else "degraded" if any(ready) else "down"
        return Response(Health(status=status, tiers=tiers), status_code=503 if status == "down" else 200)

    @get("/metrics", summary="Prometheus metrics", guards=[bearer_key("metrics_key")])
    async def metrics(self, gateway: NamedDependency[Gateway]) -> Response[bytes]:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)
