"""Sluice's one typed configuration: a TOML file plus `SLUICE_*` environment overrides.

Nested keys are joined by a double underscore in the environment: `SLUICE_DATABASE__URL`,
`SLUICE_TIERS__SMALL__URL`, `SLUICE_POLICIES__DEFAULT__RPM`. Values are parsed as TOML literals
when they parse (numbers, booleans, arrays), else taken as strings. Unknown keys and wrong types
fail at start with a message naming the key.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

CONFIG_ENV = "SLUICE_CONFIG"
ENV_PREFIX = "SLUICE_"
TEST_ENV_PREFIX = "SLUICE_TEST_"
DEFAULT_CONFIG_FILE = "sluice.toml"


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = 8000
    # Admin API key (`Authorization: Bearer <admin_key>`); empty disables the admin API.
    admin_key: str = ""
    # When set, /metrics and the OpenAPI schema (/openapi) require `Bearer <key>` (or the admin key).
    metrics_key: str = ""
    openapi_key: str = ""
    # With no key store entry, requests are refused unless this is true (local development).
    allow_anonymous: bool = False
    # `sluice serve` refuses allow_anonymous on a non-loopback address unless this is also true.
    allow_anonymous_on_public_host: bool = False
    anonymous_tenant: str = "local"
    anonymous_feature: str = "default"
    # Limits of anonymous callers where their feature's policy sets none (0: no limit).
    anonymous_rpm: int = 60
    anonymous_tpm: int = 100_000
    anonymous_spend_per_day_usd: float = 1.0
    default_tier: str = "small"
    # Where accounting rows wait while the database is unreachable (and, in its `charges` folder,
    # spend settlements while Redis is).
    spool_dir: str = "var/spool"
    # Larger request bodies are refused with 413 before they are read in full.
    max_body_bytes: int = 16 * 1024 * 1024


class DatabaseConfig(_Section):
    # Postgres in production (postgresql+asyncpg://...), an SQLite file as the embedded default.
    url: str = "sqlite+aiosqlite:///var/sluice.db"
    pool_size: int = 5
    flush_interval_ms: int = 200
    flush_batch_size: int = 500


class RedisConfig(_Section):
    # Empty: budgets, limits and cache live in this process (one replica only).
    url: str = ""
    # While Redis cannot be reached: "refuse" requests (503 limits_unavailable; no limit is ever
    # exceeded) or count "local"ly in each replica (limits hold per replica, not across them).
    when_unavailable: Literal["refuse", "local"] = "refuse"


class BatchConfig(_Section):
    """The Batch API (`/v1/files`, `/v1/batches`): jobs run by a worker inside the gateway."""

    # Where uploaded input files and the output and error files are kept.
    dir: str = "var/batches"
    # Share taken off a batch request's cost (OpenAI's Batch API: half price).
    discount: float = 0.5
    # Lines of one batch in flight at once (each a request at `batch` priority).
    concurrency: int = 4
    # A worker holds a batch this long between heartbeats; a batch whose worker died is taken over
    # once its lease has run out (a gateway shut down cleanly hands its batches back at once).
    lease_s: float = 30.0
    # Largest upload to /v1/files (OpenAI's bound for batch input files); it spools to disk, never whole in memory.
    max_file_bytes: int = 200 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0.0 <= self.discount <= 1.0:
            raise ConfigError(f"batch.discount: must be between 0 and 1 (a share of the price), got {self.discount}")
        if self.concurrency < 1 or self.lease_s <= 0 or self.max_file_bytes < 1:
            raise ConfigError("batch.concurrency, batch.lease_s and batch.max_file_bytes: must be positive")


class CacheConfig(_Section):
    """The response cache (gateway/cache); which features use it is each policy's `cache` key."""

    max_entries_per_scope: int = 10_000  # past this the oldest entries of the scope are evicted
    # Without Redis: entries this process keeps in all scopes together (the soonest to expire go first).
    max_entries_in_process: int = 100_000
    # Question vectors a replica keeps in memory for the semantic tier, all scopes together (~1.6 KB each); the
    # least recently searched scopes are dropped first and rebuilt from the store when searched again.
    replica_index_max_entries: int = 200_000
    candidates: int = 2  # nearest cached questions the matcher reads
    matcher_dir: str = ""  # empty: the shipped matcher (gateway/cache/matcher)
    redis_timeout_ms: int = 250  # a slower Redis is treated as down: the cache is bypassed
    retry_after_s: float = 1.0  # how long the cache stays bypassed after Redis failed

    def __post_init__(self) -> None:
        for name in ("max_entries_per_scope", "max_entries_in_process", "replica_index_max_entries", "candidates"):
            if getattr(self, name) < 1:
                raise ConfigError(f"cache.{name}: must be at least 1, got {getattr(self, name)}")


class ModelsConfig(_Section):
    cache_dir: str = "~/.cache/sluice/models"


# Engine settings of a tier that are counts or sizes: unset (the spec's default) or at least 1.
POSITIVE_ENGINE_SETTINGS = ("kv_cache_mb", "max_num_seqs", "max_num_batched_tokens",
                            "max_batch_tokens_beside_interactive", "max_model_len", "num_threads")  # fmt: skip


class TierConfig(_Section):
    # In-process engine: a demo model name (tiny|small|large) or a GGUF file / safetensors directory.
    model: str = ""
    # OpenAI-compatible upstream (our engine server, vLLM, ...); when set, `model` is not loaded.
    url: str = ""
    upstream_model: str = ""  # model name sent upstream; defaults to the tier's served name
    api_key: str = ""
    # Tokenizer for counting prompt tokens of an upstream tier: a demo model name or model path.
    tokenizer: str = ""
    # The engine settings of an in-process tier, and of `sluice engine --tier <name>`. Unset: the
    # tier's spec holds the default (`engines/<name>/spec.py`, or `engines.tiers.TierSpec`), the one
    # place engine defaults are defined.
    device: str | None = None  # "cpu" (the default) or "cuda[:N]": where the engine's weights and KV cache live
    dtype: Literal["float32", "bfloat16"] | None = None  # bf16 is emulated on CPUs without AVX-512 BF16
    # auto: w8a8 on CPUs with int8 dot products (VNNI/AMX), else int8 weight-only; on CUDA none (bf16 was faster).
    # CPU modes: w8a8, int8, int4; CUDA modes: int8, fp8 (engines.quantization).
    quantization: Literal["none", "auto", "w8a8", "int8", "int4", "fp8"] | None = None
    # auto: bfloat16 on CPUs with native bf16 (AVX-512 BF16, AMX), else the same as dtype.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] | None = None
    # w8a8: int8 passes over the attention projections' inputs; 2 (the default) keeps perplexity within +1% of
    # float32, 1 is faster (BENCHMARKS.md, "w8a8 in two passes").
    w8a8_attention_passes: Literal[1, 2] | None = None
    kv_cache_mb: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_batch_tokens_beside_interactive: int | None = None
    max_model_len: int | None = None
    num_threads: int | None = None
    # true: a request's tokens and logprobs are the same bits whatever it is batched with and however its prompt is
    # chunked or cached (CPU engines with native decode layers: w8a8 or int8; prefill takes longer: BENCHMARKS.md,
    # "batch-invariant").
    batch_invariant: bool | None = None
    # Speculative decoding: a drafter model sharing this tier's tokenizer (demo name or path; "" = off)
    # proposes up to num_speculative_tokens tokens per decode step, the tier's model verifies them.
    speculative_draft: str | None = None
    num_speculative_tokens: int | None = None
    price_input_per_mtok: float = 0.0
    price_output_per_mtok: float = 0.0
    price_cached_input_per_mtok: float = 0.0
    # Latency objectives: the cascade bounds its stream probe by the TTFT one; the dashboard draws both.
    slo_ttft_p99_ms: float = 1000.0
    slo_itl_p99_ms: float = 200.0
    # Does the tier return token logprobs? false (an upstream without them): classifier-only routing, no cascade.
    logprobs: bool = True
    # How an upstream tier is told a request's scheduling class (interactive | batch): "none" leaves it out
    # (most servers reject an unknown value), "sluice" sends our engine server's `priority` string, "vllm"
    # vLLM's integer `priority` (interactive 0, batch 1; vLLM must run with `--scheduling-policy priority`).
    upstream_priority: Literal["none", "sluice", "vllm"] = "none"
    # Timeouts of a call to the tier. An upstream tier: opening a connection, waiting for a free pooled
    # one, and silence between bytes. Every tier: the whole request, a stream to its last event (an
    # in-process tier's deadline too). Each ends the call with a clean error (fallback, or a 503 or an
    # in-band stream error), never a hang.
    connect_timeout_s: float = 2.0
    pool_timeout_s: float = 5.0
    read_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    # What the tier can do (engines.api.fields.capabilities): a request that needs what a tier lacks goes
    # to an allowed tier that has it, or is refused. Our engines have both (tools where the model's chat
    # template renders them); set false for an upstream that lacks them.
    supports_tools: bool = True
    supports_response_format: bool = True


class PolicyConfig(_Section):
    """Defaults for every key of a feature; a key may override each field."""

    # Share of requests served by the small tier (not escalated, not cached) that the large tier also answers
    # in the background, for the online quality delta (`shadow_runs`).
    shadow_rate: float = 0.0

    allowed_tiers: list[str] = msgspec.field(default_factory=lambda: ["small", "large"])
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 1024  # per choice (`max_tokens` is clamped to it)
    # All the output one request may cause: max_tokens × n × prompts (no amplification).
    max_request_output_tokens: int = 16384
    max_prompts_per_request: int = 16  # length of a /v1/completions prompt list
    spend_per_day_usd: float | None = None
    spend_per_month_usd: float | None = None
    rpm: int | None = None
    tpm: int | None = None
    # Response cache: off | exact (the same request) | semantic (also a paraphrase the matcher accepts).
    cache: Literal["off", "exact", "semantic"] = "semantic"
    cache_ttl_s: float = 3600.0
    # Only temperature-0 requests are cached unless a feature opts in to reusing sampled answers.
    cache_nondeterministic: bool = False
    # Requests naming an end user (`user`, else `safety_identifier`) are answered from that user's own cache
    # scope: an answer may quote what its user asked. false shares the feature's cache between its end users.
    cache_per_user: bool = True
    fallback: bool = True  # may the other tier serve when this one is down
    # May prompts and answers of this feature be shown (dashboard: shadow-run disagreements)?
    log_content: bool = False

    # Scheduling class of this feature's requests: engines admit interactive work first and preempt batch
    # work for it. `choose_priority`: its keys may pick the class per request (header `x-sluice-priority`).
    priority: Literal["interactive", "batch"] = "interactive"
    choose_priority: bool = False

    # Serve this feature's `sluice`/`auto` requests from one tier, bypassing the router.
    route_tier: str | None = None
    # This feature's quality bar (share of large-only quality, 0.8–1.0); None: router.quality_target.
    quality_target: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.shadow_rate <= 1.0:
            raise ConfigError(f"shadow_rate: must be between 0 and 1 (a share of requests), got {self.shadow_rate}")


class TenantConfig(_Section):
    """Limits of a whole tenant, beside each key's: every key of the tenant counts against them, so a
    key revoked and re-created does not start a fresh budget."""

    spend_per_day_usd: float | None = None
    spend_per_month_usd: float | None = None
    rpm: int | None = None
    tpm: int | None = None


class RouterConfig(_Section):
    # Router artifact: a directory from `sluice router train` (its LATEST version is used and reloaded when it
    # changes) or one version directory; empty: the shipped default classifier (router/default).
    artifact: str = ""
    # Default quality bar: the operating point keeps quality >= this share of large-only quality.
    quality_target: float = 0.95
    # Shadow runs (large answering in the background) at most this many at a time; more are dropped.
    shadow_concurrency: int = 2
    # The embedding model's graph (router, response cache, /v1/embeddings): "auto" is int8 on a CPU and float32
    # with onnxruntime's CUDA provider. Router artifacts and cache scopes record the one they were built with.
    embedding_precision: Literal["auto", "int8", "float32"] = "auto"

    @property
    def embedder_precision(self) -> str | None:
        """What `router.embedding.Embedder.load` takes: None lets it choose by device."""
        return None if self.embedding_precision == "auto" else self.embedding_precision


def default_tiers() -> dict[str, TierConfig]:
    return {
        "small": TierConfig(
            model="small",
            price_input_per_mtok=0.05,
            price_output_per_mtok=0.20,
            price_cached_input_per_mtok=0.025,
            slo_ttft_p99_ms=1500.0,
            slo_itl_p99_ms=150.0,
        ),
        "large": TierConfig(
            model="large",
            price_input_per_mtok=0.30,
            price_output_per_mtok=1.20,
            price_cached_input_per_mtok=0.15,
            slo_ttft_p99_ms=3000.0,
            slo_itl_p99_ms=300.0,
        ),
    }


class Settings(_Section):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    database: DatabaseConfig = msgspec.field(default_factory=DatabaseConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    tiers: dict[str, TierConfig] = msgspec.field(default_factory=dict)
    # Feature name → policy. "default" applies to features not listed.
    policies: dict[str, PolicyConfig] = msgspec.field(default_factory=lambda: {"default": PolicyConfig()})
    # Tenant name → limits over all its keys (tenants not listed: none beyond their keys').
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("tiers: at least one tier must be configured")
        for name, tier in self.tiers.items():
            if not tier.model and not tier.url:
                raise ConfigError(f"tiers.{name}: set either `model` (in-process) or `url` (upstream)")
            for key in POSITIVE_ENGINE_SETTINGS:
                if (value := getattr(tier, key)) is not None and value < 1:
                    raise ConfigError(f"tiers.{name}.{key}: must be at least 1, got {value}")
            if tier.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", tier.device):
                raise ConfigError(f"tiers.{name}.device: expected cpu, cuda or cuda:N, got {tier.device!r}")
        if self.server.default_tier not in self.tiers:
            raise ConfigError(
                f"server.default_tier: {self.server.default_tier!r} is not a configured tier "
                f"({', '.join(sorted(self.tiers))})"
            )
        for feature, policy in self.policies.items():
            unknown = [t for t in policy.allowed_tiers if t not in self.tiers]
            if unknown:
                raise ConfigError(f"policies.{feature}.allowed_tiers: unknown tier(s) {unknown}")
            if policy.route_tier is not None and policy.route_tier not in self.tiers:
                raise ConfigError(f"policies.{feature}.route_tier: {policy.route_tier!r} is not a configured tier")
            if policy.quality_target is not None:
                _check_quality_target(f"policies.{feature}.quality_target", policy.quality_target)
        _check_quality_target("router.quality_target", self.router.quality_target)
        if "default" not in self.policies:
            self.policies["default"] = PolicyConfig()

    def policy_for(self, feature: str) -> PolicyConfig:
        return self.policies.get(feature) or self.policies["default"]

    @property
    def models_cache_dir(self) -> Path:
        return Path(self.models.cache_dir).expanduser()


def _check_quality_target(key: str, value: float) -> None:
    # Operating points are stored for 0.80 … 1.00 of large-only quality.
    if not 0.8 <= value <= 1.0:
        raise ConfigError(f"{key}: must be between 0.8 and 1.0 (a share of large-only quality), got {value}")


def parse_value(raw: str) -> Any:
    """A value given as text (environment, `--set key=value`): a TOML literal when it parses, else the string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_env(data: dict[str, Any], environ: dict[str, str]) -> None:
    for name, raw in sorted(environ.items()):
        # SLUICE_TEST_* name the test suite's servers (`make test` exports them to every command it runs).
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV or name.startswith(TEST_ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__") if part]
        if len(path) < 2:
            raise ConfigError(
                f"environment variable {name}: use SECTION__KEY, e.g. SLUICE_DATABASE__URL"
            )
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name}: {part} is not a section")
            node = child
        node[path[-1]] = parse_value(raw)


def _with_tier_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """Without a `tiers` table both demo tiers exist; a table naming `small` or `large` starts from
    that tier's defaults (prices, SLOs), so overriding one key keeps the rest."""
    defaults = {k: msgspec.to_builtins(v) for k, v in default_tiers().items()}
    tiers = data.setdefault("tiers", defaults)
    if tiers is not defaults and isinstance(tiers, dict):
        for name, tier in tiers.items():
            if name in defaults and isinstance(tier, dict):
                tiers[name] = {**defaults[name], **tier}
    return data


_PATH_RE = re.compile(r"at `\$\.?(?P<path>[^`]*)`")
_T = TypeVar("_T")
_UNKNOWN_RE = re.compile(r"unknown field `(?P<field>[^`]*)`")


def _convert(value: Any, kind: type[_T], key: str) -> _T:
    """msgspec.convert with errors that name the full dotted key."""
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH_RE.search(message)
        if not match:
            raise ConfigError(message) from exc
        parts = [key, match.group("path")]
        if unknown := _UNKNOWN_RE.search(message):
            parts.append(unknown.group("field"))
        raise ConfigError(f"invalid config key {'.'.join(p for p in parts if p)}: {message}") from exc


def load_settings(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Read the TOML file (explicit path, else $SLUICE_CONFIG, else ./sluice.toml when present),
    apply `SLUICE_*` overrides and validate."""
    environ = dict(os.environ) if environ is None else environ
    file = path or environ.get(CONFIG_ENV) or (DEFAULT_CONFIG_FILE if Path(DEFAULT_CONFIG_FILE).exists() else None)
    data: dict[str, Any] = {}
    if file:
        try:
            data = tomllib.loads(Path(file).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {file} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file}: {exc}") from exc
    _with_tier_defaults(data)
    _apply_env(data, environ)
    # Tables of named entries are checked one by one so that errors name the entry.
    for section, kind in (("tiers", TierConfig), ("policies", PolicyConfig), ("tenants", TenantConfig)):
        entries = data.get(section)
        if isinstance(entries, dict):
            for name, entry in entries.items():
                _convert(entry, kind, f"{section}.{name}")
    return _convert(data, Settings, "")
