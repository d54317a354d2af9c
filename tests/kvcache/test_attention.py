"""paged_attention / AttentionMetadata / build_tree_mask against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch
from tests._devices import backend_device
from tests.kvcache._attn_ref import PagedBatch, ancestors, make_batch, reference_attention
from hypothesis import given
from hypothesis import strategies as st

from treeserve.kvcache import AttentionMetadata, build_tree_mask, paged_attention


@st.composite
def parent_arrays(draw: st.DrawFn, n: int) -> list[int]:
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


@st.composite
def paged_batches(draw: st.DrawFn, max_b: int = 4, max_qo: int = 6, max_prefix: int = 20) -> PagedBatch:
    ps = draw(st.sampled_from([1, 4, 16]))
    b = draw(st.integers(1, max_b))
    qo = [draw(st.integers(1, max_qo)) for _ in range(b)]
    kv = [q + draw(st.integers(0, max_prefix)) for q in qo]
    parents = None
    if draw(st.booleans()):
        parents = [draw(st.none() | parent_arrays(q)) for q in qo]
    return make_batch(
        seed=draw(st.integers(0, 2**16)),
        qo_lens=qo,
        kv_lens=kv,
        page_size=ps,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([4, 8])),
        parents=parents,
    )


def build_meta(batch: PagedBatch, slot_rows: bool = False, device: torch.device | None = None) -> AttentionMetadata:
    pages = batch.slot_rows(max(batch.kv_lens) + 3) if slot_rows else batch.page_lists
    return AttentionMetadata.build(batch.qo_lens, batch.kv_lens, pages, batch.page_size, batch.parents, device=device)


def run(
    batch: PagedBatch, backend: str, meta: AttentionMetadata | None = None, slot_rows: bool = False,
    q: torch.Tensor | None = None, **kw: object,
) -> torch.Tensor:
    """``paged_attention`` of ``batch`` (or of ``q`` over its caches) on the backend's test device
    (``tests._devices``); the result comes back on the CPU."""
    dev = backend_device(backend)
    meta = build_meta(batch, slot_rows, dev) if meta is None else meta
    q = batch.q if q is None else q
    out = paged_attention(q.to(dev), batch.k_cache.to(dev), batch.v_cache.to(dev), meta, backend=backend, **kw)
    return out.cpu()


# ---------------------------------------------------------------- backends vs reference


@given(batch=paged_batches(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_per_request_backend_is_batch_invariant(batch: PagedBatch, dtype: torch.dtype) -> None:
    """Each request's rows are bitwise what it gets alone (the batch-invariant mode's attention)."""
    batch.q, batch.k_cache, batch.v_cache = batch.q.to(dtype), batch.k_cache.to(dtype), batch.v_cache.to(dtype)
    out = run(batch, "torch_per_request")
    start = 0
    for i, (qo, kv) in enumerate(zip(batch.qo_lens, batch.kv_lens)):
        parents = None if batch.parents is None else [batch.parents[i]]
        meta = AttentionMetadata.build([qo], [kv], [batch.page_lists[i]], batch.page_size, parents)
        alone = paged_attention(batch.q[start : start + qo], batch.k_cache, batch.v_cache, meta, backend="torch_per_request")
        assert torch.equal(out[start : start + qo], alone), f"request {i} changed with its batch"
        start += qo

BACKENDS = ["torch", "torch_per_request", "triton"]  # triton: on CUDA where present, else the interpreter


@pytest.mark.parametrize("backend", BACKENDS)
@given(batch=paged_batches(), slot_rows=st.booleans())
def test_backend_matches_dense_reference(backend: str, batch: PagedBatch, slot_rows: bool) -> None:
    out = run(batch, backend, slot_rows=slot_rows)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@given(batch=paged_batches(max_qo=4))
def test_non_causal_sees_whole_kv(backend: str, batch: PagedBatch) -> None:
    batch.parents = None
    out = run(batch, backend, causal=False)
    torch.testing.assert_close(out.double(), reference_attention(batch, causal=False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_context_spans_many_kv_blocks(backend: str) -> None:
    """Contexts longer than one Triton KV block and query blocks split across programs."""
    parents = [None, [-1, 0, 0, 1, 1, 2, 5, 6, 6]]
    batch = make_batch(9, [40, 9], [130, 75], 16, 2, 3, 8, parents=parents)
    torch.testing.assert_close(run(batch, backend).double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("qo", "kv", "group"),
    [
        ([1] * 5, [9] * 5, 3),  # decode, equal lengths: no mask at all
        ([1, 1, 1], [3, 17, 8], 2),  # decode, ragged: key-padding mask
        ([7, 7], [7, 7], 1),  # uniform prefill without prefix: SDPA's causal mask
        ([7, 7], [7, 7], 4),  # same, GQA folded into the query axis
        ([5], [12], 2),  # extend over a cached prefix
    ],
)
@pytest.mark.parametrize("page_size", [1, 4])
def test_torch_fast_paths(qo: list[int], kv: list[int], group: int, page_size: int) -> None:
    batch = make_batch(3, qo, kv, page_size, num_kv_heads=2, group=group, head_dim=8)
    torch.testing.assert_close(run(batch, "torch").double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("qo", "kv"), [([1, 4, 3], [40, 9, 3]), ([1, 1], [300, 7])])
def test_half_precision_accumulates_in_float32(backend: str, dtype: torch.dtype, qo: list, kv: list) -> None:
    parents = [None, [-1, 0, 0, 1], None] if len(qo) == 3 else None
    batch = make_batch(5, qo, kv, 4, 2, 2, 16, parents=parents, dtype=dtype)
    out = run(batch, backend)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # the output's rounding: 2^-8 / 2^-11 relative
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=tol, rtol=tol)


def test_custom_scale() -> None:
    batch = make_batch(6, [2, 1], [5, 4], 4, 1, 2, 8)
    out = run(batch, "torch", scale=0.3)
    torch.testing.assert_close(out.double(), reference_attention(batch, scale=0.3), atol=1e-5, rtol=1e-5)


def test_metadata_is_shared_by_layers() -> None:
    """Derived data memoized by the first layer must be valid for every other layer."""
    b1 = make_batch(1, [3, 1], [6, 9], 4, 2, 2, 8, parents=[[-1, 0, 0], None])
    b2 = make_batch(2, [3, 1], [6, 9], 4, 2, 2, 8, parents=[[-1, 0, 0], None])
    b2.page_lists = b1.page_lists  # same layout, different layer contents
    b2.k_cache, b2.v_cache = b1.k_cache.clone(), b1.v_cache.clone()
    filled = ~b1.k_cache.isnan()
    b2.k_cache[filled] = torch.randn(int(filled.sum()))
    meta = build_meta(b1)
    run(b1, "torch", meta)
    assert meta.derived, "the torch backend memoizes its gather plan in the metadata"
    torch.testing.assert_close(run(b2, "torch", meta).double(), reference_attention(b2), atol=1e-5, rtol=1e-5)


def test_metadata_layout() -> None:
    meta = AttentionMetadata.build([1, 3], [5, 3], [[7, 2, 9], [5]], 4, tree_parents=[None, [-1, 0, 0]])
    assert meta.qo_indptr.tolist() == [0, 1, 4]
    assert meta.kv_indptr.tolist() == [0, 2, 3]
    assert meta.kv_page_indices.tolist() == [7, 2, 5]  # the unused 3rd page of request 0 dropped
    assert meta.kv_last_page_len.tolist() == [1, 3]
    assert (meta.max_qo_len, meta.max_kv_len, meta.num_qo_tokens, meta.batch_size) == (3, 5, 4, 2)
    assert meta.tree_mask_indptr.tolist() == [0, 1, 10]
    assert meta.tree_mask.tolist() == [True, True, False, False, True, True, False, True, False, True]
    assert meta.qo_indptr.dtype == meta.kv_page_indices.dtype == torch.int32


@given(batch=paged_batches())
def test_metadata_invariants_and_input_forms_agree(batch: PagedBatch) -> None:
    """Page lists and ReqToTokenTable slot rows describe the same layout; FlashInfer's invariants hold."""
    from_lists, from_rows = build_meta(batch), build_meta(batch, slot_rows=True)
    for name in ("qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_len"):
        assert torch.equal(getattr(from_lists, name), getattr(from_rows, name)), name
    ps = batch.page_size
    pages_per_req = (from_lists.kv_indptr[1:] - from_lists.kv_indptr[:-1]).tolist()
    assert pages_per_req == [-(-k // ps) for k in batch.kv_lens]
    last = from_lists.kv_last_page_len.tolist()
    assert all(1 <= x <= ps for x in last)
    assert [(n - 1) * ps + x for n, x in zip(pages_per_req, last)] == batch.kv_lens
    assert from_lists.kv_page_indices.tolist() == [p for pl in batch.page_lists for p in pl]
    assert from_lists.qo_indptr[-1] == from_lists.num_qo_tokens == sum(batch.qo_lens)


# ---------------------------------------------------------------- build_tree_mask


@given(st.integers(0, 12).flatmap(parent_arrays))
def test_tree_mask_is_ancestor_or_self(parents: list[int]) -> None:
    mask = build_tree_mask(parents)
    n = len(parents)
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        assert {j for j in range(n) if mask[i, j]} == ancestors(parents, i)


def test_chain_tree_mask_is_causal() -> None:
    assert torch.equal(build_tree_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    ("parents", "match"),
    [
        ([0], r"parents\[0\] = 0"),
        ([-1, 1], r"parents\[1\] = 1"),
        ([-1, 2, 0], r"parents\[1\] = 2"),
        ([-2], r"\[-1, -1\]"),
    ],
)
def test_tree_mask_rejects_non_topological(parents: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_tree_mask(parents)


def test_tree_mask_rejects_bad_types() -> None:
    with pytest.raises(TypeError, match="integers"):
        build_tree_mask([-1.0, 0.0])
    with pytest.raises(ValueError, match="1-D"):
        build_tree_mask([[-1]])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("qo", "kv", "pages", "kw", "match"),
    [
        ([2], [1], [[1]], {}, r"qo_lens\[0\] <= kv_lens\[0\]"),
        ([0], [3], [[1]], {}, r"1 <= qo_lens\[0\]"),
        ([1, 1], [3], [[1]], {}, "equally long"),
        ([1], [9], [[1, 2]], {}, r"page list 0 has 2 pages, kv_lens\[0\] needs 3"),
        ([1], [3], [[-1]], {}, "page ids must be >= 0"),
        ([1], [3], [[1]], {"page_size": 0}, "page_size"),
        ([2], [3], [[1]], {"tree_parents": [[-1, 0, 1]]}, r"tree_parents\[0\] has 3 nodes"),
        ([2], [3], [[1]], {"tree_parents": [[-1, 1]]}, r"parents\[1\] = 1"),
        ([1], [3], [[1]], {"tree_parents": []}, "tree_parents has 0 entries"),
        ([1.5], [3], [[1]], {}, r"qo_lens\[0\] must be an int"),
    ],
)
def test_build_rejects_bad_input(qo: list, kv: list, pages: list, kw: dict, match: str) -> None:
    kw = {"page_size": 4, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        AttentionMetadata.build(qo, kv, pages, **kw)


def test_build_rejects_misaligned_slot_rows() -> None:
    rows = torch.tensor([[8, 9, 10, 11, 4, 6]])  # token 5 not at page 1's offset 1
    with pytest.raises(ValueError, match="page-aligned"):
        AttentionMetadata.build([1], [6], rows, 4)
    with pytest.raises(ValueError, match="exceeds the page table width"):
        AttentionMetadata.build([1], [7], rows, 4)
    assert AttentionMetadata.build([1], [5], rows, 4).kv_page_indices.tolist() == [2, 1]


def test_attention_rejects_bad_input() -> None:
    batch = make_batch(0, [2, 1], [5, 3], 4, 2, 2, 8)
    meta = build_meta(batch)
    q, kc, vc = batch.q, batch.k_cache, batch.v_cache
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(q.double(), kc, vc, meta)
    with pytest.raises(ValueError, match="q has 2 tokens"):
        paged_attention(q[:2], kc, vc, meta)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(q[:, :3], kc, vc, meta)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :4], kc, vc, meta)
    with pytest.raises(ValueError, match="page_size"):
        paged_attention(q, kc.view(-1, 2, 2, 8), vc.view(-1, 2, 2, 8), meta)
    with pytest.raises(ValueError, match="k/v cache shapes differ"):
        paged_attention(q, kc, vc[:-1], meta)
    with pytest.raises(ValueError, match=r"kv_page_indices must lie in \[0, 2\)"):
        paged_attention(q, kc[:2].contiguous(), vc[:2].contiguous(), build_meta(batch))
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, kc, vc, meta, backend="cuda")
    with pytest.raises(ValueError, match="flashinfer"):
        paged_attention(q, kc, vc, meta, backend="flashinfer")
    with pytest.raises(TypeError, match="AttentionMetadata"):
        paged_attention(q, kc, vc, {"page_size": 4})
    tree = AttentionMetadata.build([2, 1], [5, 3], batch.page_lists, 4, tree_parents=[[-1, -1], None])
    with pytest.raises(ValueError, match="causal=False"):
        paged_attention(q, kc, vc, tree, causal=False)


def test_triton_rejects_float64() -> None:
    batch = make_batch(0, [1], [3], 4, 1, 1, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="triton attention backend supports"):
        run(batch, "triton")


# ---------------------------------------------------------------- GPU (skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("qo", "kv", "parents"),
    [
        ([1] * 8, [100, 3, 517, 64, 1, 33, 200, 17], None),
        ([37, 1, 5], [37, 90, 300], None),
        ([6, 1, 4], [70, 20, 4], [[-1, 0, 0, 1, 1, 2], None, [-1, 0, 1, 1]]),
    ],
)
def test_gpu_backends_match_reference(
    backend: str, dtype: torch.dtype, qo: list, kv: list, parents: list | None
) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    batch = make_batch(11, qo, kv, 16, 2, 4, 64, parents=parents, dtype=dtype)
    ref = reference_attention(batch)
    batch.k_cache, batch.v_cache, batch.q = batch.k_cache.cuda(), batch.v_cache.cuda(), batch.q.cuda()
    meta = AttentionMetadata.build(qo, kv, batch.page_lists, 16, parents, device="cuda")
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, backend=backend)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("qo", "kv"), [([1, 1, 1], [4, 9, 2]), ([3, 2], [3, 7])])
def test_strided_query_from_fused_qkv(backend: str, qo: list, kv: list) -> None:
    """q as a column slice of a fused QKV projection (non-contiguous rows) is accepted."""
    batch = make_batch(4, qo, kv, 4, 2, 3, 8)
    n, hq, d = batch.q.shape
    qkv = torch.randn(n, (hq + 4) * d)
    qkv[:, : hq * d] = batch.q.reshape(n, -1)
    strided = qkv.to(backend_device(backend))[:, : hq * d].view(n, hq, d)
    assert not strided.is_contiguous()
    out = run(batch, backend, q=strided)
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


def test_auto_backend_on_cpu_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """float32 on CPU: the C++ decode backend when it builds (torch otherwise), logged once; a
    prefill chunk longer than the query view lists goes through the torch path either way."""
    import treeserve._utils as utils
    from treeserve.kvcache import backends
    from treeserve.kvcache._attention_cpu import load_cpu_decode_op
    from treeserve.kvcache.query_view import MAX_VIEW_QUERIES

    name = "cpu" if load_cpu_decode_op() is None else "torch"
    msg = f"treeserve.kvcache.paged_attention: backend={name} on cpu"
    utils._logged_once.discard(msg)
    backends._CHOSEN.clear()  # selections are memoized (and logged) once per process
    batch = make_batch(2, [MAX_VIEW_QUERIES + 1], [MAX_VIEW_QUERIES + 4], 4, 1, 2, 8)
    with caplog.at_level("INFO", logger="treeserve"):
        out = run(batch, "auto")
        run(batch, "auto")
    assert torch.equal(out, run(batch, "torch"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count(msg) == 1
