"""The router's rows in the database: each trained version (`router_versions`) and each evaluation (`eval_runs`)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from gateway.db import migrate
from gateway.db.database import make_database
from gateway.db.schema import eval_runs, router_versions


async def _insert(url: str, table: Any, row: dict[str, Any]) -> None:
    engine = make_database(url)
    try:
        await migrate.upgrade_async(engine)
        async with engine.begin() as conn:
            await conn.execute(table.insert().values(**row))
    finally:
        await engine.dispose()


async def record_router_version(url: str, meta: dict[str, Any], artifact_path: str) -> None:
    point = next(
        (p for p in meta["operating_points"] if p["quality_target"] >= meta["default_quality_target"] - 1e-9),
        meta["operating_points"][-1],
    )
    await _insert(url, router_versions, {
        "version": meta["version"],
        "created_at": datetime.now(UTC),
        "artifact_path": artifact_path,
        "training_fingerprint": meta["training_data"]["sha256"],
        "operating_point": point,
        "metrics": meta["validation"],
    })


async def record_eval_run(
    url: str, router_version: str | None, dataset: str, metrics: dict[str, Any], plot_path: str | None
) -> str:
    run_id = str(uuid.uuid4())
    await _insert(url, eval_runs, {
        "id": run_id,
        "created_at": datetime.now(UTC),
        "router_version": router_version,
        "dataset": dataset,
        "rows": int(metrics["rows"]),
        "metrics": metrics,
        "plot_path": plot_path,
    })
    return run_id
