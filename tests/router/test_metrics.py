"""APGR and CPT as RouteLLM computes them, checked against values worked out by hand."""

import numpy as np
import pytest

from router.metrics import apgr, cpt, full_curve, large_fraction_for, oracle_scores, routing_curve

SCORES = np.array([0.9, 0.7, 0.5, 0.3, 0.1])


def test_curve_points_follow_routellms_quantile_thresholds() -> None:
    # Thresholds 0.1, 0.3, 0.5, 0.7, 0.9 (quantiles 0, .25, .5, .75, 1); >= each, > the last.
    curve = routing_curve(SCORES, small=np.array([0, 0, 0, 1, 1]), large=np.array([1, 1, 0, 1, 1]), num_results=4)
    assert curve.large_fraction.tolist() == pytest.approx([0.0, 0.4, 0.6, 0.8, 1.0])
    assert curve.quality.tolist() == pytest.approx([0.4, 0.8, 0.8, 0.8, 0.8])
    assert (curve.small_quality, curve.large_quality) == pytest.approx((0.4, 0.8))


def test_apgr_and_cpt_on_a_hand_computed_table() -> None:
    curve = routing_curve(SCORES, small=np.array([0, 0, 0, 1, 1]), large=np.array([1, 1, 0, 1, 1]), num_results=4)
    # AUC = 0.4·(0.4+0.8)/2 + 0.6·0.8 = 0.72; APGR = (0.72 − 0.4) / (0.8 − 0.4).
    assert apgr(curve) == pytest.approx(0.8)
    # 50%: quality 0.6 is reached halfway between (0, 0.4) and (0.4, 0.8); 80%: quality 0.72.
    assert cpt(curve, 0.5) == pytest.approx(0.2)
    assert cpt(curve, 0.8) == pytest.approx(0.32)


def test_apgr_can_exceed_one_when_routing_beats_the_large_model() -> None:
    # The small model is right where the large one is wrong (row 3): the curve rises above large-only quality.
    curve = routing_curve(SCORES, small=np.array([0, 0, 1, 1, 1]), large=np.array([1, 1, 1, 0, 1]), num_results=4)
    # Points (0, .6) (.4, 1) (.6, 1) (.8, .8) (1, .8): AUC = .32 + .2 + .18 + .16 = .86.
    assert apgr(curve) == pytest.approx((0.86 - 0.6) / (0.8 - 0.6))


def test_random_scores_recover_half_the_gap_and_the_oracle_nearly_all() -> None:
    rng = np.random.default_rng(0)
    small = (rng.random(20_000) < 0.6).astype(float)
    large = np.maximum(small, rng.random(20_000) < 0.5)
    assert apgr(routing_curve(rng.random(20_000), small, large)) == pytest.approx(0.5, abs=0.02)
    oracle = routing_curve(oracle_scores(small, large), small, large)
    assert apgr(oracle) > 0.85  # the 10-point sweep caps it below 1
    assert cpt(oracle, 0.5) < cpt(routing_curve(rng.random(20_000), small, large), 0.5)


def test_full_curve_and_the_fraction_for_a_quality_share() -> None:
    curve = full_curve(SCORES, small=np.array([0, 0, 0, 1, 1]), large=np.array([1, 1, 0, 1, 1]))
    assert curve.large_fraction.tolist() == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert curve.quality.tolist() == pytest.approx([0.4, 0.6, 0.8, 0.8, 0.8, 0.8])
    assert large_fraction_for(curve, 0.95) == pytest.approx(0.4)  # 0.8 ≥ 0.95 · 0.8 first at 2 of 5 calls
    assert large_fraction_for(curve, 0.70) == pytest.approx(0.2)  # 0.6 ≥ 0.56


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="same length"):
        routing_curve(np.array([0.1]), np.array([1.0, 0.0]), np.array([1.0]))
