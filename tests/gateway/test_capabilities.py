"""Tools and structured outputs as capabilities: a tier that lacks one is skipped for a request that needs
it (or the request is refused), the accounting row says what the request used, and the canonical form a
cache keys on tells such requests apart."""

from __future__ import annotations

import msgspec
import pytest

from engines.api.errors import APIError
from engines.api.fields import canonical_request
from engines.api.protocol import (
    FunctionDefinition,
    JSONSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
    Tool,
)
from tests.gateway.conftest import chat, make_settings, start

TOOL = Tool(type="function", function=FunctionDefinition(name="lookup", parameters={"type": "object"}))
SCHEMA = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="r", schema={"type": "object"}))


def settings_where(tier: str, allowed_tiers: tuple[str, ...] = ("small", "large"), **lacks: bool):
    settings = make_settings(allowed_tiers=list(allowed_tiers))
    tiers = dict(settings.tiers)
    tiers[tier] = msgspec.structs.replace(tiers[tier], **lacks)
    return msgspec.structs.replace(settings, tiers=tiers)


async def test_a_tool_request_skips_a_tier_without_tools(make_gateway, tiers, records):
    gateway = make_gateway(settings_where("small", supports_tools=False))
    reply = await gateway.chat(await start(gateway), chat(model="sluice-small", tools=[TOOL]))
    assert reply.headers["x-sluice-tier"] == "large"
    assert tiers["small"].requests == [] and tiers["large"].requests[0].tools == [TOOL]
    await gateway.drain()
    assert [(r.tier, r.used_tools, r.response_format) for r in records] == [("large", True, None)]


async def test_a_plain_request_still_goes_where_it_was_routed(make_gateway, tiers, records):
    gateway = make_gateway(settings_where("small", supports_tools=False))
    reply = await gateway.chat(await start(gateway), chat(model="sluice-small"))
    assert reply.headers["x-sluice-tier"] == "small"
    await gateway.drain()
    assert [(r.used_tools, r.response_format) for r in records] == [(False, None)]


async def test_a_request_no_allowed_tier_can_serve_is_refused_naming_the_capability(make_gateway, tiers, records):
    gateway = make_gateway(settings_where("large", ("large",), supports_response_format=False))
    with pytest.raises(APIError) as refused:
        await gateway.chat(await start(gateway), chat(model="sluice-large", response_format=SCHEMA))
    assert (refused.value.status_code, refused.value.code, refused.value.param) == (
        400, "unsupported_capability", "response_format")
    assert tiers["large"].requests == []
    await gateway.drain()
    assert [(r.status, r.response_format) for r in records] == [(400, "json_schema")]


async def test_vllms_structured_outputs_need_a_tier_that_constrains_output(make_gateway, tiers, records):
    gateway = make_gateway(settings_where("small", supports_response_format=False))
    choice = StructuredOutputs(choice=["yes", "no"])
    reply = await gateway.chat(await start(gateway), chat(model="sluice-small", structured_outputs=choice))
    assert reply.headers["x-sluice-tier"] == "large" and tiers["small"].requests == []
    alone = make_gateway(settings_where("small", ("small",), supports_response_format=False))
    with pytest.raises(APIError) as refused:
        await alone.chat(await start(alone), chat(model="sluice-small", structured_outputs=choice))
    assert (refused.value.code, refused.value.param) == ("unsupported_capability", "structured_outputs")
    await gateway.drain()
    await alone.drain()
    assert [(r.tier, r.response_format) for r in records] == [("large", "structured"), (None, "structured")]


async def test_fallback_never_lands_on_a_tier_without_the_capability(make_gateway, tiers):
    gateway = make_gateway(settings_where("large", supports_tools=False))
    tiers["small"].down = True
    with pytest.raises(APIError) as refused:
        await gateway.chat(await start(gateway), chat(model="sluice-small", tools=[TOOL]))
    assert refused.value.status_code == 503 and tiers["large"].requests == []


def test_the_canonical_request_separates_tools_and_response_formats_and_ignores_transport() -> None:
    plain = canonical_request(chat("hi"))
    assert canonical_request(chat("hi", stream=True, user="u1")) == plain
    assert canonical_request(chat("hi", tools=[TOOL])) != plain
    assert canonical_request(chat("hi", response_format=SCHEMA)) != plain
    assert canonical_request(chat("hi", response_format=SCHEMA)) != canonical_request(
        chat("hi", response_format=ResponseFormat(type="json_object")))
    assert canonical_request(chat("hi", logit_bias={"5": 1.0})) != plain
