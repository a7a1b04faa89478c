"""The HTTP surface through ASGI: OpenAI-style errors, headers, keys, admin API, shared limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from litestar.testing import AsyncTestClient

from gateway.app import create_app
from gateway.db.database import make_database
from gateway.db.schema import requests as requests_table
from tests.gateway.conftest import ADMIN_KEY, EXPENSIVE, make_settings
from tests.gateway.scripted_tier import ScriptedTier

CHAT = {"model": "sluice", "messages": [{"role": "user", "content": "hello there"}]}


@asynccontextmanager
async def serve(settings, tiers, records=None, **options: Any) -> AsyncIterator[AsyncTestClient]:
    app = create_app(settings, tiers, record_sink=records.append if records is not None else None, **options)
    async with AsyncTestClient(app) as client:
        yield client


@pytest.fixture
def gateway_client(tiers, records, sqlite_url) -> Callable[..., Any]:
    def open_client(**policy: Any) -> Any:
        return serve(make_settings(database_url=sqlite_url, **policy), tiers, records)

    return open_client


def assert_openai_error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b'{"model": "sluice", "messages": [', 400, "invalid_json", None),
        (b"[]", 400, "invalid_type", None),
        (b'{"messages": []}', 400, "missing_required_parameter", "model"),
        (b'{"model": 5, "messages": []}', 400, "invalid_type", "model"),
        (
            b'{"model": "sluice", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}',
            400,
            None,
            "max_tokens",
        ),
        (b'{"model": "sluice", "messages": []}', 400, "empty_array", "messages"),
        (b'{"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found", "model"),
        (b'{"model": "sluice", "n": 1000, "messages": [{"role": "user", "content": "hi"}]}', 400, None, "n"),
        (
            b'{"model": "sluice", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}',
            400,
            None,
            "max_tokens",
        ),
        (
            b'{"model": "sluice", "stream_options": {"include_usage": true}, '
            b'"messages": [{"role": "user", "content": "hi"}]}',
            400,
            None,
            "stream_options",
        ),
    ],
)
async def test_malformed_chat_requests_get_openai_style_4xx(gateway_client, records, body, status, code, param):
    async with gateway_client() as client:
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, status, code, param)
    assert [r.status for r in records] == [status]  # errors are accounted too


async def test_malformed_completion_requests_get_openai_style_4xx(gateway_client):
    async with gateway_client() as client:
        response = await client.post("/v1/completions", json={"model": "sluice", "prompt": {"a": 1}})
        assert_openai_error(response, 400, param="prompt")
        response = await client.post("/v1/completions", json={"model": "sluice"})
        assert_openai_error(response, 400, "missing_required_parameter", "prompt")


async def test_unknown_routes_and_methods_get_openai_style_errors(gateway_client):
    async with gateway_client() as client:
        assert_openai_error(await client.get("/v1/nothing"), 404)
        assert_openai_error(await client.put("/v1/chat/completions"), 405)


async def test_a_chat_completion_carries_the_sluice_headers_and_honours_the_request_id(gateway_client, records):
    async with gateway_client() as client:
        body = {**CHAT, "unknown_vendor_field": {"x": 1}, "user": "u-1", "seed": 3, "stop": ["\n"]}
        response = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "trace-42"})
    assert response.status_code == 200
    headers = response.headers
    assert (headers["x-request-id"], headers["x-sluice-tier"]) == ("trace-42", "small")
    assert (headers["x-sluice-cache"], headers["x-sluice-escalated"]) == ("miss", "false")
    assert float(headers["x-sluice-cost-usd"]) == pytest.approx(records[0].cost_usd) and records[0].cost_usd > 0
    assert response.json()["choices"][0]["message"]["content"].startswith("one two")
    assert records[0].request_id.startswith("trace-42.")  # unique, found by the client's id


async def test_a_stream_is_server_sent_events_ending_with_done(gateway_client):
    async with gateway_client() as client:
        response = await client.post(
            "/v1/completions", json={"model": "sluice-large", "prompt": "a b", "stream": True, "max_tokens": 3}
        )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2]) and len(events) == 5
    assert response.headers["x-sluice-tier"] == "large" and "x-sluice-cost-usd" not in response.headers


async def test_a_repeated_client_request_id_still_gives_each_request_its_own_record(gateway_client, records):
    async with gateway_client() as client:
        for _ in range(2):
            response = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "retry-7"})
            assert response.headers["x-request-id"] == "retry-7"
    assert len({r.request_id for r in records}) == 2


async def test_models_lists_the_tiers_the_router_and_the_embedding_model(gateway_client):
    async with gateway_client() as client:
        response = await client.get("/v1/models")
    assert [m["id"] for m in response.json()["data"]] == ["sluice-small", "sluice-large", "sluice", "auto",
                                                          "sluice-embed"]


async def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404(gateway_client, records):
    async with gateway_client() as client:
        found = await client.get("/v1/models/sluice-large")
        bare = await client.get("/v1/models/large")  # what a chat request may name as well
        missing = await client.get("/v1/models/gpt-4o")
    assert found.status_code == 200 and found.json() == {"id": "sluice-large", "created": 0, "object": "model",
                                                         "owned_by": "sluice"}
    assert bare.status_code == 200 and bare.json()["id"] == "large"
    assert_openai_error(missing, 404, "model_not_found", "model")
    assert records == []  # listing models is not a served request


async def test_healthz_reports_each_tier_and_metrics_count_requests(gateway_client, tiers):
    async with gateway_client() as client:
        await client.post("/v1/chat/completions", json=CHAT)
        tiers["large"].down = True
        health = await client.get("/healthz")
        metrics = await client.get("/metrics")
    assert health.json() == {"status": "degraded", "tiers": {"small": True, "large": False}}
    assert 'sluice_requests_total{status="200",tier="small"} 1.0' in metrics.text
    assert "sluice_ttft_seconds" in metrics.text and "sluice_in_flight_requests" in metrics.text


async def test_every_limit_is_a_429_with_retry_after_over_http(gateway_client):
    async with gateway_client(rpm=1) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        refused = await client.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert 1 <= int(refused.headers["retry-after"]) <= 60


async def test_virtual_keys_through_the_admin_api(postgres_url, tiers, records):
    settings = make_settings(database_url=postgres_url, allow_anonymous=False, max_output_tokens=4)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    async with serve(settings, tiers, records, key_cache_ttl_s=60.0) as client:
        assert_openai_error(await client.post("/admin/keys", json={"tenant": "t", "feature": "f"}), 401)
        bad = await client.post(
            "/admin/keys", json={"tenant": "t", "feature": "f", "policy": {"rpm": "x"}}, headers=admin
        )
        assert_openai_error(bad, 400, param="policy")
        created = await client.post(
            "/admin/keys", json={"tenant": "t", "feature": "f", "policy": {"max_output_tokens": 2}}, headers=admin
        )
        assert created.status_code == 201
        secret, key_id = created.json()["secret"], created.json()["id"]
        user = {"authorization": f"Bearer {secret}"}

        assert_openai_error(await client.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
        wrong = {"authorization": "Bearer sk-sluice-wrong"}
        assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=wrong), 401, "invalid_api_key")
        served = await client.post("/v1/chat/completions", json=CHAT, headers=user)
        assert served.status_code == 200
        assert served.json()["usage"]["completion_tokens"] == 2  # the key's override, not the feature's 4

        listed = (await client.get("/admin/keys", params={"tenant": "t"}, headers=admin)).json()["data"]
        assert [k["id"] for k in listed] == [key_id] and "secret" not in listed[0]
        assert (await client.delete(f"/admin/keys/{key_id}", headers=admin)).json() == {"id": key_id, "revoked": True}
        assert_openai_error(await client.delete(f"/admin/keys/{key_id}", headers=admin), 404, "key_not_found")
        # Revoked through this replica: refused at once, despite the 60 s cache.
        assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=user), 401, "invalid_api_key")
    assert [(r.tenant, r.key_id, r.status) for r in records if r.status == 200] == [("t", key_id, 200)]


async def test_two_gateways_share_limits_and_budgets_through_redis(sqlite_url, redis_url, redis_prefix):
    settings = make_settings(database_url=sqlite_url, redis_url=redis_url, tier_prices=EXPENSIVE, rpm=3)
    budget = make_settings(database_url=sqlite_url, redis_url=redis_url, tier_prices=EXPENSIVE, spend_per_day_usd=5.0)
    first_tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    second_tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    async with (
        serve(settings, first_tiers, [], redis_prefix=redis_prefix + "rpm") as a,
        serve(settings, second_tiers, [], redis_prefix=redis_prefix + "rpm") as b,
    ):
        statuses = [(await c.post("/v1/chat/completions", json=CHAT)).status_code for c in (a, b, a, b)]
    assert statuses == [200, 200, 200, 429]

    async with (
        serve(budget, first_tiers, [], redis_prefix=redis_prefix + "usd") as a,
        serve(budget, second_tiers, [], redis_prefix=redis_prefix + "usd") as b,
    ):
        assert (await a.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6})).status_code == 200  # $6
        await asyncio.to_thread(a.blocking_portal.call, a.app.state.gateway.drain)  # the charge lands
        assert_openai_error(await b.post("/v1/chat/completions", json=CHAT), 429, "budget_exceeded")


async def test_requests_reach_the_accounting_table(postgres_url, tiers):
    settings = make_settings(database_url=postgres_url)
    async with serve(settings, tiers) as client:
        await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": f"acct-{id(tiers)}"})
        await client.post("/v1/chat/completions", content=b"{", headers={"x-request-id": f"acct-bad-{id(tiers)}"})
    engine = make_database(postgres_url)
    try:
        async with engine.connect() as connection:
            rows = (
                await connection.execute(
                    sa.select(requests_table.c.request_id, requests_table.c.status, requests_table.c.tier)
                    .where(requests_table.c.request_id.like(f"acct-%{id(tiers)}.%"))
                    .order_by(requests_table.c.status)
                )
            ).all()
    finally:
        await engine.dispose()
    assert [(r.status, r.tier) for r in rows] == [(200, "small"), (400, None)]


async def test_the_openapi_schema_describes_the_request_bodies(gateway_client):
    async with gateway_client() as client:
        schema = (await client.get("/openapi/openapi.json")).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]


async def test_fields_openai_does_not_define_travel_with_the_request_to_the_tier(gateway_client, tiers):
    from engines.api.fields import extra_fields

    async with gateway_client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "best_of_n_tokens": 3,
                                                                   "metadata": {"a": "b"}})
    assert response.status_code == 200, response.text
    (request,) = tiers["small"].requests
    assert extra_fields(request) == {"best_of_n_tokens": 3}
    assert request.metadata == {"a": "b"}


async def test_a_refused_field_is_a_400_naming_it(gateway_client, tiers):
    async with gateway_client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "functions": [{"name": "f"}]})
    assert_openai_error(response, 400, "unsupported_parameter", "functions")
    assert not any(tier.requests for tier in tiers.values())
