"""Security (issue #14, item 9): budgets are per key and never shared across tenants, every admin
route needs the admin credential, and neither secrets nor prompt text reach the logs."""

from __future__ import annotations

import logging

import pytest

from gateway.keys import create_key
from tests.gateway.conftest import ADMIN_KEY, make_settings
from tests.gateway.scripted_tier import ScriptedTier
from tests.gateway.test_http_api import CHAT, assert_openai_error, serve

PRICE = {"price_input_per_mtok": 0.0, "price_output_per_mtok": 1_000_000.0}  # $1 per completion token
PROMPT_TEXT = "my-confidential-prompt-7f3a"


@pytest.fixture
def tiers() -> dict[str, ScriptedTier]:
    return {"small": ScriptedTier("small"), "large": ScriptedTier("large")}


@pytest.fixture
async def two_tenants(postgres_url):
    from gateway.db.database import make_database

    db = make_database(postgres_url)
    try:
        a = await create_key(db, tenant="tenant-a", feature="f", policy={"spend_per_day_usd": 2.0})
        b = await create_key(db, tenant="tenant-b", feature="f", policy={"spend_per_day_usd": 2.0})
    finally:
        await db.dispose()
    return a, b


async def test_one_tenant_spending_its_budget_leaves_another_untouched(tiers, postgres_url, two_tenants):
    a, b = two_tenants
    settings = make_settings(database_url=postgres_url, allow_anonymous=False, tier_prices=PRICE, max_output_tokens=2)
    body = {**CHAT, "max_tokens": 2}  # reserves $2, produces $2
    async with serve(settings, tiers, []) as client:
        as_a = {"authorization": f"Bearer {a.secret}"}
        assert (await client.post("/v1/chat/completions", json=body, headers=as_a)).status_code == 200
        await client.app.state.gateway.drain()
        refused = await client.post("/v1/chat/completions", json=body, headers=as_a)
        assert_openai_error(refused, 429, "budget_exceeded")
        as_b = {"authorization": f"Bearer {b.secret}"}
        assert (await client.post("/v1/chat/completions", json=body, headers=as_b)).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/admin/keys/"), ("POST", "/admin/keys/"), ("DELETE", "/admin/keys/some-id")],
)
async def test_every_admin_route_needs_the_admin_credential(tiers, postgres_url, two_tenants, method, path):
    a, _ = two_tenants
    async with serve(make_settings(database_url=postgres_url), tiers, []) as client:
        for headers in ({}, {"authorization": f"Bearer {a.secret}"}, {"authorization": f"Bearer {ADMIN_KEY}x"}):
            response = await client.request(method, path, headers=headers, json={"tenant": "t", "feature": "f"})
            assert_openai_error(response, 401, "invalid_api_key")
        listed = await client.get("/admin/keys/", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert listed.status_code == 200 and a.secret not in listed.text


async def test_no_secret_or_prompt_text_reaches_the_logs(tiers, postgres_url, two_tenants, caplog):
    a, _ = two_tenants
    tiers["small"].down = tiers["large"].down = True  # failures log the most
    with caplog.at_level(logging.DEBUG):
        async with serve(make_settings(database_url=postgres_url, allow_anonymous=False), tiers, []) as client:
            body = {**CHAT, "messages": [{"role": "user", "content": PROMPT_TEXT}]}
            for key in (a.secret, "sk-sluice-" + "x" * 43, ADMIN_KEY):
                await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
            await client.get("/admin/keys/", headers={"authorization": "Bearer wrong-admin"})
    logged = "\n".join(record.getMessage() + str(record.exc_info or "") for record in caplog.records)
    for secret in (a.secret, ADMIN_KEY, PROMPT_TEXT):
        assert secret not in logged


async def test_a_tenant_budget_holds_across_its_keys_even_a_recreated_one(tiers, postgres_url):
    import msgspec

    from gateway.config import TenantConfig
    from gateway.db.database import make_database
    from gateway.keys import revoke_key

    db = make_database(postgres_url)
    try:
        first = await create_key(db, tenant="tenant-t", feature="f")
        second = await create_key(db, tenant="tenant-t", feature="f")
        settings = make_settings(
            database_url=postgres_url, allow_anonymous=False, tier_prices=PRICE, max_output_tokens=2
        )
        settings = msgspec.structs.replace(settings, tenants={"tenant-t": TenantConfig(spend_per_day_usd=2.0)})
        body = {**CHAT, "max_tokens": 2}  # reserves $2, produces $2
        async with serve(settings, tiers, []) as client:
            def auth(key):
                return {"authorization": f"Bearer {key.secret}"}

            assert (await client.post("/v1/chat/completions", json=body, headers=auth(first))).status_code == 200
            await client.app.state.gateway.drain()
            assert_openai_error(await client.post("/v1/chat/completions", json=body, headers=auth(second)), 429)
            await revoke_key(db, first.key.id)
            recreated = await create_key(db, tenant="tenant-t", feature="f")
            response = await client.post("/v1/chat/completions", json=body, headers=auth(recreated))
            assert_openai_error(response, 429, "budget_exceeded")  # no fresh budget for a new key
    finally:
        await db.dispose()
