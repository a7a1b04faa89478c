"""Issue #14's hardening of the HTTP surface: what an attacker or a careless deployment meets."""

from __future__ import annotations

import logging

import msgspec

from tests.gateway.conftest import make_settings
from tests.gateway.test_http_api import assert_openai_error, serve


async def test_an_empty_admin_key_disables_the_admin_api_and_says_so_at_start(tiers, sqlite_url, caplog):
    settings = make_settings(database_url=sqlite_url)
    settings = msgspec.structs.replace(settings, server=msgspec.structs.replace(settings.server, admin_key=""))
    with caplog.at_level(logging.WARNING, logger="sluice.gateway"):
        async with serve(settings, tiers, []) as client:
            assert any("admin API disabled" in r.getMessage() for r in caplog.records)
            response = await client.get("/admin/keys/", headers={"Authorization": "Bearer "})
            assert_openai_error(response, 403, "admin_disabled")
