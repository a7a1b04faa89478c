"""The small tier: Qwen2.5-Coder-0.5B-Instruct, cheap and quick, serving most traffic."""

from engines.tiers import TierSpec

SPEC = TierSpec(
    name="small",
    model="small",
    dtype="float32",
    quantization="auto",
    kv_cache_mb=512,
    max_num_seqs=32,
    max_num_batched_tokens=512,
    max_model_len=4096,
)
