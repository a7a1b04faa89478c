"""The few-row w8a8 kernel of `w8a8_gemv.c`: compiled once per machine, loaded with ctypes.

Decode steps multiply one to a few rows by every weight of the model, so they are bound by how fast the
int8 weights stream from memory; oneDNN's `torch._int_mm` reaches about half of DRAM bandwidth at one
row, this kernel nearly all of it, with bit-identical results (`python -m bench.kernels` times both).

It needs AVX-512 VNNI (the CPUs where `quantization = "auto"` picks w8a8) and a C compiler (`cc`, or
`$CC`). The shared library is built on first use into `~/.cache/sluice/native/` under a name that hashes
the source and flags, so an edited kernel is rebuilt and concurrent builds cannot see each other's
half-written file. Where either is missing, `w8a8_gemv()` is None and W8A8Linear keeps `torch._int_mm`.
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
    `[rows, N]` float32, for 1 ≤ rows ≤ `max_rows`."""

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


@functools.cache
def w8a8_gemv() -> W8A8Gemv | None:
    """The kernel, or None where this CPU or machine cannot run it (logged once)."""
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        logger.info("w8a8 decode kernel not used: the CPU lacks %s", ", ".join(sorted(missing)))
        return None
    try:
        return W8A8Gemv(ctypes.CDLL(str(_build())))
    except subprocess.CalledProcessError as error:
        logger.warning(
            "w8a8 decode kernel not used: it did not compile (%s): falling back to torch._int_mm",
            error.stderr.decode(errors="replace").strip()[-500:],
        )
    except OSError as error:
        logger.warning("w8a8 decode kernel not used (%s): falling back to torch._int_mm", error)
    return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (cc, gcc or $CC)")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *COMPILE_FLAGS)).encode()).hexdigest()[:16]
    cache = CACHE_DIR.expanduser()
    library = cache / f"w8a8_gemv-{digest}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / library.name
        subprocess.run([compiler, *COMPILE_FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True)
        os.replace(built, library)  # atomic: a concurrent build's reader sees the whole file or none
    return library
