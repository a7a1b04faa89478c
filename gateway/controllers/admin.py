"""`/admin/keys`: create (the secret is returned once), list, revoke virtual keys. `/admin/cache`: purge."""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Any

import msgspec
from litestar import Controller, delete, get, patch, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.types import Guard
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.errors import APIError, invalid, service_unavailable
from gateway.cache.store import CacheUnavailable
from gateway.keys import ApiKey, InvalidPolicy, create_key, list_keys, revoke_key, update_key_policy
from gateway.pipeline import Gateway


class CreateKeyRequest(msgspec.Struct, kw_only=True):
    tenant: str
    feature: str
    name: str = ""
    policy: dict[str, Any] = msgspec.field(default_factory=dict)  # overrides of the feature's policy


class KeyInfo(msgspec.Struct, kw_only=True):
    id: str
    prefix: str
    tenant: str
    feature: str
    name: str
    policy: dict[str, Any]
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, key: ApiKey) -> KeyInfo:
        return cls(**{f: getattr(key, f) for f in cls.__struct_fields__})


class CreatedKeyResponse(KeyInfo, kw_only=True):
    secret: str  # shown this once


class KeyList(msgspec.Struct, kw_only=True):
    data: list[KeyInfo]
    object: str = "list"


class UpdateKeyRequest(msgspec.Struct, kw_only=True):
    policy: dict[str, Any]  # overrides to set; a null removes that override (the feature's policy applies)


class Revoked(msgspec.Struct, kw_only=True):
    id: str
    revoked: bool = True


async def admin_only(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    admin_key = connection.app.state.gateway.settings.server.admin_key
    if not admin_key:
        raise APIError(403, "The admin API is disabled (server.admin_key is not set).", code="admin_disabled")
    scheme, _, secret = (connection.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(secret.strip().encode(), admin_key.encode()):
        raise APIError(401, "The admin API needs `Authorization: Bearer <admin key>`.", code="invalid_api_key")


def bearer_key(setting: str) -> Guard:
    """A guard requiring `Authorization: Bearer <server.<setting>>` (or the admin key) when that
    setting is not empty; an empty one leaves the route open."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        server = connection.app.state.gateway.settings.server
        required = getattr(server, setting)
        if not required:
            return
        scheme, _, secret = (connection.headers.get("authorization") or "").partition(" ")
        given = secret.strip().encode()
        if scheme.lower() != "bearer" or not any(
            key and hmac.compare_digest(given, key.encode()) for key in (required, server.admin_key)
        ):
            message = f"This endpoint needs `Authorization: Bearer <server.{setting}>`."
            raise APIError(401, message, code="invalid_api_key")

    return guard


def provide_db(state: State) -> AsyncEngine:
    return state.db


class AdminKeysController(Controller):
    path = "/admin/keys"
    guards = [admin_only]  # noqa: RUF012 - Litestar's declaration style

    @post("/", status_code=201, summary="Create a virtual key")
    async def create(
        self, data: JSONBody[CreateKeyRequest], gateway: NamedDependency[Gateway], db: NamedDependency[AsyncEngine]
    ) -> CreatedKeyResponse:
        unknown = [t for t in data.policy.get("allowed_tiers") or [] if t not in gateway.settings.tiers]
        if unknown:
            raise invalid(f"policy.allowed_tiers: unknown tier(s) {unknown}", "policy.allowed_tiers")
        try:
            created = await create_key(db, tenant=data.tenant, feature=data.feature, name=data.name, policy=data.policy)
        except (InvalidPolicy, ValueError) as exc:
            raise invalid(str(exc), "policy" if isinstance(exc, InvalidPolicy) else None) from exc
        return CreatedKeyResponse(**msgspec.structs.asdict(KeyInfo.of(created.key)), secret=created.secret)

    @get("/", summary="List virtual keys")
    async def list(
        self,
        db: NamedDependency[AsyncEngine],
        tenant: FromQuery[str | None] = None,
        include_revoked: FromQuery[bool] = True,
    ) -> KeyList:
        try:
            keys = await list_keys(db, tenant=tenant, include_revoked=include_revoked)
        except ValueError as exc:
            raise invalid(str(exc), "tenant") from exc
        return KeyList(data=[KeyInfo.of(key) for key in keys])

    @delete("/{key_id:str}", status_code=200, summary="Revoke a virtual key")
    async def revoke(
        self, key_id: FromPath[str], gateway: NamedDependency[Gateway], db: NamedDependency[AsyncEngine]
    ) -> Revoked:
        if not await revoke_key(db, key_id):
            raise APIError(404, f"No active key with id {key_id}.", code="key_not_found", param="key_id")
        if gateway.keys is not None:
            gateway.keys.forget(key_id)
        return Revoked(id=key_id)

    @patch("/{key_id:str}", summary="Change a virtual key's policy overrides (limits, budgets)")
    async def update(
        self,
        key_id: FromPath[str],
        data: JSONBody[UpdateKeyRequest],
        gateway: NamedDependency[Gateway],
        db: NamedDependency[AsyncEngine],
    ) -> KeyInfo:
        unknown = [t for t in data.policy.get("allowed_tiers") or [] if t not in gateway.settings.tiers]
        if unknown:
            raise invalid(f"policy.allowed_tiers: unknown tier(s) {unknown}", "policy.allowed_tiers")
        try:
            updated = await update_key_policy(db, key_id, data.policy)
        except InvalidPolicy as exc:
            raise invalid(str(exc), "policy") from exc
        if updated is None:
            raise APIError(404, f"No active key with id {key_id}.", code="key_not_found", param="key_id")
        if gateway.keys is not None:
            gateway.keys.forget(key_id)
        return KeyInfo.of(updated)


class CachePurged(msgspec.Struct, kw_only=True):
    tenant: str
    feature: str | None
    purged_entries: int


class AdminCacheController(Controller):
    path = "/admin/cache"
    guards = [admin_only]  # noqa: RUF012 - Litestar's declaration style

    @delete("/{tenant:str}", status_code=200, summary="Purge a tenant's cached answers (or one feature's)")
    async def purge(
        self, tenant: FromPath[str], gateway: NamedDependency[Gateway], feature: FromQuery[str | None] = None
    ) -> CachePurged:
        if gateway.cache is None:
            raise APIError(404, "The response cache is not enabled.", code="cache_disabled")
        try:
            purged = await gateway.cache.purge(tenant, feature)
        except CacheUnavailable as exc:
            raise service_unavailable("The response cache cannot be reached right now.", "cache_unavailable") from exc
        return CachePurged(tenant=tenant, feature=feature, purged_entries=purged)
