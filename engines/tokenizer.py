"""Text ↔ token ids for one model: a fast `tokenizers.Tokenizer` plus the model's own chat template.

Built either from an HF directory (tokenizer.json + tokenizer_config.json) or from the
`tokenizer.*` metadata of a GGUF file. The chat template is rendered the way transformers does it
(sandboxed Jinja, `trim_blocks`/`lstrip_blocks`, `raise_exception`), so prompts are token-for-token
what the model was trained on.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# Ends a document in raw completion mode; instruct models trained from a base model still emit it.
END_OF_TEXT_TOKEN = "<|endoftext|>"
# Fill-in-the-middle tokens (prefix, suffix, middle) as code models spell them. Each family trained the same layout:
# prefix token, the text before the gap, suffix token, the text after it, middle token; the model writes the gap.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),  # SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
# Texts longer than this are encoded through `encode_batch`, which lets go of the GIL while it works; `encode`
# holds it throughout. The gateway counts a long prompt on a worker thread, and with `encode` that thread still
# stopped the event loop, every other request with it, for as long as the count took (seconds for a few MB).
ENCODE_WITHOUT_GIL_CHARS = 4096


def _encode(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > ENCODE_WITHOUT_GIL_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


class Tokenizer:
    """Encode, decode and chat-format for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )
        self.eos_token_ids: list[int] = _eos_token_ids(backend, chat_template, eos_token_id, extra_eos_token_ids)
        self.fim_token_ids: tuple[int, int, int] | None = _fim_token_ids(backend)
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        self._compiled_template: jinja2.Template | None = None
        self._control_text: re.Pattern[str] | None = None  # built on first use
        self._text_backend: tokenizers.Tokenizer | None = None

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_hf_directory(cls, directory: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and, when present, chat_template.jinja and
        generation_config.json (its `eos_token_id` list) from an HF checkpoint directory."""
        directory = Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        chat_template = _select_template(config.get("chat_template"))
        template_file = directory / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text()
        generation = _read_json(directory / "generation_config.json")
        generation_eos = generation.get("eos_token_id")
        extra_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        return cls(
            backend,
            chat_template,
            bos_token_id=_token_id(backend, config.get("bos_token")),
            eos_token_id=_token_id(backend, config.get("eos_token")),
            extra_eos_token_ids=extra_eos,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

        The vocabulary-to-`tokenizers` conversion is transformers' own (the one behind
        `AutoTokenizer.from_pretrained(..., gguf_file=...)`), so both tokenize identically; it
        picks the pre-tokenizer split from `tokenizer.ggml.pre` and adds CONTROL tokens as special.
        """
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

        if "tokenizer.ggml.tokens" not in metadata:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no tokenizer")
        tokenizer_dict = {
            name: metadata[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in metadata
        }
        backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
        return cls(
            backend,
            metadata.get("tokenizer.chat_template"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        )

    # -- text ↔ ids -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return _encode(self.backend, text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (a partial UTF-8 sequence shows as U+FFFD), for logprobs."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (OpenAI's `logprobs[].bytes`)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if token_id in self._special_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            byte_of = _unicode_to_byte()
            return bytes(byte_of[char] for char in piece)
        # SentencePiece: byte-fallback pieces look like <0x0A>, and ▁ stands for a space.
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- chat -----------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text the model's chat template makes of `messages` (and `tools`, OpenAI-shaped
        `{"type": "function", "function": {...}}` dicts, as transformers passes them).

        Raises ValueError when the model has no template or the template rejects the messages
        (e.g. `raise_exception('Conversation roles must alternate ...')`).
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions endpoint instead")
        try:
            if self._compiled_template is None:
                self._compiled_template = _jinja_environment().from_string(self.chat_template)
            return self._compiled_template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                tools=[dict(tool) for tool in tools] if tools else None,
                bos_token=self._token_text_or_empty(self.bos_token_id),
                eos_token=self._token_text_or_empty(self.eos_token_ids[0] if self.eos_token_ids else None),
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template error: {error.message or error}") from error
        except (TypeError, KeyError, IndexError, AttributeError) as error:
            # The template is the model's data, and it fails like this on messages it does not expect
            # (e.g. `'<|im_start|>' + message['content']` with a None content): the caller's input is wrong.
            raise ValueError(f"chat template cannot render these messages: {error}") from error

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None, suffix: str = "",
    ) -> list[int]:
        """Token ids of the rendered chat prompt, then `suffix` (the start of the reply, when it is forced).
        Special tokens written by the template
        (`<|im_start|>`) become their single ids; no BOS is added beyond what the template writes.

        Special-token text inside the messages is tokenised as text, never as the control token, so
        a user cannot close their turn and open a system one by typing `<|im_end|>`: each such text
        is swapped for a placeholder nobody can guess before rendering, and encoded as plain text in
        its place. Messages without such text encode exactly as their rendered prompt does."""
        injected: list[str] = []
        marker = f"\ue000{secrets.token_hex(8)}:"
        shielded = [_shield(message, self._control_pattern(), marker, injected) for message in messages]
        text = self.render_chat(shielded, add_generation_prompt, tools) + suffix
        if not injected:
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for index, part in enumerate(re.split(f"{re.escape(marker)}(\\d+)\ue001", text)):
            if index % 2 == 0:
                ids += self.encode(part, add_special_tokens=False) if part else []
            else:
                ids += self._as_text(injected[int(part)])
        return ids

    def _control_pattern(self) -> re.Pattern[str]:
        if self._control_text is None:
            texts = sorted((self.backend.id_to_token(i) or "" for i in self._special_ids), key=len, reverse=True)
            self._control_text = re.compile("|".join(re.escape(t) for t in texts if t) or "(?!)")
        return self._control_text

    def _as_text(self, text: str) -> list[int]:
        """`text` with special-token strings encoded as ordinary text."""
        if self._text_backend is None:
            self._text_backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
            self._text_backend.encode_special_tokens = True
        return _encode(self._text_backend, text, add_special_tokens=False)

    @property
    def supports_tools(self) -> bool:
        """The chat template renders `tools` (it reads the variable)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def _token_text_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def _shield(value: Any, control: re.Pattern[str], marker: str, injected: list[str]) -> Any:
    """`value` (a message, or anything in it) with each control-token text replaced by
    `marker<index>\ue001`, the text appended to `injected`."""
    if isinstance(value, str):

        def swap(match: re.Match[str]) -> str:
            injected.append(match.group(0))
            return f"{marker}{len(injected) - 1}\ue001"

        return control.sub(swap, value)
    if isinstance(value, Mapping):
        return {key: _shield(item, control, marker, injected) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_shield(item, control, marker, injected) for item in value]
    return value


def _eos_token_ids(
    backend: tokenizers.Tokenizer, chat_template: str | None, eos_token_id: int | None, extra: Sequence[int]
) -> list[int]:
    """EOS, the end-of-turn token the chat template writes, `<|endoftext|>`, and any extra, deduplicated."""
    candidates: list[int | None] = [eos_token_id]
    for token in END_OF_TURN_TOKENS:
        if chat_template is not None and token in chat_template:
            candidates.append(backend.token_to_id(token))
    candidates.append(backend.token_to_id(END_OF_TEXT_TOKEN))
    candidates.extend(extra)
    return list(dict.fromkeys(token_id for token_id in candidates if token_id is not None))


def _fim_token_ids(backend: tokenizers.Tokenizer) -> tuple[int, int, int] | None:
    """The vocabulary's fill-in-the-middle tokens (prefix, suffix, middle), or None if it has no complete set."""
    for spellings in FIM_TOKENS:
        prefix, suffix, middle = (backend.token_to_id(token) for token in spellings)
        if prefix is not None and suffix is not None and middle is not None:
            return prefix, suffix, middle
    return None


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF's variant: unlike Jinja's builtin it does not HTML-escape, which templates rely on for tool schemas.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _jinja_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    return environment


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte→printable-character table used by byte-level BPE vocabularies."""
    byte_values = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    byte_values += list(range(ord("®"), ord("ÿ") + 1))
    code_points = byte_values[:]  # printable bytes stand for themselves
    for byte in range(256):
        if byte not in byte_values:
            byte_values.append(byte)
            code_points.append(256 + len(code_points) - 188)  # the others shift past U+00FF, in order
    return {chr(code_point): byte for byte, code_point in zip(byte_values, code_points, strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _select_template(template: str | list[dict[str, str]] | None) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones of which we use "default"."""
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _token_id(backend: tokenizers.Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    if isinstance(token, dict):  # older configs spell AddedToken out as a dict
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)
