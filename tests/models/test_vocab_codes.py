"""Token embedding and LM head kept as GGUF codes (``treeserve.models.vocab_codes``, issue 33)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.test_gguf_linear import check_greedy_pick, random_blocks
from treeserve.models import load
from treeserve.models.gguf_loader import gguf_config, open_gguf
from treeserve.models.gguf_op import BLOCK_BYTES, GGUFWeight, dequantize_blocks, gguf_op_available
from treeserve.models.llama import Embedding
from treeserve.models.loader import resolve_model_path
from treeserve.models.quant import ExactHead
from treeserve.models.synthetic_gguf import SPECS, SyntheticSpec, write_synthetic_gguf
from treeserve.models.vocab_codes import HEAD_CODES_MIN_BYTES, CodesEmbedding, CodesHead, head_from_codes, row_norms
from treeserve.runner import PagedSequence

QTYPES = sorted(BLOCK_BYTES)
TINY = SyntheticSpec("llama", 2, 128, 4, 2, 192, 320, False, False, 500000.0, 256)
requires_op = pytest.mark.skipif(not gguf_op_available(), reason="the C++ GGUF operator is not built here")


@pytest.mark.parametrize("qtype", QTYPES)
def test_torch_dequantization_is_bitwise_gguf_quants(qtype: str) -> None:
    """``dequantize_blocks`` (torch) against ``gguf.quants.dequantize`` (llama.cpp's reference in
    numpy) on random blocks, compared as bits; ``dequantize_rows`` gives the same rows."""
    n, k = 67, 256
    raw = random_blocks(qtype, n, k, 5)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32))
    w = GGUFWeight.from_bytes(qtype, raw, (n, k))
    assert torch.equal(dequantize_blocks(qtype, w.raw, k).view(torch.int32), ref.view(torch.int32))
    assert torch.equal(w.dequantize().view(torch.int32), ref.view(torch.int32))
    ids = torch.tensor([[3, 0, 66], [3, 5, 5]])
    assert torch.equal(w.dequantize_rows(ids), ref[ids])


def test_the_size_rule_and_its_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREESERVE_HEAD_CODES", raising=False)
    smol = gguf_config(open_gguf(resolve_model_path("smollm2-135m-instruct")))
    assert not head_from_codes(smol.vocab_size, smol.hidden_size)  # the default model keeps ExactHead
    for name in ("llama-3.2-1b", "llama-3-8b", "qwen2.5-1.5b"):
        assert head_from_codes(SPECS[name].vocab_size, SPECS[name].hidden_size), name
    assert not head_from_codes(HEAD_CODES_MIN_BYTES // 4 // 64, 64)
    assert head_from_codes(HEAD_CODES_MIN_BYTES // 4 // 64 + 1, 64)
    monkeypatch.setenv("TREESERVE_HEAD_CODES", "1")
    assert head_from_codes(10, 32)
    monkeypatch.setenv("TREESERVE_HEAD_CODES", "0")
    assert not head_from_codes(SPECS["llama-3-8b"].vocab_size, 4096)
    monkeypatch.setenv("TREESERVE_HEAD_CODES", "yes")
    with pytest.raises(ValueError, match="TREESERVE_HEAD_CODES must be '0' or '1'"):
        head_from_codes(10, 32)


def test_bad_codes() -> None:
    with pytest.raises(TypeError, match="codes must be a GGUFWeight"):
        CodesEmbedding(torch.zeros(4, 32))  # type: ignore[arg-type]


@requires_op
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**20), margin=st.sampled_from([0.0, 1e-6, 1e-4]), qtype=st.sampled_from(QTYPES),
       q8=st.booleans())
def test_codes_head_greedy_equals_float32_head_on_near_ties(seed: int, margin: float, qtype: str, q8: bool) -> None:
    """Rows whose two best logits differ by ~margin pick the float32 head's token (at margin 0, a
    token float32 rounding cannot order against it); every logit within the first pass's bound;
    with the int8 first pass (``q8_min_rows``) too."""
    v, k, m = 257, 64, 5
    gen = torch.Generator().manual_seed(seed)
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, v, k, seed), (v, k))
    x = torch.randn(m, k, generator=gen)
    top2 = F.linear(x, w.dequantize()).topk(2, dim=1).indices
    last = k // 32 - 1  # the last block: scale 0.01, its last byte moved by one code step in the runner-up
    element = 32 * last + (15 if qtype != "Q8_0" else 31)  # that byte's low nibble / int8 code
    for r in range(m):  # logits of a and b then differ by 0.01 * x[r, element]
        a, b = top2[r]
        start = last * BLOCK_BYTES[qtype]
        w.raw[a, start : start + 2] = torch.tensor(np.array([0.01], np.float16).view(np.uint8))
        w.raw[b] = w.raw[a]
        w.raw[b, -1] ^= 1
        x[r, element] = margin / 0.01
    dense = w.dequantize()
    head = CodesHead(w)
    head.q8_min_rows = 1 if q8 else None
    logits = head(x)
    ref, noise = check_greedy_pick(logits, x, dense, margin)
    bound = head.row_bound(x, q8 and head.int16) * dense.double().norm(dim=1).float()
    assert bool(((logits - ref).abs() <= bound + noise[:, None]).all())


@requires_op
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**20), spread=st.sampled_from([1.0, 1e3, 1e6]), qtype=st.sampled_from(QTYPES))
def test_the_first_pass_is_within_its_row_bound(seed: int, spread: float, qtype: str) -> None:
    """Each block of x holds one element ``spread`` times the others (the int16 rounding's worst
    case): the first pass, before re-scoring, is within ``row_bound(x) |W_j|`` of the float64
    product, and Q4_0 / Q8_0 take the int16 operator (its bound is wider than float32's)."""
    v, k, m = 96, 256, 4
    gen = torch.Generator().manual_seed(seed)
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, v, k, seed), (v, k))
    x = torch.randn(m, k, generator=gen)
    x[:, ::32] *= spread
    head = CodesHead(w)
    assert head.int16 == (qtype != "Q4_1")
    op = torch.ops.treeserve.gguf_linear if head.int16 else torch.ops.treeserve.gguf_linear_exact
    first = op(x, w.raw, qtype, k).double()
    ref = x.double() @ w.dequantize().double().t()
    bound = (head.row_bound(x) * head.row_norms).double()
    assert bool(((first - ref).abs() <= bound).all())
    assert bool((head.row_bound(x) >= head.bound_factor * x.norm(dim=1, keepdim=True)).all())
    if head.int16:  # the int8 pass: within its own, wider bound (beyond the int16 one on even blocks)
        first = torch.ops.treeserve.gguf_linear_q8(x, w.raw, qtype, k).double()
        bound8 = (head.row_bound(x, True) * head.row_norms).double()
        assert bool(((first - ref).abs() <= bound8).all())
        assert spread != 1.0 or bool(((first - ref).abs() > bound).any())


@requires_op
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**20), qtype=st.sampled_from(QTYPES), scale=st.sampled_from([0.0, 1e-3, 1.0]))
def test_the_rescoring_recomputes_exactly_the_entries_the_bound_keeps(seed: int, qtype: str, scale: float) -> None:
    """``codes_head_rescore`` (the C++ re-scoring) against torch: the entries re-scored are those whose
    upper bound reaches the best lower bound (flat logits: many; ``scale`` 0 makes every row all
    ties), each becomes the float32 dot of x with its dequantized row (within float32 summation of
    the float64 one), and every other entry keeps the first pass's value bit for bit."""
    v, k, m = 700, 128, 3
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, v, k, seed), (v, k))
    head = CodesHead(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale
    op = torch.ops.treeserve.gguf_linear if head.int16 else torch.ops.treeserve.gguf_linear_exact
    first = op(x, w.raw, qtype, k)
    bound = head.row_bound(x) * head.row_norms
    kept = first + bound >= (first - bound).amax(dim=1, keepdim=True)
    got = first.clone()
    torch.ops.treeserve.codes_head_rescore(got, x, w.raw, qtype, k, head.row_bound(x).view(-1), head.row_norms)
    dense = w.dequantize().double()
    ref = x.double() @ dense.t()
    noise = 2 * (k + 2) * 2.0**-24 * (x.double().abs() @ dense.abs().t())
    assert bool(((got.double() - ref).abs()[kept] <= noise[kept]).all())
    assert torch.equal(got[~kept], first[~kept])
    assert bool(kept.any(dim=1).all())
    assert torch.equal(head(x), got)


@requires_op
def test_the_rescoring_names_bad_operands() -> None:
    w = GGUFWeight.from_bytes("Q4_0", random_blocks("Q4_0", 40, 64, 0), (40, 64))
    x, rn = torch.randn(2, 64), row_norms(w)
    op = torch.ops.treeserve.codes_head_rescore
    with pytest.raises(ValueError, match="logits"):
        op(torch.zeros(2, 39), x, w.raw, "Q4_0", 64, torch.zeros(2), rn)
    with pytest.raises(ValueError, match="bound"):
        op(torch.zeros(2, 40), x, w.raw, "Q4_0", 64, torch.zeros(3), rn)
    with pytest.raises(TypeError, match="float32"):
        op(torch.zeros(2, 40, dtype=torch.float64), x, w.raw, "Q4_0", 64, torch.zeros(2), rn)
    with pytest.raises(RuntimeError, match="qtype"):
        op(torch.zeros(2, 40), x, w.raw, "Q5_0", 64, torch.zeros(2), rn)


@requires_op
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**20), qtype=st.sampled_from(QTYPES), q8_from=st.sampled_from([None, 2, 4]))
def test_a_rows_greedy_logit_is_the_same_alone_and_in_a_step(seed: int, qtype: str, q8_from: int | None) -> None:
    """A row alone (int16 first pass) and in a step of 9 rows (the int8 pass from ``q8_from`` rows):
    the same greedy pick with bitwise the same re-scored logit (what keeps speculative verify steps
    exact against decode steps without a cap for the head)."""
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, 3000, 256, seed), (3000, 256))
    head = CodesHead(w)
    head.q8_min_rows = q8_from
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(seed))
    together = head(x)
    for r in range(9):
        alone = head(x[r : r + 1])[0]
        best = int(alone.argmax())
        assert best == int(together[r].argmax()) and alone[best].item() == together[r, best].item()


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_a_step_without_logits_rows_gets_an_empty_logits_tensor(qtype: str) -> None:
    """A chunked-prefill step where no request samples asks the head for 0 rows (a batch of 16 600-token
    prompts on Llama-3.2-1B shapes once raised in the row bound's reshape)."""
    head = CodesHead(GGUFWeight.from_bytes(qtype, random_blocks(qtype, 300, 256, 1), (300, 256)))
    for q8_from in (None, 0):
        head.q8_min_rows = q8_from
        out = head(torch.zeros(0, 256))
        assert out.shape == (0, 300) and out.dtype == torch.float32


@requires_op
def test_an_engine_with_a_codes_head_prefills_long_prompts_in_chunks(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: prompts longer than a step's token budget take steps where nobody samples; the
    output is each prompt's output alone."""
    from treeserve import LLM, SamplingParams

    monkeypatch.setenv("TREESERVE_HEAD_CODES", "1")
    model, _ = load(write_synthetic_gguf(tmp_path / "m.gguf", TINY, "Q8_0", seed=3), quantization="auto")
    assert isinstance(model.lm_head, CodesHead)
    llm = LLM((model, None), speculative=None, max_batched_tokens=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, TINY.vocab_size, 150).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_use_q8_head_measures_or_takes_the_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    qtype: str) -> None:
    """``quant.use_q8_head``: the override sets the int16 pass's last row count (``all``: never int8);
    without it the measured choice is None or more than one row (a single stream keeps int16), and
    none where the operator has no vector kernel (no AVX2); Q4_1 heads never take int8; a head with the int8
    pass still picks the float32 head's greedy tokens."""
    from treeserve.models.gguf_op import q8_lanes
    from treeserve.models.quant import use_q8_head

    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, 300, 128, 3), (300, 128))
    monkeypatch.setenv("TREESERVE_HEAD_INT16_MAX_ROWS", "3")
    head = CodesHead(w)
    use_q8_head(head)
    assert head.q8_min_rows == (4 if head.int16 else None)
    monkeypatch.setenv("TREESERVE_HEAD_INT16_MAX_ROWS", "all")
    head = CodesHead(w)
    use_q8_head(head)
    assert head.q8_min_rows is None
    monkeypatch.delenv("TREESERVE_HEAD_INT16_MAX_ROWS")
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path))
    head = CodesHead(w)
    use_q8_head(head)
    if not (head.int16 and q8_lanes()):
        assert head.q8_min_rows is None
    else:
        assert head.q8_min_rows is None or head.q8_min_rows >= 2
    head.q8_min_rows = 1 if head.int16 else None
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    check_greedy_pick(head(x), x, w.dequantize(), 0.0)
    if not head.int16:
        with pytest.raises(ValueError, match="q8: the int8 first pass needs a Q4_0 or Q8_0 head"):
            head.logits(x, True)


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tied", [False, True])
def test_a_load_keeps_the_vocabulary_as_codes_by_the_rule(tmp_path: Path, tied: bool, qtype: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Untied: the embedding is read from its codes (bitwise the dense rows) whatever the head; the
    head is codes where the rule says so, and then a tied embedding too. Greedy decoding of the
    codes model equals the float32-head model's."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", replace(TINY, tie_word_embeddings=tied), qtype, seed=2)
    dense, _ = load(path, quantization=None)
    monkeypatch.setenv("TREESERVE_HEAD_CODES", "0")
    small, _ = load(path, quantization="auto")
    monkeypatch.setenv("TREESERVE_HEAD_CODES", "1")
    monkeypatch.setenv("TREESERVE_HEAD_INT16_MAX_ROWS", "all")  # the int8 pass's logits: 2^-8, not 1e-4
    big, _ = load(path, quantization="auto")
    assert isinstance(small.lm_head, ExactHead) and isinstance(big.lm_head, CodesHead)
    assert isinstance(small.embed_tokens, Embedding if tied else CodesEmbedding)
    assert isinstance(big.embed_tokens, CodesEmbedding)
    if tied:
        assert big.embed_tokens.raw.data_ptr() == big.lm_head.raw.data_ptr()  # one copy: the file's
    ids = torch.arange(TINY.vocab_size)
    assert torch.equal(big.embed_tokens(ids), dense.embed_tokens(ids).float())
    prompt = list(range(20, 40))
    with torch.inference_mode():
        a = PagedSequence(small, 64, page_size=1).extend(prompt, all_logits=True)
        b = PagedSequence(big, 64, page_size=1).extend(prompt, all_logits=True)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@requires_op
@pytest.mark.parametrize("qtype", QTYPES)
def test_row_norms_from_the_codes_match_the_dequantized_rows(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``row_norms`` (``treeserve::codes_row_norms``, rows in parallel) is the float64 norm of the float32
    dequantization rounded once to float32: within half a float32 ulp of it; without the operator, an
    error naming it."""
    import treeserve.models.vocab_codes as vc

    n, k = 301, 512
    w = GGUFWeight.from_bytes(qtype, random_blocks(qtype, n, k, 9), (n, k))
    ref = w.dequantize().double().norm(dim=1)
    got = row_norms(w)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert bool(((got.double() - ref).abs() <= 2.0**-24 * ref * (1 + 1e-9)).all())
    monkeypatch.setattr(vc, "gguf_op_available", lambda: False)
    with pytest.raises(RuntimeError, match="codes_row_norms"):
        row_norms(w)


@requires_op
def test_row_norms_operator_checks_its_arguments() -> None:
    raw = torch.from_numpy(random_blocks("Q8_0", 2, 64, 0)).reshape(2, -1)
    with pytest.raises(ValueError, match="codes_row_norms: qtype must be"):
        torch.ops.treeserve.codes_row_norms(raw, "Q5_K", 64)
    with pytest.raises(ValueError, match="K must be a positive multiple of 32"):
        torch.ops.treeserve.codes_row_norms(raw, "Q8_0", 48)
    with pytest.raises(ValueError, match=r"w must be uint8 \[N, K/32 \* block bytes\] = \[N, 40\]"):
        torch.ops.treeserve.codes_row_norms(raw, "Q4_1", 64)
    with pytest.raises(ValueError, match="w must be uint8"):
        torch.ops.treeserve.codes_row_norms(raw.to(torch.int8), "Q8_0", 64)


@requires_op
def test_the_traced_rescoring_matches_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With few candidates per row (random logits), the static re-scoring of a traced step covers
    the eager one's candidates: the same picks, every logit within the first pass's bound."""
    import treeserve.models.vocab_codes as vc

    v, k = 300, 128
    w = GGUFWeight.from_bytes("Q4_0", random_blocks("Q4_0", v, k, 4), (v, k))
    head = CodesHead(w)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    eager = head(x)
    monkeypatch.setattr(vc, "_tracing", lambda: True)
    traced = head(x)
    assert torch.equal(traced.argmax(1), eager.argmax(1))
    bound = head.row_bound(x) * head.row_norms
    assert bool(((traced - eager).abs() <= 2 * bound).all())
    assert not torch.equal(traced, eager)  # the static path re-scored entries the eager one left
