"""Router benchmark (issue #9).

(a) Routing quality on RouteLLM's MMLU + GSM8K responses (Mixtral-8x7B as small, GPT-4 as large; contaminated
    prompts dropped; pooled; 80/20 split, seed 0): APGR and CPT(50%) of our classifier (trained by `train_router` on
    the 80%, exactly as `sluice router build-default` ships it), a random router, a TF-IDF + logistic-regression
    baseline predicting "the small model is wrong" and the oracle, all on the same held-out 20%.
    With `--data FILE` the same comparison runs on any file in the training format (its own 80/20 split, seed 0).
    Generalisation: the comparison on each benchmark alone (GSM8K only, MMLU only), each its own training file.
(b) The cascade on our own tiers (bench/router_cascade.py): from `--labels` (default var/labels/gsm8k_test.jsonl,
    written by `sluice router label`); skipped with a message when the file is absent.
(c) Router overhead per request, embedding + classifier: p50/p99 at batch 1 and with 32 concurrent requests.

    python bench/router.py --routellm-only --out FIGURES.json     # (a) alone
    python bench/router.py --data FILE --out FIGURES.json         # (a)'s comparison on FILE
    python bench/router.py                                        # (a), (b), generalisation and (c)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, cpu_model, percentile, print_table
from router.data import TrainingRow, load_rows, tier_scores
from router.metrics import apgr, cpt, oracle_scores, routing_curve
from router.train import split_indices, train_router

ROUTERS = ("ours", "random", "tfidf_lr", "oracle")
CACHED_TRAIN_ONLY = False  # --cached-train-only
EMBED_MAX_TOKENS: int | None = None  # --embed-max-tokens (None: the model's own limit, as served)


def _embeddings(prompts: list[str]) -> tuple[np.ndarray, str]:
    from router.embed_cache import embed_cached

    embedder = _embedder(threads=2)
    return embed_cached(embedder, prompts), embedder.version


def _embedder(**options: Any) -> Any:
    from router.embedding import Embedder

    if EMBED_MAX_TOKENS is not None:
        options["max_tokens"] = EMBED_MAX_TOKENS
    return Embedder.load(**options)


def tfidf_lr_scores(train: list[TrainingRow], test: list[TrainingRow]) -> np.ndarray:
    """The baseline: TF-IDF (word 1–2-grams) + logistic regression predicting "the small model is wrong"."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x_train = vectorizer.fit_transform([r.prompt for r in train])
    y = np.array([r.small_score < 0.5 for r in train], dtype=int)
    model = LogisticRegression(C=1.0, max_iter=2000).fit(x_train, y)
    return model.predict_proba(vectorizer.transform([r.prompt for r in test]))[:, 1]


def _figures(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> dict[str, Any]:
    curve = routing_curve(scores, small, large)
    return {
        "apgr": apgr(curve),
        "cpt50": cpt(curve, 0.5),
        "cpt80": cpt(curve, 0.8),
        "curve": {"large_fraction": curve.large_fraction.tolist(), "quality": curve.quality.tolist()},
    }


def _split_embeddings(prompts: list[str], train: np.ndarray, test: np.ndarray, cached_train_only: bool
                      ) -> tuple[np.ndarray, np.ndarray, str]:
    """Embeddings of every prompt, and which training rows to train on: all of them, or with
    `cached_train_only` those whose embeddings are already cached (the test rows are always embedded)."""
    if not cached_train_only:
        embeddings, version = _embeddings(prompts)
        return embeddings, train, version
    from router.embed_cache import lookup

    test_vectors, version = _embeddings([prompts[i] for i in test])
    embeddings, found = lookup(version, prompts)
    embeddings[test] = test_vectors
    return embeddings, train[found[train]], version


def compare(rows: list[TrainingRow], seed: int = 0, cached_train_only: bool = False) -> dict[str, Any]:
    """(a): the four routers on the held-out 20% of `rows`."""
    prompts = [r.prompt for r in rows]
    train, test = split_indices(len(rows), seed)
    embeddings, ours_train, version = _split_embeddings(prompts, train, test, cached_train_only)
    train_rows, test_rows = [rows[i] for i in train], [rows[i] for i in test]
    small, large = tier_scores(test_rows)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        artifact = train_router([rows[i] for i in ours_train], Path(tmp), seed=seed,
                                embeddings=embeddings[ours_train], embedder_version=version)
        train_s = time.perf_counter() - started
        ours = artifact.score(embeddings[test], [prompts[i] for i in test])
    scores = {
        "ours": ours,
        "random": np.random.default_rng(seed).random(len(test)),
        "tfidf_lr": tfidf_lr_scores(train_rows, test_rows),
        "oracle": oracle_scores(small, large, seed),
    }
    result: dict[str, Any] = {name: _figures(s, small, large) for name, s in scores.items()}
    result["ours"]["train_seconds"] = train_s
    result["ours"]["train_rows"] = len(ours_train)
    if len(ours_train) < len(train):  # the baseline again, on exactly the rows ours trained on
        same = tfidf_lr_scores([rows[i] for i in ours_train], test_rows)
        result["tfidf_lr_same_rows"] = {**_figures(same, small, large), "train_rows": len(ours_train)}
    result["ours"]["validation"] = artifact.meta["validation"]
    result["ours"]["blend"] = {key: artifact.meta["score"].get(key) for key in
                               ("regression_weight", "neighbours_k", "ngram_weight")}
    result["split"] = {"rows": len(rows), "train": len(train), "test": len(test), "seed": seed}
    result["test_quality"] = {"small_only": float(small.mean()), "large_only": float(large.mean())}
    result["ours_vs_tfidf_lr"] = {
        "apgr_gain": result["ours"]["apgr"] - result["tfidf_lr"]["apgr"],
        "cpt50_ratio": result["ours"]["cpt50"] / result["tfidf_lr"]["cpt50"],
    }
    return result


def show(title: str, result: dict[str, Any]) -> None:
    names = [*ROUTERS, *(["tfidf_lr_same_rows"] if "tfidf_lr_same_rows" in result else [])]
    rows = [[name, result[name]["apgr"], result[name]["cpt50"], result[name]["cpt80"]] for name in names]
    print_table(f"{title} ({result['split']['test']} held-out rows)", ["router", "APGR", "CPT(50%)", "CPT(80%)"], rows)


def part_routellm() -> dict[str, Any]:
    from router.datasets import routellm_rows

    result = compare(routellm_rows(), cached_train_only=CACHED_TRAIN_ONLY)
    show("(a) RouteLLM MMLU + GSM8K, Mixtral → GPT-4", result)
    target_met = bool(result["ours"]["apgr"] >= 0.70 and result["ours"]["cpt50"] <= 0.22)
    result["target"] = {"apgr_min": 0.70, "cpt50_max": 0.22, "met": target_met}
    return result


GENERALISATION = ["gsm8k", "mmlu"]  # --generalisation


def part_generalisation() -> dict[str, Any]:
    """Each benchmark alone as its own training file: another task (and, for GSM8K, 10x fewer rows)."""
    from router.datasets import routellm_rows

    out = {}
    for benchmark in GENERALISATION:
        result = compare(routellm_rows(benchmarks=(benchmark,)), cached_train_only=CACHED_TRAIN_ONLY)
        show(f"generalisation: {benchmark} only", result)
        out[benchmark] = result
    return out


async def _concurrent(embedder: Any, artifact: Any, prompts: list[str], workers: int) -> list[float]:
    latencies: list[float] = []
    queue = list(prompts)

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            started = time.perf_counter()
            vectors = await embedder.embed_async([prompt])
            artifact.score(vectors, [prompt])
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return latencies


def _overhead(embedder: Any, artifact: Any, prompts: list[str]) -> dict[str, Any]:
    for prompt in prompts[:10]:  # warm-up
        artifact.score(embedder.embed([prompt]), [prompt])
    embed_ms, classify_ms, total_ms = [], [], []
    for prompt in prompts:
        t0 = time.perf_counter()
        vectors = embedder.embed([prompt])
        t1 = time.perf_counter()
        artifact.score(vectors, [prompt])
        t2 = time.perf_counter()
        embed_ms.append((t1 - t0) * 1000)
        classify_ms.append((t2 - t1) * 1000)
        total_ms.append((t2 - t0) * 1000)
    concurrent_ms = asyncio.run(_concurrent(embedder, artifact, prompts, 32))
    return {
        "embedder": embedder.version,
        "batch1": {"p50_ms": percentile(total_ms, 50), "p99_ms": percentile(total_ms, 99),
                   "embed_p50_ms": percentile(embed_ms, 50), "classifier_p50_ms": percentile(classify_ms, 50),
                   "classifier_p99_ms": percentile(classify_ms, 99)},
        "concurrent32": {"p50_ms": percentile(concurrent_ms, 50), "p99_ms": percentile(concurrent_ms, 99)},
    }


def part_overhead(n: int = 300) -> dict[str, Any]:
    """(c): embedding + classifier per request, on held-out RouteLLM prompts (or synthetic ones without data):
    the embedder as the gateway loads it (int8 on a CPU), and the float32 graph as the baseline in the same run."""
    from router.artifact import DEFAULT_ARTIFACT_DIR, RouterArtifact
    from router.datasets import routellm_rows
    from router.embedding import DEFAULT_THREADS, hold_numpy_blas_to_one_thread

    try:
        rows = routellm_rows()
        _, test = split_indices(len(rows), 0)
        prompts = [rows[i].prompt for i in test[:n]]
    except FileNotFoundError:
        prompts = [f"Question {i}: what is {i} times {i + 7}, and why?" for i in range(n)]
    artifact = RouterArtifact.load(DEFAULT_ARTIFACT_DIR)
    hold_numpy_blas_to_one_thread()  # as in the gateway (`build_router`)
    shipped = _overhead(_embedder(), artifact, prompts)  # as the gateway loads it
    baseline = _overhead(_embedder(precision="float32"), artifact, prompts)
    result = {
        "prompts": len(prompts),
        **shipped,
        "baseline_float32_embedding": baseline,
        "batch1_p50_ratio_baseline_over_ours": baseline["batch1"]["p50_ms"] / shipped["batch1"]["p50_ms"],
        "target": {"batch1_p50_ms_max": 5.0, "met": bool(shipped["batch1"]["p50_ms"] <= 5.0)},
        "embedding_threads": DEFAULT_THREADS,
        "embedding_threads_spin_within_a_call": True,
        "numpy_blas_threads": 1,
        "note": "embedding: router.embedding as the gateway loads it (onnxruntime); classifier: the shipped "
        "router/default; baseline: the same with the float32 embedding graph",
    }
    table = []
    for name, r in (("ours", shipped), ("float32 embedding", baseline)):
        table += [
            [f"{name}: batch 1", r["batch1"]["p50_ms"], r["batch1"]["p99_ms"]],
            ["  embedding only", r["batch1"]["embed_p50_ms"], ""],
            ["  classifier only", r["batch1"]["classifier_p50_ms"], r["batch1"]["classifier_p99_ms"]],
            [f"{name}: 32 concurrent", r["concurrent32"]["p50_ms"], r["concurrent32"]["p99_ms"]],
        ]
    print_table("(c) router overhead per request (embedding + classifier)", ["load", "p50 ms", "p99 ms"], table)
    return result


LABELS = [Path("var/labels/gsm8k_test.jsonl")]  # --labels


def part_cascade() -> dict[str, Any]:
    """(b): the cascade on our own tiers, from `sluice router label` output (bench/router_cascade.py)."""
    from bench.router_cascade import cascade_benchmark

    labels = LABELS[0]
    if not labels.exists():
        message = f"{labels} not found: run `sluice router label --dataset gsm8k --n 120 --out {labels}` first"
        print(f"(b) skipped: {message}")
        return {"skipped": message}
    return cascade_benchmark(labels)


PARTS = {"cascade": part_cascade, "generalisation": part_generalisation, "overhead": part_overhead}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routellm-only", action="store_true", help="run (a) on RouteLLM data alone")
    parser.add_argument("--data", help="run (a)'s comparison on this file in the training format instead")
    parser.add_argument("--part", nargs="+", choices=("routellm", *PARTS), default=["routellm", *PARTS],
                        help="which parts to run")
    parser.add_argument("--out", default=str(RESULTS_DIR / "router.json"), help="where to write the JSON")
    parser.add_argument("--generalisation", nargs="+", choices=("gsm8k", "mmlu"), default=["gsm8k", "mmlu"],
                        help="benchmarks to run alone as their own training files")
    parser.add_argument("--labels", type=Path, default=LABELS[0],
                        help="(b): labelled GSM8K rows of our tiers, from `sluice router label`")
    parser.add_argument("--cached-train-only", action="store_true",
                        help="train ours only on training rows already in the embedding cache (slow CPUs); the "
                        "held-out rows are always all embedded, and the JSON says how many rows ours trained on")
    parser.add_argument("--embed-max-tokens", type=int, default=None,
                        help="an experiment: cut prompts to this many tokens before embedding them, in (a) and "
                        "(c) (default: the model's 256, as the gateway serves; the shipped classifier was trained "
                        "on full prompts, so (c)'s classifier time is unchanged, (a) retrains)")
    args = parser.parse_args(argv)
    global CACHED_TRAIN_ONLY, EMBED_MAX_TOKENS
    CACHED_TRAIN_ONLY = args.cached_train_only
    EMBED_MAX_TOKENS = args.embed_max_tokens
    GENERALISATION[:] = args.generalisation
    LABELS[:] = [args.labels]
    figures: dict[str, Any] = {}
    if args.data:
        figures.update(compare(load_rows(args.data), cached_train_only=args.cached_train_only))
        show(f"(a) on {args.data}", figures)
        figures["data"] = str(args.data)
    else:
        parts = ["routellm"] if args.routellm_only else args.part
        if "routellm" in parts:
            figures.update(part_routellm())
        for name in parts:
            if name in PARTS:
                figures[name] = PARTS[name]()
    payload = {
        "benchmark": "router",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "machine": {"cpu": cpu_model(), "python": platform.python_version()},
        "embed_max_tokens": EMBED_MAX_TOKENS or "the model's own (256)",
        **figures,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
