"""The response cache as a specification: what may be served from it, to whom, for how long."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
import pytest

from engines.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JSONSchemaFormat,
    ResponseFormat,
    Usage,
)
from gateway.cache.service import CachePolicy, Lookup, ResponseCache
from gateway.cache.store import RedisCacheStore

SEMANTIC = CachePolicy(mode="semantic", ttl_s=60)
EXACT = CachePolicy(mode="exact", ttl_s=60)
WHO = {"tenant": "acme", "feature": "search", "endpoint": "chat", "tier": "small"}


def ask(text: str, system: str | None = None, **fields: Any) -> ChatCompletionRequest:
    messages = [ChatMessage(role="system", content=system)] if system else []
    fields.setdefault("temperature", 0)
    return ChatCompletionRequest(model="sluice", messages=[*messages, ChatMessage(role="user", content=text)], **fields)


def answer(text: str) -> bytes:
    choice = ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason="stop")
    return msgspec.json.encode(
        ChatCompletion(id="c1", created=1, model="small", choices=[choice], usage=Usage.of(5, 3))
    )


async def put(
    cache: ResponseCache, request: ChatCompletionRequest, text: str, policy: CachePolicy = SEMANTIC, **who: str
) -> Lookup:
    lookup = await cache.begin(request, policy, **{**WHO, **who})
    assert lookup.status == "miss" and lookup.leader
    await cache.store(lookup, answer(text), cost_usd=0.002)
    return lookup


async def get(
    cache: ResponseCache, request: ChatCompletionRequest, policy: CachePolicy = SEMANTIC, **who: str
) -> Lookup:
    lookup = await cache.begin(request, policy, **{**WHO, **who})
    cache.release(lookup)
    return lookup


async def test_the_same_request_is_an_exact_hit_and_a_paraphrase_a_semantic_one(store, make_cache):
    cache = make_cache(store)
    await put(cache, ask("How do I learn Python quickly?"), "Practice daily.")
    exact = await get(cache, ask("How do I learn Python quickly?"))
    assert exact.status == "exact" and exact.hit.similarity == 1.0
    assert msgspec.json.decode(exact.hit.entry.body)["choices"][0]["message"]["content"] == "Practice daily."
    assert exact.hit.entry.cost_usd == 0.002
    paraphrase = await get(cache, ask("What is the fastest way to learn Python?"))
    assert paraphrase.status == "semantic" and 0.5 < paraphrase.hit.similarity < 1.0


async def test_a_different_question_on_the_same_topic_is_not_served(store, make_cache):
    cache = make_cache(store)
    await put(cache, ask("How do I learn Python quickly?"), "Practice daily.")
    assert (await get(cache, ask("How do I learn Java quickly?"))).status == "miss"
    assert (await get(cache, ask("How do I uninstall Python on Windows?"))).status == "miss"


@pytest.mark.parametrize(
    ("change", "who"),
    [
        ({}, {"tenant": "globex"}),
        ({}, {"feature": "chat"}),
        ({}, {"tier": "large"}),
        ({}, {"endpoint": "completions"}),
        ({"system": "Answer in French."}, {}),
        ({"max_tokens": 7}, {}),
        ({"top_p": 0.5}, {}),
        ({"seed": 3}, {}),
        ({"stop": ["\n"]}, {}),
        ({"model": "sluice-large"}, {}),
        ({"user": "someone-else"}, {}),
        ({"response_format": ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name="r", schema={"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}))},
         {}),
    ],
)
async def test_nothing_is_ever_served_across_scopes(store, make_cache, change, who):
    cache = make_cache(store)
    await put(cache, ask("How do I learn Python quickly?"), "Practice daily.")
    text = "How do I learn Python quickly?"
    for question in (text, "What is the fastest way to learn Python?"):  # exact and semantic
        fields = dict(change)
        if "model" in fields:
            request = ask(question, **{k: v for k, v in fields.items() if k != "model"})
            request.model = fields["model"]
        else:
            request = ask(question, **fields)
        assert (await get(cache, request, **who)).status == "miss"


async def test_a_gap_to_fill_is_served_only_to_the_same_prompt_and_suffix(store, make_cache):
    """Fill in the middle: the gap's text depends on every character around it, so no semantic match."""
    def fill(prompt: str, suffix: str | None) -> CompletionRequest:
        return CompletionRequest(model="sluice", prompt=prompt, suffix=suffix, temperature=0)

    cache, completions = make_cache(store), {"endpoint": "completions"}
    question, paraphrase = "How do I learn Python quickly?", "What is the fastest way to learn Python?"
    await put(cache, fill(question, None), "Practice daily.", **completions)
    assert (await get(cache, fill(paraphrase, None), **completions)).status == "semantic"  # without a suffix
    await put(cache, fill(question, "\nThat is all."), "Practice daily.", **completions)
    assert (await get(cache, fill(question, "\nThat is all."), **completions)).status == "exact"
    assert (await get(cache, fill(question, "\nThat is it."), **completions)).status == "miss"
    assert (await get(cache, fill(paraphrase, "\nThat is all."), **completions)).status == "miss"


async def test_a_schema_with_its_properties_in_another_order_asks_for_another_answer(store, make_cache):
    """The properties' order is the order of the answer's keys (OpenAI's structured outputs, our grammar)."""
    def ask_for(*names: str) -> ChatCompletionRequest:
        schema = {"type": "object", "properties": {name: {"type": "string"} for name in names}}
        response_format = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="r", schema=schema))
        return ask("Name a city and its country.", response_format=response_format)

    cache = make_cache(store)
    await put(cache, ask_for("city", "country"), '{"city":"Paris","country":"France"}', policy=EXACT)
    assert (await get(cache, ask_for("city", "country"), policy=EXACT)).status == "exact"
    assert (await get(cache, ask_for("country", "city"), policy=EXACT)).status == "miss"


async def test_each_end_user_has_their_own_answers_unless_the_feature_shares_them(store, make_cache):
    """An answer may quote what its user asked, so by default the user a request names (`user`, else
    `safety_identifier`) is part of its scope; fields that only attribute a request (metadata) are not."""
    cache = make_cache(store)
    await put(cache, ask("How do I learn Rust quickly?", user="alice", metadata={"trace": "1"}), "Read the book.")
    again = ask("How do I learn Rust quickly?", user="alice", metadata={"trace": "2"})
    assert (await get(cache, again)).status == "exact"
    for someone_else in ({"user": "bob"}, {"safety_identifier": "bob"}, {}):
        for question in ("How do I learn Rust quickly?", "What is the fastest way to learn Rust?"):
            assert (await get(cache, ask(question, **someone_else))).status == "miss"

    shared = CachePolicy(mode="semantic", ttl_s=60, per_user=False)
    await put(cache, ask("How do I learn Python quickly?", user="alice"), "Practice daily.", policy=shared)
    for request in (ask("How do I learn Python quickly?", user="bob"),
                    ask("What is the fastest way to learn Python?", safety_identifier="carol")):
        assert (await get(cache, request, policy=shared)).status in ("exact", "semantic")


async def test_earlier_turns_are_part_of_the_scope(store, make_cache):
    cache = make_cache(store)
    first = ask("And in Python?")
    first.messages.insert(0, ChatMessage(role="user", content="How do I reverse a list in Java?"))
    await put(cache, first, "Use reversed().")
    other = ask("And in Python?")
    other.messages.insert(0, ChatMessage(role="user", content="How do I open a file in Java?"))
    assert (await get(cache, other)).status == "miss"


async def test_a_long_question_is_served_only_by_the_exact_tier(store, make_cache):
    """Two long prompts that share what the models read (the embedder's 256 tokens, the matcher's few dozen)
    and differ after it would look the same to both: a question the matcher cannot read whole is exact-only."""
    policy = ("You are the support assistant of ACME Corp. Answer the customer's question using only the policy "
              "below. Be brief and polite, and never promise refunds that the policy does not allow. ") + " ".join(
        f"Section {i}: orders placed on a business day ship within {i % 5 + 1} days, and returns are accepted for "
        f"{10 + i} days when the item is unused." for i in range(30))
    cache = make_cache(store)
    await put(cache, ask(f"{policy} Question: Can I return an opened laptop?"), "No.")
    assert (await get(cache, ask(f"{policy} Question: How do I change my delivery address?"))).status == "miss"
    assert (await get(cache, ask(f"{policy} Question: Can I return an opened laptop?"))).status == "exact"


async def test_only_deterministic_requests_are_eligible_unless_the_feature_opts_in(store, make_cache):
    cache = make_cache(store)
    sampled = ask("How do I learn Python quickly?", temperature=0.7)
    assert (await cache.begin(sampled, SEMANTIC, **WHO)).status == "off"
    assert (await cache.begin(ask("x", temperature=None), SEMANTIC, **WHO)).status == "off"
    assert (await get(cache, ask("x", temperature=0.7, top_p=0))).status == "miss"  # greedy too: a lookup
    opted_in = CachePolicy(mode="semantic", ttl_s=60, nondeterministic=True)
    await put(cache, sampled, "Practice daily.", opted_in)
    assert (await get(cache, sampled, opted_in)).status == "exact"


async def test_cache_control_no_store_and_no_cache(store, make_cache):
    cache = make_cache(store)
    request = ask("How do I learn Python quickly?")
    assert (await cache.begin(request, SEMANTIC, control="no-store", **WHO)).status == "off"
    fresh = await cache.begin(request, SEMANTIC, control="no-cache", **WHO)
    assert fresh.status == "miss" and fresh.leader  # not read, but the fresh answer is kept
    await cache.store(fresh, answer("Practice daily."), 0.001)
    assert (await cache.begin(request, SEMANTIC, control="no-cache", **WHO)).status == "miss"
    assert (await get(cache, request)).status == "exact"
    assert (await get(cache, ask("What is the fastest way to learn Python?"))).status == "semantic"  # kept whole


async def test_exact_mode_never_serves_a_paraphrase_and_off_mode_nothing(store, make_cache):
    cache = make_cache(store)
    exact_only = CachePolicy(mode="exact", ttl_s=60)
    await put(cache, ask("How do I learn Python quickly?"), "Practice daily.", exact_only)
    assert (await get(cache, ask("How do I learn Python quickly?"), exact_only)).status == "exact"
    assert (await get(cache, ask("What is the fastest way to learn Python?"), exact_only)).status == "miss"
    assert (await get(cache, ask("How do I learn Python quickly?"), CachePolicy("off", 60))).status == "off"


async def test_entries_expire_after_the_feature_ttl(store, make_cache):
    cache = make_cache(store)
    short = CachePolicy(mode="semantic", ttl_s=0.3)
    await put(cache, ask("How do I learn Python quickly?"), "Practice daily.", short)
    assert (await get(cache, ask("What is the fastest way to learn Python?"), short)).status == "semantic"
    await asyncio.sleep(0.45)
    assert (await get(cache, ask("How do I learn Python quickly?"), short)).status == "miss"
    assert (await get(cache, ask("What is the fastest way to learn Python?"), short)).status == "miss"


async def test_a_full_scope_evicts_its_oldest_entries(store, make_cache):
    cache = make_cache(store, max_entries_per_scope=2)
    questions = ["How do I learn Python quickly?", "What is the capital of France?", "How do I bake bread?"]
    for q in questions:
        await put(cache, ask(q), f"answer to {q}")
    assert (await get(cache, ask(questions[0]))).status == "miss"
    assert (await get(cache, ask("What is the fastest way to learn Python?"))).status == "miss"
    assert [(await get(cache, ask(q))).status for q in questions[1:]] == ["exact", "exact"]


async def test_purge_removes_a_tenants_entries_and_only_theirs(store, make_cache):
    cache = make_cache(store)
    await put(cache, ask("How do I learn Python quickly?"), "a", tenant="acme")
    await put(cache, ask("How do I learn Python quickly?"), "b", tenant="acme", feature="chat")
    await put(cache, ask("How do I learn Python quickly?"), "c", tenant="globex")
    assert (await get(cache, ask("What is the fastest way to learn Python?"))).status == "semantic"
    assert await cache.purge("acme", "search") == 1
    assert (await get(cache, ask("How do I learn Python quickly?"))).status == "miss"
    assert (await get(cache, ask("What is the fastest way to learn Python?"))).status == "miss"
    assert (await get(cache, ask("How do I learn Python quickly?"), feature="chat")).status == "exact"
    assert await cache.purge("acme") == 1
    assert (await get(cache, ask("How do I learn Python quickly?"), feature="chat")).status == "miss"
    assert (await get(cache, ask("How do I learn Python quickly?"), tenant="globex")).status == "exact"


async def test_two_replicas_share_entries_ttl_eviction_and_purge(shared_stores, make_cache):
    stores = shared_stores
    a, b = make_cache(stores(), max_entries_per_scope=2), make_cache(stores(), max_entries_per_scope=2)
    await put(a, ask("How do I learn Python quickly?"), "Practice daily.")
    assert (await get(b, ask("What is the fastest way to learn Python?"))).status == "semantic"
    await put(b, ask("What is the capital of France?"), "Paris.")
    assert (await get(a, ask("Which city is the capital of France?"))).status == "semantic"
    await put(a, ask("How do I bake bread?"), "Knead.")  # evicts the Python entry, seen by b's index
    assert (await get(b, ask("What is the fastest way to learn Python?"))).status == "miss"
    await a.purge("acme")
    assert (await get(b, ask("Which city is the capital of France?"))).status == "miss"


async def test_a_replica_that_fell_behind_the_trimmed_log_reloads_its_index(redis_stores, make_cache):
    writer = redis_stores()
    writer.log_length = 3
    a = make_cache(writer)
    b = make_cache(redis_stores())
    await put(a, ask("What is the capital of France?"), "Paris.")
    assert (await get(b, ask("Which city is the capital of France?"))).status == "semantic"
    for i in range(300):  # far past the log length: b's cursor is trimmed away
        lookup = await a.begin(ask(f"What is {i} plus {i}?"), SEMANTIC, **WHO)
        if lookup.leader:
            await a.store(lookup, answer(str(2 * i)), 0.001)
    await put(a, ask("How do I learn Python quickly?"), "Practice daily.")
    assert (await get(b, ask("What is the fastest way to learn Python?"))).status == "semantic"
    assert (await get(b, ask("Which city is the capital of France?"))).status == "semantic"


async def test_the_store_uses_vector_sets_where_redis_has_them_and_replica_indexes_where_not(redis_url, redis8_url):
    from redis.asyncio import Redis

    plain, with_sets = Redis.from_url(redis_url), Redis.from_url(redis8_url)
    version = (await plain.info("server"))["redis_version"]
    assert await RedisCacheStore(plain, "probe").uses_vector_sets() is (int(version.split(".")[0]) >= 8)
    assert await RedisCacheStore(with_sets, "probe").uses_vector_sets() is True
    assert await RedisCacheStore(plain, "probe").nearest("scope", np.ones(4, np.float32), 2, 0.0) is (
        None if int(version.split(".")[0]) < 8 else [])
    await plain.aclose()
    await with_sets.aclose()


async def test_with_vector_sets_redis_searches_and_replicas_keep_no_index(vector_set_stores, make_cache):
    store = vector_set_stores()
    a, b = make_cache(store, max_entries_per_scope=2), make_cache(vector_set_stores(), max_entries_per_scope=2)
    first = await put(a, ask("How do I learn Python quickly?"), "Practice daily.")
    vector_set = store._scope(first.key.scope, "vs")
    assert await store.redis.execute_command("VCARD", vector_set) == 1
    hit = await get(b, ask("What is the fastest way to learn Python?"))
    assert hit.status == "semantic" and 0.6 < hit.hit.similarity < 1.0
    assert a._replicas == {} and b._replicas == {}  # nothing searched in process
    await put(a, ask("What is the capital of France?"), "Paris.")
    await put(a, ask("How do I bake bread?"), "Knead.")  # evicts the Python entry: its vector goes too
    assert await store.redis.execute_command("VCARD", vector_set) == 2
    await a.purge("acme")
    assert await store.redis.exists(vector_set) == 0


async def test_entries_that_expired_neither_shorten_the_scope_nor_hide_a_live_match(shared_stores, make_cache):
    """Two short-lived entries nearer the query than a live one: once they expire (and no put has dropped them
    yet) a new replica still finds the live one."""
    cache = make_cache(shared_stores())
    brief = CachePolicy(mode="semantic", ttl_s=0.05)
    for text, answer_text, policy in [("How do I learn Python quickly?", "Practice daily.", SEMANTIC),  # lives on
                                      ("What is the fastest way to learn Python?", "Build things.", brief),
                                      ("What's the quickest way to learn Python?", "Read code.", brief)]:
        lookup = await cache.begin(ask(text), policy, **WHO, control="no-cache")  # stored, never looked up
        await cache.store(lookup, answer(answer_text), cost_usd=0.002)
    await asyncio.sleep(0.2)  # two expire; no put since, so their vectors are still the query's nearest two
    hit = await get(make_cache(shared_stores()), ask("What's the quickest way to learn Python?"))
    assert hit.status == "semantic" and b"Practice daily." in hit.hit.entry.body


async def test_redis_down_means_the_cache_is_bypassed_not_an_error(make_cache):
    from redis.asyncio import Redis

    closed_port = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    cache = make_cache(RedisCacheStore(closed_port, "down"), retry_after_s=30)
    lookup = await cache.begin(ask("How do I learn Python quickly?"), SEMANTIC, **WHO)
    assert lookup.status == "bypass" and not lookup.leader
    # Within retry_after_s the store is not even tried again.
    assert (await cache.begin(ask("How do I learn Python quickly?"), SEMANTIC, **WHO)).status == "bypass"
    await cache.aclose()


async def test_identical_concurrent_misses_wait_for_the_first(store, make_cache):
    cache = make_cache(store)
    request = ask("How do I learn Python quickly?")
    leader = await cache.begin(request, SEMANTIC, **WHO)
    assert leader.leader
    followers = [asyncio.create_task(cache.begin(request, SEMANTIC, **WHO)) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert not any(f.done() for f in followers)  # waiting, not generating
    await cache.store(leader, answer("Practice daily."), 0.002)
    assert [(await f).status for f in followers] == ["exact"] * 5


async def test_followers_generate_themselves_when_the_leader_fails(store, make_cache):
    cache = make_cache(store)
    request = ask("How do I learn Python quickly?")
    leader = await cache.begin(request, SEMANTIC, **WHO)
    follower = asyncio.create_task(cache.begin(request, SEMANTIC, **WHO))
    await asyncio.sleep(0.02)
    cache.release(leader)  # the tier failed: nothing to store
    assert (await follower).status == "miss"
