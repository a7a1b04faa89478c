"""Unquantised float linears on a CPU run through oneDNN with their weights packed once: the same products as
`F.linear` to float32 rounding, a row's result independent of its batch, and a tied head left sharing the
embedding table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines.quantization import OneDnnLinear, onednn_available
from engines.speculative import weight_bytes
from tests.engine.conftest import TinyModel, make_engine

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.mark.parametrize("packed", [True, False])
def test_a_onednn_linear_computes_what_f_linear_computes(packed: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=True)
    layer = OneDnnLinear.from_linear(linear, packed=packed)
    assert layer.weight.is_mkldnn == packed
    for shape in [(1, 96), (37, 96), (2, 5, 96)]:
        x = torch.randn(shape)
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_rows_result_is_the_same_bits_alone_or_in_any_batch() -> None:
    # Decode rows, prefill chunks and speculative verification rows see one product per row.
    torch.manual_seed(0)
    layer = OneDnnLinear.from_linear(nn.Linear(256, 512, bias=False))
    rows = torch.randn(300, 256)
    alone = layer(rows[:1])
    for batch in (2, 7, 32, 64, 300):
        assert torch.equal(layer(rows[:batch])[:1], alone), batch


def test_a_float32_engine_packs_its_linears_and_leaves_a_tied_head_on_the_embedding(tiny_qwen2: TinyModel) -> None:
    engine = make_engine(tiny_qwen2)
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, OneDnnLinear)]
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(m.packed for m in linears) == len(linears) - 1  # every body linear
    head = model.lm_head
    assert isinstance(head, OneDnnLinear) and not head.packed
    assert head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # no second copy of the table
    # Weight bytes count the packed (opaque) tensors and the shared table once: what HF's tied model holds.
    assert weight_bytes(model) == sum(p.numel() * p.element_size() for p in tiny_qwen2.hf_model.parameters())
