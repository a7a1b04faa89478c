"""Plain configuration objects for the engine library.

Engines never read the gateway's configuration: callers (the CLI, the gateway, tests) build
these from whatever they hold and pass them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama / Qwen2 family."""

    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """How an engine instance runs: memory, batching, precision."""

    model: str  # path to a GGUF file or an HF safetensors directory
    dtype: str = "float32"  # activation / KV-cache dtype: "float32" | "bfloat16" (emulated without AVX-512 bf16)
    # None | "auto" | "w8a8" | "int8" | "int4" on CPU; None | "auto" | "int8" | "fp8" on CUDA (engines.quantization)
    quantization: str | None = None
    # w8a8: int8 passes over the attention's q/k/v and output projections' inputs (1 or 2; the second takes what the
    # first one's rounding left: `engines.quantization.W8A8Linear`). Two keep w8a8's perplexity within +1% of
    # float32 where one did not, for more products (BENCHMARKS.md, "w8a8 in two passes").
    w8a8_attention_passes: int = 2
    # None: `dtype`; "auto": bfloat16 on CUDA and on CPUs with native bf16 (half the bytes decode attention reads),
    # else `dtype`.
    kv_cache_dtype: str | None = None
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": weights, KV cache and every step's tensors live there
    # CUDA only: decode steps of up to this many rows replay captured CUDA graphs (one per batch size bucket)
    # instead of launching each kernel from Python; 0 runs every step eagerly.
    cuda_graph_max_batch: int = 64
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # None: derive from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 32  # running sequences per step
    # Requests queued beyond the running ones; more are refused at once (backpressure, 503 +
    # Retry-After) instead of queueing without bound.
    max_num_waiting: int = 256
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    # Batch-priority tokens a step may carry beside interactive work (decode rows first, then prefill chunks):
    # each row lengthens the step the interactive sequences wait for; batch work alone is not bounded.
    max_batch_tokens_beside_interactive: int = 1
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    # Every prompt token attends as a decode row, so a request's tokens and logprobs are the same bits whatever it
    # was batched with and however its prompt was chunked or found in the prefix cache (CPU engines whose decode
    # layers run natively, w8a8 or int8: `ModelRunner.rows_are_batch_invariant`). Without it, a quantised token's
    # logprob moves a little with the prompt's chunking; with it, prefill takes longer (BENCHMARKS.md,
    # "batch-invariant").
    batch_invariant: bool = False
    num_threads: int | None = None  # torch intra-op threads; None: physical cores
    seed: int = 0
    # Speculative decoding: a drafter sharing the tokenizer (GGUF file or safetensors directory) proposes
    # up to `num_speculative_tokens` tokens per decode step (engines.speculative); None: off.
    speculative_model: str | None = None
    num_speculative_tokens: int = 6
    # True: a round stops drafting where another draft no longer pays, judged by the drafter's probability for
    # its own tokens (engines.speculative.worth_another_draft); False: every round drafts the k the running
    # acceptance rate suggests. None: rounds of one sequence adapt, a batch's follow the acceptance rate — adaptive
    # rounds led at batch 1 on every CPU measured since 2026-12-05 and lost at batch 4 on several (BENCHMARKS.md).
    speculative_adaptive_drafts: bool | None = None
    # The drafter scores only the first this many token ids (byte-level BPE numbers tokens in merge order, so
    # these are the common ones: 99 % of GSM8K's tokens for the demo models' 151,936): a smaller head to
    # stream per draft. Verification keeps the output exact whatever the drafter proposes. None: all.
    speculative_draft_vocab: int | None = 65536
    served_model_name: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.w8a8_attention_passes not in (1, 2):
            raise ValueError(f"w8a8_attention_passes is 1 or 2, not {self.w8a8_attention_passes!r}")
