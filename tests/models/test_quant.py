"""Packed GGUF codes (Q4_0 / Q4_1 / Q8_0), HF int4/int8 opt-in and the exact bf16 head."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models._helpers import paged_logits, write_gguf
from treeserve.models import load, load_hf_model, random_model, save_hf_dir, tiny_config
from treeserve._cpu import cpu_features
from treeserve.models import quant
from treeserve.models.quant import (
    ExactHead,
    Int4Planes,
    PackedLinear,
    check_quantization,
    measure_crossover,
    planes_from_gguf,
    quantize_int4,
    quantize_int8,
    restore_dense,
)

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _gguf_planes(qtype: str, n: int, k: int, seed: int) -> tuple[Int4Planes, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[qtype])
    return planes_from_gguf(qtype, raw, (n, k)), dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)


def test_int4pack_convention_is_q_minus_8_times_scale_plus_zero() -> None:
    """torch's CPU int4 kernel decodes code c as (c - 8) * scale + zero (what every mapping relies on)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 16, 64
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale, zero = torch.rand(k // 32, n, generator=gen) + 0.1, torch.randn(k // 32, n, generator=gen)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    decoded = torch._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, torch.stack([scale, zero], -1)).T
    expected = (codes - 8) * scale.repeat_interleave(32, 0).T + zero.repeat_interleave(32, 0).T
    torch.testing.assert_close(decoded, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", QTYPES)
@given(n=st.integers(1, 40), groups=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_planes_dequantize_bit_exactly_like_gguf(qtype: str, n: int, groups: int, seed: int) -> None:
    planes, ref = _gguf_planes(qtype, n, 32 * groups, seed)
    assert planes.codes.dtype == torch.uint8 and int(planes.codes.max()) <= 15
    assert torch.equal(planes.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_gemm_equals_dequantized_gemm(qtype: str, rows: int) -> None:
    """float32 activations: float tolerance; bfloat16 (the fast path): bf16 rounding of x and scales."""
    planes, ref = _gguf_planes(qtype, 48, 96, seed=rows)
    w = torch.from_numpy(ref)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ w.double().T
    f32 = PackedLinear(planes, w, None, act_dtype=torch.float32).packed_forward(x)
    torch.testing.assert_close(f32.double(), exact, rtol=1e-5, atol=1e-5)
    bf16 = PackedLinear(planes, w, None, act_dtype=torch.bfloat16).packed_forward(x)
    assert bf16.dtype == torch.float32
    bound = 2.0**-7 * (x.abs().double() @ w.abs().double().T) + 2.0**-7 * exact.abs()  # x, scales, out
    assert bool(((bf16.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("quantizer", [quantize_int4, quantize_int8])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
def test_int4_kernel_rows_of_every_call_are_the_rows_alone(quantizer, act_dtype: torch.dtype) -> None:
    """torch's int4 kernel (``Int4Planes``' packed path) accumulates each row alone, in the same
    order, whatever the call's row count (4-row blocks, any remainder): ``quant.plain_rows`` puts a
    verify step's draft rows on it below ``packed_max_rows``, and greedy speculation over int4 / int8
    quantized float checkpoints keeps plain decoding's output only while this holds."""
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(4))
    layer = PackedLinear(quantizer(w), w, None, act_dtype=act_dtype)
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([layer.packed_forward(x[i : i + 1]) for i in range(19)])
    for m in range(2, 20):
        assert torch.equal(layer.packed_forward(x[:m]), alone[:m]), m


def test_packed_linear_routes_by_rows_and_adds_bias() -> None:
    planes, ref = _gguf_planes("Q4_1", 32, 64, seed=1)
    w, bias = torch.from_numpy(ref), torch.randn(32)
    layer = PackedLinear(planes, w, bias, act_dtype=torch.float32, packed_max_rows=4)
    x = torch.randn(6, 64)
    assert torch.equal(layer(x[:4]), layer.packed_forward(x[:4]))
    assert torch.equal(layer(x), F.linear(x, w, bias))
    torch.testing.assert_close(layer.packed_forward(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    with quant.plain_rows(1):  # a verify step of one request: every row on the packed path
        assert torch.equal(layer(x), layer.packed_forward(x))
    with quant.plain_rows(5):
        assert torch.equal(layer(x[:2]), F.linear(x[:2], w, bias))


@pytest.mark.parametrize("quantizer,levels", [(quantize_int4, 15), (quantize_int8, 254)])
def test_hf_quantizers_error_within_half_a_step(quantizer, levels) -> None:
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(2))
    w[0, :32] = 0.5  # a constant group: scale 0 must decode exactly
    deq = quantizer(w).dequantize()
    span = w.view(24, 4, 32).amax(-1) - w.view(24, 4, 32).amin(-1)
    if levels == 254:
        span = 2 * w.view(24, 4, 32).abs().amax(-1)
    step = (span / levels).repeat_interleave(32, 1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    assert torch.equal(deq[0, :32], w[0, :32])


def test_cat_rows_pads_planes_exactly() -> None:
    a, ra = _gguf_planes("Q4_1", 8, 64, seed=3)
    b, rb = _gguf_planes("Q8_0", 5, 64, seed=4)
    fused = Int4Planes.cat_rows([a, b])
    assert fused.planes == 2 and fused.shape == (13, 64)
    assert torch.equal(fused.dequantize(), torch.from_numpy(np.concatenate([ra, rb])))


def test_bad_inputs_name_the_field(monkeypatch) -> None:
    with pytest.raises(ValueError, match="qtype"):
        planes_from_gguf("Q5_K", np.zeros(10, np.uint8), (1, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        planes_from_gguf("Q4_0", np.zeros(18, np.uint8), (1, 31))
    with pytest.raises(ValueError, match="needs 36 bytes"):
        planes_from_gguf("Q4_0", np.zeros(18, np.uint8), (2, 32))
    with pytest.raises(TypeError, match="2-D float"):
        quantize_int4(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="quantization must be one of"):
        check_quantization("fp8")
    planes, ref = _gguf_planes("Q4_0", 4, 32, seed=0)
    with pytest.raises(ValueError, match="weight must have"):
        PackedLinear(planes, torch.zeros(4, 64), None)
    layer = PackedLinear(planes, torch.from_numpy(ref), None)
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="TREESERVE_PACKED_MAX_ROWS"):
        measure_crossover(layer)
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "7")
    assert measure_crossover(layer) == 7
    with pytest.raises(TypeError, match="float32"):
        ExactHead(torch.nn.Parameter(torch.zeros(4, 32, dtype=torch.bfloat16)))
    monkeypatch.setenv("TREESERVE_EXACT_HEAD", "fast")
    with pytest.raises(ValueError, match="TREESERVE_EXACT_HEAD"):
        ExactHead(torch.nn.Parameter(torch.zeros(4, 32)))
    monkeypatch.setenv("TREESERVE_EXACT_HEAD", "f32")
    w = torch.randn(4, 32)
    head = ExactHead(torch.nn.Parameter(w))
    x = torch.ones(2, 32)
    assert head.bf16_max_rows == 0 and torch.equal(head(x), head._float32(x))  # the float32 head itself
    torch.testing.assert_close(head(x), F.linear(x, w))
    monkeypatch.setenv("TREESERVE_EXACT_HEAD", "bf16")
    assert ExactHead(torch.nn.Parameter(w)).bf16_max_rows >= 2**40  # every batch size


def test_measured_crossover_is_a_candidate_row_count(monkeypatch) -> None:
    monkeypatch.delenv("TREESERVE_PACKED_MAX_ROWS", raising=False)
    planes, ref = _gguf_planes("Q4_1", 64, 64, seed=5)
    assert measure_crossover(PackedLinear(planes, torch.from_numpy(ref), None)) in (0, 1, 2, 4, 8, 16, 32, 64, 128)


def near_ties(seed: int, v: int, h: int, m: int, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A head ``w [v, h]`` and rows ``x [m, h]`` whose two best float32 logits differ by ~margin."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=gen)
    x = torch.randn(m, h, generator=gen) * 3
    f32 = F.linear(x, w)
    top2 = f32.topk(2, dim=1).indices
    for r in range(m):  # move the runner-up to within `margin` of the best
        a, b = top2[r]
        w[b] = w[b] + (f32[r, a] - f32[r, b] - margin) / x[r].dot(x[r]) * x[r]
    return w, x


@given(
    seed=st.integers(0, 2**20),
    margin=st.sampled_from([0.0, 1e-4, 1e-3, 1e-2]),
    max_cand=st.sampled_from([1, 64]),
    static=st.booleans(),
    op=st.booleans() if quant._rescore_op_available() else st.just(False),
)
def test_exact_head_greedy_equals_float32_head_on_near_ties(seed: int, margin: float, max_cand: int, static: bool,
                                                           op: bool) -> None:
    """Rows where the two best logits differ by ~margin (far below bf16's resolution at |logit| ~ 10);
    the bf16 path forced (on a machine where it is slower the head would skip it). ``static``: the
    static-shape re-scoring a whole-graph compile traces (top candidates + ``torch.cond``), run eagerly;
    ``op``: the C++ re-scoring (``treeserve::exact_head_rescore``), else the torch ops."""
    v, h, m = 300, 64, 4
    w, x = near_ties(seed, v, h, m, margin)
    with mock.patch.dict(os.environ, {"TREESERVE_EXACT_HEAD": "bf16"}):
        head = ExactHead(torch.nn.Parameter(w, requires_grad=False), max_candidates=max_cand)
    with mock.patch.object(quant, "_tracing", lambda: static), mock.patch.object(quant, "_rescore_op_available", lambda: op):
        logits = head(x)
    if max_cand == 64:  # some rows keep bf16 values: the bf16 GEMM really ran
        assert float((logits - F.linear(x, w)).abs().max()) > 0
    ref = F.linear(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (m, v)
    best = logits.argmax(1)
    # Equal picks, or (margin 0) a tie that float32 rounding (K ulps of sum |x w|) cannot order.
    f32_noise = h * 2.0**-24 * (x.abs() @ w.abs().T).amax(1)
    assert bool((ref.gather(1, best[:, None])[:, 0] >= ref.amax(1) - f32_noise).all())
    if margin >= 1e-3:
        assert torch.equal(best, ref.argmax(1))


@pytest.mark.skipif(not (quant._rescore_op_available() and quant._rows_op_available()),
                    reason="needs the C++ re-scoring and head_rows operators")
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**20), max_cand=st.sampled_from([1, 64]), bf16_rows=st.sampled_from([0, 1, 3]))
def test_exact_head_row_is_the_same_whatever_path_its_step_takes(seed: int, max_cand: int, bf16_rows: int) -> None:
    """A row alone (the bf16 or float32 first pass) and in a step of 6 rows (float32 GEMM first pass,
    or bf16 up to ``bf16_rows``): the same greedy pick with bitwise the same logit, on rows whose two
    best logits tie to float32 rounding; ``max_cand`` 1 sends rows to the full float32 head
    (``head_rows``), 64 re-scores candidates (the same dot products). This is what keeps speculative
    verify steps (more rows) exact against the decode steps they stand for."""
    v, h, m = 300, 64, 6
    w, x = near_ties(seed, v, h, m, 0.0)
    with mock.patch.dict(os.environ, {"TREESERVE_EXACT_HEAD": "f32"}):
        head = ExactHead(torch.nn.Parameter(w, requires_grad=False), max_candidates=max_cand)
    head.bf16_max_rows = bf16_rows
    if bf16_rows and "weight_bf16" not in head._buffers:
        head.bf16_weight()
    together = head(x)
    for r in range(m):
        alone = head(x[r : r + 1])[0]
        best = int(alone.argmax())
        assert best == int(together[r].argmax())
        assert alone[best].item() == together[r, best].item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_gguf_packed_model_tracks_dense(tmp_path, monkeypatch, arch) -> None:
    """Every GGUF code type, Q/K un-permuted (llama), Qwen3's per-head norms (in the fused decode plan
    too): packed decode within bf16 error of the dense model."""
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "256")
    model = random_model(tiny_config(arch, hidden_size=64, intermediate_size=128), seed=3, init_std=0.1)
    ids = list(range(5, 37))
    for qtype in QTYPES:
        path = write_gguf(model, tmp_path / f"{qtype}.gguf", GGMLQuantizationType[qtype])
        dense, _ = load(path)
        packed, _ = load(path, quantization="auto")
        proj = packed.layers[1].self_attn.qkv_proj
        assert isinstance(proj, PackedLinear) and proj.packed_max_rows == 256
        assert isinstance(packed.lm_head, ExactHead)
        torch.testing.assert_close(proj.dense_weight(), dense.layers[1].self_attn.qkv_proj.weight, rtol=0, atol=0)
        x = torch.randn(3, 64)
        torch.testing.assert_close(proj(x), F.linear(x, proj.dense_weight()), rtol=0.03, atol=0.03)
        a = paged_logits(dense, ids, [len(ids)], 4)
        b = paged_logits(packed, ids, [8] + [1] * 24, 4)
        assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())
        assert len(packed.decode_plan().norms) == (4 if arch == "qwen3" else 2) * 2


@pytest.mark.skipif(not quant.int8_available(), reason="oneDNN int8 linear unavailable in this torch build")
def test_dense_weight_is_dropped_where_codes_and_int8_serve(tmp_path, monkeypatch) -> None:
    """A GGUF projection whose small batches take the C++ operator and large ones the int8 GEMM
    holds no dense copy; every batch still multiplies right, and the copy comes back on demand."""
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "8")
    monkeypatch.setenv("TREESERVE_INT8", "1")
    model = random_model(tiny_config("llama", hidden_size=64, intermediate_size=128), seed=4, init_std=0.1)
    path = write_gguf(model, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0)
    dense, _ = load(path)
    packed, _ = load(path, quantization="auto")
    projs = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(projs) == 4 * len(packed.layers) and not any(m.has_dense for m in projs)
    assert not any(n.endswith("_proj.weight") for n, _ in packed.named_parameters())
    proj, ref = packed.layers[1].mlp.down_proj, dense.layers[1].mlp.down_proj.weight
    for rows in (3, 40):  # the operator, then int8 (2-D and 3-D inputs)
        x = torch.randn(rows, 128)
        expect = F.linear(x, ref)
        torch.testing.assert_close(proj(x), expect, rtol=0.05, atol=0.05 * float(expect.abs().max()))
        torch.testing.assert_close(proj(x.view(1, rows, 128)), proj(x).view(1, rows, -1), rtol=0, atol=0)
    ids = list(range(5, 37))
    a = paged_logits(dense, ids, [len(ids)], 4)
    b = paged_logits(packed, ids, [16] + [1] * 16, 4)  # prefill through int8, decode through the operator
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())
    torch.testing.assert_close(proj.dense_weight(), ref, rtol=0, atol=0)
    assert proj.has_dense and sum(m.has_dense for m in projs) == 1
    restore_dense(packed)
    assert all(m.has_dense for m in projs)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_hf_opt_in_quantization(tmp_path, quantization, monkeypatch) -> None:
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "64")
    model = random_model(tiny_config("qwen2"), seed=1, init_std=0.05)
    folder = save_hf_dir(model, tmp_path / "hf")
    plain = load_hf_model(folder, quantization="auto")
    assert not isinstance(plain.layers[0].mlp.down_proj, PackedLinear)
    q = load_hf_model(folder, quantization=quantization)
    down = q.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.planes == (2 if quantization == "int8" else 1)
    assert q.layers[0].self_attn.qkv_proj.bias is not None
    ids = list(range(3, 19))
    a = paged_logits(model, ids, [len(ids)], 4)
    b = paged_logits(q, ids, [4] + [1] * 12, 4)
    tol = 0.05 if quantization == "int8" else 0.25
    assert float((a - b).abs().max()) < tol * float(a.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("max_rows", "int8", "min_agreement", "max_ppl_ratio"),
    [("4096", "0", 0.98, 1.002), pytest.param("0", "1", 0.9, 1.02, id="int8")],
)
def test_embedded_model_packed_decode_agrees_with_float32(smol, monkeypatch, max_rows, int8, min_agreement,
                                                         max_ppl_ratio) -> None:
    """The default CPU configuration (GGUF codes packed, exact head), every row through the packed
    codes, or every row through the int8 GEMM (``int8_op``): teacher-forced top-1 agreement with the
    dense float32 model and perplexity on the agreement text within the given margins (int8:
    here 92% and -4.7% on 112 tokens; +0.1% perplexity over 1,500 tokens, benches/RESULTS.md)."""
    from tests.models.test_smollm2 import TEXT

    if int8 == "1" and not quant.int8_available():
        pytest.skip("oneDNN int8 linear unavailable in this torch build")
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", max_rows)
    monkeypatch.setenv("TREESERVE_INT8", int8)
    text = " ".join([
        TEXT,
        "The scheduler batches prefill chunks and decode steps together.",
        "Speculative decoding drafts several tokens and verifies them in one forward pass.",
        "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
        "In the morning, the town market opens early: farmers sell apples, bread and fresh milk,",
        "and children walk to school along the river before the bells ring at eight o'clock.",
    ])
    ids = smol.tokenizer.encode(text)
    packed = load("smollm2-135m-instruct", quantization="auto").model
    assert isinstance(packed.layers[0].mlp.gate_up_proj, PackedLinear)
    assert packed.layers[0].mlp.gate_up_proj.large_int8 == (int8 == "1")
    ref = paged_logits(smol.model, ids, [len(ids)], 16)
    got = paged_logits(packed, ids, [len(ids)], 16)
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    target = torch.tensor(ids[1:])

    def nll(logits: torch.Tensor) -> float:
        return float(F.cross_entropy(logits[:-1].double(), target))

    ppl_ratio = float(np.exp(nll(got) - nll(ref)))
    assert len(ids) >= 100 and agreement >= min_agreement and ppl_ratio <= max_ppl_ratio, (len(ids), agreement, ppl_ratio)


@pytest.mark.skipif(not quant._rescore_op_available(), reason="C++ exact-head re-scoring unavailable")
def test_rescore_op_flags_full_rows_and_names_bad_operands() -> None:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(50, 16, generator=gen), torch.randn(2, 16, generator=gen)
    approx = F.linear(x, w)
    approx[1] = 0.0  # every entry of row 1 ties: more candidates than allowed
    out = approx.clone()
    full = torch.ops.treeserve.exact_head_rescore(out, out, x, w, w.norm(dim=1), 1e-3, 8)
    assert full.tolist() == [False, True]
    assert torch.equal(out[1], approx[1])  # a flagged row is left to the caller
    assert int(out[0].argmax()) == int(F.linear(x, w)[0].argmax())
    with pytest.raises(ValueError, match=r"need approx and out \[M, V\], x \[M, K\]"):
        torch.ops.treeserve.exact_head_rescore(out, out, x[:, :8].contiguous(), w, w.norm(dim=1), 1e-3, 8)
    with pytest.raises(TypeError, match="contiguous float32 CPU tensors"):
        torch.ops.treeserve.exact_head_rescore(out, out, x.double(), w, w.norm(dim=1), 1e-3, 8)
    # A bf16 first pass is widened into out on the way: the same result as re-scoring its float32 copy.
    approx16 = F.linear(x.bfloat16(), w.bfloat16())
    widened, into = approx16.float(), torch.full(approx16.shape, float("nan"))
    flags = torch.ops.treeserve.exact_head_rescore(widened, widened, x, w, w.norm(dim=1), 1e-2, 8)
    assert torch.equal(torch.ops.treeserve.exact_head_rescore(approx16, into, x, w, w.norm(dim=1), 1e-2, 8), flags)
    assert torch.equal(into, widened)
    with pytest.raises(TypeError, match="approx must be a contiguous float32 or bfloat16"):
        torch.ops.treeserve.exact_head_rescore(approx16.double(), into, x, w, w.norm(dim=1), 1e-2, 8)
    with pytest.raises(ValueError, match="need approx and out"):
        torch.ops.treeserve.exact_head_rescore(approx16, into[:, :10].contiguous(), x, w, w.norm(dim=1), 1e-2, 8)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN unavailable in this torch build")
@pytest.mark.parametrize("k", [1, 64])
def test_exact_head_bf16_bound_covers_worst_case_roundings(k: int) -> None:
    """x = W = 1 + 2^-8 + 2^-20 rounds up by ~2^-8 relative (bf16 keeps 8 significant bits) in x,
    in W and again in the bf16 product: the bf16 pass's error reaches ~3 2^-8 |x| |W|, which the
    bound must cover (the former 2^-8 + 2^-9 did not: 0.0078 against 0.0059 at K = 1)."""
    v = 1.0 + 2.0**-8 + 2.0**-20
    w = torch.full((3, k), v)
    x = torch.full((1, k), v)
    with mock.patch.dict(os.environ, {"TREESERVE_EXACT_HEAD": "bf16"}):
        head = ExactHead(torch.nn.Parameter(w, requires_grad=False))
    err = (head._bf16(x).double() - x.double() @ w.double().T).abs()
    bound = head.bound_factor * x.double().norm() * w.double().norm(dim=1)
    assert bool((err <= bound).all()), (err.max().item(), bound.min().item())
    assert float(err.max()) > (2.0**-8 + 2.0**-9) * k * v * v  # the case is really worst: the old factor fails


@pytest.mark.skipif(not quant._rows_op_available(), reason="C++ few-row head unavailable")
@given(m=st.integers(1, 11), k=st.integers(1, 70), v=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_head_rows_is_float32_per_row_whatever_the_row_count(m: int, k: int, v: int, seed: int) -> None:
    """``treeserve::head_rows``: within float32 summation error of the float64 product; each row's
    logits bit-equal to that row computed alone (the rows of a verify step are those of a decode
    step), and to the re-scoring's dot product (a re-scored candidate keeps its value)."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(v, k, generator=gen)
    y = torch.ops.treeserve.head_rows(x, w)
    ref = x.double() @ w.double().T
    bound = (k + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert y.dtype == torch.float32 and y.shape == (m, v)
    assert bool(((y.double() - ref).abs() <= bound).all())
    for r in {0, m - 1}:
        assert torch.equal(torch.ops.treeserve.head_rows(x[r : r + 1].contiguous(), w)[0], y[r])
    if quant._rescore_op_available():  # every entry a candidate: the re-scoring writes dot(x, W_j)
        out = torch.zeros(m, v)
        torch.ops.treeserve.exact_head_rescore(out, out, x, w, torch.ones(v), 1e30, v)
        assert torch.equal(out, y)


@pytest.mark.skipif(not quant._rows_op_available(), reason="C++ few-row head unavailable")
def test_exact_head_serves_a_few_rows_through_head_rows(monkeypatch) -> None:
    """With the float32 head serving (no approximate pass), ``rows_min_rows .. rows_max_rows`` rows go
    through ``head_rows``, others through ``F.linear`` with their argmax contenders re-scored to
    ``head_rows``' dot products where the re-scoring operator is built; the measured range is a
    candidate range; bad operands are refused by name."""
    monkeypatch.setenv("TREESERVE_EXACT_HEAD", "f32")
    monkeypatch.setenv("TREESERVE_HEAD_ROWS_MAX_ROWS", "4")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(97, 40, generator=gen)
    head = ExactHead(torch.nn.Parameter(w, requires_grad=False))
    assert (head.rows_min_rows, head.rows_max_rows, head.bf16_max_rows) == (1, 4, 0)
    for m in (1, 2, 4, 5):
        x = torch.randn(m, 40, generator=gen)
        y, rows = head(x), torch.ops.treeserve.head_rows(x, w)
        if m <= 4 or not quant._rescore_op_available():
            assert torch.equal(y, rows if m <= 4 else F.linear(x, w)), m
            continue
        changed = y != F.linear(x, w)
        assert torch.equal(y[changed], rows[changed])
        best = y.argmax(1, keepdim=True)
        assert torch.equal(y.gather(1, best), rows.gather(1, best))
    monkeypatch.setenv("TREESERVE_HEAD_ROWS_MAX_ROWS", "0")
    assert ExactHead(torch.nn.Parameter(w, requires_grad=False)).rows_max_rows == 0
    monkeypatch.delenv("TREESERVE_HEAD_ROWS_MAX_ROWS")
    lo, hi = ExactHead(torch.nn.Parameter(w, requires_grad=False))._rows_range()
    assert lo in (1, 2) and hi in (0, 1, 2, 4, 8, 16, 32, 64, 128) and (lo == 2 or hi >= 1)
    with pytest.raises(ValueError, match=r"need x \[M, K\] and weight \[V, K\]"):
        torch.ops.treeserve.head_rows(torch.zeros(2, 39), w)
    with pytest.raises(TypeError, match="contiguous float32 CPU tensors"):
        torch.ops.treeserve.head_rows(torch.zeros(2, 40, dtype=torch.float64), w)


def test_bf16_kv_cache_tracks_the_float32_cache(smol) -> None:
    """SmolLM2 float32 with its KV stored in bfloat16 (``kv_cache_dtype``: the AVX-512 BF16 default):
    teacher-forced over ~130 tokens, prefill then one decode step per token, top-1 agreement with
    the float32 cache >= 97% and perplexity within 1% of it (measured: 100% and +0.6% on these 78
    tokens; 99.4% and +0.01% over 1,200 tokens of README text, benches/RESULTS.md)."""
    from tests.models.test_smollm2 import TEXT

    text = " ".join([TEXT, "The scheduler batches prefill chunks and decode steps together.",
                     "In the morning, the town market opens early: farmers sell apples, bread and fresh milk,",
                     "and children walk to school along the river before the bells ring at eight o'clock."])  # fmt: skip
    ids = smol.tokenizer.encode(text)
    chunks = [16] + [1] * (len(ids) - 16)
    ref = paged_logits(smol.model, ids, chunks, 1)
    got = paged_logits(smol.model, ids, chunks, 1, kv_dtype=torch.bfloat16)
    assert not torch.equal(ref, got)  # the bf16 cache really ran
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    target = torch.tensor(ids[1:])
    nll = [float(F.cross_entropy(x[:-1].double(), target)) for x in (ref, got)]
    ppl_ratio = float(np.exp(nll[1] - nll[0]))
    assert len(ids) >= 60 and agreement >= 0.97 and abs(ppl_ratio - 1) <= 0.01, (len(ids), agreement, ppl_ratio)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN unavailable in this torch build")
def test_exact_head_bf16_pass_on_the_reordered_weight() -> None:
    """Where oneDNN's bf16 primitives run (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), the bf16 first pass
    multiplies by the weight reordered once at load (oneDNN's layout) and the plain bf16 weight is
    not kept; elsewhere (an AVX2-only CPU, where the reorder raises) it keeps the plain weight. Either
    way: the same bf16 products as ``F.linear`` on the plain bf16 weight, and a traced step gets the
    plain one back from ``restore_dense``."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(257, 64, generator=gen)
    with mock.patch.dict(os.environ, {"TREESERVE_EXACT_HEAD": "bf16"}):
        head = ExactHead(torch.nn.Parameter(w, requires_grad=False))
    x = torch.randn(5, 64, generator=gen)
    plain = F.linear(x.bfloat16(), w.bfloat16())
    if cpu_features().onednn_bf16:
        assert head._w16_packed is not None and "weight_bf16" not in head._buffers
    else:
        assert head._w16_packed is None and torch.equal(head.weight_bf16, w.bfloat16())
    assert torch.equal(head._bf16(x), plain)
    model = torch.nn.Sequential(head)
    restore_dense(model)
    assert torch.equal(head.weight_bf16, w.bfloat16())
    with mock.patch.object(quant, "_tracing", lambda: True):
        assert torch.equal(head._bf16(x), plain)  # the traced path: F.linear on the plain weight
    assert (quant._prepack_bf16(torch.zeros(4, 64, dtype=torch.bfloat16)) is not None) == cpu_features().onednn_bf16


def test_fingerprint_ignores_the_dense_weight_built_on_demand() -> None:
    """A GGUF-coded layer's dense weight (built at its first large batch, or by a cold start's
    measurement) leaves the disk KV tier's model id unchanged; its codes do not."""
    from treeserve.kvcache import module_fingerprint
    from treeserve.models.gguf_op import GGUFWeight

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (8, 2, 18), dtype=np.uint8)
    raw[..., :2] = (rng.standard_normal((8, 2, 1)) * 0.02).astype(np.float16).view(np.uint8)
    layer = PackedLinear(GGUFWeight.from_bytes("Q4_0", raw.reshape(-1), (8, 64)), None, None,
                         packed_max_rows=4, weight_dtype=torch.float32)
    before = module_fingerprint(layer)
    assert not layer.has_dense
    layer.dense_weight()
    assert layer.has_dense and module_fingerprint(layer) == before
    layer.raw[0, 2] ^= 1
    assert module_fingerprint(layer) != before
