"""The engine's kernel specifications hold on the CPUs narrower than this one, not only on this one.

What the engine runs depends on the CPU: `auto` picks w8a8 on tiles where there are int8 dot products and int8
weight-only with the AVX2 products where there are not, the native kernels come in an AVX2, an AVX-512 and an AMX
build, and without AVX they are off. A suite run on one host exercises one of these paths; a bug in the others
stays hidden until a user's CPU meets it (the AVX2 sampling kernel's first run of its tests was on a user's
AVX2 host). So the kernel and engine tests run again here in a child process under each narrower
`ATEN_CPU_CAPABILITY` (PyTorch's cap, honoured by `engines.cpu.cpu_flags`), and must pass there too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.cpu import FLAGS_BEYOND_CAP, ISA_CAP_ENV, cpu_flags

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SPECS = [
    "tests/engine/test_cpu_kernels.py",
    "tests/engine/test_native_decode.py",
    "tests/engine/test_fused_kernels.py",
    "tests/engine/test_int8_matmul.py",
    "tests/engine/test_sampler.py",
    "tests/engine/test_quantization.py",
    "tests/engine/test_speculative.py",
    "tests/engine/test_engine.py",
]


def narrower(cap: str) -> bool:
    """Whether capping at `cap` takes anything away from what this process runs."""
    return any(flag.startswith(FLAGS_BEYOND_CAP[cap]) for flag in cpu_flags())


@pytest.mark.parametrize("cap", ["avx512", "avx2", "default"])
def test_the_kernel_specs_pass_as_a_narrower_cpu_runs_them(cap: str) -> None:
    if not narrower(cap):
        pytest.skip(f"this CPU runs nothing beyond {ISA_CAP_ENV}={cap}: the suite itself ran that path")
    env = {**os.environ, ISA_CAP_ENV: cap}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_SPECS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, f"{ISA_CAP_ENV}={cap}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"


def test_a_cap_hides_the_flags_beyond_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines import cpu

    monkeypatch.setattr(cpu, "_proc_cpu_flags", lambda: frozenset({"sse4_2", "avx2", "fma", "avx512f",
                                                                     "avx512_vnni", "amx_int8", "avx_vnni"}))
    for cap, kept in [
        ("", {"sse4_2", "avx2", "fma", "avx512f", "avx512_vnni", "amx_int8", "avx_vnni"}),
        ("AVX512", {"sse4_2", "avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni"}),
        ("avx2", {"sse4_2", "avx2", "fma"}),
        ("default", {"sse4_2"}),
    ]:
        monkeypatch.setenv(ISA_CAP_ENV, cap)
        cpu.cpu_flags.cache_clear()
        assert cpu.cpu_flags() == kept, cap
    cpu.cpu_flags.cache_clear()
