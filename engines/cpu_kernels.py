"""The CPU decode kernels of `cpu_kernels.c`: compiled once per machine, loaded with ctypes.

A decode step at batch 1 multiplies one row by every weight of the model and attends over one
sequence's cache, so it should be bound by how fast the weights stream from memory. Three things kept it
far from that: oneDNN's `torch._int_mm` and the packed `_weight_int8pack_mm` (bfloat16 activations,
emulated on CPUs without native bf16) stream a one-row product's weights well below DRAM bandwidth, and
paged attention through PyTorch ops (gather the blocks, mask, SDPA) pays per-op costs far above the few
kilobytes of K/V it reads. On CPUs with int8 dot products (where `quantization = "auto"` picks w8a8), the
weight lives in tile order and every row count runs on `w8a8_amx` (AMX tiles) or `w8a8_vnni` (AVX-512 VNNI),
bit-identical to `_int_mm` (`engines.quantization.TiledW8A8Linear`); on AVX2-only CPUs (where `auto` picks
int8) `int8_gemv` (activations rounded to int16 per row, exact integer sums) replaces the second.
`paged_decode_attention` (an AVX2 and an AVX-512 build; reads the cache in place through the block tables)
replaces the third, for every decode row of every step, so a row's result never depends on the batch size.
Beside them, the ~20 small PyTorch ops of a decode layer (norms, RoPE, KV store, SiLU, residuals) cost a third
of a batch-1 step; `decode_layer_int8` runs a whole layer for a step's decode rows in one call on the AVX2
kernels' arithmetic (`engines.models.llama.NativeDecoder`, where every product is int8 weight-only on float32,
or w8a8: on AMX tiles, or through VNNI dot products). Prefill rows run through the PyTorch modules, where a
tiled gate_up product applies SiLU · up itself (`TiledW8A8Kernel.silu_mul`); on AMX their attention runs on tiles
(`PagedPrefillAttention`). A greedy step's w8a8 LM head (AMX or VNNI) gives its argmax, and that token's logprob,
without writing logits (`TiledW8A8Kernel.argmax`).
A sampled step's rows are drawn by `sample_rows` (temperature, min-p, top-k, top-p: `engines.sampler.draw_native`),
and the logprobs a request asks for come from `logprob_rows`.
`python -m bench.kernels` times the GEMVs against the PyTorch ops, `python -m bench.engine --batch1-only`
a decode step with the kernels against the PyTorch ops; BENCHMARKS.md has the figures.

One library, built for AVX2 + FMA with the AVX-512 and AMX kernels in their own target regions, needs a C compiler
(`cc`, or `$CC`). It is built on first use into `~/.cache/sluice/native/` under a name that hashes the
source and flags, so an edited kernel is rebuilt and concurrent builds cannot see each other's
half-written file. Where the compiler or a kernel's instructions are missing, its accessor returns None
and the caller keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engines.cpu import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
INCLUDES = (Path(__file__).with_name("cpu_attention.inc"),)  # what SOURCE includes: part of the build's hash
CACHE_DIR = Path("~/.cache/sluice/native")
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma"})  # the library's baseline: `int8_gemv`
AVX512_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})  # `w8a8_vnni`, `paged_decode_attention`
AMX_INT8_FLAGS = AVX512_VNNI_FLAGS | {"amx_tile", "amx_int8"}  # `w8a8_amx`
AVX512_BF16_FLAGS = AVX512_VNNI_FLAGS | {"avx512_bf16"}  # `paged_decode_attention` on a bfloat16 cache by `vdpbf16ps`
AMX_BF16_FLAGS = AVX512_BF16_FLAGS | {"amx_tile", "amx_bf16"}  # ... with q · k and Σ weight · v on AMX tiles
# -ffp-contract=off: no a * b + c fused where the source does not say so — GCC would fuse in some inlined
# copies of a kernel and not others, and a row's result would then depend on the batch it came in.
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64


class LayerProducts(enum.IntEnum):
    """How `decode_layer_int8` multiplies (`enum layer_products`): every product of a layer is one kind."""

    INT8_WEIGHT_ONLY = 0  # `int8_gemv`'s arithmetic: int16 activations, weight [N, K]
    W8A8_AMX = 1  # `w8a8_amx`'s: int8 activations, the weight in tile order
    W8A8_VNNI = 2  # `w8a8_vnni`'s: int8 activations (shifted to uint8), the weight in tile order and its row sums


class TiledW8A8Kernel:
    """`W8A8Linear`'s product, bit for bit, at any number of rows, over a weight in tile order:
    `pack(weight [N, K] int8)` → the tiled weight `[ceil(N / group), ceil(K / k_chunk), group * k_chunk]`
    int8 (zero-padded), with the weight's row sums where the product takes them; `(x [rows, K] float32, tiled, N,
    scales [N], bias [N] | None, weight_sum [N] | None)` → `[rows, N]` float32. A weight's row n is
    `rows(tiled, ids, K)`: a gather, never a second copy.
    Two products read that order: `W8A8Amx` on AMX tiles and `W8A8Vnni` through AVX-512 VNNI, which also takes
    the weight's row sums (`needs_weight_sum`). Each also gives each row's argmax of the product, and its
    log-softmax there, without writing the product (`argmax`: an LM head's greedy choice and its logprob)."""

    group = 64  # output features per block of the tiled weight (TILE_GROUP)
    k_chunk = 64  # inputs per block (TILE_K_CHUNK)
    symbol: str  # the product's C function
    products: LayerProducts  # what `decode_layer_int8` calls it
    needs_weight_sum = False
    quad_major = False  # a block's layout: [quad of 4 inputs][slice of 16 features], else [slice][quad]

    def __init__(self, library: ctypes.CDLL) -> None:
        self._pack = library.w8a8_tile_pack
        self._pack.restype = None
        self._pack.argtypes = [_POINTER, _INT64, _INT64, ctypes.c_int, _POINTER, _POINTER]
        # (x, rows, K, tiled[, weight_sum], scales, bias, out, N, xq, x_scale, threads)
        self._product = getattr(library, self.symbol)
        self._product.restype = ctypes.c_int
        self._product.argtypes = [_POINTER, _INT64, _INT64, _POINTER, *([_POINTER] if self.needs_weight_sum else []),
                                  _POINTER, _POINTER, _POINTER, _INT64, _POINTER, _POINTER, ctypes.c_int]
        # The same, then silu(gate) · up: (..., xq, x_scale, scratch, threads)
        self._silu_mul = getattr(library, f"{self.symbol}_silu_mul")
        self._silu_mul.restype = ctypes.c_int
        self._silu_mul.argtypes = [*self._product.argtypes[:-1], _POINTER, ctypes.c_int]
        # The product's arguments, `out` the [rows] int64 ids, then the [rows] float32 logprobs (or NULL)
        self._argmax = getattr(library, f"{self.symbol}_argmax")
        self._argmax.restype = ctypes.c_int
        self._argmax.argtypes = [*self._product.argtypes[:-1], _POINTER, ctypes.c_int]
        # (products, x, rows, K, tiled, weight_sum, scales, bias, out, N, xq, x_scale, residual, passes, threads)
        self._two_pass = library.w8a8_two_pass
        self._two_pass.restype = ctypes.c_int
        self._two_pass.argtypes = [ctypes.c_int, _POINTER, _INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER,
                                   _POINTER, _INT64, _POINTER, _POINTER, _POINTER, _POINTER, ctypes.c_int]

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tiled weight, and its row sums `[N]` int32 where this product takes them (else None). Taken in
        the same pass: summing the [N, K] int8 weight in torch widens it whole, a 4x copy of an LM head."""
        out_features, in_features = weight.shape
        weight = weight.contiguous()
        tiled = torch.empty(-(-out_features // self.group), -(-in_features // self.k_chunk),
                            self.group * self.k_chunk, dtype=torch.int8)
        row_sums = torch.empty(out_features, dtype=torch.int32) if self.needs_weight_sum else None
        self._pack(weight.data_ptr(), out_features, in_features, int(self.quad_major), tiled.data_ptr(),
                   None if row_sums is None else row_sums.data_ptr())
        return tiled, row_sums

    def rows(self, tiled: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
        """Rows `ids` of the weight `tiled` was packed from, `[len(ids), in_features]` int8."""
        groups, chunks, _ = tiled.shape
        within = ids % self.group
        if self.quad_major:  # [quad][slice of 16 features][feature][input in quad]
            blocks = tiled.view(groups, chunks, 16, 4, 16, 4)
            picked = blocks[ids // self.group, :, :, within // 16, within % 16, :]
        else:  # [slice][quad][feature][input in quad]
            blocks = tiled.view(groups, chunks, 4, 16, 16, 4)
            picked = blocks[ids // self.group, :, within // 16, :, within % 16, :]
        return picked.reshape(len(ids), chunks * self.k_chunk)[:, :in_features]  # [ids, chunks, quad, input] → rows

    def __call__(
        self, x: torch.Tensor, tiled: torch.Tensor, out_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
        weight_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.empty(x.shape[0], out_features)
        self._run(self._product, x, tiled, out_features, scales, bias, weight_sum, out)
        return out

    def two_pass(
        self, x: torch.Tensor, tiled: torch.Tensor, out_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
        weight_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The product with x's rows in two int8 passes, as the decode layer multiplies an input that takes them:
        `W8A8Linear(activation_passes=2)`'s bits."""
        rows, in_features = x.shape
        self._check_operands(in_features, tiled, out_features, weight_sum)
        x = x.contiguous()
        out = torch.empty(rows, out_features)
        scratch = torch.empty(2 * rows, tiled.shape[1] * self.k_chunk, dtype=torch.uint8)  # both passes' rows
        row_scales, residual = torch.empty(2 * rows), torch.empty(rows, in_features)
        passes = torch.empty(2 * rows, out_features)
        self._two_pass(int(self.products), x.data_ptr(), rows, in_features, tiled.data_ptr(),
                       None if weight_sum is None else weight_sum.data_ptr(), scales.data_ptr(),
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, scratch.data_ptr(),
                       row_scales.data_ptr(), residual.data_ptr(), passes.data_ptr(), torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor, tiled: torch.Tensor, out_features: int, scales: torch.Tensor,
               bias: torch.Tensor | None, weight_sum: torch.Tensor | None = None, with_logprobs: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """`[rows]` int64: each row's index of its largest output (the first of equal ones, NaN the largest, as
        numpy's argmax), the product's own bits compared in cache and never written out (an LM head's greedy
        choice); with `with_logprobs` also `[rows]` float32, each row's log-softmax at that index (within ~1e-5 of
        `log_softmax`'s: the token's logprob), else None."""
        ids = torch.empty(x.shape[0], dtype=torch.long)
        logprobs = torch.empty(x.shape[0]) if with_logprobs else None
        if x.shape[0] == 0:
            return ids, logprobs
        if self._run(self._argmax, x, tiled, out_features, scales, bias, weight_sum, ids,
                     None if logprobs is None else logprobs.data_ptr()) != 0:
            raise MemoryError(f"{self.symbol}_argmax found no scratch memory")
        return ids, logprobs

    def gates(self, out_features: int) -> bool:
        """Whether `silu_mul` takes a gate_up weight of `out_features` ([gate; up], each whole groups)."""
        return out_features % (2 * self.group) == 0

    def silu_mul(
        self, x: torch.Tensor, tiled: torch.Tensor, out_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
        weight_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`silu(gate) · up` of the product with a gate_up weight [gate; up] (`gates(out_features)`), `[rows,
        out_features / 2]`: each gate group meets its up group while both are in cache, instead of the product
        writing [rows, out_features] for SiLU and the multiply to read back. SiLU is the decode layer's (a few ulp
        from torch's)."""
        assert self.gates(out_features)
        out = torch.empty(x.shape[0], out_features // 2)
        scratch = torch.empty(torch.get_num_threads(), 2, x.shape[0], self.group)  # each thread's gate and up group
        self._run(self._silu_mul, x, tiled, out_features, scales, bias, weight_sum, out, scratch.data_ptr())
        return out

    def _check_operands(self, in_features: int, tiled: torch.Tensor, out_features: int,
                        weight_sum: torch.Tensor | None) -> None:
        """The tiled weight covers [out_features, in_features], with the row sums this product takes (if any)."""
        assert tiled.shape[1] * self.k_chunk >= in_features and tiled.shape[0] * self.group >= out_features
        assert (weight_sum is not None) == self.needs_weight_sum

    def _run(
        self, product: ctypes._CFuncPtr, x: torch.Tensor, tiled: torch.Tensor, out_features: int, scales: torch.Tensor,
        bias: torch.Tensor | None, weight_sum: torch.Tensor | None, out: torch.Tensor, *extra: int,
    ) -> int:
        """`product(x, rows, K, tiled[, weight_sum], scales, bias, out, N, xq, x_scale, *extra, threads)`; its
        status."""
        rows, in_features = x.shape
        self._check_operands(in_features, tiled, out_features, weight_sum)
        x = x.contiguous()
        scratch = torch.empty(rows, tiled.shape[1] * self.k_chunk, dtype=torch.uint8)  # int8 or uint8 rows
        row_scales = torch.empty(rows)
        return product(x.data_ptr(), rows, in_features, tiled.data_ptr(),
                       *(() if weight_sum is None else (weight_sum.data_ptr(),)), scales.data_ptr(),
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, scratch.data_ptr(),
                       row_scales.data_ptr(), *extra, torch.get_num_threads())


class W8A8Amx(TiledW8A8Kernel):
    """`TiledW8A8Kernel` on AMX tiles (`w8a8_amx`)."""

    symbol = "w8a8_amx"
    products = LayerProducts.W8A8_AMX


class W8A8Vnni(TiledW8A8Kernel):
    """`TiledW8A8Kernel` through AVX-512 VNNI dot products (`w8a8_vnni`): activations shifted to unsigned bytes,
    so it takes the weight's row sums (`weight_sum [N]` int32, Σₖ w[n, k])."""

    symbol = "w8a8_vnni"
    products = LayerProducts.W8A8_VNNI
    needs_weight_sum = True
    quad_major = True


class RmsNormRows:
    """The decode layer's RMSNorm over rows (`rms_norm_rows`): `(x [..., K] float32, weight [K] float32, eps)` →
    the same shape, each row the bits `decode_layer_int8` gives it. K must be a multiple of 8 (`supports`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = library.rms_norm_rows
        self._norm.restype = ctypes.c_int
        self._norm.argtypes = [_POINTER, _POINTER, _INT64, _INT64, ctypes.c_float, _POINTER, ctypes.c_int]

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] % 8 == 0
                and not torch.is_grad_enabled())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        hidden = x.shape[-1]
        self._norm(x.data_ptr(), weight.data_ptr(), x.numel() // hidden, hidden, eps, out.data_ptr(),
                   torch.get_num_threads())
        return out


class RopeRows:
    """`engines.models.llama.apply_rope` over rows (`rope_rows`), the same bits: `(x [rows, heads, head_dim] float32,
    each row's heads contiguous, cos / signed sin [rows, 1, head_dim])` → a new `[rows, heads, head_dim]`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rope = library.rope_rows
        self._rope.restype = ctypes.c_int
        self._rope.argtypes = [_POINTER, _INT64, _POINTER, _POINTER, _INT64, _INT64, _INT64, _POINTER, ctypes.c_int]

    @staticmethod
    def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        rows, _, head_dim = x.shape
        return (x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu" and head_dim % 16 == 0
                and x.stride(2) == 1 and x.stride(1) == head_dim and cos.shape == sin.shape == (rows, 1, head_dim)
                and cos.is_contiguous() and sin.is_contiguous() and not torch.is_grad_enabled())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, heads, head_dim = x.shape
        out = torch.empty(rows, heads, head_dim)
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, head_dim, out.data_ptr(),
                   torch.get_num_threads())
        return out


class SampleRows:
    """One draw per row of float32 logits from softmax(logits / temperature) within what its min-p, top k (0: all)
    and top-p nucleus keep (`sample_rows`): `engines.sampler.draw_native` calls it. -1 marks a row left to the
    caller. Beside each id, its log-softmax where the draw summed the whole row (temperature 1, no min-p: the same
    bits as `LogprobRows`), else NaN."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._sample = library.sample_rows
        self._sample.restype = ctypes.c_int
        self._sample.argtypes = [_POINTER, _INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER,
                                 ctypes.c_float, _INT64, _POINTER, _POINTER, ctypes.c_int]

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2

    def __call__(self, logits: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int],
                 top_ps: Sequence[float], min_ps: Sequence[float], uniforms: Sequence[float], log_share: float,
                 max_likely: int) -> tuple[list[int], list[float]]:
        logits = logits.contiguous()
        temperature = torch.tensor(temperatures, dtype=torch.float32)
        top_k = torch.tensor(top_ks, dtype=torch.int64)
        top_p = torch.tensor(top_ps, dtype=torch.float32)
        min_p = torch.tensor(min_ps, dtype=torch.float32)
        u = torch.tensor(uniforms, dtype=torch.float64)
        ids = torch.empty(len(logits), dtype=torch.int64)
        logprobs = torch.empty(len(logits))
        status = self._sample(logits.data_ptr(), len(logits), logits.shape[-1], temperature.data_ptr(),
                              top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), u.data_ptr(), log_share,
                              max_likely, ids.data_ptr(), logprobs.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError("sample_rows found no scratch memory")
        return ids.tolist(), logprobs.tolist()


class LogprobRows:
    """Each row's log-softmax at a chosen id and at its `top_n` most likely ids, for float32 logits (`logprob_rows`):
    `engines.sampler.token_logprobs` calls it."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._logprobs = library.logprob_rows
        self._logprobs.restype = ctypes.c_int
        self._logprobs.argtypes = [_POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _POINTER,
                                   ctypes.c_int]

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2

    def __call__(self, logits: torch.Tensor, chosen: Sequence[int], top_n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(chosen ids' log-probabilities [rows], top ids [rows, top_n], their log-probabilities [rows, top_n])."""
        logits = logits.contiguous()
        chosen_ids = torch.tensor(chosen, dtype=torch.int64)
        chosen_lp = torch.empty(len(logits))
        top_ids = torch.empty(len(logits), top_n, dtype=torch.int64)
        top_lp = torch.empty(len(logits), top_n)
        self._logprobs(logits.data_ptr(), len(logits), logits.shape[-1], chosen_ids.data_ptr(), top_n,
                       chosen_lp.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr(), torch.get_num_threads())
        return chosen_lp, top_ids, top_lp


class Int8Gemv:
    """`(x [rows, K] float32, weight [N, K] int8, scales [N] float32, bias [N] float32 | None)` →
    `[rows, N]` float32 = (q(x) · weightᵀ) · scales + bias, for any number of rows and K a multiple of 8 up to
    `max_k`, where q(x) is each row x / s rounded half to even, s = max(max|x|, 1e-12) / `x_levels`
    (int16 levels; the integer sums are exact). Each row's result is the same bits whatever other rows
    share the call."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemv = library.int8_gemv
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = [_POINTER, _INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER, _INT64, ctypes.c_int]
        self.max_k: int = library.int8_gemv_max_k()
        self.x_levels: int = library.int8_gemv_x_levels()

    def supports(self, in_features: int) -> bool:
        return in_features % 8 == 0 and 8 <= in_features <= self.max_k

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows, in_features = x.shape
        out_features = weight.shape[0]
        x = x.contiguous()
        out = torch.empty(rows, out_features)
        status = self._gemv(
            x.data_ptr(),
            rows,
            in_features,
            weight.data_ptr(),
            scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out_features,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError(f"int8_gemv: no scratch memory for {rows} rows of {in_features}")
        if status != 0:
            raise ValueError(
                f"int8_gemv takes one row or more of a multiple of 8 features, 8 to {self.max_k}; "
                f"got {tuple(x.shape)}"
            )
        return out


class PagedDecodeAttention:
    """`(query [T, H, D] float32, k_cache, v_cache [slots, KVH, D] float32 or bfloat16, block_tables [T, B]
    long, context_lens [T] long, block_size, scale)` → `[T, H, D]` float32: row t attends over positions
    [0, context_lens[t]) of its sequence, read in place through its block table. `isa`: the build — "avx2",
    "avx512", "avx512bf16" (the AVX-512 one, reading a bfloat16 cache with `vdpbf16ps`), or "amx" (that one with
    q · k and Σ weight · v on AMX tiles; the process must have been granted AMX state: `attention_isa`)."""

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        self._attention = getattr(library, f"paged_decode_attention_{isa}")
        self.isa = isa
        self.lanes = {"avx2": 8, "avx512": 16, "avx512bf16": 16, "amx": 16}[isa]  # head_dim must be a multiple of it
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [_POINTER, _POINTER, _POINTER, ctypes.c_int, _POINTER, _INT64, _POINTER]
        self._attention.argtypes += [_INT64] * 5 + [ctypes.c_float, ctypes.c_int, _POINTER, ctypes.c_int]
        max_head_dim, max_group = _INT64(), _INT64()
        library.paged_decode_attention_limits(ctypes.byref(max_head_dim), ctypes.byref(max_group))
        self.max_head_dim, self.max_group = max_head_dim.value, max_group.value

    def attends_prefill(self, head_dim: int, kv_dtype: torch.dtype) -> bool:
        """Whether prefill chunks should attend through this kernel, as decode rows, rather than SDPA: where it
        reads a bfloat16 cache with `vdpbf16ps`, it beat SDPA on a Zen 4 (`python -m bench.kernels`' prefill table,
        BENCHMARKS.md 2026-12-06). On AMX CPUs SDPA's bfloat16 products run on tiles and were 3-4x faster than this
        kernel on an Intel Xeon (the same table, 2026-12-06 (later)): chunks take `PagedPrefillAttention` there."""
        return (self.isa == "avx512bf16" and kv_dtype == torch.bfloat16 and head_dim % 32 == 0
                and "amx_bf16" not in cpu_flags())

    def supports(
        self, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int
    ) -> bool:
        return (
            kv_dtype in (torch.float32, torch.bfloat16)
            and block_size > 0
            and block_size & (block_size - 1) == 0  # a power of two: positions map to slots by shift and mask
            and head_dim % self.lanes == 0
            and head_dim <= self.max_head_dim
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= self.max_group
        )

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        fetch_ahead: bool = True,
    ) -> torch.Tensor:
        """`fetch_ahead`: read each row's cache ahead of need (decode rows, each its own sequence's blocks; a prefill
        chunk's rows read their one sequence's K/V from cache after the first, and pass False)."""
        rows, num_heads, head_dim = query.shape
        query, block_tables = query.float().contiguous(), block_tables.contiguous()
        out = torch.empty(rows, num_heads, head_dim)
        status = self._attention(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            rows,
            num_heads,
            k_cache.shape[1],
            head_dim,
            block_size,
            scale,
            int(fetch_ahead),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"paged_decode_attention cannot take heads {num_heads}/{k_cache.shape[1]} × {head_dim} in blocks of "
                f"{block_size}"
            )
        return out

    def attend_chunk(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, num_computed: int, block_size: int, scale: float) -> torch.Tensor:
        """A prefill chunk (`ChunkAttention`), each query row a decode row over its causal context."""
        rows = query.shape[0]
        return self(query, k_cache, v_cache, block_table.expand(rows, -1).contiguous(),
                    torch.arange(num_computed + 1, num_computed + rows + 1), block_size, scale, fetch_ahead=False)


class PagedPrefillAttention:
    """A prefill chunk's causal attention over a bfloat16 paged cache on AMX tiles (`paged_prefill_attention_amx`):
    16 query rows of a head are one tile, so one instruction scores 16 positions for all of them, where the decode
    kernel takes each row alone. The softmax weights are rounded to bfloat16 as the decode kernel's AMX build rounds
    them; a row's result depends on its query and its context only, not on the chunk it came in."""

    isa = "amx"

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attention = library.paged_prefill_attention_amx
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [_POINTER] * 4 + [_INT64] * 6 + [ctypes.c_float, _POINTER, ctypes.c_int]
        max_head_dim, max_group = _INT64(), _INT64()
        library.paged_decode_attention_limits(ctypes.byref(max_head_dim), ctypes.byref(max_group))
        self.max_head_dim, self.max_group = max_head_dim.value, max_group.value

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                 block_size: int) -> bool:
        """A bfloat16 cache, heads of a multiple of 32 dims, blocks of a power of two of at least 16 positions."""
        return (kv_dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= self.max_head_dim
                and block_size >= 16 and block_size & (block_size - 1) == 0 and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= self.max_group)

    def attend_chunk(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, num_computed: int, block_size: int, scale: float) -> torch.Tensor:
        """query [n, H, D] at positions [num_computed, num_computed + n) of the sequence whose K/V (these rows'
        too) are at `block_table`'s blocks → [n, H, D] float32, row i over positions [0, num_computed + i]."""
        rows, num_heads, head_dim = query.shape
        query, block_table = query.float().contiguous(), block_table.contiguous()
        out = torch.empty(rows, num_heads, head_dim)
        status = self._attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                                 num_computed, rows, num_heads, k_cache.shape[1], head_dim, block_size, scale,
                                 out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise ValueError(f"paged_prefill_attention_amx cannot take heads {num_heads}/{k_cache.shape[1]} × "
                             f"{head_dim} in blocks of {block_size} (status {status})")
        return out


class Int8Projection(ctypes.Structure):
    """An int8 projection as `decode_layer_int8` reads it (`struct int8_linear`)."""

    _fields_ = [("weight", _POINTER), ("scale", _POINTER), ("bias", _POINTER), ("weight_sum", _POINTER),
                ("activation_passes", ctypes.c_int32)]


class DecoderLayerWeights(ctypes.Structure):
    """`struct decoder_layer`: one layer's norms, projections and KV cache, by address. Built once per layer
    by `DecodeLayerKernel.layer`, which keeps the tensors alive beside it."""

    _fields_ = [
        ("input_norm", _POINTER),
        ("post_attention_norm", _POINTER),
        ("qkv", Int8Projection),
        ("o", Int8Projection),
        ("gate_up", Int8Projection),
        ("down", Int8Projection),
        ("k_cache", _POINTER),
        ("v_cache", _POINTER),
    ]


class DecoderShape(ctypes.Structure):
    """`struct decoder_shape`: the sizes every layer of a model shares."""

    _fields_ = [
        ("hidden", _INT64),
        ("heads", _INT64),
        ("kv_heads", _INT64),
        ("head_dim", _INT64),
        ("intermediate", _INT64),
        ("block_size", _INT64),
        ("rms_norm_eps", ctypes.c_float),
        ("attention_scale", ctypes.c_float),
        ("kv_bf16", ctypes.c_int32),
        ("products", ctypes.c_int32),  # `LayerProducts`
        ("bf16_dot", ctypes.c_int32),  # a bfloat16 cache attended by `vdpbf16ps` (1) or on AMX tiles (2)
    ]


class DecodeRows(ctypes.Structure):
    """`struct decode_rows`: one step's decode rows, the same for every layer of the step."""

    _fields_ = [
        ("rows", _INT64),
        ("cos", _POINTER),
        ("sin", _POINTER),
        ("slot_mapping", _POINTER),
        ("block_tables", _POINTER),
        ("max_blocks", _INT64),
        ("context_lens", _POINTER),
        ("workspace", _POINTER),
    ]


@dataclass(frozen=True)
class ForwardCost:
    """What a forward over n decode rows costs, in one-row forwards (speculation sizes its rounds with it): the
    weights stream once for all rows; each row beyond the first adds `per_row` (its arithmetic), and each pass
    over the weights beyond the first (a pass takes `rows_per_pass` rows; later passes find the weights in
    cache) adds `per_pass`."""

    per_row: float = 0.0
    per_pass: float = 0.0
    rows_per_pass: int = 1 << 30

    def __call__(self, rows: int) -> float:
        return 1 + self.per_row * (rows - 1) + self.per_pass * (-(-rows // self.rows_per_pass) - 1)


# Per kind of product (`python -m bench.kernels` times them; BENCHMARKS.md). int16 products (`vpmaddwd`) are bound
# by arithmetic, not by the weight stream, from two rows on: about a fifth of a row each (both demo models, 1 to 8
# rows, within 0.1 on the AVX2 EPYC, 2026-12-04). On AMX tiles 16 rows cost ~1.06 one-row products. `w8a8_vnni`
# takes 4 rows a pass at the cost of one (0.96-1.14x), and each further pass ~0.1-0.35 of a one-row product (16 rows
# 1.7-2.05x); with attention and the rest of the layer a verification of ~14 rows at batch 4 took 2.3 plain steps in
# `bench.speculative`, hence 0.4 a pass (Zen 4, 2026-12-05).
FORWARD_COST = {
    LayerProducts.INT8_WEIGHT_ONLY: ForwardCost(per_row=0.2),
    LayerProducts.W8A8_AMX: ForwardCost(),
    LayerProducts.W8A8_VNNI: ForwardCost(per_pass=0.4, rows_per_pass=4),
}

class Projection(NamedTuple):
    """A projection's operands as `decode_layer_int8` takes them."""

    weight: torch.Tensor  # int8, [N, K] or in tile order
    scales: torch.Tensor
    bias: torch.Tensor | None
    weight_sum: torch.Tensor | None  # the weight's row sums where the products are W8A8_VNNI
    activation_passes: int = 1  # int8 passes over the input (`W8A8Linear.activation_passes`)


class DecodeLayerKernel:
    """A whole Llama / Qwen2 decoder layer for up to `max_rows` decode rows in one native call
    (`decode_layer_int8`): int8 products of one kind (`LayerProducts`, in the shape) on float32 activations, a
    float32 or bfloat16 paged KV cache read and written in place. x [rows, hidden] is updated in place."""

    def __init__(self, library: ctypes.CDLL, attention: PagedDecodeAttention) -> None:
        self._layer = library.decode_layer_int8
        self._layer.restype = ctypes.c_int
        self._layer.argtypes = [_POINTER, _POINTER, _POINTER, _POINTER, ctypes.c_int]
        self._workspace_floats = library.decode_layer_workspace_floats
        self._workspace_floats.restype = _INT64
        self._workspace_floats.argtypes = [_POINTER, _INT64]
        self._attention = attention
        self.max_rows: int = library.decode_layer_max_rows()
        self._max_k: int = library.int8_gemv_max_k()

    def supports(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, kv_dtype: torch.dtype,
        block_size: int,
    ) -> bool:
        return (
            self._attention.supports(heads, kv_heads, head_dim, kv_dtype, block_size)
            and head_dim % 8 == 0
            and all(k % 8 == 0 and 8 <= k <= self._max_k for k in (hidden, heads * head_dim, intermediate))
        )

    def layer(
        self, input_norm: torch.Tensor, post_attention_norm: torch.Tensor, qkv: Projection, o: Projection,
        gate_up: Projection, down: Projection, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> tuple[DecoderLayerWeights, list[torch.Tensor]]:
        """The layer's operands by address, and the tensors that must outlive it."""
        keep = [input_norm, post_attention_norm, k_cache, v_cache]

        def projection(operands: Projection) -> Int8Projection:
            weight, scales, bias, weight_sum, passes = operands
            keep.extend(tensor for tensor in (weight, scales, bias, weight_sum) if tensor is not None)
            return Int8Projection(weight.data_ptr(), scales.data_ptr(), None if bias is None else bias.data_ptr(),
                                  None if weight_sum is None else weight_sum.data_ptr(), passes)

        for tensor in keep[:2]:
            assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        weights = DecoderLayerWeights(
            input_norm.data_ptr(), post_attention_norm.data_ptr(), projection(qkv), projection(o),
            projection(gate_up), projection(down), k_cache.data_ptr(), v_cache.data_ptr(),
        )
        return weights, keep

    def rows(
        self, shape: DecoderShape, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor,
    ) -> tuple[DecodeRows, list[torch.Tensor]]:
        """A step's decode rows by address (cos, sin [rows, head_dim] float32), with a workspace for them;
        and the tensors that must outlive it."""
        rows = slot_mapping.shape[0]
        keep = [tensor.contiguous() for tensor in (cos, sin, slot_mapping, block_tables, context_lens)]
        keep.append(torch.empty(self._workspace_floats(ctypes.byref(shape), rows)))
        cos, sin, slot_mapping, block_tables, context_lens, workspace = keep
        step = DecodeRows(rows, cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
                          block_tables.shape[1], context_lens.data_ptr(), workspace.data_ptr())
        return step, keep

    def __call__(self, weights: DecoderLayerWeights, shape: DecoderShape, step: DecodeRows, x: torch.Tensor) -> None:
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape == (step.rows, shape.hidden)
        status = self._layer(ctypes.byref(weights), ctypes.byref(shape), ctypes.byref(step), x.data_ptr(),
                             torch.get_num_threads())
        if status == -2:
            raise MemoryError("decode_layer_int8: attention found no scratch memory")
        if status != 0:
            raise ValueError(f"decode_layer_int8 cannot take {step.rows} rows of this layer's sizes")


@functools.cache
def w8a8_vnni() -> W8A8Vnni | None:
    """The w8a8 kernel on AVX-512 VNNI, or None where this CPU or machine cannot run it."""
    library = _library()
    return None if library is None or not _has(AVX512_VNNI_FLAGS, "w8a8_vnni") else W8A8Vnni(library)


@functools.cache
def w8a8_amx() -> W8A8Amx | None:
    """The AMX w8a8 kernel, or None where this CPU, kernel (Linux grants AMX state on request) or machine
    cannot run it."""
    library = _library()
    if library is None or not _has(AMX_INT8_FLAGS, "w8a8_amx"):
        return None
    if library.w8a8_amx_enable() != 0:
        logger.info("CPU kernel w8a8_amx not used: the OS did not grant AMX tile state")
        return None
    return W8A8Amx(library)


def w8a8_tiled() -> TiledW8A8Kernel | None:
    """The tiled w8a8 kernel w8a8 layers run on this CPU: on AMX tiles where it has them, else through VNNI; None
    where neither runs (`torch._int_mm` then)."""
    return w8a8_amx() or w8a8_vnni()


@functools.cache
def int8_gemv() -> Int8Gemv | None:
    """The int8 weight-only kernel, or None where this CPU or machine cannot run it."""
    library = _library()
    return None if library is None else Int8Gemv(library)


@functools.cache
def paged_decode_attention() -> PagedDecodeAttention | None:
    """The decode attention kernel, or None where this CPU or machine cannot run it."""
    library = _library()
    return None if library is None else PagedDecodeAttention(library, attention_isa())


def prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                      block_size: int) -> PagedPrefillAttention | PagedDecodeAttention | None:
    """The kernel prefill chunks attend through on this CPU, or None for SDPA: on AMX tiles where the attention
    build is "amx"; the decode kernel, row by row, where it reads bfloat16 with `vdpbf16ps` (`attends_prefill`);
    SDPA elsewhere (BENCHMARKS.md: `python -m bench.kernels`' prefill table)."""
    library = _library()
    if library is None:
        return None
    kernel = PagedPrefillAttention(library) if attention_isa() == "amx" else paged_decode_attention()
    if kernel is None or not kernel.supports(num_heads, num_kv_heads, head_dim, kv_dtype, block_size):
        return None
    if isinstance(kernel, PagedDecodeAttention) and not kernel.attends_prefill(head_dim, kv_dtype):
        return None
    return kernel


def attention_isa() -> str:
    """The attention build this CPU runs (`PagedDecodeAttention.isa`): on AMX tiles where the CPU has AMX-BF16 and
    the OS grants tile state, else with `vdpbf16ps` where it has AVX512_BF16, else AVX-512 or AVX2 FMAs."""
    library = _library()
    if library is not None and cpu_flags() >= AMX_BF16_FLAGS:
        if library.w8a8_amx_enable() == 0:
            return "amx"
        logger.info("CPU attention on AMX tiles not used: the OS did not grant AMX tile state")
    return "avx512bf16" if bf16_dot_products() else "avx512" if cpu_flags() >= AVX512_VNNI_FLAGS else "avx2"


def bf16_dot_products() -> bool:
    """Whether the attention reads a bfloat16 cache with `vdpbf16ps` here (AVX512_BF16: Zen 4, Sapphire Rapids):
    the query and the softmax weights are then rounded to bfloat16, as SDPA in the cache's dtype rounds them."""
    return cpu_flags() >= AVX512_BF16_FLAGS


@functools.cache
def rms_norm_rows() -> RmsNormRows | None:
    """The decode layer's RMSNorm over rows, or None where this CPU or machine cannot run the kernels."""
    library = _library()
    return None if library is None else RmsNormRows(library)


@functools.cache
def rope_rows() -> RopeRows | None:
    """`apply_rope` over rows in C, or None where this CPU or machine cannot run the kernels."""
    library = _library()
    return None if library is None else RopeRows(library)


@functools.cache
def logprob_rows() -> LogprobRows | None:
    """The log-probability kernel, or None where this CPU or machine cannot run the kernels."""
    library = _library()
    return None if library is None else LogprobRows(library)


@functools.cache
def sample_rows() -> SampleRows | None:
    """The sampling kernel, or None where this CPU or machine cannot run the kernels."""
    library = _library()
    return None if library is None else SampleRows(library)


@functools.cache
def decode_layer() -> DecodeLayerKernel | None:
    """The whole-layer decode kernel (AVX2 + FMA), or None where this CPU or machine cannot run it."""
    library = _library()
    return None if library is None else DecodeLayerKernel(library, PagedDecodeAttention(library, "avx2"))


def _has(flags: frozenset[str], kernel: str) -> bool:
    missing = flags - cpu_flags()
    if missing:
        logger.info("CPU kernel %s not used: the CPU lacks %s", kernel, ", ".join(sorted(missing)))
    return not missing


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where this CPU or machine cannot run them (logged once)."""
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        logger.info("CPU decode kernels not used: the CPU lacks %s", ", ".join(sorted(missing)))
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except subprocess.CalledProcessError as error:
        logger.warning(
            "CPU decode kernels not used: they did not compile (%s): falling back to PyTorch ops",
            error.stderr.decode(errors="replace").strip()[-500:],
        )
    except OSError as error:
        logger.warning("CPU decode kernels not used (%s): falling back to PyTorch ops", error)
    return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (cc, gcc or $CC)")
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (SOURCE, *INCLUDES)))
    digest.update(" ".join((compiler, *COMPILE_FLAGS)).encode())
    cache = CACHE_DIR.expanduser()
    library = cache / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / library.name
        subprocess.run([compiler, *COMPILE_FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True)
        os.replace(built, library)  # atomic: a concurrent build's reader sees the whole file or none
    return library
