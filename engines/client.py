"""The one interface through which the gateway talks to a tier, in-process or over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engines.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)


class EngineUnavailable(Exception):
    """The tier could not serve: down, timed out, or refused. The gateway may fall back."""


class EngineClient(Protocol):
    """An OpenAI-compatible tier. Streams yield chunks; the last chunk carries `usage`."""

    model_name: str

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        """Prompt tokens exactly as this tier will count them (chat template applied)."""
        ...

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion: ...

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]: ...

    async def complete(self, request: CompletionRequest) -> Completion: ...

    def complete_stream(self, request: CompletionRequest) -> AsyncIterator[Completion]: ...

    async def ready(self) -> bool: ...

    async def close(self) -> None: ...
