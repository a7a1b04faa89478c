"""The CUDA path's fused kernels against their PyTorch references — the residual add + RMSNorm, SiLU(gate) · up, and
RoPE with the K/V store:
interpreted on CPU (float32), natively on CUDA (bfloat16, the demo tiers' widths) where a GPU is present. Outputs
start as NaN (`nan_filled_empty`), so a row or column a kernel never writes fails."""

from __future__ import annotations

import pytest
import torch

from tests.engine.interpreted import interpreted_report, nan_filled_empty, report_when_run

# name: (rows, hidden, with a residual)
CASES = {"rows_and_residual": (3, 96, True), "no_residual": (2, 64, False), "one_row_odd_width": (1, 72, True)}
# name: (rows, width of gate and of up); 1500 spans two column blocks of the kernel, the second partly
SILU_CASES = {"silu_two_blocks": (2, 1500), "silu_narrow": (3, 40)}


def error(rows: int, hidden: int, with_residual: bool, dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> float:
    """Max abs error of (output, residual sum) against the reference; inf where anything is not finite."""
    from kernels.rms_norm import rms_norm, rms_norm_reference

    generator = torch.Generator().manual_seed(rows * hidden)
    x, residual = (torch.randn(rows, hidden, generator=generator).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    arguments = [x, weight, 1e-6, residual if with_residual else None]
    expected = rms_norm_reference(*arguments)
    on_device = [a.to(device) if isinstance(a, torch.Tensor) else a for a in arguments]
    with nan_filled_empty():
        got = rms_norm(*on_device)
    errors = [(g.cpu().float() - e.float()).abs().max().item() for g, e in zip(got, expected, strict=True)]
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    return max(errors) if finite else float("inf")


def silu_error(rows: int, width: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """Max error of the kernel against the reference, relative to 1 + |reference|; inf where not finite."""
    from kernels.activation import silu_and_mul, silu_and_mul_reference

    x = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)).mul(3).to(dtype)
    with nan_filled_empty():
        got = silu_and_mul(x.to(device)).cpu()
    expected = silu_and_mul_reference(x).float()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return ((got.float() - expected).abs() / (1 + expected.abs())).max().item()  # relative beyond 1


# name: (tokens, heads, kv heads, head_dim); slots of every third token are -1 (padding: nothing stored)
ROPE_CASES = {"rope_gqa": (5, 6, 2, 16), "rope_odd_heads": (3, 7, 1, 24)}


def rope_error(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> float:
    """Max error of q, k, v and both caches against the reference, relative to 1 + |reference|."""
    from kernels.rope import rope_and_store_kvcache, rope_and_store_kvcache_reference

    generator = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)
    slots = torch.tensor([-1 if t % 3 == 2 else 2 * t + 1 for t in range(tokens)])
    caches = [torch.full((tokens, 2, kv_heads, head_dim), 0.25, dtype=dtype) for _ in range(4)]
    expected = [*rope_and_store_kvcache_reference(qkv, cos, signed_sin, caches[2], caches[3], slots, heads,
                                                  kv_heads, head_dim), caches[2], caches[3]]
    on_device = [t.to(device) for t in (qkv, cos, signed_sin, caches[0], caches[1], slots)]
    with nan_filled_empty():
        got = [*rope_and_store_kvcache(*on_device, heads, kv_heads, head_dim), on_device[3], on_device[4]]
    errors = [((g.cpu().float() - e.float()).abs() / (1 + e.float().abs())).max().item()
              for g, e in zip(got, expected, strict=True)]
    return max(errors) if all(bool(torch.isfinite(g).all()) for g in got) else float("inf")


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return interpreted_report(__file__)


@pytest.mark.parametrize("name", list(CASES) + list(SILU_CASES) + list(ROPE_CASES))
def test_the_interpreted_kernels_match_their_references(interpreted_errors: dict[str, float], name: str) -> None:
    assert interpreted_errors[name] < 1e-5


def test_the_reference_is_the_models_rms_norm_after_the_add() -> None:
    from engines.models.llama import RMSNorm
    from kernels.rms_norm import rms_norm_reference

    norm = RMSNorm(8, 1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 8)
    x, residual = torch.randn(2, 8), torch.randn(2, 8)
    out, summed = rms_norm_reference(x, norm.weight.data, 1e-6, residual)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(out, norm(residual + x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("rows", "hidden", "with_residual"), [(1, 896, True), (7, 1536, True), (64, 1536, False)])
def test_cuda_rms_norm_matches_reference(rows: int, hidden: int, with_residual: bool) -> None:
    # bfloat16: one rounding step of an output near 4 is 2^-5
    assert error(rows, hidden, with_residual, torch.bfloat16, "cuda") < 4e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("rows", "width"), [(1, 4864), (16, 8960)])
def test_cuda_silu_and_mul_matches_reference(rows: int, width: int) -> None:
    assert silu_error(rows, width, torch.bfloat16, "cuda") < 2e-2  # a few bfloat16 steps (2^-8 relative)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 14, 2, 64), (33, 12, 2, 128)])  # the demo tiers' attention heads
def test_cuda_rope_and_store_match_reference(shape: tuple[int, int, int, int]) -> None:
    assert rope_error(*shape, torch.bfloat16, "cuda") < 2e-2


def test_the_rope_reference_is_the_models_rotation() -> None:
    from engines.models.llama import apply_rope, rope_cos_sin
    from kernels.rope import rope_and_store_kvcache_reference

    cos, signed_sin = rope_cos_sin(8, 16, 10000.0)
    positions = torch.tensor([0, 5, 11])
    qkv = torch.randn(3, (2 + 2) * 8)
    caches = [torch.zeros(4, 4, 1, 8) for _ in range(2)]
    q, k, v = rope_and_store_kvcache_reference(qkv, cos[positions], signed_sin[positions], *caches,
                                               torch.tensor([0, 1, 2]), 2, 1, 8)
    rotated = apply_rope(qkv[:, :24].reshape(3, 3, 8), cos[positions].unsqueeze(1),
                         signed_sin[positions].unsqueeze(1))
    assert torch.equal(q, rotated[:, :2]) and torch.equal(k, rotated[:, 2:])
    assert torch.equal(v, qkv[:, 24:].view(3, 1, 8)) and torch.equal(caches[1].view(-1, 1, 8)[:3], v)


if __name__ == "__main__":
    # The subprocess side of the fixture: TRITON_INTERPRET=1 is already in the environment.
    report_when_run(lambda: {**{name: error(*case) for name, case in CASES.items()},
                             **{name: silu_error(*case) for name, case in SILU_CASES.items()},
                             **{name: rope_error(*case) for name, case in ROPE_CASES.items()}})
