"""Semantic cache benchmark: (a) match quality, (b) lookup latency, (c) end to end through the gateway.

(a) On labelled question pairs (default: the held-out test split of the QQP pairs the matcher never
    saw): the false-hit rate (false hits / negative pairs) and recall (hits / positive pairs) of our
    rule (cosine ≥ the matcher's floor, then the matcher ≥ its shipped threshold, both from meta.json,
    never tuned here) against cosine-only with its threshold tuned on the same pairs for the same
    false-hit rate (an oracle threshold: the baseline's best case).
(b) `ResponseCache.begin` per lookup, embedding and matcher included, with 1k, 10k and 100k entries in
    one scope (in-process store, and each `--redis-url` that is reachable: a Redis 7 searched through the
    replica's index, a Redis 8 through its vector sets), one lookup at a time and 32 at once. Half the
    queries are paraphrases of stored questions, half are new questions. `--embedding-precision float32`
    runs (a) and (b) on the float32 graph, the baseline of the int8 one a CPU gateway runs.
(c) The gateway app over HTTP (ASGI) with both tiers on a fake upstream that streams at 20 ms a
    token: held-out question pairs asked once, then their paraphrases and some repeats.

    python bench/semcache.py [--quality-only] [--data PAIRS.jsonl.gz] [--out FIGURES.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # `python bench/semcache.py`: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cpu_model, percentile, print_table, write_results
from gateway.cache.pairs import DEFAULT_PAIRS, Pair, load_pairs, split_pairs
from gateway.cache.verifier import MATCHER_DIR, Matcher, pick_threshold, rates_at

TARGET_FHR = 0.01
EMBEDDING_PRECISION: str | None = None  # --embedding-precision; None: the gateway's choice for this machine
TARGETS = {
    "false_hit_rate_max": TARGET_FHR,
    "recall_ratio_min": 2.0,
    "lookup_p50_ms_max": 5.0,
    "lookup_p99_ms_max": 15.0,
}


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def eval_pairs(data: Path, matcher: Matcher, split: str) -> tuple[list[Pair], str]:
    pairs = load_pairs(data)
    trained_on = matcher.meta.get("data_sha256")
    if split == "validation":
        return split_pairs(pairs)["validation"], "validation (the matcher's operating point was chosen on it)"
    if split == "test" or (split == "auto" and trained_on == file_digest(data)):
        return split_pairs(pairs)["test"], "test (held out: no question of it was trained or tuned on)"
    return pairs, "all pairs of the file"


def embed_all(embedder: Any, texts: list[str], batch: int = 128) -> dict[str, np.ndarray]:
    unique = sorted(set(texts))
    vectors = [embedder.embed(unique[i : i + batch]) for i in range(0, len(unique), batch)]
    return dict(zip(unique, np.concatenate(vectors), strict=True))


def quality(data: Path, matcher: Matcher, split: str) -> dict[str, Any]:
    from router.embedding import Embedder

    pairs, described = eval_pairs(data, matcher, split)
    labels = np.array([p.label for p in pairs])
    embedder = Embedder.load(precision=EMBEDDING_PRECISION)
    vectors = embed_all(embedder, [t for p in pairs for t in (p.text_a, p.text_b)])
    cosine = np.array([float(vectors[p.text_a] @ vectors[p.text_b]) for p in pairs])
    shown = np.flatnonzero(cosine >= matcher.floor)  # only these reach the matcher, as in the cache
    scores = np.zeros(len(pairs), dtype=np.float32)
    probabilities = matcher.score_many([pairs[i].text_a for i in shown], [pairs[i].text_b for i in shown])
    scores[shown] = matcher.rule_score(probabilities, cosine[shown])
    ours_fhr, ours_recall = rates_at(np.where(cosine >= matcher.floor, scores, -1.0), labels, matcher.threshold)
    matcher_scores = np.full(len(pairs), -1.0, dtype=np.float32)
    matcher_scores[shown] = probabilities
    cos_threshold, cos_fhr, cos_recall = pick_threshold(cosine, labels, ours_fhr)
    ref_threshold, ref_fhr, ref_recall = pick_threshold(cosine, labels, TARGET_FHR)
    return {
        "embedder": embedder.version,
        "pairs": len(pairs),
        "positives": int(labels.sum()),
        "negatives": int((1 - labels).sum()),
        "split": described,
        "data": str(data),
        "matcher_version": matcher.version,
        "cosine_only": {"false_hit_rate": cos_fhr, "recall": cos_recall, "threshold": cos_threshold},
        "ours": {
            "false_hit_rate": ours_fhr,
            "recall": ours_recall,
            "threshold": matcher.threshold,
            "cosine_floor": matcher.floor,
            "rule": "cosine >= cosine_floor and rule score >= threshold (meta.json: threshold, floor, combine)",
            "combine": matcher.combine,
        },
        "recall_ratio": ours_recall / cos_recall if cos_recall else float("inf"),
        "cosine_only_at_1pct_fhr": {"false_hit_rate": ref_fhr, "recall": ref_recall, "threshold": ref_threshold},
        "recall_ratio_vs_cosine_at_1pct_fhr": ours_recall / ref_recall if ref_recall else float("inf"),
        # How well each score orders the pairs, whatever the threshold: recall at each false-hit rate with the
        # best threshold for it (the matcher's probability, below the cosine floor -1 as in the cache).
        "ranking": {"cosine": ranking(cosine, labels), "matcher": ranking(matcher_scores, labels)},
        "targets_met": {
            "false_hit_rate": ours_fhr <= TARGET_FHR,
            "recall_ratio": (ours_recall / cos_recall if cos_recall else 0.0) >= 2.0,
        },
    }


RANKING_FHRS = (0.005, 0.01, 0.02, 0.05)


def ranking(scores: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    from sklearn.metrics import roc_auc_score

    recall = {f"{fhr:.3f}": pick_threshold(scores, labels, fhr)[2] for fhr in RANKING_FHRS}
    return {"auc": float(roc_auc_score(labels, scores)), "recall_at_false_hit_rate": recall}


def print_quality(q: dict[str, Any]) -> None:
    rows = [
        [
            "cosine only (oracle threshold, same FHR)",
            q["cosine_only"]["false_hit_rate"],
            q["cosine_only"]["recall"],
            q["cosine_only"]["threshold"],
        ],
        [
            "cosine only (oracle threshold, FHR <= 1%)",
            q["cosine_only_at_1pct_fhr"]["false_hit_rate"],
            q["cosine_only_at_1pct_fhr"]["recall"],
            q["cosine_only_at_1pct_fhr"]["threshold"],
        ],
        [
            "ours (cosine floor + matcher, shipped)",
            q["ours"]["false_hit_rate"],
            q["ours"]["recall"],
            q["ours"]["threshold"],
        ],
    ]
    print_table(
        f"(a) match quality on {q['pairs']} pairs, {q['split']}",
        ["rule", "false-hit rate", "recall", "threshold"],
        rows,
    )
    print(f"recall ratio ours / cosine-only at the same false-hit rate: {q['recall_ratio']:.2f}x")
    rank_rows = [
        [name, r["auc"], *r["recall_at_false_hit_rate"].values()] for name, r in q["ranking"].items()
    ]
    print_table(
        "ranking (recall at the best threshold for each false-hit rate)",
        ["score", "AUC", *(f"recall @ {fhr:.1%}" for fhr in RANKING_FHRS)],
        rank_rows,
    )


# --- (b) lookup latency ---------------------------------------------------------------------------


def _request(text: str) -> Any:
    from engines.api.protocol import ChatCompletionRequest, ChatMessage

    return ChatCompletionRequest(model="sluice", messages=[ChatMessage(role="user", content=text)], temperature=0)


async def _fill(cache: Any, scope: Any, size: int, texts: list[str], vectors: np.ndarray, seed: int) -> None:
    """`size` entries in one scope: the real questions first, then noisy copies of them (cosine ≈ 0.85)."""
    from gateway.cache.keys import cache_key
    from gateway.cache.store import Entry

    rng = np.random.default_rng(seed)
    body = json.dumps({"choices": [{"message": {"content": "cached"}}]}).encode()
    pending = []
    for i in range(size):
        j = i % len(texts)
        vector = vectors[j]
        if i >= len(texts):
            vector = vector + rng.standard_normal(vector.shape).astype(np.float32) * 0.031
            vector /= np.linalg.norm(vector)
        text = texts[j] if i < len(texts) else f"{texts[j]} ({i})"
        key = cache_key(_request(text), **scope.who, versions=scope.versions)
        entry = Entry(body, "chat", text, 0.001, time.time())
        pending.append(cache.backend.put(scope.ref(key.scope), key.exact, entry, 3600.0, vector, size))
        if len(pending) == 32:  # a connection each, within redis-py's pool
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)


class _Scope:
    def __init__(self, versions: str) -> None:
        self.who = {"tenant": "bench", "feature": "latency", "endpoint": "chat", "tier": "small"}
        self.versions = versions

    def ref(self, scope_id: str) -> Any:
        from gateway.cache.store import ScopeRef

        return ScopeRef(scope_id, "bench", "latency")


async def _time_lookups(cache: Any, queries: list[str], concurrency: int) -> list[float]:
    from gateway.cache.service import CachePolicy

    policy = CachePolicy("semantic", 3600.0)
    who = {"tenant": "bench", "feature": "latency", "endpoint": "chat", "tier": "small"}
    timings: list[float] = []
    queue = list(queries)

    async def worker() -> None:
        while queue:
            request = _request(queue.pop())
            started = time.perf_counter()
            lookup = await cache.begin(request, policy, **who)
            timings.append((time.perf_counter() - started) * 1000)
            cache.release(lookup)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings


async def latency(data: Path, sizes: list[int], n_queries: int, redis_urls: list[str], redis_max: int,
                  matcher: Matcher) -> dict[str, Any]:
    from gateway.cache.service import ResponseCache
    from gateway.cache.store import CacheUnavailable, MemoryCacheStore, RedisCacheStore
    from router.embedding import Embedder, hold_numpy_blas_to_one_thread

    embedder = Embedder.load(precision=EMBEDDING_PRECISION)
    hold_numpy_blas_to_one_thread()  # as in the gateway (`gateway.routing.build_router`)

    async def models() -> tuple[Any, Matcher]:
        return embedder, matcher

    splits = split_pairs(load_pairs(data))
    positives = [p for p in splits["test"] if p.label == 1][: n_queries // 2]
    stored = [p.text_a for p in positives] + sorted({p.text_a for p in splits["validation"]})
    stored = list(dict.fromkeys(stored))[: max(sizes)]
    fresh = sorted({p.text_b for p in splits["validation"] if p.label == 0} - set(stored))[: n_queries // 2]
    queries = [p.text_b for p in positives] + fresh
    random.Random(0).shuffle(queries)
    vectors = embed_all(embedder, stored)
    stored_vectors = np.stack([vectors[t] for t in stored])
    stores: list[tuple[str, Any]] = [("memory", MemoryCacheStore)]
    for redis_url in redis_urls:
        from redis.asyncio import Redis

        probe = RedisCacheStore(Redis.from_url(redis_url))
        try:
            name = "redis (vector sets)" if await probe.uses_vector_sets() else "redis (replica index)"
        except CacheUnavailable as exc:
            print(f"(b) skips {redis_url}: {exc}")
            continue
        finally:
            await probe.aclose()
        stores.append((name, lambda url=redis_url: RedisCacheStore(Redis.from_url(url),
                                                                   f"bench-semcache-{time.time_ns()}")))
    results: dict[str, Any] = {"queries": len(queries), "paraphrase_queries": len(positives), "cells": []}
    for name, make_store in stores:
        for size in sizes:
            if name.startswith("redis") and size > redis_max:
                continue
            cache = ResponseCache(make_store(), models, max_entries_per_scope=size)
            scope = _Scope(f"{embedder.version}+{matcher.version}")
            started = time.perf_counter()
            await _fill(cache, scope, size, stored, stored_vectors, seed=size)
            fill_s = time.perf_counter() - started
            await _time_lookups(cache, queries[:8], 1)  # sync the replica index (a one-off per scope)
            for concurrency in (1, 32):
                timings = await _time_lookups(cache, queries, concurrency)
                results["cells"].append(
                    {
                        "store": name,
                        "entries": size,
                        "concurrency": concurrency,
                        "lookups": len(timings),
                        "p50_ms": percentile(timings, 50),
                        "p99_ms": percentile(timings, 99),
                        "mean_ms": sum(timings) / len(timings),
                        "fill_s": fill_s,
                    }
                )
            if name.startswith("redis"):
                await cache.backend.purge("bench", None)
            await cache.aclose()
    return results


def print_latency(lat: dict[str, Any]) -> None:
    rows = [[c["store"], c["entries"], c["concurrency"], c["p50_ms"], c["p99_ms"], c["mean_ms"]] for c in lat["cells"]]
    print_table(
        f"(b) lookup latency, embedding and matcher included ({lat['queries']} queries, half paraphrases)",
        ["store", "entries", "concurrent", "p50 ms", "p99 ms", "mean ms"],
        rows,
    )


# --- (c) end to end -------------------------------------------------------------------------------


async def end_to_end(data: Path, n_pairs: int, repeats: int, token_interval_ms: float) -> dict[str, Any]:
    import msgspec
    from litestar.testing import AsyncTestClient

    from bench.fake_upstream import FakeUpstream, serving_in_thread
    from gateway.app import create_app
    from gateway.config import PolicyConfig, RedisConfig, load_settings
    from gateway.db.migrate import upgrade

    splits = split_pairs(load_pairs(data))
    rng = random.Random(1)
    test = list(splits["test"])
    rng.shuffle(test)
    positives = [p for p in test if p.label == 1][: n_pairs // 2]
    negatives = [p for p in test if p.label == 0][: n_pairs // 2]
    records: list[Any] = []
    upstream = FakeUpstream(token_interval_s=token_interval_ms / 1000)
    # A migrated database file, not `:memory:`: every pooled connection (the batch worker's too) sees the tables.
    with serving_in_thread(upstream) as url, tempfile.TemporaryDirectory() as workdir:
        base = load_settings(environ={})
        tiers = {n: msgspec.structs.replace(t, url=url, model="") for n, t in base.tiers.items()}
        settings = msgspec.structs.replace(
            base,
            tiers=tiers,
            redis=RedisConfig(url=""),
            database=msgspec.structs.replace(base.database, url=f"sqlite+aiosqlite:///{workdir}/sluice.db"),
            # No anonymous rate or spend limits: the replay sends hundreds of requests in a minute.
            server=msgspec.structs.replace(base.server, allow_anonymous=True, anonymous_rpm=0, anonymous_tpm=0,
                                           anonymous_spend_per_day_usd=0.0),
            policies={"default": PolicyConfig(cache="semantic")},
        )
        upgrade(settings.database.url)  # as `sluice serve` does: the batch worker polls its tables
        app = create_app(settings, record_sink=records.append)
        async with AsyncTestClient(app, timeout=60) as client:

            async def ask(text: str) -> tuple[str, float]:
                body = {
                    "model": "sluice",
                    "messages": [{"role": "user", "content": text}],
                    "temperature": 0,
                    "stream": True,
                }
                started = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                return response.headers["x-sluice-cache"], (time.perf_counter() - started) * 1000

            await ask("warm up: load the embedding model and the matcher")
            first = [await ask(p.text_a) for p in positives + negatives]
            second = [(await ask(p.text_b), p.label) for p in positives + negatives]
            again = [await ask(p.text_a) for p in (positives + negatives)[:repeats]]
    served = [r for r in records if r.status == 200][1:]
    spent = sum(r.cost_usd for r in served)
    saved = sum(r.cost_saved_usd for r in served)
    phase2 = [s for (s, _), _ in second] + [s for s, _ in again]
    hit_ms = [ms for (s, ms), _ in second if s != "miss"] + [ms for s, ms in again if s != "miss"]
    miss_ms = [ms for s, ms in first] + [ms for (s, ms), _ in second if s == "miss"]
    return {
        "requests": len(served),
        "token_interval_ms": token_interval_ms,
        "first_pass_misses": sum(s == "miss" for s, _ in first),
        "second_pass": len(phase2),
        "second_pass_hit_rate": sum(s != "miss" for s in phase2) / len(phase2),
        "paraphrase_hit_rate": sum(s == "semantic" for (s, _), label in second if label == 1) / max(1, len(positives)),
        "false_hits_on_non_duplicates": sum(s != "miss" for (s, _), label in second if label == 0),
        "non_duplicates_asked": len(negatives),
        "exact_repeat_hit_rate": sum(s == "exact" for s, _ in again) / max(1, len(again)),
        "cost_spent_usd": spent,
        "cost_saved_usd": saved,
        "cost_without_cache_usd": spent + saved,
        "saved_fraction": saved / (spent + saved) if spent + saved else 0.0,
        "hit_latency_ms": {"p50": percentile(hit_ms, 50), "p99": percentile(hit_ms, 99), "n": len(hit_ms)},
        "miss_latency_ms": {"p50": percentile(miss_ms, 50), "p99": percentile(miss_ms, 99), "n": len(miss_ms)},
    }


def print_e2e(e: dict[str, Any]) -> None:
    rows = [
        ["hits", e["hit_latency_ms"]["n"], e["hit_latency_ms"]["p50"], e["hit_latency_ms"]["p99"]],
        ["misses", e["miss_latency_ms"]["n"], e["miss_latency_ms"]["p50"], e["miss_latency_ms"]["p99"]],
    ]
    print_table(
        f"(c) end to end through the gateway (streamed, fake upstream at {e['token_interval_ms']:g} ms/token)",
        ["requests", "n", "p50 ms", "p99 ms"],
        rows,
    )
    print(
        f"second-pass hit rate {e['second_pass_hit_rate']:.2f} (paraphrases {e['paraphrase_hit_rate']:.2f}, "
        f"exact repeats {e['exact_repeat_hit_rate']:.2f}); false hits on non-duplicates "
        f"{e['false_hits_on_non_duplicates']}/{e['non_duplicates_asked']}; saved ${e['cost_saved_usd']:.6f} of "
        f"${e['cost_without_cache_usd']:.6f} ({100 * e['saved_fraction']:.1f}%)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_PAIRS, help="labelled pairs {text_a, text_b, label}")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument("--quality-only", action="store_true", help="only (a): no latency, no gateway")
    ap.add_argument("--matcher", type=Path, default=MATCHER_DIR,
                    help="matcher directory for (a) and (b); (c) runs the gateway, with the shipped matcher")
    ap.add_argument(
        "--split",
        choices=["auto", "test", "validation", "all"],
        default="auto",
        help="auto: the held-out test split when --data is the matcher's training file, else all pairs",
    )
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--redis-url", action="append", default=[],
                    help="also measure lookups on this Redis (repeatable: a Redis 7 and a Redis 8 side by side)")
    ap.add_argument("--redis-max-entries", type=int, default=10_000, help="largest scope measured on Redis")
    ap.add_argument("--e2e-pairs", type=int, default=200, help="paraphrase pairs replayed in (c); 0 skips (c)")
    ap.add_argument("--embedding-precision", choices=["int8", "float32"], default=None,
                    help="the embedder's graph for (a) and (b) (default: the gateway's, int8 on a CPU); (c) runs "
                         "the gateway's")
    args = ap.parse_args(argv)
    global EMBEDDING_PRECISION
    EMBEDDING_PRECISION = args.embedding_precision
    if not args.data.exists():
        sys.exit(f"no pair file at {args.data}: pass --data (the QQP pairs live in ../shared/data/semcache)")
    matcher = Matcher.load(args.matcher)
    figures: dict[str, Any] = {"cpu": cpu_model(), "targets": TARGETS}
    figures["quality"] = quality(args.data, matcher, args.split)
    figures["embedder"] = figures["quality"]["embedder"]
    print_quality(figures["quality"])
    if not args.quality_only:
        sizes = [int(s) for s in args.sizes.split(",")]
        figures["latency"] = asyncio.run(
            latency(args.data, sizes, args.queries, args.redis_url, args.redis_max_entries, matcher)
        )
        print_latency(figures["latency"])
        if args.e2e_pairs > 0:  # 0: (b) alone
            figures["end_to_end"] = asyncio.run(end_to_end(args.data, args.e2e_pairs, 50, 20.0))
            print_e2e(figures["end_to_end"])
    if args.quality_only:
        q = figures["quality"]
        out = {k: q[k] for k in ("cosine_only", "ours", "recall_ratio")} | {"details": q}
    else:
        out = figures
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    write_results("semcache-quality" if args.quality_only else "semcache", figures)


if __name__ == "__main__":
    main()
