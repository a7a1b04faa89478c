"""The matcher's data split, its operating point, and its false-hit rate on pairs it never saw."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.cache.index import VectorIndex
from gateway.cache.pairs import DEFAULT_PAIRS, Pair, load_pairs, split_pairs
from gateway.cache.verifier import Matcher, fhr_upper_bound, pick_threshold, rates_at


def _questions(pairs: list[Pair]) -> set[str]:
    return {" ".join(t.lower().split()) for p in pairs for t in (p.text_a, p.text_b)}


def test_no_question_is_in_two_splits_and_the_split_ignores_file_order():
    rng = np.random.default_rng(0)
    questions = [f"question number {i}?" for i in range(400)]
    pairs = [Pair(questions[a], questions[b], int(rng.integers(2))) for a, b in rng.integers(0, 400, (600, 2))]
    splits = split_pairs(pairs)
    names = list(splits)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert not _questions(splits[first]) & _questions(splits[second])
    shuffled = split_pairs(list(reversed(pairs)))
    assert {k: set(v) for k, v in shuffled.items()} == {k: set(v) for k, v in splits.items()}
    assert sum(map(len, splits.values())) == len(pairs)


def test_the_threshold_is_the_lowest_that_keeps_the_false_hit_rate():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    labels = np.array([1, 1, 0, 1, 1, 0, 0, 0])
    assert pick_threshold(scores, labels, 0.0) == (0.8, 0.0, 0.5)
    assert pick_threshold(scores, labels, 0.25) == (0.5, 0.25, 1.0)
    assert rates_at(scores, labels, 0.5) == (0.25, 1.0)
    tied = np.array([0.9, 0.9, 0.1])
    assert pick_threshold(tied, np.array([1, 0, 1]), 0.0)[2] == 0.0  # never cuts between equal scores


def test_with_a_confidence_the_threshold_bounds_the_false_hit_rate_on_unseen_pairs_too():
    # 400 negatives: observed, 4 false hits meet 1%; as a 95% upper limit, even one does not
    # (1 of 400 → ≤ 1.18%), while none does (0 of 400 → ≤ 1 - 0.05^(1/400) = 0.75%).
    scores = np.r_[[0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6], np.full(396, 0.1)]
    labels = np.r_[[1, 0, 1, 0, 1, 0, 1, 0], np.zeros(396, dtype=int)]
    assert pick_threshold(scores, labels, 0.01) == (0.6, 0.01, 1.0)
    assert pick_threshold(scores, labels, 0.01, confidence=0.95) == (0.95, 0.0, 0.25)
    assert fhr_upper_bound(np.array([0, 1]), 400, 0.95) == pytest.approx([1 - 0.05 ** (1 / 400), 0.0118], abs=1e-4)


def test_the_index_finds_the_nearest_live_entries_also_through_the_bit_prefilter(monkeypatch):
    import gateway.cache.index as index_module

    monkeypatch.setattr(index_module, "EXACT_SCAN_MAX", 100)
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((1000, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(384)
    for i, v in enumerate(vectors):
        index.add(f"k{i}", v, expires_at=100.0 if i != 7 else 1.0, text=f"q{i}")
    near = vectors[3] + 0.02 * rng.standard_normal(384).astype(np.float32)
    near /= np.linalg.norm(near)
    assert [k for k, _ in index.search(near, 2, 0.5, now=10.0)] == ["k3"]
    assert index.search(vectors[7], 2, 0.5, now=10.0) == []  # expired
    index.remove("k3")
    assert index.search(near, 2, 0.5, now=10.0) == [] and len(index) == 999 and "k3" not in index.texts
    index.add("k-new", vectors[3], 100.0)  # reuses the freed row
    assert [k for k, _ in index.search(near, 2, 0.5, now=10.0)] == ["k-new"]


def test_the_bit_prefilter_keeps_every_row_as_near_as_its_nearest_few_hundred():
    from gateway.cache.index import PREFILTER, nearest_by_hamming

    distance = np.random.default_rng(2).integers(0, 385, 5000).astype(np.uint16)
    rows = nearest_by_hamming(distance, 384)
    cutoff = np.sort(distance)[PREFILTER - 1]
    assert set(rows) == set(np.flatnonzero(distance <= cutoff))  # the nearest PREFILTER, and their ties
    same = np.zeros(5000, dtype=np.uint16)  # one huge tie: ranked exactly it would cost a full scan
    assert len(nearest_by_hamming(same, 384)) == PREFILTER


HELD_OUT_SLICE = 2000  # pairs of the test split: about 1,300 negatives, so ±0.3% of sampling noise at 1%


def test_the_served_cosine_floor_keeps_99_percent_of_the_accepted_duplicates_and_never_drops():
    from gateway.cache.train_matcher import serving_floor

    cosine = np.r_[np.linspace(0.70, 0.99, 200), [0.3, 0.4]]
    labels = np.r_[np.ones(200, dtype=int), [0, 1]]
    accepted = np.r_[np.ones(200, dtype=bool), [True, False]]  # the two low pairs: a false hit, a rejected duplicate
    floor = serving_floor(cosine, labels, accepted, 0.55)
    assert floor == 0.70  # the 1% quantile of accepted duplicates (0.7029) in steps of 0.05
    assert (cosine[accepted & (labels == 1)] >= floor).mean() >= 0.99
    assert serving_floor(cosine, labels, accepted, 0.8) == 0.8  # never under the floor it was tuned above
    assert serving_floor(cosine, labels, np.zeros(202, dtype=bool), 0.55) == 0.55

@pytest.mark.skipif(not DEFAULT_PAIRS.exists(), reason=f"no QQP pairs at {DEFAULT_PAIRS} (../shared/data absent)")
def test_the_shipped_rule_keeps_its_false_hit_rate_on_a_held_out_slice(matcher: Matcher, embedder):
    """The cache's rule (cosine floor, then the matcher) on pairs no question of which was trained or tuned
    on. The full split's figures are in BENCHMARKS.md (`make bench-semcache`)."""
    test = split_pairs(load_pairs(DEFAULT_PAIRS))["test"][:HELD_OUT_SLICE]
    labels = np.array([p.label for p in test])
    cosine = (embedder.embed([p.text_a for p in test]) * embedder.embed([p.text_b for p in test])).sum(axis=1)
    shown = np.flatnonzero(cosine >= matcher.floor)
    probabilities = matcher.score_many([test[i].text_a for i in shown], [test[i].text_b for i in shown])
    scores = np.full(len(test), -1.0, dtype=np.float32)
    scores[shown] = matcher.rule_score(probabilities, cosine[shown])
    false_hit_rate, recall = rates_at(scores, labels, matcher.threshold)
    assert false_hit_rate <= 0.015  # the 1% target plus the slice's sampling noise
    assert recall > 0.05


def test_a_pairs_score_does_not_depend_on_what_it_is_scored_beside(matcher: Matcher):
    """Scored beside another candidate of another length (or in another lookup's batch), a pair gets exactly the
    probability it gets alone: the one its threshold was chosen on."""
    query = "How do I get into Harvard?"
    duplicate, unrelated = "How can I get admitted to Harvard?", "What is the best pizza in New York City and why?"
    alone = matcher.score([query], [duplicate])[0]
    assert matcher.score([query, query], [duplicate, unrelated])[0] == alone
    assert matcher.score([query, query, query], [unrelated, unrelated, duplicate])[2] == alone


def test_a_pair_longer_than_the_matcher_reads_is_never_a_match(matcher: Matcher):
    """Cut to the matcher's length, two long questions that differ only at the end would read the same: such
    a pair scores 0, and a query that leaves no room for a candidate is not one the matcher can judge."""
    preamble = ("I bought a laptop from your online store three weeks ago and since yesterday it does not charge at "
                "all, not even overnight with the original cable")
    first, second = f"{preamble}, even with another charger. Can I get a refund?", f"{preamble}. Can I get it repaired?"
    assert matcher.tokenizer.encode(first, second).overflowing  # the pair does not fit whole
    assert matcher.score([first], [second])[0] == 0.0
    question = "How do I get into Harvard?"
    assert matcher.score([question], ["How can I get admitted to Harvard?"])[0] > 0.5  # a pair that fits is judged
    assert matcher.reads_whole(question)
    assert not matcher.reads_whole(" ".join([preamble] * 3))
    assert not matcher.reads_whole("a" * 5000)
