"""`/admin/keys`: create (the secret is returned once), list, revoke virtual keys."""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Any

import msgspec
from litestar import Controller, delete, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery, JSONBody
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.errors import APIError, invalid
from gateway.keys import ApiKey, InvalidPolicy, create_key, list_keys, revoke_key
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
