"""The dashboard page: the panels for a scope, the headline answer, and the HTML around them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.errors import invalid
from gateway.admin import queries
from gateway.admin.queries import HOURLY_BUCKETS_UP_TO, RANGES, Scope
from gateway.config import Settings
from gateway.keys import ApiKey, list_keys

DEFAULT_RANGE = "7d"
MAX_SPAN = timedelta(days=366)
KEYS_LISTED = 200
LIMIT_FIELDS = ("rpm", "tpm", "spend_per_day_usd", "spend_per_month_usd")

_templates = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _usd(value: float | None) -> str:
    if value is None:
        return "–"
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.4f}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms"


_templates.filters.update(pct=_pct, usd=_usd, ms=_ms)


def scope_from(
    range_name: str | None, start: datetime | None, end: datetime | None, feature: str | None, tenant: str | None
) -> Scope:
    """The scope a request asks for: a named range up to now, or explicit `start`/`end` (UTC when naive)."""
    filters = {"feature": feature or None, "tenant": tenant or None}
    if start is None and end is None:
        name = range_name or DEFAULT_RANGE
        if name not in RANGES:
            raise invalid(f"range must be one of {', '.join(RANGES)}", "range")
        return Scope.last(RANGES[name], **filters)
    if start is None or end is None:
        raise invalid("give both start and end, or neither (then range applies)", "start")
    start, end = (t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC) for t in (start, end))
    if not start < end <= start + MAX_SPAN:
        raise invalid(f"start must be before end, at most {MAX_SPAN.days} days apart", "end")
    if end - start > HOURLY_BUCKETS_UP_TO:  # drawn by day: whole UTC days
        start = start.replace(hour=0, minute=0, second=0, microsecond=0)
        midnight = end.replace(hour=0, minute=0, second=0, microsecond=0)
        end = midnight if midnight == end else midnight + timedelta(days=1)
    return Scope(start=start, end=end, **filters)


class Panels(msgspec.Struct, kw_only=True):
    escalation: queries.EscalationPanel
    cost: queries.CostPanel
    cache: queries.CachePanel
    latency: queries.LatencyPanel
    quality: queries.QualityPanel
    keys: queries.KeysPanel
    errors: queries.ErrorsPanel


async def panels(engine: AsyncEngine, scope: Scope, settings: Settings) -> Panels:
    escalation, cost, cache, latency, quality, keys, errors = await asyncio.gather(
        queries.escalation(engine, scope),
        queries.cost(engine, scope, settings),
        queries.cache(engine, scope),
        queries.latency(engine, scope, settings),
        queries.quality(engine, scope, settings),
        queries.top_keys(engine, scope, settings),
        queries.errors(engine, scope),
    )
    return Panels(
        escalation=escalation, cost=cost, cache=cache, latency=latency, quality=quality, keys=keys, errors=errors
    )


def feature_rows(data: Panels) -> list[dict[str, Any]]:
    """The headline table: per feature, how often it escalates, what it costs, and the small tier's
    quality delta where shadow runs measured one."""
    quality = {row.feature: row for row in data.quality.features}
    return [
        {"escalation": row, "quality": quality.get(row.feature)}
        for row in data.escalation.features
    ]


def _chart_data(data: Panels) -> str:
    """What the charts draw, as JSON safe inside a <script> element."""
    charts = {
        "escalation": {"x": data.escalation.axis.buckets, "series": data.escalation.series},
        "cost": {"x": data.cost.axis.buckets, "series": data.cost.series},
        "cache": {
            "x": data.cache.axis.buckets,
            "series": [
                {"name": "exact", "values": data.cache.exact_hit_rate},
                {"name": "semantic", "values": data.cache.semantic_hit_rate},
            ],
        },
        "ttft": {
            "x": data.latency.axis.buckets,
            "series": data.latency.ttft_p99_ms,
            "slo": {t.tier: t.slo_ttft_p99_ms for t in data.latency.tiers},
        },
        "itl": {
            "x": data.latency.axis.buckets,
            "series": data.latency.itl_p99_ms,
            "slo": {t.tier: t.slo_itl_p99_ms for t in data.latency.tiers},
        },
    }
    return msgspec.json.encode(charts).decode().replace("</", "<\\/")


def render_dashboard(
    *,
    scope: Scope,
    range_name: str | None,
    data: Panels,
    choices: queries.Choices,
    keys: list[ApiKey],
    csrf: str,
    notice: str = "",
    secret: str = "",
) -> str:
    return _templates.get_template("dashboard.html").render(
        scope=scope,
        range_name=range_name if range_name in RANGES else ("" if range_name else DEFAULT_RANGE),
        ranges=list(RANGES),
        data=data,
        features=feature_rows(data),
        choices=choices,
        keys=keys[:KEYS_LISTED],
        keys_total=len(keys),
        limit_fields=LIMIT_FIELDS,
        chart_data=_chart_data(data),
        csrf=csrf,
        notice=notice,
        secret=secret,
    )


def render_login(*, message: str = "", next_path: str = "/admin", disabled: bool = False) -> str:
    return _templates.get_template("login.html").render(message=message, next_path=next_path, disabled=disabled)


async def keys_for(engine: AsyncEngine, scope: Scope) -> list[ApiKey]:
    """Active keys for the key table, narrowed by the page's tenant and feature filters."""
    keys = await list_keys(engine, tenant=scope.tenant, include_revoked=False)
    return [key for key in keys if scope.feature in (None, key.feature)]
