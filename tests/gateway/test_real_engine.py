"""The gateway over a real in-process engine (tiny random-weight checkpoint), built by the app."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from engines.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.app import create_app
from gateway.config import PolicyConfig, TierConfig, load_settings
from tests.tiny_models import write_tiny_checkpoint

MAX_PROMPT_TOKENS = 40
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AsyncTestClient]:
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("gateway-tiny"), "llama")
    base = load_settings(environ={})
    tier = TierConfig(
        model=str(checkpoint),
        dtype="float32",
        quantization="none",
        kv_cache_mb=4,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        max_model_len=256,
        price_input_per_mtok=1.0,
        price_output_per_mtok=2.0,
    )
    settings = msgspec.structs.replace(
        base,
        server=msgspec.structs.replace(base.server, allow_anonymous=True),
        database=msgspec.structs.replace(base.database, url="sqlite+aiosqlite:///:memory:"),
        tiers={"small": tier},
        policies={"default": PolicyConfig(allowed_tiers=["small"], max_prompt_tokens=MAX_PROMPT_TOKENS)},
    )
    records: list[object] = []
    async with AsyncTestClient(create_app(settings, record_sink=records.append)) as test_client:
        yield test_client


def chat_body(text: str, **fields: object) -> dict[str, object]:
    return {"model": "sluice", "messages": [{"role": "user", "content": text}], "temperature": 0, **fields}


async def test_a_chat_completion_is_served_by_the_engine_and_costed(client: AsyncTestClient):
    response = await client.post("/v1/chat/completions", json=chat_body("hello there", max_tokens=4))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 2
    expected_cost = (usage["prompt_tokens"] * 1.0 + 4 * 2.0) / 1e6
    assert float(response.headers["x-sluice-cost-usd"]) == pytest.approx(expected_cost)


async def test_the_prompt_budget_uses_the_engines_own_count(client: AsyncTestClient):
    gateway = client.app.state.gateway
    request = ChatCompletionRequest(model="sluice", messages=[ChatMessage(role="user", content=LONG_PROMPT)])
    engine_count = gateway.clients["small"].count_prompt_tokens(request)
    assert engine_count > MAX_PROMPT_TOKENS
    response = await client.post("/v1/chat/completions", json=chat_body(LONG_PROMPT))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "prompt_too_long"
    assert f"{engine_count} tokens" in error["message"] and f"limit of {MAX_PROMPT_TOKENS}" in error["message"]


async def test_a_stream_from_the_engine_reaches_the_client_as_sse(client: AsyncTestClient):
    body = chat_body("hello", max_tokens=3, stream=True, stream_options={"include_usage": True})
    response = await client.post("/v1/chat/completions", json=body)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    usage = msgspec.json.decode(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 3


async def test_engine_validation_errors_pass_through_as_openai_errors(client: AsyncTestClient):
    response = await client.post("/v1/chat/completions", json=chat_body("hi", temperature=7))
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
