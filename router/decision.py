"""Which tier a model name asks for. A pinned name decides here; for `sluice` and `auto` the gateway's
router (`gateway.routing`: the difficulty classifier, then the cascade) decides and fills `score`.

Model names: `sluice-<tier>` (or the bare tier name) asks for that tier; `sluice` and `auto` let the
router decide; an answer names the tier that served it as `sluice-<tier>` (`tier_model`). A name asking
for a tier the key may not use is refused (`ModelNotAllowed`), because the caller asked for something
specific; `auto` instead falls to the first allowed tier.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

TIER_MODEL_PREFIX = "sluice-"
AUTO_MODELS = ("sluice", "auto")


class ModelNotFound(LookupError):
    """The requested model names no tier."""


class ModelNotAllowed(PermissionError):
    """The requested tier exists but the caller's policy does not allow it."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    tier: str
    score: float | None  # classifier difficulty score; None until the classifier exists
    reason: str  # "requested" | "default" | "only_allowed"


def tier_model(tier: str) -> str:
    """The model name of a tier, as clients send it and as its answers name it."""
    return f"{TIER_MODEL_PREFIX}{tier}"


def model_ids(tiers: Collection[str]) -> list[str]:
    """The model names clients may send, as listed by `GET /v1/models`."""
    return [tier_model(tier) for tier in tiers] + list(AUTO_MODELS)


def requested_tier(model: str, tiers: Collection[str]) -> str | None:
    """The tier a model name asks for, None for "let the router decide"."""
    if model in AUTO_MODELS:
        return None
    tier = model.removeprefix(TIER_MODEL_PREFIX)
    if tier in tiers:
        return tier
    raise ModelNotFound(model)


def decide(model: str, tiers: Collection[str], allowed: Sequence[str], default_tier: str) -> RouteDecision:
    tier = requested_tier(model, tiers)
    if tier is not None:
        if tier not in allowed:
            raise ModelNotAllowed(model)
        return RouteDecision(tier=tier, score=None, reason="requested")
    if default_tier in allowed:
        return RouteDecision(tier=default_tier, score=None, reason="default")
    usable = [t for t in allowed if t in tiers]
    if not usable:
        raise ModelNotAllowed(model)
    return RouteDecision(tier=usable[0], score=None, reason="only_allowed")
