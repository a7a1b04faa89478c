"""Tool calls in the model's own format, and the grammar that forces one.

Qwen2.5 (and every Hermes-style template) asks the model to answer a tool call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call; the template
itself names that format, so a model whose template shows `<tool_call>` gets this parser (as vLLM's
`hermes` parser). A model whose template does not render `tools` refuses them.

Models do not always use the tags: the demo tiers' 1.5B coder model answers every prompt of
`bench/data/tool_prompts.jsonl` with the call as plain JSON in a ```json fence (BENCHMARKS.md). A reply
that is nothing but calls to the request's own tools, written as JSON (bare or in one fence), is read as
those calls too (`whole_reply_calls`), as vLLM's `llama3_json` parser reads a bare JSON reply; anything
else in the reply keeps it text.

`tool_choice` "required" or a named function forces a call: the prompt ends with the block's
opening `<tool_call>\n`, and constrained decoding allows only `{"name": <a tool>, "arguments":
<its parameters' schema>}` (strict function schemas are honoured on this path). With "auto", a `strict` function
holds the reply to such calls or to text that holds none (`calls_or_answer_grammar`), as a `response_format` does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engines.api.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall, new_call_id
from engines.sampling_params import GrammarSpec
from engines.structured import inline_json

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FORCED_PREFIX = CALL_START + "\n"
_BLOCK = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.S)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)
WHOLE_REPLY_OPENERS = "{[`"  # how a reply written as JSON calls begins: an object, a list, a fence
_CALL_KEYS = frozenset({"name", "arguments", "parameters"})
# A reply's first key where it opens like JSON (after a fence or a list's bracket): a call's is one of _CALL_KEYS.
_FIRST_KEY = re.compile(r'\s*(?:```(?:json)?\s*)?\[?\s*\{\s*"([^"\\]*)"')
# A free-text answer beside strict tools (a lark terminal): empty, or opening with anything but a blank or what
# opens a call (`WHOLE_REPLY_OPENERS`, or the `<` of a block), and holding no block.
TEXT_ANSWER = r'/([^\s{\[`<][\s\S]*)?/ & ~/[\s\S]*<tool_call>[\s\S]*/'
# Between the tokens of a constrained call's JSON: nothing, a space, or a new line indented (pretty-printed calls).
CALL_WHITESPACE = r"(?: |\n {0,16})?"


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
    return GrammarSpec("json_schema", json.dumps(_call_schema(tools)))


def calls_or_answer_grammar(tools: list[Tool], answer: dict[str, Any] | None, parallel: bool) -> GrammarSpec:
    """What `tool_choice: "auto"` allows beside a `response_format`, or beside strict tools: tool calls, or an
    answer — valid against the `answer` schema, or without one (None) free text that does not open like a call
    (`TEXT_ANSWER`) — the model chooses. Calls as models write them: the template's blocks (one, or several on
    lines of their own when `parallel`), or one call as bare JSON or in a ```json fence (how the demo models
    call, `whole_reply_calls`), with the line breaks and indentation the model likes (bounded: a weak model
    cannot loop on blanks) and arguments valid against the function's parameters. A bare or fenced call may
    also name a function the request does not declare: that is how weak models answer beside tools, and such a
    reply is answered again under the answer's schema alone (`invented_call`), where forcing a declared name
    would have made it a call to the wrong tool; beside strict tools alone it is text, as without them."""
    block = f'"{CALL_START}\\n" call "\\n{CALL_END}"'
    return GrammarSpec("lark", "\n".join([
        "start: blocks | any_call | fenced_call | answer",
        f'blocks: {block} ("\\n" {block})*' if parallel else f"blocks: {block}",
        'fenced_call: "```json\\n" any_call "\\n```"',
        f"call: {inline_json(_call_schema(tools), whitespace=CALL_WHITESPACE)}",
        f"any_call: {inline_json(_any_call_schema(tools), whitespace=CALL_WHITESPACE)}",
        f"answer: {inline_json(answer)}" if answer is not None else f"answer: TEXT\nTEXT: {TEXT_ANSWER}",
    ]))


def _any_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """A call to one of `tools` (arguments valid against its parameters) or to a function it does not name."""
    invented = {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": other_name_pattern([t.function.name for t in tools])},
                       "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return {"anyOf": [*_call_alternatives(tools), invented]}


_NAME_CHARS = "A-Za-z0-9_.\\-"  # what a function name is written in (OpenAI: letters, digits, _ and -)


def other_name_pattern(names: Collection[str]) -> str:
    """An anchored regular expression for function names other than `names` (a declared name cannot take
    an invented call's looser arguments): along the trie of `names`, any string that leaves it, or that ends
    where no name ends."""
    prefixes = sorted({name[:i] for name in names for i in range(len(name) + 1)})
    ends, alternatives = set(names), []
    for prefix in prefixes:
        taken = "".join(re.escape(char) for char in sorted({name[len(prefix)] for name in names
                                                            if name.startswith(prefix) and len(name) > len(prefix)}))
        free = f"[{_NAME_CHARS}&&[^{taken}]]" if taken else f"[{_NAME_CHARS}]"
        alternatives.append(f"{re.escape(prefix)}{free}[{_NAME_CHARS}]{{0,63}}")
        if prefix and prefix not in ends:
            alternatives.append(re.escape(prefix))
    return "^(?:" + "|".join(alternatives) + ")$"


def invented_call(text: str, tool_names: Collection[str]) -> bool:
    """Whether a whole reply is one call, bare or in a fence, to a function not among `tool_names`."""
    value = _json_reply(text)
    return (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] not in tool_names
            and set(value) <= _CALL_KEYS)


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON of one call to one of `tools`: its name, then arguments valid against its parameters."""
    alternatives = _call_alternatives(tools)
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _call_alternatives(tools: list[Tool]) -> list[dict[str, Any]]:
    """One call's JSON per tool: its name, then arguments valid against its parameters."""
    return [
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


def _call(payload: str) -> ToolCall | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _tool_call(value["name"], _arguments(value))


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("arguments", call.get("parameters", {}))  # Llama 3 models write "parameters"
    if isinstance(arguments, str):  # an object as a JSON string, OpenAI's wire form, which models imitate
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return arguments
        return decoded if isinstance(decoded, dict) else arguments
    return arguments


def _tool_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=json.dumps(arguments)))


def _json_reply(text: str) -> Any:
    """The JSON value a whole reply is, bare or in one ```json fence; None when it is not JSON."""
    body = text.strip()
    if fenced := _FENCE.fullmatch(body):
        body = fenced.group(1)
    try:
        return json.loads(body)
    except ValueError:
        return None


def whole_reply_calls(text: str, tool_names: Collection[str]) -> list[ToolCall]:
    """The calls of a reply that is only calls written as JSON, bare or in one ```json fence: an object
    `{"name": <one of tool_names>, "arguments": {...}}` or a list of them; [] for any other reply, so that
    JSON which is not a call to one of the request's tools (an example, an answer) stays text."""
    value = _json_reply(text)
    if value is None:
        return []
    items = value if isinstance(value, list) and value else [value]
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in tool_names and set(item) <= _CALL_KEYS
                and isinstance(_arguments(item), dict)):
            return []
    return [_tool_call(item["name"], _arguments(item)) for item in items]


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
    A reply that opens like JSON (`WHOLE_REPLY_OPENERS`, after any whitespace) when `tool_names` are given
    is held whole, since only its end tells whether it is calls (`whole_reply_calls`) or text — unless its
    first key is not a call's: then it streams like any other reply (a JSON answer beside tools).
    Blank text is held until text follows it: the line breaks around calls are not content.
    Whatever else is held when the stream ends goes out as content."""

    tool_names: frozenset[str] = frozenset()
    buffer: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    holds_whole_reply: bool | None = None  # None until the reply's first non-blank character
    blank: str = ""  # blank text not sent yet

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        if self.holds_whole_reply is None:
            head = self.buffer.lstrip()
            if not head:
                return "", []
            self.holds_whole_reply = bool(self.tool_names) and head[0] in WHOLE_REPLY_OPENERS
        if self.holds_whole_reply and (first_key := _FIRST_KEY.match(self.buffer)):
            self.holds_whole_reply = first_key.group(1) in _CALL_KEYS
        if self.holds_whole_reply:
            return "", []
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
        return self._unless_blank("".join(content)), new_calls

    def _unless_blank(self, content: str) -> str:
        content, self.blank = self.blank + content, ""
        if content.isspace():
            content, self.blank = "", content
        return content

    def flush(self) -> tuple[str, list[ToolCall]]:
        """What is still held when the reply ends: (content, calls)."""
        content, calls = "", []
        if self.holds_whole_reply:
            self.holds_whole_reply = False
            calls = whole_reply_calls(self.buffer, self.tool_names)
            if calls:
                self.buffer = ""
                self.calls.extend(calls)
            else:  # read as any other reply: `<tool_call>` blocks inside it still count
                content, calls = self.feed("")
        rest, self.buffer = self.buffer, ""
        content, self.blank = content + self.blank + rest, ""
        return ("" if self.calls and content.isspace() else content), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def arguments_of(call: ToolCall) -> Any:
    return json.loads(call.function.arguments)
