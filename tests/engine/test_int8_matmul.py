"""Int8 weight-only matmul: the PyTorch reference against a dequantised float32 matmul, and the Triton kernel
(run by Triton's CPU interpreter on tiny grids, natively where CUDA is available) against the reference.

`@triton.jit` reads TRITON_INTERPRET at import time, so the interpreted cases run in one subprocess with
that variable set; this test process never sees it, and launches a Triton kernel only on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from tests.engine.interpreted import interpreted_report, report_when_run

SMALL_BLOCKS = (16, 16, 16)  # N=40, K=72 leave partial N and K blocks; M=17 a partial M block


class Case(NamedTuple):
    M: int
    N: int
    K: int
    dtype: torch.dtype  # x's
    bias_dtype: torch.dtype | None
    blocks: tuple[int, int, int] | None = SMALL_BLOCKS  # None: the launcher's own rule
    column_major_x: bool = False


def operands(case: Case, device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x, weight int8, scales float32, bias or None), drawn on CPU (the same numbers on every device)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(case.M, case.K, generator=generator).to(case.dtype)
    if case.column_major_x:
        x = x.t().contiguous().t()
    weight = torch.randint(-128, 128, (case.N, case.K), generator=generator, dtype=torch.int8)
    scales = torch.rand(case.N, generator=generator) * 0.02 + 0.001
    bias = None if case.bias_dtype is None else torch.randn(case.N, generator=generator).to(case.bias_dtype)
    return tuple(t if t is None else t.to(device) for t in (x, weight, scales, bias))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected| (NaN where `actual` holds NaN, e.g. an unwritten element)."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-30)).item()


TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}

INTERPRETED_CASES = {
    "float32_m1_bias": Case(1, 40, 72, torch.float32, torch.float32),
    "float32_m5": Case(5, 40, 72, torch.float32, None),
    "float32_m17_bias": Case(17, 40, 72, torch.float32, torch.float32),
    "float32_column_major_x": Case(5, 40, 72, torch.float32, None, column_major_x=True),
    "bfloat16_m1": Case(1, 40, 72, torch.bfloat16, None),
    "bfloat16_m5_bias": Case(5, 40, 72, torch.bfloat16, torch.bfloat16),
    "bfloat16_m17_float32_bias": Case(17, 40, 72, torch.bfloat16, torch.float32),
    "float16_m5_bias": Case(5, 40, 72, torch.float16, torch.float16),
    # the launcher's block rule as a GPU would run it: (16, 16, 128), (128, 16, 64), (64, 16, 32)
    "bfloat16_default_blocks_decode": Case(3, 40, 72, torch.bfloat16, torch.bfloat16, blocks=None),
    "bfloat16_default_blocks_prefill": Case(70, 40, 72, torch.bfloat16, None, blocks=None),
    "float32_default_blocks_prefill": Case(70, 24, 40, torch.float32, torch.float32, blocks=None),
}


def test_reference_equals_dequantised_float32_matmul() -> None:
    from kernels.int8_matmul import int8_weight_only_matmul_reference

    for name, case in INTERPRETED_CASES.items():
        x, weight, scales, bias = operands(case)
        dequantised = weight.float() * scales[:, None]
        expected = x.float() @ dequantised.t() + (0 if bias is None else bias.float())
        reference = int8_weight_only_matmul_reference(x, weight, scales, bias)
        assert reference.dtype == case.dtype and reference.shape == (case.M, case.N), name
        tolerance = 1e-5 if case.dtype == torch.float32 else TOLERANCES[case.dtype]
        assert relative_error(reference, expected) < tolerance, name


# -- Triton kernel, interpreted ------------------------------------------------------------------------


def _interpreted_case(case: Case) -> float:
    from kernels.int8_matmul import int8_weight_only_matmul, int8_weight_only_matmul_reference

    x, weight, scales, bias = operands(case)
    out = torch.full((case.M, case.N), float("nan"), dtype=case.dtype)  # an unwritten element stays NaN
    block_m, block_n, block_k = case.blocks or (None, None, None)
    result = int8_weight_only_matmul(
        x, weight, scales, bias, out=out, block_m=block_m, block_n=block_n, block_k=block_k
    )
    assert result is out
    return relative_error(out, int8_weight_only_matmul_reference(x, weight, scales, bias))


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    """Relative max error of each Triton case vs the reference, computed in a TRITON_INTERPRET=1 subprocess."""
    return interpreted_report(__file__)


@pytest.mark.parametrize("name", list(INTERPRETED_CASES))
def test_triton_int8_matmul_matches_reference(interpreted_errors: dict[str, float], name: str) -> None:
    # NaN (an element the kernel never wrote) fails this comparison too
    assert interpreted_errors[name] < TOLERANCES[INTERPRETED_CASES[name].dtype]


def test_block_rule() -> None:
    from kernels.int8_matmul import choose_blocks

    assert choose_blocks(1, 151936, torch.bfloat16) == (16, 64, 128, 4)  # the LM head: plenty of N blocks
    assert choose_blocks(1, 896, torch.bfloat16) == (16, 16, 128, 4)  # 56 programs rather than 14
    assert choose_blocks(1, 9728, torch.bfloat16)[1] == 32
    assert choose_blocks(17, 9728, torch.bfloat16)[0] == 32  # one M block for every decode row
    assert choose_blocks(4096, 9728, torch.bfloat16) == (128, 128, 64, 8)
    assert choose_blocks(4096, 9728, torch.float32) == (64, 64, 32, 4)
    for M in (1, 16, 33, 64, 65, 512, 8192):
        for N in (1, 40, 896, 151936):
            for dtype in (torch.bfloat16, torch.float32):
                blocks = choose_blocks(M, N, dtype)[:3]
                assert all(b >= 16 and b & (b - 1) == 0 for b in blocks), (M, N, dtype, blocks)  # tl.dot's minimum


def test_launcher_rejects_bad_operands() -> None:
    from kernels.int8_matmul import int8_weight_only_matmul

    x, weight, scales = torch.randn(2, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8)
    bad_calls = {
        "x must be": (x.to(torch.float64), weight, scales, None),
        "weight must be \\[N, 32\\] int8": (x, weight.float(), scales, None),
        "weight must be \\[N, 32\\]": (x, torch.zeros(8, 16, dtype=torch.int8), scales, None),
        "weight must be contiguous": (x, torch.zeros(32, 8, dtype=torch.int8).t(), scales, None),
        "scales must be": (x, weight, scales.half(), None),
        "scales must be contiguous \\[8\\]": (x, weight, torch.ones(4), None),
        "bias must be": (x, weight, scales, torch.ones(7)),
    }
    for message, arguments in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            int8_weight_only_matmul(*arguments)
    with pytest.raises(ValueError, match="out must be"):
        int8_weight_only_matmul(x, weight, scales, out=torch.empty(2, 8, dtype=torch.bfloat16))


# -- Triton kernel, natively on CUDA ------------------------------------------------------------------------

CUDA_CASES = [
    Case(M, N, K, dtype, bias_dtype, blocks=None)
    for M in (1, 16)
    for N, K in ((896, 896), (151936, 896), (9728, 1536))
    for dtype, bias_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, None), (torch.float32, torch.float32))
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: f"M{c.M}-N{c.N}-K{c.K}-{c.dtype}-bias{c.bias_dtype}")
def test_cuda_matches_reference(case: Case) -> None:
    from kernels.int8_matmul import int8_weight_only_matmul, int8_weight_only_matmul_reference

    x, weight, scales, bias = operands(case, device="cuda")
    out = torch.full((case.M, case.N), float("nan"), dtype=case.dtype, device="cuda")
    int8_weight_only_matmul(x, weight, scales, bias, out=out)
    assert relative_error(out, int8_weight_only_matmul_reference(x, weight, scales, bias)) < TOLERANCES[case.dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay() -> None:
    from kernels.int8_matmul import int8_weight_only_matmul, int8_weight_only_matmul_reference

    x, weight, scales, bias = operands(Case(4, 9728, 1536, torch.bfloat16, torch.bfloat16), device="cuda")
    out = torch.empty(4, 9728, dtype=torch.bfloat16, device="cuda")
    int8_weight_only_matmul(x, weight, scales, bias, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int8_weight_only_matmul(x, weight, scales, bias, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, int8_weight_only_matmul_reference(x, weight, scales, bias)) < 2e-2


if __name__ == "__main__":
    # The subprocess side of the fixture: TRITON_INTERPRET=1 is already in the environment.
    report_when_run(lambda: {name: _interpreted_case(case) for name, case in INTERPRETED_CASES.items()})
