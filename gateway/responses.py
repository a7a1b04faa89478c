"""The Responses API (`POST /v1/responses`) over the chat pipeline.

A request is translated to a chat completion request and served like any other (routing, the cascade,
the cache, limits, accounting: the row's endpoint is `chat`); its answer is translated back, into a
`response` object or into the Responses API's typed server-sent events (`response.created` …
`response.completed`), so `client.responses.create(...)` and `client.responses.stream(...)` of the
official SDK work unchanged.

Stateless, as the gateway's replicas are: nothing is stored, so what needs a stored response or
conversation (`previous_response_id`, `conversation`, `background`, `prompt` templates, item references)
is refused with a 400 naming the field, as is `store: true`; so are inputs our tiers cannot read (images,
files, reasoning items) and tools other than functions. Every response answers `store: false`.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engines.api.errors import APIError
from engines.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
    ToolCall,
)
from gateway.pipeline import Gateway, Reply, RequestState
from gateway.relay import EventStream

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SERVED_AS = "chat"  # the endpoint a Responses request is served and accounted as


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # input_text | output_text (input_image, input_file, … are refused)
    text: str | None = None
    annotations: Any = None
    logprobs: Any = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`: a message (the default type), a function call, or a function call's output."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def is_strict(self) -> bool:
        """Responses function tools are strict unless `strict: false` says otherwise (OpenAI's function-calling
        guide: omitted, Responses holds calls to the schema; Chat Completions does not)."""
        return self.strict is not False


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # text | json_object | json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    # Refused when set: they need a stored response or conversation (or a reasoning model).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    max_tool_calls: int | None = None


def _refuse(message: str, param: str, code: str = "unsupported_parameter") -> APIError:
    return APIError(400, message, code=code, param=param)


# -- request ----------------------------------------------------------------------------------------


def to_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers `request`, or a 400 for what it cannot express."""
    _check_stateless(request)
    logprobs = LOGPROBS_INCLUDE in (request.include or [])
    return ChatCompletionRequest(
        model=request.model,
        messages=_messages(request),
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        logprobs=logprobs,
        top_logprobs=request.top_logprobs if logprobs else None,
        tools=[_tool(tool, i) for i, tool in enumerate(request.tools)] if request.tools else None,
        tool_choice=_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request.text),
        stream=request.stream,
        stream_options=StreamOptions(include_usage=True) if request.stream else None,
        user=request.user,
        metadata=request.metadata,
        safety_identifier=request.safety_identifier,
        prompt_cache_key=request.prompt_cache_key,
        # Forwarded to HTTP tiers and refused by our engines, as in a chat request.
        reasoning_effort=(request.reasoning or {}).get("effort"),
        verbosity=request.text.verbosity if request.text is not None else None,
        service_tier=request.service_tier,
    )


def _check_stateless(request: ResponsesRequest) -> None:
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(request, name) is not None:
            raise _refuse(f"`{name}` needs a stored response or conversation, and Sluice stores none: send the "
                          "whole conversation in `input`", name)
    if request.store:
        raise _refuse("`store: true` is not supported: Sluice stores no responses (omit it; responses answer "
                      "`store: false`)", "store")
    if request.background:
        raise _refuse("`background` responses are not supported: Sluice stores no responses", "background")
    if request.max_tool_calls is not None:
        raise _refuse("`max_tool_calls` is not supported; limit calls with `tool_choice`", "max_tool_calls")
    if (request.reasoning or {}).get("summary") is not None:
        raise _refuse("`reasoning.summary` is not supported: Sluice answers no reasoning items", "reasoning")
    if request.truncation not in (None, "disabled"):
        raise _refuse("only `truncation: \"disabled\"` is supported: an input over the prompt budget is a 400",
                      "truncation")
    for value in request.include or []:
        if value != LOGPROBS_INCLUDE:
            raise _refuse(f"`include` value `{value}` is not supported (only `{LOGPROBS_INCLUDE}`)", "include")


def _messages(request: ResponsesRequest) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
    items = [InputItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    unanswered: list[str] = []  # call ids of `function_call` items without their output yet
    for i, item in enumerate(items):
        if item.type == "message":
            messages.append(ChatMessage(role=_role(item.role, i), content=_text(item.content, f"input[{i}].content")))
        elif item.type == "function_call":
            _append_call(messages, item, i)
            unanswered.append(item.call_id or "")
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise _refuse("a `function_call_output` item needs `call_id`", f"input[{i}]", "invalid_value")
            if item.call_id not in unanswered:  # stateless: the call it answers must be in `input`, before it
                raise _refuse(f"no `function_call` item before this output has the call_id {item.call_id!r}",
                              f"input[{i}].call_id", "invalid_value")
            unanswered.remove(item.call_id)
            output = _text(item.output, f"input[{i}].output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        else:
            raise _refuse(f"input items of type `{item.type}` are not supported (message, function_call, "
                          "function_call_output)", f"input[{i}].type")
    if not messages:
        raise _refuse("`input` must hold at least one item", "input", "invalid_value")
    if unanswered:
        raise _refuse(f"no `function_call_output` item answers the call(s) {unanswered}", "input", "invalid_value")
    return messages


def _append_call(messages: list[ChatMessage], item: InputItem, index: int) -> None:
    """A function call joins the assistant turn before it (its text, its other calls), else starts one."""
    if item.call_id is None or item.name is None:
        raise _refuse("a `function_call` item needs `call_id` and `name`", f"input[{index}]", "invalid_value")
    call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments or "{}"))
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _role(role: str | None, index: int) -> str:
    if role in ("user", "assistant", "system"):
        return role
    if role == "developer":  # the Responses API's name for the system turn
        return "system"
    raise _refuse(f"message role `{role}` is not one of user, assistant, system, developer", f"input[{index}].role",
                  "invalid_value")


def _text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type not in ("input_text", "output_text"):
            raise _refuse(f"content of type `{part.type}` is not supported: these models read text "
                          "(input_text, output_text)", param)
        if part.text is None:
            raise _refuse(f"a `{part.type}` part needs `text`", param, "missing_required_parameter")
        texts.append(part.text)
    return "".join(texts)


def _tool(tool: FunctionTool, index: int) -> Tool:
    if tool.type != "function" or not tool.name:
        raise _refuse(f"tools of type `{tool.type}` are not supported (function tools with a name)",
                      f"tools[{index}]")
    return Tool(type="function", function=FunctionDefinition(name=tool.name, description=tool.description,
                                                             parameters=tool.parameters, strict=tool.is_strict))


def _tool_choice(choice: str | ToolChoiceFunction | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise _refuse(f"`tool_choice` of type `{choice.type}` is not supported (none, auto, required, or a "
                      "function by name)", "tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=fmt.name or "response", schema=fmt.schema, description=fmt.description, strict=fmt.strict))
    raise _refuse(f"`text.format` of type `{fmt.type}` is not supported (text, json_object, json_schema)",
                  "text.format")


# -- response ---------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{random.getrandbits(96):024x}"  # as `request_ids`: no system call per id


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    return part if logprobs is None else {**part, "logprobs": logprobs}


def _message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def _logprobs(chat_logprobs: dict[str, Any] | None) -> list[Any]:
    return [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes") or [],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"], "bytes": top.get("bytes") or []}
                              for top in t.get("top_logprobs") or []]}
            for t in (chat_logprobs or {}).get("content") or []]


@dataclass
class ResponseShell:
    """What a response object repeats of its request, and its identity."""

    request: ResponsesRequest
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def object(self, model: str, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               incomplete: dict[str, str] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                  "strict": t.is_strict} for t in request.tools or []]
        choice = request.tool_choice
        text_format = request.text.format if request.text is not None and request.text.format else TextFormat()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": model,
            "output": output, "usage": usage, "error": error, "incomplete_details": incomplete,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls is not False, "tools": tools,
            "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
            "text": {"format": msgspec.to_builtins(text_format)}, "truncation": "disabled",
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "metadata": request.metadata or {}, "user": request.user,
            "completed_at": int(time.time()) if status == "completed" else None,
        }


def from_completion(shell: ResponseShell, completion: dict[str, Any]) -> dict[str, Any]:
    """The response object of a chat completion (JSON, as the pipeline answers it)."""
    (choice,) = completion["choices"]
    message = choice["message"]
    output = []
    if message.get("content"):
        part = _text_part(message["content"], _logprobs(choice.get("logprobs")))
        output.append(_message_item(_new_id("msg"), [part], "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(_call_item(_new_id("fc"), call["id"], function["name"], function["arguments"], "completed"))
    status, incomplete = _status(choice.get("finish_reason"))
    return shell.object(completion["model"], status, output, _usage(completion.get("usage")), incomplete)


# Chat fields a chat-side refusal may name, as the Responses request calls them.
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input", "reasoning_effort": "reasoning",
           "verbosity": "text.verbosity"}


async def serve(gateway: Gateway, state: RequestState, request: ResponsesRequest) -> Reply:
    """`request` served as its chat completion; a refusal names the Responses API's fields."""
    chat = to_chat(request)
    try:
        reply = await gateway.chat(state, chat)
    except APIError as exc:
        raise _renamed(exc) from None
    return translate(reply, request)


def _renamed(error: APIError) -> APIError:
    param = error.param or ""
    field = param.split("[", 1)[0].split(".", 1)[0]
    if field not in _PARAMS:
        return error
    message = error.message.replace(f"`{field}`", f"`{_PARAMS[field]}`")
    return APIError(error.status_code, message, code=error.code, param=_PARAMS[field], type=error.type,
                    headers=error.headers)


def translate(reply: Reply, request: ResponsesRequest) -> Reply:
    """The pipeline's chat reply as the Responses API answers it (headers kept)."""
    shell = ResponseShell(request)
    if reply.stream is None:
        body = msgspec.json.encode(from_completion(shell, msgspec.json.decode(reply.body)))
        return Reply(headers=reply.headers, body=body)
    return Reply(headers=reply.headers, stream=EventStream(response_events(shell, reply.stream)))


# -- streaming --------------------------------------------------------------------------------------


@dataclass
class _OpenCall:
    output_index: int
    item_id: str
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class _StreamState:
    """The response being streamed: its output items so far and the events' sequence."""

    shell: ResponseShell
    model: str = ""
    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    text_index: int | None = None  # output index of the message being written
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    calls: dict[int, _OpenCall] = field(default_factory=dict)  # by the chat stream's tool call index
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    def event(self, kind: str, **data: Any) -> bytes:
        payload = msgspec.json.encode({"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        return self.shell.object(self.model or self.shell.request.model, status, self.output, **extra)


async def response_events(shell: ResponseShell, chat_events: EventStream) -> AsyncGenerator[bytes, None]:
    """The Responses API's events for a streamed chat reply (OpenAI's SSE bytes). Closing this closes
    `chat_events`, which finishes the request."""
    state = _StreamState(shell)
    try:
        yield state.event("response.created", response=state.snapshot("in_progress"))
        yield state.event("response.in_progress", response=state.snapshot("in_progress"))
        async for data in _sse_data(chat_events):
            if data == b"[DONE]":
                break
            chunk = msgspec.json.decode(data)
            if "error" in chunk:
                for event in _failed(state, chunk["error"]):
                    yield event
                return
            for event in _chunk_events(state, chunk):
                yield event
        for event in _completed(state):
            yield event
    finally:
        await chat_events.aclose()


async def _sse_data(events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The `data` of each server-sent event, whatever the byte chunks' boundaries."""
    buffer = b""
    async for part in events:
        buffer += part
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()


def _chunk_events(state: _StreamState, chunk: dict[str, Any]) -> list[bytes]:
    state.model = chunk.get("model") or state.model
    if chunk.get("usage"):
        state.usage = _usage(chunk["usage"])
    events = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            events += _text_delta(state, delta["content"], _logprobs(choice.get("logprobs")))
        for call in delta.get("tool_calls") or []:
            events += _call_delta(state, call)
        if choice.get("finish_reason"):
            state.finish_reason = choice["finish_reason"]
    return events


def _text_delta(state: _StreamState, text: str, logprobs: list[Any]) -> list[bytes]:
    events = []
    if state.text_index is None:
        state.text_index = len(state.output)
        item = _message_item(_new_id("msg"), [], "in_progress")
        state.output.append(item)
        events.append(state.event("response.output_item.added", output_index=state.text_index, item=item))
        events.append(state.event("response.content_part.added", item_id=item["id"], output_index=state.text_index,
                                  content_index=0, part=_text_part("")))
    state.text.append(text)
    state.logprobs += logprobs
    item_id = state.output[state.text_index]["id"]
    events.append(state.event("response.output_text.delta", item_id=item_id, output_index=state.text_index,
                              content_index=0, delta=text, logprobs=logprobs))
    return events


def _call_delta(state: _StreamState, call: dict[str, Any]) -> list[bytes]:
    """A tool call of the chat stream: whole (our engines) or in fragments keyed by `index` (upstreams)."""
    events = _close_text(state)
    index = call.get("index", len(state.calls))
    function = call.get("function") or {}
    open_call = state.calls.get(index)
    if open_call is None:
        open_call = state.calls[index] = _OpenCall(len(state.output), _new_id("fc"), call.get("id") or _new_id("call"),
                                                   function.get("name") or "")
        item = _call_item(open_call.item_id, open_call.call_id, open_call.name, "", "in_progress")
        state.output.append(item)
        events.append(state.event("response.output_item.added", output_index=open_call.output_index, item=item))
    if function.get("arguments"):
        open_call.arguments += function["arguments"]
        events.append(state.event("response.function_call_arguments.delta", item_id=open_call.item_id,
                                  output_index=open_call.output_index, delta=function["arguments"]))
    return events


def _close_text(state: _StreamState) -> list[bytes]:
    if state.text_index is None:
        return []
    index, text = state.text_index, "".join(state.text)
    part = _text_part(text, state.logprobs)
    item = _message_item(state.output[index]["id"], [part], "completed")
    state.output[index], state.text_index = item, None
    return [
        state.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                    logprobs=state.logprobs),
        state.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
        state.event("response.output_item.done", output_index=index, item=item),
    ]


def _close_calls(state: _StreamState) -> list[bytes]:
    events = []
    for call in state.calls.values():
        item = _call_item(call.item_id, call.call_id, call.name, call.arguments, "completed")
        state.output[call.output_index] = item
        events.append(state.event("response.function_call_arguments.done", item_id=call.item_id,
                                  output_index=call.output_index, arguments=call.arguments))
        events.append(state.event("response.output_item.done", output_index=call.output_index, item=item))
    state.calls.clear()
    return events


def _completed(state: _StreamState) -> list[bytes]:
    events = _close_text(state) + _close_calls(state)
    status, incomplete = _status(state.finish_reason)
    response = state.snapshot(status, usage=state.usage, incomplete=incomplete)
    return [*events, state.event(f"response.{status}", response=response)]


def _failed(state: _StreamState, error: dict[str, Any]) -> list[bytes]:
    """A stream that failed midway: the `error` event, then `response.failed` with what was produced."""
    code, message = error.get("code") or "stream_failed", error.get("message") or "The stream failed."
    events = [state.event("error", code=code, message=message, param=error.get("param"))]
    # A response's error code is one of the API's few; ours stays in the message (and in the `error` event).
    known = code if code == "rate_limit_exceeded" else "server_error"
    response = state.snapshot("failed", usage=state.usage, error={"code": known, "message": f"{message} ({code})"})
    return [*events, state.event("response.failed", response=response)]
