"""Constrained decoding: a grammar (JSON, JSON valid against a schema, a Lark-style grammar, a regular expression)
decides which tokens may come next.

llguidance turns a `GrammarSpec` into a grammar and gives every constrained sequence its own
matcher. Each step the sampler fills a token bitmask for the constrained rows (one bit per
vocabulary entry) and masks the logits of the rows that need it; the engine advances the matcher
by the token it accepted. The grammar allows a stop token only where the JSON is complete, so a
constrained sequence finishes exactly when its grammar does.

Why llguidance over xgrammar (both measured by `bench/structured.py`, see BENCHMARKS.md):
xgrammar 0.2.8 fills masks faster, but its grammar for a string with `maxLength` admits raw
control characters, which JSON forbids, so its output failed to parse in our property test;
llguidance's output always parsed. Output is compact JSON (no free whitespace): a model, however
weak, cannot loop on blanks.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.torch
import numpy as np
import torch

from engines.sampling_params import GrammarSpec

if TYPE_CHECKING:
    from engines.tokenizer import Tokenizer

_JSON_OBJECT = {"type": "object"}
_WHAT = {"lark": "the grammar", "regex": "the regular expression"}  # for errors; else a JSON schema
_COMPACT = {"whitespace_flexible": False}


def inline_json(schema: dict[str, Any], whitespace: str | None = None) -> str:
    """A JSON schema as a rule of a Lark-style grammar (`GrammarSpec("lark", ...)`): compact JSON like a
    `json_schema` spec's, or with whitespace matching the regular expression `whitespace` between its tokens."""
    options = _COMPACT if whitespace is None else {**_COMPACT, "whitespace_pattern": whitespace}
    return "%json " + json.dumps({**schema, "x-guidance": options})


class GrammarError(ValueError):
    """The schema cannot be compiled (invalid, or outside what the grammar library supports)."""


class _Vocabulary:
    """The tokenizer as llguidance reads it: every id's bytes (special tokens marked by a 0xFF prefix,
    as llguidance's own HF adapter does), padded to the model's logits width."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = stop_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [self._bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.tokens += [f"\xff<|pad_{i}|>".encode() for i in range(tokenizer.vocab_size, vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if i >= tokenizer.vocab_size or tokenizer.is_special(i)]

    @staticmethod
    def _bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
        if tokenizer.is_special(token_id):
            return b"\xff" + tokenizer.token_text(token_id).encode()
        return tokenizer.token_bytes(token_id)

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"))


class Grammars:
    """Grammars for one tokenizer and vocabulary (the model's logits width), each spec checked once while it
    is among the `max_cached` most recently used: clients send schemas of their own, without bound."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = 1024) -> None:
        self.vocab_size = vocab_size
        vocabulary = _Vocabulary(tokenizer, vocab_size, stop_token_ids)
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary))
        self._cache: OrderedDict[GrammarSpec, str] = OrderedDict()
        self.max_cached = max_cached
        self._lock = threading.Lock()  # used from the event loop (validation) and the step thread

    def __len__(self) -> int:
        """Grammars held compiled."""
        return len(self._cache)

    def __contains__(self, spec: GrammarSpec) -> bool:
        return spec in self._cache

    def compile(self, spec: GrammarSpec) -> str:
        """The grammar for `spec`; raises GrammarError when the schema is invalid or unsupported."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
        if grammar is not None:
            return grammar
        what = _WHAT.get(spec.kind, "the JSON schema")
        try:
            if spec.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.source or "")
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.source or "")
            else:
                schema = _JSON_OBJECT if spec.kind == "json_object" else json.loads(spec.source or "{}")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{what} cannot be used for constrained decoding: {exc}") from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"{what} cannot be used for constrained decoding: {error}")
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: GrammarSpec) -> GrammarState:
        return GrammarState(llguidance.LLMatcher(self._tokenizer, self.compile(spec), log_level=0))


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next. Every token of `fill`'s mask is allowed; where the
        next text is forced the mask keeps only its canonical tokenization, this any tokenization of it."""
        return self._matcher.validate_tokens([token_id]) == 1

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False when the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_stopped()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)


def allows(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place (row i of `logits` by row i of `bitmask`).
    numpy unpacks the bits and writes in one single-threaded pass each (fastest of the variants tried;
    llguidance's own helper needs torch.compile, a C compiler at run time). `logits`: contiguous float32."""
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=logits.shape[-1], bitorder="little")
    np.copyto(logits.numpy(), -np.inf, where=~allowed.view(np.bool_))
