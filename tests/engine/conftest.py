"""Shared fixtures: tiny random checkpoints (with a trained tokenizer) and their HF reference models.

The random weights are drawn with a large standard deviation so that greedy decoding walks
through varied tokens instead of repeating one: parity tests then compare something meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.config import EngineConfig
from engines.llm_engine import LLMEngine
from engines.loader import Checkpoint, load_checkpoint
from tests.tiny_models import write_tiny_checkpoint

MODELS_DIR = Path("~/.cache/sluice/models").expanduser()
SMOLLM2_GGUF = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_STD = 0.25


@dataclass
class TinyModel:
    checkpoint: Checkpoint
    hf_model: torch.nn.Module  # float32 reference with exactly the checkpoint's weights


def _tiny_model(directory: Path, architecture: str) -> TinyModel:
    path = write_tiny_checkpoint(directory, architecture)  # type: ignore[arg-type]
    checkpoint = load_checkpoint(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(WEIGHT_STD * torch.randn(param.shape, generator=generator))
    tensors = {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()}
    if checkpoint.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return TinyModel(Checkpoint(config=checkpoint.config, tensors=tensors, tokenizer=checkpoint.tokenizer), hf_model)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(f"tiny_{request.param}")


def make_engine(model: TinyModel, **overrides: object) -> LLMEngine:
    """A float32 engine over a tiny model; keyword arguments override EngineConfig fields."""
    settings: dict[str, object] = dict(model="tiny", dtype="float32", num_kv_blocks=64, block_size=4,
                                       max_num_seqs=8, max_num_batched_tokens=64, num_threads=1)
    settings.update(overrides)
    return LLMEngine.from_checkpoint(model.checkpoint, EngineConfig(**settings))  # type: ignore[arg-type]


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; return every request's outputs in order."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("the engine did not finish within max_steps")


def generated_ids(outputs: list) -> list[int]:
    return [token_id for output in outputs for token_id in output.new_token_ids]
