"""The cascade on the request path: a scripted small tier whose token logprobs are set per test, a
stand-in classifier artifact, and the gateway without HTTP."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np
import pytest

from gateway.config import PolicyConfig, RouterConfig, Settings
from gateway.counters import InProcessCounterStore
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from gateway.routing import Router, prompt_text
from router.artifact import OperatingPoint
from tests.gateway.conftest import EXPENSIVE, chat, make_settings, start

LOW, HIGH = -3.0, -0.05  # per-token logprobs: an unsure small answer, a sure one
TAU = -1.0


class StandInArtifact:
    """What the gateway reads of `router.artifact.RouterArtifact`, with scores fixed per prompt text so
    that each test decides which tier the classifier picks."""

    version = "test-1"

    def __init__(self, scores: dict[str, float], point: OperatingPoint) -> None:
        self.scores = scores
        self.point = point

    def score(self, embeddings: np.ndarray, prompts: list[str]) -> np.ndarray:
        assert embeddings.shape == (len(prompts), 4)
        return np.array([self.scores.get(p, 0.1) for p in prompts])

    def operating_point(self, quality_target: float | None = None) -> OperatingPoint:
        return self.point


class Watcher:
    def __init__(self, artifact: StandInArtifact) -> None:
        self.current = artifact


class CountingEmbedder:
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def embed_async(self, texts: list[str]) -> np.ndarray:
        self.texts.extend(texts)
        return np.ones((len(texts), 4), dtype=np.float32) / 2


def settings_with(small_logprobs: bool = True, **policy: Any) -> Settings:
    settings = make_settings(tier_prices=EXPENSIVE, **policy)
    tiers = dict(settings.tiers)
    tiers["small"] = msgspec.structs.replace(tiers["small"], logprobs=small_logprobs)
    return msgspec.structs.replace(settings, tiers=tiers, router=RouterConfig())


@pytest.fixture
def embedder() -> CountingEmbedder:
    return CountingEmbedder()


@pytest.fixture
def cascade_gateway(tiers, records, embedder):
    tiers["small"].words = ["small-a", "small-b", "small-c", "small-d"]
    tiers["large"].words = ["large-a", "large-b", "large-c"]

    def build(
        logprob: float | None = LOW,
        tau: float | None = TAU,
        threshold: float = 0.5,
        scores: dict[str, float] | None = None,
        settings: Settings | None = None,
        tau_stream: float | str | None = "same",
    ) -> Gateway:
        tiers["small"].logprobs = None if logprob is None else [logprob] * len(tiers["small"].words)
        settings = settings or settings_with()
        stream_tau = tau if tau_stream == "same" else tau_stream
        artifact = StandInArtifact(scores or {}, OperatingPoint(threshold, tau, 0.95, 0.3, 0.1, stream_tau))
        router = Router(settings, embedder, Watcher(artifact))
        return Gateway(settings, tiers, InProcessCounterStore(), records.append, Metrics(), router=router)

    return build


async def collect(stream) -> list[bytes]:
    return [event async for event in stream]


def stream_text(events: list[bytes]) -> str:
    text = ""
    for event in events:
        payload = event.removeprefix(b"data: ").strip()
        if payload == b"[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            text += choice["delta"].get("content") or ""
    return text


# --- non-streamed ---------------------------------------------------------------------------------


async def test_an_unsure_small_answer_is_escalated_and_only_the_large_answer_is_returned(cascade_gateway, tiers):
    gateway = cascade_gateway(logprob=LOW)
    reply = await gateway.chat(await start(gateway), chat("what is two plus two", max_tokens=3))
    body = json.loads(reply.body)
    assert body["choices"][0]["message"]["content"] == "large-a large-b large-c"
    assert body["model"] == "sluice-large"  # the model that answered, by a name the client can send
    assert body["choices"][0]["logprobs"] is None
    assert reply.headers["x-sluice-route"] == "small"
    assert reply.headers["x-sluice-tier"] == "large"
    assert reply.headers["x-sluice-escalated"] == "true"
    assert reply.headers["x-sluice-confidence"] == "-3.0000"
    assert tiers["small"].requests[0].logprobs is True  # the cascade asked
    assert tiers["large"].requests[0].logprobs is False  # the client did not


async def test_an_escalated_request_is_recorded_with_route_score_confidence_and_both_attempts_cost(
    cascade_gateway, records
):
    gateway = cascade_gateway(logprob=LOW, scores={"what is two plus two": 0.2})
    reply = await gateway.chat(await start(gateway), chat("what is two plus two", max_tokens=3))
    (record,) = records
    assert (record.route, record.tier, record.escalated) == ("small", "large", True)
    assert record.route_score == pytest.approx(0.2)
    assert record.confidence == pytest.approx(LOW)
    # $1 per completion token on both tiers (EXPENSIVE): 3 abandoned small tokens + 3 large ones.
    assert record.cost_usd == pytest.approx(6.0)
    assert reply.headers["x-sluice-cost-usd"] == "6.00000000"
    assert gateway.metrics.registry.get_sample_value("sluice_escalations_total") == 1


async def test_a_sure_small_answer_is_served_without_escalation_and_without_the_cascades_logprobs(
    cascade_gateway, tiers, records
):
    gateway = cascade_gateway(logprob=HIGH)
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2))
    body = json.loads(reply.body)
    assert body["choices"][0]["message"]["content"] == "small-a small-b" and body["model"] == "sluice-small"
    assert body["choices"][0]["logprobs"] is None  # asked by the cascade, not by the client
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")
    assert reply.headers["x-sluice-confidence"] == "-0.0500"
    assert tiers["large"].requests == []
    assert (records[0].escalated, records[0].cost_usd) == (False, pytest.approx(2.0))


async def test_a_client_that_asked_for_logprobs_gets_them(cascade_gateway):
    gateway = cascade_gateway(logprob=HIGH)
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2, logprobs=True))
    content = json.loads(reply.body)["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in content] == [HIGH, HIGH]


async def test_text_completions_cascade_too(cascade_gateway, tiers):
    from engines.api.protocol import CompletionRequest

    gateway = cascade_gateway(logprob=LOW)
    reply = await gateway.complete(
        await start(gateway, "completions"), CompletionRequest(model="auto", prompt="two plus two", max_tokens=2)
    )
    body = json.loads(reply.body)
    assert body["choices"][0]["text"] == "large-a large-b"
    assert tiers["small"].requests[0].logprobs == 0
    assert reply.headers["x-sluice-escalated"] == "true"


async def test_a_small_tier_without_logprobs_gets_classifier_only_routing(cascade_gateway, tiers, records):
    gateway = cascade_gateway(logprob=LOW, settings=settings_with(small_logprobs=False))
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2))
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")
    assert "x-sluice-confidence" not in reply.headers
    assert tiers["small"].requests[0].logprobs is False
    assert records[0].confidence is None


async def test_an_upstream_that_returns_no_logprobs_is_served_as_it_answered(cascade_gateway, tiers):
    gateway = cascade_gateway(logprob=None)  # configured with logprobs, but none come back
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2))
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")
    assert tiers["large"].requests == []


async def test_a_hard_prompt_goes_to_large_directly_without_a_cascade(cascade_gateway, tiers, records):
    gateway = cascade_gateway(logprob=LOW, scores={"prove the theorem": 0.9})
    reply = await gateway.chat(await start(gateway), chat("prove the theorem", max_tokens=2))
    assert (reply.headers["x-sluice-route"], reply.headers["x-sluice-tier"]) == ("large", "large")
    assert reply.headers["x-sluice-escalated"] == "false"
    assert tiers["small"].requests == []
    assert records[0].route_score == pytest.approx(0.9)


async def test_a_pinned_model_name_bypasses_classifier_and_cascade(cascade_gateway, tiers, embedder):
    gateway = cascade_gateway(logprob=LOW)
    reply = await gateway.chat(await start(gateway), chat("hi", model="sluice-small", max_tokens=2))
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")
    assert tiers["small"].requests[0].logprobs is False
    assert embedder.texts == []


async def test_a_feature_pinned_to_a_tier_is_not_classified(cascade_gateway, tiers, embedder):
    gateway = cascade_gateway(logprob=LOW, settings=settings_with(route_tier="large"))
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2))
    assert reply.headers["x-sluice-tier"] == "large"
    assert embedder.texts == []


async def test_no_tau_means_classifier_only(cascade_gateway, tiers):
    gateway = cascade_gateway(logprob=LOW, tau=None)
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2))
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")


async def test_the_prompt_is_embedded_once_from_the_last_user_message(cascade_gateway, embedder):
    from engines.api.protocol import ChatCompletionRequest, ChatMessage

    gateway = cascade_gateway(logprob=LOW)
    state = await start(gateway)
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="first question"),
        ChatMessage(role="assistant", content="an answer"),
        ChatMessage(role="user", content="second question"),
    ]
    await gateway.chat(state, ChatCompletionRequest(model="sluice", messages=messages, max_tokens=2))
    assert embedder.texts == ["second question"]
    assert state.prompt_embedding is not None and state.prompt_embedding.shape == (4,)


def test_prompt_text_of_completions_is_the_prompt_and_token_ids_have_none():
    from engines.api.protocol import CompletionRequest

    assert prompt_text(CompletionRequest(model="auto", prompt="hello")) == "hello"
    assert prompt_text(CompletionRequest(model="auto", prompt=["a", "b"])) == "b"
    assert prompt_text(CompletionRequest(model="auto", prompt=[1, 2, 3])) is None


# --- streamed --------------------------------------------------------------------------------------


async def test_an_unsure_stream_is_escalated_and_the_client_never_sees_the_small_tokens(cascade_gateway, tiers):
    gateway = cascade_gateway(logprob=LOW)
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=3))
    events = await collect(reply.stream)
    assert b"small-" not in b"".join(events)
    assert stream_text(events) == "large-a large-b large-c"
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert {chunk["model"] for chunk in chunks} == {"sluice-large"}
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("large", "true")
    assert tiers["small"].requests[0].logprobs is True


async def test_a_long_unsure_stream_is_cut_within_its_first_k_tokens(cascade_gateway, tiers, records):
    tiers["small"].words = [f"small-{i}" for i in range(100)]
    gateway = cascade_gateway(logprob=LOW)
    tiers["small"].logprobs = [LOW] * 100
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=100))
    events = await collect(reply.stream)
    assert b"small-" not in b"".join(events)
    assert tiers["small"].streams_closed_early == 1
    (record,) = records
    assert (record.tier, record.escalated, record.confidence) == ("large", True, pytest.approx(LOW))
    # The abandoned small attempt is charged for the tokens it produced before the decision (k = 32).
    assert record.cost_usd == pytest.approx(32 + 3)


async def test_a_sure_stream_is_flushed_and_streamed_on_without_logprobs(cascade_gateway, tiers, records):
    tiers["small"].words = [f"w{i}" for i in range(40)]
    gateway = cascade_gateway(logprob=HIGH)
    tiers["small"].logprobs = [HIGH] * 40
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=40))
    events = await collect(reply.stream)
    assert stream_text(events) == " ".join(f"w{i}" for i in range(40))
    assert b'"logprobs":{' not in b"".join(events)
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")
    assert tiers["large"].requests == []
    assert (records[0].completion_tokens, records[0].escalated) == (40, False)


async def test_a_sure_stream_its_client_left_before_reading_closes_the_small_tier(cascade_gateway, tiers, records):
    tiers["small"].words = [f"w{i}" for i in range(40)]
    gateway = cascade_gateway(logprob=HIGH)
    tiers["small"].logprobs = [HIGH] * 40
    tiers["small"].hold_after = 36  # past the decision window: the tier is still generating when the client leaves
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=40))
    assert reply.headers["x-sluice-tier"] == "small"
    await reply.stream.aclose()
    assert tiers["small"].streams_closed_early == 1
    assert len(records) == 1 and records[0].completion_tokens < 40


async def test_a_stream_shorter_than_the_window_is_decided_at_its_end(cascade_gateway, tiers):
    gateway = cascade_gateway(logprob=HIGH)
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=2))
    events = await collect(reply.stream)
    assert stream_text(events) == "small-a small-b"
    assert events[-1] == b"data: [DONE]\n\n"


async def test_a_stream_without_logprobs_is_relayed_without_buffering_for_a_decision(cascade_gateway, tiers):
    gateway = cascade_gateway(logprob=None)
    tiers["small"].hold_after = 1  # the stream stops after one word until released
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=3))
    first = await anext(reply.stream)  # arrives although the window (k tokens) is not full
    assert b"small-a" in first
    tiers["small"].release.set()
    rest = await collect(reply.stream)
    assert stream_text([first, *rest]) == "small-a small-b small-c"


def test_policy_shadow_rate_must_be_a_share():
    with pytest.raises(msgspec.ValidationError, match="shadow_rate"):
        msgspec.convert({"shadow_rate": 1.5}, PolicyConfig)


async def test_a_small_stream_that_dies_inside_the_window_is_answered_by_large(cascade_gateway, tiers, records):
    gateway = cascade_gateway(logprob=HIGH)
    tiers["small"].fail_after = 2  # dies after two words, while they are still held back
    reply = await gateway.chat(await start(gateway), chat("hi", stream=True, max_tokens=3))
    events = await collect(reply.stream)
    assert b"small-" not in b"".join(events)
    assert stream_text(events) == "large-a large-b large-c"
    assert (records[0].tier, records[0].fallback, records[0].escalated) == ("large", True, False)


async def test_an_artifact_trained_on_other_embeddings_still_routes_and_is_warned_about_once(
    cascade_gateway, embedder, caplog
):
    gateway = cascade_gateway(logprob=HIGH)
    artifact = gateway.router.artifacts.current
    artifact.meta = {"features": {"embedder": "all-MiniLM-L6-v2@0000-float32"}}
    embedder.version = "all-MiniLM-L6-v2@0000-int8"
    with caplog.at_level("WARNING", logger="sluice.gateway"):
        for _ in range(3):
            reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=2))
            assert reply.headers["x-sluice-route"] == "small"
    warnings = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert warnings == ["router artifact test-1 was trained on all-MiniLM-L6-v2@0000-float32 embeddings, the gateway "
                        "computes all-MiniLM-L6-v2@0000-int8: retrain it"]


async def test_each_path_escalates_on_its_own_tau(cascade_gateway, tiers):
    """A complete answer is judged by its least likely token, a stream by its first tokens' mean: each has a τ."""
    tiers["small"].words = ["small-a", "small-b", "small-c", "small-d"]
    gateway = cascade_gateway(logprob=LOW, tau=None, tau_stream=TAU)  # no τ for complete answers
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=4))
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("small", "false")
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=4, stream=True))
    assert "large-a" in stream_text(await collect(reply.stream))
    gateway = cascade_gateway(logprob=LOW, tau=TAU, tau_stream=None)  # no τ for streams
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=4, stream=True))
    assert "small-a" in stream_text(await collect(reply.stream))
    reply = await gateway.chat(await start(gateway), chat("hi", max_tokens=4))
    assert (reply.headers["x-sluice-tier"], reply.headers["x-sluice-escalated"]) == ("large", "true")
