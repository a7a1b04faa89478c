"""The cascade benchmark's arithmetic on a hand-computed table of four labelled questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.router_cascade import auroc, cascade_benchmark

# (small right, large right, small token logprobs, small answer, large answer)
TABLE = [
    (True, True, [-0.1], "#### 3", "#### 3"),
    (False, True, [-2.0], "#### 5", "#### 4"),
    (True, True, [-0.5], "#### 7", "#### 7"),
    (False, False, [-1.5], "#### 1", "#### 2"),
]


@pytest.fixture
def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.jsonl"
    with path.open("w") as f:
        for i, (small, large, logprobs, small_answer, large_answer) in enumerate(TABLE):
            row = {
                "prompt": f"q{i}", "small_score": float(small), "large_score": float(large),
                "small_confidence": sum(logprobs) / len(logprobs), "small_logprobs": logprobs,
                "small_answer": small_answer, "large_answer": large_answer,
                "small_tokens": [100, 1000], "large_tokens": [100, 1000],
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


def test_auroc_counts_ties_half():
    assert auroc([0.9, 0.1], [True, False]) == 1.0
    assert auroc([0.5, 0.5], [True, False]) == 0.5
    assert auroc([0.1, 0.5, 0.5], [True, False, True]) == 0.25  # one loss, one tie


def test_the_cheapest_tau_reaching_95_percent_of_large_only(labels: Path):
    figures = cascade_benchmark(labels)
    policies = figures["policies"]
    # large-only 3/4 right; 95% of it is 0.7125. Escalating confidences below -1.5 (question 1 only)
    # turns question 1 right: 3/4, with one request of four reaching the large tier.
    assert policies["small_only"]["accuracy"] == 0.5
    assert policies["large_only"]["accuracy"] == 0.75
    cascade = policies["cascade"]
    assert (cascade["tau"], cascade["accuracy"], cascade["large_call_fraction"]) == (-1.5, 0.75, 0.25)
    # Each attempt costs the same here (equal tokens, prices differ): cascade = 4 small + 1 large.
    small_cost = policies["small_only"]["cost_usd"] / 4
    large_cost = policies["large_only"]["cost_usd"] / 4
    assert cascade["cost_usd"] == pytest.approx(4 * small_cost + large_cost)
    assert figures["targets"]["met_in_sample"] is True
    assert figures["confidence_auroc"]["mean"] == 1.0


def test_agreement_is_validated_on_questions_the_large_tier_got_right(labels: Path):
    study = cascade_benchmark(labels)["agreement_validation"]
    # Questions 0-2: agreement 1, 0, 1; small right 1, 0, 1: perfectly correlated.
    assert study["questions"] == 3
    assert study["pearson_agreement_vs_small_correct"] == pytest.approx(1.0)
    assert study["accuracy_of_agreement_as_label"] == 1.0


def test_the_small_only_study_scores_answers_against_gsm8k(tmp_path: Path):
    from bench.router_cascade import small_only_study

    (tmp_path / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(3))
    )
    answers = tmp_path / "labels.small.answers.jsonl"
    answers.write_text(
        "".join(
            json.dumps({"question": f"q{i}", "text": f"#### {given}", "logprobs": [lp], "prompt_tokens": 5,
                        "completion_tokens": tokens}) + "\n"
            for i, given, lp, tokens in ((0, 0, -0.1, 3), (1, 9, -2.0, 256), (2, 2, -0.3, 3))
        )
    )
    study = small_only_study(answers, tmp_path, "test")
    assert (study["questions"], study["small_correct"], study["truncated_at_budget"]) == (3, 2, 1)
    assert study["confidence_auroc"]["mean"] == 1.0  # both right answers are surer than the wrong one


def test_the_routed_cascade_sends_the_question_the_classifier_flags_straight_to_large(labels: Path):
    from bench.router_cascade import cheapest_routed, evaluate, load_labelled
    from gateway.config import load_settings
    from router.confidence import answer_confidence

    rows = load_labelled(labels, load_settings(environ={}).tiers)

    def conf(r):
        return answer_confidence(r.small_logprobs)

    # A classifier that flags q1 (small wrong, large right): it alone goes to large, no escalation needed.
    assert cheapest_routed(rows, [0.1, 0.9, 0.1, 0.1], conf, 0.95) == (0.9, -float("inf"))
    assert evaluate(rows, -float("inf"), conf, [False, True, False, False])[:2] == (0.75, 0.25)
    # One that flags q3 (both wrong) is no help: the cascade alone (τ just above q1's -2.0) is cheapest.
    assert cheapest_routed(rows, [0.1, 0.1, 0.1, 0.9], conf, 0.95) == (float("inf"), -1.5)


def test_a_classifier_trained_on_the_tiers_own_outcomes_scores_each_question_out_of_fold(monkeypatch):
    import numpy as np

    import router.train
    from bench.router_cascade import OWN_FOLDS, Labelled, own_classifier_scores

    rows = [Labelled(f"question {i}", i % 3 == 0, i % 2 == 0, [-0.1], "", "", 1.0, 2.0) for i in range(40)]
    trained_on: list[set[str]] = []

    class Scored:
        def __init__(self, prompts: set[str]) -> None:
            self.prompts = prompts

        def score(self, embeddings: np.ndarray, prompts: list[str]) -> np.ndarray:
            assert not self.prompts & set(prompts)  # never a question the model was trained on
            return np.full(len(prompts), float(len(trained_on)))

    def fake_train(training_rows, out_dir, **kwargs):
        assert kwargs["embeddings"].shape == (len(training_rows), 384)
        trained_on.append({r.prompt for r in training_rows})
        return Scored(trained_on[-1])

    monkeypatch.setattr(router.train, "train_router", fake_train)
    scores = own_classifier_scores(rows, np.zeros((len(rows), 384), dtype=np.float32), "test-embedder")
    assert len(trained_on) == OWN_FOLDS and all(len(t) == 32 for t in trained_on)
    assert sorted(scores.count(float(k)) for k in range(1, OWN_FOLDS + 1)) == [8] * OWN_FOLDS  # each row once
