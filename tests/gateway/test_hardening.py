"""Issue #14's hardening of the HTTP surface: what an attacker or a careless deployment meets."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from engines.api.errors import APIError, service_unavailable
from gateway import cli
from gateway.budgets import OFFLOAD_PROMPT_CHARS
from gateway.cli import anonymous_exposure
from gateway.config import load_settings
from gateway.keys import anonymous_policy, new_secret
from tests.gateway.conftest import ADMIN_KEY, make_settings
from tests.gateway.test_http_api import CHAT, assert_openai_error, serve


async def test_an_empty_admin_key_disables_the_admin_api_and_says_so_at_start(tiers, sqlite_url, caplog):
    settings = make_settings(database_url=sqlite_url)
    settings = msgspec.structs.replace(settings, server=msgspec.structs.replace(settings.server, admin_key=""))
    with caplog.at_level(logging.WARNING, logger="sluice.gateway"):
        async with serve(settings, tiers, []) as client:
            assert any("admin API disabled" in r.getMessage() for r in caplog.records)
            response = await client.get("/admin/keys/", headers={"Authorization": "Bearer "})
            assert_openai_error(response, 403, "admin_disabled")


@pytest.mark.parametrize(
    ("host", "forced", "refused"),
    [
        ("127.0.0.1", False, False),
        ("::1", False, False),
        ("localhost", False, False),
        ("0.0.0.0", False, True),
        ("10.1.2.3", False, True),
        ("gateway.internal", False, True),
        ("0.0.0.0", True, False),
    ],
)
def test_serve_refuses_anonymous_access_on_a_public_address_unless_forced(host, forced, refused, tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text(f"[server]\nallow_anonymous = true\nallow_anonymous_on_public_host = {str(forced).lower()}\n")
    settings = load_settings(config, environ={})
    assert (anonymous_exposure(settings, host) is not None) == refused
    if refused:  # the command exits before anything is served or migrated
        assert cli.main(["--config", str(config), "serve", "--host", host, "--port", "1"]) == 2


def test_anonymous_callers_get_default_limits_unless_their_policy_sets_its_own():
    settings = load_settings(environ={})
    policy = anonymous_policy(settings)
    assert (policy.rpm, policy.tpm, policy.spend_per_day_usd) == (60, 100_000, 1.0)
    own = load_settings(environ={"SLUICE_POLICIES__DEFAULT__RPM": "5", "SLUICE_SERVER__ANONYMOUS_TPM": "0"})
    assert (anonymous_policy(own).rpm, anonymous_policy(own).tpm) == (5, None)


async def test_the_anonymous_limit_refuses_over_http(tiers, sqlite_url):
    settings = make_settings(database_url=sqlite_url)
    server = msgspec.structs.replace(settings.server, anonymous_rpm=2)
    async with serve(msgspec.structs.replace(settings, server=server), tiers, []) as client:
        statuses = [(await client.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]


async def test_unauthenticated_requests_are_a_metric_not_accounting_rows(tiers, sqlite_url):
    records: list = []
    settings = make_settings(database_url=sqlite_url, allow_anonymous=False)
    async with serve(settings, tiers, records) as client:
        for headers in ({}, {"authorization": "Bearer sk-sluice-wrong"}, {"authorization": f"Bearer {new_secret()}"}):
            assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=headers), 401)
        metrics = (await client.get("/metrics")).text
    assert records == []
    assert 'sluice_unauthenticated_requests_total{code="invalid_api_key"} 3.0' in metrics


async def test_the_body_size_limit_is_a_config_key(tiers, sqlite_url):
    settings = make_settings(database_url=sqlite_url)
    settings = msgspec.structs.replace(settings, server=msgspec.structs.replace(settings.server, max_body_bytes=2048))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    async with serve(settings, tiers, []) as client:
        assert_openai_error(await client.post("/v1/chat/completions", json=big), 413, "request_too_large")
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert load_settings(environ={"SLUICE_SERVER__MAX_BODY_BYTES": "1024"}).server.max_body_bytes == 1024


async def test_a_large_prompt_is_tokenised_off_the_event_loop(tiers, sqlite_url):
    on_loop: list[tuple[bool, bool]] = []  # (a large prompt, counted on the event loop)
    count = tiers["small"].count_prompt_tokens

    def counting(request):
        large = len(request.messages[0].content) > OFFLOAD_PROMPT_CHARS
        try:
            on_loop.append((large, asyncio.get_running_loop() is not None))
        except RuntimeError:  # a worker thread runs no event loop
            on_loop.append((large, False))
        return count(request)

    tiers["small"].count_prompt_tokens = counting
    small = {**CHAT, "model": "sluice-small", "messages": [{"role": "user", "content": "short prompt"}]}
    large = {**CHAT, "model": "sluice-small", "messages": [{"role": "user", "content": "word " * OFFLOAD_PROMPT_CHARS}]}
    async with serve(make_settings(database_url=sqlite_url, max_prompt_tokens=10**6), tiers, []) as client:
        assert (await client.post("/v1/chat/completions", json=small)).status_code == 200
        assert (await client.post("/v1/chat/completions", json=large)).status_code == 200
    # The gateway's own count (the first of each prompt; the scripted tier counts again to report usage).
    assert next(entry for entry in on_loop if entry[0]) == (True, False)
    assert all(loop for large, loop in on_loop if not large)


SECRET = "/srv/sluice/secret.toml at 10.0.0.7:5432"


@pytest.mark.parametrize(
    "failure",
    [RuntimeError(SECRET), APIError(500, SECRET, type="server_error")],
    ids=["exception", "tier-500"],
)
async def test_internal_failures_answer_a_request_id_never_their_text(tiers, sqlite_url, failure):
    async def broken(request):
        raise failure

    tiers["small"].chat = broken
    async with serve(make_settings(database_url=sqlite_url), tiers, []) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "trace-1"})
    error = assert_openai_error(response, 500)
    assert SECRET not in response.text and "RuntimeError" not in response.text
    assert "(request id trace-1." in error["message"]


async def test_a_stream_failing_midway_reports_an_error_id_never_the_text(tiers, sqlite_url):
    original = tiers["small"].chat_stream

    async def failing(request):
        async for chunk in original(request):
            yield chunk
            raise RuntimeError(SECRET)

    tiers["small"].chat_stream = failing
    async with serve(make_settings(database_url=sqlite_url), tiers, []) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert "The stream failed (err-" in response.text and SECRET not in response.text


@pytest.mark.parametrize(("path", "setting"), [("/metrics", "metrics_key"), ("/openapi/openapi.json", "openapi_key")])
async def test_metrics_and_the_openapi_schema_can_require_a_credential(tiers, sqlite_url, path, setting):
    settings = make_settings(database_url=sqlite_url)
    async with serve(settings, tiers, []) as client:
        assert (await client.get(path)).status_code == 200  # open by default
    locked = msgspec.structs.replace(settings, server=msgspec.structs.replace(settings.server, **{setting: "ops"}))
    async with serve(locked, tiers, []) as client:
        assert_openai_error(await client.get(path), 401, "invalid_api_key")
        assert_openai_error(await client.get(path, headers={"authorization": "Bearer nope"}), 401)
        assert (await client.get(path, headers={"authorization": "Bearer ops"})).status_code == 200
        assert (await client.get(path, headers={"authorization": f"Bearer {ADMIN_KEY}"})).status_code == 200


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "sluice", "prompt": ["a"] * 17, "max_tokens": 1}, "too_many_prompts", "prompt"),
        ({"model": "sluice", "prompt": ["a"] * 4, "max_tokens": 1024, "n": 8}, "output_too_large", "n"),
    ],
)
async def test_one_request_cannot_fan_out_beyond_the_policy(tiers, sqlite_url, body, code, param):
    async with serve(make_settings(database_url=sqlite_url), tiers, []) as client:
        assert_openai_error(await client.post("/v1/completions", json=body), 400, code, param)
        # Within the bounds: 16 prompts × 1 token, and 2 prompts × 8 choices × 1024 tokens.
        fine = {**body, "prompt": ["a"] * (16 if code == "too_many_prompts" else 2)}
        assert (await client.post("/v1/completions", json=fine)).status_code == 200


async def test_a_tier_at_capacity_falls_back_then_answers_503_with_retry_after(tiers, sqlite_url):
    async def overloaded(request):
        raise service_unavailable("The engine is at capacity. Retry shortly.", "engine_overloaded")

    tiers["small"].chat = overloaded
    async with serve(make_settings(database_url=sqlite_url), tiers, []) as client:
        served = await client.post("/v1/chat/completions", json=CHAT)
        assert served.status_code == 200 and served.headers["x-sluice-tier"] == "large"
        tiers["large"].chat = overloaded
        refused = await client.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(refused, 503, "tier_unavailable")
    assert int(refused.headers["retry-after"]) > 0
