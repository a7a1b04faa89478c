"""The request path without HTTP: budgets, limits, fallback and the one record per request."""

from __future__ import annotations

import msgspec
import pytest
from redis.asyncio import Redis

from engines.api.errors import APIError
from engines.api.protocol import ChatCompletion, CompletionRequest
from gateway.budgets import MAX_CHARS_PER_TOKEN
from gateway.counters import Limits, LocalFallbackCounterStore, RedisCounterStore
from gateway.pipeline import RequestState
from tests.gateway.conftest import EXPENSIVE, chat, make_settings, start


async def collect(reply_stream) -> list[bytes]:
    return [chunk async for chunk in reply_stream]


async def test_a_prompt_over_the_key_budget_is_refused_naming_both_counts(make_gateway, tiers, records):
    gateway = make_gateway(max_prompt_tokens=3)
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat("one two three four five"))
    assert caught.value.status_code == 400
    assert caught.value.code == "prompt_too_long"
    assert "5 tokens" in caught.value.message and "limit of 3" in caught.value.message
    assert not any(tier.requests for tier in tiers.values())  # no engine work
    assert [(r.status, r.error_code) for r in records] == [(400, "prompt_too_long")]


async def test_a_prompt_too_long_in_characters_for_the_budget_is_refused_before_it_is_tokenised(
        make_gateway, tiers, records):
    gateway = make_gateway(max_prompt_tokens=3)
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat("x" * (3 * MAX_CHARS_PER_TOKEN + 1)))
    assert (caught.value.status_code, caught.value.code) == (400, "prompt_too_long")
    assert f"{3 * MAX_CHARS_PER_TOKEN + 1} characters" in caught.value.message  # not a token count: none was taken
    assert not any(tier.requests for tier in tiers.values())
    assert [(r.status, r.error_code) for r in records] == [(400, "prompt_too_long")]


async def test_max_tokens_above_the_cap_is_clamped_and_the_reply_says_so(make_gateway, tiers):
    gateway = make_gateway(max_output_tokens=3)
    reply = await gateway.chat(await start(gateway), chat(max_tokens=100))
    assert reply.headers["x-sluice-max-tokens-clamped"] == "3"
    assert tiers["small"].requests[0].max_tokens == 3
    assert msgspec.json.decode(reply.body, type=ChatCompletion).usage.completion_tokens == 3


async def test_max_completion_tokens_is_clamped_too(make_gateway, tiers):
    gateway = make_gateway(max_output_tokens=2)
    reply = await gateway.chat(await start(gateway), chat(max_completion_tokens=50))
    assert reply.headers["x-sluice-max-tokens-clamped"] == "2"
    assert tiers["small"].requests[0].output_limit() == 2


async def test_vllms_min_tokens_is_lowered_with_the_limit_it_would_exceed(make_gateway, tiers):
    """vLLM refuses a floor above the limit: a capped request must still reach such a tier whole."""
    gateway = make_gateway(max_output_tokens=3)
    await gateway.chat(await start(gateway), chat(max_tokens=100, min_tokens=50))
    await gateway.chat(await start(gateway), chat(max_tokens=100, min_tokens=2))
    assert [(r.max_tokens, r.min_tokens) for r in tiers["small"].requests] == [(3, 3), (3, 2)]


async def test_a_missing_max_tokens_gets_the_cap_without_the_clamped_header(make_gateway, tiers):
    gateway = make_gateway(max_output_tokens=4)
    reply = await gateway.chat(await start(gateway), chat())
    assert "x-sluice-max-tokens-clamped" not in reply.headers
    assert tiers["small"].requests[0].max_tokens == 4


async def test_spend_over_the_daily_budget_is_refused_once_spend_accumulates(make_gateway):
    gateway = make_gateway(make_settings(tier_prices=EXPENSIVE, spend_per_day_usd=10.0))
    first = await gateway.chat(await start(gateway), chat(max_tokens=8))  # 8 tokens at $1: $8
    assert float(first.headers["x-sluice-cost-usd"]) == pytest.approx(8.0)
    await gateway.drain()
    await gateway.chat(await start(gateway), chat(max_tokens=8))  # $8 < $10: admitted, now $16
    await gateway.drain()
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat(max_tokens=8))
    assert (caught.value.status_code, caught.value.code) == (429, "budget_exceeded")
    assert int(caught.value.headers["Retry-After"]) > 0
    assert not any(name.startswith("x-ratelimit-") for name in caught.value.headers)  # a budget, not a rate


async def test_the_monthly_budget_is_enforced_as_well(make_gateway):
    gateway = make_gateway(make_settings(tier_prices=EXPENSIVE, spend_per_month_usd=1.0))
    await gateway.chat(await start(gateway), chat(max_tokens=2))
    await gateway.drain()
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat())
    assert caught.value.code == "budget_exceeded" and "Monthly" in caught.value.message


async def test_requests_per_minute_are_limited_with_retry_after(make_gateway):
    gateway = make_gateway(rpm=2)
    for _ in range(2):
        await gateway.chat(await start(gateway), chat())
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat())
    assert (caught.value.status_code, caught.value.code) == (429, "rate_limit_exceeded")
    assert 1 <= int(caught.value.headers["Retry-After"]) <= 60


async def test_replies_carry_openais_rate_limit_headers_counting_each_request(make_gateway):
    gateway = make_gateway(rpm=3, tpm=100)
    first = await gateway.chat(await start(gateway), chat("a b", max_tokens=8))  # 2 prompt + 8 reserved
    second = await gateway.chat(await start(gateway), chat("a b", max_tokens=8))
    assert [r.headers["x-ratelimit-limit-requests"] for r in (first, second)] == ["3", "3"]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["2", "1"]
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    tokens_left = [int(r.headers["x-ratelimit-remaining-tokens"]) for r in (first, second)]
    assert tokens_left[1] < tokens_left[0] <= 90
    reset = first.headers["x-ratelimit-reset-requests"]
    assert reset.endswith("s") and 0 < float(reset[:-1]) <= 60


async def test_a_key_without_per_minute_limits_gets_no_rate_limit_headers(make_gateway):
    gateway = make_gateway()
    reply = await gateway.chat(await start(gateway), chat())
    assert not any(name.startswith("x-ratelimit-") for name in reply.headers)


async def test_a_rate_limited_request_is_told_none_is_left_and_when_the_minute_ends(make_gateway):
    gateway = make_gateway(rpm=1)
    await gateway.chat(await start(gateway), chat())
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat())
    headers = caught.value.headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert headers["x-ratelimit-reset-requests"] == f"{headers['Retry-After']}s"


async def test_tokens_per_minute_count_prompt_and_completion(make_gateway):
    gateway = make_gateway(tpm=20)
    await gateway.chat(await start(gateway), chat("a b", max_tokens=8))  # 2 + 8 tokens
    await gateway.drain()
    await gateway.chat(await start(gateway), chat("a b", max_tokens=8))  # 20 tokens used
    await gateway.drain()
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat("a"))
    assert caught.value.code == "rate_limit_exceeded" and "tokens per minute" in caught.value.message
    assert "Retry-After" in caught.value.headers


async def test_a_down_tier_falls_back_to_the_other_allowed_tier(make_gateway, tiers, records):
    tiers["small"].down = True
    gateway = make_gateway()
    reply = await gateway.chat(await start(gateway), chat())
    assert reply.headers["x-sluice-tier"] == "large"
    assert (records[0].route, records[0].tier, records[0].fallback) == ("small", "large", True)


async def test_a_down_tier_without_fallback_gives_503_with_retry_after(make_gateway, tiers, records):
    tiers["small"].down = True
    gateway = make_gateway(fallback=False)
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat())
    assert caught.value.status_code == 503 and caught.value.headers["Retry-After"]
    assert tiers["large"].requests == []
    assert records[0].status == 503 and records[0].error_code == "tier_unavailable"


async def test_fallback_only_goes_to_allowed_tiers(make_gateway, tiers):
    tiers["small"].down = True
    gateway = make_gateway(allowed_tiers=["small"])
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat())
    assert caught.value.status_code == 503


async def test_a_stream_whose_tier_is_down_before_its_first_chunk_falls_back(make_gateway, tiers):
    tiers["small"].down = True
    gateway = make_gateway()
    reply = await gateway.chat(await start(gateway), chat(stream=True))
    assert reply.headers["x-sluice-tier"] == "large"
    chunks = await collect(reply.stream)
    assert chunks[-1] == b"data: [DONE]\n\n"


async def test_in_flight_requests_are_counted_on_the_tier_serving_them(make_gateway, tiers):
    tiers["small"].down = True
    gateway = make_gateway()

    def in_flight(tier: str) -> float | None:
        return gateway.metrics.registry.get_sample_value("sluice_in_flight_requests", {"tier": tier})

    reply = await gateway.chat(await start(gateway), chat(stream=True))
    assert (in_flight("small"), in_flight("large")) == (0, 1)
    await collect(reply.stream)
    assert (in_flight("small"), in_flight("large")) == (0, 0)


async def test_an_explicit_tier_outside_the_allowed_tiers_is_refused(make_gateway):
    gateway = make_gateway(allowed_tiers=["small"])
    with pytest.raises(APIError) as caught:
        await gateway.chat(await start(gateway), chat(model="sluice-large"))
    assert (caught.value.status_code, caught.value.code) == (403, "model_not_allowed")


async def test_auto_goes_to_an_allowed_tier_when_the_default_is_not_allowed(make_gateway, tiers):
    gateway = make_gateway(allowed_tiers=["large"])
    reply = await gateway.chat(await start(gateway), chat(model="auto"))
    assert reply.headers["x-sluice-tier"] == "large"


async def test_a_streamed_request_is_recorded_once_with_its_usage_and_cost(make_gateway, records):
    gateway = make_gateway(make_settings(tier_prices=EXPENSIVE))
    reply = await gateway.chat(await start(gateway), chat("a b c", stream=True, max_tokens=5))
    body = b"".join(await collect(reply.stream))
    assert b'"usage":{' not in body  # the client did not ask for usage
    assert len(records) == 1
    record = records[0]
    assert (record.stream, record.prompt_tokens, record.completion_tokens) == (True, 3, 5)
    assert record.cost_usd == pytest.approx(5.0)
    assert record.ttft_ms is not None and record.itl_ms_mean is not None


async def test_include_usage_passes_the_usage_chunk_to_the_client(make_gateway):
    gateway = make_gateway()
    request = chat(stream=True, max_tokens=2, stream_options={"include_usage": True})
    reply = await gateway.chat(await start(gateway), msgspec.convert(msgspec.to_builtins(request), type(request)))
    body = b"".join(await collect(reply.stream))
    assert b'"choices":[],' in body and b'"completion_tokens":2' in body


async def test_closing_a_stream_mid_way_cancels_upstream_and_charges_what_was_produced(make_gateway, tiers, records):
    tiers["small"].hold_after = 3
    gateway = make_gateway(make_settings(tier_prices=EXPENSIVE))
    reply = await gateway.chat(await start(gateway), chat("a b", stream=True))
    received = [await anext(reply.stream) for _ in range(3)]
    assert all(chunk.startswith(b"data: ") for chunk in received)
    await reply.stream.aclose()  # what the HTTP layer does when the client disconnects
    assert tiers["small"].streams_closed_early == 1
    assert (records[0].completion_tokens, records[0].cost_usd) == (3, pytest.approx(3.0))
    await gateway.drain()
    assert (await gateway.counters.spent("anonymous:local:default", gateway.clock()))[0] == pytest.approx(3.0)


async def test_a_stream_closed_before_it_was_read_still_finishes_and_closes_upstream(make_gateway, tiers, records):
    tiers["small"].hold_after = 1
    gateway = make_gateway()
    reply = await gateway.chat(await start(gateway), chat(stream=True))
    await reply.stream.aclose()
    assert tiers["small"].streams_closed_early == 1
    assert len(records) == 1 and records[0].completion_tokens == 1
    assert gateway.metrics.registry.get_sample_value("sluice_in_flight_requests", {"tier": "small"}) == 0


async def test_a_tier_failing_mid_stream_ends_the_stream_with_an_error_event(make_gateway, tiers, records):
    tiers["small"].fail_after = 2
    gateway = make_gateway()
    reply = await gateway.chat(await start(gateway), chat(stream=True))
    events = await collect(reply.stream)
    assert len(events) == 3 and b'"code":"tier_unavailable"' in events[-1]
    assert (records[0].status, records[0].error_code, records[0].completion_tokens) == (200, "tier_unavailable", 2)


async def test_without_reachable_counters_requests_are_refused_not_served(make_gateway, tiers, records):
    redis = Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        gateway = make_gateway(counters=RedisCounterStore(redis, "unreachable"))
        with pytest.raises(APIError) as caught:
            await gateway.chat(await start(gateway), chat())
    finally:
        await redis.aclose()
    assert (caught.value.status_code, caught.value.code) == (503, "limits_unavailable")
    assert caught.value.headers["Retry-After"] and not any(tier.requests for tier in tiers.values())


async def test_with_local_fallback_an_unreachable_redis_still_serves_and_limits_hold_per_replica(
    make_gateway, tiers, records
):
    redis = Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        counters = LocalFallbackCounterStore(RedisCounterStore(redis, "unreachable"), retry_interval_s=60)
        gateway = make_gateway(counters=counters, rpm=2)
        for _ in range(2):
            await gateway.chat(await start(gateway), chat())
        assert counters.using_local
        with pytest.raises(APIError) as caught:
            await gateway.chat(await start(gateway), chat())
    finally:
        await redis.aclose()
    assert (caught.value.status_code, caught.value.code) == (429, "rate_limit_exceeded")
    assert len(tiers["small"].requests) == 2


async def test_local_fallback_goes_back_to_redis_once_it_answers(redis_url: str, redis_prefix: str) -> None:
    down, up = Redis.from_url("redis://127.0.0.1:1/0"), Redis.from_url(redis_url)
    shared = RedisCounterStore(up, redis_prefix)
    counters = LocalFallbackCounterStore(RedisCounterStore(down, "unreachable"), retry_interval_s=0.0)
    limits = Limits(rpm=2)
    try:
        assert (await counters.admit("k", limits, 1, 0.0)).admitted  # counted in this replica
        counters.shared = shared  # Redis answers again
        assert (await counters.admit("k", limits, 1, 0.0)).admitted
        assert (await shared.admit("k", limits, 1, 0.0)).admitted  # Redis had seen one request: this is the 2nd
        assert not (await shared.admit("k", limits, 1, 0.0)).admitted
    finally:
        await shared.aclose()
        await down.aclose()
        await up.aclose()


async def test_text_completions_take_the_same_path(make_gateway, tiers, records):
    gateway = make_gateway(max_output_tokens=2)
    state = RequestState(request_id="req-cmpl", endpoint="completions")
    state.principal = await gateway.authenticate(None)
    reply = await gateway.complete(state, CompletionRequest(model="sluice-large", prompt="x y z", max_tokens=9))
    assert reply.headers["x-sluice-tier"] == "large" and reply.headers["x-sluice-max-tokens-clamped"] == "2"
    assert (records[0].endpoint, records[0].prompt_tokens, records[0].completion_tokens) == ("completions", 3, 2)


async def test_without_a_key_and_without_anonymous_access_the_caller_is_refused(make_gateway):
    gateway = make_gateway(make_settings(allow_anonymous=False))
    with pytest.raises(APIError) as caught:
        await gateway.authenticate(None)
    assert (caught.value.status_code, caught.value.code) == (401, "invalid_api_key")
    with pytest.raises(APIError):
        await gateway.authenticate("Bearer sk-sluice-not-a-real-key")
