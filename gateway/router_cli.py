"""`sluice router …`: train, tune, evaluate and build the shipped difficulty classifier."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT_TOKENS = 200.0


def _settings(args: argparse.Namespace) -> Any:
    from gateway.config import load_settings

    return load_settings(getattr(args, "config", None))


def _prices(settings: Any) -> Any:
    from router.tune import Prices

    small, large = settings.tiers["small"], settings.tiers["large"]
    return Prices(small.price_input_per_mtok, small.price_output_per_mtok,
                  large.price_input_per_mtok, large.price_output_per_mtok)


def _db_url(args: argparse.Namespace) -> str | None:
    if args.no_db:
        return None
    return args.database_url or _settings(args).database.url or None


def _embeddings(prompts: list[str]) -> tuple[Any, str]:
    from router.embed_cache import embed_cached
    from router.embedding import Embedder

    embedder = Embedder.load()
    return embed_cached(embedder, prompts), embedder.version


def _train(rows: list[Any], out: Path, quality_target: float, args: argparse.Namespace) -> Any:
    from router.train import train_router

    embeddings, version = _embeddings([r.prompt for r in rows])
    artifact = train_router(rows, out, quality_target=quality_target, seed=args.seed,
                            embeddings=embeddings, embedder_version=version)
    print(f"router {artifact.version} written to {artifact.path}")
    print(json.dumps(artifact.meta["validation"], indent=2))
    if url := _db_url(args):
        from gateway.router_records import record_router_version

        asyncio.run(record_router_version(url, artifact.meta, str(artifact.path)))
        print("recorded in router_versions")
    return artifact


def cmd_train(args: argparse.Namespace) -> int:
    from router.data import load_rows

    if args.from_db:
        rows = _rows_from_db(args)
        if not rows:
            print("no shadow runs to train from (set policies.<feature>.shadow_rate)", file=sys.stderr)
            return 1
        print(f"{len(rows)} training rows from shadow_runs")
    else:
        rows = load_rows(args.data)
    _train(rows, Path(args.out), args.quality_target, args)
    return 0


def _rows_from_db(args: argparse.Namespace) -> list[Any]:
    """Shadow runs as training rows: the large answer is the reference (small_score = agreement)."""
    from datetime import UTC, datetime

    from gateway.shadow import training_rows_from_db

    url = args.database_url or _settings(args).database.url
    since = datetime.fromisoformat(args.since) if args.since else None
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    return asyncio.run(training_rows_from_db(url, since))


def cmd_label(args: argparse.Namespace) -> int:
    import dataclasses

    from router.label import run_label

    async def build_tier(name: str) -> Any:
        from engines.large.spec import SPEC as LARGE
        from engines.serving import build_in_process_client
        from engines.small.spec import SPEC as SMALL

        cache = args.cache_dir or _settings(args).models_cache_dir
        quantization = None if args.quantization == "none" else args.quantization
        spec = dataclasses.replace(SMALL if name == "small" else LARGE, quantization=quantization, dtype=args.dtype)
        client = await asyncio.to_thread(build_in_process_client, spec, cache)
        return client, client.close

    try:
        count = run_label(args.dataset, args.n, args.split, Path(args.out), Path(args.data_dir), build_tier,
                          args.concurrency, tiers=("small", "large") if args.tier == "both" else (args.tier,))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"labelled {count} new question(s) into {args.out}")
    return 0


def cmd_build_default(args: argparse.Namespace) -> int:
    """The shipped classifier: RouteLLM MMLU + GSM8K rows, the 80% training split (seed 0) — the 20% stays
    held out for `bench/router.py`."""
    from router.artifact import DEFAULT_ARTIFACT_DIR
    from router.datasets import routellm_rows
    from router.train import split_indices

    rows = routellm_rows()
    train, _ = split_indices(len(rows), seed=0)
    train_rows = [rows[i] for i in train]
    if args.cached_train_only:
        from router.embed_cache import lookup
        from router.embedding import Embedder

        _, found = lookup(Embedder.load().version, [r.prompt for r in train_rows])
        train_rows = [r for r, ok in zip(train_rows, found, strict=True) if ok]
        print(f"training on the {len(train_rows)} of {len(train)} training rows whose embeddings are cached")
    out = Path(args.out) if args.out else DEFAULT_ARTIFACT_DIR
    shutil.rmtree(out, ignore_errors=True)  # one shipped version, no history
    args.no_db = True
    artifact = _train(train_rows, out, 0.95, args)
    if args.cascade_labels:
        tune_on_demo_tier_labels(artifact, Path(args.cascade_labels), args)
    return 0


def tune_on_demo_tier_labels(artifact: Any, labels: Path, args: argparse.Namespace) -> None:
    """The operating points re-tuned on the demo tiers' own answers (`sluice router label`): thresholds that
    mean something for these tiers, and the cascade's τs, which RouteLLM's rows (no logprobs of our small
    tier) cannot give."""
    from router.data import load_rows
    from router.train import fingerprint

    rows = load_rows(labels)
    scores = _scores(artifact, rows)
    tuned_on = {"source": f"{labels.name}: the demo tiers' answers (sluice router label)", "rows": len(rows),
                "fingerprint": fingerprint(rows)}
    chosen = _tune(artifact, rows, scores, 0.95, DEFAULT_OUTPUT_TOKENS, _settings(args), tuned_on)
    print(f"tuned on {len(rows)} labelled rows of the demo tiers; at 0.95 of large-only quality: {chosen}")


def _load_for_eval(args: argparse.Namespace) -> tuple[Any, list[Any], Any]:
    from router.artifact import DEFAULT_ARTIFACT_DIR, RouterArtifact
    from router.data import load_rows
    from router.train import split_indices

    artifact = RouterArtifact.load(args.artifact or DEFAULT_ARTIFACT_DIR)
    rows = load_rows(args.data)
    if args.split == "test":
        _, test = split_indices(len(rows), seed=args.seed)
        rows = [rows[i] for i in test]
    return artifact, rows, _scores(artifact, rows)


def _scores(artifact: Any, rows: list[Any]) -> Any:
    """The artifact's difficulty score of each row's prompt, embedded as the gateway embeds it."""
    prompts = [r.prompt for r in rows]
    embeddings, _ = _embeddings(prompts)
    return artifact.score(embeddings, prompts)


def _tune(artifact: Any, rows: list[Any], scores: Any, quality_target: float, output_tokens: float,
          settings: Any, tuned_on: Any) -> Any:
    """Store the artifact's operating points (thresholds, and τs where the rows carry the small tier's
    confidences) tuned on `rows`; return the one for `quality_target`."""
    import numpy as np

    from router.artifact import store_operating_points
    from router.confidence import DEFINITIONS
    from router.data import tier_scores
    from router.tune import operating_points, request_costs

    def column(values: list[float | None]) -> np.ndarray | None:
        return None if any(v is None for v in values) else np.array(values, dtype=np.float64)

    cost_small, cost_large = request_costs([r.prompt for r in rows], _prices(settings), output_tokens)
    points = operating_points(
        scores, *tier_scores(rows),
        cost_small=cost_small, cost_large=cost_large, confidence=column([r.small_confidence for r in rows]),
        stream_confidence=column([r.small_stream_confidence for r in rows]),
    )
    store_operating_points(artifact.path, points, quality_target, {"tuned_on": tuned_on, "confidence": DEFINITIONS})
    return next(p for p in points if p.quality_target >= quality_target - 1e-9)


def cmd_tune(args: argparse.Namespace) -> int:
    artifact, rows, scores = _load_for_eval(args)
    chosen = _tune(artifact, rows, scores, args.quality_target, args.output_tokens, _settings(args), str(args.data))
    print(f"operating point for {args.quality_target:.2f} of large-only quality: {chosen}")
    print(f"stored the operating points in {artifact.path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from router.evaluate import evaluate, plot

    artifact, rows, scores = _load_for_eval(args)
    point = artifact.operating_point(args.quality_target)
    result = evaluate(rows, scores, point, _prices(_settings(args)), args.output_tokens)
    plot_path = plot(result, Path(args.plot), f"router {artifact.version} on {Path(args.data).name}")
    metrics = {"router_version": artifact.version, **result.metrics}
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    print(f"plot: {plot_path}")
    if url := _db_url(args):
        from gateway.router_records import record_eval_run

        run_id = asyncio.run(record_eval_run(url, artifact.version, str(args.data), result.metrics, str(plot_path)))
        print(f"recorded in eval_runs ({run_id})")
    return 0


def cmd_export_routellm(args: argparse.Namespace) -> int:
    from router.data import write_rows
    from router.datasets import routellm_rows

    rows = routellm_rows(benchmarks=tuple(args.benchmarks))
    write_rows(args.out, rows)
    print(f"{len(rows)} rows written to {args.out}")
    return 0


def add_router_commands(sub: Any) -> None:
    router = sub.add_parser("router", help="difficulty classifier: train, tune, eval, build the shipped default")
    actions = router.add_subparsers(dest="action", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser, db: bool = True) -> None:
        p.add_argument("--config", help="sluice.toml (tier prices, database URL)")
        p.add_argument("--seed", type=int, default=0)
        if db:
            p.add_argument("--database-url", help="record the run here (default: database.url of the config)")
            p.add_argument("--no-db", action="store_true", help="do not record the run in the database")

    train = actions.add_parser("train", help="train a classifier from rows (prompt, small_score, large_score)")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="training rows, .jsonl or .csv")
    source.add_argument("--from-db", action="store_true",
                        help="train from shadow_runs (small_score = agreement with the large answer)")
    train.add_argument("--since", help="with --from-db: only runs created at or after this ISO time (UTC)")
    train.add_argument("--out", required=True, help="artifact root; a new version goes under it, LATEST points at it")
    train.add_argument("--quality-target", type=float, default=0.95, help="default operating point (0.8–1.0)")
    common(train)
    train.set_defaults(handler=cmd_train)

    for name, handler, text in (
        ("tune", cmd_tune, "pick threshold (and the τs, with small_confidence / small_stream_confidence) at a quality "
                           "target; store with artifact"),
        ("eval", cmd_eval, "APGR, CPT, qualities, escalation and cost of an artifact on rows; PNG plot"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("--data", required=True, help="rows in the training format, .jsonl or .csv")
        p.add_argument("--artifact", default="", help="artifact directory (default: the shipped router/default)")
        p.add_argument("--quality-target", type=float, default=0.95 if name == "tune" else None)
        p.add_argument("--split", choices=("all", "test"), default="all",
                       help="test: only the held-out 20%% of an 80/20 split (seed), as in bench/router.py")
        p.add_argument("--output-tokens", type=float, default=DEFAULT_OUTPUT_TOKENS,
                       help="assumed answer length for costs")
        common(p, db=name == "eval")
        if name == "eval":
            p.add_argument("--plot", default="var/router_eval.png", help="where to write the PNG")
        p.set_defaults(handler=handler)

    build = actions.add_parser("build-default", help="train the shipped classifier from RouteLLM data")
    build.add_argument("--out", default="", help="default: router/default")
    build.add_argument("--cached-train-only", action="store_true",
                       help="train only on rows whose embeddings are already cached (slow CPUs)")
    build.add_argument("--cascade-labels", default="",
                       help="the demo tiers' labelled answers (sluice router label): tune thresholds and τs on them")
    common(build, db=False)
    build.set_defaults(handler=cmd_build_default)

    label = actions.add_parser("label", help="run both demo tiers over GSM8K and write training rows (resumable)")
    label.add_argument("--dataset", default="gsm8k", choices=["gsm8k"])
    label.add_argument("--n", type=int, default=300, help="questions, from the start of the split")
    label.add_argument("--split", default="test", choices=["test", "train"])
    label.add_argument("--out", required=True, help="JSONL file; questions already in it are skipped")
    label.add_argument("--data-dir", default="../shared/data/gsm8k", help="GSM8K directory")
    label.add_argument("--concurrency", type=int, default=16, help="questions in flight (batched by the engines)")
    label.add_argument("--cache-dir", help="models cache (default: models.cache_dir)")
    label.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="activations and unquantised weights; bfloat16 halves the memory peak of loading")
    label.add_argument("--tier", default="both", choices=["both", "small", "large"],
                       help="answer with one tier only (rows are written once both have answered)")
    label.add_argument("--quantization", default="auto", choices=["auto", "w8a8", "int8", "int4", "none"],
                       help="both tiers' weights; w8a8 keeps no float copy (auto may, on CPUs without VNNI): "
                            "least memory")
    label.add_argument("--config", help="sluice.toml (models cache)")
    label.set_defaults(handler=cmd_label)

    export = actions.add_parser("export-routellm", help="write RouteLLM MMLU/GSM8K rows in the training format")
    export.add_argument("--out", required=True)
    export.add_argument("--benchmarks", nargs="+", choices=("mmlu", "gsm8k"), default=["mmlu", "gsm8k"])
    common(export, db=False)
    export.set_defaults(handler=cmd_export_routellm)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `sluice router …`")
