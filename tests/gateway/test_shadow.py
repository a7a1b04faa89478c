"""Shadow runs: the large tier answers sampled small-served requests in the background, never on the
request path, bounded, dropped under load, written to `shadow_runs` and read back as training rows."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import msgspec
import numpy as np
import pytest
import sqlalchemy as sa

from gateway.config import RouterConfig
from gateway.counters import InProcessCounterStore
from gateway.db.database import make_database
from gateway.db.schema import shadow_runs
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from gateway.shadow import ShadowSampler, training_rows_from_db
from router.shadow import EMBEDDING, FINAL_ANSWER, agreement, cosine, training_rows
from tests.gateway.conftest import chat, make_settings, start


class UnitEmbedder:
    async def embed_async(self, texts: list[str]) -> np.ndarray:
        return np.array([[1.0, 0.0] if "yes" in t else [0.6, 0.8] for t in texts], dtype=np.float32)


@pytest.fixture
async def db(sqlite_url: str):
    engine = make_database(sqlite_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def shadow_gateway(tiers, records, db):
    tiers["small"].words = ["so", "the", "answer", "####", "4"]
    tiers["large"].words = ["####", "4"]

    def build(rate: float = 1.0, concurrency: int = 2) -> Gateway:
        settings = make_settings(shadow_rate=rate)
        settings = msgspec.structs.replace(settings, router=RouterConfig(shadow_concurrency=concurrency))
        metrics = Metrics()
        sampler = ShadowSampler(settings, tiers, db, metrics, UnitEmbedder())
        return Gateway(settings, tiers, InProcessCounterStore(), records.append, metrics, shadow=sampler)

    return build


def shadow_count(gateway: Gateway, outcome: str) -> float:
    return gateway.metrics.registry.get_sample_value("sluice_shadow_runs_total", {"outcome": outcome}) or 0.0


async def rows(db) -> list[sa.Row]:
    async with db.connect() as connection:
        return list(await connection.execute(sa.select(shadow_runs)))


async def test_the_response_returns_while_the_shadow_call_is_still_blocked(shadow_gateway, tiers, db, records):
    gateway = shadow_gateway()
    tiers["large"].hold_after = 0  # the large tier blocks every answer until released
    reply = await asyncio.wait_for(gateway.chat(await start(gateway), chat("what is 2+2", max_tokens=5)), 1.0)
    assert reply.headers["x-sluice-tier"] == "small"
    await asyncio.wait_for(tiers["large"].held.wait(), 1.0)  # the shadow is running, and blocked
    assert len(records) == 1 and await rows(db) == []
    tiers["large"].release.set()
    await asyncio.gather(*gateway.shadow.tasks)
    (row,) = await rows(db)
    assert (row.small_answer, row.large_answer) == ("so the answer #### 4", "#### 4")
    assert (row.agreement, row.agreement_method, row.prompt) == (1.0, FINAL_ANSWER, "what is 2+2")
    assert row.request_id == records[0].request_id
    assert shadow_count(gateway, "recorded") == 1


async def test_a_stream_served_by_small_is_shadowed_with_its_text(shadow_gateway, tiers, db):
    gateway = shadow_gateway()
    reply = await gateway.chat(await start(gateway), chat("q", stream=True, max_tokens=5))
    _ = [event async for event in reply.stream]
    await asyncio.gather(*gateway.shadow.tasks)
    (row,) = await rows(db)
    assert row.small_answer == "so the answer #### 4"
    assert tiers["large"].requests[0].stream is False


async def test_shadows_beyond_the_concurrency_bound_are_dropped_and_counted(shadow_gateway, tiers, db):
    gateway = shadow_gateway(concurrency=1)
    tiers["large"].hold_after = 0
    await gateway.chat(await start(gateway), chat("first", max_tokens=5))
    await asyncio.wait_for(tiers["large"].held.wait(), 1.0)
    reply = await asyncio.wait_for(gateway.chat(await start(gateway), chat("second", max_tokens=5)), 1.0)
    assert reply.headers["x-sluice-tier"] == "small"
    assert shadow_count(gateway, "dropped") == 1
    assert len(tiers["large"].requests) == 1  # the second was never sent
    tiers["large"].release.set()
    await asyncio.gather(*gateway.shadow.tasks)
    assert [row.prompt for row in await rows(db)] == ["first"]


async def test_unsampled_and_large_served_requests_are_not_shadowed(shadow_gateway, tiers, db):
    gateway = shadow_gateway(rate=0.0)
    await gateway.chat(await start(gateway), chat("q", max_tokens=5))
    gateway = shadow_gateway(rate=1.0)
    await gateway.chat(await start(gateway), chat("q", model="sluice-large", max_tokens=5))
    assert tiers["large"].requests[0].model == "sluice-large"  # only the request itself
    assert len(tiers["large"].requests) == 1 and not gateway.shadow.tasks


async def test_a_failed_shadow_is_counted_and_never_reaches_the_client(shadow_gateway, tiers, db):
    gateway = shadow_gateway()
    tiers["large"].down = True
    reply = await gateway.chat(await start(gateway), chat("q", max_tokens=5))
    assert reply.headers["x-sluice-tier"] == "small"
    await asyncio.gather(*gateway.shadow.tasks)
    assert shadow_count(gateway, "failed") == 1 and await rows(db) == []


async def test_shadow_runs_become_training_rows_with_the_large_answer_as_reference(
    shadow_gateway, tiers, db, sqlite_url
):
    gateway = shadow_gateway()
    await gateway.chat(await start(gateway), chat("agree", max_tokens=5))
    await asyncio.gather(*gateway.shadow.tasks)
    tiers["large"].words = ["####", "5"]
    await gateway.chat(await start(gateway), chat("disagree", max_tokens=5))
    await asyncio.gather(*gateway.shadow.tasks)
    loaded = await training_rows_from_db(sqlite_url)
    assert sorted((r.prompt, r.small_score, r.large_score) for r in loaded) == [
        ("agree", 1.0, 1.0),
        ("disagree", 0.0, 1.0),
    ]
    assert await training_rows_from_db(sqlite_url, since=datetime.now(UTC) + timedelta(hours=1)) == []


def test_agreement_is_the_final_number_match_when_both_state_one():
    assert agreement("x = 3\n#### 12", "so 12 in total") == agreement("12", "#### 12.0")
    assert agreement("#### 1,200", "1200").score == 1.0
    assert agreement("#### 7", "#### 8").score == 0.0
    assert agreement("#### 7", "#### 8").method == FINAL_ANSWER


def test_agreement_falls_back_to_embedding_cosine_without_final_numbers():
    u, v = np.array([1.0, 0.0]), np.array([0.6, 0.8])
    assert agreement("yes", "sure", None) is None
    result = agreement("yes", "sure", (u, v))
    assert (result.score, result.method) == (pytest.approx(0.6), EMBEDDING)
    assert cosine(np.array([1.0, 0.0]), np.array([-1.0, 0.0])) == 0.0


def test_training_rows_take_the_agreement_as_small_score():
    (row,) = training_rows([("p", 0.25)])
    assert (row.prompt, row.small_score, row.large_score) == ("p", 0.25, 1.0)
