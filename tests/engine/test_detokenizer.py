"""Incremental detokenization: streamed text equals the decoded whole; stop strings cut and hold back text."""

from __future__ import annotations

import pytest

from engines.detokenizer import IncrementalDetokenizer
from engines.tokenizer import Tokenizer
from tests.engine.conftest import TinyModel


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: TinyModel) -> Tokenizer:
    return tiny_llama.checkpoint.tokenizer


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    pieces = [detokenizer.add_token(token_id) for token_id in token_ids]
    return [*pieces, detokenizer.flush()]


def test_streamed_text_equals_decoding_all_tokens_including_multibyte_characters(tokenizer: Tokenizer) -> None:
    text = " Héllo wörld — naïve café 😀 done."
    token_ids = tokenizer.encode(text)
    pieces = stream(IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), stop=[]), token_ids)
    assert "".join(pieces) == tokenizer.decode(token_ids) == text
    assert all("\ufffd" not in piece for piece in pieces)  # partial characters are held until complete


def test_a_stop_string_cuts_the_text_before_it(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world"])
    pieces = stream(detokenizer, tokenizer.encode("Hello, world! More text."))
    assert "".join(pieces) == "Hello, "
    assert detokenizer.stopped


def test_no_stop_string_matches_before_min_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hello, world! Hello, world!")
    early = len(tokenizer.encode("Hello, world"))
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world"], min_tokens=early + 1)
    assert "".join(stream(detokenizer, token_ids)) == "Hello, world! Hello, "  # the second one stops it
    assert detokenizer.stopped


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["capital city"])
    released = ""
    for token_id in tokenizer.encode("Paris is the capital of France."):
        released += detokenizer.add_token(token_id)
        assert not released.endswith("capital")  # could still become "capital city"
    released += detokenizer.flush()
    assert released == "Paris is the capital of France."
    assert not detokenizer.stopped


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["France", "the"])
    assert "".join(stream(detokenizer, tokenizer.encode("Paris is the capital of France."))) == "Paris is "


def test_nothing_is_released_after_a_stop(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["is"])
    stream(detokenizer, tokenizer.encode("Paris is"))
    assert detokenizer.add_token(tokenizer.encode(" big")[0]) == ""
    assert detokenizer.flush() == ""
