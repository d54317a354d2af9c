"""``treeserve::int8_linear`` (``int8_op``): the rigorous error bound against float64, row
independence, the no-saturation guarantee at the worst-case codes, bad input; ``PackedLinear``'s
choice of it (``use_int8``)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._isa_builds import NO_AVX512, build_variant, skip_without_avx512

from treeserve._cpp import cpu_flags
from treeserve.models.int8_op import (
    BLOCK,
    W_MAX,
    Int8Weight,
    int8_available,
    int8_linear,
    int8_swiglu_linear,
    mixer,
    rotate,
    x_max,
)
from treeserve.models.quant import PackedLinear, quantize_int8, use_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="oneDNN int8 linear unavailable in this torch build")


def inverse_rotate(t: torch.Tensor) -> torch.Tensor:
    """``t R^T`` (``R`` orthogonal: Hadamard blocks / 8, symmetric, then the block mixer)."""
    nb = t.shape[-1] // BLOCK
    blocks = mixer(nb).t() @ t.reshape(*t.shape[:-1], nb, BLOCK)
    return rotate_blocks_only(blocks).reshape(t.shape)


def rotate_blocks_only(blocks: torch.Tensor) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return blocks @ (h / 8.0)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The module's per-output error bound ``0.5 s_m |W^_n|_1 + 0.5 scale_n |(x R)_m|_1`` (float64),
    with float32 slack: ``W^`` is the rounded rotated weight."""
    wr = rotate(w).double()
    scale = wr.abs().amax(1) / W_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    w_hat = torch.round(wr / scale[:, None]).clamp(-W_MAX, W_MAX) * scale[:, None]
    xr = rotate(x).double()
    s = xr.abs().amax(1, keepdim=True) / x_max()
    b = 0.5 * s * w_hat.abs().sum(1) + 0.5 * scale * xr.abs().sum(1, keepdim=True)
    return b * 1.001 + 1e-5 * (xr.abs() @ w_hat.abs().t())


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 70),
    blocks=st.integers(1, 4),
    outliers=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_within_bound_of_float64(m: int, n: int, blocks: int, outliers: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = blocks * BLOCK
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randint(0, k, (outliers,), generator=gen)] *= 50.0  # LLM-like outlier channels
    w = torch.randn(n, k, generator=gen) * 0.05
    y = int8_linear(x, Int8Weight.from_dense(w))
    ref = x.double() @ w.double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert bool(((y.double() - ref).abs() <= bound(x, w)).all())


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 50), blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_swiglu_within_bound_of_float64(m: int, n: int, blocks: int, seed: int) -> None:
    """``int8_swiglu_linear([gate | up])`` is the int8 product of ``silu(gate) * up`` (float64 here; the
    operator's exp is a few ulp off, far inside the bound), with gates deep in both tails."""
    gen = torch.Generator().manual_seed(seed)
    k = blocks * BLOCK
    gate_up = torch.randn(m, 2 * k, generator=gen) * 4.0
    gate_up[:, 0] = torch.linspace(-120.0, 120.0, m)  # exp under- and overflow territory
    w = torch.randn(n, k, generator=gen) * 0.05
    act = torch.nn.functional.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    y = int8_swiglu_linear(gate_up, Int8Weight.from_dense(w))
    assert y.shape == (m, n) and y.dtype == torch.float32 and bool(y.isfinite().all())
    assert bool(((y.double() - act @ w.double().t()).abs() <= bound(act.float(), w)).all())


@pytest.mark.slow
def test_avx2_build_matches_the_native_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The operator's source built without AVX-512 (``-mno-avx512f``: the code AVX2-only hosts such as the
    Zen 3 EPYC run; its activation width set to the native build's, which oneDNN's product here allows):
    ``int8_linear`` bit for bit the native build's outputs on an AVX-512 host (the
    rotation's butterflies in the same order per element, then the same oneDNN product); its SwiGLU,
    whose 16-lane exp loop is AVX-512 only (the scalar ``std::exp`` loop there), within the same bound
    of float64 as the native one. Skipped on hosts without AVX-512, whose native build it is."""
    from treeserve.models.int8_op import SOURCE

    skip_without_avx512()
    width = [f"-DTREESERVE_INT8_VNNI_CODES={int(x_max() == 127)}"]
    avx2 = build_variant(SOURCE, "treeserve_int8_avx2", NO_AVX512 + width, tmp_path)
    assert avx2.int8_activation_max() == x_max()
    gen = torch.Generator().manual_seed(3)
    for m, blocks in ((1, 1), (5, 3), (17, 2), (40, 4)):
        k = blocks * BLOCK
        dense = torch.randn(23, k, generator=gen) * 0.05
        w = Int8Weight.from_dense(dense)
        x = torch.randn(m, k, generator=gen)
        x[:, 3] *= 50.0
        assert torch.equal(avx2.int8_linear(x, *w.operands), int8_linear(x, w))
        gate_up = torch.randn(m, 2 * k, generator=gen) * 4.0
        gate_up[:, 0] = torch.linspace(-120.0, 120.0, m)
        act = torch.nn.functional.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
        y = avx2.int8_swiglu_linear(gate_up, *w.operands)
        assert bool(y.isfinite().all())
        assert bool(((y.double() - act @ dense.double().t()).abs() <= bound(act.float(), dense)).all())


def test_swiglu_forward_routes_like_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PackedLinear.swiglu_forward``: the fused int8 operator where ``forward`` would take the int8
    GEMM (above ``packed_max_rows``), else exactly ``forward(silu(gate) * up)``; bad input named."""
    monkeypatch.setenv("TREESERVE_INT8", "1")
    layers = _packed_layers(BLOCK)
    assert use_int8(layers)
    m = layers[0]
    gate_up = torch.randn(5, 2 * BLOCK)
    assert torch.equal(m.swiglu_forward(gate_up), int8_swiglu_linear(gate_up, m.int8))
    small = gate_up[:2]
    act = torch.nn.functional.silu(small[:, :BLOCK]) * small[:, BLOCK:]
    assert torch.equal(m.swiglu_forward(small), m(act))
    torch.testing.assert_close(m.swiglu_forward(gate_up), m(torch.nn.functional.silu(gate_up[:, :BLOCK]) *
                                                               gate_up[:, BLOCK:]), rtol=0.05, atol=0.05)
    with pytest.raises(TypeError, match="gate_up must be a float32"):
        int8_swiglu_linear(gate_up.double(), m.int8)
    with pytest.raises(ValueError, match=r"gate_up must have shape \[M, 128\]"):
        int8_swiglu_linear(gate_up[:, :BLOCK], m.int8)
    w = m.int8
    with pytest.raises(ValueError, match="gate_up must have an even number of columns"):
        torch.ops.treeserve.int8_swiglu_linear(torch.randn(2, 3), w.packed, w.scales, w.zeros, w.mix)


def test_rows_are_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2 * BLOCK, generator=gen)
    w = Int8Weight.from_dense(torch.randn(96, 2 * BLOCK, generator=gen))
    full = int8_linear(x, w)
    for i in (0, 5, 36):
        assert torch.equal(int8_linear(x[i : i + 1], w)[0], full[i])
    assert torch.equal(int8_linear(x[3:20], w), full[3:20])


def test_activation_width_follows_the_host() -> None:
    """8-bit activation codes (127) where the host has VNNI and oneDNN is not capped below it, else 7
    bits (63): the width this CPU should take, whatever the CPU the suite runs on."""
    flags = cpu_flags().split()
    vnni = "avx512_vnni" in flags or "avx_vnni" in flags
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    allowed = not cap or any(name in cap for name in ("VNNI", "BF16", "FP16", "AMX", "AVX10", "ALL", "DEFAULT"))
    assert x_max() == (127 if vnni and allowed else 63)


def test_worst_case_codes_do_not_saturate() -> None:
    """Every activation code +x_max() against every weight code +127 (and sign-flipped rows): the
    products reach their maximum (with 7-bit codes, the pairs a non-VNNI int8 multiply adds in int16;
    with 8 bits, VNNI's u8 x s8 products, which a non-VNNI kernel would saturate); the result must
    still be exact (x R = t and W R = t give x W^T = t t^T)."""
    k = 4 * BLOCK
    t = torch.ones(4, k)
    t[1] = -1.0
    t[2, ::2] = -1.0
    t[3, ::3] = -1.0
    x, w = inverse_rotate(t), inverse_rotate(t)
    y = int8_linear(x, Int8Weight.from_dense(w)).double()
    torch.testing.assert_close(y, t.double() @ t.double().t(), rtol=1e-4, atol=1e-3)


def test_zero_rows_and_empty_batch() -> None:
    w = Int8Weight.from_dense(torch.randn(8, BLOCK))
    assert torch.equal(int8_linear(torch.zeros(3, BLOCK), w), torch.zeros(3, 8))
    assert int8_linear(torch.zeros(0, BLOCK), w).shape == (0, 8)
    zero_w = Int8Weight.from_dense(torch.zeros(5, BLOCK))
    assert torch.equal(int8_linear(torch.randn(2, BLOCK), zero_w), torch.zeros(2, 5))


def test_bad_input_is_named() -> None:
    w = Int8Weight.from_dense(torch.randn(8, BLOCK))
    with pytest.raises(TypeError, match="x must be a float32"):
        int8_linear(torch.randn(2, BLOCK, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"x must have shape \[M, 64\]"):
        int8_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="multiple of 64 columns"):
        Int8Weight.from_dense(torch.randn(8, 96))
    with pytest.raises(TypeError, match="weight must be a floating tensor"):
        Int8Weight.from_dense(torch.ones(8, BLOCK, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 64 columns"):
        torch.ops.treeserve.int8_linear(torch.randn(2, 32), w.packed, w.scales, w.zeros, w.mix)
    with pytest.raises(ValueError, match=r"mix must be a contiguous float32 \[K/64, K/64\]"):
        torch.ops.treeserve.int8_linear(torch.randn(2, BLOCK), w.packed, w.scales, w.zeros, torch.eye(2))


def _packed_layers(k: int, n: int = 3) -> list[PackedLinear]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        codes = quantize_int8(torch.randn(48, k, generator=gen))
        out.append(PackedLinear(codes, codes.dequantize(), None, torch.bfloat16, packed_max_rows=2))
    return out


def test_use_int8_routes_large_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = _packed_layers(BLOCK)
    monkeypatch.setenv("TREESERVE_INT8", "1")
    assert use_int8(layers)
    m = layers[0]
    x = torch.randn(5, BLOCK)
    assert torch.equal(m(x), int8_linear(x, m.int8))  # 5 rows > packed_max_rows: int8
    assert torch.equal(m(x[:2]), m.packed_forward(x[:2]))  # 2 rows: packed codes
    monkeypatch.setenv("TREESERVE_INT8", "0")
    fresh = _packed_layers(BLOCK)
    assert not use_int8(fresh) and fresh[0].int8 is None
    assert torch.equal(fresh[0](x), torch.nn.functional.linear(x, fresh[0].weight))


def test_use_int8_declines_other_widths_and_bad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREESERVE_INT8", "1")
    assert not use_int8(_packed_layers(96))  # not a multiple of the rotation block
    monkeypatch.setenv("TREESERVE_INT8", "yes")
    with pytest.raises(ValueError, match="TREESERVE_INT8 must be '0' or '1'"):
        use_int8(_packed_layers(BLOCK))
