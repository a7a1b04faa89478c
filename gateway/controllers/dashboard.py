"""`/admin`: the dashboard page, its JSON API (`/admin/api/...`), key management forms, sign-in.

Controllers stay thin: numbers come from `gateway.admin.queries`, the page from `gateway.admin.page`,
sessions and CSRF tokens from `gateway.admin.auth`. Every route here except the sign-in form sits
behind `admin_session`: the admin key as a Bearer token, or a signed session cookie (then writes need
the CSRF token and a same-origin request).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie, State
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.errors import APIError
from gateway.admin import auth, page, queries
from gateway.admin.queries import Scope
from gateway.config import Settings
from gateway.keys import InvalidPolicy, create_key, revoke_key, update_key_policy

STATIC_DIR = Path(__file__).resolve().parent.parent / "admin" / "static"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
FAILED_LOGIN_DELAY_S = 0.5  # slows guessing the admin key through the form
PAGE_HEADERS = {
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
}
DONE = {"revoked": "Key revoked.", "limits": "Limits saved."}


class LoginRequired(Exception):
    """No admin credentials: pages redirect to the sign-in form, the API answers 401."""


def _settings(connection: ASGIConnection[Any, Any, Any, Any]) -> Settings:
    return connection.app.state.gateway.settings


async def admin_session(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    admin_key = _settings(connection).server.admin_key
    if not admin_key:
        raise APIError(403, "The admin dashboard is disabled (server.admin_key is not set).", code="admin_disabled")
    if auth.bearer_matches(admin_key, connection.headers.get("authorization")):
        return  # API clients: no cookie, so no cross-site request can carry this
    session = connection.cookies.get(auth.SESSION_COOKIE)
    if not auth.session_valid(admin_key, session):
        raise LoginRequired
    assert session is not None
    if connection.scope["method"] in SAFE_METHODS:
        return
    submitted = connection.headers.get(auth.CSRF_HEADER)
    if submitted is None and isinstance(connection, Request):
        submitted = (await connection.form()).get(auth.CSRF_FIELD)
    if not auth.same_origin(connection.headers) or not auth.csrf_valid(admin_key, session, submitted):
        raise APIError(403, "Cross-site or stale form: reload the page and try again.", code="csrf_failed")


def login_required(request: Request[Any, Any, Any], _: LoginRequired) -> Response[Any]:
    if request.url.path.startswith("/admin/api/") or request.method not in SAFE_METHODS:
        error = APIError(
            401, "Sign in at /admin/login or send `Authorization: Bearer <admin key>`.", code="invalid_api_key"
        )
        return Response(error.body(), status_code=401, media_type=MediaType.JSON)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return Redirect(f"/admin/login?next={quote(target, safe='')}", status_code=303)


def provide_scope(
    range: FromQuery[str | None] = None,
    start: FromQuery[datetime | None] = None,
    end: FromQuery[datetime | None] = None,
    feature: FromQuery[str | None] = None,
    tenant: FromQuery[str | None] = None,
) -> Scope:
    return page.scope_from(range, start, end, feature, tenant)


def provide_settings(state: State) -> Settings:
    return state.gateway.settings


def _html(html: str, status: int = 200) -> Response[str]:
    return Response(html, status_code=status, media_type=MediaType.HTML, headers=PAGE_HEADERS)


def _safe_next(path: str | None) -> str:
    """Only a path of this dashboard (no open redirect to another site)."""
    return path if path and path.startswith("/admin") and not path.startswith("//") else "/admin"


class LoginController(Controller):
    path = "/admin"
    include_in_schema = False

    @get("/login")
    async def form(self, settings: NamedDependency[Settings], next: FromQuery[str | None] = None) -> Response[str]:
        disabled = not settings.server.admin_key
        return _html(page.render_login(next_path=_safe_next(next), disabled=disabled), 403 if disabled else 200)

    @post("/login")
    async def login(self, request: Request[Any, Any, Any], settings: NamedDependency[Settings]) -> Response[Any]:
        admin_key = settings.server.admin_key
        if not admin_key:
            return _html(page.render_login(disabled=True), 403)
        form = await request.form()
        target = _safe_next(form.get("next"))
        if not auth.same_origin(request.headers):
            return _html(page.render_login(message="Sign in from this server's own page.", next_path=target), 403)
        if not auth.admin_key_matches(admin_key, str(form.get("admin_key") or "")):
            await asyncio.sleep(FAILED_LOGIN_DELAY_S)
            return _html(page.render_login(message="That is not the admin key.", next_path=target), 401)
        cookie = Cookie(
            key=auth.SESSION_COOKIE,
            value=auth.new_session(admin_key),
            path="/admin",
            max_age=auth.SESSION_TTL_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return Redirect(target, status_code=303, cookies=[cookie])


class DashboardController(Controller):
    path = "/admin"
    guards = [admin_session]  # noqa: RUF012 - Litestar's declaration style
    exception_handlers = {LoginRequired: login_required}  # noqa: RUF012
    dependencies = {"span": Provide(provide_scope, sync_to_thread=False)}  # noqa: RUF012

    @get("/", include_in_schema=False)
    async def dashboard(
        self,
        request: Request[Any, Any, Any],
        span: NamedDependency[Scope],
        db: NamedDependency[AsyncEngine],
        settings: NamedDependency[Settings],
        done: FromQuery[str | None] = None,
    ) -> Response[str]:
        return await _render(request, span, db, settings, notice=DONE.get(done or "", ""))

    @post("/logout", include_in_schema=False)
    async def logout(self) -> Response[Any]:
        expired = Cookie(key=auth.SESSION_COOKIE, path="/admin", max_age=0)
        return Redirect("/admin/login", status_code=303, cookies=[expired])

    @get("/api/escalation", summary="Escalation rate per feature over time")
    async def escalation(
        self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine]
    ) -> queries.EscalationPanel:
        return await queries.escalation(db, span)

    @get("/api/cost", summary="Cost per feature over time, per tier, and against the large tier")
    async def cost(
        self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine], settings: NamedDependency[Settings]
    ) -> queries.CostPanel:
        return await queries.cost(db, span, settings)

    @get("/api/cache", summary="Exact and semantic cache hit rates and cost saved")
    async def cache(self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine]) -> queries.CachePanel:
        return await queries.cache(db, span)

    @get("/api/latency", summary="TTFT and inter-token latency p50/p99 per tier against the SLOs")
    async def latency(
        self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine], settings: NamedDependency[Settings]
    ) -> queries.LatencyPanel:
        return await queries.latency(db, span, settings)

    @get("/api/quality", summary="Quality delta from shadow runs, and evaluation runs")
    async def quality(
        self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine], settings: NamedDependency[Settings]
    ) -> queries.QualityPanel:
        return await queries.quality(db, span, settings)

    @get("/api/keys", summary="Top keys by spend with budget status")
    async def keys(
        self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine], settings: NamedDependency[Settings]
    ) -> queries.KeysPanel:
        return await queries.top_keys(db, span, settings)

    @get("/api/errors", summary="Errors by code")
    async def errors(self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine]) -> queries.ErrorsPanel:
        return await queries.errors(db, span)

    @get("/api/filters", summary="Features and tenants with traffic in the range")
    async def filters(self, span: NamedDependency[Scope], db: NamedDependency[AsyncEngine]) -> queries.Choices:
        return await queries.choices(db, span)

    @post("/forms/keys", include_in_schema=False)
    async def create_key(
        self,
        request: Request[Any, Any, Any],
        span: NamedDependency[Scope],
        db: NamedDependency[AsyncEngine],
        settings: NamedDependency[Settings],
    ) -> Response[str]:
        form = await request.form()
        try:
            limits = {name: value for name, value in _limits(form).items() if value is not None}
            created = await create_key(
                db,
                tenant=str(form.get("tenant") or ""),
                feature=str(form.get("feature") or ""),
                name=str(form.get("name") or ""),
                policy=limits,
            )
        except ValueError as exc:  # InvalidPolicy is one
            return await _render(request, span, db, settings, notice=f"Not created: {exc}", status=400)
        notice = f"Key {created.key.prefix}… created for {created.key.tenant} / {created.key.feature}."
        return await _render(request, span, db, settings, notice=notice, secret=created.secret, status=201)

    @post("/forms/keys/{key_id:str}/revoke", include_in_schema=False)
    async def revoke_key(
        self, key_id: FromPath[str], db: NamedDependency[AsyncEngine], request: Request[Any, Any, Any]
    ) -> Response[Any]:
        if not await revoke_key(db, key_id):
            raise APIError(404, f"No active key with id {key_id}.", code="key_not_found", param="key_id")
        _forget(request, key_id)
        return Redirect("/admin/?done=revoked#keys", status_code=303)

    @post("/forms/keys/{key_id:str}/limits", include_in_schema=False)
    async def key_limits(
        self,
        key_id: FromPath[str],
        request: Request[Any, Any, Any],
        span: NamedDependency[Scope],
        db: NamedDependency[AsyncEngine],
        settings: NamedDependency[Settings],
    ) -> Response[Any]:
        try:
            updated = await update_key_policy(db, key_id, _limits(await request.form()))
        except (InvalidPolicy, ValueError) as exc:
            return await _render(request, span, db, settings, notice=f"Limits not saved: {exc}", status=400)
        if updated is None:
            raise APIError(404, f"No active key with id {key_id}.", code="key_not_found", param="key_id")
        _forget(request, key_id)
        return Redirect("/admin/?done=limits#keys", status_code=303)


def _limits(form: Any) -> dict[str, float | int | None]:
    """The limit fields of a key form: empty means "as the feature's policy" (None)."""
    limits: dict[str, float | int | None] = {}
    for name in page.LIMIT_FIELDS:
        raw = str(form.get(name) or "").strip()
        try:
            limits[name] = None if not raw else int(raw) if name in ("rpm", "tpm") else float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a number, not {raw!r}") from None
        if limits[name] is not None and limits[name] < 0:  # type: ignore[operator]
            raise ValueError(f"{name} must not be negative")
    return limits


def _forget(request: Request[Any, Any, Any], key_id: str) -> None:
    """This replica applies the change at once (others within the key cache's TTL)."""
    keys = request.app.state.gateway.keys
    if keys is not None:
        keys.forget(key_id)


async def _render(
    request: Request[Any, Any, Any],
    span: NamedDependency[Scope],
    db: AsyncEngine,
    settings: Settings,
    *,
    notice: str = "",
    secret: str = "",
    status: int = 200,
) -> Response[str]:
    admin_key = settings.server.admin_key
    session = request.cookies.get(auth.SESSION_COOKIE) or ""
    data, choices, keys = await asyncio.gather(
        page.panels(db, span, settings), queries.choices(db, span), page.keys_for(db, span)
    )
    html = page.render_dashboard(
        scope=span,
        range_name=request.query_params.get("range"),
        data=data,
        choices=choices,
        keys=keys,
        csrf=auth.csrf_token(admin_key, session) if session else "",
        notice=notice,
        secret=secret,
    )
    return _html(html, status)


static_files = create_static_files_router(
    path="/admin/static",
    directories=[STATIC_DIR],
    name="admin-static",
    guards=[admin_session],
    exception_handlers={LoginRequired: login_required},
)

# What gateway/app.py mounts; `settings` is also what the dashboard's handlers ask for.
route_handlers = [LoginController, DashboardController, static_files]
dependencies = {"settings": Provide(provide_settings, sync_to_thread=False)}
