"""The cache on the request path: hits skip the tier, are accounted and streamed; replicas share entries."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import msgspec
import openai
import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from engines.api.protocol import StreamOptions
from gateway.app import create_app
from gateway.cache.service import ResponseCache
from gateway.cache.store import MemoryCacheStore, RedisCacheStore
from gateway.counters import InProcessCounterStore
from gateway.embeddings import EMBED_MODEL, EmbeddingsRequest
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from gateway.routing import Router
from router.artifact import OperatingPoint
from tests.gateway.conftest import ADMIN_KEY, EXPENSIVE, chat, loopback_socket, make_settings, served_on, start
from tests.gateway.scripted_tier import ScriptedTier

QUESTION = "How do I learn Python quickly?"


def body(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "sluice", "messages": [{"role": "user", "content": text}], "temperature": 0, **fields}


@pytest.fixture
def cached_gateway(tiers, records, models):
    def build(store=None, **policy: Any) -> Gateway:
        settings = make_settings(tier_prices=EXPENSIVE, **policy)
        cache = ResponseCache(store or MemoryCacheStore(), models)
        return Gateway(settings, tiers, InProcessCounterStore(), records.append, Metrics(), cache=cache)

    return build


async def chunks_of(stream) -> list[dict[str, Any]]:
    events = [e async for e in stream]
    assert events[-1] == b"data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


def text_in(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def text_of(reply) -> str:
    if reply.stream is None:
        return msgspec.json.decode(reply.body)["choices"][0]["message"]["content"]
    return text_in(await chunks_of(reply.stream))


async def test_a_repeated_question_is_answered_from_the_cache_and_accounted_as_saved(cached_gateway, tiers, records):
    gateway = cached_gateway()
    first = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0, max_tokens=3))
    again = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0, max_tokens=3))
    assert len(tiers["small"].requests) == 1
    assert (first.headers["x-sluice-cache"], again.headers["x-sluice-cache"]) == ("miss", "exact")
    first_answer, answer_again = json.loads(first.body), json.loads(again.body)
    assert answer_again["id"] != first_answer["id"]  # a response of its own: clients key their logs on ids
    assert {**answer_again, "id": None, "created": None} == {**first_answer, "id": None, "created": None}
    miss, hit = records
    assert (miss.cache_status, miss.cost_usd) == ("miss", pytest.approx(3.0))  # 3 tokens at $1
    assert (hit.cache_status, hit.tier, hit.cost_usd, hit.cost_saved_usd) == ("exact", None, 0.0, pytest.approx(3.0))
    assert hit.cache_similarity == 1.0
    gateway.metrics.watch_cache(gateway.cache)
    metrics = gateway.metrics.render().decode()
    assert 'sluice_cache_lookups_total{result="exact"} 1.0' in metrics
    assert "sluice_cache_saved_usd_total 3.0" in metrics
    assert "sluice_cache_in_process_entries 1.0" in metrics  # what the store holds, beside its bound
    assert 'sluice_cache_index_vectors{kind="entries"}' in metrics and "sluice_cache_index_scopes" in metrics


async def test_sampled_requests_and_cache_off_features_always_reach_the_tier(cached_gateway, tiers, records):
    gateway = cached_gateway()
    for _ in range(2):
        await gateway.chat(await start(gateway), chat(QUESTION, temperature=0.8))
    off = cached_gateway(cache="off")
    for _ in range(2):
        await off.chat(await start(off), chat(QUESTION, temperature=0))
    assert len(tiers["small"].requests) == 4
    assert {r.cache_status for r in records} == {"off"}


async def test_end_users_get_only_their_own_answers_unless_the_feature_shares_them(cached_gateway, tiers):
    apart, shared = cached_gateway(), cached_gateway(cache_per_user=False)
    for gateway in (apart, shared):
        for user in ("alice", "bob", "alice"):
            await gateway.chat(await start(gateway), chat(QUESTION, temperature=0, user=user))
    assert len(tiers["small"].requests) == 2 + 1  # apart: alice's, then bob's; shared: alice's answer for all


async def test_a_streamed_replay_equals_the_original_stream(cached_gateway, tiers):
    gateway = cached_gateway()
    streamed = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0, stream=True))
    first = await chunks_of(streamed.stream)
    original = text_in(first)
    await asyncio.sleep(0.05)  # the stream's answer is kept in the background
    replay = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0, stream=True))
    assert replay.headers["x-sluice-cache"] == "exact"
    replayed = await chunks_of(replay.stream)
    assert text_in(replayed) == original == " ".join(tiers["small"].words)
    assert len({c["id"] for c in replayed}) == 1 and replayed[0]["id"] != first[0]["id"]
    as_json = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0))
    assert as_json.headers["x-sluice-cache"] == "exact" and await text_of(as_json) == original
    assert len(tiers["small"].requests) == 1


async def test_a_stream_kept_for_the_cache_and_closed_before_it_was_read_closes_upstream(cached_gateway, tiers):
    tiers["small"].hold_after = 1
    gateway = cached_gateway()
    reply = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0, stream=True))
    await reply.stream.aclose()  # the client left before the first event
    assert tiers["small"].streams_closed_early == 1
    tiers["small"].hold_after = None
    again = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0))
    assert again.headers["x-sluice-cache"] == "miss"  # a cut stream is not kept


async def test_a_cached_stream_carries_usage_only_when_asked(cached_gateway):
    gateway = cached_gateway()
    await gateway.chat(await start(gateway), chat(QUESTION, temperature=0))
    request = chat(QUESTION, temperature=0, stream=True, stream_options=StreamOptions(include_usage=True))
    events = [e async for e in (await gateway.chat(await start(gateway), request)).stream]
    usage = [json.loads(e[6:])["usage"] for e in events if e.startswith(b"data: {") and b'"usage":{' in e]
    assert usage and usage[-1]["completion_tokens"] == 8


async def test_concurrent_identical_misses_reach_the_tier_once(cached_gateway, tiers, records):
    gateway = cached_gateway()
    tiers["small"].hold_after = 0
    calls = [asyncio.create_task(gateway.chat(await start(gateway), chat(QUESTION, temperature=0))) for _ in range(4)]
    await tiers["small"].held.wait()
    await asyncio.sleep(0.05)
    tiers["small"].release.set()
    replies = await asyncio.gather(*calls)
    assert len(tiers["small"].requests) == 1
    assert sorted(r.headers["x-sluice-cache"] for r in replies) == ["exact", "exact", "exact", "miss"]


async def test_with_redis_down_requests_are_still_served(cached_gateway, tiers, records):
    down = RedisCacheStore(Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2), "down")
    gateway = cached_gateway(store=down)
    for _ in range(2):
        reply = await gateway.chat(await start(gateway), chat(QUESTION, temperature=0))
        assert reply.headers["x-sluice-cache"] == "miss"
    assert len(tiers["small"].requests) == 2
    assert [r.cache_status for r in records] == ["bypass", "bypass"]
    await down.aclose()


async def test_two_gateways_share_the_cache_through_redis_and_the_admin_api_purges_it(
    sqlite_url, redis_url, redis_prefix
):
    settings = make_settings(database_url=sqlite_url, redis_url=redis_url)
    a_tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    b_tiers = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    a_app = create_app(settings, a_tiers, record_sink=[].append, redis_prefix=redis_prefix)
    b_app = create_app(settings, b_tiers, record_sink=[].append, redis_prefix=redis_prefix)

    def b_calls() -> int:  # whichever tier the router picks for the question
        return sum(len(tier.requests) for tier in b_tiers.values())

    async with AsyncTestClient(a_app) as a, AsyncTestClient(b_app) as b:
        first = await a.post("/v1/chat/completions", json=body(QUESTION))
        assert first.headers["x-sluice-cache"] == "miss"
        exact = await b.post("/v1/chat/completions", json=body(QUESTION))
        assert exact.headers["x-sluice-cache"] == "exact"  # the paraphrase across replicas: test_cache.py
        assert exact.json()["choices"] == first.json()["choices"]
        assert b_calls() == 0
        purged = await b.delete("/admin/cache/local", headers=admin)
        assert purged.status_code == 200 and purged.json()["purged_entries"] == 1
        assert (await a.post("/v1/chat/completions", json=body(QUESTION))).headers["x-sluice-cache"] == "miss"
        no_store = await b.post("/v1/chat/completions", json=body(QUESTION), headers={"cache-control": "no-store"})
        assert no_store.headers["x-sluice-cache"] == "miss" and b_calls() == 1
        assert (await b.delete("/admin/cache/local")).status_code == 401


async def test_embeddings_over_http_follow_the_openai_shape_and_are_accounted(sqlite_url, tiers, records):
    app = create_app(make_settings(database_url=sqlite_url), tiers, record_sink=records.append)
    async with AsyncTestClient(app) as client:
        one = (await client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "hello world"})).json()
        assert one["object"] == "list" and one["model"] == EMBED_MODEL
        assert len(one["data"][0]["embedding"]) == 384 and one["data"][0]["object"] == "embedding"
        assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] == 4  # [CLS] hello world [SEP]
        many = (await client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": ["a", "b c"]})).json()
        assert [d["index"] for d in many["data"]] == [0, 1]
        for bad, status, param in [
            ({"model": "gpt-x", "input": "a"}, 404, "model"),
            ({"model": EMBED_MODEL, "input": []}, 400, "input"),
            ({"model": EMBED_MODEL, "input": [""]}, 400, "input"),
            ({"model": EMBED_MODEL, "input": "a", "dimensions": 8}, 400, "dimensions"),
            ({"model": EMBED_MODEL, "input": 5}, 400, "input"),
            ({"model": EMBED_MODEL, "input": [[9906, 1917]]}, 400, "input"),  # token ids, as tiktoken counts them
            ({"model": EMBED_MODEL, "input": [9906, 1917]}, 400, "input"),
        ]:
            response = await client.post("/v1/embeddings", json=bad)
            assert response.status_code == status and response.json()["error"]["param"] == param, response.text
            if isinstance(bad["input"], list) and bad["input"]:
                assert ("Token-id arrays" in response.text) == (not isinstance(bad["input"][0], str))
    served = [r for r in records if r.status == 200]
    assert [(r.endpoint, r.tier, r.prompt_tokens) for r in served] == [
        ("embeddings", "embed", 4),
        ("embeddings", "embed", 7),
    ]


def test_the_openai_sdk_creates_embeddings(sqlite_url, tiers):
    app = create_app(make_settings(database_url=sqlite_url), tiers, record_sink=[].append)
    with served_on(app, loopback_socket()) as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0)
        result = sdk.embeddings.create(model=EMBED_MODEL, input=["How do I learn Python?", "Learning Python fast"])
        a, b = (d.embedding for d in result.data)
        assert len(a) == 384 and sum(x * y for x, y in zip(a, b, strict=True)) > 0.6
        assert result.usage.prompt_tokens > 0


class ThreadRecordingEmbedder:
    """The real embedding model, recording which thread counts an embeddings request's tokens."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.version, self.dim = inner, inner.version, inner.dim
        self.counted_on: list[int] = []

    def count_tokens(self, texts: list[str]) -> int:
        self.counted_on.append(threading.get_ident())
        return self.inner.count_tokens(texts)

    async def embed_async(self, texts: list[str]) -> Any:
        return await self.inner.embed_async(texts)


async def test_an_embeddings_request_is_counted_off_the_event_loop(tiers, records, embedder):
    """Its texts can be 16 MB: the loop serves other requests while the tokenizer counts them."""
    recording = ThreadRecordingEmbedder(embedder)

    async def service() -> Any:
        return recording

    gateway = Gateway(make_settings(), tiers, InProcessCounterStore(), records.append, Metrics(), embedder=service)
    reply = await gateway.embeddings(await start(gateway), EmbeddingsRequest(model=EMBED_MODEL, input=["a b", "c"]))
    assert msgspec.json.decode(reply.body)["usage"]["prompt_tokens"] == 7
    assert recording.counted_on and threading.get_ident() not in recording.counted_on


class CountingEmbedder:
    """The real embedding model, counting the texts it is asked to embed."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.version, self.dim = inner, inner.version, inner.dim
        self.texts: list[str] = []

    async def embed_async(self, texts: list[str]) -> Any:
        self.texts.extend(texts)
        return await self.inner.embed_async(texts)


class SmallArtifact:
    """A classifier that sends every prompt to the small tier, with no cascade."""

    version = "test-small"

    def score(self, embeddings: Any, prompts: list[str]) -> Any:
        assert embeddings.shape == (len(prompts), 384)
        return [0.1] * len(prompts)

    def operating_point(self, quality_target: float | None = None) -> OperatingPoint:
        return OperatingPoint(0.5, None, 0.95, 0.0, 0.0)


async def test_the_router_and_the_cache_share_one_embedding_per_request(tiers, records, embedder, mechanics_matcher):
    counting = CountingEmbedder(embedder)

    async def models() -> tuple[Any, Any]:
        return counting, mechanics_matcher

    settings = make_settings(tier_prices=EXPENSIVE)
    router = Router(settings, counting, SimpleNamespace(current=SmallArtifact()))
    cache = ResponseCache(MemoryCacheStore(), models)
    gateway = Gateway(settings, tiers, InProcessCounterStore(), records.append, Metrics(), router=router, cache=cache)
    first = await gateway.chat(await start(gateway), chat(QUESTION, model="sluice", temperature=0, max_tokens=3))
    again = await gateway.chat(await start(gateway), chat(QUESTION, model="sluice", temperature=0, max_tokens=3))
    assert (first.headers["x-sluice-route"], first.headers["x-sluice-cache"]) == ("small", "miss")
    assert again.headers["x-sluice-cache"] == "exact"
    assert counting.texts == [QUESTION, QUESTION]  # one embedding per request: the router's, read by the cache
