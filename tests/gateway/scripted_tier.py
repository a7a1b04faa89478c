"""A scripted tier for gateway tests: answers with fixed words, one token per word, and can be
made unavailable or held mid-stream. Its prompt "tokenizer" counts whitespace-separated words."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from engines.api.client import EngineUnavailable
from engines.api.prompts import chat_template_messages
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
    TokenLogprob,
    Usage,
    new_id,
    now,
)


class ScriptedTier:
    def __init__(self, name: str, words: list[str] | None = None) -> None:
        self.model_name = name
        self.words = words or ["one", "two", "three", "four", "five", "six", "seven", "eight"]
        self.down = False
        self.requests: list[ChatCompletionRequest | CompletionRequest] = []
        self.fail_after: int | None = None  # streams raise EngineUnavailable after this many words
        self.hold_after: int | None = None  # answers stop after this many words until released
        self.release = asyncio.Event()
        self.streams_closed_early = 0
        self.calls_cancelled = 0
        self.held = asyncio.Event()
        # Logprob of each word's token, returned when a request asks for logprobs; None: like an upstream
        # that returns none.
        self.logprobs: list[float] | None = None

    def count_prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        if isinstance(request, ChatCompletionRequest):
            return sum(len(m["content"].split()) for m in chat_template_messages(request.messages))
        prompt = request.prompt
        return len(prompt.split()) if isinstance(prompt, str) else len(prompt)

    def _answer(self, request: ChatCompletionRequest | CompletionRequest) -> list[str]:
        if self.down:
            raise EngineUnavailable(f"{self.model_name} is down")
        self.requests.append(request)
        limit = request.output_limit() or len(self.words)
        return self.words[:limit]

    def _usage(self, request: ChatCompletionRequest | CompletionRequest, words: list[str]) -> Usage:
        return Usage.of(self.count_prompt_tokens(request), len(words))

    async def _hold(self) -> None:
        self.held.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.calls_cancelled += 1
            raise

    def _chat_logprobs(self, request: ChatCompletionRequest, first: int, words: list[str]) -> ChoiceLogprobs | None:
        if not request.logprobs or self.logprobs is None:
            return None
        values = self.logprobs[first : first + len(words)]
        return ChoiceLogprobs(content=[TokenLogprob(token=w, logprob=lp) for w, lp in zip(words, values, strict=True)])

    def _completion_logprobs(
        self, request: CompletionRequest, first: int, words: list[str]
    ) -> CompletionLogprobs | None:
        if request.logprobs is None or self.logprobs is None:
            return None
        return CompletionLogprobs(tokens=list(words), token_logprobs=list(self.logprobs[first : first + len(words)]))

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        words = self._answer(request)
        if self.hold_after is not None:
            await self._hold()
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=" ".join(words)),
            finish_reason="length",
            logprobs=self._chat_logprobs(request, 0, words),
        )
        return ChatCompletion(
            id=new_id("chatcmpl"),
            created=now(),
            model=self.model_name,
            choices=[choice],
            usage=self._usage(request, words),
        )

    async def complete(self, request: CompletionRequest) -> Completion:
        words = self._answer(request)
        choice = CompletionChoice(
            index=0, text=" ".join(words), finish_reason="length", logprobs=self._completion_logprobs(request, 0, words)
        )
        return Completion(
            id=new_id("cmpl"), created=now(), model=self.model_name, choices=[choice], usage=self._usage(request, words)
        )

    async def _words(self, request: ChatCompletionRequest | CompletionRequest) -> AsyncIterator[tuple[int, str]]:
        words = self._answer(request)
        finished = False
        try:
            for i, word in enumerate(words):
                if self.fail_after is not None and i == self.fail_after:
                    raise EngineUnavailable(f"{self.model_name} died mid-stream")
                if self.hold_after is not None and i == self.hold_after:
                    self.held.set()
                    await self.release.wait()
                yield i, (" " if i else "") + word
            finished = True
        finally:
            if not finished:
                self.streams_closed_early += 1

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        rid, created = new_id("chatcmpl"), now()
        count = 0
        async with aclosing(self._words(request)) as words:
            async for i, text in words:
                count += 1
                delta = DeltaMessage(role="assistant" if count == 1 else None, content=text)
                logprobs = self._chat_logprobs(request, i, [text])
                yield ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self.model_name,
                    choices=[ChatChunkChoice(index=0, delta=delta, logprobs=logprobs)],
                )
        done = ChatChunkChoice(index=0, delta=DeltaMessage(), finish_reason="length")
        yield ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[done])
        usage = Usage.of(self.count_prompt_tokens(request), count)
        yield ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[], usage=usage)

    async def complete_stream(self, request: CompletionRequest) -> AsyncIterator[Completion]:
        rid, created = new_id("cmpl"), now()
        count = 0
        async with aclosing(self._words(request)) as words:
            async for i, text in words:
                count += 1
                choice = CompletionChoice(index=0, text=text, logprobs=self._completion_logprobs(request, i, [text]))
                yield Completion(id=rid, created=created, model=self.model_name, choices=[choice])
        usage = Usage.of(self.count_prompt_tokens(request), count)
        yield Completion(id=rid, created=created, model=self.model_name, choices=[], usage=usage)

    async def ready(self) -> bool:
        return not self.down

    def load(self) -> None:
        return None  # like an upstream: its load is its own

    async def close(self) -> None:
        return None
