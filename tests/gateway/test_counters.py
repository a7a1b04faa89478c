"""Rate-limit and budget counters: the same semantics in Redis and in process."""

from __future__ import annotations

import asyncio
import calendar
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.counters import (
    SETTLEMENT_ID_GRACE_S,
    Charge,
    CounterStore,
    CountersUnavailable,
    InProcessCounterStore,
    Limits,
    MinuteLeft,
    RedisCounterStore,
    Settlement,
    Windows,
)

NOON = calendar.timegm((2026, 3, 14, 12, 0, 15))  # 15 s into a minute


def once(charges: dict[str, Charge]) -> list[Settlement]:
    """`charges` as one settlement of its own."""
    return [Settlement(uuid.uuid4().hex, charges)]


@pytest.fixture(params=["in_process", "redis"])
async def store(request: pytest.FixtureRequest, redis_url: str, redis_prefix: str) -> AsyncIterator[CounterStore]:
    if request.param == "in_process":
        yield InProcessCounterStore()
        return
    redis = Redis.from_url(redis_url)
    try:
        yield RedisCounterStore(redis, redis_prefix)
    finally:
        await redis.aclose()


async def test_requests_beyond_rpm_are_refused_until_the_minute_ends(store: CounterStore):
    limits = Limits(rpm=2)
    assert (await store.admit("k", limits, 1, NOON)).admitted
    assert (await store.admit("k", limits, 1, NOON + 1)).admitted
    refused = await store.admit("k", limits, 1, NOON + 2)
    assert (refused.refused_by, refused.retry_after_s) == ("rpm", 43)
    assert (await store.admit("k", limits, 1, NOON + 45)).admitted  # the next minute


async def test_an_admission_says_what_is_left_of_the_tightest_minute_limits(store: CounterStore):
    key, tenant = Limits(rpm=5, tpm=1000), Limits(rpm=3)
    first = await store.admit("k", key, 100, NOON, Charge(completion_tokens=50), also=[("t", tenant)])
    assert first.minute == MinuteLeft(limit_requests=3, remaining_requests=2, limit_tokens=1000,
                                      remaining_tokens=850, reset_s=45)  # fmt: skip
    await store.charge_many(once({"k": Charge(completion_tokens=-40)}), NOON)  # produced 10 of the 50
    second = await store.admit("k", key, 100, NOON + 1, Charge(completion_tokens=50), also=[("t", tenant)])
    assert (second.minute.remaining_requests, second.minute.remaining_tokens) == (1, 1000 - 110 - 150)
    assert (await store.admit("u", Limits(), 10, NOON)).minute == MinuteLeft(reset_s=45)


async def test_a_refused_request_is_not_counted(store: CounterStore):
    limits = Limits(rpm=1)
    await store.admit("k", limits, 0, NOON)
    for _ in range(3):
        assert not (await store.admit("k", limits, 0, NOON)).admitted
    assert (await store.admit("k", Limits(rpm=2), 0, NOON)).admitted


async def test_tpm_counts_prompt_tokens_on_admission_and_completion_tokens_when_charged(store: CounterStore):
    limits = Limits(tpm=100)
    assert (await store.admit("k", limits, 60, NOON)).admitted
    await store.charge_many(once({"k": Charge(completion_tokens=30)}), NOON)
    refused = await store.admit("k", limits, 11, NOON)  # 90 used + 11 > 100
    assert refused.refused_by == "tpm"
    assert (await store.admit("k", limits, 10, NOON)).admitted


async def test_spend_budgets_refuse_once_reached_until_the_day_or_month_ends(store: CounterStore):
    await store.charge_many(once({"k": Charge(cost_usd=0.75)}), NOON)
    assert (await store.admit("k", Limits(spend_per_day_usd=1.0), 0, NOON)).admitted
    await store.charge_many(once({"k": Charge(cost_usd=0.25)}), NOON)
    refused = await store.admit("k", Limits(spend_per_day_usd=1.0), 0, NOON)
    assert (refused.refused_by, refused.retry_after_s) == ("spend_per_day", 12 * 3600 - 15)
    assert (await store.admit("k", Limits(spend_per_day_usd=1.0), 0, NOON + 86400)).admitted
    month = await store.admit("k", Limits(spend_per_month_usd=0.5), 0, NOON + 86400)
    assert month.refused_by == "spend_per_month"
    assert await store.spent("k", NOON) == (pytest.approx(1.0), pytest.approx(1.0))


async def test_one_charge_many_call_charges_each_subject(store: CounterStore):
    await store.charge_many(once({"a": Charge(cost_usd=1.5), "b": Charge(cost_usd=0.5)}), NOON)
    assert (await store.spent("a", NOON))[0] == pytest.approx(1.5)
    assert (await store.spent("b", NOON))[0] == pytest.approx(0.5)


async def test_a_settlement_sent_again_changes_the_counters_once(store: CounterStore):
    """A retry after a lost reply, or a spool replayed twice, sends a settlement again under its id."""
    settlement = Settlement("s-1", {"k": Charge(completion_tokens=-5, cost_usd=-0.25), "t": Charge(cost_usd=1.0)})
    await store.charge_many([settlement], NOON)
    await store.charge_many([settlement], NOON)
    await store.charge_many([settlement, settlement], NOON)  # twice in one round trip, too
    assert await store.spent("k", NOON) == (pytest.approx(-0.25), pytest.approx(-0.25))
    assert await store.spent("t", NOON) == (pytest.approx(1.0), pytest.approx(1.0))
    refused = await store.admit("k", Limits(tpm=100), 106, NOON)  # -5 tokens counted once: 101 > 100
    assert refused.refused_by == "tpm"
    assert (await store.admit("k", Limits(tpm=100), 105, NOON)).admitted


async def test_a_settlement_its_sender_keeps_no_more_is_remembered_a_grace_period(redis_url: str, redis_prefix: str):
    redis = Redis.from_url(redis_url)
    store = RedisCounterStore(redis, redis_prefix)
    first, second = Settlement("first", {"k": Charge(cost_usd=1.0)}), Settlement("second", {"k": Charge(cost_usd=1.0)})
    try:
        await store.charge_many([first], NOON)
        assert await redis.ttl(f"{redis_prefix}:applied:first") > SETTLEMENT_ID_GRACE_S
        await store.charge_many([second], NOON, forget=["first"])
        assert 0 < await redis.ttl(f"{redis_prefix}:applied:first") <= SETTLEMENT_ID_GRACE_S
        assert await redis.ttl(f"{redis_prefix}:applied:second") > SETTLEMENT_ID_GRACE_S
        await store.charge_many([first, second], NOON)  # a late copy within the grace: still applied once
        assert await store.spent("k", NOON) == (pytest.approx(2.0), pytest.approx(2.0))
    finally:
        await store.aclose()
        await redis.aclose()


async def test_distinct_settlements_of_one_subject_all_apply(store: CounterStore):
    charges = {"k": Charge(completion_tokens=1, cost_usd=0.5)}
    await store.charge_many([Settlement("a", charges), Settlement("b", charges)], NOON)
    await store.charge_many([Settlement("c", charges)], NOON)
    assert await store.spent("k", NOON) == (pytest.approx(1.5), pytest.approx(1.5))


async def test_an_unreachable_redis_is_reported_as_counters_unavailable():
    redis = Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        store = RedisCounterStore(redis, "unreachable")
        with pytest.raises(CountersUnavailable):
            await store.admit("k", Limits(rpm=1), 0, NOON)
        with pytest.raises(CountersUnavailable):
            await store.charge_many(once({"k": Charge(cost_usd=1.0)}), NOON)
    finally:
        await redis.aclose()


async def test_subjects_do_not_share_counters(store: CounterStore):
    await store.admit("a", Limits(rpm=1), 0, NOON)
    assert (await store.admit("b", Limits(rpm=1), 0, NOON)).admitted


async def test_two_redis_stores_with_one_prefix_share_one_limit(redis_url: str, redis_prefix: str):
    first, second = Redis.from_url(redis_url), Redis.from_url(redis_url)
    try:
        a, b = RedisCounterStore(first, redis_prefix), RedisCounterStore(second, redis_prefix)
        assert (await a.admit("k", Limits(rpm=2), 0, NOON)).admitted
        assert (await b.admit("k", Limits(rpm=2), 0, NOON)).admitted
        assert not (await a.admit("k", Limits(rpm=2), 0, NOON)).admitted
        await a.charge_many(once({"k": Charge(cost_usd=2.5)}), NOON)
        assert await b.spent("k", NOON) == (pytest.approx(2.5), pytest.approx(2.5))
    finally:
        await first.aclose()
        await second.aclose()


def test_windows_end_at_the_minute_the_utc_day_and_the_month():
    w = Windows.at(calendar.timegm((2026, 12, 31, 23, 59, 30)))
    assert (w.retry_after("rpm"), w.retry_after("spend_per_day"), w.retry_after("spend_per_month")) == (30, 30, 30)
    assert (w.day, w.month) == ("20261231", "202612")


async def test_concurrent_admissions_on_one_redis_store_each_get_their_own_answer(redis_url: str, redis_prefix: str):
    redis = Redis.from_url(redis_url)
    store = RedisCounterStore(redis, redis_prefix)
    try:
        answers = await asyncio.gather(*(store.admit("k", Limits(rpm=20), 0, NOON) for _ in range(50)))
        assert sum(answer.admitted for answer in answers) == 20
        assert {answer.refused_by for answer in answers if not answer.admitted} == {"rpm"}
    finally:
        await store.aclose()
        await redis.aclose()


async def test_admission_still_works_after_redis_forgot_its_scripts(redis_url: str, redis_prefix: str):
    redis = Redis.from_url(redis_url)
    store = RedisCounterStore(redis, redis_prefix)
    try:
        assert (await store.admit("k", Limits(rpm=2), 0, NOON)).admitted
        await redis.script_flush()  # what a Redis restart does to the script cache
        assert (await store.admit("k", Limits(rpm=2), 0, NOON)).admitted
        assert not (await store.admit("k", Limits(rpm=2), 0, NOON)).admitted
    finally:
        await store.aclose()
        await redis.aclose()
