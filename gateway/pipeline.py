"""The request path, as plain code tested without HTTP: a sequence of small named steps.

authenticate (`gateway.auth`) → check the request (`engines.api.rules`) → route (`router`) →
budget: count prompt tokens with the target tier's tokenizer, cap the output → admit (rate limits
and spend, one atomic round trip) → call the tier, falling back when it is down (`gateway.fallback`)
→ relay the answer (`gateway.relay`) → `finish`: the one `RequestRecord`, metrics, and the spend
charge (`gateway.charges`). After admission the response cache (`gateway.cache`) is asked: a hit is
the answer (replayed as SSE for a stream), and a miss it may keep is stored once its answer is whole.

Every request that reaches the gateway ends in exactly one `finish`, success or not, streamed or
not, the client still there or gone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from engines.api.client import EngineClient
from engines.api.errors import APIError, invalid, service_unavailable
from engines.api.fields import NO_NEEDS, Capabilities, capabilities
from engines.api.protocol import (
    ChatCompletionRequest,
    Chunk,
    CompletionRequest,
    Request,
    StreamOptions,
    Usage,
    wants_stream_usage,
)
from engines.api.rules import check_request
from gateway import embeddings
from gateway.accounting import RequestRecord
from gateway.auth import Authenticator, Principal
from gateway.budgets import (
    check_amplification,
    check_prompt_length,
    check_prompt_size,
    clamp_output,
    count_prompt_tokens,
    count_prompt_tokens_off_loop,
    limits_of,
    rate_limit_headers,
    refusal,
    reservation,
)
from gateway.cache.hook import cache_policy, query_embedding
from gateway.cache.replay import as_new_response, assemble, replay
from gateway.cache.service import Lookup, ResponseCache
from gateway.capabilities import capable_tier, supports
from gateway.charges import ChargeBatcher
from gateway.config import PolicyConfig, Settings
from gateway.cost import request_cost
from gateway.counters import Admission, Charge, CounterStore, CountersUnavailable, Limits
from gateway.embeddings import EmbeddingsRequest
from gateway.fallback import Served, call_with_fallback, candidate_tiers, open_stream_with_fallback
from gateway.keys import KeyCache
from gateway.metrics import Metrics
from gateway.relay import EventStream, PassingStream, StreamAccount, relay
from gateway.routing import Router, cascade_call, cascade_stream
from gateway.slo import SloTracker
from router.cascade import CascadePlan
from router.decision import ModelNotAllowed, ModelNotFound, RouteDecision, tier_model

if TYPE_CHECKING:
    from gateway.shadow import ShadowSampler

RecordSink = Callable[[RequestRecord], None]

log = logging.getLogger("sluice.gateway")

UNIQUE_SUFFIX_LEN = 12
MAX_CLIENT_REQUEST_ID_LEN = 64 - 1 - UNIQUE_SUFFIX_LEN  # the `requests.request_id` column holds 64
CLIENT_CLOSED_REQUEST = 499  # recorded status of a request whose client left before the answer (nginx's code)
SLO_RETRY_AFTER_S = 1  # told to interactive requests refused while their tier is over its latency objective


@dataclass(slots=True)
class RequestState:
    """What one request did, gathered along its path; becomes its one `RequestRecord`."""

    request_id: str  # unique: the accounting row's key
    endpoint: str  # chat | completions
    response_id: str = ""  # answered in `x-request-id`: the client's own id when it sent one
    priority: str = "interactive"  # interactive | batch (a Batch API line: discounted)
    asked_priority: str | None = None  # the `x-sluice-priority` header
    started: float = field(default_factory=time.perf_counter)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    principal: Principal | None = None
    model_requested: str = ""
    stream: bool = False
    route: RouteDecision | None = None
    cascade: CascadePlan | None = None  # set when the small tier's answer may be escalated
    router_version: str | None = None
    # np.ndarray, of the last user message (chat) or the prompt: computed once, shared by router and cache
    prompt_embedding: Any = None
    escalated: bool = False
    confidence: float | None = None  # the small tier's, when the cascade asked for logprobs
    abandoned_cost_usd: float = 0.0  # an escalated request's small attempt
    tier: str | None = None
    fallback: bool = False
    admitted: bool = False  # counted by the limits, so its spend is settled
    admitted_at: float = 0.0  # the clock at admission: its settlement goes to the same windows
    tenant_admitted: bool = False  # also counted against its tenant's limits
    admitted_locally: bool = False  # counted in this replica's memory (Redis down, `local` mode): settled there
    reserved: Charge = field(default_factory=Charge)  # counted at admission, settled at `finish`
    counted_prompt_tokens: int = 0  # as counted before the call; usage replaces it when it comes
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0
    ttft_ms: float | None = None
    itl_ms_mean: float | None = None
    finished: bool = False
    needs: Capabilities = NO_NEEDS  # tools and response_format the request uses
    cache_control: str | None = None  # the client's Cache-Control header
    cache_status: str = "off"  # off | bypass | miss | exact | semantic
    cache_similarity: float | None = None
    cost_saved_usd: float = 0.0

    @property
    def reply_request_id(self) -> str:
        """What `x-request-id` answers: the client's own id when it sent one, else the request's."""
        return self.response_id or self.request_id


@dataclass(slots=True)
class Reply:
    """A successful answer: a JSON body, or a stream of server-sent events."""

    headers: dict[str, str]
    body: bytes = b""
    stream: EventStream | None = None


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
        router: Router | None = None,
        shadow: ShadowSampler | None = None,
        slo: SloTracker | None = None,
        cache: ResponseCache | None = None,
        embedder: Callable[[], Awaitable[Any]] | None = None,
        charge_spool: Path | None = None,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.counters = counters
        self.record_sink = record_sink
        self.metrics = metrics
        self.clock = clock
        self.keys = keys
        self.auth = Authenticator(settings, keys)
        self.charges = ChargeBatcher(counters, clock, charge_spool)
        self.router = router or Router(settings)
        self.shadow = shadow
        self.slo = slo or SloTracker(settings.tiers)
        self.cache = cache
        self.embedder = embedder  # loads (once) and returns the embedding service
        self._cache_writes: set[asyncio.Task[None]] = set()

    async def authenticate(self, authorization: str | None) -> Principal:
        return await self.auth.authenticate(authorization)

    async def chat(self, state: RequestState, request: ChatCompletionRequest) -> Reply:
        return await self._serve(state, request)

    async def complete(self, state: RequestState, request: CompletionRequest) -> Reply:
        return await self._serve(state, request)

    async def embeddings(self, state: RequestState, request: EmbeddingsRequest) -> Reply:
        return await self._serve(state, request)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait until queued charges are written (shutdown; tests that read counters)."""
        await self.charges.drain() if timeout_s is None else await self.charges.drain(timeout_s)

    @property
    def unsettled(self) -> dict[tuple[str, float], Charge]:
        return self.charges.unsettled

    # -- the steps ------------------------------------------------------------------------------

    async def _serve(self, state: RequestState, request: Request | EmbeddingsRequest) -> Reply:
        try:
            if isinstance(request, EmbeddingsRequest):
                return await self._embed(state, request)
            return await self._handle(state, request)
        except APIError as exc:
            error = _hide_internals(exc, state.request_id)
            self.finish(state, error.status_code, error.code)
            if error is exc:
                raise
            raise error from exc
        except asyncio.CancelledError:
            # The client left (the HTTP layer cancels us): the tier's work was cancelled with us.
            self.finish(state, CLIENT_CLOSED_REQUEST, "client_disconnected")
            raise

    async def _handle(self, state: RequestState, request: Request) -> Reply:
        policy = self._begin(state, request)
        if state.priority == "batch" or request.priority is not None:  # what our engines schedule by
            request = msgspec.structs.replace(request, priority=state.priority)
        check_request(request)
        check_prompt_size(request, policy)
        state.needs = capabilities(request)
        await self._route(state, request, policy)
        state.route = self._capable(state.route, state.needs, policy)
        candidates = [t for t in candidate_tiers(state.route.tier, policy, self.clients)
                      if supports(self.settings.tiers.get(t), state.needs)]
        self._check_slo(state)
        request, headers = await self._admit(state, request, candidates)
        lookup = await self._cache_begin(state, request)
        if lookup.hit is not None:
            return self._cached(state, request, lookup, headers)
        try:
            if request.stream:
                return await self._stream(state, request, candidates, headers, lookup)
            return await self._answer(state, request, candidates, headers, lookup)
        except BaseException:
            self._cache_release(lookup)
            raise

    def _begin(self, state: RequestState, request: Request) -> PolicyConfig:
        if state.principal is None:
            raise RuntimeError("authenticate before serving")
        state.model_requested = request.model
        state.stream = request.stream
        state.priority = priority_of(state, state.principal.policy)
        return state.principal.policy

    async def _route(self, state: RequestState, request: Request, policy: PolicyConfig) -> None:
        """The tier (classifier for `sluice`/`auto`) and, for the small tier, the cascade's plan."""
        try:
            routed = await self.router.route(state, request, policy, self.clients)
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
        state.route, state.cascade, state.router_version = routed.decision, routed.cascade, routed.router_version

    def _capable(self, route: RouteDecision, needs: Capabilities, policy: PolicyConfig) -> RouteDecision:
        """The route, moved to a tier that supports what the request uses when its own does not."""
        tier = capable_tier(route.tier, needs, policy.allowed_tiers, self.clients, self.settings.tiers)
        return route if tier == route.tier else RouteDecision(tier, route.score, "capability")

    def _check_slo(self, state: RequestState) -> None:
        """New interactive work for a tier over its latency objective is refused rather than queued to miss
        it too (batch work stopped earlier: `SloTracker.batch_may_run`)."""
        assert state.route is not None
        if state.priority == "interactive" and self.slo.overloaded(state.route.tier):
            raise APIError(429, f"The {state.route.tier} tier is over its latency objective right now. Retry shortly.",
                           code="slo_overloaded", type="rate_limit_error",
                           headers={"Retry-After": str(SLO_RETRY_AFTER_S)})  # fmt: skip

    async def _admit(self, state: RequestState, request: Request,
                     candidates: list[str]) -> tuple[Request, dict[str, str]]:  # fmt: skip
        """Budgets, then the counters: the request as it may run, and the reply's first headers."""
        assert state.principal is not None and state.route is not None
        policy = state.principal.policy
        state.counted_prompt_tokens = await count_prompt_tokens_off_loop(self.clients[state.route.tier], request)
        check_prompt_length(state.counted_prompt_tokens, policy)
        request, clamped = clamp_output(request, policy)
        check_amplification(request, policy)
        reserve = reservation(self.settings, candidates, request, state.counted_prompt_tokens)
        admission = await self._reserve(state, state.counted_prompt_tokens, reserve)
        headers = {"x-request-id": state.reply_request_id, "x-sluice-cache": "miss",
                   "x-sluice-route": state.route.tier, **rate_limit_headers(admission.minute)}  # fmt: skip
        if clamped:
            headers["x-sluice-max-tokens-clamped"] = str(policy.max_output_tokens)
        return request, headers

    async def _reserve(self, state: RequestState, prompt_tokens: int, reserve: Charge) -> Admission:
        """Admit the request against its key's limits and its tenant's (one atomic round trip), counting
        it and reserving `reserve` for both; the state keeps what its settlement needs."""
        principal = state.principal
        assert principal is not None
        now = self.clock()
        tenant = self._tenant_limits(principal)
        admission = await self._count(principal.subject, limits_of(principal.policy), prompt_tokens, now, reserve,
                                      tenant)  # fmt: skip
        state.admitted, state.admitted_at, state.reserved = True, now, reserve
        state.admitted_locally, state.tenant_admitted = admission.local, bool(tenant)
        return admission

    def _tenant_limits(self, principal: Principal) -> list[tuple[str, Limits]]:
        """The tenant's own limits, over all its keys, when it has any: admitted with the key's."""
        tenant = self.settings.tenants.get(principal.tenant)
        if tenant is None or principal.key_id is None:
            return []
        limits = Limits(tenant.rpm, tenant.tpm, tenant.spend_per_day_usd, tenant.spend_per_month_usd)
        return [(tenant_subject(principal.tenant), limits)]

    async def _count(self, subject: str, limits: Limits, prompt_tokens: int, now: float, reserve: Charge,
                     also: list[tuple[str, Limits]]) -> Admission:  # fmt: skip
        """Admit the request against its rate limits and budgets (its key's, and `also` its tenant's),
        counting it and reserving its worst case for each, all or none (one atomic round trip)."""
        try:
            admission = await self.counters.admit(subject, limits, prompt_tokens, now, reserve, also)
        except CountersUnavailable as exc:
            # Fail closed: without the shared counters no limit or budget could hold.
            raise service_unavailable(
                "Rate limits and budgets cannot be checked right now. Retry later.", "limits_unavailable"
            ) from exc
        if not admission.admitted:
            raise refusal(admission, [limits, *(its for _, its in also)][admission.refused_subject])
        return admission

    async def _answer(self, state: RequestState, request: Request, candidates: list[str],
                      headers: dict[str, str], lookup: Lookup) -> Reply:  # fmt: skip
        """A whole answer, from the first tier that can serve."""

        async def call(tier: str, client: EngineClient, request: Request = request) -> Any:
            with self._in_flight(tier):
                if isinstance(request, ChatCompletionRequest):
                    return await client.chat(request)
                return await client.complete(request)

        if state.cascade is not None:
            served = await cascade_call(self, state, request, candidates, call)
        else:
            served = await call_with_fallback(self.clients, candidates, call)
        self._served(state, served)
        self._charge_usage(state, served.value.usage)
        _cascade_headers(state, headers)
        headers["x-sluice-tier"] = served.tier
        headers["x-sluice-cost-usd"] = f"{state.cost_usd:.8f}"
        served.value.model = tier_model(served.tier)  # a name clients can send back, whatever the tier calls itself
        body = msgspec.json.encode(served.value)
        if lookup.leader and self.cache is not None:
            await self.cache.store(lookup, body, state.cost_usd)
        self.finish(state, 200)
        if self.shadow is not None:
            self.shadow.maybe_submit(state, request, served.value)
        return Reply(headers=headers, body=body)

    async def _stream(self, state: RequestState, request: Request, candidates: list[str],
                      headers: dict[str, str], lookup: Lookup) -> Reply:  # fmt: skip
        """A stream from the first tier that produced its first chunk; relayed as it comes."""
        # Upstream always reports usage: spend is charged from it whether or not the client wants it.
        upstream = msgspec.structs.replace(request, stream_options=StreamOptions(include_usage=True))

        def open_stream(client: EngineClient) -> AsyncIterator[Any]:
            if isinstance(upstream, ChatCompletionRequest):
                return client.chat_stream(upstream)
            return client.complete_stream(upstream)

        served = await self._open(state, upstream, candidates, open_stream)
        state.ttft_ms = (time.perf_counter() - state.started) * 1000
        _cascade_headers(state, headers)
        headers["x-sluice-tier"] = served.tier
        first, rest = served.value
        kept: list[Chunk] = []  # what the cache keeps of a led miss
        model = tier_model(served.tier)

        def passing(chunk: Chunk) -> None:
            chunk.model = model  # a name clients can send back, whatever the tier calls itself
            if lookup.leader:
                kept.append(chunk)

        passing(first)
        rest = PassingStream(rest, passing)

        def end(account: StreamAccount) -> None:
            self._end_stream(state, account, request)
            if lookup.leader:
                whole = account.error_code is None and account.usage is not None
                self._cache_store_later(lookup, assemble(kept, account.usage) if whole else None, state.cost_usd)

        events = relay(first, rest, wants_stream_usage(request.stream_options), end)
        return Reply(headers=headers, stream=EventStream(events))

    async def _open(self, state: RequestState, upstream: Request, candidates: list[str],
                    open_stream: Callable[[EngineClient], AsyncIterator[Any]]) -> Served[Any]:  # fmt: skip
        """Open the stream (through the cascade's decision window when it has a plan), counted in flight
        on the tier serving it until `_end_stream`."""
        assert state.route is not None
        self._enter(state.route.tier)
        try:
            if state.cascade is not None:
                served = await cascade_stream(self, state, upstream, candidates, open_stream)
            else:
                served = await open_stream_with_fallback(self.clients, candidates, open_stream)
        except BaseException:
            self._leave(state.route.tier)
            raise
        if served.tier != state.route.tier:
            self._leave(state.route.tier)
            self._enter(served.tier)
        self._served(state, served)
        return served

    def _end_stream(self, state: RequestState, account: StreamAccount, request: Request) -> None:
        assert state.tier is not None
        self._leave(state.tier)
        state.itl_ms_mean = account.itl_ms_mean()
        self._charge_usage(state, account.usage or self._produced_usage(state, account.texts))
        self.finish(state, 200, account.error_code)
        if self.shadow is not None and account.error_code is None:
            self.shadow.maybe_submit(state, request, "".join(account.texts))

    def _produced_usage(self, state: RequestState, texts: list[str]) -> Usage:
        """Usage of a stream that ended before its usage chunk (the client left): the prompt as
        counted up front, the text produced so far counted with the serving tier's tokenizer."""
        assert state.tier is not None
        text = "".join(texts)
        completion_tokens = 0
        if text:
            client = self.clients[state.tier]
            completion_tokens = count_prompt_tokens(client, CompletionRequest(model=state.tier, prompt=text))
        return Usage.of(state.counted_prompt_tokens, completion_tokens)

    # -- response cache -------------------------------------------------------------------------

    async def _cache_begin(self, state: RequestState, request: Request) -> Lookup:
        principal, route = state.principal, state.route
        if self.cache is None or principal is None or route is None:
            return Lookup("off")
        lookup = await self.cache.begin(
            request, cache_policy(principal.policy), tenant=principal.tenant, feature=principal.feature,
            endpoint=state.endpoint, tier=route.tier, control=state.cache_control, embedding=state.prompt_embedding,
        )  # fmt: skip
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

    def _cached(self, state: RequestState, request: Request, lookup: Lookup, headers: dict[str, str]) -> Reply:
        """A hit is the answer: nothing is generated, spent or charged; what it saved is recorded."""
        hit = lookup.hit
        assert hit is not None
        state.cache_similarity, state.cost_saved_usd = hit.similarity, hit.entry.cost_usd
        headers["x-sluice-cache"] = hit.status
        headers["x-sluice-cost-usd"] = f"{0.0:.8f}"
        body = as_new_response(hit.entry.body, state.endpoint)
        if not request.stream:
            self.finish(state, 200)
            return Reply(headers=headers, body=body)
        events = replay(body, state.endpoint, wants_stream_usage(request.stream_options))
        state.ttft_ms = (time.perf_counter() - state.started) * 1000
        return Reply(headers=headers, stream=EventStream(self._replay(state, events)))

    async def _replay(self, state: RequestState, events: list[bytes]) -> AsyncGenerator[bytes, None]:
        try:
            for event in events:
                yield event
        finally:
            self.finish(state, 200)

    # -- embeddings -----------------------------------------------------------------------------

    async def _embed(self, state: RequestState, request: EmbeddingsRequest) -> Reply:
        """Admitted and accounted like a completion: its tokens count against the key's limits."""
        principal = state.principal
        if principal is None or self.embedder is None:
            raise RuntimeError("authenticate before serving; the embedding service is not configured")
        state.model_requested = request.model
        embedder = await self.embedder()
        texts = embeddings.texts_of(request, embedder.dim)
        # On a worker thread: 2,048 long texts take the tokenizer seconds, which the event loop must not wait out.
        tokens = state.counted_prompt_tokens = await asyncio.to_thread(embedder.count_tokens, texts)
        check_prompt_length(tokens, principal.policy)
        admission = await self._reserve(state, tokens, Charge())  # nothing reserved: embeddings have no price
        vectors = await embedder.embed_async(texts)
        state.tier, state.prompt_tokens = "embed", tokens
        body = msgspec.json.encode(embeddings.response(vectors, tokens, request.encoding_format))
        self.finish(state, 200)
        headers = {"x-request-id": state.reply_request_id, **rate_limit_headers(admission.minute)}
        return Reply(headers=headers, body=body)

    # -- accounting -----------------------------------------------------------------------------

    @staticmethod
    def _served(state: RequestState, served: Served[Any]) -> None:
        state.tier, state.fallback = served.tier, served.fallback

    def _charge_usage(self, state: RequestState, usage: Usage | None) -> None:
        if usage is None or state.tier is None:
            return
        state.prompt_tokens = usage.prompt_tokens
        state.completion_tokens = usage.completion_tokens
        state.cached_tokens = usage.cached_tokens
        tier = self.settings.tiers[state.tier]
        state.cost_usd = request_cost(tier, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        state.cost_usd += state.abandoned_cost_usd
        if state.priority == "batch":
            state.cost_usd *= 1.0 - self.settings.batch.discount

    @contextmanager
    def _in_flight(self, tier: str) -> Iterator[None]:
        self._enter(tier)
        try:
            yield
        finally:
            self._leave(tier)

    def _enter(self, tier: str) -> None:
        self.metrics.in_flight_of(tier).inc()

    def _leave(self, tier: str) -> None:
        self.metrics.in_flight_of(tier).dec()

    def finish(self, state: RequestState, status: int, error_code: str | None = None) -> None:
        """Record the request once: accounting row, metrics, and (if admitted) its spend."""
        if state.finished:
            return
        state.finished = True
        if state.principal is None:
            # Refused before anyone was known (a bad or missing key): a metric, not a row, so that
            # unauthenticated traffic cannot fill the accounting table.
            self.metrics.count_unauthenticated(error_code or str(status))
            return
        record = record_of(state, status, error_code)
        self.record_sink(record)
        self.metrics.observe(record)
        interactive_success = status == 200 and record.tier is not None and record.priority == "interactive"
        if interactive_success and self.slo.observe(record.tier or "", record.ttft_ms, record.itl_ms_mean):
            self.metrics.count_goodput(record.tier or "")
        if state.admitted:
            self._settle(state, state.principal.subject, status)

    def _settle(self, state: RequestState, subject: str, status: int) -> None:
        """Replace the request's reservation by what it cost. A non-streamed request whose client
        left keeps its reservation: its tier was cancelled midway, and what it had produced by then
        is not known, so the worst case is what it is charged."""
        if status == CLIENT_CLOSED_REQUEST and not state.stream and state.tier is None:
            return
        produced = Charge(state.completion_tokens, state.cost_usd)
        if produced != state.reserved:
            local = state.admitted_locally
            self.charges.charge(subject, produced - state.reserved, state.admitted_at, local)
            if state.tenant_admitted and state.principal is not None:
                self.charges.charge(tenant_subject(state.principal.tenant), produced - state.reserved,
                                    state.admitted_at, local)  # fmt: skip


def priority_of(state: RequestState, policy: PolicyConfig) -> str:
    """The request's scheduling class: batch for a Batch API line, else the header's where the key's policy
    lets it choose, else the policy's."""
    asked = state.asked_priority
    if state.priority == "batch" or asked is None:
        return "batch" if state.priority == "batch" else policy.priority
    if not policy.choose_priority:
        raise APIError(403, "This key may not choose its priority; drop the `x-sluice-priority` header.",
                       code="priority_not_allowed", param="x-sluice-priority")  # fmt: skip
    if asked not in ("interactive", "batch"):
        raise invalid("`x-sluice-priority` must be interactive or batch.", "x-sluice-priority")
    return asked


def tenant_subject(tenant: str) -> str:
    """Whose counters a tenant's own limits use (never a key id: those are UUIDs)."""
    return f"tenant:{tenant}"


def _hide_internals(exc: APIError, request_id: str) -> APIError:
    """A tier's own failure (`server_error`: its internals, paths, addresses) becomes a 500 that names
    the request id, the details going to the log; refusals and our 503s pass unchanged."""
    if exc.type != "server_error":
        return exc
    log.error("request %s: the tier failed: %s", request_id, exc.message)
    message = f"The model tier failed to handle the request (request id {request_id})."
    return APIError(500, message, code="tier_error", type="server_error")


def record_of(state: RequestState, status: int, error_code: str | None) -> RequestRecord:
    """The request's one accounting row."""
    principal, route = state.principal, state.route
    return RequestRecord(
        request_id=state.request_id,
        tenant=principal.tenant if principal else "",
        feature=principal.feature if principal else "",
        created_at=state.created_at,
        key_id=principal.key_id if principal else None,
        endpoint=state.endpoint,
        model_requested=_printable(state.model_requested)[:128],
        route=route.tier if route else None,
        route_score=route.score if route else None,
        tier=state.tier,
        escalated=state.escalated,
        confidence=state.confidence,
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
        used_tools=state.needs.uses_tools,
        response_format=state.needs.response_format,
        priority=state.priority,
    )


def _cascade_headers(state: RequestState, headers: dict[str, str]) -> None:
    headers["x-sluice-escalated"] = "true" if state.escalated else "false"
    if state.confidence is not None:
        headers["x-sluice-confidence"] = f"{state.confidence:.4f}"


def _printable(text: str) -> str:
    """Client-chosen text bound for the database, without the control characters it refuses (NUL)."""
    return text if text.isprintable() else "".join(c for c in text if c.isprintable())
