"""The OpenAI layer over one engine: requests become prompt token ids and sampling parameters,
engine deltas become `ChatCompletion` / `ChatCompletionChunk` / `Completion` objects.

This is the one place that does the mapping; the engine server and the gateway's in-process
client both call it. Streams always end with a usage-only chunk (`choices: []`, `usage` set),
whether or not the client asked for `stream_options.include_usage`: in-process callers charge
from it, and the HTTP layer drops it when the client did not ask.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from engines.outputs import RequestOutput
from engines.outputs import TokenLogprob as EngineTokenLogprob
from engines.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
    now,
    stop_list,
)
from engines.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engines.llm_engine import AsyncLLMEngine
    from engines.metrics import EngineMetrics

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5  # OpenAI's limit for the legacy completions endpoint
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class OpenAIError(Exception):
    """A request the API refuses, carrying the OpenAI error body and its HTTP status.

    Raised by `OpenAIServing` and `HttpEngineClient`; the engine server and the gateway both turn it
    into `{"error": {...}}` with `status_code`.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)

    @classmethod
    def from_detail(cls, detail: ErrorDetail, status_code: int) -> OpenAIError:
        return cls(detail.message, status_code=status_code, type=detail.type, param=detail.param, code=detail.code)

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=self.detail)


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(message, param=param, code=code)


RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)
_ERROR_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Parse a request body, turning malformed JSON and mistyped fields into a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        path = _ERROR_PATH.search(str(exc))
        param = path.group(1) if path and path.group(1) else None
        raise invalid(f"invalid request: {exc}", param, "invalid_type") from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc


class PromptTokenizer(Protocol):
    """What the OpenAI layer needs from `engines.tokenizer.Tokenizer`."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


# ---------------------------------------------------------------------------------------------
# Requests → prompts and sampling parameters
# ---------------------------------------------------------------------------------------------


def chat_template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Wire messages → the plain dicts a chat template reads. Only text content is supported."""
    if not messages:
        raise invalid("`messages` must contain at least one message", "messages", "empty_array")
    converted = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role: unsupported role {message.role!r}; expected one of {sorted(CHAT_ROLES)}",
                f"messages[{i}].role",
            )
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    raise invalid(
                        f"messages[{i}].content[{j}]: content of type {part.type!r} is not supported; "
                        "this model reads text only",
                        f"messages[{i}].content[{j}].type",
                    )
        # "developer" is OpenAI's newer name for the system role; open chat templates know only "system".
        role = "system" if message.role == "developer" else message.role
        converted.append({"role": role, "content": message.text()})
    return converted


def chat_prompt_token_ids(tokenizer: PromptTokenizer, request: ChatCompletionRequest) -> list[int]:
    try:
        return tokenizer.apply_chat_template(chat_template_messages(request.messages))
    except ValueError as exc:  # no template, or the template rejects these messages (e.g. roles must alternate)
        raise invalid(str(exc), "messages", "invalid_messages") from exc


def completion_prompts(tokenizer: PromptTokenizer, request: CompletionRequest) -> list[list[int]]:
    """One token-id list per prompt: a string, strings, token ids, or lists of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer.encode(p) for p in prompt]  # type: ignore[arg-type]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
    else:
        raise invalid("`prompt` must be a string, a list of strings, or token ids", "prompt", "invalid_type")
    for i, ids in enumerate(prompts):
        if not ids:
            raise invalid(f"prompt {i} is empty", "prompt", "empty_prompt")
    return prompts


def _check_range(value: float | None, low: float, high: float, param: str, low_open: bool = False) -> None:
    if value is None:
        return
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"`{param}` must be in {bracket}{low}, {high}]; got {value}", param)


@dataclass(frozen=True)
class _Decoding:
    """The request fields shared by both endpoints, validated once."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    n: int
    stop: list[str]
    seed: int | None
    output_limit: int | None
    logprobs: bool
    top_logprobs: int
    output_limit_param: str


def _validated(decoding: _Decoding) -> _Decoding:
    _check_range(decoding.temperature, 0.0, 2.0, "temperature")
    _check_range(decoding.top_p, 0.0, 1.0, "top_p", low_open=True)
    if decoding.top_k is not None and decoding.top_k < -1:
        raise invalid("`top_k` must be -1 or 0 (off) or a positive number of tokens", "top_k")
    if not 1 <= decoding.n <= MAX_N:
        raise invalid(f"`n` must be between 1 and {MAX_N}; got {decoding.n}", "n")
    if len(decoding.stop) > MAX_STOP_STRINGS:
        raise invalid(f"`stop` takes at most {MAX_STOP_STRINGS} sequences; got {len(decoding.stop)}", "stop")
    if decoding.output_limit is not None and decoding.output_limit < 1:
        raise invalid(
            f"`{decoding.output_limit_param}` must be at least 1; got {decoding.output_limit}",
            decoding.output_limit_param,
        )
    return decoding


def _sampling_params(decoding: _Decoding, num_prompt_tokens: int, max_model_len: int, choice: int) -> SamplingParams:
    remaining = max_model_len - num_prompt_tokens
    if remaining < 1:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens} "
            "tokens, leaving no room for a completion.",
            param="messages",
            code="context_length_exceeded",
        )
    max_tokens = decoding.output_limit if decoding.output_limit is not None else remaining
    if max_tokens > remaining:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or `{decoding.output_limit_param}`.",
            param=decoding.output_limit_param,
            code="context_length_exceeded",
        )
    return SamplingParams(
        temperature=1.0 if decoding.temperature is None else decoding.temperature,
        top_p=1.0 if decoding.top_p is None else decoding.top_p,
        top_k=max(decoding.top_k or 0, 0),
        max_tokens=max_tokens,
        # Siblings of an `n` > 1 request must differ, yet stay reproducible under a seed.
        seed=None if decoding.seed is None else decoding.seed + choice,
        stop=decoding.stop,
        logprobs=decoding.logprobs,
        top_logprobs=decoding.top_logprobs,
    )


def _chat_decoding(request: ChatCompletionRequest) -> _Decoding:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise invalid(f"`{name}` is not supported by this engine; omit it or send 0", name, "unsupported_parameter")
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise invalid("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        _check_range(request.top_logprobs, 0, MAX_TOP_LOGPROBS_CHAT, "top_logprobs")
    return _validated(
        _Decoding(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            n=request.n,
            stop=[s for s in stop_list(request.stop) if s],
            seed=request.seed,
            output_limit=request.output_limit(),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
            output_limit_param="max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
        )
    )


def _completion_decoding(request: CompletionRequest) -> _Decoding:
    if request.logprobs is not None:
        _check_range(request.logprobs, 0, MAX_LOGPROBS_COMPLETION, "logprobs")
        if request.echo:
            raise invalid(
                "`echo` together with `logprobs` (prompt logprobs) is not supported", "echo", "unsupported_parameter"
            )
    return _validated(
        _Decoding(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            n=request.n,
            stop=[s for s in stop_list(request.stop) if s],
            seed=request.seed,
            output_limit=request.max_tokens,
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
            output_limit_param="max_tokens",
        )
    )


@dataclass(frozen=True)
class EngineCall:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _ChoiceState:
    """What a choice has produced so far (for non-streamed responses and usage)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[EngineTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    started: bool = False
    last_token_time: float = 0.0


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

    # -- prompt accounting ------------------------------------------------------------------

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        """Prompt tokens as this engine counts them (chat template applied), over all prompts of a batch."""
        if isinstance(request, ChatCompletionRequest):
            return len(chat_prompt_token_ids(self.tokenizer, request))
        return sum(len(ids) for ids in completion_prompts(self.tokenizer, request))

    # -- building engine calls --------------------------------------------------------------

    def _calls(self, request_id: str, prompts: list[list[int]], decoding: _Decoding) -> list[EngineCall]:
        vocab_size = self.tokenizer.vocab_size
        calls = []
        for prompt_index, prompt in enumerate(prompts):
            if any(not 0 <= t < vocab_size for t in prompt):
                raise invalid(f"prompt {prompt_index} has token ids outside [0, {vocab_size})", "prompt")
            for i in range(decoding.n):
                index = prompt_index * decoding.n + i
                params = _sampling_params(decoding, len(prompt), self.max_model_len, i)
                calls.append(EngineCall(index, prompt_index, f"{request_id}-{index}", prompt, params))
        return calls

    def prepare_chat(self, request: ChatCompletionRequest) -> list[EngineCall]:
        """Validate a chat request and map it to engine calls; raises OpenAIError."""
        decoding = _chat_decoding(request)
        prompt = chat_prompt_token_ids(self.tokenizer, request)
        return self._calls(new_id("chatcmpl"), [prompt], decoding)

    def prepare_completion(self, request: CompletionRequest) -> list[EngineCall]:
        """Validate a text-completion request and map it to engine calls; raises OpenAIError."""
        decoding = _completion_decoding(request)
        return self._calls(new_id("cmpl"), completion_prompts(self.tokenizer, request), decoding)

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
                self._record(states[position], output, started)
                yield calls[position], output
        except ValueError as exc:  # the engine refuses requests it can never schedule
            raise OpenAIError(str(exc), code="invalid_request") from exc
        finally:
            await outputs.aclose()

    def _record(self, state: _ChoiceState, output: RequestOutput, started: float) -> None:
        state.text.append(output.new_text)
        state.logprobs.extend(output.logprobs)
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
        self, logprobs: Sequence[EngineTokenLogprob], top: int, text_offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for lp in logprobs:
            token = self.tokenizer.token_text(lp.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(lp.logprob)
            result.top_logprobs.append({self.tokenizer.token_text(t): v for t, v in lp.top[:top]} if top else None)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    # -- chat -------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        calls = self.prepare_chat(request)
        states = [_ChoiceState() for _ in calls]
        async for _ in self._run(calls, states):
            pass
        top = request.top_logprobs or 0
        choices = [
            ChatChoice(
                index=call.index,
                message=AssistantMessage(content="".join(state.text)),
                finish_reason=state.finish_reason,
                logprobs=ChoiceLogprobs(content=self._chat_logprobs(state.logprobs, top)) if request.logprobs else None,
            )
            for call, state in zip(calls, states, strict=True)
        ]
        return ChatCompletion(
            id=_response_id(calls),
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=_usage(calls, states),
        )

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[ChatCompletionChunk, None]:
        """Validates now (raising OpenAIError), then streams: each choice's first chunk carries the
        assistant role, its last one the finish reason; a usage-only chunk always comes last."""
        return self._chat_chunks(request, self.prepare_chat(request))

    async def _chat_chunks(
        self, request: ChatCompletionRequest, calls: list[EngineCall]
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        response_id, created = _response_id(calls), now()
        states = [_ChoiceState() for _ in calls]
        announced: set[int] = set()
        top = request.top_logprobs or 0
        async for call, output in self._run(calls, states):
            if not (output.new_text or output.finished or (request.logprobs and output.logprobs)):
                continue
            first = call.index not in announced
            announced.add(call.index)
            choice = ChatChunkChoice(
                index=call.index,
                delta=DeltaMessage(role="assistant" if first else None, content=output.new_text),
                finish_reason=output.finish_reason if output.finished else None,
                logprobs=(
                    ChoiceLogprobs(content=self._chat_logprobs(output.logprobs, top)) if request.logprobs else None
                ),
            )
            yield ChatCompletionChunk(id=response_id, created=created, model=self.model_name, choices=[choice])
        yield ChatCompletionChunk(
            id=response_id, created=created, model=self.model_name, choices=[], usage=_usage(calls, states)
        )

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
            logprobs = (
                self._completion_logprobs(state.logprobs, request.logprobs, len(echo))
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
        )

    def complete_stream(self, request: CompletionRequest) -> AsyncGenerator[Completion, None]:
        """Validates now (raising OpenAIError), then streams text deltas; a usage-only chunk comes last."""
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
            echo = ""
            if call.index not in echoed:
                echoed.add(call.index)
                echo = self._echo(request, call)
            logprobs = None
            if request.logprobs is not None:
                offset = text_offsets[call.index] + len(echo)
                logprobs = self._completion_logprobs(output.logprobs, request.logprobs, offset)
            text = echo + output.new_text
            text_offsets[call.index] += len(text)
            choice = CompletionChoice(
                index=call.index,
                text=text,
                finish_reason=output.finish_reason if output.finished else None,
                logprobs=logprobs,
            )
            yield Completion(id=response_id, created=created, model=self.model_name, choices=[choice])
        usage = _usage(calls, states)
        yield Completion(id=response_id, created=created, model=self.model_name, choices=[], usage=usage)


def is_usage_chunk(chunk: ChatCompletionChunk | Completion) -> bool:
    """The usage-only chunk that ends every stream of this layer."""
    return not chunk.choices and chunk.usage is not None

