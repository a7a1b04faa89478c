"""The engine on a CUDA GPU: each kernel against its reference and the bandwidth floor, then both tiers' decode
tokens/s per weight format, with CUDA graphs and without, and speculative decoding.

`python -m bench.gpu [--quick] [--out FILE]` (`bench/gpu.sh` runs it after the kernel tests on a lent GPU
machine, which has no internet).

Bandwidth: a device-to-device copy of 2 GiB, bytes read plus written per second, measured in the same run: the
roofline every "% of bandwidth" figure divides by.

Kernels (bfloat16): the paged-attention decode kernel over the demo tiers' attention shapes, as the unique K/V
bytes it must read per second (each KV head's rows once, however many query heads share them); the KV store; the
fused residual add + RMSNorm against the PyTorch ops it replaces (both inside CUDA graphs: their count is the cost);
RoPE + the K/V store in one kernel (its reference launched from the host: its store indexes by a mask);
the int8 weight-only product (`kernels.int8_matmul`) and the fp8 layer (`Fp8Linear`, `torch._scaled_mm`) at 1 and
16 rows against the bfloat16 product (cuBLAS) on the tiers' largest projections, as weight bytes read per second.
Each kernel's result is checked against its reference in the same run (max abs error printed).

Engine: the demo tiers' architectures (`SHAPES`: Qwen2.5-Coder-0.5B and 1.5B, read from the demo GGUFs) with
random weights, N(0, 0.02): the GPU machine cannot fetch the demo checkpoints and a run may carry 64 MiB, which
holds neither. A decode step's time does not depend on the weights' values, so tokens/s are the real models';
what does depend on them is the speculative acceptance rate (a random drafter agrees with a random target on
almost nothing), so the speculative rows measure what a round costs here, not what it gains on real weights.
Each configuration: one greedy request alone (batch 1, EOS ignored) as decode tokens/s and as weight bytes
read per second over the copy bandwidth, then 16 and 64 requests at once as output tokens/s (prefill included).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_model, print_table, write_results
from bench.engine import decode_weight_bytes
from engines.config import EngineConfig, ModelConfig
from engines.loader import Checkpoint
from engines.sampling_params import SamplingParams
from engines.tokenizer import Tokenizer

SHAPES = {
    "small": ModelConfig(architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, attention_bias=True),
    "large": ModelConfig(architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, attention_bias=True),
}
FORMATS = ("bfloat16", "int8", "fp8")
PROMPT_TOKENS = 64
BATCH1_TOKENS = 128
THROUGHPUT_BATCHES = (16, 64)
THROUGHPUT_TOKENS = 64
BLOCK_SIZE = 16


# -- timing --------------------------------------------------------------------------------------------


def cuda_time(run: Callable[[], object], repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of one `run()` launched from the host (CUDA events around each call): the launch overhead
    included, as an eager step pays it."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_time(run: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Median seconds of one `run()` on the GPU alone: `calls` calls captured in one CUDA graph, replayed, so that
    no host launch overhead is counted (as in the engine's captured decode steps)."""
    run()  # compiles, and sets up workspaces outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    return cuda_time(graph.replay, repeats=replays, warmup=1) / calls


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes read plus written per second by a device-to-device copy of `gib` GiB."""
    source = torch.empty(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    seconds = cuda_time(lambda: target.copy_(source), repeats=20)
    return 2 * source.numel() * 2 / seconds


# -- kernels -------------------------------------------------------------------------------------------


def attention_rows(bandwidth: float, quick: bool) -> list[dict[str, Any]]:
    cases = [(1, 4096), (32, 1024), (64, 2048)] if not quick else [(8, 512)]
    rows = []
    for tier, config in SHAPES.items():
        rows += [decode_attention_row(tier, config, num_seqs, context, bandwidth) for num_seqs, context in cases]
        rows.append(store_row(tier, config, bandwidth))
        rows += [rms_norm_row(tier, config, num_rows, bandwidth) for num_rows in (1, 64)]
        rows += [rope_row(tier, config, num_tokens, bandwidth) for num_tokens in (1, 64)]
    return rows


def rope_row(tier: str, config: ModelConfig, num_tokens: int, bandwidth: float) -> dict[str, Any]:
    """RoPE + the K/V store in one kernel; the reference (PyTorch ops, its store indexing by a mask) runs eagerly."""
    from kernels.rope import rope_and_store_kvcache, rope_and_store_kvcache_reference

    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda")
    cos, sin = (torch.randn(num_tokens, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    caches = [torch.zeros(num_tokens, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    slots = torch.arange(num_tokens, device="cuda") * BLOCK_SIZE
    shape = (heads, kv_heads, dim)
    seconds = graph_time(lambda: rope_and_store_kvcache(qkv, cos, sin, caches[0], caches[1], slots, *shape))
    reference_seconds = cuda_time(lambda: rope_and_store_kvcache_reference(qkv, cos, sin, caches[2], caches[3], slots,
                                                                           *shape))
    got = rope_and_store_kvcache(qkv, cos, sin, caches[0], caches[1], slots, *shape)
    expected = rope_and_store_kvcache_reference(qkv, cos, sin, caches[2], caches[3], slots, *shape)
    error = max((g.float() - e.float()).abs().max().item() for g, e in zip(got, expected, strict=True))
    moved = qkv.numel() * 2 + 2 * (heads + 3 * kv_heads) * dim * num_tokens  # qkv read; q, k, cached k, v written
    return dict(kernel="rope + store K/V", tier=tier, shape=f"{num_tokens} tokens", microseconds=seconds * 1e6,
                launched_microseconds=cuda_time(lambda: rope_and_store_kvcache(qkv, cos, sin, caches[0], caches[1],
                                                                               slots, *shape)) * 1e6,
                reference_microseconds=reference_seconds * 1e6, floor_microseconds=moved / bandwidth * 1e6,
                fraction_of_bandwidth=moved / seconds / bandwidth, max_abs_error=error)


def rms_norm_row(tier: str, config: ModelConfig, num_rows: int, bandwidth: float) -> dict[str, Any]:
    """The fused residual add + RMSNorm against the PyTorch ops it replaces (both timed inside CUDA graphs)."""
    from kernels.rms_norm import rms_norm, rms_norm_reference

    hidden = config.hidden_size
    x, residual = (torch.randn(num_rows, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    weight = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    arguments = (x, weight, config.rms_norm_eps, residual)
    seconds = graph_time(lambda: rms_norm(*arguments))
    reference_seconds = graph_time(lambda: rms_norm_reference(*arguments))
    error = (rms_norm(*arguments)[0].float() - rms_norm_reference(*arguments)[0].float()).abs().max().item()
    moved = 4 * num_rows * hidden * 2  # x and residual read, the sum and the output written, bfloat16; weight aside
    return dict(kernel="add + rms_norm", tier=tier, shape=f"{num_rows}x{hidden}", microseconds=seconds * 1e6,
                launched_microseconds=cuda_time(lambda: rms_norm(*arguments)) * 1e6,
                reference_microseconds=reference_seconds * 1e6, floor_microseconds=moved / bandwidth * 1e6,
                fraction_of_bandwidth=moved / seconds / bandwidth, max_abs_error=error)


def decode_attention_row(tier: str, config: ModelConfig, num_seqs: int, context: int, bandwidth: float,
                         reference: bool = True, **launch: int) -> dict[str, Any]:
    from kernels.paged_attention import paged_attention_decode, paged_attention_decode_reference

    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(num_seqs, blocks_per_seq)
    context_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(num_seqs, heads, dim, dtype=torch.bfloat16, device="cuda")
    arguments = (query, k_cache, v_cache, block_tables, context_lens, dim ** -0.5)
    seconds = graph_time(lambda: paged_attention_decode(*arguments, **launch))
    if not reference:
        kv_bytes = 2 * num_seqs * context * kv_heads * dim * 2
        return dict(kernel="paged_attention_decode", tier=tier, shape=f"{num_seqs}x{context} tokens",
                    microseconds=seconds * 1e6, fraction_of_bandwidth=kv_bytes / seconds / bandwidth)
    launched_seconds = cuda_time(lambda: paged_attention_decode(*arguments))
    reference_seconds = cuda_time(lambda: paged_attention_decode_reference(*arguments), repeats=3, warmup=1)
    error = (paged_attention_decode(*arguments).float()
             - paged_attention_decode_reference(*arguments).float()).abs().max().item()
    kv_bytes = 2 * num_seqs * context * kv_heads * dim * 2  # K and V, bfloat16, each KV head's rows once
    return dict(kernel="paged_attention_decode", tier=tier, shape=f"{num_seqs}x{context} tokens",
                microseconds=seconds * 1e6, launched_microseconds=launched_seconds * 1e6,
                reference_microseconds=reference_seconds * 1e6, floor_microseconds=kv_bytes / bandwidth * 1e6,
                fraction_of_bandwidth=kv_bytes / seconds / bandwidth, max_abs_error=error)


def attention_sweep_rows(bandwidth: float) -> list[dict[str, Any]]:
    """The decode kernel's launch parameters tried on the two largest cases, to check the launcher's defaults."""
    rows = []
    for tier, config in SHAPES.items():
        for num_seqs, context in [(32, 1024), (64, 2048)]:
            for num_stages in (3, 4, 5):
                for tile_tokens in (32, 64, 128):
                    for partition_size in (512, 1024):
                        launch = dict(num_stages=num_stages, tile_tokens=tile_tokens, partition_size=partition_size)
                        try:
                            row = decode_attention_row(tier, config, num_seqs, context, bandwidth, reference=False,
                                                       **launch)
                        except Exception as error:  # e.g. Triton's OutOfResources: too much shared memory
                            row = dict(tier=tier, shape=f"{num_seqs}x{context} tokens", microseconds=float("nan"),
                                       fraction_of_bandwidth=float("nan"), error=type(error).__name__)
                        rows.append(row | launch)
    return rows


def store_row(tier: str, config: ModelConfig, bandwidth: float, num_tokens: int = 2048) -> dict[str, Any]:
    from kernels.paged_attention import store_kvcache, store_kvcache_reference

    kv_heads, dim = config.num_key_value_heads, config.head_dim
    key = torch.randn(num_tokens, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    caches = [torch.zeros(num_tokens // BLOCK_SIZE * 2, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16,
                          device="cuda") for _ in range(4)]
    slots = torch.randperm(num_tokens * 2, device="cuda")[:num_tokens]
    seconds = graph_time(lambda: store_kvcache(key, value, caches[0], caches[1], slots))
    launched_seconds = cuda_time(lambda: store_kvcache(key, value, caches[0], caches[1], slots))
    reference_seconds = cuda_time(lambda: store_kvcache_reference(key, value, caches[2], caches[3], slots))
    error = max((caches[0] - caches[2]).abs().max().item(), (caches[1] - caches[3]).abs().max().item())
    moved = 2 * 2 * key.numel() * 2  # K and V, read and written, bfloat16
    return dict(kernel="store_kvcache", tier=tier, shape=f"{num_tokens} tokens", microseconds=seconds * 1e6,
                launched_microseconds=launched_seconds * 1e6, reference_microseconds=reference_seconds * 1e6,
                floor_microseconds=moved / bandwidth * 1e6,
                fraction_of_bandwidth=moved / seconds / bandwidth, max_abs_error=error)


def matmul_rows(bandwidth: float, quick: bool) -> list[dict[str, Any]]:
    from engines.quantization import FP8_MIN_CAPABILITY, Fp8Linear, TritonInt8Linear

    fp8 = torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY
    rows = []
    for tier, config in SHAPES.items():
        projections = {"gate_up_proj": (2 * config.intermediate_size, config.hidden_size),
                       "down_proj": (config.hidden_size, config.intermediate_size),
                       "lm_head": (config.vocab_size, config.hidden_size)}
        if quick:
            projections = {"down_proj": projections["down_proj"]}
        for name, (out_features, in_features) in projections.items():
            linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16, device="cuda")
            torch.nn.init.normal_(linear.weight, std=0.02)
            layers: dict[str, torch.nn.Module] = {
                "bfloat16": linear,
                "int8": TritonInt8Linear.from_linear(linear, torch.bfloat16).cuda(),
            }
            if fp8:
                layers["fp8"] = Fp8Linear.from_linear(linear, torch.bfloat16).cuda()
            for num_rows in (1, 16):
                x = torch.randn(num_rows, in_features, dtype=torch.bfloat16, device="cuda")
                exact = x.float() @ linear.weight.float().t()
                with torch.inference_mode():
                    for format_name, layer in layers.items():
                        seconds = graph_time(lambda layer=layer, x=x: layer(x))
                        launched_seconds = cuda_time(lambda layer=layer, x=x: layer(x))
                        weight_bytes = out_features * in_features * (2 if format_name == "bfloat16" else 1)
                        relative = ((layer(x).float() - exact).norm() / exact.norm()).item()
                        rows.append(dict(kernel=f"linear {format_name}", tier=tier,
                                         shape=f"{name} {out_features}x{in_features}, {num_rows} rows",
                                         microseconds=seconds * 1e6, launched_microseconds=launched_seconds * 1e6,
                                         floor_microseconds=weight_bytes / bandwidth * 1e6,
                                         fraction_of_bandwidth=weight_bytes / seconds / bandwidth,
                                         relative_error_vs_float32=relative))
    return rows


# -- engine --------------------------------------------------------------------------------------------


def random_checkpoint(config: ModelConfig, seed: int = 0) -> Checkpoint:
    """HF-named random weights of `config` (bfloat16 on the host) and a word-level tokenizer of its vocabulary."""
    import tokenizers

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()

    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * dim, config.num_key_value_heads * dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(config.vocab_size, hidden),
                                        "lm_head.weight": normal(config.vocab_size, hidden),
                                        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes = {"self_attn.q_proj.weight": (q_size, hidden), "self_attn.k_proj.weight": (kv_size, hidden),
                  "self_attn.v_proj.weight": (kv_size, hidden), "self_attn.o_proj.weight": (hidden, q_size),
                  "self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,),
                  "self_attn.v_proj.bias": (kv_size,), "mlp.gate_proj.weight": (inter, hidden),
                  "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
        tensors.update({prefix + name: normal(*shape) for name, shape in shapes.items()})
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    vocabulary = {f"<{i}>": i for i in range(config.vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<0>"))
    return Checkpoint(config=config, tensors=tensors, tokenizer=Tokenizer(backend, None, None, None))


def engine_config(tier: str, weight_format: str, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(model=f"random-{tier}", dtype="bfloat16", device="cuda",
                                    quantization=None if weight_format == "bfloat16" else weight_format,
                                    kv_cache_bytes=8 << 30, max_num_seqs=64, max_num_batched_tokens=4096,
                                    max_model_len=4096, block_size=BLOCK_SIZE, cuda_graph_max_batch=64,
                                    enable_prefix_caching=False)
    settings.update(overrides)
    return EngineConfig(**settings)


def prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (count, PROMPT_TOKENS), generator=generator).tolist()


def batch1_tokens_per_s(engine: Any, prompt: list[int]) -> float:
    """Decode tokens/s of one greedy request alone (`LLMEngine.step`: scheduling, sampling, detokenising)."""
    engine.add_request("batch1", prompt, SamplingParams(temperature=0, max_tokens=BATCH1_TOKENS, ignore_eos=True))
    for _ in range(4):  # the prefill and a few decode steps
        engine.step()
    torch.cuda.synchronize()
    started, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(output.new_token_ids) for output in engine.step())
    return generated / (time.perf_counter() - started)


def throughput_tokens_per_s(engine: Any, batch: list[list[int]], max_tokens: int = THROUGHPUT_TOKENS) -> float:
    """Output tokens/s of `batch`'s greedy requests added at once, prefill included."""
    for i, prompt in enumerate(batch):
        engine.add_request(f"batch-{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                ignore_eos=True))
    torch.cuda.synchronize()
    started, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(output.new_token_ids) for output in engine.step())
    return generated / (time.perf_counter() - started)


def print_step_profile(engine: Any, prompt: list[int], steps: int = 64) -> None:
    """Where a batch-1 decode step's host time goes: cProfile over `steps` steps, the top functions by own time."""
    import cProfile
    import pstats

    engine.add_request("profiled", prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # the prefill
    profiler = cProfile.Profile()
    profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
    profiler.disable()
    print(f"batch-1 decode, {steps} steps, functions by own time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def engine_rows(bandwidth: float, quick: bool) -> list[dict[str, Any]]:
    from engines.llm_engine import LLMEngine
    from engines.quantization import FP8_MIN_CAPABILITY

    formats = [f for f in FORMATS if f != "fp8" or torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY]
    checkpoints = {tier: random_checkpoint(config, seed) for seed, (tier, config) in enumerate(SHAPES.items())}
    rows = []

    def measure(label: str, tier: str, config: EngineConfig, drafter: Checkpoint | None = None,
                profile: bool = False) -> None:
        started = time.perf_counter()
        engine = LLMEngine.from_checkpoint(checkpoints[tier], config, drafter=drafter)
        load_seconds = time.perf_counter() - started
        vocab = engine.model_config.vocab_size
        weight_bytes = decode_weight_bytes(engine.model)
        row: dict[str, Any] = dict(tier=tier, configuration=label, load_seconds=load_seconds,
                                   weight_bytes_per_step=weight_bytes)
        batches = THROUGHPUT_BATCHES if not quick else THROUGHPUT_BATCHES[:1]
        batches = batches if drafter is None else (4,)
        for size in (1, *batches):  # compiles each kernel variant the timed runs meet (Triton specialises on M)
            throughput_tokens_per_s(engine, prompts(size, vocab, size), max_tokens=4)
        row["batch1_tokens_per_s"] = batch1_tokens_per_s(engine, prompts(1, vocab, 1)[0])
        graphs = engine.runner.graphs
        if graphs is not None:  # the GPU's share of a batch-1 step: one replay of the one-row graph
            row["batch1_graph_replay_ms"] = cuda_time(graphs.graphs[1].replay, repeats=20) * 1e3
            row["batch1_step_ms"] = 1e3 / row["batch1_tokens_per_s"]
        if profile:
            print_step_profile(engine, prompts(1, vocab, 2)[0])
        row["batch1_fraction_of_bandwidth"] = row["batch1_tokens_per_s"] * weight_bytes / bandwidth
        for size in batches:
            row[f"batch{size}_tokens_per_s"] = throughput_tokens_per_s(engine, prompts(size, vocab, size))
        if engine.speculator is not None:
            row["speculative_acceptance_rate"] = engine.speculator.stats.acceptance_rate
            row["speculative_rounds"] = engine.speculator.stats.num_rounds
        rows.append(row)
        print(row, flush=True)
        del engine
        gc.collect()  # CUDA graphs and the KV cache go with the engine
        torch.cuda.empty_cache()

    for tier in SHAPES:
        for weight_format in formats:
            measure(f"{weight_format}, CUDA graphs", tier, engine_config(tier, weight_format),
                    profile=weight_format == "bfloat16")
        measure("bfloat16, eager (no CUDA graphs)", tier, engine_config(tier, "bfloat16", cuda_graph_max_batch=0))
    measure("bfloat16, speculative (small drafter, k <= 4)", "large",
            engine_config("large", "bfloat16", speculative_model="random-small", max_num_seqs=16),
            drafter=checkpoints["small"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small case of each kernel, fewer engine batches")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the figures here (bench/results/gpu.json always)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA GPU; none is visible")
    import triton

    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
    kernels = attention_rows(bandwidth, args.quick) + matmul_rows(bandwidth, args.quick)
    print_table("kernels (bfloat16; GPU µs: in a CUDA graph; floor = bytes / copy bandwidth)",
                ["kernel", "tier", "shape", "GPU µs", "launched µs", "reference µs", "floor µs", "of bandwidth",
                 "error"],
                [[r["kernel"], r["tier"], r["shape"], f"{r['microseconds']:.1f}", f"{r['launched_microseconds']:.1f}",
                  f"{r['reference_microseconds']:.1f}" if "reference_microseconds" in r else "-",
                  f"{r['floor_microseconds']:.1f}", f"{r['fraction_of_bandwidth']:.0%}",
                  f"{r.get('max_abs_error', r.get('relative_error_vs_float32', 0)):.2g}"] for r in kernels])
    sweep = [] if args.quick else attention_sweep_rows(bandwidth)
    if sweep:
        print_table("paged_attention_decode launch parameters (GPU µs in a CUDA graph)",
                    ["tier", "shape", "stages", "tile", "partition", "GPU µs", "of bandwidth"],
                    [[r["tier"], r["shape"], r["num_stages"], r["tile_tokens"], r["partition_size"],
                      f"{r['microseconds']:.1f}", f"{r['fraction_of_bandwidth']:.0%}"] for r in sweep])
    engines = [] if args.skip_engine else engine_rows(bandwidth, args.quick)
    if engines:
        print_table("engine decode (random weights of the demo shapes; bfloat16 activations and KV cache)",
                    ["tier", "configuration", "batch-1 tok/s", "of bandwidth", "step ms", "graph replay ms",
                     "16 req tok/s", "64 req tok/s"],
                    [[r["tier"], r["configuration"], f"{r['batch1_tokens_per_s']:.0f}",
                      f"{r['batch1_fraction_of_bandwidth']:.0%}", f"{1e3 / r['batch1_tokens_per_s']:.2f}",
                      f"{r['batch1_graph_replay_ms']:.2f}" if "batch1_graph_replay_ms" in r else "-",
                      f"{r.get('batch16_tokens_per_s', 0):.0f}",
                      f"{r.get('batch64_tokens_per_s', r.get('batch4_tokens_per_s', 0)):.0f}"] for r in engines])
    figures = {"gpu": device, "host_cpu": cpu_model(), "torch": torch.__version__, "triton": triton.__version__,
               "copy_bandwidth_bytes_per_s": bandwidth, "kernels": kernels, "attention_launch_sweep": sweep,
               "engine": engines}
    path = write_results("gpu", figures)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(path.read_text())


if __name__ == "__main__":
    main()
