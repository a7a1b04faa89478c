"""The official `openai` SDK against the gateway served by uvicorn on a loopback port."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from gateway.accounting import RequestRecord
from gateway.app import create_app
from tests.gateway.conftest import EXPENSIVE, loopback_socket, make_settings, served_on
from tests.gateway.scripted_tier import ScriptedTier

MESSAGES = [{"role": "user", "content": "say something"}]
WAIT_S = 10.0  # upper bound for the server thread to act; never reached when things work


@dataclass
class LiveGateway:
    base_url: str
    tiers: dict[str, ScriptedTier]
    records: list[RequestRecord] = field(default_factory=list)
    recorded: threading.Event = field(default_factory=threading.Event)

    def sink(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.recorded.set()


@pytest.fixture
def live(sqlite_url: str) -> Iterator[LiveGateway]:
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    sock = loopback_socket()
    live = LiveGateway(f"http://127.0.0.1:{sock.getsockname()[1]}", tiers)
    settings = make_settings(database_url=sqlite_url, tier_prices=EXPENSIVE, rpm=50)
    app = create_app(settings, tiers, record_sink=live.sink)
    with served_on(app, sock, WAIT_S):
        yield live


def client(live: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="local-dev", max_retries=0)


def test_the_sync_sdk_gets_a_chat_completion_and_the_sluice_headers(live: LiveGateway):
    raw = client(live).chat.completions.with_raw_response.create(model="sluice", messages=MESSAGES, max_tokens=3)
    completion = raw.parse()
    assert completion.choices[0].message.content == "one two three"
    assert completion.usage.completion_tokens == 3
    assert raw.headers["x-sluice-tier"] == "small" and float(raw.headers["x-sluice-cost-usd"]) == pytest.approx(3.0)


async def test_the_async_sdk_gets_a_text_completion(live: LiveGateway):
    async with openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0) as sdk:
        completion = await sdk.completions.create(model="sluice-large", prompt="a b c", max_tokens=2)
    assert completion.choices[0].text == "one two"
    assert completion.usage.prompt_tokens == 3


def test_the_sdk_streams_and_gets_usage_when_it_asks(live: LiveGateway):
    stream = client(live).chat.completions.create(
        model="sluice", messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three four"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_sdk_errors_map_to_its_exception_types(live: LiveGateway):
    sdk = client(live)
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="sluice", messages=MESSAGES, n=999)
    assert bad.value.param == "n"


def test_a_client_disconnecting_mid_stream_cancels_upstream_and_is_charged_for_what_was_produced(live: LiveGateway):
    live.tiers["small"].hold_after = 3
    body = {"model": "sluice", "messages": MESSAGES, "stream": True}
    with (
        httpx.Client(base_url=live.base_url, timeout=WAIT_S) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        received: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                received.append(line)
            if len(received) == 3:
                break
    # The response is closed: the server sees the disconnect while the tier is still generating.
    assert live.recorded.wait(WAIT_S), "the stream was never finished after the disconnect"
    record = live.records[0]
    assert live.tiers["small"].streams_closed_early == 1
    assert (record.stream, record.completion_tokens, record.cost_usd) == (True, 3, pytest.approx(3.0))


def test_a_client_leaving_before_a_plain_answer_cancels_the_upstream_call(live: LiveGateway):
    live.tiers["small"].hold_after = 0
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=0.5).chat.completions.create(
            model="sluice", messages=MESSAGES
        )
    assert live.recorded.wait(WAIT_S), "the abandoned request was never finished"
    assert live.tiers["small"].calls_cancelled == 1
    assert (live.records[0].status, live.records[0].error_code) == (499, "client_disconnected")


def test_the_sdk_creates_a_response_through_the_chat_pipeline(live: LiveGateway):
    raw = client(live).responses.with_raw_response.create(model="sluice", input="say something",
                                                          instructions="be brief", max_output_tokens=3)
    response = raw.parse()
    assert response.output_text == "one two three"
    # The scripted tier stops at the limit: the answer was cut, as OpenAI reports it.
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and raw.headers["x-sluice-tier"] == "small"
    assert live.recorded.wait(WAIT_S)
    (record,) = live.records
    assert (record.endpoint, record.completion_tokens, record.status) == ("chat", 3, 200)


def test_the_sdk_stream_helper_reads_a_streamed_response(live: LiveGateway):
    with client(live).responses.stream(model="sluice", input="say something", max_output_tokens=4) as stream:
        events = list(stream)  # the helper checks every event against the response it builds
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "one two three four"
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == "one two three four"
    assert live.recorded.wait(WAIT_S) and live.records[0].stream


def test_a_response_that_needs_stored_state_or_an_unknown_model_is_an_sdk_error(live: LiveGateway):
    sdk = client(live)
    with pytest.raises(openai.BadRequestError) as stored:
        sdk.responses.create(model="sluice", input="hi", previous_response_id="resp_123")
    assert stored.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as bad_limit:  # refused by the chat rules, named as sent
        sdk.responses.create(model="sluice", input="hi", max_output_tokens=0)
    assert bad_limit.value.param == "max_output_tokens" and "`max_output_tokens`" in bad_limit.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.create(model="no-such-model", input="hi")
    assert missing.value.code == "model_not_found"


def test_stored_responses_are_a_404_that_says_none_are_stored(live: LiveGateway):
    sdk = client(live)
    for call in (lambda: sdk.responses.retrieve("resp_1"), lambda: sdk.responses.delete("resp_1"),
                 lambda: sdk.responses.cancel("resp_1"), lambda: list(sdk.responses.input_items.list("resp_1"))):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.param == "response_id" and "stores no responses" in missing.value.message
    assert live.records == []
