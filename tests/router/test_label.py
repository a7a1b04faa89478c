"""Labelling our own tiers: final-number scoring, rows in the training format, resuming."""

from __future__ import annotations

import json
from pathlib import Path

from engines.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    TokenLogprob,
    Usage,
)
from router.data import load_rows
from router.label import Question, final_number, is_correct, label, load_gsm8k


class FixedTier:
    """Answers every question with the same text; one logprob per word when asked."""

    def __init__(self, answer: str, logprob: float = -0.5) -> None:
        self.answer = answer
        self.logprob = logprob
        self.asked: list[str] = []

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        self.asked.append(request.messages[-1].text())
        words = self.answer.split()
        logprobs = ChoiceLogprobs(content=[TokenLogprob(token=w, logprob=self.logprob) for w in words])
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=self.answer),
            finish_reason="stop",
            logprobs=logprobs if request.logprobs else None,
        )
        return ChatCompletion(id="x", created=0, model="t", choices=[choice], usage=Usage.of(10, len(words)))


def test_final_number_prefers_the_marked_answer_and_reads_commas_and_dollars():
    assert final_number("3 + 4 = 7 apples\n#### 7") == 7
    assert final_number("so it costs $1,250.") == 1250
    assert final_number("#### $18") == 18
    assert final_number("no number here") is None
    assert is_correct("answer: 12.0", 12) and not is_correct("#### 13", 12)


def test_gsm8k_questions_carry_their_reference_number(tmp_path: Path):
    (tmp_path / "test.jsonl").write_text(
        json.dumps({"question": "q1", "answer": "2+2=4\n#### 4"}) + "\n"
        + json.dumps({"question": "q2", "answer": "#### 1,000"}) + "\n"
    )
    assert load_gsm8k(tmp_path, "test", 5) == [Question("q1", 4.0), Question("q2", 1000.0)]
    assert load_gsm8k(tmp_path, "test", 1) == [Question("q1", 4.0)]


async def test_labelled_rows_score_each_tier_and_keep_the_small_logprobs(tmp_path: Path):
    out = tmp_path / "labels.jsonl"
    small, large = FixedTier("it is #### 5", -0.25), FixedTier("#### 4")
    count = await label([Question("two plus two", 4.0)], small, large, out)
    assert count == 1
    (row,) = load_rows(out)
    assert (row.prompt, row.small_score, row.large_score, row.small_confidence) == ("two plus two", 0.0, 1.0, -0.25)
    raw = json.loads(out.read_text())
    assert raw["small_logprobs"] == [-0.25] * 4  # one per word of "it is #### 5"
    assert (raw["small_tokens"], raw["large_tokens"]) == ([10, 4], [10, 2])


async def test_a_rerun_skips_questions_already_labelled(tmp_path: Path):
    out = tmp_path / "labels.jsonl"
    small, large = FixedTier("#### 4"), FixedTier("#### 4")
    await label([Question("a", 4.0)], small, large, out)
    count = await label([Question("a", 4.0), Question("b", 4.0)], small, large, out)
    assert count == 1
    assert small.asked == ["a", "b"]
    assert [r.prompt for r in load_rows(out)] == ["a", "b"]


def test_a_boxed_answer_counts_when_there_is_no_marker():
    assert final_number(r"so the profit is \(\boxed{50,000}\) dollars, after 3 years") == 50000
