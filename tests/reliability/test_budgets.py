"""Budgets hold under concurrency (issue #14, item 1): each request's worst case is reserved at
admission, atomically in Redis, and settled with what it produced; N parallel streams overspend a
budget by at most one reservation, a key's or (over several keys) its tenant's."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from redis.asyncio import Redis

from engines.api.errors import APIError
from gateway.auth import Principal
from gateway.config import TenantConfig
from gateway.counters import Charge, InProcessCounterStore, Limits, RedisCounterStore, Settlement
from gateway.metrics import Metrics
from gateway.pipeline import Gateway, RequestState
from tests.gateway.conftest import chat, make_settings, start
from tests.gateway.scripted_tier import ScriptedTier

PRICE = {"price_input_per_mtok": 0.0, "price_output_per_mtok": 1000.0}  # $0.001 per completion token
BUDGET = 0.05
MAX_TOKENS = 16  # reservation: 16 tokens = $0.016; the scripted tier produces 8 ($0.008)
RESERVATION = MAX_TOKENS * 0.001
NOON = 1_750_000_000.0 - 1_750_000_000.0 % 86400 + 43200


async def _stream(gateway: Gateway) -> tuple[object, bool]:
    """Open a stream (admission happens here); (the reply, admitted)."""
    state = await start(gateway)
    state.request_id = f"req-{id(state)}"
    try:
        return await gateway.chat(state, chat(stream=True, max_tokens=MAX_TOKENS)), True
    except APIError as exc:
        assert (exc.status_code, exc.code) == (429, "budget_exceeded"), exc.message
        return None, False


async def _consume(reply: object) -> None:
    async for _ in reply.stream:  # type: ignore[attr-defined]
        pass


@pytest.mark.parametrize("store", ["redis", "in-process"])
async def test_a_hundred_parallel_streams_overspend_by_at_most_one_reservation(store, redis_url, redis_prefix):
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    for tier in tiers.values():
        tier.hold_after = 1  # every admitted stream is mid-flight, none settled, when the others arrive
    redis = Redis.from_url(redis_url)
    counters = RedisCounterStore(redis, redis_prefix) if store == "redis" else InProcessCounterStore()
    records: list = []
    settings = make_settings(tier_prices=PRICE, spend_per_day_usd=BUDGET, max_output_tokens=MAX_TOKENS)
    gateway = Gateway(settings, tiers, counters, records.append, Metrics(), clock=lambda: NOON)
    try:
        opened = await asyncio.gather(*(_stream(gateway) for _ in range(100)))
        admitted = [reply for reply, ok in opened if ok]
        # Reserved at admission: admitted while the reservations so far are below the budget.
        assert len(admitted) == -(-BUDGET // RESERVATION)  # ceil: the last one admitted below it
        for tier in tiers.values():
            tier.release.set()
        await asyncio.gather(*(_consume(reply) for reply in admitted))
        await gateway.drain()
        spent_today, _ = await counters.spent("anonymous:local:default", NOON)
    finally:
        with contextlib.suppress(Exception):
            await counters.aclose()  # type: ignore[union-attr]
        await redis.aclose()
    charged = sum(r.cost_usd for r in records if r.status == 200)
    assert charged == pytest.approx(len(admitted) * 8 * 0.001)  # settled with what was produced
    assert spent_today == pytest.approx(charged)  # every reservation replaced by its actual cost
    assert charged <= BUDGET + RESERVATION


@pytest.mark.parametrize("store", ["redis", "in-process"])
async def test_tokens_per_minute_count_the_reserved_output(store, redis_url, redis_prefix):
    redis = Redis.from_url(redis_url)
    counters = RedisCounterStore(redis, redis_prefix) if store == "redis" else InProcessCounterStore()
    limits, reserve = Limits(tpm=100), Charge(completion_tokens=50)
    try:
        assert (await counters.admit("k", limits, 10, NOON, reserve)).admitted  # 60 counted
        assert (await counters.admit("k", limits, 10, NOON, reserve)).admitted  # 70 ≤ 100: admitted, 120 counted
        refused = await counters.admit("k", limits, 10, NOON, reserve)
        assert refused.refused_by == "tpm"
        both = Settlement("both", {"k": Charge(completion_tokens=-90)})  # both produced 5 of 50
        await counters.charge_many([both], NOON)
        assert (await counters.admit("k", limits, 10, NOON, reserve)).admitted
    finally:
        with contextlib.suppress(Exception):
            await counters.aclose()  # type: ignore[union-attr]
        await redis.aclose()


def _counters(store: str, redis: Redis, prefix: str) -> RedisCounterStore | InProcessCounterStore:
    return RedisCounterStore(redis, prefix) if store == "redis" else InProcessCounterStore()


@pytest.mark.parametrize("store", ["redis", "in-process"])
async def test_a_key_and_its_tenant_are_admitted_together_or_not_at_all(store, redis_url, redis_prefix):
    redis = Redis.from_url(redis_url)
    counters = _counters(store, redis, redis_prefix)
    try:
        tenant = [("tenant:t", Limits(rpm=1))]
        assert (await counters.admit("key-a", Limits(rpm=5), 0, NOON, also=tenant)).admitted
        refused = await counters.admit("key-b", Limits(rpm=1), 0, NOON, also=tenant)
        assert (refused.refused_by, refused.refused_subject) == ("rpm", 1)  # the tenant refused ...
        assert (await counters.admit("key-b", Limits(rpm=1), 0, NOON)).admitted  # ... and key-b was not counted
        refused = await counters.admit("key-b", Limits(rpm=1), 0, NOON, also=[("tenant:t", Limits(rpm=2))])
        assert (refused.refused_by, refused.refused_subject) == ("rpm", 0)  # the key refused ...
        assert (await counters.admit("key-c", Limits(), 0, NOON, also=[("tenant:t", Limits(rpm=2))])).admitted
        refused = await counters.admit("key-c", Limits(), 0, NOON, also=[("tenant:t", Limits(rpm=2))])
        assert refused.refused_subject == 1  # ... and the tenant was not counted then: 2 of 2 only now
    finally:
        with contextlib.suppress(Exception):
            await counters.aclose()  # type: ignore[union-attr]
        await redis.aclose()


@pytest.mark.parametrize("store", ["redis", "in-process"])
async def test_parallel_streams_on_two_keys_overspend_their_tenant_by_at_most_one_reservation(
    store, redis_url, redis_prefix
):
    """The tenant's budget binds, not the keys' (they have none): both keys' streams race for it."""
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    for tier in tiers.values():
        tier.hold_after = 1
    redis = Redis.from_url(redis_url)
    counters = _counters(store, redis, redis_prefix)
    records: list = []
    settings = make_settings(tier_prices=PRICE, max_output_tokens=MAX_TOKENS)
    settings = msgspec.structs.replace(settings, tenants={"t": TenantConfig(spend_per_day_usd=BUDGET)})
    gateway = Gateway(settings, tiers, counters, records.append, Metrics(), clock=lambda: NOON)

    async def open_stream(number: int) -> tuple[object, bool]:
        state = RequestState(request_id=f"req-{number}", endpoint="chat")
        state.principal = Principal(f"key-{number % 2}", "t", "f", settings.policies["default"])
        try:
            return await gateway.chat(state, chat(stream=True, max_tokens=MAX_TOKENS)), True
        except APIError as exc:
            assert (exc.status_code, exc.code) == (429, "budget_exceeded"), exc.message
            assert f"${BUDGET}" in exc.message  # the tenant's budget refused, and the message says which
            return None, False

    try:
        opened = await asyncio.gather(*(open_stream(number) for number in range(100)))
        admitted = [reply for reply, ok in opened if ok]
        assert len(admitted) == -(-BUDGET // RESERVATION)
        # Before any settlement: the keys hold exactly the reservations the tenant holds, nothing of
        # the refused requests (all or nothing).
        keys_reserved = sum([(await counters.spent(f"key-{k}", NOON))[0] for k in (0, 1)])
        tenant_reserved, _ = await counters.spent("tenant:t", NOON)
        assert keys_reserved == pytest.approx(tenant_reserved) == pytest.approx(len(admitted) * RESERVATION)
        for tier in tiers.values():
            tier.release.set()
        await asyncio.gather(*(_consume(reply) for reply in admitted))
        await gateway.drain()
        tenant_spent, _ = await counters.spent("tenant:t", NOON)
    finally:
        with contextlib.suppress(Exception):
            await counters.aclose()  # type: ignore[union-attr]
        await redis.aclose()
    charged = sum(r.cost_usd for r in records if r.status == 200)
    assert tenant_spent == pytest.approx(charged) == pytest.approx(len(admitted) * 8 * 0.001)
    assert charged <= BUDGET + RESERVATION
