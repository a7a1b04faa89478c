"""The OpenAI layer over one engine: requests become prompt token ids and sampling parameters,
engine deltas become `ChatCompletion` / `ChatCompletionChunk` / `Completion` objects.

This is the one place that does the mapping; the engine server and the gateway's in-process
client both call it. Requests arrive checked (`engines.api.rules.check_request`, run once at the
edge: the engine server or the gateway); what is checked here are the rules of this model.

Streams always end with a usage-only chunk (`choices: []`, `usage` set), whether or not the client
asked for `stream_options.include_usage`: in-process callers charge from it, and the HTTP layer
drops it when the client did not ask.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import deque
from collections.abc import AsyncGenerator, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from engines import tool_calls
from engines.api.client import EngineUnavailable, TierLoad
from engines.api.errors import APIError, invalid, service_unavailable
from engines.api.fields import check_engine_supports
from engines.api.prompts import PromptTokenizer, chat_prompt_token_ids, completion_prompts, count_prompt_tokens
from engines.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaMessage,
    StructuredOutputs,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    new_id,
    now,
    tool_call_deltas,
)
from engines.api.rules import Decoding, check_token_ids, decoding, max_tokens_for
from engines.outputs import EngineOverloaded, EngineStepFailed, RequestOutput
from engines.outputs import TokenLogprob as EngineTokenLogprob
from engines.sampler import SAMPLER_VERSION
from engines.sampling_params import GrammarSpec, SamplingParams
from engines.structured import GrammarError

if TYPE_CHECKING:
    from engines.llm_engine import AsyncLLMEngine, LLMEngine
    from engines.metrics import EngineMetrics
    from engines.tiers import TierSpec


def sampling_params(d: Decoding, max_tokens: int, choice: int, grammar: GrammarSpec | None = None) -> SamplingParams:
    """The engine's parameters for choice `choice` of a checked request."""
    return SamplingParams(
        temperature=1.0 if d.temperature is None else d.temperature,
        top_p=1.0 if d.top_p is None else d.top_p,
        top_k=max(d.top_k or 0, 0),
        min_p=d.min_p or 0.0,
        stop_token_ids=d.stop_token_ids,
        ignore_eos=d.ignore_eos,
        repetition_penalty=1.0 if d.repetition_penalty is None else d.repetition_penalty,
        max_tokens=max(max_tokens, 1),  # `echo_only`: the token sampled after the prompt is dropped (`_run`)
        min_tokens=min(d.min_tokens, max_tokens),  # a key's output cap may have lowered max_tokens below it
        # Siblings of an `n` > 1 request must differ, yet stay reproducible under a seed.
        seed=None if d.seed is None else d.seed + choice,
        stop=d.stop,
        logprobs=d.logprobs,
        top_logprobs=d.top_logprobs,
        prompt_logprobs=d.prompt_logprobs,
        presence_penalty=d.presence_penalty,
        frequency_penalty=d.frequency_penalty,
        logit_bias=d.logit_bias,
        grammar=grammar,
        priority=d.priority,
    )


@dataclass(frozen=True)
class ChatPlan:
    """How our engine answers a chat request: what it appends to the prompt, what grammar constrains the
    reply, and how the reply is read (`tools`: None, "auto" (free text that may hold calls), "forced")."""

    suffix: str = ""
    grammar: GrammarSpec | None = None
    # The grammars to compile before the request runs, each with the field an unusable one is blamed on.
    checks: tuple[tuple[GrammarSpec, str], ...] = ()
    tools: str | None = None
    parallel_tool_calls: bool = True
    tool_names: frozenset[str] = frozenset()  # the request's tools, for replies that call them in plain JSON
    # Beside tools, the answer's grammar alone: a reply calling a function the request does not declare is
    # answered again under it (`tool_calls.invented_call`).
    answer: GrammarSpec | None = None


def _answer_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema `response_format` holds the answer to (JSON mode: any object); None for free text."""
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    assert response_format.json_schema is not None  # rules.check_response_format
    return response_format.json_schema.schema or {}


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# What our engine does anyway: one grammar library, no fallback to another; JSON without free whitespace.
_STRUCTURED_OUTPUT_NEUTRAL = ("disable_fallback", "disable_any_whitespace")


def structured_output_grammar(spec: StructuredOutputs) -> GrammarSpec:
    """vLLM's `structured_outputs` as the grammar our engine decodes under: exactly one of `json` (a JSON schema, as
    an object or its text), `regex` (matched whole), `choice` (one of these strings), `grammar` (llguidance's
    Lark-style syntax) or `json_object: true`. vLLM's other options there are refused, not ignored."""
    fields = {key: value for key, value in msgspec.structs.asdict(spec).items() if value not in (None, False)}
    unsupported = [key for key in fields if key not in STRUCTURED_OUTPUT_KINDS + _STRUCTURED_OUTPUT_NEUTRAL]
    if unsupported:
        raise invalid(f"`structured_outputs.{unsupported[0]}` is not supported by our engine",
                      f"structured_outputs.{unsupported[0]}", "unsupported_parameter")
    asked = [key for key in STRUCTURED_OUTPUT_KINDS if key in fields]
    if len(asked) != 1:
        raise invalid(f"`structured_outputs` takes exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                      "structured_outputs")
    kind, value = asked[0], fields[asked[0]]
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as exc:
            raise invalid(f"`{param}` is not valid JSON: {exc}", param, "invalid_schema") from exc
        if not isinstance(schema, dict):
            raise invalid(f"`{param}` must be a JSON schema (an object)", param, "invalid_schema")
        return GrammarSpec("json_schema", json.dumps(schema))
    if kind == "choice":
        if not value or not all(value):
            raise invalid(f"`{param}` must be a non-empty list of non-empty strings", param)
        # Lark string literals: JSON's escapes for quotes, backslashes and control characters.
        return GrammarSpec("lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    return GrammarSpec("regex" if kind == "regex" else "lark", value)


def chat_plan(request: ChatCompletionRequest, template_supports_tools: bool) -> ChatPlan:
    uses_tools = bool(request.tools) and request.tool_choice != "none"
    schema = _answer_schema(request)
    if request.structured_outputs is not None:
        if uses_tools or schema is not None:
            raise invalid("`structured_outputs` cannot be combined with `response_format` or `tools`",
                          "structured_outputs")
        grammar = structured_output_grammar(request.structured_outputs)
        return ChatPlan(grammar=grammar, checks=((grammar, "structured_outputs"),))
    answer = None if schema is None else GrammarSpec("json_schema", json.dumps(schema))
    answer_checks = () if answer is None else ((answer, "response_format"),)
    if not uses_tools:
        return ChatPlan(grammar=answer, checks=answer_checks)
    if not template_supports_tools:
        raise invalid("this model's chat template does not support tools", "tools", "unsupported_parameter")
    parallel = request.parallel_tool_calls is not False
    tools = request.tools or []
    # A forced call is this turn's whole reply: `response_format` shapes a later turn's answer, as on OpenAI.
    if forced := tool_calls.forced_tools(request):
        call = tool_calls.forced_call_grammar(forced)
        return ChatPlan(tool_calls.FORCED_PREFIX, call, ((call, "tools"),), "forced", parallel)
    names = frozenset(tool.function.name for tool in tools)
    # Strict function schemas promise valid arguments: the reply is then held to valid calls or text (as beside a
    # format); without them it is free, and calls are read from it as the model wrote them.
    if schema is None and not any(tool.function.strict for tool in tools):
        return ChatPlan(tools="auto", parallel_tool_calls=parallel, tool_names=names)
    grammar = tool_calls.calls_or_answer_grammar(tools, schema, parallel)
    checks = ((tool_calls.forced_call_grammar(tools), "tools"), *answer_checks,
              (grammar, "tools" if schema is None else "response_format"))
    return ChatPlan(grammar=grammar, checks=checks, tools="auto", parallel_tool_calls=parallel, tool_names=names,
                    answer=answer)


class _Reply:
    """Reads one choice's text as content and tool calls, as it streams or at once."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.text = ""
        self.parser = tool_calls.StreamParser(plan.tool_names)
        self.calls: list[ToolCall] = []
        self.finished = False
        self._num_fed = 0  # characters of the reply fed so far
        # Streamed logprobs not sent yet, each output's with where its text ends in the reply.
        self._waiting_logprobs: deque[tuple[int, Sequence[EngineTokenLogprob]]] = deque()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._num_fed += len(text)
        if self.plan.tools is None:
            return text, []
        if self.plan.tools == "forced":
            self.text += text
            return "", []
        return self._keep(*self.parser.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        self.finished = True
        if self.plan.tools == "forced":
            self.calls = tool_calls.parse_forced(self.text)
            return ("", self.calls) if self.calls else (self.text, [])
        if self.plan.tools is None:
            return "", []
        return self._keep(*self.parser.flush())

    def _keep(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        if not self.plan.parallel_tool_calls:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return content, calls

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def logprobs_to_send(self, logprobs: Sequence[EngineTokenLogprob]) -> list[EngineTokenLogprob]:
        """After `feed` (and `finish`) of an output: the logprobs whose text has gone out, as content or as a call.
        Text that may be a tool call is held back, and its tokens' logprobs with it, so that a chunk's logprobs
        are those of what it sends."""
        self._waiting_logprobs.append((self._num_fed, logprobs))
        num_sent = self._num_fed - self._num_held()
        ready: list[EngineTokenLogprob] = []
        while self._waiting_logprobs and self._waiting_logprobs[0][0] <= num_sent:
            ready.extend(self._waiting_logprobs.popleft()[1])
        return ready

    def _num_held(self) -> int:
        if self.finished or self.plan.tools is None:
            return 0
        return len(self.text) if self.plan.tools == "forced" else len(self.parser.buffer) + len(self.parser.blank)


def _invented(plan: ChatPlan, state: _ChoiceState) -> bool:
    """Whether a finished reply beside tools and a format calls a function the request does not declare."""
    return plan.answer is not None and tool_calls.invented_call("".join(state.text), plan.tool_names)


@dataclass(frozen=True)
class EngineCall:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    echo_only: bool = False  # `Decoding.echo_only`: the engine samples one token, which the response leaves out


@dataclass
class _ChoiceState:
    """What a choice has produced so far (for non-streamed responses and usage)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[EngineTokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[EngineTokenLogprob | None] = field(default_factory=list)  # echo with logprobs
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    started: bool = False
    last_token_time: float = 0.0


def _prompt_only(output: RequestOutput) -> RequestOutput:
    """An `echo_only` call's one delta without the token sampled after the prompt: the prompt's logprobs, no
    answer, nothing generated, finished for its length of 0."""
    return replace(output, new_token_ids=[], new_text="", logprobs=[], finished=True, finish_reason="length",
                   num_output_tokens=0)


def _response_id(calls: Sequence[EngineCall]) -> str:
    """The id of the response: its engine requests are `<id>-<choice index>`."""
    return calls[0].request_id.rsplit("-", 1)[0]


def _usage(calls: Sequence[EngineCall], states: Sequence[_ChoiceState]) -> Usage:
    """Each prompt is counted once however many choices it has (as OpenAI bills `n`); a prompt's cached
    tokens are those of its least-cached choice, so a cache hit is never over-credited."""
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    for call, state in zip(calls, states, strict=True):
        prompt_tokens[call.prompt_index] = len(call.prompt_token_ids)
        previous = cached_tokens.get(call.prompt_index)
        cached_tokens[call.prompt_index] = (
            state.num_cached_tokens if previous is None else min(previous, state.num_cached_tokens)
        )
    return Usage.of(
        prompt_tokens=sum(prompt_tokens.values()),
        completion_tokens=sum(s.num_output_tokens for s in states),
        cached_tokens=sum(cached_tokens.values()),
    )


async def _interleave(
    streams: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several engine requests as they come, tagged with their stream's position.

    Leaving early (or failing) cancels and closes every stream, which aborts its engine request."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return

    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def drain(position: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((position, output))
            queue.put_nowait((position, None))
        except Exception as exc:
            queue.put_nowait((position, exc))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        unfinished = len(tasks)
        while unfinished:
            position, item = await queue.get()
            if item is None:
                unfinished -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


# ---------------------------------------------------------------------------------------------
# The serving class
# ---------------------------------------------------------------------------------------------


class OpenAIServing:
    """OpenAI chat and text completions over one `AsyncLLMEngine`."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        *,
        tokenizer: PromptTokenizer | None = None,
        max_model_len: int | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer: PromptTokenizer = tokenizer or engine.tokenizer
        self.max_model_len = max_model_len or engine.engine.max_model_len
        self.metrics = metrics
        self.system_fingerprint = backend_fingerprint(engine.engine)

    # -- prompt accounting ------------------------------------------------------------------

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        """Prompt tokens as this engine counts them (chat template applied, a forced reply start included),
        over all prompts of a batch."""
        if isinstance(request, ChatCompletionRequest) and request.tools:
            return len(chat_prompt_token_ids(self.tokenizer, request, self._plan(request).suffix))
        return count_prompt_tokens(self.tokenizer, request)

    # -- building engine calls --------------------------------------------------------------

    def _plan(self, request: ChatCompletionRequest) -> ChatPlan:
        return chat_plan(request, getattr(self.tokenizer, "supports_tools", False))

    def _check_grammar(self, checks: Sequence[tuple[GrammarSpec, str]]) -> None:
        for grammar, param in checks:
            try:
                self.engine.engine.grammars.compile(grammar)
            except GrammarError as exc:
                raise invalid(str(exc), param, "invalid_schema") from exc

    def _calls(self, request_id: str, prompts: list[list[int]], d: Decoding,
               grammar: GrammarSpec | None = None) -> list[EngineCall]:
        check_token_ids(prompts, self.tokenizer.vocab_size)
        if any(token >= self.tokenizer.vocab_size for token in d.logit_bias):
            raise invalid(f"`logit_bias` token ids must be below {self.tokenizer.vocab_size}", "logit_bias")
        if any(token >= self.tokenizer.vocab_size for token in d.stop_token_ids):
            raise invalid(f"`stop_token_ids` must be below {self.tokenizer.vocab_size}", "stop_token_ids")
        if d.min_tokens and grammar is not None:
            raise invalid("`min_tokens` cannot be combined with `response_format`, `tools` or `structured_outputs` on "
                          "this tier: a structured answer ends where its grammar does", "min_tokens",
                          "unsupported_parameter")
        calls = []
        for prompt_index, prompt in enumerate(prompts):
            max_tokens = max_tokens_for(d, len(prompt), self.max_model_len)
            for i in range(d.n):
                index = prompt_index * d.n + i
                params = sampling_params(d, max_tokens, i, grammar)
                calls.append(EngineCall(index, prompt_index, f"{request_id}-{index}", prompt, params, d.echo_only))
        return calls

    def prepare_chat(self, request: ChatCompletionRequest) -> list[EngineCall]:
        """Map a checked chat request to engine calls; raises APIError on the rules of this model
        (context length, token ids, what our engine supports, the schema)."""
        return self._prepare_chat(request)[1]

    def _prepare_chat(self, request: ChatCompletionRequest) -> tuple[ChatPlan, list[EngineCall]]:
        check_engine_supports(request, self.model_name)
        plan = self._plan(request)
        self._check_grammar(plan.checks)
        prompt = chat_prompt_token_ids(self.tokenizer, request, plan.suffix)
        return plan, self._calls(new_id("chatcmpl"), [prompt], decoding(request), plan.grammar)

    def prepare_completion(self, request: CompletionRequest) -> list[EngineCall]:
        """Map a checked text-completion request to engine calls; raises APIError on the rules of
        this model (context length, token ids, what our engine supports)."""
        check_engine_supports(request, self.model_name)
        grammar = None
        if request.structured_outputs is not None:
            grammar = structured_output_grammar(request.structured_outputs)
            self._check_grammar(((grammar, "structured_outputs"),))
        return self._calls(new_id("cmpl"), completion_prompts(self.tokenizer, request), decoding(request), grammar)

    # -- running ----------------------------------------------------------------------------

    async def _run(
        self, calls: list[EngineCall], states: list[_ChoiceState]
    ) -> AsyncGenerator[tuple[EngineCall, RequestOutput], None]:
        """Engine outputs of all calls, with per-choice bookkeeping and latency metrics."""
        started = time.perf_counter()
        streams = [self.engine.generate(c.request_id, c.prompt_token_ids, c.params) for c in calls]
        outputs = _interleave(streams)
        try:
            async for position, output in outputs:
                if calls[position].echo_only:
                    output = _prompt_only(output)
                self._record(states[position], output, started)
                yield calls[position], output
        except ValueError as exc:  # the engine refuses requests it can never schedule
            raise APIError(400, str(exc), code="invalid_request") from exc
        except EngineOverloaded as exc:  # backpressure: the client retries, or the gateway falls back
            raise service_unavailable("The engine is at capacity. Retry shortly.", "engine_overloaded") from exc
        finally:
            await outputs.aclose()

    def _record(self, state: _ChoiceState, output: RequestOutput, started: float) -> None:
        state.text.append(output.new_text)
        state.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = output.prompt_logprobs
        state.num_prompt_tokens = output.num_prompt_tokens
        state.num_cached_tokens = output.num_cached_tokens
        state.num_output_tokens = output.num_output_tokens
        if output.finished:
            state.finish_reason = output.finish_reason
        new_tokens = len(output.new_token_ids)
        if not new_tokens:
            return
        now_s = time.perf_counter()
        if self.metrics is not None:
            if not state.started:
                self.metrics.observe_time_to_first_token(now_s - started)
                if new_tokens > 1:
                    self.metrics.observe_inter_token_latency(0.0, new_tokens - 1)
            else:
                self.metrics.observe_inter_token_latency(now_s - state.last_token_time, new_tokens)
            self.metrics.count_generated_tokens(new_tokens)
        state.started = True
        state.last_token_time = now_s

    # -- logprobs ---------------------------------------------------------------------------

    def _chat_logprobs(self, logprobs: Sequence[EngineTokenLogprob], top: int) -> list[TokenLogprob]:
        return [
            TokenLogprob(
                token=self.tokenizer.token_text(lp.token_id),
                logprob=lp.logprob,
                bytes=list(self.tokenizer.token_bytes(lp.token_id)),
                top_logprobs=[
                    TopLogprob(
                        token=self.tokenizer.token_text(token_id),
                        logprob=value,
                        bytes=list(self.tokenizer.token_bytes(token_id)),
                    )
                    for token_id, value in lp.top[:top]
                ],
            )
            for lp in logprobs
        ]

    def _completion_logprobs(
        self, logprobs: Sequence[EngineTokenLogprob], top: int, text_offset: int,
        prompt: tuple[Sequence[int], Sequence[EngineTokenLogprob | None]] = ((), ()),
    ) -> CompletionLogprobs:
        """The legacy shape, from `text_offset` on; an echoed `prompt` (token ids, their logprobs: the first None)
        comes first, as OpenAI's `echo` with `logprobs` gives it."""
        result = CompletionLogprobs()
        for token_id, lp in [*zip(*prompt, strict=True), *((lp.token_id, lp) for lp in logprobs)]:
            token = self.tokenizer.token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(lp.logprob if lp else None)
            top_texts = {self.tokenizer.token_text(t): v for t, v in lp.top[:top]} if lp and top else None
            result.top_logprobs.append(top_texts)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def _echoed_logprobs(self, request: CompletionRequest, call: EngineCall, state: _ChoiceState
                         ) -> tuple[Sequence[int], Sequence[EngineTokenLogprob | None]]:  # fmt: skip
        """The echoed prompt's tokens and logprobs where `echo` comes with `logprobs`, else none."""
        if not (request.echo and request.logprobs is not None and state.prompt_logprobs):
            return (), ()
        return call.prompt_token_ids, state.prompt_logprobs

    # -- chat -------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        plan, calls = self._prepare_chat(request)
        states = [_ChoiceState() for _ in calls]
        async for _ in self._run(calls, states):
            pass
        if again := [call for call, state in zip(calls, states, strict=True) if _invented(plan, state)]:
            async for _ in self._answer_again(plan, again, states):
                pass
        top = request.top_logprobs or 0
        choices = []
        for call, state in zip(calls, states, strict=True):
            reply = _Reply(plan)
            content, _ = reply.feed("".join(state.text))
            rest, _ = reply.finish()
            text = content + rest
            choices.append(ChatChoice(
                index=call.index,
                # With tool calls and no text besides, content is null, as OpenAI sends it.
                message=AssistantMessage(content=text if text or not reply.calls else None,
                                         tool_calls=reply.calls or None),
                finish_reason=reply.finish_reason(state.finish_reason),
                logprobs=ChoiceLogprobs(content=self._chat_logprobs(state.logprobs, top)) if request.logprobs else None,
            ))
        return ChatCompletion(
            id=_response_id(calls),
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=_usage(calls, states),
            system_fingerprint=self.system_fingerprint,
        )

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[ChatCompletionChunk, None]:
        """Validates now (raising APIError), then streams: each choice's first chunk carries the
        assistant role, its last one the finish reason; a usage-only chunk always comes last."""
        return self._chat_chunks(request, *self._prepare_chat(request))

    async def _chat_chunks(
        self, request: ChatCompletionRequest, plan: ChatPlan, calls: list[EngineCall]
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        response_id, created = _response_id(calls), now()

        def chunk_of(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=response_id, created=created, model=self.model_name, choices=choices,
                                       usage=usage, system_fingerprint=self.system_fingerprint)

        states = [_ChoiceState() for _ in calls]
        replies = {call.index: _Reply(plan) for call in calls}
        announced: set[int] = set()
        again: list[EngineCall] = []
        async for call, output in self._run(calls, states):
            if output.finished and _invented(plan, states[call.index]):
                again.append(call)  # held so far (it opens like a call): nothing of it was sent
                continue
            if chunk := self._chat_chunk(request, replies[call.index], call, output, announced):
                yield chunk_of([chunk])
        if again:
            replies.update({call.index: _Reply(plan) for call in again})
            async for call, output in self._answer_again(plan, again, states):
                if chunk := self._chat_chunk(request, replies[call.index], call, output, announced):
                    yield chunk_of([chunk])
        yield chunk_of([], _usage(calls, states))

    def _chat_chunk(self, request: ChatCompletionRequest, reply: _Reply, call: EngineCall, output: RequestOutput,
                    announced: set[int]) -> ChatChunkChoice | None:
        """What one engine output of a choice sends, if anything: the role first, then content, whole calls,
        logprobs and, at the end, the finish reason."""
        content, new_calls = reply.feed(output.new_text)
        if output.finished:
            rest, last_calls = reply.finish()
            content, new_calls = content + rest, new_calls + last_calls
        logprobs = reply.logprobs_to_send(output.logprobs) if request.logprobs else []
        if not (content or new_calls or output.finished or logprobs):
            return None
        first = call.index not in announced
        announced.add(call.index)
        first_call = len(reply.calls) - len(new_calls)
        return ChatChunkChoice(
            index=call.index,
            delta=DeltaMessage(role="assistant" if first else None,
                               content=(content or None) if new_calls else content,
                               tool_calls=tool_call_deltas(new_calls, first_call) or None),
            finish_reason=reply.finish_reason(output.finish_reason) if output.finished else None,
            logprobs=ChoiceLogprobs(content=self._chat_logprobs(logprobs, request.top_logprobs or 0))
            if request.logprobs else None,
        )

    async def _answer_again(self, plan: ChatPlan, calls: list[EngineCall], states: list[_ChoiceState]
                            ) -> AsyncGenerator[tuple[EngineCall, RequestOutput], None]:  # fmt: skip
        """Generate these choices again under the answer's grammar alone; each one's state becomes the new
        reply's, its completion tokens counting both generations and its cached prompt tokens the first's (the
        second finds the prompt cached by the first)."""
        assert plan.answer is not None
        answer = plan.answer
        again = [replace(call, request_id=f"{call.request_id}-answer", params=replace(call.params, grammar=answer))
                 for call in calls]
        fresh = [_ChoiceState() for _ in again]
        async for call, output in self._run(again, fresh):
            yield call, output
        for call, state in zip(again, fresh, strict=True):
            first = states[call.index]
            state.num_output_tokens += first.num_output_tokens
            state.num_cached_tokens = first.num_cached_tokens
            states[call.index] = state

    # -- text completions -------------------------------------------------------------------

    def _echo(self, request: CompletionRequest, call: EngineCall) -> str:
        if not request.echo:
            return ""
        prompt = request.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str):
            return prompt[call.prompt_index]  # type: ignore[return-value]
        return self.tokenizer.decode(call.prompt_token_ids)

    async def complete(self, request: CompletionRequest) -> Completion:
        calls = self.prepare_completion(request)
        states = [_ChoiceState() for _ in calls]
        async for _ in self._run(calls, states):
            pass
        choices = []
        for call, state in zip(calls, states, strict=True):
            echo = self._echo(request, call)
            prompt = self._echoed_logprobs(request, call, state)
            logprobs = (
                self._completion_logprobs(state.logprobs, request.logprobs, 0 if prompt[0] else len(echo), prompt)
                if request.logprobs is not None
                else None
            )
            choices.append(
                CompletionChoice(
                    index=call.index, text=echo + "".join(state.text), finish_reason=state.finish_reason,
                    logprobs=logprobs,
                )
            )  # fmt: skip
        return Completion(
            id=_response_id(calls),
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=_usage(calls, states),
            system_fingerprint=self.system_fingerprint,
        )

    def complete_stream(self, request: CompletionRequest) -> AsyncGenerator[Completion, None]:
        """Validates now (raising APIError), then streams text deltas; a usage-only chunk comes last."""
        return self._completion_chunks(request, self.prepare_completion(request))

    async def _completion_chunks(
        self, request: CompletionRequest, calls: list[EngineCall]
    ) -> AsyncGenerator[Completion, None]:
        response_id, created = _response_id(calls), now()
        states = [_ChoiceState() for _ in calls]
        text_offsets = {call.index: 0 for call in calls}
        echoed: set[int] = set()
        async for call, output in self._run(calls, states):
            if not (output.new_text or output.finished or (request.logprobs is not None and output.logprobs)):
                continue
            echo, prompt = "", ((), ())
            if call.index not in echoed:
                echoed.add(call.index)
                echo, prompt = self._echo(request, call), self._echoed_logprobs(request, call, states[call.index])
            logprobs = None
            if request.logprobs is not None:
                offset = text_offsets[call.index] + (0 if prompt[0] else len(echo))
                logprobs = self._completion_logprobs(output.logprobs, request.logprobs, offset, prompt)
            text = echo + output.new_text
            text_offsets[call.index] += len(text)
            choice = CompletionChoice(
                index=call.index,
                text=text,
                finish_reason=output.finish_reason if output.finished else None,
                logprobs=logprobs,
            )
            yield Completion(id=response_id, created=created, model=self.model_name, choices=[choice],
                             system_fingerprint=self.system_fingerprint)
        usage = _usage(calls, states)
        yield Completion(id=response_id, created=created, model=self.model_name, choices=[], usage=usage,
                         system_fingerprint=self.system_fingerprint)


def backend_fingerprint(engine: LLMEngine) -> str:
    """OpenAI's `system_fingerprint`: what besides the request and its seed decides the tokens here — the model's
    weights file and the precision, device and kernels its steps run with (`LLMEngine.precision`). A client that
    pins `seed` sees it change when the backend does: another CPU's int8 kernels, for one, give other bits."""
    model = Path(engine.config.model)
    identity = {"model": model.name, "bytes": model.stat().st_size if model.is_file() else None, **engine.precision(),
                "sampler": SAMPLER_VERSION}
    return "fp_" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def is_usage_chunk(chunk: ChatCompletionChunk | Completion) -> bool:
    """The usage-only chunk that ends every stream of this layer."""
    return not chunk.choices and chunk.usage is not None



# ---------------------------------------------------------------------------------------------
# The serving layer as a tier client
# ---------------------------------------------------------------------------------------------


_ResultT = TypeVar("_ResultT")
_ChunkT = TypeVar("_ChunkT")


class InProcessEngineClient:
    """A tier whose engine runs in this process (an `engines.api.client.EngineClient`). The client
    owns the engine: `close()` shuts it down.

    Streams end with a usage-only chunk (`choices: []`) whatever `stream_options` says."""

    def __init__(self, serving: OpenAIServing, deadline_s: float | None = None) -> None:
        self.serving = serving
        self.model_name = serving.model_name
        self.deadline_s = deadline_s  # a request (a whole stream too) ends by then, however busy the engine

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        return self.serving.count_prompt_tokens(request)

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        return await self._call(self.serving.chat(request))

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[ChatCompletionChunk, None]:
        return self._stream(self.serving.chat_stream(request))

    async def complete(self, request: CompletionRequest) -> Completion:
        return await self._call(self.serving.complete(request))

    def complete_stream(self, request: CompletionRequest) -> AsyncGenerator[Completion, None]:
        return self._stream(self.serving.complete_stream(request))

    async def ready(self) -> bool:
        return bool(getattr(self.serving.engine, "healthy", True))

    def load(self) -> TierLoad:
        stats = self.serving.engine.stats()
        return TierLoad(
            waiting_interactive=stats.num_waiting - stats.num_waiting_batch,
            waiting_batch=stats.num_waiting_batch,
            running=stats.num_running,
            kv_utilisation=stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0,
        )

    async def _call(self, work: Coroutine[Any, Any, _ResultT]) -> _ResultT:
        """`work` within the deadline; a failed or unhealthy engine is unavailable (the gateway may
        fall back), never a 500."""
        if not await self.ready():
            work.close()
            raise EngineUnavailable(f"{self.model_name}: the engine is recovering from a failed step")
        try:
            async with asyncio.timeout(self.deadline_s):
                return await work
        except TimeoutError as exc:
            raise EngineUnavailable(f"{self.model_name}: no answer within {self.deadline_s} s") from exc
        except EngineStepFailed as exc:
            raise EngineUnavailable(f"{self.model_name}: {exc}") from exc

    async def _stream(self, chunks: AsyncGenerator[_ChunkT, None]) -> AsyncGenerator[_ChunkT, None]:
        try:
            if not await self.ready():
                raise EngineUnavailable(f"{self.model_name}: the engine is recovering from a failed step")
            async with asyncio.timeout(self.deadline_s):
                async for chunk in chunks:
                    yield chunk
        except TimeoutError as exc:
            raise EngineUnavailable(f"{self.model_name}: the stream ran past {self.deadline_s} s") from exc
        except EngineStepFailed as exc:
            raise EngineUnavailable(f"{self.model_name}: {exc}") from exc
        finally:
            await chunks.aclose()

    async def close(self) -> None:
        await self.serving.engine.shutdown()


def build_in_process_client(
    spec: TierSpec, cache_dir: str | None = None, deadline_s: float | None = None
) -> InProcessEngineClient:
    """Load the tier's model (slow: seconds to a minute; run it in a thread from async code) and wrap
    it as a client. The engine loads and steps on the step thread; any event loop may consume its streams."""
    from engines.llm_engine import AsyncLLMEngine
    from engines.metrics import EngineMetrics

    async_engine = AsyncLLMEngine.build(spec.engine_config(cache_dir))
    metrics = EngineMetrics(spec.served_name, async_engine.stats, async_engine.engine.precision())
    return InProcessEngineClient(OpenAIServing(async_engine, spec.served_name, metrics=metrics), deadline_s)
