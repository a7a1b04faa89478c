"""The request path, as plain code tested without HTTP.

authenticate → route → count prompt tokens (target tier's tokenizer) → prompt/output budgets →
admit (rate limits and spend, one atomic round trip) → call the tier, falling back when it is
down → relay the answer → `finish`: the one `RequestRecord`, metrics, and the spend charge.

Every request that reaches the gateway ends in exactly one `finish`, success or not, streamed or
not, the client still there or gone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
import msgspec

from engines.api.client import EngineClient, EngineUnavailable
from engines.api.errors import APIError, service_unavailable
from engines.api.protocol import (
    SSE_DONE,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    StreamOptions,
    Usage,
    sse_event,
    wants_stream_usage,
)
from engines.api.rules import check_request
from gateway import embeddings
from gateway.accounting import RequestRecord
from gateway.budgets import check_prompt_length, clamp_output, count_prompt_tokens, limits_of, refusal
from gateway.cache.hook import cache_policy, query_embedding
from gateway.cache.replay import assemble, replay
from gateway.cache.service import Lookup, ResponseCache
from gateway.config import PolicyConfig, Settings
from gateway.cost import request_cost
from gateway.counters import Charge, CounterStore, CountersUnavailable
from gateway.embeddings import EmbeddingsRequest
from gateway.keys import SECRET_PREFIX, KeyCache, KeyStoreUnavailable, effective_policy
from gateway.metrics import Metrics
from gateway.tiers import call_with_fallback, candidate_tiers, open_stream_with_fallback
from router.decision import ModelNotAllowed, ModelNotFound, RouteDecision, decide

Request = ChatCompletionRequest | CompletionRequest
Chunk = ChatCompletionChunk | Completion
RecordSink = Callable[[RequestRecord], None]

log = logging.getLogger("sluice.gateway")

UNIQUE_SUFFIX_LEN = 12
MAX_CLIENT_REQUEST_ID_LEN = 64 - 1 - UNIQUE_SUFFIX_LEN  # the `requests.request_id` column holds 64
CLIENT_CLOSED_REQUEST = 499  # recorded status of a request whose client left before the answer (nginx's code)
# Charges wait this long for others to share their Redis round trip: a budget sees spend this much
# later, and a round trip per request (a loopback send costs more CPU than the rest of a charge) is
# spared at any load.
CHARGE_COALESCE_S = 0.02


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking, and the policy that applies to them."""

    key_id: str | None
    tenant: str
    feature: str
    policy: PolicyConfig

    @property
    def subject(self) -> str:
        """Whose counters a request moves: the key, or the anonymous tenant/feature."""
        return self.key_id or f"anonymous:{self.tenant}:{self.feature}"


@dataclass(slots=True)
class RequestState:
    """What one request did, gathered along its path; becomes its one `RequestRecord`."""

    request_id: str  # unique: the accounting row's key
    endpoint: str  # chat | completions
    response_id: str = ""  # answered in `x-request-id`: the client's own id when it sent one
    started: float = field(default_factory=time.perf_counter)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    principal: Principal | None = None
    model_requested: str = ""
    stream: bool = False
    route: RouteDecision | None = None
    tier: str | None = None
    fallback: bool = False
    admitted: bool = False  # counted by the limits, so its spend is charged
    counted_prompt_tokens: int = 0  # as counted before the call; usage replaces it when it comes
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0
    ttft_ms: float | None = None
    itl_ms_mean: float | None = None
    finished: bool = False
    cache_control: str | None = None  # the client's Cache-Control header
    cache_status: str = "off"  # off | bypass | miss | exact | semantic
    cache_similarity: float | None = None
    cost_saved_usd: float = 0.0
    prompt_embedding: Any = None  # of the last user message (chat) or the prompt: shared by router and cache


@dataclass(slots=True)
class Reply:
    """A successful answer: a JSON body, or a stream of server-sent events."""

    headers: dict[str, str]
    body: bytes = b""
    stream: EventStream | None = None


class EventStream:
    """The server-sent events of a streamed reply. However it ends (read to the end, abandoned
    midway, or closed before it was read at all) `aclose` closes the upstream stream and finishes
    the request: a plain generator closed before its first step would skip its cleanup."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events
        self._started = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        self._started = True
        return await anext(self._events)

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            with suppress(StopAsyncIteration):
                await anext(self._events)  # enter the generator so that its cleanup runs
        await self._events.aclose()


def request_ids(incoming: str | None) -> tuple[str, str]:
    """(the request's own id, the id to answer in `x-request-id`).

    A client's `x-request-id` is honoured: echoed, and the prefix of the request's own id, so that
    its accounting rows are found by it. The own id stays unique even when a client repeats an id
    (retries do): accounting keys rows by it and ignores a row whose id it has already written."""
    # Not uuid4: it reads os.urandom, a system call per request. The random module's generator is
    # seeded from it once per process (again in a forked child); 128 bits make collisions as unlikely.
    own = f"req-{random.getrandbits(128):032x}"
    if incoming and len(incoming) <= MAX_CLIENT_REQUEST_ID_LEN and incoming.isprintable():
        return f"{incoming}.{own.removeprefix('req-')[:UNIQUE_SUFFIX_LEN]}", incoming
    return own, own


class Gateway:
    def __init__(
        self,
        settings: Settings,
        clients: Mapping[str, EngineClient],
        counters: CounterStore,
        record_sink: RecordSink,
        metrics: Metrics,
        keys: KeyCache | None = None,
        clock: Callable[[], float] = time.time,
        cache: ResponseCache | None = None,
        embedder: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.counters = counters
        self.record_sink = record_sink
        self.metrics = metrics
        self.keys = keys
        self.clock = clock
        self.cache = cache
        self.embedder = embedder  # loads (once) and returns the embedding service
        self._cache_writes: set[asyncio.Task[None]] = set()
        self._principals: dict[str, tuple[object, Principal]] = {}
        self._pending_charges: dict[str, Charge] = {}
        self._charging: asyncio.Task[None] | None = None

    # -- authentication -----------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> Principal:
        server = self.settings.server
        if not authorization:
            if server.allow_anonymous:
                return self._anonymous()
            raise APIError(
                401,
                "You didn't provide an API key. Send it as `Authorization: Bearer sk-sluice-...`.",
                code="invalid_api_key",
            )
        scheme, _, secret = authorization.partition(" ")
        secret = secret.strip()
        key = None
        if scheme.lower() == "bearer" and secret.startswith(SECRET_PREFIX) and self.keys is not None:
            try:
                key = await self.keys.lookup(secret)
            except KeyStoreUnavailable as exc:
                raise service_unavailable(
                    "API keys cannot be checked right now. Retry later.", "auth_unavailable"
                ) from exc
        if key is None:
            if server.allow_anonymous and scheme.lower() == "bearer" and not secret.startswith(SECRET_PREFIX):
                # Local development: SDKs insist on sending some key; a non-Sluice one means anonymous.
                return self._anonymous()
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        cached = self._principals.get(key.id)
        if cached is not None and cached[0] is key:
            return cached[1]
        policy = effective_policy(self.settings, key.feature, key.policy)
        principal = Principal(key_id=key.id, tenant=key.tenant, feature=key.feature, policy=policy)
        self._principals[key.id] = (key, principal)
        return principal

    def _anonymous(self) -> Principal:
        server = self.settings.server
        policy = self.settings.policy_for(server.anonymous_feature)
        return Principal(key_id=None, tenant=server.anonymous_tenant, feature=server.anonymous_feature, policy=policy)

    # -- serving --------------------------------------------------------------------------------

    async def chat(self, state: RequestState, request: ChatCompletionRequest) -> Reply:
        return await self._serve(state, request)

    async def complete(self, state: RequestState, request: CompletionRequest) -> Reply:
        return await self._serve(state, request)

    async def embeddings(self, state: RequestState, request: EmbeddingsRequest) -> Reply:
        return await self._serve(state, request)

    async def _embed(self, state: RequestState, request: EmbeddingsRequest) -> Reply:
        """Admitted and accounted like a completion: its tokens count against the key's limits."""
        principal = state.principal
        if principal is None or self.embedder is None:
            raise RuntimeError("authenticate before serving; the embedding service is not configured")
        state.model_requested = request.model
        embedder = await self.embedder()
        texts = embeddings.texts_of(request, embedder.dim)
        tokens = embedder.count_tokens(texts)
        state.counted_prompt_tokens = tokens
        check_prompt_length(tokens, principal.policy)
        await self._admit(state, tokens)
        vectors = await embedder.embed_async(texts)
        state.tier, state.prompt_tokens = "embed", tokens
        body = msgspec.json.encode(embeddings.response(vectors, tokens, request.encoding_format))
        self.finish(state, 200)
        return Reply(headers={"x-request-id": state.response_id or state.request_id}, body=body)

    async def _serve(self, state: RequestState, request: Request | EmbeddingsRequest) -> Reply:
        try:
            if isinstance(request, EmbeddingsRequest):
                return await self._embed(state, request)
            return await self._serve_or_raise(state, request)
        except APIError as exc:
            self.finish(state, exc.status_code, exc.code)
            raise
        except asyncio.CancelledError:
            # The client left (the HTTP layer cancels us): the tier's work was cancelled with us.
            self.finish(state, CLIENT_CLOSED_REQUEST, "client_disconnected")
            raise

    async def _serve_or_raise(self, state: RequestState, request: Request) -> Reply:
        principal = state.principal
        if principal is None:
            raise RuntimeError("authenticate before serving")
        policy = principal.policy
        state.model_requested = request.model
        state.stream = request.stream
        check_request(request)
        try:
            state.route = decide(request.model, self.clients, policy.allowed_tiers, self.settings.server.default_tier)
        except ModelNotFound as exc:
            raise APIError(
                404,
                f"The model `{request.model}` does not exist. GET /v1/models lists the models.",
                code="model_not_found",
                param="model",
            ) from exc
        except ModelNotAllowed as exc:
            raise APIError(
                403,
                f"This key may not use the model `{request.model}` (allowed tiers: {', '.join(policy.allowed_tiers)}).",
                code="model_not_allowed",
                param="model",
            ) from exc

        prompt_tokens = count_prompt_tokens(self.clients[state.route.tier], request)
        state.counted_prompt_tokens = prompt_tokens
        check_prompt_length(prompt_tokens, policy)
        request, clamped = clamp_output(request, policy)
        await self._admit(state, prompt_tokens)

        headers = {
            "x-request-id": state.response_id or state.request_id,
            "x-sluice-cache": "miss",
            "x-sluice-escalated": "false",
        }
        if clamped:
            headers["x-sluice-max-tokens-clamped"] = str(policy.max_output_tokens)
        lookup = await self._cache_begin(state, request)
        if lookup.hit is not None:
            return self._cached_reply(state, request, lookup, headers)
        try:
            return await self._generate(state, request, headers, lookup)
        except BaseException:
            self._cache_release(lookup)
            raise

    async def _admit(self, state: RequestState, prompt_tokens: int) -> None:
        assert state.principal is not None
        limits = limits_of(state.principal.policy)
        try:
            admission = await self.counters.admit(state.principal.subject, limits, prompt_tokens, self.clock())
        except CountersUnavailable as exc:
            # Fail closed: without the shared counters no limit or budget could hold.
            raise service_unavailable(
                "Rate limits and budgets cannot be checked right now. Retry later.", "limits_unavailable"
            ) from exc
        if not admission.admitted:
            raise refusal(admission, limits)
        state.admitted = True

    async def _generate(
        self, state: RequestState, request: Request, headers: dict[str, str], lookup: Lookup
    ) -> Reply:
        assert state.principal is not None and state.route is not None
        candidates = candidate_tiers(state.route.tier, state.principal.policy, self.clients)
        if request.stream:
            return await self._stream(state, request, candidates, headers, lookup)

        async def call(tier: str, client: EngineClient) -> Any:
            self._enter(tier)
            try:
                if isinstance(request, ChatCompletionRequest):
                    return await client.chat(request)
                return await client.complete(request)
            finally:
                self._leave(tier)

        served = await call_with_fallback(self.clients, candidates, call)
        state.tier, state.fallback = served.tier, served.fallback
        self._charge_usage(state, served.value.usage)
        headers["x-sluice-tier"] = served.tier
        headers["x-sluice-cost-usd"] = f"{state.cost_usd:.8f}"
        body = msgspec.json.encode(served.value)
        if lookup.leader:
            await self.cache.store(lookup, body, state.cost_usd)  # type: ignore[union-attr]
        self.finish(state, 200)
        return Reply(headers=headers, body=body)

    # -- response cache -------------------------------------------------------------------------

    async def _cache_begin(self, state: RequestState, request: Request) -> Lookup:
        principal, route = state.principal, state.route
        if self.cache is None or principal is None or route is None:
            return Lookup("off")
        lookup = await self.cache.begin(
            request, cache_policy(principal.policy), tenant=principal.tenant, feature=principal.feature,
            endpoint=state.endpoint, tier=route.tier, control=state.cache_control, embedding=state.prompt_embedding,
        )
        query_embedding(state, lookup)
        state.cache_status = lookup.status
        return lookup

    def _cache_release(self, lookup: Lookup) -> None:
        if self.cache is not None:
            self.cache.release(lookup)

    def _cache_store_later(self, lookup: Lookup, body: bytes | None, cost_usd: float) -> None:
        """Keep a streamed answer without holding up the stream's end (its followers wait for it)."""
        if self.cache is None or body is None:
            self._cache_release(lookup)
            return
        task = asyncio.get_running_loop().create_task(self.cache.store(lookup, body, cost_usd))
        self._cache_writes.add(task)
        task.add_done_callback(self._cache_writes.discard)

    def _cached_reply(self, state: RequestState, request: Request, lookup: Lookup, headers: dict[str, str]) -> Reply:
        hit = lookup.hit
        assert hit is not None
        state.cache_similarity, state.cost_saved_usd = hit.similarity, hit.entry.cost_usd
        headers["x-sluice-cache"] = hit.status
        headers["x-sluice-cost-usd"] = f"{0.0:.8f}"
        if not request.stream:
            self.finish(state, 200)
            return Reply(headers=headers, body=hit.entry.body)
        events = replay(hit.entry.body, state.endpoint, wants_stream_usage(request.stream_options))
        state.ttft_ms = (time.perf_counter() - state.started) * 1000
        return Reply(headers=headers, stream=EventStream(self._replay(state, events)))

    async def _replay(self, state: RequestState, events: list[bytes]) -> AsyncGenerator[bytes, None]:
        try:
            for event in events:
                yield event
        finally:
            self.finish(state, 200)

    async def _stream(
        self, state: RequestState, request: Request, candidates: list[str], headers: dict[str, str], lookup: Lookup
    ) -> Reply:
        include_usage = wants_stream_usage(request.stream_options)
        # Upstream always reports usage: spend is charged from it whether or not the client wants it.
        upstream_request = msgspec.structs.replace(request, stream_options=StreamOptions(include_usage=True))

        def open_stream(client: EngineClient) -> AsyncIterator[Any]:
            if isinstance(upstream_request, ChatCompletionRequest):
                return client.chat_stream(upstream_request)
            return client.complete_stream(upstream_request)

        assert state.route is not None
        self._enter(state.route.tier)
        try:
            served = await open_stream_with_fallback(self.clients, candidates, open_stream)
        except BaseException:
            self._leave(state.route.tier)
            raise
        if served.fallback:
            self._leave(state.route.tier)
            self._enter(served.tier)
        state.tier, state.fallback = served.tier, served.fallback
        state.ttft_ms = (time.perf_counter() - state.started) * 1000
        headers["x-sluice-tier"] = served.tier
        first, rest = served.value
        relay = self._relay(state, first, rest, include_usage, lookup)
        return Reply(headers=headers, stream=EventStream(relay))

    async def _relay(
        self, state: RequestState, first: Chunk, rest: AsyncIterator[Chunk], include_usage: bool, lookup: Lookup
    ) -> AsyncGenerator[bytes, None]:
        """Pass chunks through as they come. Ends with `finish` however the stream ends: the
        upstream stream is closed (cancelling its work) and what was produced is charged."""
        usage: Usage | None = None
        texts: list[str] = []
        chunk_times: list[float] = []
        error_code: str | None = None
        chunk: Chunk | None = first
        kept: list[Chunk] | None = [] if lookup.leader else None  # what the cache keeps of a led miss
        complete = False
        try:
            while chunk is not None:
                chunk_times.append(time.perf_counter())
                if kept is not None:
                    kept.append(chunk)
                if chunk.usage is not None:
                    usage = chunk.usage
                    if not include_usage:
                        chunk.usage = None
                texts.extend(_chunk_texts(chunk))
                if chunk.choices or chunk.usage is not None:
                    yield sse_event(chunk)
                chunk = await anext(rest, None)
            complete = True
            yield SSE_DONE
        except Exception as exc:
            # Headers are sent: the failure can only be told in the stream, the way OpenAI does.
            if isinstance(exc, APIError):
                detail = exc.detail
            elif isinstance(exc, EngineUnavailable):
                detail = ErrorDetail(
                    message="The tier stopped answering mid-stream.",
                    type="service_unavailable_error",
                    code="tier_unavailable",
                )
            else:
                log.exception("stream from tier %s failed", state.tier)
                detail = ErrorDetail(message="The stream failed.", type="server_error", code="stream_failed")
            error_code = detail.code or "stream_failed"
            yield sse_event(ErrorResponse(error=detail))
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(rest, "aclose", None)
                if aclose is not None:
                    await aclose()
            assert state.tier is not None
            self._leave(state.tier)
            if len(chunk_times) > 1:
                state.itl_ms_mean = (chunk_times[-1] - chunk_times[0]) * 1000 / (len(chunk_times) - 1)
            if usage is None:
                usage = self._produced_usage(state, texts)
            self._charge_usage(state, usage)
            if lookup.leader:
                self._cache_store_later(lookup, assemble(kept or [], usage) if complete else None, state.cost_usd)
            self.finish(state, 200, error_code)

    def _produced_usage(self, state: RequestState, texts: list[str]) -> Usage:
        """Usage of a stream that ended before its usage chunk (the client left): the prompt as
        counted up front, the text produced so far counted with the serving tier's tokenizer."""
        assert state.tier is not None
        client = self.clients[state.tier]
        text = "".join(texts)
        completion_tokens = 0
        if text:
            completion_tokens = count_prompt_tokens(client, CompletionRequest(model=state.tier, prompt=text))
        return Usage.of(state.counted_prompt_tokens, completion_tokens)

    # -- accounting -----------------------------------------------------------------------------

    def _charge_usage(self, state: RequestState, usage: Usage | None) -> None:
        if usage is None or state.tier is None:
            return
        state.prompt_tokens = usage.prompt_tokens
        state.completion_tokens = usage.completion_tokens
        state.cached_tokens = usage.cached_tokens
        tier = self.settings.tiers[state.tier]
        state.cost_usd = request_cost(tier, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)

    def _enter(self, tier: str) -> None:
        self.metrics.in_flight_of(tier).inc()

    def _leave(self, tier: str) -> None:
        self.metrics.in_flight_of(tier).dec()

    def finish(self, state: RequestState, status: int, error_code: str | None = None) -> None:
        """Record the request once: accounting row, metrics, and (if admitted) its spend."""
        if state.finished:
            return
        state.finished = True
        principal = state.principal
        record = RequestRecord(
            request_id=state.request_id,
            tenant=principal.tenant if principal else "",
            feature=principal.feature if principal else "",
            created_at=state.created_at,
            key_id=principal.key_id if principal else None,
            endpoint=state.endpoint,
            model_requested=_printable(state.model_requested)[:128],
            route=state.route.tier if state.route else None,
            route_score=state.route.score if state.route else None,
            tier=state.tier,
            escalated=False,
            fallback=state.fallback,
            cache_status=state.cache_status,
            cache_similarity=state.cache_similarity,
            cost_saved_usd=state.cost_saved_usd,
            stream=state.stream,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=state.cached_tokens,
            cost_usd=state.cost_usd,
            ttft_ms=state.ttft_ms,
            latency_ms=(time.perf_counter() - state.started) * 1000,
            itl_ms_mean=state.itl_ms_mean,
            status=status,
            error_code=error_code,
        )
        self.record_sink(record)
        self.metrics.observe(record)
        if state.admitted and principal is not None and (record.completion_tokens or record.cost_usd):
            self._charge(principal.subject, Charge(record.completion_tokens, record.cost_usd))

    def _charge(self, subject: str, charge: Charge) -> None:
        """Queue a charge. One task writes them; charges arriving within CHARGE_COALESCE_S, or while it
        waits on a round trip, go together in the next one."""
        pending = self._pending_charges.get(subject)
        self._pending_charges[subject] = charge if pending is None else pending + charge
        if self._charging is None or self._charging.done():
            self._charging = asyncio.get_running_loop().create_task(self._write_charges())

    async def _write_charges(self) -> None:
        await asyncio.sleep(CHARGE_COALESCE_S)
        while self._pending_charges:
            charges, self._pending_charges = self._pending_charges, {}
            try:
                await self.counters.charge_many(charges, self.clock())
            except CountersUnavailable:
                log.exception("spend of %d subjects could not be charged", len(charges))

    async def drain(self) -> None:
        """Wait until queued charges are written (shutdown; tests that read counters)."""
        while self._charging is not None and not self._charging.done():
            await self._charging


def _chunk_texts(chunk: Chunk) -> list[str]:
    if isinstance(chunk, ChatCompletionChunk):
        return [c.delta.content for c in chunk.choices if c.delta.content]
    return [c.text for c in chunk.choices if c.text]


def _printable(text: str) -> str:
    """Client-chosen text bound for the database, without the control characters it refuses (NUL)."""
    return text if text.isprintable() else "".join(c for c in text if c.isprintable())
