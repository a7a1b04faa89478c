"""Tokenizer: the tiny HF checkpoint's trained BPE and, when present, the demo GGUF vocabularies
behave exactly like transformers' tokenizers for the same files."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import tokenizers

from engines.loader import read_gguf
from engines.tokenizer import Tokenizer
from tests.tiny_models import write_tiny_checkpoint

MODELS_DIR = Path("~/.cache/sluice/models").expanduser()
SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — 東京 🙂 numbers 12345 and code: def f(x): return x ** 2",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_directory(tiny_dir)


def test_tiny_tokenizer_matches_transformers(tiny_dir: Path, tiny: Tokenizer) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_dir)
    for text in SAMPLES:
        ids = tiny.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert tiny.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tiny.vocab_size == len(reference)


def test_encode_decode_round_trips_arbitrary_text(tiny: Tokenizer) -> None:
    for text in SAMPLES[:3]:
        assert tiny.decode(tiny.encode(text)) == text


def test_special_tokens_in_text_are_single_ids_and_skipped_on_decode(tiny: Tokenizer) -> None:
    im_start, im_end = tiny.backend.token_to_id("<|im_start|>"), tiny.backend.token_to_id("<|im_end|>")
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tiny.decode(ids) == "user\nhi"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tiny.is_special(im_end) and not tiny.is_special(ids[1])


def test_eos_includes_chat_end_token(tiny: Tokenizer) -> None:
    im_end, end_of_text = tiny.backend.token_to_id("<|im_end|>"), tiny.backend.token_to_id("<|endoftext|>")
    assert tiny.eos_token_ids[0] == im_end  # tokenizer_config's eos_token comes first
    assert set(tiny.eos_token_ids) == {im_end, end_of_text}
    assert tiny.bos_token_id == end_of_text


def test_chat_template_matches_transformers(tiny_dir: Path, tiny: Tokenizer) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_dir)
    for add_generation_prompt in (True, False):
        text = reference.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert tiny.render_chat(MESSAGES, add_generation_prompt) == text
        ids = tiny.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
        assert ids == reference.encode(text, add_special_tokens=False)
    assert tiny.render_chat(MESSAGES[:2]).endswith("<|im_start|>assistant\n")


def test_template_exception_becomes_value_error(tiny: Tokenizer) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with a user message') }}"
        "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    strict = Tokenizer(tiny.backend, template, bos_token_id=tiny.bos_token_id, eos_token_id=tiny.eos_token_ids[0])
    with pytest.raises(ValueError, match="Conversation must start with a user message"):
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert strict.render_chat([{"role": "user", "content": "hi"}]) == "<|endoftext|>hi<|im_end|>"


def test_broken_or_missing_template_is_value_error(tiny: Tokenizer) -> None:
    broken = Tokenizer(tiny.backend, "{% for m in messages %}", bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="chat template"):
        broken.apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="cannot render these messages"):
        tiny.apply_chat_template([{"role": "user", "content": None}])  # type: ignore[dict-item]
    templateless = Tokenizer(tiny.backend, None, bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="no chat template"):
        templateless.apply_chat_template(MESSAGES)


def test_sandbox_blocks_unsafe_templates(tiny: Tokenizer) -> None:
    unsafe = Tokenizer(tiny.backend, "{{ messages.__class__.__mro__ }}", bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError):
        unsafe.render_chat(MESSAGES)


def test_token_bytes_concatenate_to_the_utf8_text(tiny: Tokenizer) -> None:
    text = "naïve 🙂 東京"  # multi-byte characters get split across byte-level tokens
    ids = tiny.encode(text)
    assert b"".join(tiny.token_bytes(token_id) for token_id in ids) == text.encode("utf-8")
    im_end = tiny.backend.token_to_id("<|im_end|>")
    assert tiny.token_bytes(im_end) == b"<|im_end|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.token_bytes(tiny.vocab_size + 10)


def test_token_text_is_the_decoded_piece(tiny: Tokenizer) -> None:
    ids = tiny.encode("Hello world")
    assert "".join(tiny.token_text(token_id) for token_id in ids) == "Hello world"
    assert tiny.token_text(tiny.backend.token_to_id("<|im_end|>")) == "<|im_end|>"


def test_sentencepiece_token_bytes() -> None:
    vocab = {"<unk>": 0, "<0x0A>": 1, "\u2581hi": 2, "h": 3, "i": 4, "\u2581": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Metaspace()
    sentencepiece = Tokenizer(backend, None, bos_token_id=None, eos_token_id=None)
    assert sentencepiece.token_bytes(1) == b"\n"
    assert sentencepiece.token_bytes(2) == b" hi"


def test_fill_in_the_middle_tokens_are_found_by_their_spelling(tiny: Tokenizer) -> None:
    ids = tuple(tiny.backend.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    assert tiny.fim_token_ids == ids  # Qwen2.5-Coder's, (prefix, suffix, middle)
    vocab = {"<unk>": 0, "<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim-prefix>": 4}
    starcoder = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    assert Tokenizer(starcoder, None, bos_token_id=None, eos_token_id=None).fim_token_ids == (1, 3, 2)
    incomplete = {"<unk>": 0, "<fim_prefix>": 1, "<fim_suffix>": 2, "<fim-middle>": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=incomplete, merges=[], unk_token="<unk>"))
    assert Tokenizer(backend, None, bos_token_id=None, eos_token_id=None).fim_token_ids is None


# -- demo GGUF models ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "filename",
    [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        # transformers alone takes ~1 min to read this vocabulary on a loaded 2-core machine
        pytest.param("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", marks=pytest.mark.slow),
    ],
)
def test_gguf_tokenizer_matches_transformers(filename: str) -> None:
    path = MODELS_DIR / filename
    if not path.is_file():
        pytest.skip(f"{path} is absent; fetch it with `sluice models fetch`")
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
    reference = AutoTokenizer.from_pretrained(MODELS_DIR, gguf_file=filename)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(MESSAGES) == text
    assert ours.apply_chat_template(MESSAGES) == reference.encode(text, add_special_tokens=False)
    assert ours.backend.token_to_id("<|im_end|>") in ours.eos_token_ids
    assert ours.eos_token_ids[0] == reference.eos_token_id
    if filename.startswith("qwen"):  # a code model: it fills in the middle
        assert ours.fim_token_ids == tuple(reference.convert_tokens_to_ids(["<|fim_prefix|>", "<|fim_suffix|>",
                                                                            "<|fim_middle|>"]))


def test_a_long_text_encodes_as_the_backend_does_without_holding_the_caller(tiny: Tokenizer) -> None:
    """The gateway counts long prompts on a worker thread: while one is encoded, the thread that waits (the
    event loop) must keep running, not sit behind the GIL until the count is done."""
    text = "The quick brown fox jumps over the lazy dog; 12 + 30 = 42. " * 20_000
    done, ids = threading.Event(), []
    worker = threading.Thread(target=lambda: (ids.extend(tiny.encode(text)), done.set()))
    started = time.perf_counter()
    worker.start()
    beats = 0
    while not done.is_set():
        time.sleep(0.001)
        beats += 1
    worker.join()
    elapsed = time.perf_counter() - started
    assert ids == tiny.backend.encode(text).ids
    assert elapsed > 0.05, "the text encodes too fast to show whether the GIL is held"
    assert beats >= 10  # with the GIL held throughout, the waiting thread wakes once or twice
