"""The one configuration: file, environment overrides, and errors that name the key."""

from pathlib import Path

import pytest

from gateway.assembly import engine_spec
from gateway.config import ConfigError, load_settings

EXAMPLE = Path(__file__).resolve().parents[1] / "sluice.example.toml"


def test_defaults_give_two_in_process_tiers_on_embedded_storage() -> None:
    settings = load_settings(environ={})
    assert set(settings.tiers) == {"small", "large"}
    assert settings.tiers["small"].model == "small" and settings.tiers["large"].model == "large"
    assert settings.database.url.startswith("sqlite+aiosqlite://")
    assert settings.redis.url == ""


def test_example_file_is_valid_and_equals_the_defaults() -> None:
    assert load_settings(EXAMPLE, environ={}) == load_settings(environ={})


def test_environment_overrides_nested_keys_with_typed_values(tmp_path: Path) -> None:
    file = tmp_path / "s.toml"
    file.write_text('[server]\nport = 9000\n[policies.search]\nrpm = 10\n')
    settings = load_settings(
        file,
        environ={
            "SLUICE_SERVER__PORT": "9100",
            "SLUICE_TIERS__LARGE__URL": "http://10.0.0.5:8000",
            "SLUICE_POLICIES__SEARCH__ALLOWED_TIERS": '["small"]',
            "SLUICE_REDIS__URL": "redis://127.0.0.1:6379/0",
        },
    )
    assert settings.server.port == 9100
    assert settings.tiers["large"].url == "http://10.0.0.5:8000"
    assert settings.tiers["large"].price_output_per_mtok == 1.20  # the tier's other defaults stay
    assert settings.policy_for("search").rpm == 10
    assert settings.policy_for("search").allowed_tiers == ["small"]
    assert settings.policy_for("unlisted") == settings.policies["default"]
    assert settings.redis.url == "redis://127.0.0.1:6379/0"


def test_config_file_from_environment_variable(tmp_path: Path) -> None:
    file = tmp_path / "s.toml"
    file.write_text('[database]\nurl = "postgresql+asyncpg://postgres@127.0.0.1/x"\n')
    assert load_settings(environ={"SLUICE_CONFIG": str(file)}).database.url.endswith("/x")


@pytest.mark.parametrize(
    ("environ", "named_key"),
    [
        ({"SLUICE_TIERS__SMALL__PRICE_INPUT_PER_MTOK": "cheap"}, "tiers.small.price_input_per_mtok"),
        ({"SLUICE_SERVER__PROT": "80"}, "server.prot"),
        ({"SLUICE_POLICIES__DEFAULT__RPM": "many"}, "policies.default.rpm"),
        ({"SLUICE_TIERS__SMALL__QUANTIZATION": "int3"}, "tiers.small.quantization"),
        ({"SLUICE_SERVER__DEFAULT_TIER": "xl"}, "server.default_tier"),
        ({"SLUICE_POLICIES__DEFAULT__ALLOWED_TIERS": '["medium"]'}, "policies.default.allowed_tiers"),
        ({"SLUICE_PORT": "1"}, "SLUICE_PORT"),
        ({"SLUICE_TIERS__SMALL__MAX_BATCH_TOKENS_BESIDE_INTERACTIVE": "0"}, "tiers.small.max_batch_tokens_beside"),
        ({"SLUICE_TIERS__LARGE__MAX_NUM_SEQS": "-1"}, "tiers.large.max_num_seqs"),
        ({"SLUICE_TIERS__LARGE__DEVICE": "tpu"}, "tiers.large.device"),
        ({"SLUICE_ROUTER__EMBEDDING_PRECISION": "int4"}, "router.embedding_precision"),
        ({"SLUICE_CACHE__REPLICA_INDEX_MAX_ENTRIES": "0"}, "cache.replica_index_max_entries"),
    ],
)
def test_invalid_config_fails_with_a_message_naming_the_key(environ: dict[str, str], named_key: str) -> None:
    with pytest.raises(ConfigError, match=named_key.replace(".", r"\.")):
        load_settings(environ=environ)


def test_a_tier_needs_a_model_or_an_upstream() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.large"):
        load_settings(environ={"SLUICE_TIERS__LARGE__MODEL": '""'})


def test_missing_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_settings(broken, environ={})


def test_speculative_decoding_is_off_until_a_tier_names_a_drafter() -> None:
    settings = load_settings(environ={"SLUICE_TIERS__LARGE__SPECULATIVE_DRAFT": "small"})
    assert settings.tiers["large"].speculative_draft == "small"
    assert settings.tiers["small"].speculative_draft is None
    assert engine_spec("large", settings.tiers["large"]).speculative_draft == "small"
    assert engine_spec("large", settings.tiers["large"]).num_speculative_tokens == 6
    off = load_settings(environ={"SLUICE_TIERS__LARGE__SPECULATIVE_DRAFT": ""})
    assert engine_spec("large", off.tiers["large"]).speculative_draft is None


def test_the_embedding_precision_is_chosen_by_device_unless_set() -> None:
    from gateway.cache.hook import cache_models

    assert load_settings(environ={}).router.embedder_precision is None  # auto: Embedder.load decides
    settings = load_settings(environ={"SLUICE_ROUTER__EMBEDDING_PRECISION": "float32"})
    assert settings.router.embedder_precision == "float32"
    assert cache_models(settings).embedding_precision == "float32"  # the cache's (and /v1/embeddings') embedder
