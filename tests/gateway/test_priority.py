"""Priority classes through the gateway: a feature's policy, or `x-sluice-priority` for keys that may choose,
sets the request's class; the tier receives it and the accounting row records it."""

from __future__ import annotations

import pytest
from litestar.testing import AsyncTestClient

from engines.api.errors import APIError
from engines.api.rules import decoding
from engines.serving import sampling_params
from gateway.app import create_app
from tests.gateway.conftest import chat, make_settings, start


async def test_requests_are_interactive_by_default_and_the_tier_gets_no_priority_field(make_gateway, tiers, records):
    gateway = make_gateway()
    await gateway.chat(await start(gateway), chat(model="sluice-small"))
    assert tiers["small"].requests[0].priority is None  # upstreams that know no priority see nothing new
    assert records[0].priority == "interactive"


async def test_a_feature_policy_makes_its_requests_batch(make_gateway, tiers, records):
    gateway = make_gateway(priority="batch")
    await gateway.chat(await start(gateway), chat(model="sluice-small", priority="interactive"))
    assert tiers["small"].requests[0].priority == "batch"  # the body's own field does not decide
    assert records[0].priority == "batch"


@pytest.mark.parametrize(("asked", "choose", "expected"), [("batch", True, "batch"), ("interactive", True, None)])
async def test_a_key_that_may_choose_picks_its_class_by_header(make_gateway, tiers, records, asked, choose, expected):
    gateway = make_gateway(choose_priority=choose)
    state = await start(gateway)
    state.asked_priority = asked
    await gateway.chat(state, chat(model="sluice-small"))
    assert tiers["small"].requests[0].priority == expected
    assert records[0].priority == asked


@pytest.mark.parametrize(("asked", "choose", "status", "code"), [
    ("batch", False, 403, "priority_not_allowed"),
    ("urgent", True, 400, "invalid_value"),
])  # fmt: skip
async def test_a_header_the_key_may_not_send_is_refused(make_gateway, tiers, records, asked, choose, status, code):
    gateway = make_gateway(choose_priority=choose)
    state = await start(gateway)
    state.asked_priority = asked
    with pytest.raises(APIError) as caught:
        await gateway.chat(state, chat(model="sluice-small"))
    assert (caught.value.status_code, caught.value.code) == (status, code)
    assert tiers["small"].requests == [] and [r.status for r in records] == [status]


async def test_the_header_reaches_the_pipeline_over_http(tiers, sqlite_url):
    app = create_app(make_settings(database_url=sqlite_url, choose_priority=True), tiers, record_sink=[].append)
    body = {"model": "sluice-small", "messages": [{"role": "user", "content": "hi"}]}
    async with AsyncTestClient(app) as client:
        response = await client.post("/v1/chat/completions", json=body, headers={"x-sluice-priority": "batch"})
    assert response.status_code == 200 and tiers["small"].requests[0].priority == "batch"


def test_our_engines_schedule_by_the_requests_priority():
    assert sampling_params(decoding(chat(priority="batch")), 16, 0).priority == "batch"
    assert sampling_params(decoding(chat()), 16, 0).priority == "interactive"
