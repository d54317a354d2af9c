"""Issue 15: the fused residual-add + RMSNorm operator (``treeserve.models._norm_op``) against
the float64 formula and torch's add + ``F.rms_norm``; bad inputs; the model's norm uses it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treeserve.models._norm_op import add_rms_norm, add_rms_norm_torch, load_norm_op
from treeserve.models.llama import RMSNorm

pytestmark = pytest.mark.skipif(load_norm_op() is not None, reason="no C++ compiler: the torch path is used")


@st.composite
def norm_case(draw: st.DrawFn):
    shape = draw(st.sampled_from([(1, 8), (3, 7), (64, 64), (2, 3, 579), (0, 16), (5, 1)]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    residual = (torch.randn(shape, generator=gen) * scale).to(dtype) if draw(st.booleans()) else None
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    return x, residual, weight, eps


@given(case=norm_case())
def test_add_rms_norm_matches_float64_formula_and_torch(case) -> None:
    x, residual, weight, eps = case
    s, y = add_rms_norm(x, residual, weight, eps)
    want_s, want_y = add_rms_norm_torch(x, residual, weight, eps)
    assert s.dtype == y.dtype == x.dtype and s.shape == y.shape == x.shape
    assert torch.equal(s, want_s)  # the sum is torch's add, bit for bit
    sd = s.double()
    ref = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    else:  # one bfloat16 rounding, as F.rms_norm: within half a bf16 step of the formula
        step = 2.0**-8
        torch.testing.assert_close(y.double(), ref, rtol=step * 1.01, atol=1e-6)
        torch.testing.assert_close(y.float(), want_y.float(), rtol=2 * step * 1.01, atol=1e-6)


def test_rmsnorm_module_uses_the_operator_and_matches_torch() -> None:
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x, r = torch.randn(64, 576), torch.randn(64, 576)
    s, y = norm.add(x, r)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (576,), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (576,), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)


def test_other_dtypes_take_the_torch_path() -> None:
    x, w = torch.randn(4, 16, dtype=torch.float64), torch.rand(16, dtype=torch.float64)
    s, y = add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(y, torch.nn.functional.rms_norm(x + x, (16,), w, 1e-6)) and torch.equal(s, x + x)


@pytest.mark.parametrize(
    ("x", "residual", "weight", "message"),
    [
        (torch.zeros(2, 8), None, torch.zeros(7), "same D"),
        (torch.zeros(2, 8), None, torch.zeros(8, dtype=torch.bfloat16), "share a dtype"),
        (torch.zeros(2, 8), torch.zeros(2, 7), torch.zeros(8), "residual must match"),
        (torch.zeros(2, 8, dtype=torch.float16), None, torch.zeros(8, dtype=torch.float16), "float32 and bfloat16"),
    ],
)
def test_bad_input_is_refused(x, residual, weight, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.treeserve.add_rms_norm(x, residual, weight, 1e-6)
