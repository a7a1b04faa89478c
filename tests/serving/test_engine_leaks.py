"""Nothing internal leaks from an engine server or an HTTP tier client (issue #14, item 7)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from engines.api.client import HttpEngineClient
from engines.api.errors import APIError
from engines.api.protocol import ChatCompletionRequest, ChatMessage
from engines.server import create_engine_app
from gateway.cli import build_parser

SECRET = "/srv/models/secret-path.gguf at 10.0.0.7:5432"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class BrokenServing:
    model_name = "m"

    async def chat(self, _: Any) -> Any:
        raise RuntimeError(SECRET)

    async def chat_stream(self, _: Any) -> AsyncGenerator[Any, None]:
        from engines.api.protocol import ChatChunkChoice, ChatCompletionChunk, DeltaMessage

        yield ChatCompletionChunk(
            id="c", created=0, model="m", choices=[ChatChunkChoice(index=0, delta=DeltaMessage(content="a"))]
        )
        raise RuntimeError(SECRET)


async def test_an_engine_failure_answers_an_error_id_not_its_text() -> None:
    app = create_engine_app(BrokenServing(), None, api_key="k")  # type: ignore[arg-type]
    async with AsyncTestClient(app) as client:
        auth = {"authorization": "Bearer k"}
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 401
        failed = await client.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert failed.status_code == 500 and SECRET not in failed.text and "RuntimeError" not in failed.text
        assert failed.json()["error"]["message"].startswith("The engine failed (err-")
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth)
        # In-band if the stream had started, else a plain 500: either way an id, never the text.
        assert "failed (err-" in streamed.text and SECRET not in streamed.text


@pytest.mark.parametrize("body", [b"<html>nginx: " + SECRET.encode() + b"</html>", b"Traceback ... " + SECRET.encode()])
async def test_a_non_json_upstream_error_body_is_not_echoed(body: bytes) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    client = HttpEngineClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "m")
    try:
        with pytest.raises(APIError) as caught:
            await client.chat(ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="hi")]))
    finally:
        await client.close()
        server.close()
    assert SECRET not in caught.value.message and caught.value.status_code == 400


def _no_sluice_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sluice engine` reads SLUICE_* configuration; the test run's own SLUICE_TEST_* is not any."""
    for name in [n for n in os.environ if n.startswith("SLUICE_") or n == "ENGINE_API_KEY"]:
        monkeypatch.delenv(name)


def test_sluice_engine_takes_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_sluice_environment(monkeypatch)
    args = build_parser().parse_args(["engine", "--tier", "small", "--api-key", "engine-secret"])
    assert args.api_key == "engine-secret"
    served: dict[str, Any] = {}
    monkeypatch.setattr("engines.server.run_engine_server", lambda spec, **kwargs: served.update(kwargs))
    assert args.handler(args) == 0
    assert served["api_key"] == "engine-secret"


def test_sluice_engine_requires_the_key_the_gateway_sends_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_sluice_environment(monkeypatch)
    monkeypatch.setenv("SLUICE_TIERS__SMALL__API_KEY", "tier-secret")
    served: dict[str, Any] = {}
    monkeypatch.setattr("engines.server.run_engine_server", lambda spec, **kwargs: served.update(kwargs))
    args = build_parser().parse_args(["engine", "--tier", "small"])
    assert args.handler(args) == 0
    assert served["api_key"] == "tier-secret"
