from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy.

    Invariants, asserted: callers with user input check it first (`engines.api.rules`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        assert self.temperature >= 0, "temperature must be >= 0"
        assert 0 < self.top_p <= 1, "top_p must be in (0, 1]"
        assert self.top_k >= 0, "top_k must be >= 0"
        assert self.max_tokens >= 1, "max_tokens must be >= 1"
        assert 0 <= self.top_logprobs <= 20, "top_logprobs must be between 0 and 20"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
