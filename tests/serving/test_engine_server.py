"""The engine server, spoken to with the official `openai` SDK and with raw HTTP."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import openai
import pytest

from engines.api.protocol import ChatCompletionRequest
from engines.serving import OpenAIServing
from tests.serving.conftest import MODEL_NAME, idle_kv_blocks_used, wait_until_idle


@pytest.fixture
def client(server_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


async def test_the_sync_sdk_lists_the_model_and_chats(server_url: str) -> None:
    def call() -> tuple[list[str], str | None, int]:
        with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as sync_client:
            models = [m.id for m in sync_client.models.list()]
            response = sync_client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0
            )
            assert response.usage is not None
            return models, response.choices[0].message.content, response.usage.completion_tokens

    models, content, completion_tokens = await asyncio.to_thread(call)  # the server runs on this loop
    assert models == [MODEL_NAME]
    assert isinstance(content, str)
    assert 1 <= completion_tokens <= 5


async def test_the_async_sdk_gets_a_chat_completion_with_usage_and_logprobs(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert response.object == "chat.completion"
    assert response.usage is not None and response.usage.prompt_tokens > 0
    assert response.usage.prompt_tokens_details is not None
    assert response.choices[0].logprobs is not None and response.choices[0].logprobs.content is not None
    assert len(response.choices[0].logprobs.content) == response.usage.completion_tokens


async def test_streaming_with_include_usage_ends_with_a_usage_chunk(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count"}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    assert all(chunk.usage is None for chunk in chunks[:-1])


async def test_streaming_without_include_usage_sends_no_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count"}], max_tokens=4, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)


async def test_text_completions_plain_and_streamed(client: openai.AsyncOpenAI) -> None:
    plain = await client.completions.create(model=MODEL_NAME, prompt="The cache", max_tokens=5, temperature=0,
                                            logprobs=1)
    assert plain.object == "text_completion" and plain.usage is not None
    assert plain.choices[0].logprobs is not None
    assert len(plain.choices[0].logprobs.tokens or []) == plain.usage.completion_tokens
    stream = await client.completions.create(
        model=MODEL_NAME, prompt="The cache", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == plain.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


async def test_bad_parameters_are_a_400_the_sdk_understands(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], temperature=3.0
        )
    assert raised.value.status_code == 400
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], stream=True, n=99
        )


async def test_an_unknown_model_is_a_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b'{"model": "tiny-test", "messages": "hi"}', 400),
        ("/v1/chat/completions", b"[]", 400),
        ("/v1/completions", b'{"model": "tiny-test", "prompt": "x", "max_tokens": "many"}', 400),
        ("/v1/completions", b"", 400),
        ("/v1/embeddings", b"{}", 404),
    ],
)
async def test_malformed_requests_get_an_openai_error_body_never_a_500(
    server_url: str, path: str, body: bytes, status: int
) -> None:
    async with httpx.AsyncClient(base_url=server_url) as http:
        response = await http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_health_and_metrics(server_url: str, client: openai.AsyncOpenAI) -> None:
    await client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    async with httpx.AsyncClient(base_url=server_url) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        metrics = (await http.get("/metrics")).text
    for name in (
        "sluice_engine_waiting_sequences",
        "sluice_engine_running_sequences",
        "sluice_engine_waiting_batch_sequences",
        "sluice_engine_running_batch_sequences",
        "sluice_engine_kv_cache_utilisation",
        "sluice_engine_kv_blocks_used",
        "sluice_engine_kv_blocks_free",
        "sluice_engine_prefix_cache_hit_rate",
        "sluice_engine_time_to_first_token_seconds_bucket",
        "sluice_engine_inter_token_latency_seconds_bucket",
        "sluice_engine_generated_tokens_total",
    ):
        assert f'{name}{{' in metrics, name
    ttft_count = next(line for line in metrics.splitlines()
                      if line.startswith("sluice_engine_time_to_first_token_seconds_count"))
    assert float(ttft_count.split()[-1]) >= 1
    info = next(line for line in metrics.splitlines() if line.startswith("sluice_engine_info{"))
    assert 'quantization="none"' in info and 'kv_cache_dtype="float32"' in info and info.endswith(" 1.0")
    assert 'device="cpu"' in info
    assert any(f'decode_attention="{build}"' in info for build in ("avx2", "avx512", "avx512bf16", "amx", "pytorch"))


async def test_a_client_disconnect_aborts_the_sequence_and_frees_its_blocks(
    server_url: str, serving: OpenAIServing
) -> None:
    max_tokens = 480
    request = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me everything about robots"}],
        "max_tokens": max_tokens, "temperature": 0,
    }  # fmt: skip
    # Greedy decoding of this prompt runs to the length limit, so only the disconnect can end it early.
    assert (await serving.chat(msgspec.convert(request, ChatCompletionRequest))).choices[0].finish_reason == "length"
    baseline = await idle_kv_blocks_used(serving.engine)
    generated_before = serving.engine.stats().num_generated_tokens_total

    async with (
        httpx.AsyncClient(base_url=server_url) as http,
        http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                break
    # leaving the block closed the connection mid-stream

    await wait_until_idle(serving.engine, baseline)
    generated = serving.engine.stats().num_generated_tokens_total - generated_before
    assert 0 < generated < max_tokens, "the sequence ran on after the client had gone"

