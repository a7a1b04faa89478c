"""Nothing internal leaks from an engine server or an HTTP tier client (issue #14, item 7)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from engines.api.client import _raise_for_status
from engines.api.errors import APIError
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
def test_a_non_json_upstream_error_body_is_not_echoed(body: bytes) -> None:
    with pytest.raises(APIError) as caught:
        _raise_for_status(400, body, "http://engine-small:8100")
    assert SECRET not in caught.value.message and caught.value.status_code == 400


def test_sluice_engine_takes_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["engine", "--tier", "small", "--api-key", "engine-secret"])
    assert args.api_key == "engine-secret"
    served: dict[str, Any] = {}
    monkeypatch.setattr("engines.server.run_engine_server", lambda spec, **kwargs: served.update(kwargs))
    assert args.handler(args) == 0
    assert served["api_key"] == "engine-secret"
