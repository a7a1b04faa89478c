"""Loading checkpoints: HF safetensors directories and GGUF files give HF-named float32 tensors,
the right ModelConfig and the model's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.config import ModelConfig
from engines.cpu import drop_mapped_pages
from engines.loader import (
    hf_name,
    load_checkpoint,
    load_tokenizer,
    model_config_from_gguf,
    read_gguf,
    reverse_llama_rope_permutation,
)
from engines.tokenizer import Tokenizer
from tests.tiny_models import write_tiny_checkpoint, write_tiny_gguf

MODELS_DIR = Path("~/.cache/sluice/models").expanduser()
TINY_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model(filename: str) -> Path:
    path = MODELS_DIR / filename
    if not path.is_file():
        pytest.skip(f"{path} is absent; fetch it with `sluice models fetch`")
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_safetensors_round_trip(tmp_path: Path, architecture: str) -> None:
    from transformers import AutoModelForCausalLM

    directory = write_tiny_checkpoint(tmp_path / architecture, architecture)  # type: ignore[arg-type]
    checkpoint = load_checkpoint(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    expected = reference.state_dict()
    tied = architecture == "qwen2"
    if tied:
        expected.pop("lm_head.weight")
    assert checkpoint.tensors.keys() == expected.keys()
    for name, tensor in checkpoint.tensors.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)

    config = checkpoint.config
    hf = reference.config
    assert config.architecture == architecture
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
    )
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.head_dim == hf.hidden_size // hf.num_attention_heads
    assert config.rope_theta == (10000.0 if architecture == "llama" else 1000000.0)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.tie_word_embeddings is tied
    assert config.attention_bias is (architecture == "qwen2")
    assert config.vocab_size == checkpoint.tokenizer.vocab_size
    assert checkpoint.tokenizer.backend.token_to_id("<|im_end|>") in config.eos_token_ids
    assert config.bos_token_id == checkpoint.tokenizer.bos_token_id


def test_load_tokenizer_alone(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path / "llama", "llama")
    tokenizer = load_tokenizer(directory)
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_missing_or_invalid_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(not_gguf)


def test_gguf_names_map_to_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_name("blk.2.ffn_down.weight") == "model.layers.2.mlp.down_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_reverse_rope_permutation_undoes_llama_cpp_conversion() -> None:
    num_heads, head_dim, hidden = 3, 8, 5
    weight = np.arange(num_heads * head_dim * hidden, dtype=np.float32).reshape(num_heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = weight.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(reverse_llama_rope_permutation(permuted, num_heads), weight)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tiny_gguf_loads_as_its_hf_original(tmp_path: Path, architecture: str) -> None:
    """A llama.cpp-style conversion (Q8_0, permuted llama q/k rows) loads back to the HF weights up to
    Q8_0 rounding, with the same tokenizer and architecture."""
    import gguf

    path = write_tiny_gguf(tmp_path, architecture)  # type: ignore[arg-type]
    original = load_checkpoint(tmp_path / "hf")
    checkpoint = load_checkpoint(path)
    assert checkpoint.tensors.keys() == original.tensors.keys()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in checkpoint.tensors.items():
        weight = original.tensors[name].numpy()
        expected = gguf.quants.dequantize(gguf.quants.quantize(weight, q8_0), q8_0) if weight.ndim == 2 else weight
        # exact: Q8_0 blocks run along rows, and the q/k permutation only reorders whole rows
        np.testing.assert_array_equal(tensor.numpy(), expected, err_msg=name)

    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_ids"):  # fmt: skip
        assert getattr(checkpoint.config, field) == getattr(original.config, field), field
    assert checkpoint.config.rms_norm_eps == pytest.approx(original.config.rms_norm_eps)  # stored as float32
    text = "Hello, world! naïve café 🙂"
    assert checkpoint.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": text}]) == (
        original.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    )


@pytest.mark.slow  # transformers' own GGUF load of the reference takes ~30 s here
def test_gguf_tensors_equal_transformers_state_dict() -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    path = demo_model(TINY_GGUF)
    checkpoint = load_checkpoint(path)
    reference = AutoModelForCausalLM.from_pretrained(MODELS_DIR, gguf_file=TINY_GGUF, dtype=torch.float32)
    expected = reference.state_dict()
    assert checkpoint.config.tie_word_embeddings
    expected.pop("lm_head.weight")  # tied: the same tensor as the embedding
    assert checkpoint.tensors.keys() == expected.keys()
    for name, tensor in checkpoint.tensors.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_gguf_tensors_have_hf_shapes_and_values() -> None:
    path = demo_model(TINY_GGUF)
    checkpoint = load_checkpoint(path)
    config = checkpoint.config
    tensors = checkpoint.tensors
    assert len(tensors) == 2 + config.num_hidden_layers * 9
    assert tensors["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (q_rows, config.hidden_size)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (kv_rows, config.hidden_size)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (config.hidden_size, config.intermediate_size)
    assert all(t.dtype == torch.float32 and t.is_contiguous() and torch.isfinite(t).all() for t in tensors.values())
    # A real model, not zeros: RMSNorm gains sit around 1, embeddings are small but non-zero.
    assert 0.1 < tensors["model.norm.weight"].abs().mean() < 10
    assert tensors["model.embed_tokens.weight"].std() > 1e-3


DEMO_CONFIGS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
    ),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True, bos_token_id=151643,
    ),
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True, bos_token_id=151643,
    ),
}  # fmt: skip


@pytest.mark.parametrize("filename", list(DEMO_CONFIGS))
def test_gguf_model_config(filename: str) -> None:
    gguf_file = read_gguf(demo_model(filename))
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata)
    config = model_config_from_gguf(gguf_file.metadata, set(gguf_file.tensors), tokenizer)
    expected = DEMO_CONFIGS[filename]
    actual = {name: getattr(config, name) for name in expected}
    assert actual == pytest.approx(expected)
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    assert im_end in config.eos_token_ids
    assert isinstance(config, ModelConfig)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status; madvise is Linux's")
def test_dropping_a_mapped_files_pages_releases_them_and_keeps_the_data(tmp_path: Path) -> None:
    def rss_file_kb() -> int:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("RssFile")).split()[1])

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * (32 << 12))  # 32 MiB
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    assert int(mapped.sum(dtype=np.int64)) > 0  # every page read: resident
    before = rss_file_kb()
    drop_mapped_pages(mapped)
    assert before - rss_file_kb() > 24 << 10
    assert int(mapped[12345]) == 12345 % 256  # still readable: faulted back in from the file
