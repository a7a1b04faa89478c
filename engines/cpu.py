"""What this CPU can do natively, read once from /proc/cpuinfo (Linux; elsewhere: nothing special).

The engine's `auto` settings follow it: int8 dot products (VNNI, AMX) make int8 × int8 matmuls beat
float32 ones, and native bfloat16 (AVX-512 BF16, AMX) makes a bfloat16 KV cache cheap to read.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import numpy as np

# PyTorch's own cap on the instructions its CPU kernels use (`ATEN_CPU_CAPABILITY`), honoured by ours too: with
# "avx2" an AVX-512 machine chooses and runs what an AVX2-only CPU would (`auto` settings, the native kernels'
# AVX2 builds), so those paths are tested and measured on any x86 host (`make test` runs the kernel tests so).
ISA_CAP_ENV = "ATEN_CPU_CAPABILITY"
FLAGS_BEYOND_CAP = {
    "default": ("avx", "fma", "f16c", "amx"),  # SSE only: every native kernel off, PyTorch ops alone
    "avx2": ("avx512", "avx_vnni", "amx"),
    "avx512": ("amx",),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, less those beyond `ATEN_CPU_CAPABILITY` where that is set."""
    flags = _proc_cpu_flags()
    dropped = FLAGS_BEYOND_CAP.get(os.environ.get(ISA_CAP_ENV, "").strip().lower(), ())
    return frozenset(flag for flag in flags if not flag.startswith(dropped))


def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_int8_dot_product() -> bool:
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_MADV_DONTNEED = 4  # Linux
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def drop_mapped_pages(view: np.ndarray) -> None:
    """Let go of the resident pages of a read-only file mapping under `view` (Linux `madvise(DONTNEED)`;
    elsewhere nothing). A later read faults them back in from the file, so this is safe on any view.

    Loading reads each tensor of a memory-mapped checkpoint once: without this the whole file (1.1 GB
    for the large demo model) stays counted in the process's resident memory until loading ends."""
    madvise = getattr(_libc(), "madvise", None) if sys.platform == "linux" else None
    if madvise is None or view.nbytes == 0:
        return
    import ctypes

    start = view.ctypes.data // _PAGE_SIZE * _PAGE_SIZE
    madvise(ctypes.c_void_p(start), ctypes.c_size_t(view.ctypes.data + view.nbytes - start), _MADV_DONTNEED)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; elsewhere nothing).

    Loading frees gigabytes of float32 temporaries in pieces small enough to live in malloc's arenas,
    which glibc keeps mapped: without this a loaded engine stays that much larger than its weights."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # the most glibc accepts
TRIM_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Let the C heap keep what a step frees for the next step (glibc `mallopt`; elsewhere nothing, False).

    By default glibc maps blocks above an adaptive threshold afresh and hands freed memory at the heap's top back
    to the OS beyond another, and a prefill chunk's activations (megabytes per op, every layer) defeat the
    adaptation: each op's output faulted its pages in anew, ~380,000 minor faults and ~13% of a 600-token prefill
    on the large tier (BENCHMARKS.md). Fixed thresholds — blocks up to 32 MB from the heap, up to 256 MB of free
    heap kept — reuse them. 256 MB holds a prefill chunk's activations on the large tier and bounds what a second
    engine loading in the same process keeps beside its temporaries (1 GB raised `make run`'s loading peak by
    ~0.9 GB). The engine calls it once loaded; `release_free_memory` still trims on request."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mapped) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
