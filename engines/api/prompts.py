"""Requests → prompt token ids, with a tier's tokenizer: how a tier counts a prompt, in one place.

The engine feeds these ids to its model; the gateway counts them to check budgets before the call,
so the count agrees with what the tier bills. The request has passed `rules.check_request`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from engines.api.errors import invalid
from engines.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ToolCall


class PromptTokenizer(Protocol):
    """What the contract needs from a tier's tokenizer (`engines.tokenizer.Tokenizer` is one)."""

    vocab_size: int
    fim_token_ids: tuple[int, int, int] | None  # (prefix, suffix, middle): the model fills in the middle

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, suffix: str = "") -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def chat_template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Wire messages → the plain dicts a chat template reads (tool calls and tool answers as transformers
    passes them: arguments as an object, the tool turn's `tool_call_id`)."""
    converted = []
    for m in messages:
        # "developer" is OpenAI's newer name for the system role; open chat templates know only "system".
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        converted.append(message)
    return converted


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # not JSON: the template gets the text as it came
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The request's tools as the chat template reads them; none when `tool_choice` is "none"."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [{"type": tool.type, "function": _definition(tool.function)} for tool in request.tools]


def _definition(function: Any) -> dict[str, Any]:
    return {k: v for k, v in (("name", function.name), ("description", function.description),
                              ("parameters", function.parameters)) if v is not None}


def chat_prompt_token_ids(tokenizer: PromptTokenizer, request: ChatCompletionRequest, suffix: str = "") -> list[int]:
    """The prompt: the chat template over the messages and tools, then `suffix` (a reply start the tier forces)."""
    try:
        return tokenizer.apply_chat_template(chat_template_messages(request.messages), tools=template_tools(request),
                                             suffix=suffix)
    except ValueError as exc:  # no template, or the template rejects these messages (e.g. roles must alternate)
        raise invalid(str(exc), "messages", "invalid_messages") from exc


def completion_prompts(tokenizer: PromptTokenizer, request: CompletionRequest) -> list[list[int]]:
    """One token-id list per prompt (a string, strings, token ids, or lists of token ids); with a `suffix`, each
    prompt is the text before a gap and the suffix the text after it, in the model's fill-in-the-middle layout
    (prefix token, prompt, suffix token, suffix, middle token), and the completion is what fills the gap."""
    prompts = _prompt_token_ids(tokenizer, request.prompt)
    if not request.suffix:
        return prompts
    if tokenizer.fim_token_ids is None:
        raise invalid("`suffix` asks the model to fill in the middle, and this tier's model has no fill-in-the-middle "
                      "tokens (code models such as Qwen2.5-Coder have them)", "suffix", "unsupported_parameter")
    prefix, suffix, middle = tokenizer.fim_token_ids
    after = [suffix, *tokenizer.encode(request.suffix), middle]
    return [[prefix, *ids, *after] for ids in prompts]


def _prompt_token_ids(tokenizer: PromptTokenizer, prompt: str | list[str | int | list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[misc]


def count_prompt_tokens(tokenizer: PromptTokenizer, request: ChatCompletionRequest | CompletionRequest) -> int:
    """Prompt tokens as the tier counts them (chat template applied; a suffix in the fill-in-the-middle layout, or
    beside the prompts where the tokenizer has none: an HTTP tier fills in for itself), over all prompts of a batch."""
    if isinstance(request, ChatCompletionRequest):
        return len(chat_prompt_token_ids(tokenizer, request))
    if request.suffix and tokenizer.fim_token_ids is None:
        prompts = _prompt_token_ids(tokenizer, request.prompt)
        return sum(len(ids) for ids in prompts) + len(prompts) * len(tokenizer.encode(request.suffix))
    return sum(len(ids) for ids in completion_prompts(tokenizer, request))
