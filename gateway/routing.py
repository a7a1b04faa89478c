"""The gateway's routing step: which tier serves a request, and whether the cascade may escalate it.

`sluice-small` / `sluice-large` pin a tier, as before. `sluice` and `auto` go through the difficulty
classifier: the prompt is embedded once (kept on the request state as `prompt_embedding`, where the
response cache reads the same value), scored, and cut at the feature's operating point. When the
small tier is chosen, the point sets τ, the small tier returns logprobs (`tiers.<name>.logprobs`) and
the key may use the large tier, the request gets a `CascadePlan`; otherwise it is classifier-only.
Without a classifier (no artifact, or no text to embed) the configured default tier serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engines.api.client import EngineClient, EngineUnavailable
from engines.api.errors import APIError
from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from engines.api.sse import close
from gateway.config import PolicyConfig, Settings
from gateway.cost import request_cost
from gateway.fallback import Served, call_with_fallback, open_stream_with_fallback
from gateway.relay import PassingStream
from router.cascade import (
    CascadePlan,
    StreamProbe,
    buffer_budget_s,
    client_wants_logprobs,
    response_confidence,
    should_escalate,
    strip_logprobs,
    with_logprobs,
)
from router.decision import AUTO_MODELS, RouteDecision, decide

if TYPE_CHECKING:
    from gateway.pipeline import Gateway, RequestState
    from router.artifact import RouterArtifact

Request = ChatCompletionRequest | CompletionRequest
SMALL, LARGE = "small", "large"
log = logging.getLogger("sluice.gateway")


class PromptEmbedder(Protocol):
    async def embed_async(self, texts: Sequence[str]) -> np.ndarray: ...


class ArtifactSource(Protocol):
    """`router.artifact.ArtifactWatcher`: the newest classifier artifact, reloaded when it changes."""

    @property
    def current(self) -> Any: ...


class EmbeddingHolder(Protocol):
    prompt_embedding: np.ndarray | None


@dataclass(frozen=True, slots=True)
class Routed:
    decision: RouteDecision
    cascade: CascadePlan | None
    router_version: str | None


def prompt_text(request: Request) -> str | None:
    """What the classifier and the semantic cache read: the last user message, or the prompt text."""
    if isinstance(request, ChatCompletionRequest):
        for message in reversed(request.messages):
            if message.role == "user":
                return message.text() or None
        return None
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt or None
    texts = [p for p in prompt if isinstance(p, str)]
    return texts[-1] if texts and len(texts) == len(prompt) else None  # token ids cannot be embedded


async def prompt_embedding(
    state: EmbeddingHolder, request: Request, embedder: PromptEmbedder | None
) -> np.ndarray | None:
    """The request's prompt embedding, computed on first use and kept on `state` (one per request)."""
    if state.prompt_embedding is None and embedder is not None:
        text = prompt_text(request)
        if text is not None:
            state.prompt_embedding = (await embedder.embed_async([text]))[0]
    return state.prompt_embedding


class Router:
    def __init__(
        self, settings: Settings, embedder: PromptEmbedder | None = None, artifacts: ArtifactSource | None = None
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.artifacts = artifacts
        self._checked_version: str | None = None

    async def route(
        self, state: EmbeddingHolder, request: Request, policy: PolicyConfig, tiers: Collection[str]
    ) -> Routed:
        """Raises `ModelNotFound` / `ModelNotAllowed` like `router.decision.decide`."""
        fallback = decide(request.model, tiers, policy.allowed_tiers, self.settings.server.default_tier)
        if request.model not in AUTO_MODELS:
            return Routed(fallback, None, None)
        if policy.route_tier is not None:
            return Routed(self._allowed(RouteDecision(policy.route_tier, None, "pinned"), fallback, policy), None, None)
        artifact = self.artifacts.current if self.artifacts is not None else None
        embedding = await prompt_embedding(state, request, self.embedder) if artifact is not None else None
        if artifact is None or embedding is None:
            return Routed(fallback, None, None)
        self._check_embedder(artifact)
        from router.policy import choose_tier

        score = float(artifact.score(embedding[None, :], [prompt_text(request) or ""])[0])
        point = artifact.operating_point(policy.quality_target or self.settings.router.quality_target)
        tier, reason = choose_tier(score, point, None)
        decision = self._allowed(RouteDecision(tier, score, reason), fallback, policy)
        tau = point.tau_stream if request.stream else point.tau  # each path's own confidence definition
        return Routed(decision, self._cascade(decision, tau, policy), artifact.version)

    def _check_embedder(self, artifact: RouterArtifact) -> None:
        """Warn once per artifact version trained on another embedder's vectors: its scores still route,
        but its thresholds were tuned on other numbers (`sluice router train` retrains it)."""
        if artifact.version == self._checked_version:
            return
        self._checked_version = artifact.version
        trained_on = getattr(artifact, "meta", {}).get("features", {}).get("embedder")
        serving = getattr(self.embedder, "version", None)
        if trained_on and serving and trained_on != serving:
            log.warning("router artifact %s was trained on %s embeddings, the gateway computes %s: retrain it",
                        artifact.version, trained_on, serving)

    def _allowed(self, wanted: RouteDecision, fallback: RouteDecision, policy: PolicyConfig) -> RouteDecision:
        """The wanted tier when the key may use it, else what `decide` picked (keeping the score)."""
        if wanted.tier in policy.allowed_tiers and wanted.tier in self.settings.tiers:
            return wanted
        return RouteDecision(fallback.tier, wanted.score, fallback.reason)

    def _cascade(self, decision: RouteDecision, tau: float | None, policy: PolicyConfig) -> CascadePlan | None:
        small = self.settings.tiers.get(SMALL)
        if tau is None or decision.tier != SMALL or small is None or not small.logprobs:
            return None
        if LARGE not in policy.allowed_tiers or LARGE not in self.settings.tiers:
            return None
        return CascadePlan(tau=tau, escalate_to=LARGE)


# --- the cascade on the request path ----------------------------------------------------------

Call = Callable[[str, EngineClient, Request], Awaitable[Any]]
OpenStream = Callable[[EngineClient], AsyncIterator[Any]]


async def cascade_call(gateway: Gateway, state: RequestState, request: Request, candidates: list[str],
                       call: Call) -> Served[Any]:
    """Ask the small tier with logprobs; below τ, abandon its answer (its cost stays on the request)
    and serve the large tier's. Logprobs the client did not ask for are removed."""
    plan = state.cascade
    assert plan is not None
    asked = with_logprobs(request)
    if asked is None:
        return await call_with_fallback(gateway.clients, candidates, call)
    first = await call_with_fallback(gateway.clients, candidates, lambda tier, client: call(tier, client, asked))
    if first.tier == SMALL:
        state.confidence = response_confidence(first.value)
    if first.tier == SMALL and should_escalate(state.confidence, plan.tau):
        try:
            second = await call_with_fallback(
                gateway.clients, [plan.escalate_to], lambda tier, client: call(tier, client, request)
            )
        except APIError:
            log.warning("escalation to %s failed; serving the small tier's answer", plan.escalate_to)
        else:
            usage = first.value.usage
            state.abandoned_cost_usd = _cost(gateway, SMALL, usage.prompt_tokens, usage.completion_tokens)
            state.escalated = True
            return second
    if not client_wants_logprobs(request):
        strip_logprobs(first.value)
    return first


async def cascade_stream(gateway: Gateway, state: RequestState, request: Request, candidates: list[str],
                         open_stream: OpenStream) -> Served[tuple[Any, AsyncIterator[Any]]]:
    """Hold the small tier's first tokens back until the probe can decide; then flush them and go on,
    or close the small stream and stream the large tier's answer instead."""
    plan = state.cascade
    asked = with_logprobs(request)
    if plan is None or asked is None:
        return await open_stream_with_fallback(gateway.clients, candidates, open_stream)
    served = await open_stream_with_fallback(gateway.clients, candidates, lambda client: _stream_of(client, asked))
    if served.tier != SMALL:
        return _flushed(served, [served.value[0]], served.value[1], client_wants_logprobs(request))
    small_slo = gateway.settings.tiers[SMALL].slo_ttft_p99_ms
    elapsed = time.perf_counter() - state.started
    probe = StreamProbe(replace(plan, buffer_s=buffer_budget_s(small_slo, elapsed)))
    first, rest = served.value
    try:
        exhausted = await _fill(probe, first, rest)
    except EngineUnavailable:
        await close(rest)  # the small tier died before the client saw anything: the large one answers
        large = await open_stream_with_fallback(gateway.clients, [plan.escalate_to], open_stream)
        return Served(large.tier, True, large.value)
    except BaseException:
        await close(rest)
        raise
    state.confidence = probe.confidence
    if should_escalate(state.confidence, plan.tau):
        try:
            large = await open_stream_with_fallback(gateway.clients, [plan.escalate_to], open_stream)
        except APIError:
            log.warning("escalation to %s failed; streaming the small tier's answer", plan.escalate_to)
        else:
            await close(rest)
            tokens = probe.generated_tokens
            state.abandoned_cost_usd = _cost(gateway, SMALL, state.counted_prompt_tokens, tokens)
            state.escalated = True
            return large
    remaining: AsyncIterator[Any] = _empty() if exhausted else rest
    return _flushed(served, probe.chunks, remaining, client_wants_logprobs(request))


def _stream_of(client: EngineClient, request: Request) -> AsyncIterator[Any]:
    if isinstance(request, ChatCompletionRequest):
        return client.chat_stream(request)
    return client.complete_stream(request)


async def _fill(probe: StreamProbe, first: Any, rest: AsyncIterator[Any]) -> bool:
    """Buffer chunks into the probe until it is ready; True when the stream ended meanwhile."""
    probe.add(first)
    while not probe.ready():
        chunk = await anext(rest, None)
        if chunk is None:
            return True
        probe.add(chunk)
    return False


def _flushed(served: Served[Any], buffered: list[Any], rest: AsyncIterator[Any], keep_logprobs: bool) -> Served[Any]:
    """The held-back chunks, then the rest of the stream (logprobs the cascade asked for taken out)."""
    if not keep_logprobs:
        strip_logprobs(buffered[0])
    stream = PassingStream(rest, None if keep_logprobs else strip_logprobs, held=buffered[1:])
    return Served(served.tier, served.fallback, (buffered[0], stream))


async def _empty() -> AsyncGenerator[Any, None]:
    return
    yield


def _cost(gateway: Gateway, tier: str, prompt_tokens: int, completion_tokens: int) -> float:
    return request_cost(gateway.settings.tiers[tier], prompt_tokens, completion_tokens, 0)


# --- assembly ---------------------------------------------------------------------------------


def build_router(settings: Settings) -> Router:
    """The router the app serves with: the classifier artifact (`router.artifact`, else the shipped
    default under router/default) and the embedder when an artifact is there; without one, `sluice`
    and `auto` go to the default tier. Slow (loads models): call it off the event loop."""
    from pathlib import Path

    from router.artifact import DEFAULT_ARTIFACT_DIR, ArtifactWatcher
    from router.embedding import Embedder, hold_numpy_blas_to_one_thread

    hold_numpy_blas_to_one_thread()  # the gateway process's, whether the embedder loads here or for the cache
    path = Path(settings.router.artifact).expanduser() if settings.router.artifact else DEFAULT_ARTIFACT_DIR
    if not path.exists():
        log.warning("no router artifact at %s: `sluice`/`auto` go to the default tier", path)
        return Router(settings)
    embedder = Embedder.load(settings.models_cache_dir, precision=settings.router.embedder_precision)
    return Router(settings, embedder, ArtifactWatcher(path))
