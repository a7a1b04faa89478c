"""Router benchmark part (b): the confidence cascade on our own tiers, from labelled GSM8K rows.

`sluice router label --dataset gsm8k --out FILE` ran both demo tiers over GSM8K questions and kept, per
question, whether each tier's final number was right, the small tier's token logprobs and both tiers'
token counts. Each policy's outcome on a question is therefore known without running the tiers again:

- small-only: the small tier's score and cost;
- large-only: the large tier's score and cost;
- cascade(τ): the small tier answers; below τ its answer is abandoned and the large tier's is served
  (accuracy = large score, cost = both attempts), else the small answer is served.

`cascade_benchmark(path)` sweeps τ over every observed confidence, reports the cheapest τ that keeps
accuracy ≥ 95% of large-only (in-sample, and 2-fold cross-validated: τ chosen on one half, measured on the
other) for each path with its own confidence (complete answers: `answer_confidence`; streams:
`stream_confidence`), and also runs the two studies that justify the cascade's parts:

- which confidence definition separates right from wrong small answers best (AUROC of each candidate in
  `router.confidence.CANDIDATES`);
- how well the shadow runs' agreement score (`router.shadow.agreement`, small vs large answer) tracks
  "the small answer is right, given the large one is" (Pearson correlation and accuracy of agreement as a
  predictor, on the questions the large tier got right).

`python -m bench.router_cascade --labels FILE` prints the tables and writes
bench/results/router_cascade.json; `bench/router.py` calls `cascade_benchmark` for its part (b).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import print_table, write_results
from gateway.config import TierConfig, load_settings
from gateway.cost import request_cost
from router.confidence import CANDIDATES, DEFINITIONS, answer_confidence, stream_confidence
from router.shadow import final_answer_agreement

QUALITY_SHARE = 0.95  # target: cascade accuracy >= 95% of large-only
MAX_LARGE_FRACTION = 0.50  # ...with at most half the requests reaching the large tier


@dataclass(frozen=True, slots=True)
class Labelled:
    prompt: str
    small_correct: bool
    large_correct: bool
    small_logprobs: list[float]
    small_answer: str
    large_answer: str
    small_cost: float
    large_cost: float


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    tau: float | None
    accuracy: float
    escalation_rate: float
    large_call_fraction: float
    cost_usd: float  # total over the questions
    cost_vs_large_only: float
    accuracy_vs_large_only: float


def load_labelled(path: Path, tiers: dict[str, TierConfig]) -> list[Labelled]:
    rows = []
    with path.open() as f:
        for line in f:
            raw = json.loads(line)
            if not raw.get("small_logprobs"):
                continue  # a small answer without logprobs cannot be cascaded
            small_tokens, large_tokens = raw["small_tokens"], raw["large_tokens"]
            rows.append(
                Labelled(
                    prompt=raw["prompt"],
                    small_correct=raw["small_score"] >= 0.5,
                    large_correct=raw["large_score"] >= 0.5,
                    small_logprobs=raw["small_logprobs"],
                    small_answer=raw["small_answer"],
                    large_answer=raw["large_answer"],
                    small_cost=request_cost(tiers["small"], small_tokens[0], small_tokens[1], 0),
                    large_cost=request_cost(tiers["large"], large_tokens[0], large_tokens[1], 0),
                )
            )
    return rows


def auroc(scores: Sequence[float], positives: Sequence[bool]) -> float:
    """P(score of a random positive > score of a random negative), ties counted half (Mann-Whitney U)."""
    pos = [s for s, p in zip(scores, positives, strict=True) if p]
    neg = [s for s, p in zip(scores, positives, strict=True) if not p]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def confidence_study(rows: Sequence[Labelled]) -> dict[str, float]:
    return candidate_aurocs([r.small_correct for r in rows], [r.small_logprobs for r in rows])


def candidate_aurocs(correct: Sequence[bool], logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
    return {name: auroc([candidate(lp) for lp in logprobs], correct) for name, candidate in CANDIDATES.items()}


def small_only_study(answers: Path, data_dir: Path, split: str) -> dict[str, Any]:
    """The confidence study from the small tier's answers alone (`<labels>.small.answers.jsonl`), scored
    against GSM8K: it needs no large-tier run."""
    from router.label import is_correct, load_answers, load_gsm8k

    known = load_answers(answers)
    questions = [q for q in load_gsm8k(data_dir, split, 10**9) if q.question in known]
    correct = [is_correct(known[q.question].text, q.answer) for q in questions]
    logprobs = [known[q.question].logprobs for q in questions]
    return {
        "questions": len(questions),
        "small_correct": sum(correct),
        "truncated_at_budget": sum(known[q.question].completion_tokens >= 256 for q in questions),
        "confidence_auroc": candidate_aurocs(correct, logprobs),
    }


Confidence = Callable[[Labelled], float]


def evaluate(rows: Sequence[Labelled], tau: float | None, conf: Confidence,
             to_large: Sequence[bool] | None = None) -> tuple[float, float, float]:  # fmt: skip
    """(accuracy, share of requests reaching the large tier, cost) of the cascade at τ (None: small-only);
    `to_large` marks the questions the classifier sends straight to the large tier."""
    correct = cost = large = 0.0
    for i, r in enumerate(rows):
        if to_large is not None and to_large[i]:
            large += 1
            correct += r.large_correct
            cost += r.large_cost
            continue
        up = tau is not None and conf(r) < tau
        large += up
        correct += r.large_correct if up else r.small_correct
        cost += r.small_cost + (r.large_cost if up else 0.0)
    n = len(rows)
    return correct / n, large / n, cost


def cheapest_tau(rows: Sequence[Labelled], conf: Confidence, share: float) -> float:
    """The smallest τ (fewest escalations) whose accuracy reaches `share` of large-only; +inf escalates all."""
    target = share * sum(r.large_correct for r in rows) / len(rows)
    for tau in sorted({conf(r) for r in rows} | {math.inf}):
        # τ escalates confidences strictly below it: try each observed value and everything.
        if evaluate(rows, tau, conf)[0] >= target - 1e-12:
            return tau
    return math.inf


def policy_results(rows: Sequence[Labelled], tau: float, conf: Confidence) -> list[PolicyResult]:
    n = len(rows)
    large_accuracy = sum(r.large_correct for r in rows) / n
    large_cost = sum(r.large_cost for r in rows)
    small_accuracy, _, small_cost = evaluate(rows, None, conf)
    cascade_accuracy, escalation, cascade_cost = evaluate(rows, tau, conf)

    def result(policy: str, tau_: float | None, accuracy: float, esc: float, large: float, cost: float) -> PolicyResult:
        quality = accuracy / large_accuracy if large_accuracy else 0.0
        return PolicyResult(policy, tau_, accuracy, esc, large, cost, cost / large_cost, quality)

    return [
        result("small_only", None, small_accuracy, 0.0, 0.0, small_cost),
        result("large_only", None, large_accuracy, 0.0, 1.0, large_cost),
        result("cascade", tau, cascade_accuracy, escalation, escalation, cascade_cost),
    ]


def cross_validated(rows: Sequence[Labelled], conf: Confidence, share: float) -> dict[str, float]:
    """τ chosen on one half (alternate rows), measured on the other, both ways; pooled over the halves."""
    halves = [rows[0::2], rows[1::2]]
    correct = escalated = cost = large_correct = 0.0
    for fit, test in (halves, halves[::-1]):
        tau = cheapest_tau(fit, conf, share)
        accuracy, escalation, spent = evaluate(test, tau, conf)
        correct += accuracy * len(test)
        escalated += escalation * len(test)
        cost += spent
        large_correct += sum(r.large_correct for r in test)
    n = len(rows)
    large_cost = sum(r.large_cost for r in rows)
    return {
        "accuracy": correct / n,
        "accuracy_vs_large_only": correct / large_correct if large_correct else 0.0,
        "large_call_fraction": escalated / n,
        "cost_vs_large_only": cost / large_cost,
    }


def cheapest_routed(rows: Sequence[Labelled], scores: Sequence[float], conf: Confidence,
                    share: float) -> tuple[float, float]:  # fmt: skip
    """(θ, τ) of the routed cascade — score ≥ θ goes to the large tier, the rest to the small one with
    escalation below τ — that reaches `share` of large-only accuracy with the fewest large calls."""
    target = share * sum(r.large_correct for r in rows) / len(rows)
    best: tuple[float, float, float] = (math.inf, math.inf, math.inf)  # (large share, θ, τ)
    taus = sorted({conf(r) for r in rows} | {-math.inf, math.inf})
    for theta in sorted(set(scores) | {math.inf}):
        to_large = [s >= theta for s in scores]
        for tau in taus:
            accuracy, large, _ = evaluate(rows, tau, conf, to_large)
            if accuracy >= target - 1e-12:
                best = min(best, (large, theta, tau))
                break  # a higher τ only escalates more
    return best[1], best[2]


def routed_results(rows: Sequence[Labelled], scores: Sequence[float], conf: Confidence,
                   share: float) -> dict[str, Any]:  # fmt: skip
    """The gateway's policy — classifier, then the cascade — in-sample and 2-fold cross-validated."""
    large_accuracy = sum(r.large_correct for r in rows) / len(rows)
    large_cost = sum(r.large_cost for r in rows)
    theta, tau = cheapest_routed(rows, scores, conf, share)
    accuracy, large, cost = evaluate(rows, tau, conf, [s >= theta for s in scores])
    halves = [list(range(0, len(rows), 2)), list(range(1, len(rows), 2))]
    correct = calls = spent = 0.0
    for fit, test in (halves, halves[::-1]):
        fit_theta, fit_tau = cheapest_routed([rows[i] for i in fit], [scores[i] for i in fit], conf, share)
        a, lg, c = evaluate([rows[i] for i in test], fit_tau, conf, [scores[i] >= fit_theta for i in test])
        correct, calls, spent = correct + a * len(test), calls + lg * len(test), spent + c
    n = len(rows)
    return {
        "in_sample": {"theta": theta, "tau": tau, "accuracy": accuracy,
                      "accuracy_vs_large_only": accuracy / large_accuracy if large_accuracy else 0.0,
                      "large_call_fraction": large, "cost_vs_large_only": cost / large_cost},
        "cross_validated": {"accuracy": correct / n,
                            "accuracy_vs_large_only": correct / n / large_accuracy if large_accuracy else 0.0,
                            "large_call_fraction": calls / n, "cost_vs_large_only": spent / large_cost},
    }  # fmt: skip


def classifier_scores(rows: Sequence[Labelled], embeddings: np.ndarray) -> list[float]:
    """The shipped difficulty classifier's score of each question (trained on RouteLLM's model pair, not ours)."""
    from router.artifact import DEFAULT_ARTIFACT_DIR, RouterArtifact

    return RouterArtifact.load(DEFAULT_ARTIFACT_DIR).score(embeddings, [r.prompt for r in rows]).tolist()


OWN_FOLDS = 5


def own_classifier_scores(rows: Sequence[Labelled], embeddings: np.ndarray, embedder_version: str,
                          folds: int = OWN_FOLDS) -> list[float]:
    """Each question's score from a classifier trained on these tiers' own outcomes by `train_router` (what
    `sluice router train` does with these rows), out of fold: the k-th fifth is scored by a model that never saw it."""
    import tempfile

    from router.data import TrainingRow
    from router.train import train_router

    prompts = [r.prompt for r in rows]
    training = [TrainingRow(r.prompt, float(r.small_correct), float(r.large_correct)) for r in rows]
    fold_of = np.random.default_rng(0).permutation(len(rows)) % folds
    scores = np.zeros(len(rows))
    for fold in range(folds):
        fit, held = np.flatnonzero(fold_of != fold), np.flatnonzero(fold_of == fold)
        with tempfile.TemporaryDirectory() as tmp:
            artifact = train_router([training[i] for i in fit], Path(tmp), embeddings=embeddings[fit],
                                    embedder_version=embedder_version)
            scores[held] = artifact.score(embeddings[held], [prompts[i] for i in held])
    return scores.tolist()


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    return sxy / (sx * sy) if sx and sy else float("nan")


def agreement_study(rows: Sequence[Labelled]) -> dict[str, Any]:
    """On questions the large tier got right: final-answer agreement vs "small got it right"."""
    return _agreement_figures([(r.small_answer, r.large_answer, r.small_correct, r.large_correct) for r in rows])


def routellm_agreement_study(csv_path: Path) -> dict[str, Any]:
    """The same check on RouteLLM's GSM8K responses (Mixtral-8x7B as small, GPT-4 as large, with their
    graded correctness): thousands of real answer pairs where our own tiers give a few dozen."""
    import csv

    weak, strong = "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"
    with csv_path.open(newline="") as f:
        rows = [
            (r[f"{weak}_response"], r[f"{strong}_response"], r[weak] == "True", r[strong] == "True")
            for r in csv.DictReader(f)
        ]
    return _agreement_figures(rows)


def _agreement_figures(rows: Sequence[tuple[str, str, bool, bool]]) -> dict[str, Any]:
    graded = [(small, large, small_ok) for small, large, small_ok, large_ok in rows if large_ok]
    pairs = [
        (agreed, float(small_ok))
        for small, large, small_ok in graded
        if (agreed := final_answer_agreement(small, large)) is not None
    ]
    if not pairs:
        return {"questions": 0}
    agreements, truths = zip(*pairs, strict=True)
    return {
        "questions": len(pairs),
        "questions_without_final_numbers": len(graded) - len(pairs),
        "pearson_agreement_vs_small_correct": pearson(agreements, truths),
        "accuracy_of_agreement_as_label": sum(a == t for a, t in pairs) / len(pairs),
        "mean_agreement": sum(agreements) / len(pairs),
        "small_accuracy_given_large_correct": sum(truths) / len(pairs),
    }


def path_figures(rows: Sequence[Labelled], conf: Confidence, shipped: Sequence[float],
                 own: Sequence[float] | str) -> dict[str, Any]:
    """The policies on one path (complete answers or streams), with that path's confidence; `own` holds the
    out-of-fold scores of a classifier trained on these rows, or why there are none."""
    tau = cheapest_tau(rows, conf, QUALITY_SHARE)
    results = policy_results(rows, tau, conf)
    cascade = results[-1]
    cv = cross_validated(rows, conf, QUALITY_SHARE)
    routed = routed_results(rows, shipped, conf, QUALITY_SHARE)
    own_routed = {"skipped": own} if isinstance(own, str) else routed_results(rows, own, conf, QUALITY_SHARE) | {
        "folds": OWN_FOLDS, "classifier": "train_router on the other folds' rows; each question scored out of fold"}

    def met(figures: dict[str, Any]) -> bool:
        return "skipped" not in figures and figures["accuracy_vs_large_only"] >= QUALITY_SHARE \
            and figures["large_call_fraction"] <= MAX_LARGE_FRACTION

    return {
        "policies": {r.policy: asdict(r) for r in results},
        "cascade_cross_validated": cv,
        "routed_cascade": routed,
        "routed_cascade_own_classifier": own_routed,
        "targets": {
            "quality_share_of_large_only": QUALITY_SHARE,
            "max_large_call_fraction": MAX_LARGE_FRACTION,
            "met_in_sample": met(asdict(cascade)),
            "met_cross_validated": met(cv),
            "routed_met_cross_validated": met(routed["cross_validated"]),
            "routed_own_classifier_met_cross_validated": "skipped" not in own_routed
            and met(own_routed["cross_validated"]),
        },
    }


def cascade_benchmark(labels: Path) -> dict[str, Any]:
    """Part (b): figures for the JSON (and the printed tables). The top level is the path of complete answers
    (non-streamed requests, `answer_confidence`); `streams` the same policies with `stream_confidence`."""
    from router.data import TrainingDataError
    from router.embedding import Embedder

    tiers = load_settings(environ={}).tiers
    rows = load_labelled(labels, tiers)
    if len(rows) < 4:
        raise SystemExit(f"{labels}: {len(rows)} labelled rows with small-tier logprobs; label more first")
    embedder = Embedder.load()
    embeddings = embedder.embed([r.prompt for r in rows])  # once, for both classifiers
    shipped = classifier_scores(rows, embeddings)
    try:
        own: list[float] | str = own_classifier_scores(rows, embeddings, embedder.version)
    except TrainingDataError as exc:
        own = str(exc)
    figures = {
        "questions": len(rows),
        "labels": str(labels),
        "confidence_definitions": DEFINITIONS,
        "small_accuracy": sum(r.small_correct for r in rows) / len(rows),
        "large_accuracy": sum(r.large_correct for r in rows) / len(rows),
        **path_figures(rows, lambda r: answer_confidence(r.small_logprobs), shipped, own),
        "streams": path_figures(rows, lambda r: stream_confidence(r.small_logprobs), shipped, own),
        "confidence_auroc": confidence_study(rows),
        "agreement_validation": agreement_study(rows),
    }
    _print(figures)
    return figures


def _print_path(title: str, figures: dict[str, Any], questions: int) -> None:
    header = ["policy", "tau", "accuracy", "vs large-only", "escalation", "large calls", "cost $", "cost vs large"]
    table = [
        [p["policy"], "-" if p["tau"] is None else round(p["tau"], 4), p["accuracy"], p["accuracy_vs_large_only"],
         p["escalation_rate"], p["large_call_fraction"], p["cost_usd"], p["cost_vs_large_only"]]
        for p in figures["policies"].values()
    ]
    print_table(f"{title}: cascade on our tiers, {questions} GSM8K questions (tau in-sample)", header, table)
    cv = figures["cascade_cross_validated"]
    print_table(f"{title}: cascade, tau chosen on the other half (2-fold)", list(cv), [list(cv.values())])
    for name, figures_ in figures["routed_cascade"].items():
        print_table(f"{title}: shipped classifier, then the cascade ({name})", list(figures_),
                    [list(figures_.values())])
    own = figures["routed_cascade_own_classifier"]
    for name in ("in_sample", "cross_validated") if "skipped" not in own else ():
        print_table(f"{title}: classifier trained on these tiers' outcomes (out of fold), then the cascade ({name})",
                    list(own[name]), [list(own[name].values())])


def _print(figures: dict[str, Any]) -> None:
    _print_path("Complete answers", figures, figures["questions"])
    _print_path("Streams", figures["streams"], figures["questions"])
    auc = figures["confidence_auroc"]
    print_table("Confidence candidates: AUROC for 'small answer correct'", ["candidate", "auroc"],
                sorted(auc.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0))
    agreement = figures["agreement_validation"]
    print_table("Shadow agreement vs ground truth (large correct)", list(agreement), [list(agreement.values())])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", required=True, help="JSONL from `sluice router label`")
    parser.add_argument("--out", help="also write the figures here (JSON)")
    parser.add_argument("--routellm-agreement", metavar="CSV",
                        help="validate the shadow agreement score on RouteLLM's gsm8k_responses.csv and exit")
    parser.add_argument("--small-only", action="store_true",
                        help="only the confidence study, from <labels>.small.answers.jsonl (no large-tier labels)")
    parser.add_argument("--data-dir", default="../shared/data/gsm8k", help="GSM8K, for --small-only")
    parser.add_argument("--split", default="test", choices=["test", "train"])
    args = parser.parse_args(argv)
    if args.routellm_agreement:
        study = routellm_agreement_study(Path(args.routellm_agreement))
        print_table("Shadow agreement vs ground truth, RouteLLM GSM8K (large correct)", list(study),
                    [list(study.values())])
        write_results("router_agreement", study)
        return 0
    if args.small_only:
        from router.label import answers_path

        study = small_only_study(answers_path(Path(args.labels), "small"), Path(args.data_dir), args.split)
        print_table(f"Confidence candidates, {study['questions']} small-tier answers ({study['small_correct']} right)",
                    ["candidate", "auroc"], sorted(study["confidence_auroc"].items(), key=lambda kv: -kv[1]))
        write_results("router_confidence", study)
        return 0
    labels = Path(args.labels)
    if not labels.exists():
        print(f"{labels} not found: run `sluice router label --dataset gsm8k --out {labels}` first")
        return 1
    figures = cascade_benchmark(labels)
    write_results("router_cascade", figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
