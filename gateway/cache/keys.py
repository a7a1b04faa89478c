"""What a request may be cached under: its scope, its exact key, and the text the semantic tier compares.

The scope is everything that can change the answer except the last user message: tenant, feature,
endpoint, the model asked for and the tier the router chose, the system prompt and earlier turns,
tools and response_format, every sampling parameter, and the versions of the embedding model and of
the matcher. It is a hash of the canonical request (`engines.api.fields.canonical_request`: the fields
that shape the answer) with the last user message taken out, so a field a later change adds to the request
schema joins the scope by itself instead of being silently ignored. Fields that only deliver or attribute an
answer (stream, user, metadata, ...) are not in it; the end user a request names joins it through `end_user`
unless the feature's policy shares its cache between its users.
Entries are only ever compared within one scope: two tenants, two features, two system prompts or two
temperatures never share an entry, whatever their embeddings say.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import msgspec

from engines.api.fields import canonical_request
from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from engines.api.rules import decodes_greedily

CacheMode = Literal["off", "exact", "semantic"]
_QUERY_PLACEHOLDER = "<query>"


@dataclass(frozen=True, slots=True)
class CacheKey:
    scope: str  # hex digest naming the scope
    exact: str  # hex digest of scope + query: the entry's id
    query: str  # the last user message (chat) or the prompt (completions)
    semantic: bool  # may the semantic tier serve it (a chat whose last message is the user's text)


def is_deterministic(request: ChatCompletionRequest | CompletionRequest, opt_in: bool) -> bool:
    """Eligible for caching: greedy decoding, or a feature that opted in to reusing sampled answers."""
    return opt_in or decodes_greedily(request.temperature, request.top_p)


def end_user(request: ChatCompletionRequest | CompletionRequest) -> str | None:
    """Who the request is for, as the client names them (OpenAI's `user`, or its successor
    `safety_identifier`); None when it does not say."""
    return request.user or getattr(request, "safety_identifier", None)


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
    end_user: str | None = None,
) -> CacheKey | None:
    """The request's key, or None when it has no single text to key on (token-id or batched prompts).
    `end_user` set: a scope of that end user's own (a feature whose policy keeps its users apart)."""
    semantic = False
    if isinstance(request, ChatCompletionRequest):
        last = request.messages[-1]
        query = last.text()
        semantic = last.role == "user" and bool(query.strip())
        without_query = msgspec.structs.replace(last, content=_QUERY_PLACEHOLDER)
        request = msgspec.structs.replace(request, messages=[*request.messages[:-1], without_query])
    elif isinstance(request.prompt, str):
        query = request.prompt
        # A gap's filling depends on every character around it: a suffix keeps the key exact.
        semantic = bool(query.strip()) and not request.suffix
        request = msgspec.structs.replace(request, prompt=_QUERY_PLACEHOLDER)
    else:
        return None
    context = msgspec.json.encode({"tenant": tenant, "feature": feature, "endpoint": endpoint, "tier": tier,
                                   "versions": versions, "end_user": end_user})
    scope = hashlib.sha256(context + b"\x00" + canonical_request(request)).hexdigest()[:32]
    exact = hashlib.sha256(f"{scope}\x00{query}".encode()).hexdigest()[:40]
    return CacheKey(scope=scope, exact=exact, query=query, semantic=semantic)
