"""Redis faults (issue #14, items 1 and 9), on a private redis-server this test may stop: a stopped
Redis costs a clean, fast 503 (refuse mode) and service resumes when it is back; a settlement that
fails while Redis does not answer is kept (on disk) and applied once it does, never only logged; in
`local` mode each request is settled in the store that reserved it; a settlement sent again (its reply
was lost, its spool replayed twice) is applied once."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from redis.asyncio import Redis

from engines.api.errors import APIError
from gateway.accounting.spool import Spool
from gateway.charges import ChargeBatcher, SpooledCharge
from gateway.counters import (
    SETTLEMENT_ID_GRACE_S,
    Charge,
    CircuitBreakerCounterStore,
    LocalFallbackCounterStore,
    RedisCounterStore,
)
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from tests.gateway.conftest import chat, make_settings, start
from tests.gateway.scripted_tier import ScriptedTier
from tests.reliability.conftest import PrivateRedis

PRICE = {"price_input_per_mtok": 0.0, "price_output_per_mtok": 1000.0}
SUBJECT = "anonymous:local:default"


def _gateway(redis: Redis, records: list, **policy: object) -> tuple[Gateway, dict[str, ScriptedTier]]:
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    settings = make_settings(tier_prices=PRICE, **policy)
    return Gateway(settings, tiers, RedisCounterStore(redis, "fault"), records.append, Metrics()), tiers


async def test_a_stopped_redis_is_a_fast_clean_503_and_service_resumes(private_redis: PrivateRedis):
    redis = Redis.from_url(private_redis.url, socket_connect_timeout=1.0, socket_timeout=1.0)
    records: list = []
    gateway, _ = _gateway(redis, records, rpm=1000)
    try:
        await gateway.chat(await start(gateway), chat())
        private_redis.stop()
        began = time.monotonic()
        with pytest.raises(APIError) as caught:
            await gateway.chat(await start(gateway), chat())
        assert time.monotonic() - began < 2.0  # no hang past the connect timeout
        assert (caught.value.status_code, caught.value.code) == (503, "limits_unavailable")
        assert caught.value.headers["Retry-After"]
        private_redis.start()
        await gateway.chat(await start(gateway), chat())
    finally:
        await gateway.counters.aclose()  # type: ignore[attr-defined]
        await redis.aclose()
    assert [r.status for r in records] == [200, 503, 200]  # every request accounted, none lost


async def test_a_settlement_while_redis_is_blackholed_is_kept_and_applied_later(private_redis: PrivateRedis):
    redis = Redis.from_url(private_redis.url, socket_timeout=0.3)
    records: list = []
    gateway, tiers = _gateway(redis, records, spend_per_day_usd=10.0, max_output_tokens=16)
    tiers["small"].hold_after = 1
    try:
        reply = await gateway.chat(await start(gateway), chat(stream=True, max_tokens=16))
        reserved, _ = await gateway.counters.spent(SUBJECT, gateway.clock())
        assert reserved == pytest.approx(0.016)
        # Redis stops answering (the connection stays open): the settlement times out.
        subprocess.run(["redis-cli", "-p", str(private_redis.port), "CLIENT", "PAUSE", "1500", "ALL"], check=True)
        tiers["small"].release.set()
        async for _ in reply.stream:  # type: ignore[union-attr]
            pass
        await asyncio.sleep(0.5)
        assert gateway.unsettled  # kept, not dropped
        await gateway.drain(timeout_s=10)
        assert not gateway.unsettled
        spent, _ = await gateway.counters.spent(SUBJECT, gateway.clock())
    finally:
        await gateway.counters.aclose()  # type: ignore[attr-defined]
        await redis.aclose()
    assert spent == pytest.approx(records[0].cost_usd) == pytest.approx(0.008)


async def test_a_blackholed_redis_is_refused_fast_behind_the_circuit_breaker(private_redis: PrivateRedis):
    redis = Redis.from_url(private_redis.url, socket_timeout=0.3)
    records: list = []
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    breaker = CircuitBreakerCounterStore(RedisCounterStore(redis, "breaker"), open_for_s=1.0)
    gateway = Gateway(make_settings(rpm=1000), tiers, breaker, records.append, Metrics())

    async def status() -> int:
        try:
            await gateway.chat(await start(gateway), chat())
            return 200
        except APIError as exc:
            return exc.status_code

    try:
        assert await status() == 200
        subprocess.run(["redis-cli", "-p", str(private_redis.port), "CLIENT", "PAUSE", "1200", "ALL"], check=True)
        began = time.monotonic()
        assert await status() == 503  # this one waits out the read timeout (0.3 s) ...
        first = time.monotonic() - began
        began = time.monotonic()
        assert await asyncio.gather(*(status() for _ in range(50))) == [503] * 50
        rest = time.monotonic() - began  # ... the next fifty are refused at once
        assert breaker.is_open and rest < first
        await asyncio.sleep(1.5)  # Redis answers again and the window has passed: one probe closes it
        assert await status() == 200 and not breaker.is_open
    finally:
        await breaker.aclose()
        await redis.aclose()
    assert len(records) == 53  # every request accounted, refused or served


async def test_a_settlement_while_redis_is_down_is_spooled_and_applied_after_a_gateway_restart(
    private_redis: PrivateRedis, tmp_path
):
    """Redis stops (its counters saved) while a stream is in flight: the settlement goes to the spool on
    disk; this gateway stops; the next one, started once Redis is back, applies it."""
    spool = tmp_path / "charges"
    records: list = []
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    tiers["small"].hold_after = 1
    settings = make_settings(tier_prices=PRICE, spend_per_day_usd=10.0, max_output_tokens=16)

    def gateway_on(redis: Redis) -> Gateway:
        counters = RedisCounterStore(redis, "restart")
        return Gateway(settings, tiers, counters, records.append, Metrics(), charge_spool=spool)

    redis = Redis.from_url(private_redis.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    first = gateway_on(redis)
    try:
        reply = await first.chat(await start(first), chat(stream=True, max_tokens=16))
        assert (await first.counters.spent(SUBJECT, first.clock()))[0] == pytest.approx(0.016)  # reserved
        private_redis.stop(save=True)
        tiers["small"].release.set()
        async for _ in reply.stream:  # type: ignore[union-attr]
            pass
        for _ in range(100):  # the settlement fails, and is written to disk
            if list(spool.glob("*.jsonl")):
                break
            await asyncio.sleep(0.05)
        await first.drain(timeout_s=0.5)  # shutdown while Redis is still down
    finally:
        await first.counters.aclose()  # type: ignore[attr-defined]
        await redis.aclose()
    (kept,) = first.unsettled.values()  # on disk, not in memory only
    assert (kept.completion_tokens, kept.cost_usd) == (-8, pytest.approx(-0.008))
    assert list(spool.glob("*.jsonl"))

    private_redis.start()
    redis = Redis.from_url(private_redis.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    second = gateway_on(redis)
    try:
        second.charges.start()  # as the app's startup does
        await asyncio.sleep(0.1)
        await second.drain(timeout_s=10)
        spent, _ = await second.counters.spent(SUBJECT, second.clock())
    finally:
        await second.counters.aclose()  # type: ignore[attr-defined]
        await redis.aclose()
    assert spent == pytest.approx(records[0].cost_usd) == pytest.approx(0.008)  # reservation replaced, once
    assert not second.unsettled and not list(spool.glob("*.jsonl"))


async def test_in_local_mode_each_request_is_settled_where_it_was_reserved(private_redis: PrivateRedis, tmp_path):
    """One stream is admitted by Redis, then Redis stops and another is admitted in this replica's
    counters. The first one's settlement waits (spooled) for Redis; the second one's is counted locally.
    Neither store gets back a reservation it never counted."""
    redis = Redis.from_url(private_redis.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    counters = LocalFallbackCounterStore(RedisCounterStore(redis, "local-mode"), retry_interval_s=0.2)
    tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    tiers["small"].hold_after = 1
    records: list = []
    settings = make_settings(tier_prices=PRICE, spend_per_day_usd=10.0, max_output_tokens=16)
    gateway = Gateway(settings, tiers, counters, records.append, Metrics(), charge_spool=tmp_path / "charges")
    request = chat(stream=True, max_tokens=16)
    try:
        by_redis = await gateway.chat(await start(gateway), request)
        private_redis.stop(save=True)
        by_replica = await gateway.chat(await start(gateway), request)
        assert counters.using_local
        tiers["small"].release.set()
        for reply in (by_redis, by_replica):
            async for _ in reply.stream:  # type: ignore[union-attr]
                pass
        await asyncio.sleep(0.3)
        local_spent, _ = await counters.local.spent(SUBJECT, gateway.clock())
        assert local_spent == pytest.approx(0.008)  # reserved 0.016 here, settled here
        (kept,) = gateway.unsettled.values()  # the Redis-admitted one's settlement, for Redis
        assert kept.cost_usd == pytest.approx(-0.008)
        private_redis.start()
        await asyncio.sleep(0.3)
        await gateway.drain(timeout_s=10)
        redis_spent, _ = await counters.shared.spent(SUBJECT, gateway.clock())
    finally:
        await counters.shared.aclose()  # type: ignore[attr-defined]
        await redis.aclose()
    assert redis_spent == pytest.approx(0.008)  # reserved 0.016 there, settled there
    assert not gateway.unsettled
    assert [r.cost_usd for r in records] == [pytest.approx(0.008)] * 2


class ReplyDropper:
    """A TCP proxy in front of Redis that can lose a reply: the command reaches Redis and runs, and the
    client's connection is cut instead of answered (a network fault after the write)."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.drop_next = False
        self.dropped = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        redis, to_redis = await asyncio.open_connection("127.0.0.1", self.redis_port)

        async def forward_commands() -> None:
            while data := await client.read(1 << 16):
                to_redis.write(data)
            to_redis.close()

        async def forward_replies() -> None:
            while data := await redis.read(1 << 16):
                if self.drop_next:
                    self.drop_next, self.dropped = False, self.dropped + 1
                    to_client.transport.abort()
                    to_redis.close()
                    return
                to_client.write(data)
            to_client.close()

        await asyncio.gather(forward_commands(), forward_replies(), return_exceptions=True)


@pytest.mark.parametrize("kept_in", ["memory", "spool"])
async def test_a_settlement_whose_reply_was_lost_is_sent_again_and_applied_once(
    private_redis: PrivateRedis, kept_in: str, tmp_path
):
    proxy = ReplyDropper(private_redis.port)
    via_proxy, direct = Redis.from_url(await proxy.start(), socket_timeout=1.0), Redis.from_url(private_redis.url)
    spool = tmp_path / "charges" if kept_in == "spool" else None
    charges = ChargeBatcher(RedisCounterStore(via_proxy, "lost"), spool_dir=spool)
    counters = RedisCounterStore(direct, "lost")
    at = time.time()
    try:
        charges.charge("warm-up", Charge(cost_usd=1.0), at)  # Redis learns the script: the next reply is its result
        await charges.drain()
        proxy.drop_next = True
        charges.charge(SUBJECT, Charge(completion_tokens=-8, cost_usd=-0.008), at)
        for _ in range(200):
            if proxy.dropped:
                break
            await asyncio.sleep(0.01)
        assert proxy.dropped == 1
        assert (await counters.spent(SUBJECT, at))[0] == pytest.approx(-0.008)  # applied, its reply lost
        assert charges.unsettled  # so its sender keeps it, to send again
        await charges.drain(timeout_s=10)  # sent again CHARGE_RETRY_S later, and answered
        assert not charges.unsettled
        assert (await counters.spent(SUBJECT, at))[0] == pytest.approx(-0.008)  # applied once
        ttls = sorted([await direct.ttl(key) async for key in direct.scan_iter("lost:applied:*")])
        assert len(ttls) == 2 and 0 < ttls[0] <= SETTLEMENT_ID_GRACE_S < ttls[1]  # the warm-up's id forgotten
        charges.charge("after", Charge(cost_usd=1.0), at)  # its round trip has Redis forget the lost one's id
        await charges.drain()
        ttls = sorted([await direct.ttl(key) async for key in direct.scan_iter("lost:applied:*")])
        assert len(ttls) == 3 and 0 < ttls[1] <= SETTLEMENT_ID_GRACE_S < ttls[2]
    finally:
        await charges.counters.aclose()  # type: ignore[attr-defined]
        await counters.aclose()
        await via_proxy.aclose()
        await direct.aclose()
        proxy.server.close()


async def test_a_spool_replayed_twice_applies_its_settlements_once(redis_url: str, redis_prefix: str, tmp_path):
    """A gateway applies a spooled segment and stops before deleting it: the next one replays it again."""
    directory, at = tmp_path / "charges", float(int(time.time() // 60) * 60)
    spool = Spool(directory, max_bytes=1 << 20, segment_bytes=1 << 20, item_type=SpooledCharge)
    spool.append([
        SpooledCharge("k", at, -8, -0.008, settlement="s-1"),
        SpooledCharge("tenant:t", at, -8, -0.008, settlement="s-1"),
        SpooledCharge("k", at, -2, -0.002, settlement="s-2"),  # a distinct settlement of the same subject
        SpooledCharge("old", at, 0, 0.5),  # spooled by a version without ids
    ])  # fmt: skip
    spool.seal()
    (segment,) = directory.glob("*.jsonl")
    spooled = segment.read_bytes()
    redis = Redis.from_url(redis_url)
    counters = RedisCounterStore(redis, redis_prefix)
    try:
        for _ in range(2):
            segment.write_bytes(spooled)
            charges = ChargeBatcher(counters, spool_dir=directory)
            charges.start()
            await charges.drain(timeout_s=10)
            assert not list(directory.glob("*.jsonl")) and not charges.unsettled
        spent = [(await counters.spent(subject, at))[0] for subject in ("k", "tenant:t", "old")]
    finally:
        await counters.aclose()
        await redis.aclose()
    assert spent == [pytest.approx(-0.01), pytest.approx(-0.008), pytest.approx(0.5)]
