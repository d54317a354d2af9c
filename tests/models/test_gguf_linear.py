"""The C++ GGUF operator ``treeserve::gguf_linear`` (Q4_0 / Q4_1 / Q8_0 blocks as shipped) and its uses."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests._isa_builds import NO_AVX512, build_variant, skip_without_avx512

from treeserve.models import gguf_op
from treeserve.models.gguf_op import BLOCK_BYTES, GGUFWeight, gguf_linear
from treeserve.models.quant import ExactHead, PackedLinear

QTYPES = sorted(BLOCK_BYTES)
requires_op = pytest.mark.skipif(not gguf_op.gguf_op_available(), reason="no C++ compiler: torch path only")


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random codes with random f16 scales (negative, zero and subnormal-free magnitudes ~1e-2)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = 2 if qtype == "Q4_1" else 1
    scales = (rng.standard_normal((n, k // 32, halves)) * 0.02).astype(np.float16)
    scales[rng.random(scales.shape) < 0.1] = 0
    blocks[..., : 2 * halves] = scales.view(np.uint8)
    return blocks.reshape(-1)


def run_op(x: torch.Tensor, w: GGUFWeight, exact: bool, lib: str = "treeserve") -> torch.Tensor:
    """``treeserve::gguf_linear_exact`` (float32 activations) or ``gguf_linear`` (int16) on ``x``."""
    ns = getattr(torch.ops, lib)
    return (ns.gguf_linear_exact if exact else ns.gguf_linear)(x, w.raw, w.qtype, w.in_features)


def magnitudes(w: GGUFWeight) -> torch.Tensor:
    """|w| per weight in float64, read as |d q| + |m| for Q4_1 (the operator sums d q x and m x apart)."""
    mag = w.raw.clone()
    if w.qtype == "Q4_1":  # clear the f16 sign bits of d and m: dequantizes to |d| q + |m|
        blocks = mag.view(w.shape[0], -1, BLOCK_BYTES[w.qtype])
        blocks[..., 1] &= 0x7F
        blocks[..., 3] &= 0x7F
    return GGUFWeight(w.qtype, mag, w.in_features).dequantize(torch.float64).abs()


def error_bound(x: torch.Tensor, w: GGUFWeight, exact: bool) -> torch.Tensor:
    """Rigorous |y - x @ dequant(w).T| bound ``[M, N]``: float32 summation, K + 2 ulps of sum |x| |w|;
    int16 activations add per 32-block s_b / 2 (s_b = max|x_b| / 32767 in float32; 0.51 covers the
    float rounding of x / s_b) times sum |w| over the block, and the rounded |x| grows by as much."""
    k = x.shape[1]
    xa = x.double().abs()
    rounding = torch.zeros_like(xa)
    if not exact:
        s = (x.abs().reshape(x.shape[0], -1, 32).amax(-1) / 32767).double()  # [M, K/32], as the op (float32)
        rounding = (0.51 * s).repeat_interleave(32, dim=1)
    wmag = magnitudes(w)
    return (rounding + 2 * (k + 2) * 2.0**-24 * (xa + rounding)) @ wmag.T + 1e-30


def block_scaled(m: int, k: int, seed: int, spread: float) -> torch.Tensor:
    """Gaussian x whose 32-blocks are scaled by 10^U(-spread, spread), some set to 0."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** ((torch.rand(m, k // 32, 1, generator=gen) * 2 - 1) * spread)
    scale[torch.rand(m, k // 32, 1, generator=gen) < 0.1] = 0
    return (torch.randn(m, k // 32, 32, generator=gen) * scale).reshape(m, k)


@requires_op
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(QTYPES),
    exact=st.booleans(),
    m=st.integers(1, 11),
    groups=st.integers(1, 80),
    n=st.integers(0, 20).map(lambda i: 2 * i + 1),
    spread=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 2**20),
)
def test_op_within_bound_of_float64_dequantized_gemm(
    qtype: str, exact: bool, m: int, groups: int, n: int, spread: float, seed: int
) -> None:
    """Both activation modes, every row count (register blocks of 1..8 rows and their remainders),
    K across the 64-block scale chunks: within ``error_bound`` of the float64 product."""
    k = 32 * groups
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, seed), (n, k))
    x = block_scaled(m, k, seed, spread)
    ref = x.double() @ w.dequantize(torch.float64).T
    y = run_op(x, w, exact)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert bool(((y.double() - ref).abs() <= error_bound(x, w, exact)).all())


def q8_bound(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """``error_bound``'s form for int8 activations: per 32-block s_b = max|x_b| / 127."""
    s = (x.abs().reshape(x.shape[0], -1, 32).amax(-1) / 127).double()
    rounding = (0.51 * s).repeat_interleave(32, dim=1)
    return (rounding + 2 * (x.shape[1] + 2) * 2.0**-24 * (x.double().abs() + rounding)) @ magnitudes(w).T + 1e-30


@requires_op
@settings(max_examples=40, deadline=None)
@example(qtype="Q4_1", m=150, groups=3, n=6, spread=3.0, seed=1)  # more rows than one pass over the weights
@given(
    qtype=st.sampled_from(QTYPES),
    m=st.integers(1, 40),
    groups=st.integers(1, 80),
    n=st.integers(1, 41),
    spread=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 2**20),
)
def test_q8_op_within_bound_of_float64_dequantized_gemm(qtype: str, m: int, groups: int, n: int, spread: float,
                                                         seed: int) -> None:
    """``treeserve::gguf_linear_q8`` (int8 activations per 32-block): every row count (lane groups of
    8 or 16 rows, their remainders, several groups), weight tiles of 4 rows and the 1-3 left over,
    block counts across the 8-block code chunks."""
    k = 32 * groups
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, seed), (n, k))
    x = block_scaled(m, k, seed, spread)
    ref = x.double() @ w.dequantize(torch.float64).T
    y = torch.ops.treeserve.gguf_linear_q8(x, w.raw, qtype, k)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert bool(((y.double() - ref).abs() <= q8_bound(x, w)).all())


@requires_op
@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(QTYPES), m=st.integers(2, 40), groups=st.integers(1, 20), n=st.integers(1, 11),
       seed=st.integers(0, 2**20))
def test_q8_rows_of_any_call_are_the_rows_alone(qtype: str, m: int, groups: int, n: int, seed: int) -> None:
    """``treeserve::gguf_linear_q8``: each row of a call of any size (lane groups of 8 or 16 rows and
    their zero-padded remainders, several groups, weight tiles of 1-4 rows) is bit for bit the row
    computed alone (one lane group: the tile that decodes codes a block ahead; several: a chunk at a time)."""
    k = 32 * groups
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, seed), (n, k))
    x = block_scaled(m, k, seed, 3.0)
    y = torch.ops.treeserve.gguf_linear_q8(x, w.raw, qtype, k)
    rows = sorted({0, m - 1, seed % m})
    assert torch.equal(y[rows], torch.cat([torch.ops.treeserve.gguf_linear_q8(x[i : i + 1], w.raw, qtype, k)
                                           for i in rows]))


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_q8_extreme_codes_and_activations_do_not_saturate(qtype: str) -> None:
    """The largest products the int8 path can meet: every code at an end of its range (Q4 nibbles 0 /
    15, Q8_0 -128 / 127) against blocks of x rounded to +-127 everywhere, with both signs and mixed.
    Without VNNI the kernel adds byte products in saturating int16 (``vpmaddubsw``); its sums must
    stay exact: a saturated pair would be off by thousands of codes, far past ``q8_bound``. One lane
    group and several."""
    n, k = 6, 32 * 9
    blocks = np.zeros((n, k // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = 2 if qtype == "Q4_1" else 1
    blocks[..., : 2 * halves] = np.full((n, k // 32, halves), 0.03, dtype=np.float16).view(np.uint8)
    code_bytes = blocks[..., 2 * halves :]
    ends = (0x00, 0xFF) if qtype != "Q8_0" else (0x80, 0x7F)  # nibbles 0 / 15; int8 -128 / 127
    code_bytes[0::2] = ends[0]
    code_bytes[1::2] = ends[1]
    code_bytes[4, :, ::2] = ends[0]  # one row mixed within each block
    w = GGUFWeight.from_bytes(qtype, blocks.reshape(-1), (n, k))
    signs = torch.ones(12, k)
    signs[1::3] = -1
    signs[2::3, 1::2] = -1  # rows of alternating signs
    x = signs * torch.linspace(0.5, 4.0, 12)[:, None]  # each block's entries equal in size: codes +-127
    ref = x.double() @ w.dequantize(torch.float64).T
    for m in (1, 3, 12):
        y = torch.ops.treeserve.gguf_linear_q8(x[:m], w.raw, qtype, k)
        assert bool(((y.double() - ref[:m]).abs() <= q8_bound(x[:m], w)).all()), m


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_q8_rounding_is_real_and_non_finite_rows_stay_apart(qtype: str) -> None:
    """The int8 rounding is what the bound says, not a no-op (the result differs from the int16 one
    by more than the int16 bound), zero rows give 0 and a non-finite activation only its own row NaN."""
    n, k = 33, 576
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, 9), (n, k))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9))
    x[1] = 0
    x[2, 100] = float("nan")
    y = torch.ops.treeserve.gguf_linear_q8(x, w.raw, qtype, k)
    y16 = run_op(x, w, False)
    assert bool((y[1] == 0).all()) and bool(y[2].isnan().all()) and bool(y[[0, 3]].isfinite().all())
    assert bool(((y - y16)[[0, 3]].abs().double() > error_bound(x[[0, 3]], w, False)).any())


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_int16_activations_are_far_finer_than_bfloat16(qtype: str) -> None:
    """The int16 bound is not vacuous: on Gaussian activations (a SmolLM2 layer's shape) the bound is
    within 2^-12 of sum |x| |w| and the error at least 16x below that of bfloat16 activations; the
    rounding is real (the result differs from the float32-activation one)."""
    n, k = 64, 576
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, 5), (n, k))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(5))
    wd = w.dequantize(torch.float64)
    ref = x.double() @ wd.T
    y = run_op(x, w, False)
    err = (y.double() - ref).abs().max()
    bf16_err = (x.bfloat16().double() @ wd.T - ref).abs().max()
    assert err * 16 < bf16_err
    assert bool((error_bound(x, w, False) <= 2.0**-12 * (x.double().abs() @ magnitudes(w).T) + 1e-30).all())
    assert not torch.equal(y, run_op(x, w, True))


@requires_op
def test_int16_path_zero_and_non_finite_blocks() -> None:
    """An all-zero x gives exactly 0; a non-finite activation makes its row NaN (as float32 would be
    non-finite), other rows unaffected."""
    n, k = 9, 96
    w = GGUFWeight.from_bytes("Q4_1", random_blocks("Q4_1", n, k, 6), (n, k))
    x = torch.randn(3, k)
    x[0] = 0
    x[1, 40] = float("inf")
    y = run_op(x, w, False)
    assert bool((y[0] == 0).all()) and bool(y[1].isnan().all()) and bool(y[2].isfinite().all())


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_gguf_reference_bit_exactly(qtype: str) -> None:
    """Both dequantizations, the C++ operator's (``GGUFWeight.dequantize`` where it is built: rows
    split across threads) and the torch one (``dequantize_blocks``), are ``gguf.quants``' values bit
    for bit (Q4_1's product then sum: no fused multiply-add)."""
    n, k = 301, 96
    raw = random_blocks(qtype, n, k, seed=1)
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32)
    w = GGUFWeight.from_bytes(qtype, raw, (n, k))
    np.testing.assert_array_equal(gguf_op.dequantize_blocks(qtype, w.raw, k).numpy(), ref)
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)
    np.testing.assert_array_equal(w.dequantize(torch.bfloat16).float().numpy(), torch.from_numpy(ref).bfloat16().float().numpy())
    if gguf_op.gguf_op_available():
        np.testing.assert_array_equal(torch.ops.treeserve.gguf_dequantize(w.raw, qtype, k).numpy(), ref)


@requires_op
def test_dequantize_op_bad_inputs() -> None:
    raw = torch.from_numpy(random_blocks("Q4_0", 2, 64, seed=0)).reshape(2, -1)
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.treeserve.gguf_dequantize(raw, "Q5_K", 64)
    with pytest.raises(RuntimeError, match="K must be"):
        torch.ops.treeserve.gguf_dequantize(raw, "Q4_0", 48)
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.treeserve.gguf_dequantize(raw, "Q4_1", 64)


def test_bad_inputs_name_the_field() -> None:
    raw = random_blocks("Q4_1", 2, 64, seed=0)
    with pytest.raises(ValueError, match="qtype"):
        GGUFWeight.from_bytes("Q5_K", raw, (2, 64))
    with pytest.raises(ValueError, match="K"):
        GGUFWeight.from_bytes("Q4_1", raw, (2, 48))
    with pytest.raises(ValueError, match="raw: Q4_1 weight of shape"):
        GGUFWeight.from_bytes("Q4_1", raw, (3, 64))
    with pytest.raises(TypeError, match="raw must hold uint8"):
        GGUFWeight.from_bytes("Q4_1", torch.zeros(80, dtype=torch.int32), (2, 64))
    w = GGUFWeight.from_bytes("Q4_1", raw, (2, 64))
    with pytest.raises(TypeError, match="x must be a float32"):
        gguf_linear(torch.zeros(1, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"x must have shape \[M, 64\]"):
        gguf_linear(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match="packed must have"):
        ExactHead(torch.nn.Parameter(torch.zeros(3, 64)), packed=w)


@requires_op
def test_op_rejects_bad_tensors() -> None:
    w = GGUFWeight.from_bytes("Q8_0", random_blocks("Q8_0", 2, 64, 0), (2, 64))
    with pytest.raises(RuntimeError, match="qtype must be"):
        torch.ops.treeserve.gguf_linear(torch.zeros(1, 64), w.raw, "Q2_K", 64)
    with pytest.raises(RuntimeError, match="qtype must be"):
        torch.ops.treeserve.gguf_linear_exact(torch.zeros(1, 64), w.raw, "Q2_K", 64)
    with pytest.raises(RuntimeError, match="w must be uint8"):
        torch.ops.treeserve.gguf_linear(torch.zeros(1, 64), w.raw, "Q4_0", 64)


def test_fallback_without_the_op_is_the_dense_product(monkeypatch) -> None:
    """A host that cannot build the operator: ``gguf_linear`` and ``PackedLinear`` serve through torch."""
    monkeypatch.setattr(gguf_op, "load_gguf_linear_op", lambda: "no compiler")
    n, k = 5, 64
    w = GGUFWeight.from_bytes("Q4_0", random_blocks("Q4_0", n, k, 3), (n, k))
    x = torch.randn(2, k)
    torch.testing.assert_close(gguf_linear(x, w), F.linear(x, w.dequantize()), rtol=0, atol=0)
    layer = PackedLinear(w, w.dequantize(), None, packed_max_rows=8)
    assert not layer.use_op
    torch.testing.assert_close(layer(x), F.linear(x, w.dequantize()), rtol=0, atol=0)
    head = ExactHead(torch.nn.Parameter(w.dequantize(), requires_grad=False), packed=w)
    assert head.qtype is None and head.packed_max_rows == 0


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_linear_takes_the_op_for_small_batches(qtype: str) -> None:
    n, k = 33, 128
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, 4), (n, k))
    bias = torch.randn(n)
    layer = PackedLinear(w, w.dequantize(), bias, packed_max_rows=4)
    assert layer.use_op and not hasattr(layer, "packed")  # no int4 copy of the weight
    x = torch.randn(4, k)
    expected = run_op(x, w, False) + bias  # int16 activations
    assert torch.equal(layer(x), expected)
    ref = x.double() @ w.dequantize(torch.float64).T + bias.double()
    assert bool(((layer(x).double() - ref).abs() <= error_bound(x, w, False) + 2.0**-22 * bias.abs()).all())


@requires_op
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**20), margin=st.sampled_from([0.0, 1e-6, 1e-4]))
def test_packed_head_greedy_equals_float32_head_on_near_ties(seed: int, margin: float) -> None:
    """Q8_0 head through the operator: rows whose two best logits differ by ~margin still pick the
    float32 head's token (or, at margin 0, a token float32 rounding cannot order against it)."""
    v, k, m = 257, 64, 3
    gen = torch.Generator().manual_seed(seed)
    w = GGUFWeight.from_bytes("Q8_0", random_blocks("Q8_0", v, k, seed), (v, k))
    dense = w.dequantize()
    x = torch.randn(m, k, generator=gen)
    f32 = F.linear(x, dense)
    top2 = f32.topk(2, dim=1).indices
    for r in range(m):  # runner-up := best entry with code 0 moved by one step: logits differ by d * x[r, 0]
        a, b = top2[r]
        w.raw[a, :2] = torch.tensor(np.array([0.01], np.float16).view(np.uint8))
        w.raw[b] = w.raw[a]
        q = int(w.raw[a, 2].view(torch.int8))
        w.raw[b, 2] = (q + 1 if q < 127 else q - 1) & 255
        x[r, 0] = margin / 0.01
    dense = w.dequantize()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREESERVE_HEAD_PACKED_MAX_ROWS", "8")
        head = ExactHead(torch.nn.Parameter(dense, requires_grad=False), packed=w)
    assert head.packed_max_rows == 8 and m <= 8  # every row takes the packed pass
    assert head.int16  # Q8_0: x rounded to int16 codes
    logits = head(x)
    ref, noise = check_greedy_pick(logits, x, dense, margin)
    bound = head.packed_pass_factor * x.norm(dim=1, keepdim=True) * head.row_norms  # the other logits: the first pass's
    assert bool(((logits - ref).abs() <= bound + noise[:, None]).all())
    assert not torch.equal(logits, ref)  # the int16 pass's rounding is real: only the contenders are re-scored


def check_greedy_pick(logits: torch.Tensor, x: torch.Tensor, dense: torch.Tensor,
                      margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Assert that each row's pick in ``logits`` is the float32 head's (``x @ dense.T``), or at margin
    below 1e-4 a token float32 rounding cannot order against it; return the float32 logits and
    that rounding noise per row."""
    ref = F.linear(x, dense)
    best = logits.argmax(1)
    noise = x.shape[1] * 2.0**-24 * (x.abs() @ dense.abs().T).amax(1)
    assert bool((ref.gather(1, best[:, None])[:, 0] >= ref.amax(1) - noise).all())
    if margin >= 1e-4:
        assert torch.equal(best, ref.argmax(1))
    return ref, noise


@requires_op
@pytest.mark.slow
def test_scalar_fallback_within_bound(tmp_path) -> None:
    """The operator built without AVX2/FMA/F16C (as on a host without them; registered as
    ``treeserve_scalar``) is within the same bounds in both modes, every row count; its int8 path
    is bit for bit the native build's (the same operations per row in the same order)."""
    scalar = ["-O2", "-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c"]
    build_variant(gguf_op.SOURCE, "treeserve_scalar", scalar, tmp_path)
    for qtype in QTYPES:
        for m in (1, 5, 9):
            k, n = 32 * 70, 7
            w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, m), (n, k))
            x = block_scaled(m, k, m, 3.0)
            ref = x.double() @ w.dequantize(torch.float64).T
            for exact in (True, False):
                y = run_op(x, w, exact, "treeserve_scalar")
                assert bool(((y.double() - ref).abs() <= error_bound(x, w, exact)).all())
            y = torch.ops.treeserve_scalar.gguf_linear_q8(x, w.raw, qtype, k)
            assert bool(((y.double() - ref).abs() <= q8_bound(x, w)).all())
            assert torch.equal(y, torch.ops.treeserve.gguf_linear_q8(x, w.raw, qtype, k))
            assert torch.equal(torch.ops.treeserve_scalar.gguf_dequantize(w.raw, qtype, k), w.dequantize())


@requires_op
@pytest.mark.parametrize("name", ["gguf_linear", "gguf_linear_exact", "gguf_dequantize", "gguf_linear_q8"])
def test_opcheck(name: str) -> None:
    """Schema, fake (tracing) implementation and dispatch of the operators agree."""
    w = GGUFWeight.from_bytes("Q4_1", random_blocks("Q4_1", 5, 64, 7), (5, 64))
    args = (w.raw, "Q4_1", 64) if name == "gguf_dequantize" else (torch.randn(3, 64), w.raw, "Q4_1", 64)
    torch.library.opcheck(getattr(torch.ops.treeserve, name).default, args)


@requires_op
@pytest.mark.slow
@pytest.mark.parametrize("build", ["novnni", "avx2"])
def test_vnni_build_is_bitwise_the_avx2_one(tmp_path, build: str) -> None:
    """The int16 path's integer dot products use ``vpdpwssd`` (and the int8 path ``vpdpbusd``) where the
    host has AVX-512 VNNI (or AVX-VNNI): the native build holds them exactly on such hosts, and its
    int16 outputs are bit for bit those of the same source built without VNNI (exact int32 lanes, the
    same float32 order), every qtype and row-block size; that build's int8 path (``vpmaddubsw``, int16
    sums) keeps its bound and is bit for bit the native one too. ``avx2``: the same for the source
    built without AVX-512 at all (``-mno-avx512f``: 4-row register blocks, the 8-lane int8 kernel), the
    build AVX2-only hosts (the Zen 3 EPYC) run, so AVX-512 hosts check it too, its lane groups in pairs
    and alone (13, 20 and 88 rows) and its tiles of 1-4 weight rows; skipped on hosts without AVX-512,
    whose native build it is."""
    import subprocess

    from treeserve._cpp import build_name, built_library, cpu_flags

    if build == "avx2":
        skip_without_avx512()
    else:  # the native build's instructions, read once (not again for the avx2 build)
        flags = cpu_flags().split()
        vnni = ("avx512_vnni" in flags and "avx512vl" in flags) or "avx_vnni" in flags
        native = built_library(build_name(gguf_op.SOURCE))
        listing = subprocess.run(["objdump", "-d", str(native)], capture_output=True, text=True, check=True).stdout
        assert ("vpdpwssd" in listing) == vnni and ("vpdpbusd" in listing) == vnni
    library = f"treeserve_{build}"
    variant = NO_AVX512 if build == "avx2" else ["-O3", "-march=native", "-mno-avx512vnni", "-mno-avxvnni"]
    build_variant(gguf_op.SOURCE, library, variant, tmp_path)
    for qtype in QTYPES:
        # 1-2 lane groups of 8 rows, an odd count, two passes of Q8_GROUPS (pairs in the second); tiles of 1-4 rows
        for m, n in itertools.product((1, 3, 5, 8, 13, 20, 88), (9, 10, 11)):
            k = 32 * 70
            w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, m), (n, k))
            x = block_scaled(m, k, m, 3.0)
            assert torch.equal(run_op(x, w, False, library), run_op(x, w, False))
            ref = x.double() @ w.dequantize(torch.float64).T  # the int8 path without VNNI: vpmaddubsw
            y = getattr(torch.ops, library).gguf_linear_q8(x, w.raw, qtype, k)
            assert bool(((y.double() - ref).abs() <= q8_bound(x, w)).all())
            assert torch.equal(y, torch.ops.treeserve.gguf_linear_q8(x, w.raw, qtype, k))


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_int16_rows_of_every_call_are_the_rows_alone(qtype: str) -> None:
    """In a call of any row count every row is bit for bit the row alone, on every host (two
    accumulator chains per row in every register block: blocks of 4 rows with AVX2's 16 vector
    registers, 8 with AVX-512's 32): verify steps rely on it (``quant.plain_rows``: draft
    rows on the int16 path of a lone request's row). Counts past one register block and a remainder included."""
    n, k = 37, 32 * 70
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, 4), (n, k))
    x = block_scaled(19, k, 4, 3.0)
    alone = torch.cat([run_op(x[i : i + 1], w, False) for i in range(19)])
    for m in range(1, 20):
        assert torch.equal(run_op(x[:m], w, False), alone[:m]), m
