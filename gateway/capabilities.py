"""Which tiers can serve a request that uses tools or a response format, vLLM's `structured_outputs` among them
(`engines.api.fields.capabilities`).

A tier's configuration says what it supports (`supports_tools`, `supports_response_format`); a request
that needs what its routed tier lacks goes to the first allowed tier that has it, and fallback never
lands on a tier that lacks it.
"""

from __future__ import annotations

from collections.abc import Mapping

from engines.api.errors import APIError
from engines.api.fields import STRUCTURED, Capabilities
from gateway.config import TierConfig


def supports(config: TierConfig | None, needs: Capabilities) -> bool:
    """Can a tier configured as `config` serve a request with these needs? (No config: a tier built in code.)"""
    if config is None:
        return True
    return (config.supports_tools or not needs.uses_tools) and (
        config.supports_response_format or needs.response_format is None)


def capable_tier(primary: str, needs: Capabilities, allowed: list[str], tiers: Mapping[str, object],
                 configs: Mapping[str, TierConfig]) -> str:
    """`primary` if it can serve the request, else the first allowed tier (of `tiers`, in order) that can;
    refuses when none can."""
    for tier in [primary, *(t for t in tiers if t != primary and t in allowed)]:
        if supports(configs.get(tier), needs):
            return tier
    if needs.uses_tools:
        need, param = "tools", "tools"
    elif needs.response_format == STRUCTURED:
        need, param = "structured_outputs", "structured_outputs"
    else:
        need, param = f"response_format {needs.response_format}", "response_format"
    raise APIError(400, f"No tier this key may use supports {need} (tried {primary}"
                   f"{''.join(', ' + t for t in allowed if t != primary)}).", code="unsupported_capability",
                   param=param)
