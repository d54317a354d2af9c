"""K-quant and other GGUF types converted at load to the blocks the GGUF operator multiplies
(``treeserve.models.gguf_convert``), against ``gguf.quants``' exact dequantization; and llama.cpp's
Q4_K_M mixture loaded from its codes alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models._helpers import rel_err
from treeserve.models import load
from treeserve.models.gguf_convert import as_blocks, convert_op_available, converted_type
from treeserve.models.gguf_file import GGUFTensor
from treeserve.models.gguf_loader import open_gguf
from treeserve.models.gguf_op import GGUFWeight, gguf_op_available
from treeserve.models.quant import PACKABLE, PackedLinear
from treeserve.models.synthetic_gguf import SyntheticSpec, synthetic_tensor_shapes, tensor_type, write_synthetic_gguf
from treeserve.runner import PagedSequence

needs_op = pytest.mark.skipif(not (gguf_op_available() and convert_op_available()),
                              reason="the C++ GGUF operators are not built here")
# Widths that are multiples of 256, as the k-quants need.
KSPEC = SyntheticSpec("llama", 8, 256, 4, 2, 512, 320, False, False, 500000.0, 256)
QSPEC = SyntheticSpec("qwen2", 8, 256, 4, 2, 512, 320, True, True, 1000000.0, 256)  # tied head, q|k|v biases


def _f16(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def _tensor(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFTensor:
    return GGUFTensor("t", GGMLQuantizationType[qtype], tuple(reversed(shape)), shape[0] * shape[1], raw.nbytes, 0, raw)


# Byte offsets of each type's f16 fields (d, then a minimum where the type has one); the rest are codes.
_HALVES = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "Q5_K": (0, 2), "Q4_K": (0, 2), "Q5_1": (0, 2),
           "Q4_1": (0, 2)}


def _random_raw(seed: int, qtype: str, shape: tuple[int, int], scale: float) -> np.ndarray:
    """Random ``qtype`` blocks with every f16 field finite: ``d`` near ``scale`` (x0.1..2), a
    minimum in [0, 8 scale]."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for i, at in enumerate(_HALVES.get(qtype, (0,))):
        raw[:, at : at + 2] = _f16(scale * (rng.uniform(0.1, 2.0, n) if i == 0 else rng.uniform(0.0, 8.0, n)))
    return raw.reshape(shape[0], -1)


def _q4_1_from_q4_k(raw: np.ndarray, k: int) -> np.ndarray:
    converted = as_blocks(_tensor("Q4_K", raw, (raw.shape[0], k)), (raw.shape[0], k))
    assert converted is not None and converted[0] == "Q4_1"
    return converted[1]


def _q8_0(w: np.ndarray) -> np.ndarray:
    dst = torch.empty(w.shape[0], w.shape[1] // 32 * 34, dtype=torch.uint8)
    torch.ops.treeserve.gguf_convert(torch.from_numpy(w), "F32", w.shape[1], "Q8_0", dst)
    return dst.numpy()


@needs_op
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), supers=st.integers(1, 3),
       scale=st.sampled_from([1e-4, 3e-3, 0.5]))
def test_q4_k_repacked_as_q4_1_keeps_its_codes(seed: int, rows: int, supers: int, scale: float) -> None:
    k = 256 * supers
    raw = _random_raw(seed, "Q4_K", (rows, k), scale)
    ref = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(rows, k).astype(np.float64)
    got = GGUFWeight.from_bytes("Q4_1", _q4_1_from_q4_k(raw, k), (rows, k)).dequantize().numpy().astype(np.float64)
    # Each scale and minimum rounded once to f16: |error| <= 2^-11 (|d sc q| + |dmin m|) per weight; the bound
    # from the file's own terms (both at most the super-block's largest |w| plus its minimum).
    sup = raw.reshape(-1, 144)
    d = sup[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = sup[:, 2:4].copy().view(np.float16).astype(np.float64)
    bound = 2.0**-11 * (d * 63 * 15 + dmin * 63) + 1e-12  # per super-block, [S, 1]
    err = np.abs(got - ref).reshape(-1, 256)
    assert (err <= bound).all()
    # Scales and minima are numpy's float32 products rounded to f16 (nearest even), bit for bit.
    q41 = _q4_1_from_q4_k(raw, k).reshape(-1, 20)
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(sup[:, 4:16]))
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    assert np.array_equal(q41[:, 0:2].copy().view(np.float16).reshape(-1, 8),
                          (d32 * sc.astype(np.float32)).astype(np.float16))
    assert np.array_equal(q41[:, 2:4].copy().view(np.float16).reshape(-1, 8),
                          (-(dmin32 * mn.astype(np.float32))).astype(np.float16))
    # The codes themselves are unchanged: (w' - m') / d' recovers Q4_K's 4-bit q exactly.
    d1 = q41[:, 0:2].copy().view(np.float16).astype(np.float64)
    m1 = q41[:, 2:4].copy().view(np.float16).astype(np.float64)
    nz = d1[:, 0] != 0
    q = (got.reshape(-1, 32) - m1) / np.where(d1 == 0, 1, d1)
    assert np.allclose(q[nz], np.round(q[nz]), atol=1e-3)
    assert (np.round(q[nz]) >= 0).all() and (np.round(q[nz]) <= 15).all()


@needs_op
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), blocks=st.integers(1, 6),
       scale=st.sampled_from([1e-6, 1e-2, 30.0]), zero_block=st.booleans())
def test_q8_0_requantization_error_and_codes(seed: int, rows: int, blocks: int, scale: float, zero_block: bool) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, 32 * blocks)) * scale).astype(np.float32)
    if zero_block:
        w[0, :32] = 0
    out = _q8_0(w).reshape(rows, blocks, 34)
    d = out[..., 0:2].copy().view(np.float16).astype(np.float64)  # [rows, blocks, 1]
    codes = out[..., 2:].view(np.int8).astype(np.float64)
    assert (np.abs(codes) <= 127).all()
    back = GGUFWeight.from_bytes("Q8_0", out.reshape(rows, -1), (rows, 32 * blocks)).dequantize().numpy()
    err = np.abs(back.astype(np.float64) - w).reshape(rows, blocks, 32)
    amax = np.abs(w.astype(np.float64)).reshape(rows, blocks, 32).max(-1, keepdims=True)
    # Half a step, plus the f16 rounding of d (relative 2^-11, absolute 2^-25 among f16's subnormals) at the
    # block's largest weight, whose code may be clipped at 127.
    assert (err <= d / 2 + amax * 2.0**-10 + 127 * 2.0**-25).all()
    if zero_block:
        assert d[0, 0, 0] == 0 and (codes[0, 0] == 0).all()
    bad = w.copy()
    bad[-1, -1] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        _q8_0(bad)


@needs_op
@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1"])
def test_other_types_become_q8_0_within_half_a_step(qtype: str) -> None:
    shape = (4, 512)
    raw = _random_raw(7, qtype, shape, 1e-3)
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(shape)
    t = _tensor(qtype, raw, shape)
    natural = as_blocks(t, shape)
    assert natural is not None and natural[0] == converted_type(qtype)
    got_type, blocks = as_blocks(t, shape, "Q8_0")  # type: ignore[misc]
    assert got_type == "Q8_0" and blocks.shape == (shape[0], shape[1] // 32 * 34)
    back = GGUFWeight.from_bytes("Q8_0", blocks, shape).dequantize().numpy()
    if qtype in ("Q4_0", "Q5_0"):
        assert np.array_equal(back, ref)  # the same d, codes q - 8 / q - 16: exact
        return
    d = blocks.reshape(-1, 34)[:, 0:2].copy().view(np.float16).astype(np.float64)
    amax = np.abs(ref.astype(np.float64)).reshape(-1, 32).max(-1, keepdims=True)
    assert (np.abs(back - ref).reshape(-1, 32) <= d / 2 + amax * 2.0**-10).all()
    # The operator's own k-quant decoders compute gguf.quants' float32 values bit for bit: requantizing
    # gguf's dequantization gives the same bytes.
    assert np.array_equal(blocks, _q8_0(np.ascontiguousarray(ref, dtype=np.float32)))


@needs_op
def test_the_operator_checks_its_arguments() -> None:
    op = torch.ops.treeserve.gguf_convert
    raw = torch.zeros(2, 144, dtype=torch.uint8)
    q41 = torch.full((2, 8 * 20), 7, dtype=torch.uint8)
    op(raw, "Q4_K", 256, "Q4_1", q41)
    assert not (q41 == 7).any()  # every byte written (zero codes and scales; the minima -0.0)
    q80 = torch.empty(2, 8 * 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qtype must be"):
        op(raw, "Q3_K", 256, "Q8_0", q80)
    with pytest.raises(ValueError, match="out must be 'Q8_0'"):
        op(torch.zeros(2, 210, dtype=torch.uint8), "Q6_K", 256, "Q4_1", q41)
    with pytest.raises(ValueError, match="multiple of 256"):
        op(raw, "Q4_K", 128, "Q4_1", q41)
    with pytest.raises(ValueError, match=r"src must be \[N, 144\]"):
        op(torch.zeros(2, 143, dtype=torch.uint8), "Q4_K", 256, "Q4_1", q41)
    with pytest.raises(TypeError, match="float32"):
        op(torch.zeros(2, 64, dtype=torch.float64), "F32", 64, "Q8_0", torch.empty(2, 68, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        op(torch.zeros(2, 144, dtype=torch.int8), "Q4_K", 256, "Q4_1", q41)
    with pytest.raises(ValueError, match=r"dst must be a contiguous \[2, 160\]"):
        op(raw, "Q4_K", 256, "Q4_1", q80)  # Q8_0's width for a Q4_1 result
    with pytest.raises(ValueError, match="dst must be a contiguous"):
        op(raw, "Q4_K", 256, "Q4_1", torch.empty(160, 2, dtype=torch.uint8).t())
    with pytest.raises(TypeError, match="dst must be a uint8"):
        op(raw, "Q4_K", 256, "Q4_1", torch.empty(2, 160, dtype=torch.int8))
    # a corrupt file's non-finite scale is refused on every path (the Q4_K repack too)
    for bad_type, scale_at, out_type in (("Q4_K", 0, "Q4_1"), ("Q4_K", 2, "Q8_0"), ("Q6_K", 208, "Q8_0")):
        bad = torch.from_numpy(_random_raw(2, bad_type, (2, 256), 1e-3))
        bad[1, scale_at : scale_at + 2] = torch.from_numpy(_f16(np.array([np.inf])).reshape(-1))
        width = 8 * (20 if out_type == "Q4_1" else 34)
        with pytest.raises(ValueError, match="non-finite"):
            op(bad, bad_type, 256, out_type, torch.empty(2, width, dtype=torch.uint8))
    # as_blocks writes into a caller's rows (a fused buffer) and checks them
    t = _tensor("Q4_K", _random_raw(1, "Q4_K", (3, 256), 1e-3), (3, 256))
    into = torch.empty(3, 160, dtype=torch.uint8)
    found = as_blocks(t, (3, 256), into=into)
    alone = as_blocks(t, (3, 256))
    assert found is not None and np.shares_memory(found[1], into.numpy()) and alone is not None
    assert np.array_equal(into.numpy(), np.asarray(alone[1]))
    with pytest.raises(ValueError, match=r"into must be a contiguous uint8 \[3, 160\]"):
        as_blocks(t, (3, 256), into=torch.empty(3, 159, dtype=torch.uint8))


def test_which_types_convert_and_bad_tensors() -> None:
    assert [converted_type(q) for q in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "F16", "BF16", "F32")] == [
        "Q4_0", "Q4_1", "Q8_0", "Q4_1", "Q8_0", "Q8_0", None, None, None]
    assert converted_type("NOT_A_TYPE") is None
    plain = np.zeros((2, 64), np.float16)
    assert as_blocks(_tensor("F16", plain, (2, 64)), (2, 64)) is None  # plain floats load dense
    raw = _random_raw(0, "Q8_0", (2, 64), 1e-2)
    t = _tensor("Q8_0", raw, (2, 64))
    kept = as_blocks(t, (2, 64))
    assert kept is not None and kept[1] is not None and np.shares_memory(kept[1], raw)  # the file's bytes
    assert as_blocks(t, (4, 32)) is not None and as_blocks(t, (2, 48)) is None  # K must be a multiple of 32


@pytest.mark.parametrize("mixture", ["Q4_K_M", "Q5_K_M"])
@pytest.mark.parametrize("spec", [KSPEC, QSPEC], ids=["untied", "tied"])
def test_the_k_m_mixtures_follow_llama_cpp(tmp_path: Path, spec: SyntheticSpec, mixture: str) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec, mixture, seed=2)
    tensors = open_gguf(path).tensors
    more = {0, 7, 3, 6}  # use_more_bits over 8 layers: the first and last eighth, then every third from 1
    head = "token_embd.weight" if spec.tie_word_embeddings else "output.weight"  # the head's tensor: Q6_K
    for name, shape in synthetic_tensor_shapes(spec).items():
        t = tensors[name]
        if len(shape) == 1:
            assert t.tensor_type.name == "F32"
            continue
        kind = name.split(".")[-2] if name.startswith("blk.") else name
        bumped = kind in ("attn_v", "ffn_down") and int(name.split(".")[1]) in more
        want = "Q6_K" if name == head or bumped else mixture[:4]
        assert t.tensor_type.name == want, name
        assert tensor_type(name, mixture, spec.num_layers, spec.tie_word_embeddings) == want, name
        w = dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(w).all() and 0.01 < w.std() < 0.04, (name, w.std())


@needs_op
@pytest.mark.parametrize(("qtype", "spec"), [("Q4_K_M", KSPEC), ("Q6_K", KSPEC), ("Q4_K_M", QSPEC), ("Q5_K_M", KSPEC)],
                         ids=["llama-Q4_K_M", "llama-Q6_K", "qwen2-Q4_K_M", "llama-Q5_K_M"])
def test_k_quant_files_load_from_their_codes_alone(tmp_path: Path, qtype: str, spec: SyntheticSpec,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec, qtype, seed=1)
    tensors = open_gguf(path).tensors
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    exact, _ = load(path, quantization=None)
    lean, _ = load(path, quantization="auto")
    parts = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
             "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
    for i, layer in enumerate(lean.layers):
        for sub in PACKABLE:
            m = layer.get_submodule(sub)
            assert isinstance(m, PackedLinear) and not m.has_dense and m.int8 is None, (i, sub)
            types = {tensors[f"blk.{i}.{p}.weight"].tensor_type.name for p in parts[sub]}
            # Q4_K alone: repacked as Q4_1 (scales rounded to f16); anything else, or a mixed group: Q8_0.
            assert m.qtype == ("Q4_1" if types == {"Q4_K"} else "Q8_0"), (i, sub, types)
            ref = exact.layers[i].get_submodule(sub).weight
            err = float((m.dequantized() - ref).abs().max() / ref.abs().max())
            assert 0 < err < (2e-3 if m.qtype == "Q4_1" else 1e-2), (i, sub, err)
    if qtype == "Q4_K_M":  # both kinds of qkv group occur: layer 0 mixed (v in Q6_K), layer 1 all Q4_K
        assert lean.layers[0].self_attn.qkv_proj.qtype == "Q8_0"
        assert lean.layers[1].self_attn.qkv_proj.qtype == "Q4_1"
    # The lean model (the operator on every row, int16 activations) computes what a dense model of the
    # converted weights computes.
    converted, _ = load(path, quantization=None)
    with torch.no_grad():
        for i, layer in enumerate(converted.layers):
            for sub in PACKABLE:
                layer.get_submodule(sub).weight.copy_(lean.layers[i].get_submodule(sub).dequantized())
        converted.embed_tokens.weight.copy_(lean.embed_tokens(torch.arange(spec.vocab_size)))
        converted.lm_head.weight.copy_(lean.lm_head.weight)
    ids = list(range(260, 300))
    with torch.inference_mode():
        ref = PagedSequence(converted, 64, page_size=1).extend(ids, all_logits=True)
        got = PagedSequence(lean, 64, page_size=1).extend(ids, all_logits=True)
        far = PagedSequence(exact, 64, page_size=1).extend(ids, all_logits=True)
    assert rel_err(got, ref) < 1e-3
    assert rel_err(ref, far) < 0.05  # the conversion's own change, through 8 layers of random weights


@needs_op
@pytest.mark.slow
def test_a_build_without_f16c_converts_bit_for_bit(tmp_path: Path) -> None:
    """The operator built without AVX / F16C (``c10::Half``'s rounding of the Q4_K scales instead of
    vcvtps2ph's, scalar loops) writes the same bytes as the native build (one build per process: a
    library registers once)."""
    from tests._isa_builds import build_variant
    from treeserve.models import gguf_convert

    scalar = build_variant(gguf_convert.SOURCE, "treeserve_convert_scalar", ["-O2", "-mno-avx", "-mno-f16c"], tmp_path)
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        raw = torch.from_numpy(_random_raw(5, qtype, (6, 512), 3e-5))  # tiny scales: f16 subnormals too
        out = "Q4_1" if qtype == "Q4_K" else "Q8_0"
        width = 512 // 32 * (20 if out == "Q4_1" else 34)
        native, other = (torch.empty(6, width, dtype=torch.uint8) for _ in range(2))
        torch.ops.treeserve.gguf_convert(raw, qtype, 512, out, native)
        scalar.gguf_convert(raw, qtype, 512, out, other)
        assert torch.equal(native, other), qtype
