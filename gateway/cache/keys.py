"""What a request may be cached under: its scope, its exact key, and the text the semantic tier compares.

The scope is everything that can change the answer except the last user message: tenant, feature,
endpoint, the model asked for and the tier the router chose, the system prompt and earlier turns,
tools and response_format, every sampling parameter, and the versions of the embedding model and of
the matcher. It is a hash of the canonical request with the last user message taken out, so a field a
later change adds to the request schema joins the scope by itself instead of being silently ignored.
Entries are only ever compared within one scope: two tenants, two features, two system prompts or two
temperatures never share an entry, whatever their embeddings say.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from engines.api.protocol import ChatCompletionRequest, CompletionRequest

CacheMode = Literal["off", "exact", "semantic"]
# Transport-only fields: how the answer is delivered, not what it is (a streamed request is served
# from an answer first given as JSON and the other way round).
_DELIVERY_FIELDS = ("stream", "stream_options")
_canonical = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True, slots=True)
class CacheKey:
    scope: str  # hex digest naming the scope
    exact: str  # hex digest of scope + query: the entry's id
    query: str  # the last user message (chat) or the prompt (completions)
    semantic: bool  # may the semantic tier serve it (a chat whose last message is the user's text)


def is_deterministic(request: ChatCompletionRequest | CompletionRequest, opt_in: bool) -> bool:
    """Eligible for caching: greedy decoding, or a feature that opted in to reusing sampled answers."""
    return opt_in or request.temperature == 0


def cache_control(header: str | None) -> tuple[bool, bool]:
    """(may read from the cache, may write to it) per `Cache-Control`: no-cache skips the lookup but
    stores the fresh answer; no-store does neither."""
    directives = {d.strip().split("=", 1)[0].lower() for d in (header or "").split(",")}
    no_store = "no-store" in directives
    return not (no_store or "no-cache" in directives), not no_store


def cache_key(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    tenant: str,
    feature: str,
    endpoint: str,
    tier: str,
    versions: str,
) -> CacheKey | None:
    """The request's key, or None when it has no single text to key on (token-id or batched prompts)."""
    body: dict[str, Any] = msgspec.to_builtins(request)
    for name in _DELIVERY_FIELDS:
        body.pop(name, None)
    semantic = False
    if isinstance(request, ChatCompletionRequest):
        last = request.messages[-1]
        query = last.text()
        semantic = last.role == "user" and bool(query.strip())
        body["messages"] = [*body["messages"][:-1], {"role": last.role, "name": last.name, "content": "<query>"}]
    elif isinstance(request.prompt, str):
        query = request.prompt
        body["prompt"] = "<query>"
        semantic = bool(query.strip())
    else:
        return None
    context = {"tenant": tenant, "feature": feature, "endpoint": endpoint, "tier": tier, "versions": versions}
    scope = hashlib.sha256(_canonical.encode([context, body])).hexdigest()[:32]
    exact = hashlib.sha256(f"{scope}\x00{query}".encode()).hexdigest()[:40]
    return CacheKey(scope=scope, exact=exact, query=query, semantic=semantic)
