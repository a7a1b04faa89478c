"""The router's configuration: the artifact and default quality bar, and per-feature pins and bars, validated at
start with messages naming the key."""

import pytest

from gateway.config import ConfigError, load_settings


def test_defaults_use_the_shipped_artifact_at_95_percent() -> None:
    settings = load_settings(environ={})
    assert settings.router.artifact == "" and settings.router.quality_target == 0.95
    policy = settings.policy_for("anything")
    assert policy.route_tier is None and policy.quality_target is None


def test_a_feature_can_pin_a_tier_and_set_its_own_bar() -> None:
    settings = load_settings(environ={
        "SLUICE_POLICIES__BILLING__ROUTE_TIER": "large",
        "SLUICE_POLICIES__CHAT__QUALITY_TARGET": "0.85",
    })
    assert settings.policy_for("billing").route_tier == "large"
    assert settings.policy_for("chat").quality_target == 0.85


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SLUICE_POLICIES__BILLING__ROUTE_TIER": "huge"}, "policies.billing.route_tier: 'huge' is not a configured"),
        ({"SLUICE_POLICIES__CHAT__QUALITY_TARGET": "1.5"}, "policies.chat.quality_target: must be between 0.8 and 1"),
        ({"SLUICE_ROUTER__QUALITY_TARGET": "0.5"}, "router.quality_target: must be between 0.8 and 1.0"),
    ],
)
def test_bad_router_settings_fail_at_start_naming_the_key(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_settings(environ=environ)
