"""Batch-invariant projections (``treeserve.models.invariant``): a row's result never depends on
the other rows of its batch, bitwise, for dense and packed projections and the LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.models import random_model, tiny_config
from treeserve.models.invariant import make_batch_invariant, row_tiled
from treeserve.models.quant import PackedLinear, quantize_int4

DTYPES = [torch.float32, torch.bfloat16]


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 40),
    row=st.integers(0, 39),
    tile=st.sampled_from([1, 4, 8, 16]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_row_tiled_linear_rows_do_not_depend_on_the_batch(m: int, row: int, tile: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(m, 64, generator=g).to(dtype)
    row = row % m
    full = row_tiled(lambda t: F.linear(t, w), x, tile)
    alone = row_tiled(lambda t: F.linear(t, w), x[row : row + 1], tile)
    assert full.shape == (m, 96)
    assert torch.equal(full[row], alone[0])
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)


@pytest.mark.parametrize("max_rows", [0, 64])  # dense path for every tile / packed path for every tile
def test_row_tiled_packed_linear_is_batch_invariant(max_rows: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    planes = quantize_int4(w)
    layer = PackedLinear(planes, planes.dequantize(), None, packed_max_rows=max_rows)
    x = torch.randn(21, 128)
    full = row_tiled(layer, x, 8)
    for r in (0, 7, 8, 20):
        assert torch.equal(full[r], row_tiled(layer, x[r : r + 1], 8)[0])


def test_row_tiled_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="tile must be an int >= 1"):
        row_tiled(torch.nn.Identity(), torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        row_tiled(torch.nn.Identity(), torch.zeros(2, 3, 4), 4)
    assert row_tiled(torch.nn.Identity(), torch.zeros(0, 3), 4).shape == (0, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant_model_keeps_its_parameters_and_values(dtype: torch.dtype) -> None:
    model = random_model(tiny_config("llama"), seed=1, dtype=dtype)
    names = [n for n, _ in model.named_parameters()]
    x = torch.randn(5, model.config.hidden_size).to(dtype)
    proj = model.layers[0].mlp.gate_up_proj
    before = proj(x)
    assert make_batch_invariant(model) is make_batch_invariant(model)  # idempotent
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(proj(x), before, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    head = model.lm_head(x.float())
    assert head.dtype == torch.float32 and torch.equal(head[3], model.lm_head(x[3:4].float())[0])
