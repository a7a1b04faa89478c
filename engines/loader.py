"""Checkpoints in, plain float32 tensors out: GGUF files and HF safetensors directories.

Whatever the source, a `Checkpoint` holds the model's `ModelConfig`, its weights under HF
parameter names (`model.layers.0.self_attn.q_proj.weight`, ...) as float32 tensors, and its
`Tokenizer`. With tied embeddings (`config.tie_word_embeddings`) there is no `lm_head.weight`.

GGUF: the header is parsed here (`gguf.GGUFReader` builds numpy views for every element of the
vocabulary arrays and takes 4-13 s on the demo models before touching a weight); block
dequantisation is `gguf.quants.dequantize` (numpy) on zero-copy views of a memory map.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.config import ModelConfig
from engines.cpu import drop_mapped_pages
from engines.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: MutableMapping[str, torch.Tensor]  # HF parameter names, float32 (GGUF: dequantised when read)
    tokenizer: Tokenizer


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a GGUF file or an HF safetensors directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _load_hf_directory(path)
    if path.is_file():
        return _load_gguf(path)
    raise FileNotFoundError(f"no checkpoint at {path}: expected a .gguf file or an HF directory with config.json")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a checkpoint, without reading any weights."""
    path = Path(path).expanduser()
    if path.is_dir():
        return Tokenizer.from_hf_directory(path)
    return Tokenizer.from_gguf_metadata(read_gguf(path).metadata)


# -- GGUF -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (rows last-but-one), i.e. GGUF's dims reversed
    ggml_type: int
    data: np.ndarray  # uint8 view into the memory map, [rows, bytes per row]


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF v2/v3 header; tensor data stays in the memory map until dequantised."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    buffer = memoryview(blob)
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported")
    position = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, position = _read_string(buffer, position)
        (value_type,) = struct.unpack_from("<I", buffer, position)
        metadata[key], position = _read_value(buffer, position + 4, value_type)

    infos = []
    for _ in range(tensor_count):
        name, position = _read_string(buffer, position)
        (num_dims,) = struct.unpack_from("<I", buffer, position)
        dims = struct.unpack_from(f"<{num_dims}Q", buffer, position + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buffer, position + 4 + 8 * num_dims)
        position += 4 + 8 * num_dims + 12
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))

    alignment = metadata.get("general.alignment", 32)
    data_start = (position + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        row_bytes = shape[-1] // block_size * type_size
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        start = data_start + offset
        data = blob[start : start + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, shape, ggml_type, data)
    return GGUFFile(metadata, tensors)


def _read_string(buffer: memoryview, position: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, position)
    start = position + 8
    return str(buffer[start : start + length], "utf-8"), start + length


def _read_value(buffer: memoryview, position: int, value_type: int) -> tuple[Any, int]:
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buffer, position)[0], position + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(buffer, position)
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", buffer, position)
        position += 12
        if element_type in _NUMPY_SCALARS:
            values = np.frombuffer(buffer, dtype=_NUMPY_SCALARS[element_type], count=count, offset=position)
            return values.tolist(), position + values.nbytes
        items = []
        for _ in range(count):
            item, position = _read_value(buffer, position, element_type)
            items.append(item)
        return items, position
    raise ValueError(f"unknown GGUF metadata value type {value_type}")


# GGUF tensor name (after "blk.N.") → HF parameter name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`."""
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, module = stem.split(".", 2)
        if module not in _GGUF_LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"
    if stem not in _GGUF_GLOBAL_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"


# Dequantised a block of rows at a time into one output, each block at most this many values (16 MB of float32):
# either dequantiser makes a few temporaries of a block's size (gguf-py's, several times the size of what it
# returns, took gigabytes at once for a 151936-row embedding; 4096-row blocks of the large model's 8960-wide
# rows added 0.5 GB to its loading peak).
_DEQUANTIZE_VALUES = 1 << 22


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """float32 array of `tensor.shape`."""
    from gguf.quants import dequantize as gguf_dequantize

    from engines.ggml import DEQUANTIZERS, dequantize_rows

    if tensor.ggml_type == 0:  # F32: already the values, reinterpret the bytes
        return tensor.data.view(np.float32).reshape(tensor.shape)
    if tensor.ggml_type == 1:  # F16
        return tensor.data.view(np.float16).astype(np.float32).reshape(tensor.shape)
    rows, width = tensor.data.shape[0], tensor.shape[-1]
    values = np.empty((rows, width), dtype=np.float32)
    block_rows = max(1, _DEQUANTIZE_VALUES // width)
    for start in range(0, rows, block_rows):
        block = tensor.data[start:start + block_rows]
        if tensor.ggml_type in DEQUANTIZERS:  # the demo checkpoints' formats, in torch (engines/ggml.py)
            dequantize_rows(block, tensor.ggml_type, torch.from_numpy(values[start:start + len(block)]))
        else:
            values[start:start + len(block)] = gguf_dequantize(block, tensor.ggml_type).reshape(len(block), -1)
    return values.reshape(tensor.shape)


def reverse_llama_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of q/k rows.

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)… while HF rotates halves (x_i, x_{i+d/2}),
    so the converter reorders each head's rows; this is transformers' `_reverse_permute_weights`.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def model_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], tokenizer: Tokenizer) -> ModelConfig:
    architecture = metadata["general.architecture"]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")

    def field(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{architecture}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {architecture}.{name}")
        return value

    hidden_size = field("embedding_length")
    num_heads = field("attention.head_count")
    return ModelConfig(
        architecture=architecture,
        vocab_size=field("vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        hidden_size=hidden_size,
        intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field("attention.head_count_kv", num_heads),
        head_dim=field("attention.key_length", hidden_size // num_heads),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        max_position_embeddings=field("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )


def _load_gguf(path: Path) -> Checkpoint:
    gguf_file = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata)
    config = model_config_from_gguf(gguf_file.metadata, set(gguf_file.tensors), tokenizer)

    def convert(name: str) -> torch.Tensor:
        values = dequantize(gguf_file.tensors[name])
        if values.flags.writeable:  # a fresh array: the file's pages are read and not needed again
            drop_mapped_pages(gguf_file.tensors[name].data)
        if config.architecture == "llama" and ".attn_q." in name:
            values = reverse_llama_rope_permutation(values, config.num_attention_heads)
        elif config.architecture == "llama" and ".attn_k." in name:
            values = reverse_llama_rope_permutation(values, config.num_key_value_heads)
        # dequantize returns a fresh writable array except for F32 (a read-only map view): copy only then
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    return Checkpoint(config, LazyTensors({hf_name(name): name for name in gguf_file.tensors}, convert), tokenizer)


class LazyTensors(MutableMapping[str, torch.Tensor]):
    """A checkpoint's float32 tensors, each dequantised from the memory-mapped file when it is read.

    A 1.5B model is 6 GB in float32: loading it whole before building (and quantising) the model
    doubled the peak memory of a start. Reading a tensor twice dequantises it twice; tensors stored
    (`mapping[name] = tensor`) are kept as given.
    """

    def __init__(self, sources: dict[str, str], convert: Callable[[str], torch.Tensor]) -> None:
        self._sources = dict(sources)  # HF name → name in the file
        self._convert = convert
        self._stored: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._stored:
            return self._stored[name]
        return self._convert(self._sources[name])

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._sources.pop(name, None)
        self._stored[name] = tensor

    def __delitem__(self, name: str) -> None:
        if self._stored.pop(name, None) is None:
            del self._sources[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*self._sources, *self._stored])

    def __len__(self) -> int:
        return len(self._sources) + len(self._stored)


# -- HF safetensors -------------------------------------------------------------------------------


def model_config_from_hf(config: dict[str, Any], tokenizer: Tokenizer) -> ModelConfig:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_ARCHITECTURES}")
    num_heads = config["num_attention_heads"]
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    eos = config.get("eos_token_id")
    config_eos = [eos] if isinstance(eos, int) else list(eos or [])
    return ModelConfig(
        architecture=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases; Llama only when its config says attention_bias
        attention_bias=model_type == "qwen2" or config.get("attention_bias", False),
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys([*tokenizer.eos_token_ids, *config_eos])),
    )


def _load_hf_directory(directory: Path) -> Checkpoint:
    from safetensors.torch import load_file

    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    tokenizer = Tokenizer.from_hf_directory(directory)
    config = model_config_from_hf(json.loads(config_file.read_text()), tokenizer)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            tensors[name] = tensor.float()  # no copy when already float32
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return Checkpoint(config, tensors, tokenizer)
