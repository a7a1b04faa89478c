"""Seeded traffic for the dashboard tests: real keys, request rows written by the accounting writer's own
`write_batch` (so the hourly rollup is the writer's), shadow comparisons and evaluation runs."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting import RequestRecord, write_batch
from gateway.config import Settings
from gateway.cost import request_cost
from gateway.db.schema import eval_runs, shadow_runs
from gateway.keys import ApiKey, create_key

FEATURES = {"search": 0.08, "support-chat": 0.35, "code-review": 0.55, "summarize": 0.15}  # escalation odds
TENANTS = ("acme", "globex")
AGREEMENT = {"search": 0.95, "support-chat": 0.82, "code-review": 0.64, "summarize": 0.9}
LATENCY = {"small": (5.0, 2.8), "large": (6.2, 3.6)}  # log-normal means of TTFT and ITL (ms)


@dataclass
class Seeded:
    start: datetime
    end: datetime
    records: list[RequestRecord]
    shadows: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    keys: list[ApiKey] = field(default_factory=list)


def _record(
    rng: random.Random, settings: Settings, at: datetime, tenant: str, feature: str, key: ApiKey
) -> RequestRecord:
    base: dict[str, Any] = {
        "request_id": uuid.uuid4().hex,
        "created_at": at,
        "tenant": tenant,
        "feature": feature,
        "key_id": key.id,
        "prompt_tokens": rng.randrange(20, 1500),
        "completion_tokens": rng.randrange(5, 400),
    }
    roll = rng.random()
    if roll < 0.04:
        status, code = rng.choice([(429, "rate_limit_exceeded"), (429, "budget_exceeded"), (400, "prompt_too_long")])
        return RequestRecord(**base | {"prompt_tokens": 0, "completion_tokens": 0}, status=status, error_code=code)
    if roll < 0.16:
        semantic = rng.random() < 0.4
        saved = request_cost(settings.tiers["small"], base["prompt_tokens"], base["completion_tokens"], 0)
        return RequestRecord(**base, cache_status="semantic" if semantic else "exact", cost_saved_usd=saved)
    escalated = rng.random() < FEATURES[feature]
    tier = "large" if escalated else "small"
    cached = rng.randrange(0, base["prompt_tokens"] // 2 + 1)
    ttft_mu, itl_mu = LATENCY[tier]
    status, code = (502, "upstream_error") if rng.random() < 0.01 else (200, None)
    return RequestRecord(
        **base,
        route="small",
        tier=tier,
        escalated=escalated,
        cached_tokens=cached,
        cost_usd=request_cost(settings.tiers[tier], base["prompt_tokens"], base["completion_tokens"], cached),
        ttft_ms=rng.lognormvariate(ttft_mu, 0.5),
        itl_ms_mean=rng.lognormvariate(itl_mu, 0.4),
        status=status,
        error_code=code,
    )


async def seed(engine: AsyncEngine, settings: Settings, *, end: datetime, days: int = 30, count: int = 3000) -> Seeded:
    rng = random.Random(11)
    start = end - timedelta(days=days)
    keys = []
    for tenant in TENANTS:
        for feature in FEATURES:
            policy = {"spend_per_day_usd": round(rng.uniform(0.002, 0.05), 4)} if rng.random() < 0.6 else {}
            created = await create_key(
                engine, tenant=tenant, feature=feature, name=f"{tenant} {feature}", policy=policy
            )
            keys.append(created.key)
    records = []
    for _ in range(count):
        key = rng.choice(keys)
        at = start + timedelta(seconds=rng.uniform(0, (end - start).total_seconds()))
        records.append(_record(rng, settings, at, key.tenant, key.feature, key))
    for batch in range(0, len(records), 500):
        await write_batch(engine, records[batch : batch + 500])
    shadows = []
    for record in rng.sample([r for r in records if r.tier == "small"], 300):
        shadows.append(
            {
                "id": str(uuid.uuid4()),
                "created_at": record.created_at,
                "request_id": record.request_id,
                "tenant": record.tenant,
                "feature": record.feature,
                "prompt": f"prompt of {record.request_id}",
                "small_answer": "small answer",
                "large_answer": "large answer",
                "agreement": float(rng.random() < AGREEMENT[record.feature]),
                "agreement_method": "final_answer",
                "large_cost_usd": 0.0004,
            }
        )
    evals = [
        {
            "id": str(uuid.uuid4()),
            "created_at": end - timedelta(days=ago, hours=3),
            "router_version": f"r{n}",
            "dataset": "gsm8k-test",
            "rows": 500,
            "metrics": {"apgr": 0.61 + n / 100, "escalation_rate": 0.3, "cpt50": 0.22},
        }
        for n, ago in enumerate((12, 2))
    ]
    async with engine.begin() as connection:
        await connection.execute(shadow_runs.insert(), shadows)
        await connection.execute(eval_runs.insert(), evals)
    return Seeded(start=start, end=end, records=records, shadows=shadows, evals=evals, keys=keys)
