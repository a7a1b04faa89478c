"""The linear-layer kernels behind `quantization = "auto"`, timed on this CPU.

For the shapes of the small demo model (Qwen2.5-0.5B: gate/up 896→9728, down 4864→896, the LM head
896→151936) at decode-sized and prefill-sized row counts: float32 `nn.Linear` (the baseline), w8a8
(`W8A8Linear`: int8 weights and per-row int8 activations, `torch._int_mm`) and int8 weight-only
(`Int8Linear`: `_weight_int8pack_mm`, bfloat16 activations), plus whether the CPU has the
instructions `auto` looks for; on CPUs with AMX, w8a8 on AMX tiles too (`TiledW8A8Linear`, what `auto`
runs there; its own streamed table at 1 to 32 rows against `w8a8_gemv` and `torch._int_mm`). Both layers
run decode-sized inputs (up to 8 rows for w8a8, 48 for int8) through their CPU kernel (`w8a8_gemv`,
`int8_gemv`) where this CPU has it, so their 1- and 8-row figures (and int8's 32-row one) are the kernels'.

Decode GEMVs (second table): the kernel of the mode `auto` picks here (w8a8 with AVX-512 VNNI, else int8
weight-only) against its PyTorch op (`torch._int_mm`, `_weight_int8pack_mm`: the same layer with
`gemv = None`) at 1 to 8 rows, with the weights streamed from memory as in a decode step (enough copies
of each layer, cycled, to exceed the last-level cache), in GB/s of weights read beside the memory
bandwidth a large tensor read reaches in the same run.

Decode attention (third table): `paged_attention` over a paged cache (bfloat16 where the CPU has native
bf16, else float32: what `kv_cache_dtype = "auto"` picks) with the `paged_decode_attention` kernel against
the PyTorch path it replaces (blocks gathered, masked, SDPA), for both demo models' head layouts, from
one row of 300 tokens to 64 rows of 900; best of `--repeat`.

    python -m bench.kernels [--threads N] [--repeat 10]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from bench.common import print_table, write_results
from bench.engine import memory_bandwidth
from engines.attention import AttentionMetadata, paged_attention
from engines.cpu import has_int8_dot_product, has_native_bf16
from engines.cpu_kernels import int8_gemv, paged_decode_attention, w8a8_amx, w8a8_gemv
from engines.quantization import Int8Linear, TiledW8A8Linear, W8A8Linear, resolve_quantization

SHAPES = {"gate_up 896→9728": (896, 9728), "down 4864→896": (4864, 896), "lm_head 896→151936": (896, 151936)}
ROWS = (1, 8, 32, 128, 512)
GEMV_ROWS = (1, 2, 4, 8)
AMX_ROWS = (1, 2, 4, 8, 16, 32)  # a speculative verification is k + 1 rows a sequence; batched decode, one each
STREAMED_BYTES = 256 << 20  # weights cycled per timing: well past any last-level cache here
HEAD_LAYOUTS = {"small 14/2 heads × 64": (14, 2, 64), "large 12/2 heads × 128": (12, 2, 128)}
ATTENTION_BATCHES = ((1, 300), (4, 500), (16, 900), (64, 900))  # (decode rows, context tokens each)
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
        amx = w8a8_amx()
        tiled = None if amx is None else TiledW8A8Linear.from_linear(dense, torch.float32, amx)
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            float32_ms = milliseconds(dense, x, repeat)
            w8a8_ms = milliseconds(w8a8, x, repeat)
            int8_ms = milliseconds(int8, x, repeat)
            amx_ms = None if tiled is None else milliseconds(tiled, x, repeat)
            results.append(
                {
                    "layer": name,
                    "rows": rows,
                    "float32_ms": float32_ms,
                    "w8a8_ms": w8a8_ms,
                    "int8_weight_only_ms": int8_ms,
                    "w8a8_amx_ms": amx_ms,
                    "float32_over_w8a8_x": float32_ms / w8a8_ms,
                    "float32_over_int8_weight_only_x": float32_ms / int8_ms,
                    "float32_over_w8a8_amx_x": None if amx_ms is None else float32_ms / amx_ms,
                }
            )
    return results


def run_all(layers: list[Int8Linear], x: torch.Tensor) -> None:
    for layer in layers:
        layer(x)


# Per mode `quantization = "auto"` can pick: its layer, that layer's decode kernel, and the PyTorch op its
# `gemv = None` runs instead.
GEMV_KERNELS = {
    "w8a8": (W8A8Linear, "w8a8_gemv", "torch._int_mm"),
    "int8": (Int8Linear, "int8_gemv", "aten._weight_int8pack_mm (bfloat16)"),
}


@torch.inference_mode()
def measure_gemv(layer_type: type[Int8Linear], repeat: int) -> list[dict[str, Any]]:
    """`layer_type`'s decode kernel against its PyTorch op at decode row counts, weights streamed from memory."""
    torch.manual_seed(0)
    results = []
    for name, (in_features, out_features) in SHAPES.items():
        dense = nn.Linear(in_features, out_features, bias=False)
        copies = [
            layer_type.from_linear(dense, torch.float32)
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
def measure_amx(repeat: int) -> list[dict[str, Any]]:
    """w8a8 on AMX tiles (`TiledW8A8Linear`, what `auto` runs on AMX CPUs) against `w8a8_gemv` (up to its row
    limit) and `torch._int_mm` on the same quantised weights, streamed from memory."""
    kernel = w8a8_amx()
    assert kernel is not None
    torch.manual_seed(0)
    results = []
    for name, (in_features, out_features) in SHAPES.items():
        dense = nn.Linear(in_features, out_features, bias=False)
        count = max(1, STREAMED_BYTES // (in_features * out_features))
        rows_major = [W8A8Linear.from_linear(dense, torch.float32) for _ in range(count)]
        tiled = [TiledW8A8Linear.from_linear(dense, torch.float32, kernel) for _ in range(count)]
        gemv = rows_major[0].gemv
        for rows in AMX_ROWS:
            x = torch.randn(rows, in_features)
            timed: dict[str, float | None] = {}
            for path, layers in (("amx", tiled), ("w8a8_gemv", rows_major), ("int_mm", rows_major)):
                if path == "w8a8_gemv" and (gemv is None or rows > gemv.max_rows):
                    timed[path] = None
                    continue
                for layer in rows_major:
                    layer.gemv = gemv if path == "w8a8_gemv" else None
                timed[path] = min(milliseconds(partial(run_all, layers), x, 1) for _ in range(repeat)) / count
            weight_gb = in_features * out_features / 1e9
            gemv_ms = timed["w8a8_gemv"]
            results.append({
                "layer": name, "rows": rows, "amx_ms": timed["amx"], "w8a8_gemv_ms": gemv_ms,
                "int_mm_ms": timed["int_mm"], "amx_weight_gb_s": weight_gb / timed["amx"] * 1000,
                "w8a8_gemv_over_amx_x": None if gemv_ms is None else gemv_ms / timed["amx"],
                "int_mm_over_amx_x": timed["int_mm"] / timed["amx"],
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


@torch.inference_mode()
def measure_decode_attention(repeat: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results = []
    for name, heads in HEAD_LAYOUTS.items():
        for rows, context in ATTENTION_BATCHES:
            timed = {}
            for path in ("kernel", "pytorch"):
                attend, query = decode_step(rows, context, heads, kernel=path == "kernel")
                timed[path] = min(milliseconds(attend, query, 1) for _ in range(repeat))
            results.append({
                "heads": name, "rows": rows, "context_tokens": context, "pytorch_ms": timed["pytorch"],
                "kernel_ms": timed["kernel"], "pytorch_over_kernel_x": timed["pytorch"] / timed["kernel"],
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
        ["layer", "rows", "float32", "w8a8", "int8 weight-only", "w8a8 AMX", "float32/w8a8 x", "float32/int8 x",
         "float32/w8a8 AMX x"],
        [
            [r["layer"], r["rows"], r["float32_ms"], r["w8a8_ms"], r["int8_weight_only_ms"], r["w8a8_amx_ms"],
             r["float32_over_w8a8_x"], r["float32_over_int8_weight_only_x"], r["float32_over_w8a8_amx_x"]]
            for r in results
        ],
    )  # fmt: skip
    figures: dict[str, Any] = {"cpu": cpu, "baseline": "float32 nn.Linear", "results": results}
    mode = resolve_quantization("auto") or "int8"
    layer_type, kernel_name, baseline = GEMV_KERNELS[mode]
    if (w8a8_gemv() if mode == "w8a8" else int8_gemv()) is not None:
        bandwidth = memory_bandwidth()
        gemv = measure_gemv(layer_type, max(3, args.repeat // 2))
        print_table(
            f"{mode} decode GEMVs, weights streamed from memory: {kernel_name} against {baseline} "
            f"(memory read {bandwidth['read_gb_s']:.1f} GB/s, copy {bandwidth['copy_gb_s']:.1f} GB/s)",
            ["layer", "rows", "PyTorch ms", "kernel ms", "PyTorch GB/s", "kernel GB/s", "PyTorch/kernel x"],
            [[r["layer"], r["rows"], r["pytorch_ms"], r["kernel_ms"], r["pytorch_weight_gb_s"],
              r["kernel_weight_gb_s"], r["pytorch_over_kernel_x"]] for r in gemv],
        )  # fmt: skip
        figures |= {"decode_gemv_kernel": kernel_name,
                    "decode_gemv_baseline": f"{baseline} ({layer_type.__name__} with gemv=None)", "decode_gemv": gemv,
                    "memory_bandwidth": bandwidth}  # fmt: skip
    else:
        print(f"{kernel_name} unavailable on this machine (its instructions or a C compiler missing): not timed")
    if mode == "w8a8" and w8a8_amx() is not None:
        amx = measure_amx(max(3, args.repeat // 2))
        print_table(
            "w8a8 on AMX tiles (what auto runs here), weights streamed from memory, ms per call",
            ["layer", "rows", "AMX ms", "w8a8_gemv ms", "torch._int_mm ms", "AMX GB/s", "gemv/AMX x", "_int_mm/AMX x"],
            [[r["layer"], r["rows"], r["amx_ms"], r["w8a8_gemv_ms"], r["int_mm_ms"], r["amx_weight_gb_s"],
              r["w8a8_gemv_over_amx_x"], r["int_mm_over_amx_x"]] for r in amx],
        )  # fmt: skip
        figures |= {"w8a8_amx": amx}
    else:
        print("w8a8_amx unavailable on this machine (needs AMX-INT8 and a compiler with AMX intrinsics): not timed")
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
    else:
        print("decode attention kernel unavailable on this machine (needs AVX2, FMA and a C compiler): not timed")
    write_results("kernels", figures)


if __name__ == "__main__":
    main()
