"""The few-row w8a8 kernel computes exactly what `torch._int_mm` does, and its absence costs nothing but speed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from engines import w8a8_gemv as gemv_module
from engines.quantization import W8A8Linear
from engines.w8a8_gemv import w8a8_gemv

needs_kernel = pytest.mark.skipif(
    w8a8_gemv() is None, reason="the w8a8 decode kernel needs AVX-512 VNNI and a C compiler; this machine lacks one"
)


def w8a8_pair(in_features: int, out_features: int, bias: bool) -> tuple[W8A8Linear, W8A8Linear]:
    """The same quantised layer twice: through the kernel, and forced onto `torch._int_mm`."""
    torch.manual_seed(in_features + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with_kernel = W8A8Linear.from_linear(linear, torch.float32)
    reference = W8A8Linear.from_linear(linear, torch.float32)
    reference.gemv = None
    return with_kernel, reference


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("in_features", "bias"), [(256, False), (200, True), (4864 // 8, True)])
def test_the_kernel_is_bit_identical_to_int_mm(rows: int, in_features: int, bias: bool) -> None:
    with_kernel, reference = w8a8_pair(in_features, 96, bias)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows).unsqueeze(1)  # row scales far apart
    x[0] = x[0].clamp(-100, 100)
    x[0, :3] = torch.tensor([127.0, 2.5, -3.5])  # scale exactly 1: two values halfway, rounded half to even
    assert torch.equal(with_kernel(x), reference(x))
    assert torch.equal(with_kernel(torch.zeros(rows, in_features)), reference(torch.zeros(rows, in_features)))


@needs_kernel
def test_rows_beyond_the_kernel_go_to_int_mm_and_stay_exact() -> None:
    with_kernel, reference = w8a8_pair(128, 64, True)
    kernel = w8a8_gemv()
    assert kernel is not None
    x = torch.randn(kernel.max_rows + 1, 128)
    assert torch.equal(with_kernel(x), reference(x))
    with pytest.raises(ValueError, match="rows"):
        kernel(x, with_kernel.weight, with_kernel.weight_sum, with_kernel.scales, with_kernel.bias)


def test_a_cpu_without_vnni_keeps_int_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_module, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert gemv_module.w8a8_gemv.__wrapped__() is None


def test_a_kernel_that_does_not_compile_is_logged_and_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(gemv_module, "SOURCE", broken)
    monkeypatch.setattr(gemv_module, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(gemv_module, "cpu_flags", lambda: gemv_module.REQUIRED_CPU_FLAGS)
    with caplog.at_level(logging.WARNING, logger=gemv_module.__name__):
        assert gemv_module.w8a8_gemv.__wrapped__() is None
    assert "did not compile" in caplog.text or "no C compiler" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left to load later
