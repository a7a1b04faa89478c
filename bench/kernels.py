"""The linear-layer kernels behind `quantization = "auto"`, timed on this CPU.

For the shapes of the small demo model (Qwen2.5-0.5B: gate/up 896→9728, down 4864→896, the LM head
896→151936) at decode-sized and prefill-sized row counts: float32 `nn.Linear` (the baseline), w8a8
(`W8A8Linear`: int8 weights and per-row int8 activations, `torch._int_mm`) and int8 weight-only
(`Int8Linear`: `_weight_int8pack_mm`, bfloat16 activations), plus whether the CPU has the
instructions `auto` looks for.

    python -m bench.kernels [--threads N] [--repeat 10]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bench.common import print_table, write_results
from engines.cpu import has_int8_dot_product, has_native_bf16
from engines.quantization import Int8Linear, W8A8Linear, resolve_quantization

SHAPES = {"gate_up 896→9728": (896, 9728), "down 4864→896": (4864, 896), "lm_head 896→151936": (896, 151936)}
ROWS = (1, 8, 32, 128, 512)


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
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            float32_ms = milliseconds(dense, x, repeat)
            w8a8_ms = milliseconds(w8a8, x, repeat)
            int8_ms = milliseconds(int8, x, repeat)
            results.append(
                {
                    "layer": name,
                    "rows": rows,
                    "float32_ms": float32_ms,
                    "w8a8_ms": w8a8_ms,
                    "int8_weight_only_ms": int8_ms,
                    "float32_over_w8a8_x": float32_ms / w8a8_ms,
                    "float32_over_int8_weight_only_x": float32_ms / int8_ms,
                }
            )
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
        ["layer", "rows", "float32", "w8a8", "int8 weight-only", "float32/w8a8 x", "float32/int8 x"],
        [
            [r["layer"], r["rows"], r["float32_ms"], r["w8a8_ms"], r["int8_weight_only_ms"],
             r["float32_over_w8a8_x"], r["float32_over_int8_weight_only_x"]]
            for r in results
        ],
    )  # fmt: skip
    write_results("kernels", {"cpu": cpu, "baseline": "float32 nn.Linear", "results": results})


if __name__ == "__main__":
    main()
