"""The cascade's plain logic: when a stream has seen enough to decide, what confidence an answer has,
and how the request asks for logprobs."""

from __future__ import annotations

import math

from engines.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    CompletionRequest,
    DeltaMessage,
    TokenLogprob,
    Usage,
)
from router.cascade import (
    CascadePlan,
    StreamProbe,
    buffer_budget_s,
    response_confidence,
    should_escalate,
    strip_logprobs,
    with_logprobs,
)
from router.confidence import CANDIDATES, answer_confidence, stream_confidence


def chunk(*logprobs: float, text: str = "x", index: int = 0) -> ChatCompletionChunk:
    content = ChoiceLogprobs(content=[TokenLogprob(token=text, logprob=lp) for lp in logprobs])
    choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=content)
    return ChatCompletionChunk(id="c", created=0, model="small", choices=[choice])


def plain_chunk(text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id="c", created=0, model="small", choices=[ChatChunkChoice(index=0, delta=DeltaMessage(content=text))]
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_probe_decides_after_k_tokens():
    probe = StreamProbe(CascadePlan(tau=-1.0, escalate_to="large", k=3))
    probe.add(chunk(-0.5, -0.5))
    assert not probe.ready()
    probe.add(chunk(-2.0, -9.0))  # the fourth token is past the window
    assert probe.ready() and probe.tokens == 4
    assert probe.confidence == -1.0 and probe.generated_tokens == 4


def test_a_probe_decides_on_fewer_tokens_when_the_buffering_time_is_up():
    clock = Clock()
    probe = StreamProbe(CascadePlan(tau=-1.0, escalate_to="large", k=32, buffer_s=0.5), clock=clock)
    probe.add(chunk(-0.2))
    assert not probe.ready()
    clock.now = 0.6
    assert probe.ready() and probe.confidence == -0.2


def test_a_stream_without_logprobs_is_decided_at_once_and_never_escalates():
    probe = StreamProbe(CascadePlan(tau=-1.0, escalate_to="large"))
    probe.add(
        ChatCompletionChunk(
            id="c", created=0, model="s", choices=[ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant"))]
        )
    )
    assert not probe.ready()  # a role-only chunk says nothing yet
    probe.add(plain_chunk("hello"))
    assert probe.ready() and probe.confidence is None
    assert not should_escalate(probe.confidence, -1.0)


def test_a_complete_answer_is_as_confident_as_its_least_likely_token_in_its_least_confident_choice():
    def choice(index: int, *logprobs: float) -> ChatChoice:
        content = [TokenLogprob(token="t", logprob=lp) for lp in logprobs]
        return ChatChoice(
            index=index,
            message=AssistantMessage(content="t"),
            finish_reason="stop",
            logprobs=ChoiceLogprobs(content=content),
        )

    response = ChatCompletion(
        id="r", created=0, model="s", choices=[choice(0, -0.1), choice(1, -2.0, -1.0)], usage=Usage.of(1, 3)
    )
    assert response_confidence(response) == -2.0  # not the stream's mean of the first tokens (-1.5)
    strip_logprobs(response)
    assert response_confidence(response) is None
    assert all(c.logprobs is None for c in response.choices)


def test_requests_ask_for_logprobs_where_the_engines_allow():
    chat = ChatCompletionRequest(model="auto", messages=[ChatMessage(role="user", content="q")])
    assert with_logprobs(chat).logprobs is True
    assert with_logprobs(CompletionRequest(model="auto", prompt="q")).logprobs == 0
    assert with_logprobs(CompletionRequest(model="auto", prompt="q", logprobs=3)).logprobs == 3
    assert with_logprobs(CompletionRequest(model="auto", prompt="q", echo=True)) is None


def test_buffering_time_is_what_the_ttft_slo_leaves():
    assert buffer_budget_s(1500.0, 0.2) == 1.3
    assert buffer_budget_s(1500.0, 2.0) == 0.0


def test_a_streams_confidence_is_the_mean_of_its_first_k_token_logprobs_an_answers_its_minimum():
    assert stream_confidence([-1.0, -3.0, -100.0], k=2) == -2.0
    assert stream_confidence([]) == -math.inf
    assert answer_confidence([-1.0, -3.0, -100.0]) == -100.0
    assert answer_confidence([]) == -math.inf
    assert CANDIDATES["min"]([-1.0, -3.0]) == -3.0
    assert CANDIDATES["uncertain_fraction"]([-0.1, -2.0]) == -0.5
