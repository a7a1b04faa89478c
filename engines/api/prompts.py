"""Requests → prompt token ids, with a tier's tokenizer: how a tier counts a prompt, in one place.

The engine feeds these ids to its model; the gateway counts them to check budgets before the call,
so the count agrees with what the tier bills. The request has passed `rules.check_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engines.api.errors import invalid
from engines.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


class PromptTokenizer(Protocol):
    """What the contract needs from a tier's tokenizer (`engines.tokenizer.Tokenizer` is one)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def chat_template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Wire messages → the plain dicts a chat template reads."""
    # "developer" is OpenAI's newer name for the system role; open chat templates know only "system".
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def chat_prompt_token_ids(tokenizer: PromptTokenizer, request: ChatCompletionRequest) -> list[int]:
    try:
        return tokenizer.apply_chat_template(chat_template_messages(request.messages))
    except ValueError as exc:  # no template, or the template rejects these messages (e.g. roles must alternate)
        raise invalid(str(exc), "messages", "invalid_messages") from exc


def completion_prompts(tokenizer: PromptTokenizer, request: CompletionRequest) -> list[list[int]]:
    """One token-id list per prompt: a string, strings, token ids, or lists of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[misc]


def count_prompt_tokens(tokenizer: PromptTokenizer, request: ChatCompletionRequest | CompletionRequest) -> int:
    """Prompt tokens as the tier counts them (chat template applied), over all prompts of a batch."""
    if isinstance(request, ChatCompletionRequest):
        return len(chat_prompt_token_ids(tokenizer, request))
    return sum(len(ids) for ids in completion_prompts(tokenizer, request))
