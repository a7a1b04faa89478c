"""The fake upstream speaks enough OpenAI for the official SDK, over keep-alive HTTP/1.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI, BadRequestError

from bench.fake_upstream import ANSWER, ANSWER_PIECES, FakeUpstream, start_server


@pytest.fixture
async def upstream_url() -> AsyncIterator[str]:
    server, url = await start_server(upstream=FakeUpstream(models=("small", "large")))
    async with server:
        yield url


@pytest.fixture
async def client(upstream_url: str) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{upstream_url}/v1", api_key="sk-any", max_retries=0) as sdk:
        yield sdk


async def test_lists_the_models_it_was_started_with(client: AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["small", "large"]


async def test_answers_every_chat_completion_with_the_fixed_text_and_usage(client: AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "three word prompt"}], n=2
    )
    assert [c.message.content for c in completion.choices] == [ANSWER, ANSWER]
    assert completion.model == "small"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, len(ANSWER_PIECES))


async def test_streams_the_fixed_text_with_a_final_usage_chunk_when_asked(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="large",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ANSWER_PIECES)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_streams_without_usage_unless_asked(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert all(chunk.usage is None for chunk in [c async for c in stream])


async def test_paced_streams_deliver_every_event() -> None:
    server, url = await start_server(upstream=FakeUpstream(token_interval_s=0.001))
    async with server, AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-any", max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == ANSWER


async def test_text_completions_are_answered_too(client: AsyncOpenAI) -> None:
    completion = await client.completions.create(model="small", prompt=["a b", "c"])
    assert completion.choices[0].text == ANSWER
    assert completion.usage is not None and completion.usage.prompt_tokens == 3


async def test_rejects_a_malformed_body_with_an_openai_error(client: AsyncOpenAI) -> None:
    with pytest.raises(BadRequestError) as caught:
        await client.chat.completions.create(model="small", messages="not a list")  # type: ignore[arg-type]
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def _exchange(url: str, raw: bytes, responses: int) -> list[bytes]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        heads = []
        for _ in range(responses):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            heads.append(head)
        return heads
    finally:
        writer.close()


async def test_answers_pipelined_requests_on_one_connection_in_order(upstream_url: str) -> None:
    get_models = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    missing = b"GET /nowhere HTTP/1.1\r\nhost: x\r\n\r\n"
    heads = await _exchange(upstream_url, get_models + missing + get_models, responses=3)
    assert [h.split(b" ")[1] for h in heads] == [b"200", b"404", b"200"]


async def test_reads_chunked_request_bodies(upstream_url: str) -> None:
    body = b'{"model":"small","messages":[{"role":"user","content":"hi"}]}'
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    [head] = await _exchange(upstream_url, raw, responses=1)
    assert head.startswith(b"HTTP/1.1 200")
