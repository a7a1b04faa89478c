"""The gateway's two ways to call a tier: `HttpEngineClient` against the engine server, and
`InProcessEngineClient` over the OpenAI layer directly."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from engines.api.client import EngineUnavailable, HttpEngineClient
from engines.api.errors import APIError
from engines.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from engines.metrics import EngineMetrics
from engines.server import create_engine_app
from engines.serving import InProcessEngineClient, OpenAIServing
from tests.serving.conftest import MODEL_NAME, eventually_running, idle_kv_blocks_used, wait_until_idle


def chat(content: str, **fields: object) -> ChatCompletionRequest:
    # The gateway's own model name: clients replace it with the tier's.
    return ChatCompletionRequest(model="sluice-auto", messages=[ChatMessage(role="user", content=content)], **fields)


@pytest.fixture
async def http_client(server_url: str, serving: OpenAIServing) -> AsyncIterator[HttpEngineClient]:
    client = HttpEngineClient(server_url, MODEL_NAME, tokenizer=serving.tokenizer, read_timeout=30.0)  # type: ignore[arg-type]
    yield client
    await client.close()


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_http_chat_returns_the_upstream_completion_under_the_tier_model(http_client: HttpEngineClient) -> None:
    request = chat("Hello", temperature=0, max_tokens=5)
    response = await http_client.chat(request)
    assert response.model == MODEL_NAME
    assert response.usage.prompt_tokens == http_client.count_prompt_tokens(request)
    assert 1 <= response.usage.completion_tokens <= 5
    assert await http_client.ready()


async def test_http_streams_end_with_usage_even_when_the_caller_did_not_ask(http_client: HttpEngineClient) -> None:
    expected = await http_client.chat(chat("Good morning", temperature=0, max_tokens=6))
    chunks = [chunk async for chunk in http_client.chat_stream(chat("Good morning", temperature=0, max_tokens=6))]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens


async def test_http_text_completions_plain_and_streamed(http_client: HttpEngineClient) -> None:
    request = CompletionRequest(model="x", prompt="Once upon a time", max_tokens=4, temperature=0)
    plain = await http_client.complete(request)
    chunks = [chunk async for chunk in http_client.complete_stream(request)]
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == plain.choices[0].text
    assert plain.usage is not None and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.usage.prompt_tokens == http_client.count_prompt_tokens(request)


async def test_an_upstream_4xx_is_re_raised_as_the_same_openai_error(http_client: HttpEngineClient) -> None:
    with pytest.raises(APIError) as plain:
        await http_client.chat(chat("Hi", temperature=9.0))
    assert (plain.value.status_code, plain.value.detail.param) == (400, "temperature")
    with pytest.raises(APIError) as streamed:
        async for _ in http_client.chat_stream(chat("Hi", top_p=2.0)):
            pass
    assert (streamed.value.status_code, streamed.value.detail.param) == (400, "top_p")


async def test_a_wrong_upstream_model_name_is_a_404_model_not_found(server_url: str) -> None:
    client = HttpEngineClient(server_url, "no-such-model")
    try:
        with pytest.raises(APIError) as raised:
            await client.chat(chat("Hi", max_tokens=1))
        assert (raised.value.status_code, raised.value.detail.code) == (404, "model_not_found")
    finally:
        await client.close()


async def test_closing_an_http_stream_early_aborts_the_upstream_request(
    http_client: HttpEngineClient, serving: OpenAIServing
) -> None:
    baseline = await idle_kv_blocks_used(serving.engine)
    before = serving.engine.stats()
    stream = http_client.chat_stream(chat("Tell me everything about robots", temperature=0, max_tokens=300))
    await anext(stream)
    await eventually_running(serving.engine, 1)
    await stream.aclose()
    await wait_until_idle(serving.engine, baseline)
    # Cut short, not run to the end: the engine aborted it well before its 300 tokens.
    for _ in range(500):  # statistics are as of the latest step
        if serving.engine.stats().num_aborted_total - before.num_aborted_total >= 1:
            break
        await asyncio.sleep(0.01)
    after = serving.engine.stats()
    assert after.num_aborted_total - before.num_aborted_total == 1
    assert after.num_generated_tokens_total - before.num_generated_tokens_total < 150


async def test_a_tier_that_is_down_is_unavailable() -> None:
    client = HttpEngineClient(f"http://127.0.0.1:{unused_port()}", MODEL_NAME, connect_timeout=1.0)
    try:
        assert not await client.ready()
        with pytest.raises(EngineUnavailable):
            await client.chat(chat("Hi"))
        with pytest.raises(EngineUnavailable):
            async for _ in client.chat_stream(chat("Hi")):
                pass
    finally:
        await client.close()


async def test_a_tier_that_does_not_answer_in_time_is_unavailable() -> None:
    async def accept_and_stay_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(5)
        writer.close()

    silent = await asyncio.start_server(accept_and_stay_silent, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    client = HttpEngineClient(f"http://127.0.0.1:{port}", MODEL_NAME, read_timeout=0.2)
    try:
        with pytest.raises(EngineUnavailable):
            await client.chat(chat("Hi"))
    finally:
        await client.close()
        silent.close()


@pytest.mark.parametrize("status", [500, 502, 503, 429])
async def test_upstream_5xx_and_429_are_unavailable(status: int) -> None:
    # A stand-in upstream that fails every request the way an overloaded or crashing server does.
    transport = httpx.MockTransport(lambda _: httpx.Response(status, json={"error": {"message": "x", "type": "y"}}))
    client = HttpEngineClient("http://upstream", MODEL_NAME, transport=transport)
    try:
        with pytest.raises(EngineUnavailable):
            await client.chat(chat("Hi"))
        with pytest.raises(EngineUnavailable):
            async for _ in client.chat_stream(chat("Hi")):
                pass
    finally:
        await client.close()


async def test_the_api_key_is_sent_and_required(serving: OpenAIServing, metrics: EngineMetrics) -> None:
    app = create_engine_app(serving, metrics, api_key="s3cret")
    keyed = HttpEngineClient("http://engine", MODEL_NAME, api_key="s3cret", transport=httpx.ASGITransport(app))
    wrong = HttpEngineClient("http://engine", MODEL_NAME, api_key="guess", transport=httpx.ASGITransport(app))
    try:
        assert (await keyed.chat(chat("Hi", max_tokens=2))).usage.completion_tokens >= 1
        with pytest.raises(APIError) as raised:
            await wrong.chat(chat("Hi", max_tokens=2))
        assert (raised.value.status_code, raised.value.detail.code) == (401, "invalid_api_key")
    finally:
        await keyed.close()
        await wrong.close()


def test_without_a_tokenizer_prompt_tokens_are_estimated_from_characters(serving: OpenAIServing) -> None:
    request = chat("The quick brown fox jumps over the lazy dog. " * 8)
    estimate = HttpEngineClient("http://unused", MODEL_NAME).count_prompt_tokens(request)
    exact = serving.count_prompt_tokens(request)
    assert exact / 2 <= estimate <= exact * 2
    assert HttpEngineClient("http://unused", MODEL_NAME).count_prompt_tokens(
        CompletionRequest(model="x", prompt=[[1, 2, 3], [4, 5]])
    ) == 5


async def test_the_in_process_client_serves_through_the_openai_layer(serving: OpenAIServing) -> None:
    client = InProcessEngineClient(serving)
    assert client.model_name == MODEL_NAME and await client.ready()
    request = chat("Hello", temperature=0, max_tokens=4)
    response = await client.chat(request)
    assert response.usage.prompt_tokens == client.count_prompt_tokens(request)
    chunks = [chunk async for chunk in client.chat_stream(request)]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    with pytest.raises(APIError):  # requests arrive checked (by the gateway); the model's own rules hold here
        await client.complete(CompletionRequest(model="x", prompt=[1, 2, 10**6]))


@pytest.mark.parametrize(("field", "sent"), [("none", None), ("sluice", "batch"), ("vllm", 1)])
async def test_an_upstream_is_told_the_scheduling_class_only_in_the_form_configured_for_it(
    field: str, sent: object
) -> None:
    bodies: list[dict] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(500, json={"error": {"message": "x", "type": "y"}})

    client = HttpEngineClient("http://upstream", MODEL_NAME, transport=httpx.MockTransport(upstream),
                              priority_field=field)  # type: ignore[arg-type]  # fmt: skip
    request = ChatCompletionRequest(model="sluice", messages=[ChatMessage(role="user", content="hi")], priority="batch")
    with pytest.raises(EngineUnavailable):
        await client.chat(request)
    assert bodies[0].get("priority") == sent and ("priority" in bodies[0]) == (sent is not None)
