"""The linear-layer kernels behind `quantization = "auto"`, timed on this CPU.

For the shapes of the small demo model (Qwen2.5-0.5B: gate/up 896→9728, down 4864→896, the LM head
896→151936) at decode-sized and prefill-sized row counts: float32 `nn.Linear` (the baseline), w8a8
(`W8A8Linear`: int8 weights and per-row int8 activations, `torch._int_mm`) and int8 weight-only
(`Int8Linear`: `_weight_int8pack_mm`, bfloat16 activations), plus whether the CPU has the
instructions `auto` looks for; on CPUs with AMX or AVX-512 VNNI, w8a8 over the weight in tile order too
(`TiledW8A8Linear` on `w8a8_amx` or `w8a8_vnni`: what `auto` runs there). int8 weight-only runs
decode-sized inputs (up to 48 rows) through `int8_gemv` where this CPU has it, so its 1-, 8- and 32-row
figures are that kernel's.

Decode products (second table), with the weights streamed from memory as in a decode step (enough copies
of each layer, cycled, to exceed the last-level cache), in GB/s of weights read beside the memory
bandwidth a large tensor read reaches in the same run: where `auto` picks w8a8, the tiled kernel against
`torch._int_mm` on the same quantised weights at 1 to 32 rows, and each row count's time over one row's
(what a speculative verification or a batched decode step pays per extra row); where it picks int8,
`int8_gemv` against `_weight_int8pack_mm` (the same layer with `gemv = None`) at 1 to 8 rows.

Decode attention (third table): `paged_attention` over a paged cache (bfloat16 where the CPU has native
bf16, else float32: what `kv_cache_dtype = "auto"` picks) with the `paged_decode_attention` kernel against
the PyTorch path it replaces (blocks gathered, masked, SDPA), for both demo models' head layouts, from
one row of 300 tokens to 64 rows of 900; best of `--repeat`.

Decode attention by block order (fifth table): one 32-sequence decode step of the small model's 24 layers,
each sequence 430 tokens, through the kernel over caches of the small tier's size (`kv_cache_mb`: far past
any last-level cache), with each sequence's blocks adjacent and ascending (what the block manager hands out),
in runs that go backwards (what it handed a sequence reusing freed blocks before 2026-12-06: blocks are freed
tail first) and scattered (blocks taken one at a time as sequences grow); the orders alternate within each
repetition, median of `--repeat`.

Prefill attention (fourth table, wherever the kernel reads bfloat16 with bfloat16 dot products or AMX tiles):
one layer's attention of a chunk of a prompt, fresh or over a cached prefix, as the model runner builds it —
through the kernel (`engines.cpu_kernels.prefill_attention`: on AMX tiles 16 query rows of a head a tile, else
each query token a decode row over its causal context, timed whether or not the model runner gives it prefill
chunks on this CPU, which the table's title says), against SDPA (causal, or masked over the gathered prefix),
what it replaces; best of `--repeat`.

    python -m bench.kernels [--threads N] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from bench.common import print_table, write_results
from bench.engine import memory_bandwidth
from engines.attention import AttentionMetadata, ChunkAttention, paged_attention
from engines.config import ModelConfig
from engines.cpu import has_int8_dot_product, has_native_bf16
from engines.cpu_kernels import TiledW8A8Kernel, int8_gemv, paged_decode_attention, prefill_attention, w8a8_tiled
from engines.model_runner import ModelRunner, TokenSpan
from engines.quantization import Int8Linear, TiledW8A8Linear, W8A8Linear, resolve_quantization

SHAPES = {"gate_up 896→9728": (896, 9728), "down 4864→896": (4864, 896), "lm_head 896→151936": (896, 151936)}
ROWS = (1, 8, 32, 128, 512)
GEMV_ROWS = (1, 2, 4, 8)
TILED_ROWS = (1, 2, 3, 4, 5, 8, 16, 32)  # a speculative verification is k + 1 rows a sequence; batched decode, one each
STREAMED_BYTES = 256 << 20  # weights cycled per timing: well past any last-level cache here
HEAD_LAYOUTS = {"small 14/2 heads × 64": (14, 2, 64), "large 12/2 heads × 128": (12, 2, 128)}
ATTENTION_BATCHES = ((1, 300), (4, 500), (16, 900), (64, 900))  # (decode rows, context tokens each)
PREFILL_CHUNKS = ((480, 0), (480, 480), (160, 640))  # (chunk tokens, cached tokens before it)
BLOCK_ORDER_STEP = (32, 430, 24)  # (decode rows, context tokens each, layers): a loaded step of the small model
BLOCK_ORDERS = ("adjacent", "backward runs", "scattered")
BLOCK_SIZE = 16


def milliseconds(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeat: int) -> float:
    """Mean time of `layer(x)` after two warm-up calls."""
    layer(x)
    layer(x)
    started = time.perf_counter()
    for _ in range(repeat):
        layer(x)
    return (time.perf_counter() - started) / repeat * 1000


@torch.inference_mode()
def measure(repeat: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results = []
    for name, (in_features, out_features) in SHAPES.items():
        dense = nn.Linear(in_features, out_features, bias=False)
        w8a8 = W8A8Linear.from_linear(dense, torch.float32)
        int8 = Int8Linear.from_linear(dense, torch.float32)
        kernel = w8a8_tiled()
        tiled = None if kernel is None else TiledW8A8Linear.from_linear(dense, torch.float32, kernel)
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            float32_ms = milliseconds(dense, x, repeat)
            w8a8_ms = milliseconds(w8a8, x, repeat)
            int8_ms = milliseconds(int8, x, repeat)
            tiled_ms = None if tiled is None else milliseconds(tiled, x, repeat)
            results.append(
                {
                    "layer": name,
                    "rows": rows,
                    "float32_ms": float32_ms,
                    "w8a8_ms": w8a8_ms,
                    "int8_weight_only_ms": int8_ms,
                    "w8a8_tiled_ms": tiled_ms,
                    "float32_over_w8a8_x": float32_ms / w8a8_ms,
                    "float32_over_int8_weight_only_x": float32_ms / int8_ms,
                    "float32_over_w8a8_tiled_x": None if tiled_ms is None else float32_ms / tiled_ms,
                }
            )
    return results


def run_all(layers: list[Int8Linear], x: torch.Tensor) -> None:
    for layer in layers:
        layer(x)


@torch.inference_mode()
def measure_gemv(repeat: int) -> list[dict[str, Any]]:
    """`int8_gemv` against `_weight_int8pack_mm` at decode row counts, weights streamed from memory."""
    torch.manual_seed(0)
    results = []
    for name, (in_features, out_features) in SHAPES.items():
        dense = nn.Linear(in_features, out_features, bias=False)
        copies = [
            Int8Linear.from_linear(dense, torch.float32)
            for _ in range(max(1, STREAMED_BYTES // (in_features * out_features)))
        ]
        kernel = copies[0].gemv
        for rows in GEMV_ROWS:
            x = torch.randn(rows, in_features)
            streamed = {}
            for path in ("kernel", "pytorch"):
                for layer in copies:
                    layer.gemv = kernel if path == "kernel" else None
                streamed[path] = min(milliseconds(partial(run_all, copies), x, 1) for _ in range(repeat)) / len(copies)
            weight_gb = in_features * out_features / 1e9
            results.append({
                "layer": name, "rows": rows, "pytorch_ms": streamed["pytorch"], "kernel_ms": streamed["kernel"],
                "pytorch_weight_gb_s": weight_gb / streamed["pytorch"] * 1000,
                "kernel_weight_gb_s": weight_gb / streamed["kernel"] * 1000,
                "pytorch_over_kernel_x": streamed["pytorch"] / streamed["kernel"],
            })  # fmt: skip
    return results


@torch.inference_mode()
def measure_tiled(kernel: TiledW8A8Kernel, repeat: int) -> list[dict[str, Any]]:
    """w8a8 in tile order (`TiledW8A8Linear` on `kernel`, what `auto` runs here) against `torch._int_mm` on the
    same quantised weights, streamed from memory."""
    torch.manual_seed(0)
    results = []
    for name, (in_features, out_features) in SHAPES.items():
        dense = nn.Linear(in_features, out_features, bias=False)
        count = max(1, STREAMED_BYTES // (in_features * out_features))
        rows_major = [W8A8Linear.from_linear(dense, torch.float32) for _ in range(count)]
        tiled = [TiledW8A8Linear.from_linear(dense, torch.float32, kernel) for _ in range(count)]
        one_row_ms = None
        for rows in TILED_ROWS:
            x = torch.randn(rows, in_features)
            timed = {path: min(milliseconds(partial(run_all, layers), x, 1) for _ in range(repeat)) / count
                     for path, layers in (("tiled", tiled), ("int_mm", rows_major))}  # fmt: skip
            one_row_ms = one_row_ms or timed["tiled"]
            weight_gb = in_features * out_features / 1e9
            results.append({
                "layer": name, "rows": rows, "tiled_ms": timed["tiled"], "int_mm_ms": timed["int_mm"],
                "tiled_weight_gb_s": weight_gb / timed["tiled"] * 1000,
                "tiled_over_one_row_x": timed["tiled"] / one_row_ms,
                "int_mm_over_tiled_x": timed["int_mm"] / timed["tiled"],
            })  # fmt: skip
    return results


def decode_step(
    rows: int, context: int, heads: tuple[int, int, int], kernel: bool
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """One layer's decode attention (a function of the queries, and queries) for `rows` sequences of
    `context` tokens in a shuffled paged cache of `auto`'s KV dtype, with the kernel or through the PyTorch
    ops."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_each = -(-context // BLOCK_SIZE)
    kv_dtype = torch.bfloat16 if has_native_bf16() else torch.float32
    caches = [torch.randn(rows * blocks_each * BLOCK_SIZE, num_kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    tables = torch.randperm(rows * blocks_each).view(rows, blocks_each)
    lens = torch.full((rows,), context)
    slots = tables[:, -1] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    mask = (torch.arange(blocks_each * BLOCK_SIZE).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
    metadata = AttentionMetadata(
        block_size=BLOCK_SIZE, slot_mapping=slots, num_decode_tokens=rows, decode_block_tables=tables,
        decode_mask=None if kernel else mask, prefills=[], decode_context_lens=lens if kernel else None,
        decode_kernel=paged_decode_attention() if kernel else None,
    )  # fmt: skip
    key, value = torch.randn(2, rows, num_kv_heads, head_dim)

    def attend(query: torch.Tensor) -> torch.Tensor:
        return paged_attention(query, key, value, *caches, metadata, head_dim**-0.5)

    return attend, torch.randn(rows, num_heads, head_dim)


AttentionStep = Callable[..., tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]


def kernel_and_baseline_ms(step: AttentionStep, repeat: int, *args: Any) -> tuple[float, float]:
    """Best of `repeat` timings of one layer's attention built by `step(*args, kernel=...)`: through the kernel,
    then through the path it replaces."""
    best = []
    for kernel in (True, False):
        attend, query = step(*args, kernel=kernel)
        best.append(min(milliseconds(attend, query, 1) for _ in range(repeat)))
    return best[0], best[1]


@torch.inference_mode()
def measure_decode_attention(repeat: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results = []
    for name, heads in HEAD_LAYOUTS.items():
        for rows, context in ATTENTION_BATCHES:
            kernel_ms, pytorch_ms = kernel_and_baseline_ms(decode_step, repeat, rows, context, heads)
            results.append({
                "heads": name, "rows": rows, "context_tokens": context, "pytorch_ms": pytorch_ms,
                "kernel_ms": kernel_ms, "pytorch_over_kernel_x": pytorch_ms / kernel_ms,
            })  # fmt: skip
    return results


def block_tables(order: str, rows: int, blocks_each: int, num_blocks: int) -> torch.Tensor:
    """`rows` block tables of `blocks_each` blocks out of `num_blocks`, in `order` (`BLOCK_ORDERS`)."""
    ascending = torch.arange(rows * blocks_each).view(rows, blocks_each)
    if order == "adjacent":
        return ascending
    if order == "backward runs":
        return ascending.flip(1).contiguous()
    return torch.randperm(num_blocks)[: rows * blocks_each].view(rows, blocks_each)


@torch.inference_mode()
def measure_block_order(repeat: int) -> list[dict[str, Any]]:
    from engines.small.spec import SPEC

    torch.manual_seed(0)
    kernel = paged_decode_attention()
    assert kernel is not None
    rows, context, layers = BLOCK_ORDER_STEP
    num_heads, num_kv_heads, head_dim = HEAD_LAYOUTS["small 14/2 heads × 64"]
    kv_dtype = torch.bfloat16 if has_native_bf16() else torch.float32
    slot_bytes = 2 * layers * num_kv_heads * head_dim * kv_dtype.itemsize  # K and V of one token, every layer
    num_blocks = (SPEC.kv_cache_mb << 20) // (slot_bytes * BLOCK_SIZE)
    caches = [tuple(torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim).to(kv_dtype) for _ in range(2))
              for _ in range(layers)]  # fmt: skip
    tables = {order: block_tables(order, rows, -(-context // BLOCK_SIZE), num_blocks) for order in BLOCK_ORDERS}
    lens, query = torch.full((rows,), context), torch.randn(rows, num_heads, head_dim)
    timings: dict[str, list[float]] = {order: [] for order in BLOCK_ORDERS}
    for _ in range(repeat):
        for order, table in tables.items():
            start = time.perf_counter()
            for k_cache, v_cache in caches:
                kernel(query, k_cache, v_cache, table, lens, BLOCK_SIZE, head_dim**-0.5)
            timings[order].append((time.perf_counter() - start) * 1e3)
    adjacent_ms = statistics.median(timings["adjacent"])
    return [{
        "block_order": order, "rows": rows, "context_tokens": context, "layers": layers,
        "kv_cache_mb": SPEC.kv_cache_mb, "kernel_ms_per_step": statistics.median(times),
        "over_adjacent_x": statistics.median(times) / adjacent_ms,
    } for order, times in timings.items()]  # fmt: skip


def prefill_step(chunk: int, cached: int, heads: tuple[int, int, int], kernel: bool
                 ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:  # fmt: skip
    """One layer's attention (a function of the queries, and queries) for a chunk of `chunk` tokens after `cached`
    cached ones, in a shuffled bfloat16 paged cache, as a model runner builds it with the kernel or SDPA."""
    num_heads, num_kv_heads, head_dim = heads
    config = ModelConfig(architecture="llama", vocab_size=1, hidden_size=num_heads * head_dim, intermediate_size=1,
                         num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim)  # fmt: skip
    blocks = -(-(chunk + cached) // BLOCK_SIZE)
    runner = ModelRunner(nn.Module(), config, BLOCK_SIZE, blocks, torch.bfloat16)
    runner.prefill_attention = prefill_kernel(heads) if kernel else None
    table = torch.randperm(blocks).tolist()
    span = TokenSpan([0] * chunk, cached, table)
    for cache in runner.kv_caches[0]:
        cache.copy_(torch.randn(cache.shape))
    positions = torch.arange(cached, cached + chunk)
    slots = torch.tensor(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    metadata = AttentionMetadata(block_size=BLOCK_SIZE, slot_mapping=slots, num_decode_tokens=0,
                                 decode_block_tables=None, decode_mask=None, prefills=[runner.prefill_chunk(span, 0)],
                                 prefill_kernel=runner.prefill_attention)  # fmt: skip
    key, value = torch.randn(2, chunk, num_kv_heads, head_dim)

    def attend(query: torch.Tensor) -> torch.Tensor:
        return paged_attention(query, key, value, *runner.kv_caches[0], metadata, head_dim**-0.5)

    return attend, torch.randn(chunk, num_heads, head_dim)


def prefill_kernel(heads: tuple[int, int, int]) -> ChunkAttention | None:
    """The kernel the model runner gives prefill chunks on this CPU, else the decode kernel row by row (timed where
    the runner would not take it)."""
    num_heads, num_kv_heads, head_dim = heads
    return prefill_attention(num_heads, num_kv_heads, head_dim, torch.bfloat16, BLOCK_SIZE) or paged_decode_attention()


@torch.inference_mode()
def measure_prefill_attention(repeat: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results = []
    for name, heads in HEAD_LAYOUTS.items():
        for chunk, cached in PREFILL_CHUNKS:
            kernel_ms, sdpa_ms = kernel_and_baseline_ms(prefill_step, repeat, chunk, cached, heads)
            results.append({
                "heads": name, "chunk_tokens": chunk, "cached_tokens": cached, "sdpa_ms": sdpa_ms,
                "kernel_ms": kernel_ms, "sdpa_over_kernel_x": sdpa_ms / kernel_ms,
            })  # fmt: skip
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "int8_dot_product": has_int8_dot_product(),
        "native_bf16": has_native_bf16(),
        "auto_quantization": resolve_quantization("auto"),
        "threads": torch.get_num_threads(),
    }
    results = measure(args.repeat)
    print_table(
        f"Linear kernels, ms per call ({cpu['capability']}, int8 dot products {cpu['int8_dot_product']}, "
        f"{cpu['threads']} threads; auto → {cpu['auto_quantization']})",
        ["layer", "rows", "float32", "w8a8", "int8 weight-only", "w8a8 tiled", "float32/w8a8 x", "float32/int8 x",
         "float32/w8a8 tiled x"],
        [
            [r["layer"], r["rows"], r["float32_ms"], r["w8a8_ms"], r["int8_weight_only_ms"], r["w8a8_tiled_ms"],
             r["float32_over_w8a8_x"], r["float32_over_int8_weight_only_x"], r["float32_over_w8a8_tiled_x"]]
            for r in results
        ],
    )  # fmt: skip
    kernel = w8a8_tiled()
    kernel_name = None if kernel is None else kernel.symbol
    figures: dict[str, Any] = {"cpu": cpu, "baseline": "float32 nn.Linear", "w8a8_tiled_kernel": kernel_name,
                               "results": results}  # fmt: skip
    bandwidth = memory_bandwidth()
    memory = f"memory read {bandwidth['read_gb_s']:.1f} GB/s, copy {bandwidth['copy_gb_s']:.1f} GB/s"
    figures["memory_bandwidth"] = bandwidth
    if kernel is not None:
        tiled = measure_tiled(kernel, max(3, args.repeat // 2))
        print_table(
            f"w8a8 decode products in tile order ({kernel_name}, what auto runs here) against torch._int_mm, weights "
            f"streamed from memory ({memory})",
            ["layer", "rows", "tiled ms", "torch._int_mm ms", "tiled GB/s", "tiled / one row x", "_int_mm/tiled x"],
            [[r["layer"], r["rows"], r["tiled_ms"], r["int_mm_ms"], r["tiled_weight_gb_s"], r["tiled_over_one_row_x"],
              r["int_mm_over_tiled_x"]] for r in tiled],
        )  # fmt: skip
        figures |= {"decode_tiled_baseline": "torch._int_mm (W8A8Linear)", "decode_tiled": tiled}
    else:
        print("w8a8 tiled kernels unavailable on this machine (need AVX-512 VNNI or AMX-INT8): not timed")
    if resolve_quantization("auto") != "w8a8" and int8_gemv() is not None:
        gemv = measure_gemv(max(3, args.repeat // 2))
        print_table(
            f"int8 decode GEMVs, weights streamed from memory: int8_gemv against aten._weight_int8pack_mm (bfloat16) "
            f"({memory})",
            ["layer", "rows", "PyTorch ms", "kernel ms", "PyTorch GB/s", "kernel GB/s", "PyTorch/kernel x"],
            [[r["layer"], r["rows"], r["pytorch_ms"], r["kernel_ms"], r["pytorch_weight_gb_s"],
              r["kernel_weight_gb_s"], r["pytorch_over_kernel_x"]] for r in gemv],
        )  # fmt: skip
        figures |= {"decode_gemv_kernel": "int8_gemv",
                    "decode_gemv_baseline": "aten._weight_int8pack_mm (bfloat16; Int8Linear with gemv=None)",
                    "decode_gemv": gemv}  # fmt: skip
    if paged_decode_attention() is not None:
        attention = measure_decode_attention(max(3, args.repeat // 2))
        kv_dtype = "bfloat16" if has_native_bf16() else "float32"
        print_table(
            f"Decode attention over a {kv_dtype} paged cache, ms per layer: the kernel against gather + mask + SDPA",
            ["heads", "rows", "context tokens", "PyTorch ms", "kernel ms", "PyTorch/kernel x"],
            [[r["heads"], r["rows"], r["context_tokens"], r["pytorch_ms"], r["kernel_ms"], r["pytorch_over_kernel_x"]]
             for r in attention],
        )  # fmt: skip
        figures |= {"decode_attention_baseline": "gather + mask + SDPA (paged_attention without the kernel)",
                    "decode_attention_kv_dtype": kv_dtype, "decode_attention": attention}  # fmt: skip
        order = measure_block_order(max(5, args.repeat))
        print_table(
            f"Decode attention by block order: a step of {order[0]['layers']} layers, {order[0]['rows']} rows of "
            f"{order[0]['context_tokens']} tokens, caches of {order[0]['kv_cache_mb']} MB, ms per step (median)",
            ["block order", "kernel ms", "over adjacent x"],
            [[r["block_order"], r["kernel_ms_per_step"], r["over_adjacent_x"]] for r in order],
        )  # fmt: skip
        figures |= {"decode_attention_block_order_baseline": "backward runs (what a sequence reusing freed blocks "
                    "held before 2026-12-06)", "decode_attention_block_order": order}  # fmt: skip
        attention_kernel = paged_decode_attention()
        if attention_kernel is not None and attention_kernel.isa in ("avx512bf16", "amx"):
            prefill = measure_prefill_attention(max(3, args.repeat // 2))
            chunk_kernel = prefill_attention(14, 2, 64, torch.bfloat16, BLOCK_SIZE)
            taken = "taken" if chunk_kernel is not None else "NOT taken"
            how = ("16 query rows of a head an AMX tile" if attention_kernel.isa == "amx"
                   else "each query token a decode row")
            print_table(
                f"Prefill attention over a bfloat16 paged cache, ms per layer: the kernel ({how}; {taken} by the model "
                "runner on this CPU) against SDPA",
                ["heads", "chunk tokens", "cached tokens", "SDPA ms", "kernel ms", "SDPA/kernel x"],
                [[r["heads"], r["chunk_tokens"], r["cached_tokens"], r["sdpa_ms"], r["kernel_ms"],
                  r["sdpa_over_kernel_x"]] for r in prefill],
            )  # fmt: skip
            figures |= {"prefill_attention_baseline": "SDPA (causal, or masked over the gathered cached prefix)",
                        "prefill_attention": prefill, "prefill_attention_kernel_taken": taken == "taken"}  # fmt: skip
        else:
            print("prefill chunks attend through SDPA on this CPU (the kernel reads bfloat16 with bfloat16 dot "
                  "products only with AVX512_BF16 or AMX): not timed")
    else:
        print("decode attention kernel unavailable on this machine (needs AVX2, FMA and a C compiler): not timed")
    write_results("kernels", figures)


if __name__ == "__main__":
    main()
