from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engines.api.rules import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS_CHAT,
    decodes_greedily,
)


@dataclass(frozen=True)
class GrammarSpec:
    """What constrained decoding must produce: any JSON object, JSON valid against the schema in `source`
    (JSON text), text of the Lark-style grammar in `source` (llguidance's syntax, JSON schemas inline), or text
    matching the regular expression in `source` whole."""

    kind: Literal["json_object", "json_schema", "lark", "regex"]
    source: str | None = None


@dataclass
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy.

    Invariants, asserted: callers with user input check it first (`engines.api.rules`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off; else tokens below min_p × the most likely token's probability are dropped
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: until this many tokens, no EOS or stop token is sampled and no stop string matches
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's: each prompt token's logprob after the tokens before it, with this many top alternatives (None: off).
    # Every prompt position is computed for it: no prefix-cache hits.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    repetition_penalty: float = 1.0  # vLLM's: a token already in the prompt or the answer has its logit divided
    # by it where positive, multiplied where negative (1: off)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    grammar: GrammarSpec | None = None
    # Scheduling class: interactive sequences are admitted first and take the slots and KV blocks of
    # running batch sequences (preempted, recomputed later) when they need them.
    priority: Literal["interactive", "batch"] = "interactive"

    def __post_init__(self) -> None:
        assert self.temperature >= 0, "temperature must be >= 0"
        assert 0 <= self.top_p <= 1, "top_p must be in [0, 1]"
        assert self.top_k >= 0, "top_k must be >= 0"
        assert 0 <= self.min_p <= 1, "min_p must be in [0, 1]"
        assert self.repetition_penalty > 0, "repetition_penalty must be > 0"
        assert self.max_tokens >= 1, "max_tokens must be >= 1"
        assert 0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"
        assert 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS_CHAT, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS_CHAT}]"
        assert self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS_CHAT, \
            f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS_CHAT}]"
        for name in ("presence_penalty", "frequency_penalty"):
            assert -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY, \
                f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}]"
        assert len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, \
            f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens"
        assert all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()), \
            f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"

    @property
    def greedy(self) -> bool:
        return decodes_greedily(self.temperature, self.top_p)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
