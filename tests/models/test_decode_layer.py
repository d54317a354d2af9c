"""The fused C++ decode path (``treeserve::decode_layers``) against the Python layer path.

Both run the same operators in the same order, so logits and every layer's KV cache must agree
bit for bit (GGUF-packed, dense, int8, GGUF with int8 activations and mixed projections);
fallbacks (prefill, int4-plane codes, biases, compile, batch invariance) must leave the Python
path in charge; bad operands must fail with the field named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.kvcache.query_view import MAX_VIEW_QUERIES
from treeserve.models import LlamaForCausalLM
from treeserve.models._decode_op import _operands, load_decode_op, run_decode_layers
from treeserve.models.config import tiny_config
from treeserve.models.gguf_op import GGUFWeight
from treeserve.models.int8_op import Int8Weight, int8_available
from treeserve.models.invariant import make_batch_invariant
from treeserve.models.quant import PackedLinear, quantize_int4
from treeserve.models.synthetic import random_model
from treeserve.scheduler import DraftTree

requires_op = pytest.mark.skipif(load_decode_op() is not None, reason="C++ decode_layers operator unavailable")
PROJS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
QTYPES = ("Q4_0", "Q4_1", "Q8_0")
LARGE = ("dense", "int8", "q8") if int8_available() else ("dense", "q8")  # a batch above max_rows
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # the caches the operator writes


def gguf_model(seed: int = 0, max_rows: int = 8, num_layers: int = 2, large: str = "dense",
               **overrides: object) -> LlamaForCausalLM:
    """A random float32 model whose projections are GGUF ``PackedLinear`` (qtypes mixed per layer);
    their batches above ``max_rows`` take ``large``: ``"dense"`` (``F.linear``), ``"int8"`` (the
    int8 GEMM) or ``"q8"`` (the codes with int8 activations, ``large_q8``)."""
    config = tiny_config(num_layers=num_layers, head_dim=32, **overrides)
    model = random_model(config, seed=seed, init_std=0.05)
    for i, layer in enumerate(model.layers):
        for j, name in enumerate(PROJS):
            mod = layer.get_submodule(name)
            dense = mod.weight.detach()
            qtype = QTYPES[(i + j) % len(QTYPES)]
            raw = quantize(dense.numpy(), GGMLQuantizationType[qtype])
            codes = GGUFWeight.from_bytes(qtype, raw, tuple(dense.shape))
            parent, _, attr = name.rpartition(".")
            packed = PackedLinear(codes, codes.dequantize(), mod.bias, packed_max_rows=max_rows)
            packed.int8 = Int8Weight.from_dense(packed.weight) if large == "int8" else None
            packed.large_q8 = large == "q8"
            setattr(layer.get_submodule(parent), attr, packed)
    return model


def decode_step(model: LlamaForCausalLM, ctx: list[int], page_size: int, seed: int, fused: bool,
                kv_dtype: torch.dtype = torch.float32, trees: list[list[int]] | None = None):
    """One decode step (one new token per request, after ``ctx[b] - 1`` cached random tokens of
    KV) on a pool of ``kv_dtype`` filled with random K/V; returns ``(logits, k_caches, v_caches)``.
    With ``trees`` a verify step: request ``b`` also scores draft nodes with parents
    ``trees[b]`` (-1 = the pending token) at positions ``ctx[b] - 1 + depth``, logits of every row."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    nodes = [0] * len(ctx) if trees is None else [len(t) for t in trees]
    kv_lens = [c + n for c, n in zip(ctx, nodes)]
    pages_per = [-(-k // page_size) for k in kv_lens]
    num_pages = 1 + sum(pages_per)
    pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    for c in pool.k_caches + pool.v_caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    pages, start = [], 0
    for n in pages_per:
        pages.append(perm[start : start + n])
        start += n
    parents = [[-1] + [p + 1 for p in t] for t in trees] if trees is not None else None
    depths = [DraftTree([0] * len(t), t).depths() for t in trees] if trees is not None else [[]] * len(ctx)
    positions = torch.tensor([c - 1 + d for c, ds in zip(ctx, depths) for d in [0, *ds]])
    slots = torch.tensor([p[j // page_size] * page_size + j % page_size
                          for p, c, k in zip(pages, ctx, kv_lens) for j in range(c - 1, k)])
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen)
    meta = AttentionMetadata.build([1 + n for n in nodes], kv_lens, pages, page_size, parents)
    model._decode_plan = False if fused else None  # None: the Python path
    logits = model(ids, positions, pool, slots, meta, torch.arange(len(positions)))
    return logits, pool.k_caches, pool.v_caches


def assert_same(ref, got) -> None:  # type: ignore[no-untyped-def]
    """Logits and every layer's caches bit for bit."""
    for a, b in zip(ref, got):
        if isinstance(a, list):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        else:
            assert torch.equal(a, b)


@requires_op
@settings(max_examples=16, deadline=None)
@given(
    batch=st.integers(1, 8),
    page_size=st.sampled_from([1, 4, 16]),
    max_ctx=st.integers(1, 70),
    max_rows=st.sampled_from([0, 3, 8]),  # 0: every projection takes ``large``; 3: mixed by batch
    large=st.sampled_from(LARGE),
    kv_dtype=st.sampled_from(KV_DTYPES),  # 16-bit: KV stored rounded, q rounded to attend
    seed=st.integers(0, 2**16),
    arch=st.sampled_from(["llama", "qwen3"]),  # qwen3: per-head query / key norms
)
def test_fused_equals_python_path(batch: int, page_size: int, max_ctx: int, max_rows: int, large: str,
                                  kv_dtype: torch.dtype, seed: int, arch: str) -> None:
    model = gguf_model(seed=seed % 3, max_rows=max_rows, large=large, arch=arch)
    ctx = np.random.default_rng(seed).integers(1, max_ctx + 1, batch).tolist()
    ref = decode_step(model, ctx, page_size, seed, fused=False, kv_dtype=kv_dtype)
    got = decode_step(model, ctx, page_size, seed, fused=True, kv_dtype=kv_dtype)
    assert model.decode_plan() is not None
    assert_same(ref, got)


@requires_op
@settings(max_examples=16, deadline=None)
@given(
    trees=st.lists(st.lists(st.integers(-1, 7), max_size=8), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 4]),
    max_ctx=st.integers(1, 70),
    max_rows=st.sampled_from([0, 3, 8]),
    large=st.sampled_from(LARGE),
    kv_dtype=st.sampled_from(KV_DTYPES),
    seed=st.integers(0, 2**16),
    arch=st.sampled_from(["llama", "qwen3"]),
)
def test_verify_step_fused_equals_python_path(trees: list[list[int]], page_size: int, max_ctx: int, max_rows: int,
                                              large: str, kv_dtype: torch.dtype, seed: int, arch: str) -> None:
    """A verify step (the pending token plus draft-tree nodes per request, positions prefix_len +
    depth) through ``decode_layers`` equals the Python layers bit for bit, logits and caches; a
    step the query view cannot list (a tree with a gap on pages larger than one token) stays
    in Python, and the fused operator serves every other."""
    trees = [[min(p, k - 1) for k, p in enumerate(t)] for t in trees]  # parent before child
    model = gguf_model(seed=seed % 3, max_rows=max_rows, large=large, arch=arch)
    ctx = np.random.default_rng(seed).integers(1, max_ctx + 1, len(trees)).tolist()
    ref = decode_step(model, ctx, page_size, seed, fused=False, kv_dtype=kv_dtype, trees=trees)
    calls = []
    real = torch.ops.treeserve.decode_layers
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.ops.treeserve, "decode_layers", lambda *a: calls.append(1) or real(*a))
        got = decode_step(model, ctx, page_size, seed, fused=True, kv_dtype=kv_dtype, trees=trees)
    chains = all(t == list(range(-1, len(t) - 1)) for t in trees)
    assert calls == ([1] if page_size == 1 or chains else [])
    assert_same(ref, got)


@requires_op
@settings(max_examples=8, deadline=None)
@given(batch=st.integers(2, 13), seed=st.integers(0, 2**16))
def test_each_request_of_a_batch_is_the_request_alone(batch: int, seed: int) -> None:
    """A fused decode step of ``batch`` requests on the GGUF codes' int16 path (``packed_max_rows``
    above the batch) gives each request the final hidden state it gets alone, bit for bit, on every
    host: the operator sums every row of a call as the row alone (two accumulator chains per row in
    each register block), so the batch a request lands in never changes what the head scores (the
    head's own passes differ by row count; the engine's heads re-score every greedy contender
    exactly, ``ExactHead``)."""
    model = gguf_model(seed=seed % 3, max_rows=16)
    cfg, page_size = model.config, 4
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
    positions = torch.randint(0, 50, (batch,), generator=gen)

    def step(rows: list[int]) -> torch.Tensor:  # each request: its token alone in a page of its own
        pool = KVPool(cfg.num_layers, 1 + len(rows), page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        meta = AttentionMetadata.build([1] * len(rows), [1] * len(rows), [[1 + i] for i in range(len(rows))], page_size)
        slots = torch.tensor([(1 + i) * page_size for i in range(len(rows))])
        model._decode_plan = None
        seen: list[torch.Tensor] = []
        hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
        try:
            model(ids[rows], positions[rows], pool, slots, meta, torch.arange(len(rows)))
        finally:
            hook.remove()
        return seen[0]

    together = step(list(range(batch)))
    for b in range(batch):
        assert torch.equal(together[b : b + 1], step([b])), b


@requires_op
@pytest.mark.parametrize("head_dim", [32, 64])  # 64: the attention operator's compile-time (AVX-512) size
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_dense_model_equals_python_path(head_dim: int, kv_dtype: torch.dtype) -> None:
    """Plain ``Linear`` projections (an HF checkpoint without quantization) take the operator too."""
    model = random_model(tiny_config(num_layers=3, head_dim=head_dim), seed=1)
    assert model.decode_plan() is not None
    ref = decode_step(model, [1, 17, 40, 9], 4, 3, fused=False, kv_dtype=kv_dtype)
    got = decode_step(model, [1, 17, 40, 9], 4, 3, fused=True, kv_dtype=kv_dtype)
    assert got[1][0].dtype == kv_dtype
    assert torch.equal(ref[0], got[0])
    assert all(torch.equal(x, y) for x, y in zip(ref[1] + ref[2], got[1] + got[2]))


@requires_op
def test_fused_path_runs_and_writes_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused operator is what serves an eligible step (not a silent fallback)."""
    model = gguf_model(max_rows=2)
    calls = []
    real = torch.ops.treeserve.decode_layers

    def spy(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.treeserve, "decode_layers", spy)
    _, k, _ = decode_step(model, [5, 9, 1], 4, 0, fused=True)
    assert calls == [3]


@requires_op
def test_int8_activation_codes_take_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches above ``packed_max_rows`` of ``large_q8`` projections run in the operator, through
    ``gguf_linear_q8`` on the codes, bit for bit the Python layers (which call the same op)."""
    model = gguf_model(max_rows=2, large="q8")
    qtypes = []
    real = torch.ops.treeserve.decode_layers

    def spy(*args):  # type: ignore[no-untyped-def]
        qtypes.append(list(args[5]))
        return real(*args)

    monkeypatch.setattr(torch.ops.treeserve, "decode_layers", spy)
    ref = decode_step(model, [5, 9, 1, 30], 4, 1, fused=False)
    got = decode_step(model, [5, 9, 1, 30], 4, 1, fused=True)
    assert qtypes == [[f"q8:{QTYPES[i % 3]}" for i in range(8)]]
    assert_same(ref, got)


@requires_op
def test_ineligible_steps_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("decode_layers must not be called")

    # Int4-plane codes (torch's int4 kernel) at a batch they serve; above it the dense weight.
    model = random_model(tiny_config(num_layers=1, head_dim=32))
    layer = model.layers[0]
    for name in PROJS:
        parent, _, attr = name.rpartition(".")
        codes = quantize_int4(layer.get_submodule(name).weight.detach())
        packed = PackedLinear(codes, codes.dequantize().float(), None, torch.float32, packed_max_rows=2)
        setattr(layer.get_submodule(parent), attr, packed)
    assert model.decode_plan() is not None
    decode_step(model, [3, 4, 5], 4, 0, fused=True)  # 3 rows: dense, fused
    monkeypatch.setattr(torch.ops.treeserve, "decode_layers", boom)
    decode_step(model, [3, 4], 4, 0, fused=True)
    model = gguf_model()
    # A prefill chunk longer than the query view lists (short ones run as verify steps do).
    n = MAX_VIEW_QUERIES + 1
    pool = KVPool(2, 8, 4, model.config.num_kv_heads, model.config.head_dim, torch.float32)
    meta = AttentionMetadata.build([n], [n], [[1, 2, 3, 4, 5]], 4)
    model(torch.arange(n), torch.arange(n), pool, torch.arange(4, 4 + n), meta, torch.tensor([n - 1]))
    # While Dynamo traces, and on a batch-invariant model (row-tiled projections).
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        decode_step(model, [3], 4, 0, fused=True)
    decode_step(make_batch_invariant(gguf_model()), [3], 4, 0, fused=True)
    # Weights that require grad, with grad enabled (the operator has no autograd formula).
    model = gguf_model(max_rows=0)
    model.layers[0].input_layernorm.weight.requires_grad_(True)
    decode_step(model, [3], 4, 0, fused=True)
    # A bias on a projection.
    biased = gguf_model(attention_bias=True)
    assert biased.decode_plan() is None


@requires_op
def test_plan_dropped_on_apply() -> None:
    model = gguf_model()
    assert model.decode_plan() is not None
    model.to(torch.bfloat16)
    assert model.decode_plan() is None


@requires_op
def test_bad_operands_are_named() -> None:
    model = gguf_model()
    plan = model.decode_plan()
    cfg = model.config
    pool = KVPool(2, 4, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    meta = AttentionMetadata.build([1], [3], [[1]], 4)
    h = torch.randn(1, cfg.hidden_size)
    run = lambda pos, slots, hh=h: run_decode_layers(plan, hh, model.rope_cache, pos, pool, slots, meta)  # noqa: E731
    with pytest.raises(ValueError, match="out_slots must lie in"):
        run(torch.tensor([2]), torch.tensor([16]))
    with pytest.raises(ValueError, match="positions must lie in"):
        run(torch.tensor([cfg.max_position_embeddings]), torch.tensor([6]))
    with pytest.raises(TypeError, match="out_slots must be int32 or int64"):
        run(torch.tensor([2]), torch.tensor([6.0]))
    with pytest.raises(ValueError, match="positions and out_slots must be"):
        run(torch.tensor([2, 3]), torch.tensor([6]))
    bad_meta = AttentionMetadata.build([1], [3], [[4]], 4)  # page 4 of a 4-page pool
    with pytest.raises(ValueError, match="kv_page_indices must lie in"):
        run_decode_layers(plan, h, model.rope_cache, torch.tensor([2]), pool, torch.tensor([6]), bad_meta)
    k0 = pool.k_caches[0].clone()
    with pytest.raises(ValueError, match="need L >= 1"):
        torch.ops.treeserve.decode_layers(
            h, model.rope_cache, torch.tensor([2]), plan.norms[:-1], *_operands(plan, 1), pool.k_caches,
            pool.v_caches, torch.tensor([6]), meta.kv_indptr, meta.kv_page_indices, meta.kv_last_page_len,
            cfg.num_heads, cfg.num_kv_heads, plan.eps, plan.scale,
        )
    for norms, error, message in [
            ([*plan.norms, *[torch.ones(32)] * 3, torch.ones(31)], ValueError, r"norms\[7\] must be \[head_dim = 32\]"),
            ([*plan.norms[:3], torch.ones(cfg.hidden_size, dtype=torch.float64)], TypeError, "norms must be float32"),
            ([*plan.norms[:3], torch.ones(cfg.hidden_size + 1)], ValueError, r"norms\[3\] must be \[hidden = 64\]")]:
        with pytest.raises(error, match=message):  # Qwen3's norms after the layer norms; a bad layer norm
            torch.ops.treeserve.decode_layers(
                h, model.rope_cache, torch.tensor([2]), norms, *_operands(plan, 1), pool.k_caches, pool.v_caches,
                torch.tensor([6]), meta.kv_indptr, meta.kv_page_indices, meta.kv_last_page_len, cfg.num_heads,
                cfg.num_kv_heads, plan.eps, plan.scale,
            )
    assert torch.equal(pool.k_caches[0], k0)  # nothing written on error


@requires_op
@pytest.mark.parametrize("rows", [2, 3])  # GGUF blocks; dense weights (max_rows 2)
def test_opcheck(rows: int) -> None:
    # No int8 variant: opcheck cannot clone oneDNN's opaque prepacked weights, and traced steps
    # never take the int8 GEMM (run_decode_layers and PackedLinear.large_forward decline it).
    model = gguf_model(max_rows=2)
    plan = model.decode_plan()
    cfg = model.config
    pool = KVPool(2, 4, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    meta = AttentionMetadata.build([1, 1], [3, 6], [[1], [2, 3]], 4)
    args = (
        torch.randn(2, cfg.hidden_size), model.rope_cache, torch.tensor([2, 5]), plan.norms,
        *_operands(plan, rows), pool.k_caches, pool.v_caches, torch.tensor([6, 13]), meta.kv_indptr, meta.kv_page_indices,
        meta.kv_last_page_len, cfg.num_heads, cfg.num_kv_heads, plan.eps, plan.scale,
    )
    torch.library.opcheck(torch.ops.treeserve.decode_layers.default, args)
