"""Llama and Qwen2 decoder-only transformers (Qwen2 is Llama with q/k/v biases), over a paged KV cache.

q/k/v and gate/up projections are merged into one matmul each; weights are loaded from HF
parameter names by `load_weights`. Projections are plain `nn.Linear`, so weight-only
quantization can swap them in place.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch
import torch.nn.functional as F
from torch import nn

from engines.attention import AttentionMetadata, StepYielded, as_blocks, paged_attention
from engines.config import ModelConfig
from engines.cpu_kernels import (
    FORWARD_COST,
    DecodeLayerKernel,
    DecoderLayerWeights,
    DecodeRows,
    DecoderShape,
    LayerProducts,
    TiledW8A8Kernel,
    attention_isa,
    decode_layer,
    rms_norm_rows,
    rope_rows,
)
from engines.quantization import RowDispatchLinear, TiledW8A8Linear, first_output_rows, native_operands
from engines.sampler import GreedyTokens

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = rms_norm_rows()
        if kernel is not None and kernel.supports(x, self.weight):  # the decode layer's norm: its rows' bits
            return kernel(x, self.weight, self.eps)
        # Normalise in float32 whatever the activation dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(residual + x), residual + x)` in one Triton kernel (the CUDA path; `kernels.rms_norm`)."""
        from kernels.rms_norm import rms_norm  # imported where CUDA runs (see `kernels`)

        return rms_norm(x, self.weight, self.eps, residual)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_positions, head_dim] in float32 (HF's non-interleaved "rotate half"
    layout); the sin table's first half is negated (see `apply_rope`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/signed_sin [T, 1, D]. HF's x·cos + rotate_half(x)·sin, where rotate_half(x)
    = (-x₂, x₁): written x.roll(D/2)·(-sin₁, sin₂), which moves only signs (the same floats) in four ops
    instead of seven; a decode step runs this once per layer, over q's and k's heads together. On the CPU the same
    operations run in C (`rope_rows`), one pass instead of four over the rows of a prefill chunk."""
    kernel = rope_rows()
    if kernel is not None and kernel.supports(x, cos, signed_sin):
        return kernel(x, cos, signed_sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        if metadata.triton:
            return self.forward_fused(x, cos, sin, kv_cache, metadata)
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rope(qk.reshape(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                      metadata: AttentionMetadata) -> torch.Tensor:
        """`forward` on the CUDA path: RoPE and the K/V store in one kernel (`kernels.rope`), then the attention."""
        from kernels.rope import rope_and_store_kvcache  # imported where CUDA runs (see `kernels`)

        k_cache, v_cache = kv_cache
        q, k, v = rope_and_store_kvcache(
            self.qkv_proj(x), cos.squeeze(1), sin.squeeze(1), as_blocks(k_cache, metadata.block_size),
            as_blocks(v_cache, metadata.block_size), metadata.slot_mapping, self.num_heads, self.num_kv_heads,
            self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "gates", False):  # a CPU kernel's product that applies SiLU · up itself
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with SiLU and the product in one Triton kernel (the CUDA path; `kernels.activation`)."""
        from kernels.activation import silu_and_mul  # imported where CUDA runs (see `kernels`)

        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: KVCache, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on the CUDA path, where each residual add runs inside the norm after it (one kernel for
        both) and the MLP's SiLU · up is one kernel: `x` is the previous layer's output before its add (the
        embedding for the first layer, whose `residual` is None); returns this layer's output before its add,
        and the residual stream."""
        h, residual = self.input_layernorm.fused(x, residual)
        h, residual = self.post_attention_layernorm.fused(self.self_attn(h, cos, sin, kv_cache, metadata), residual)
        return self.mlp.forward_fused(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2. `forward` takes this step's flattened tokens of all sequences and returns hidden states."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                          bias=False)
        # Plain attributes, not buffers: they stay float32 on the CPU whatever the model is cast to.
        self.rope_cos, self.rope_sin = rope_cos_sin(config.head_dim, max_positions or config.max_position_embeddings,
                                                    config.rope_theta)

    @staticmethod
    def is_attention_projection(name: str) -> bool:
        """Whether the linear layer of this qualified name is an attention's q/k/v or output projection: the layers
        whose w8a8 inputs take two int8 passes (`EngineConfig.w8a8_attention_passes`)."""
        return name.rpartition(".")[2] in ("qkv_proj", "o_proj")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        native = metadata.native_decode
        if metadata.triton:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                self._yield_if_asked(metadata)
                x, residual = layer.forward_fused(x, residual, cos, sin, kv_cache, metadata)
            return self.norm.fused(x, residual)[0]
        if native is None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                self._yield_if_asked(metadata)
                x = layer(x, cos, sin, kv_cache, metadata)
            return self.norm(x)
        # The decode rows through the native layers, the prefill rows (if any) through the modules: each row
        # of a step depends on its own sequence only, so the two halves are computed apart, layer by layer.
        n = metadata.num_decode_tokens
        decode_x, prefill_x = x[:n].contiguous(), x[n:]
        prefill_metadata = metadata.prefill_only() if metadata.prefills else None
        prefill_cos, prefill_sin = cos[n:], sin[n:]
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            self._yield_if_asked(metadata)
            native.run_layer(index, decode_x)
            if prefill_metadata is not None:
                prefill_x = layer(prefill_x, prefill_cos, prefill_sin, kv_cache, prefill_metadata)
        return self.norm(torch.cat([decode_x, prefill_x]) if prefill_metadata is not None else decode_x)

    @staticmethod
    def _yield_if_asked(metadata: AttentionMetadata) -> None:
        if metadata.should_yield is not None and metadata.should_yield():
            raise StepYielded

    def native_decoder(self, kv_caches: list[KVCache], block_size: int) -> NativeDecoder | None:
        """Every layer's operands for the whole-layer decode kernel, or None where the kernel or one of the
        layers cannot take them (anything but int8 products the kernel takes, `native_operands`, of one kind
        throughout)."""
        kernel, config = decode_layer(), self.config
        kv_dtype = kv_caches[0][0].dtype
        if kernel is None or not kernel.supports(config.hidden_size, config.num_attention_heads,
                                                 config.num_key_value_heads, config.head_dim,
                                                 config.intermediate_size, kv_dtype, block_size):
            return None
        layers, kinds = [], set()
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            products = [native_operands(module) for module in (attention.qkv_proj, attention.o_proj,
                                                               mlp.gate_up_proj, mlp.down_proj)]
            norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            found = [product for product in products if product is not None]
            if len(found) < len(products) or any(norm.dtype != torch.float32 for norm in norms):
                return None
            if found[2][1].activation_passes != 1:  # the layer's gate_up product runs in one pass
                return None
            kinds.update(kind for kind, _ in found)
            layers.append(kernel.layer(*norms, *(operands for _, operands in found), k_cache, v_cache))
        if len(kinds) != 1:  # one kind of product throughout
            return None
        products = kinds.pop()
        shape = DecoderShape(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                             config.head_dim, config.intermediate_size, block_size, config.rms_norm_eps,
                             config.head_dim ** -0.5, int(kv_dtype == torch.bfloat16), products,
                             {"avx512bf16": 1, "amx": 2}.get(attention_isa(), 0) if kv_dtype == torch.bfloat16 else 0)
        return NativeDecoder(kernel, shape, layers, self.rope_cos, self.rope_sin)

    def move_to(self, device: torch.device) -> None:
        """Move every weight and the RoPE tables to `device`, each shared tensor once: `Module.to` would copy a
        buffer once per module holding it (the int8 table a tied head shares with the embedding)."""
        moved: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}

        def move(tensor: torch.Tensor) -> torch.Tensor:
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            if key not in moved:
                moved[key] = tensor.to(device)
            return moved[key]

        self._apply(move)
        self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)

    def untie_lm_head(self) -> None:
        """Give a tied model an `lm_head` module sharing the embedding's weight (no copy).

        Weight-only quantisation replaces nn.Linear modules only; the tied head (a quarter of a
        0.5B model's decode FLOPs) is reachable once it is one.
        """
        if self.lm_head is None:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight

    def greedy_tokens(self, hidden: torch.Tensor, with_logprobs: bool = False) -> GreedyTokens | None:
        """Each row's argmax of `compute_logits(hidden)` (and with `with_logprobs` its log-softmax there) from the
        LM head's own pass, without the logits, where the head can give it (`TiledW8A8Linear.argmax`); None where
        it cannot."""
        head = self.lm_head
        if not isinstance(head, TiledW8A8Linear) or head.out_features != self.config.vocab_size:
            return None
        chosen = head.argmax(hidden, with_logprobs)
        return None if chosen is None else GreedyTokens(*chosen)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight)
        logits = self.lm_head(hidden)
        vocab_size = self.config.vocab_size
        if logits.shape[-1] == vocab_size:
            return logits
        padded = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        padded[..., :logits.shape[-1]] = logits
        return padded

    def limit_vocabulary(self, num_ids: int) -> int:
        """Score only the first `num_ids` token ids (the others' logits are -inf): a speculative drafter's head,
        sharing the full one's weight. Returns the head's weight bytes a step no longer reads (0 where the head
        cannot be cut: int4)."""
        self.untie_lm_head()
        head = self.lm_head
        assert head is not None
        vocab_size = self.config.vocab_size
        if num_ids >= vocab_size or (cut := first_output_rows(head, num_ids)) is None:
            return 0
        self.lm_head = cut
        weight = head.packed.weight if isinstance(head, RowDispatchLinear) else head.weight
        return (vocab_size - num_ids) * head.in_features * weight.element_size()

    @torch.no_grad()
    def load_weights(self, tensors: MutableMapping[str, torch.Tensor], *, consume: bool = False,
                     on_layer_loaded: Callable[[nn.Module], None] | None = None) -> None:
        """Copy HF-named tensors in (merging q/k/v and gate/up); every parameter must be covered exactly once.

        `consume` empties `tensors` as it goes. Parameters still on the meta device are allocated
        module by module as their tensors arrive, and `on_layer_loaded` gets each decoder layer once it
        is whole (to quantise it), then the model itself once an untied head is loaded (its only float
        nn.Linear left by then), before the embedding: a model loaded that way is never whole in float32
        (6 GB at 1.5B)."""
        params = {name: tuple(param.shape) for name, param in self.named_parameters()}
        layer_params = [{name for name in params if name.startswith(f"layers.{i}.")} for i in range(len(self.layers))]
        loaded: set[str] = set()

        def copy(name: str, tensor: torch.Tensor) -> None:
            if name not in params:
                raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
            if params[name] != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {params[name]}")
            module_name, _, param_name = name.rpartition(".")
            module = self.get_submodule(module_name)
            if getattr(module, param_name).is_meta:
                module.to_empty(device="cpu", recurse=False)
            getattr(module, param_name).copy_(tensor)
            loaded.add(name)
            if on_layer_loaded is not None and name.startswith("layers."):
                index = int(name.split(".")[1])
                if name in layer_params[index] and layer_params[index] <= loaded:
                    on_layer_loaded(self.layers[index])

        merged = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        pending: dict[str, list[torch.Tensor | None]] = {}
        # The vocabulary-sized tensors last, head then embedding: handed over as soon as it is loaded,
        # each is the only float32 table in memory at its time (they are 0.9 GB each at 1.5B).
        last = {"lm_head.weight": 1, "embed_tokens.weight": 2}
        for hf_name in sorted(tensors, key=lambda n: last.get(n.removeprefix("model."), 0)):
            tensor = tensors.pop(hf_name) if consume else tensors[hf_name]
            if "rotary_emb" in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in merged:
                target, index = merged[parts[-2]]
                key = ".".join([*parts[:-2], target, parts[-1]])
                pieces = pending.setdefault(key, [None] * (3 if target == "qkv_proj" else 2))
                pieces[index] = tensor
                if all(piece is not None for piece in pieces):
                    copy(key, torch.cat(pending.pop(key), dim=0))  # type: ignore[arg-type]
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some checkpoints store the tied head anyway
            copy(name, tensor)
            if name == "lm_head.weight" and on_layer_loaded is not None:
                on_layer_loaded(self)  # every layer was handed over: the head is the only nn.Linear left
        if pending:
            raise ValueError(f"checkpoint lacks part of {sorted(pending)[0]!r}")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


class NativeDecoder:
    """A model's decode rows through `DecodeLayerKernel`, one native call per layer (RMSNorm, int8 products,
    RoPE, KV store, paged attention, SiLU, residuals), instead of ~20 PyTorch ops and kernel calls per layer:
    at batch 1 those cost a third of a step (BENCHMARKS.md). Built once per model runner by
    `LlamaForCausalLM.native_decoder`; `rows` prepares a step's decode rows."""

    def __init__(self, kernel: DecodeLayerKernel, shape: DecoderShape,
                 layers: list[tuple[DecoderLayerWeights, list[torch.Tensor]]], rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor) -> None:
        self.kernel, self.shape, self.layers = kernel, shape, layers
        self.products = LayerProducts(shape.products)
        self.forward_cost = FORWARD_COST[self.products]
        # Whether the modules compute a decode row to these layers' bits: w8a8 products in tile order sum exactly
        # at any row count, and the modules' norms, RoPE, attention and (where gate_up's halves are whole groups
        # of the tile order, `TiledW8A8Kernel.gates`) SiLU on the CPU are these layers' C code. Int8 weight-only
        # products differ by row count; an ungated MLP's SiLU is torch's in the modules.
        self.modules_match = (self.products in (LayerProducts.W8A8_AMX, LayerProducts.W8A8_VNNI)
                              and shape.intermediate % TiledW8A8Kernel.group == 0)
        self.max_rows = kernel.max_rows
        self._rope_cos, self._rope_sin = rope_cos, rope_sin

    def rows(self, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor) -> PreparedDecodeRows:
        """The step's decode rows (at most `max_rows`): their positions, KV slots, block tables, context lengths."""
        step = self.kernel.rows(self.shape, self._rope_cos[positions], self._rope_sin[positions], slot_mapping,
                                block_tables, context_lens)
        return PreparedDecodeRows(self, *step)


class PreparedDecodeRows:
    """One step's decode rows by address for `DecodeLayerKernel` (`engines.attention.NativeDecodeRows`), with the
    tensors those addresses point into, kept alive for the step."""

    def __init__(self, decoder: NativeDecoder, step: DecodeRows, keep: list[torch.Tensor]) -> None:
        self._decoder, self._step, self._keep = decoder, step, keep

    def run_layer(self, index: int, x: torch.Tensor) -> None:
        decoder = self._decoder
        decoder.kernel(decoder.layers[index][0], decoder.shape, self._step, x)
