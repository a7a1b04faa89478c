"""Tuning picks the cheapest (threshold, τ) whose quality meets the bar, on tables small enough to check by hand.
Default costs: 1 per small call, 10 per large call; an escalated request pays both."""

import numpy as np
import pytest

from router.tune import QUALITY_TARGETS, Prices, operating_points, request_costs, tune


def test_without_confidences_the_fewest_large_calls_that_meet_the_bar_win() -> None:
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.1])
    small = np.array([0, 1, 0, 1, 1])
    large = np.array([1, 1, 1, 1, 0])  # large-only quality 0.8
    # 1.0 × 0.8 needs 4 of 5 right: sending only row 0 large does it (cost 10 + 4 = 14).
    point = tune(scores, small, large, quality_target=1.0)
    assert 0.8 < point.threshold <= 0.9 and point.tau is None
    assert point.expected_large_fraction == pytest.approx(0.2)
    assert point.expected_escalation_rate == 0.0
    # 0.75 × 0.8 = 0.6 is met by the small tier alone (3 of 5): nothing goes large.
    assert tune(scores, small, large, quality_target=0.75).expected_large_fraction == 0.0


def test_with_confidences_escalating_one_doubtful_answer_beats_sending_everyone_large() -> None:
    # Row 0 is the only one the small tier gets wrong, the classifier scores it lowest, but the small tier
    # is unsure of it: the cheapest way to full quality is small for all and escalate below τ (cost 5 + 10).
    scores = np.array([0.1, 0.9, 0.5, 0.3, 0.7])
    small = np.array([0, 1, 1, 1, 1])
    large = np.array([1, 1, 1, 1, 1])
    confidence = np.array([0.1, 0.9, 0.8, 0.7, 0.6])
    point = tune(scores, small, large, quality_target=1.0, confidence=confidence)
    assert point.threshold > 0.9  # nothing is routed large up front
    assert point.tau is not None and 0.1 < point.tau <= 0.6
    assert point.expected_escalation_rate == pytest.approx(0.2)
    assert point.expected_large_fraction == 0.0
    # Without the confidences the same bar needs every request on the large tier.
    assert tune(scores, small, large, quality_target=1.0).expected_large_fraction == 1.0


def test_streams_get_the_lowest_tau_on_their_own_confidence_that_keeps_the_bar() -> None:
    # The same table: the complete answer's confidence flags row 0 alone, the stream's (its first tokens) ranks
    # row 0 only third from the bottom: keeping full quality then takes escalating three streams.
    scores = np.array([0.1, 0.9, 0.5, 0.3, 0.7])
    small = np.array([0, 1, 1, 1, 1])
    large = np.array([1, 1, 1, 1, 1])
    answer = np.array([0.1, 0.9, 0.8, 0.7, 0.6])
    stream = np.array([0.5, 0.9, 0.8, 0.3, 0.4])
    point = tune(scores, small, large, quality_target=1.0, confidence=answer, stream_confidence=stream)
    assert 0.1 < point.tau <= 0.6
    assert (stream < point.tau_stream).tolist() == [True, False, False, True, True]  # the fewest that include row 0
    assert tune(scores, small, large, quality_target=1.0, confidence=answer).tau_stream is None


def test_streams_get_no_tau_where_the_threshold_alone_keeps_the_bar() -> None:
    """A τ that escalates no stream would still hold every routed small stream back for its decision window."""
    scores = np.array([0.1, 0.9, 0.5, 0.3, 0.7])
    small = np.array([1, 0, 1, 1, 1])  # the one answer the small tier gets wrong is the one the classifier flags
    large = np.array([1, 1, 1, 1, 1])
    stream = np.array([0.5, 0.9, 0.8, 0.3, 0.4])
    point = tune(scores, small, large, quality_target=1.0, confidence=stream, stream_confidence=stream)
    assert 0.7 < point.threshold <= 0.9 and point.tau is None and point.tau_stream is None


def test_costs_follow_tier_prices_and_prompt_length() -> None:
    prices = Prices(small_input=0.05, small_output=0.20, large_input=0.30, large_output=1.20)
    small, large = request_costs(["x" * 400], prices, output_tokens=100)  # 100 prompt tokens at 4 chars each
    assert small[0] == pytest.approx((100 * 0.05 + 100 * 0.20) / 1e6)
    assert large[0] == pytest.approx((100 * 0.30 + 100 * 1.20) / 1e6)


def test_one_point_per_target_from_080_to_100() -> None:
    rng = np.random.default_rng(0)
    small = (rng.random(300) < 0.6).astype(float)
    large = np.maximum(small, rng.random(300) < 0.5)
    points = operating_points(rng.random(300), small, large)
    assert [p.quality_target for p in points] == list(QUALITY_TARGETS)
    assert QUALITY_TARGETS[0] == 0.8 and QUALITY_TARGETS[-1] == 1.0
    fractions = [p.expected_large_fraction for p in points]
    assert fractions == sorted(fractions)
