"""Incremental detokenization with stop strings.

Text is produced token by token by decoding a short window of recent tokens and keeping what
the newest token added: this stays correct for byte-level BPE (a character split over several
tokens is held back until complete) and for tokenizers whose spacing depends on context. Text
that could still turn into a stop string is held back until it cannot. Before `min_tokens` output tokens
no stop string matches (vLLM's rule): from then on, only text that ends after that token can.
"""

from __future__ import annotations

from engines.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens, for context-dependent spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.stop = [s for s in stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all output text so far (cut at the stop string once one matched)
        self.num_emitted_chars = 0
        self.stopped = False  # a stop string matched

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the newly releasable text."""
        if self.stopped:
            return ""
        self.tokens.append(token_id)
        self.num_output_tokens += 1
        self._decode_pending(final=False)
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """The request ended: decode what was waiting for more bytes and release everything held back."""
        if not self.stopped:
            self._decode_pending(final=True)
        return self._release(final=True)

    def _decode_pending(self, final: bool) -> None:
        if self.read_offset == len(self.tokens):
            return
        prefix_text = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        # A trailing U+FFFD means an incomplete UTF-8 sequence: wait for the next token, unless none will come.
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            search_from = max(0, len(self.text) - self.max_stop_len + 1)
            self.text += full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            if self.stop and self.num_output_tokens >= self.min_tokens:
                self._match_stop(search_from)

    def _match_stop(self, search_from: int) -> None:
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back_chars()
        end = max(end, self.num_emitted_chars)
        released = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return released

    def _held_back_chars(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        tail = self.text[-self.max_stop_len:]
        for length in range(min(len(tail), self.max_stop_len - 1), 0, -1):
            suffix = tail[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0
