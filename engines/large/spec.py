"""The large tier: Qwen2.5-Coder-1.5B-Instruct, for the requests the small tier would get wrong."""

from engines.tiers import TierSpec

SPEC = TierSpec(
    name="large",
    model="large",
    dtype="float32",
    quantization="auto",
    kv_cache_mb=1024,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    max_model_len=4096,
)
