"""What this CPU can do natively, read once from /proc/cpuinfo (Linux; elsewhere: nothing special).

The engine's `auto` settings follow it: int8 dot products (VNNI, AMX) make int8 × int8 matmuls beat
float32 ones, and native bfloat16 (AVX-512 BF16, AMX) makes a bfloat16 KV cache cheap to read.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
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


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; elsewhere nothing).

    Loading frees gigabytes of float32 temporaries in pieces small enough to live in malloc's arenas,
    which glibc keeps mapped: without this a loaded engine stays that much larger than its weights."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)
