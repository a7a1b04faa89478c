"""Tiny, deterministic HF-format checkpoints for tests: random weights, a real trained BPE tokenizer.

`write_tiny_checkpoint(tmp_path, "llama")` gives a directory that both `transformers`
(`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`) and our own
`engines.loader.load_checkpoint` read. The qwen2 variant ties its embeddings (like Qwen2.5-0.5B)
and has q/k/v biases, so both loader paths are exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 512
TARGET_VOCAB_SIZE = 512
SEED = 0

# Qwen2.5-Coder's ChatML and fill-in-the-middle tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")
# The usual ChatML template (as shipped by Qwen2 / SmolLM2 instruct models), minus the default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few KB of plain English, so that merges cover common words and spaces ("Ġthe", "ing", ...).
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A gateway forwards requests to a model and returns the answer.
Every request is counted, every token is billed, and every budget is checked before the model runs.
Small models answer simple questions quickly; large models handle the hard ones with more care.
The cache remembers prompts that were seen before, so the second time is faster than the first.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Write a function that adds two numbers. def add(a, b): return a + b. The result is printed to the screen.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text, and so do symbols: + - * / = ( ) [ ] { } < > .
Once upon a time there was a little robot who wanted to learn how to read. It read one word at a time.
The weather is sunny in the morning and rainy in the evening. People walk their dogs in the park.
Attention is computed over keys and values that are stored in blocks of a paged cache on the device.
The scheduler decides which sequences run in the next step and how many tokens each of them may take.
She said that the meeting would start at nine and end before noon, and everybody agreed to be on time.
Please summarise the following paragraph in one sentence, using simple words that a child understands.
Questions, answers, instructions, and stories: the assistant should be helpful, honest, and harmless.
"""


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    added_tokens = {
        str(index): {
            "content": token,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }


def _model_config(
    architecture: Literal["llama", "qwen2"], vocab_size: int, bos_id: int, eos_id: int
) -> PretrainedConfig:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if architecture == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if architecture == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    raise ValueError(f"unknown architecture {architecture!r}; expected 'llama' or 'qwen2'")


def write_tiny_checkpoint(directory: Path, architecture: Literal["llama", "qwen2"]) -> Path:
    """Write a tiny random-weight HF checkpoint with a trained tokenizer into `directory`; return it."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))

    config = _model_config(
        architecture,
        vocab_size=tokenizer.get_vocab_size(),
        bos_id=tokenizer.token_to_id("<|endoftext|>"),
        eos_id=tokenizer.token_to_id("<|im_end|>"),
    )
    model_class = LlamaForCausalLM if architecture == "llama" else Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    return directory


# GGUF tensor names for HF parameter names (the inverse of engines.loader's mapping, written out here
# independently so that a test of the loader does not check the loader against itself).
_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{suffix}"
    return f"{_HF_TO_GGUF_GLOBAL[stem]}.{suffix}"


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for interleaved RoPE."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(directory: Path, architecture: Literal["llama", "qwen2"]) -> Path:
    """Convert the tiny checkpoint to `directory/tiny-<arch>.gguf` as llama.cpp does: Q8_0 matrices,
    F32 norms and biases, llama q/k rows permuted, tokenizer as `tokenizer.ggml.*` metadata.
    The HF directory it came from is kept in `directory/hf`."""
    import gguf
    from safetensors.numpy import load_file

    directory = Path(directory)
    hf_directory = write_tiny_checkpoint(directory / "hf", architecture)
    config = json.loads((hf_directory / "config.json").read_text())
    tokenizer = json.loads((hf_directory / "tokenizer.json").read_text())

    path = directory / f"tiny-{architecture}.gguf"
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token, _ in vocab])  # 3: CONTROL
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(CHATML_TEMPLATE)

    for name, tensor in load_file(hf_directory / "model.safetensors").items():
        values = tensor.astype(np.float32)
        if architecture == "llama" and ".q_proj.weight" in name:
            values = _llama_cpp_permute(values, config["num_attention_heads"])
        elif architecture == "llama" and ".k_proj.weight" in name:
            values = _llama_cpp_permute(values, config["num_key_value_heads"])
        if values.ndim == 2:
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
