"""The cost model: per-million-token prices, cached prompt tokens at the cached-input price."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import TierConfig
from gateway.cost import request_cost

TIER = TierConfig(
    model="small", price_input_per_mtok=0.30, price_output_per_mtok=1.20, price_cached_input_per_mtok=0.15
)


def test_a_million_uncached_prompt_tokens_cost_the_input_price() -> None:
    assert request_cost(TIER, prompt_tokens=1_000_000, completion_tokens=0, cached_tokens=0) == pytest.approx(0.30)


def test_a_million_completion_tokens_cost_the_output_price() -> None:
    assert request_cost(TIER, prompt_tokens=0, completion_tokens=1_000_000, cached_tokens=0) == pytest.approx(1.20)


def test_cached_prompt_tokens_cost_the_cached_input_price_and_the_rest_the_input_price() -> None:
    cost = request_cost(TIER, prompt_tokens=1000, completion_tokens=200, cached_tokens=600)
    assert cost == pytest.approx((400 * 0.30 + 600 * 0.15 + 200 * 1.20) / 1e6)


def test_a_free_tier_costs_nothing() -> None:
    assert request_cost(TierConfig(model="tiny"), prompt_tokens=5000, completion_tokens=5000, cached_tokens=10) == 0.0


@pytest.mark.parametrize(
    ("prompt", "completion", "cached"), [(-1, 0, 0), (0, -1, 0), (10, 0, -1), (10, 0, 11)], ids=str
)
def test_impossible_token_counts_are_refused(prompt: int, completion: int, cached: int) -> None:
    with pytest.raises(ValueError, match="token"):
        request_cost(TIER, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


@given(
    prompt=st.integers(0, 10**7),
    completion=st.integers(0, 10**7),
    cached_share=st.floats(0, 1),
)
def test_prefix_cache_hits_never_raise_the_cost(prompt: int, completion: int, cached_share: float) -> None:
    cached = int(prompt * cached_share)
    with_cache = request_cost(TIER, prompt, completion, cached)
    without_cache = request_cost(TIER, prompt, completion, 0)
    assert 0 <= with_cache <= without_cache + 1e-12
