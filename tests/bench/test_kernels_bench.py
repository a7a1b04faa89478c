"""`python -m bench.kernels`' prefill attention table times the two paths on the same work; its block-order table
lays the same blocks out in the orders it names."""

from __future__ import annotations

import pytest
import torch

from bench.kernels import block_tables, prefill_step
from engines.cpu_kernels import paged_decode_attention


@pytest.mark.parametrize(("chunk", "cached"), [(37, 0), (21, 50)])
def test_the_prefill_attention_bench_compares_the_kernel_and_sdpa_on_the_same_attention(chunk: int, cached: int
                                                                                        ) -> None:  # fmt: skip
    kernel = paged_decode_attention()
    if kernel is None or kernel.isa not in ("avx512bf16", "amx"):
        pytest.skip("the kernel reads bfloat16 without bfloat16 dot products on this CPU: the table is not printed")
    outputs = []
    for through_kernel in (True, False):
        torch.manual_seed(0)  # the same cache, keys, values and queries for both paths
        attend, query = prefill_step(chunk, cached, (14, 2, 64), kernel=through_kernel)
        outputs.append(attend(query))
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)  # bfloat16 on both sides


def test_the_block_order_table_holds_each_sequence_in_the_order_it_names() -> None:
    torch.manual_seed(0)
    adjacent, backward, scattered = (block_tables(order, 3, 5, 100) for order in ("adjacent", "backward runs",
                                                                                  "scattered"))  # fmt: skip
    steps = {name: (table[:, 1:] - table[:, :-1]).unique().tolist()
             for name, table in (("adjacent", adjacent), ("backward", backward))}  # fmt: skip
    assert steps == {"adjacent": [1], "backward": [-1]}
    assert sorted(adjacent.flatten().tolist()) == sorted(backward.flatten().tolist()) == list(range(15))
    assert scattered.unique().numel() == 15 and scattered.max() < 100  # distinct blocks out of the whole cache
