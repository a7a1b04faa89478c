"""Tool calls in the model's own format, and the grammar that forces one.

Qwen2.5 (and every Hermes-style template) asks the model to answer a tool call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call; the template
itself names that format, so a model whose template shows `<tool_call>` gets this parser (as vLLM's
`hermes` parser). A model whose template does not render `tools` refuses them.

`tool_choice` "required" or a named function forces a call: the prompt ends with the block's
opening `<tool_call>\n`, and constrained decoding allows only `{"name": <a tool>, "arguments":
<its parameters' schema>}` (strict function schemas are honoured on this path).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engines.api.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall
from engines.sampling_params import GrammarSpec

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FORCED_PREFIX = CALL_START + "\n"
_BLOCK = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.S)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_tools(request: ChatCompletionRequest) -> list[Tool]:
    """The tools one of which the reply must call: all for "required", the named one; none otherwise."""
    choice, tools = request.tool_choice, request.tools or []
    if choice == "required":
        return tools
    if choice is not None and not isinstance(choice, str):
        return [tool for tool in tools if tool.function.name == choice.function.name]
    return []


def forced_call_grammar(tools: list[Tool]) -> GrammarSpec:
    """JSON of one call to one of `tools`, arguments valid against its parameters."""
    alternatives = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))


def _call(payload: str) -> ToolCall | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(id=new_call_id(), function=FunctionCall(name=value["name"], arguments=json.dumps(arguments)))


def parse_forced(text: str) -> list[ToolCall]:
    """The call of a forced reply (the JSON after the prompt's `<tool_call>`)."""
    call = _call(text.removesuffix(CALL_END).strip())
    return [call] if call is not None else []


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside tool-call blocks, the calls) of a free reply. A block that is not a valid call
    stays text: the client sees what the model wrote rather than nothing."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[position:match.start()])
        calls.append(call)
        position = match.end()
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


@dataclass
class StreamParser:
    """Splits a streamed free reply into content deltas and whole tool calls.

    Text that may be the start of `<tool_call>` is held back until it is known not to be; a block is
    held until its `</tool_call>`, then sent as one call (OpenAI-style deltas may carry a call whole).
    Whatever is held when the stream ends goes out as content."""

    buffer: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content: list[str] = []
        new_calls: list[ToolCall] = []
        while self.buffer:
            start = self.buffer.find(CALL_START)
            if start < 0:
                keep = _partial_suffix(self.buffer, CALL_START)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content.append(self.buffer[:start])
            end = self.buffer.find(CALL_END, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            block = self.buffer[start:end + len(CALL_END)]
            self.buffer = self.buffer[end + len(CALL_END):]
            _, calls = parse(block)
            if calls:
                new_calls.extend(calls)
            else:
                content.append(block)
        self.calls.extend(new_calls)
        return "".join(content), new_calls

    def flush(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def arguments_of(call: ToolCall) -> Any:
    return json.loads(call.function.arguments)
