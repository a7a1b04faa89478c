"""The CPU decode kernels of `cpu_kernels.c`: compiled once per machine, loaded with ctypes.

A decode step at batch 1 multiplies one row by every weight of the model and attends over one
sequence's cache, so it should be bound by how fast the weights stream from memory. Two things kept it
far from that: oneDNN's `torch._int_mm` streams a one-row product's weights well below DRAM bandwidth,
and paged attention through PyTorch ops (gather the blocks, mask, SDPA) pays per-op costs far above the
few kilobytes of K/V it reads. `w8a8_gemv` (bit-identical to `_int_mm`) replaces the first for inputs
of up to `max_rows` rows; `paged_decode_attention` (reads the cache in place through the block tables)
the second, for every decode row of every step, so a row's result never depends on the batch size.
`python -m bench.kernels` times the GEMV against `_int_mm`, `python -m bench.engine --batch1-only` a
decode step with both kernels against the PyTorch ops; BENCHMARKS.md has the figures.

They need AVX-512 with VNNI (the CPUs where `quantization = "auto"` picks w8a8) and a C compiler (`cc`,
or `$CC`). The shared library is built on first use into `~/.cache/sluice/native/` under a name that
hashes the source and flags, so an edited kernel is rebuilt and concurrent builds cannot see each
other's half-written file. Where either is missing, both accessors return None and the callers keep
their PyTorch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engines.cpu import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
CACHE_DIR = Path("~/.cache/sluice/native")
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
COMPILE_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp", "-shared", "-fPIC")
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64


class W8A8Gemv:
    """`(x [rows, K] float32, weight [N, K] int8, weight_sum [N] int32, scales [N], bias [N] | None)` →
    `[rows, N]` float32, for 1 ≤ rows ≤ `max_rows`: `W8A8Linear`'s product, bit for bit."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemv = library.w8a8_gemv
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = [
            _POINTER,
            _INT64,
            _INT64,
            _POINTER,
            _POINTER,
            _POINTER,
            _POINTER,
            _POINTER,
            _INT64,
            _POINTER,
            _POINTER,
            ctypes.c_int,
        ]
        self.max_rows: int = library.w8a8_gemv_max_rows()

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_sum: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        rows, in_features = x.shape
        out_features = weight.shape[0]
        x = x.contiguous()
        out = torch.empty(rows, out_features)
        scratch, row_scales = torch.empty(rows, in_features, dtype=torch.uint8), torch.empty(rows)
        status = self._gemv(
            x.data_ptr(),
            rows,
            in_features,
            weight.data_ptr(),
            weight_sum.data_ptr(),
            scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out_features,
            scratch.data_ptr(),
            row_scales.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"w8a8_gemv takes 1 to {self.max_rows} rows, got {rows}")
        return out


class PagedDecodeAttention:
    """`(query [T, H, D] float32, k_cache, v_cache [slots, KVH, D] float32 or bfloat16, block_tables [T, B]
    long, context_lens [T] long, block_size, scale)` → `[T, H, D]` float32: row t attends over positions
    [0, context_lens[t]) of its sequence, read in place through its block table."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attention = library.paged_decode_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [_POINTER, _POINTER, _POINTER, ctypes.c_int, _POINTER, _INT64, _POINTER]
        self._attention.argtypes += [_INT64] * 5 + [ctypes.c_float, _POINTER, ctypes.c_int]
        max_head_dim, max_group = _INT64(), _INT64()
        library.paged_decode_attention_limits(ctypes.byref(max_head_dim), ctypes.byref(max_group))
        self.max_head_dim, self.max_group = max_head_dim.value, max_group.value

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> bool:
        return (
            kv_dtype in (torch.float32, torch.bfloat16)
            and head_dim % 16 == 0
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
    ) -> torch.Tensor:
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
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"paged_decode_attention cannot take heads {num_heads}/{k_cache.shape[1]} × {head_dim}")
        return out


@functools.cache
def w8a8_gemv() -> W8A8Gemv | None:
    """The w8a8 kernel, or None where this CPU or machine cannot run it."""
    library = _library()
    return None if library is None else W8A8Gemv(library)


@functools.cache
def paged_decode_attention() -> PagedDecodeAttention | None:
    """The decode attention kernel, or None where this CPU or machine cannot run it."""
    library = _library()
    return None if library is None else PagedDecodeAttention(library)


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
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *COMPILE_FLAGS)).encode()).hexdigest()[:16]
    cache = CACHE_DIR.expanduser()
    library = cache / f"cpu_kernels-{digest}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / library.name
        subprocess.run([compiler, *COMPILE_FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True)
        os.replace(built, library)  # atomic: a concurrent build's reader sees the whole file or none
    return library
