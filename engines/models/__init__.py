"""Model implementations, by the `architecture` name of ModelConfig."""

from __future__ import annotations

from engines.config import ModelConfig
from engines.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: {sorted(MODEL_CLASSES)}") \
            from None
