"""Split-KV (flash-decoding) Triton attention: the split rule, and the split kernel + merge against
the float64 reference (on CUDA where present, else the interpreter)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._devices import backend_device
from tests.kvcache._attn_ref import PagedBatch, make_batch, reference_attention
from tests.kvcache.test_attention import build_meta, parent_arrays

from treeserve.kvcache import AttentionMetadata
from treeserve.kvcache import _attention_triton as tri
from treeserve.kvcache.split_kv import CTAS_PER_SM, MAX_SPLITS, MIN_SPLIT_KEYS, kv_splits

DEV = backend_device("triton")

# ---------------------------------------------------------------- the rule


@given(programs=st.integers(1, 5000), max_kv_len=st.integers(1, 200_000), num_sms=st.integers(1, 200))
def test_rule_bounds_and_monotonicity(programs: int, max_kv_len: int, num_sms: int) -> None:
    s = kv_splits(programs, max_kv_len, num_sms)
    assert 1 <= s <= MAX_SPLITS
    if s > 1:  # a split is only made when the GPU is not full and each split keeps enough keys
        assert programs * s <= CTAS_PER_SM * num_sms
        assert s * MIN_SPLIT_KEYS <= max_kv_len
    if programs >= CTAS_PER_SM * num_sms or max_kv_len < 2 * MIN_SPLIT_KEYS:
        assert s == 1
    assert kv_splits(programs + 1, max_kv_len, num_sms) <= s  # more programs: never more splits
    assert kv_splits(programs, max_kv_len + MIN_SPLIT_KEYS, num_sms) >= s  # longer: never fewer
    assert kv_splits(programs, max_kv_len, num_sms + 1) >= s  # bigger GPU: never fewer


@pytest.mark.parametrize(
    ("programs", "max_kv_len", "num_sms", "want"),
    [
        (64 * 8, 2048, 132, 1),  # batch 64, 8 KV heads fill an H200: no split
        (16 * 8, 1024, 132, 4),  # batch-16 tree verify: 528 // 128 programs
        (1 * 8, 4096, 132, MAX_SPLITS),  # batch 1, long context: as many as allowed
        (1 * 8, 300, 132, 300 // MIN_SPLIT_KEYS),  # batch 1, short context: bounded by its length
        (2 * 8, 1024, 108, 8),  # A100 (108 SMs), batch 2: 1024 // 128 keys bound it
    ],
)
def test_rule_documented_cases(programs: int, max_kv_len: int, num_sms: int, want: int) -> None:
    assert kv_splits(programs, max_kv_len, num_sms) == want


@pytest.mark.parametrize("field", ["programs", "max_kv_len", "num_sms"])
@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_rule_rejects_bad_input(field: str, bad: object) -> None:
    args = {"programs": 8, "max_kv_len": 1024, "num_sms": 132, field: bad}
    with pytest.raises(ValueError, match=rf"{field} must be an int >= 1"):
        kv_splits(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the split kernel vs the reference


def run_split(batch: PagedBatch, num_splits: int | None, meta: AttentionMetadata | None = None) -> torch.Tensor:
    meta = build_meta(batch, device=DEV) if meta is None else meta
    d = batch.q.shape[-1]
    out = tri.paged_attention_triton(batch.q.to(DEV), batch.k_cache.to(DEV), batch.v_cache.to(DEV), meta,
                                     d**-0.5, True, num_splits)
    return out.cpu()


@st.composite
def split_batches(draw: st.DrawFn) -> PagedBatch:
    """Decode or tree-verify batches (GQA ratios 1..4, pages of 1/4/16 slots), KV lengths from 1
    (a lone token) across page and 64-key block boundaries."""
    ps = draw(st.sampled_from([1, 4, 16]))
    b = draw(st.integers(1, 3))
    tree = draw(st.booleans())
    qo = [draw(st.integers(1, 5)) if tree else 1 for _ in range(b)]
    kv = [q + draw(st.sampled_from([0, 1, ps - 1, ps, ps + 1, 63, 64, 65]) | st.integers(0, 150)) for q in qo]
    parents = [draw(st.none() | parent_arrays(q)) for q in qo] if tree else None
    return make_batch(draw(st.integers(0, 2**16)), qo, kv, ps, draw(st.sampled_from([1, 2])),
                      draw(st.sampled_from([1, 2, 3, 4])), 8, parents=parents)


@settings(max_examples=20)
@given(batch=split_batches(), num_splits=st.integers(1, 6))
def test_split_matches_reference(batch: PagedBatch, num_splits: int) -> None:
    """Any split count (more splits than 64-key blocks leaves splits empty) gives the reference."""
    out = run_split(batch, num_splits)
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


def test_auto_rule_splits_a_long_batch_one_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher applies the rule to the metadata's host sizes; a batch-1 decode over 2 x
    ``MIN_SPLIT_KEYS`` keys is split, and is exact."""
    chosen: list[int] = []

    def spy(programs: int, max_kv_len: int, num_sms: int) -> int:
        chosen.append(kv_splits(programs, max_kv_len, num_sms))
        return chosen[-1]

    monkeypatch.setattr(tri, "kv_splits", spy)
    kv = 2 * MIN_SPLIT_KEYS + 5
    batch = make_batch(3, [1], [kv], 16, 1, 4, 8)
    out = run_split(batch, None)
    assert chosen == [2]  # 1 program (1 KV head, 1 query block): bounded by the length
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


def test_static_metadata_with_shorter_contexts_leaves_splits_empty() -> None:
    """What a CUDA-graph replay sees: ``max_kv_len`` is the buffers' full context (fixing the split
    count at capture), the requests are shorter, and most splits cover nothing."""
    batch = make_batch(4, [1, 1], [3, 70], 4, 2, 2, 8)
    meta = build_meta(batch, device=DEV)
    capacity = 8 * MIN_SPLIT_KEYS
    static = AttentionMetadata(meta.qo_indptr, meta.kv_indptr, meta.kv_page_indices, meta.kv_last_page_len,
                               meta.page_size, meta.max_qo_len, capacity, meta.num_qo_tokens)
    hkv = batch.k_cache.shape[2]
    assert kv_splits(2 * hkv, capacity, tri._num_sms(DEV)) == 8
    out = run_split(batch, None, static)
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile", [tri.Tiles(16, 16, 16, 4), tri.Tiles(32, 64, 16, 8)])
def test_tile_override_matches_reference(tile: tri.Tiles) -> None:
    """The benchmarks' tile sweep computes the same attention (split and unsplit)."""
    batch = make_batch(8, [1, 3], [70, 40], 4, 2, 3, 8, parents=[None, [-1, 0, 0]])
    meta = build_meta(batch, device=DEV)
    for splits in (1, 3):
        out = tri.paged_attention_triton(batch.q.to(DEV), batch.k_cache.to(DEV), batch.v_cache.to(DEV), meta,
                                         8**-0.5, True, splits, tile).cpu()
        torch.testing.assert_close(out.double(), reference_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile", [(16, 16, 16, 4), tri.Tiles(16, 16, 4, 4), tri.Tiles(8, 16, 16, 4), tri.Tiles(32, 64, 8, 8),
                                  tri.Tiles(16, 24, 16, 4), tri.Tiles(16, 16, 16, 3)])
def test_bad_tile_is_refused(tile: object) -> None:
    batch = make_batch(0, [1], [3], 4, 1, 1, 8)
    meta = build_meta(batch, device=DEV)
    with pytest.raises(ValueError, match="tile must be a Tiles"):
        tri.paged_attention_triton(batch.q.to(DEV), batch.k_cache.to(DEV), batch.v_cache.to(DEV), meta, 0.3, True,
                                   1, tile)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_num_splits_must_be_a_positive_int(bad: object) -> None:
    batch = make_batch(0, [1], [3], 4, 1, 1, 8)
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        run_split(batch, bad)  # type: ignore[arg-type]


def test_decode_graph_runner_with_split_triton_attention_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode graph runner's static path (captured on CUDA, eager on CPU) with split Triton
    attention: the split count comes from the static metadata (``max_kv_len`` = the buffers' full
    context), the requests' real contexts are shorter, and the tokens and logits equal the eager
    runner's. ``MIN_SPLIT_KEYS`` is lowered so that the tiny test context is split."""
    import random

    from tests.runner._helpers import commit, make_bench, step_and_compare, tiny_model

    from treeserve.kvcache import select_backend, split_kv

    monkeypatch.setattr(split_kv, "MIN_SPLIT_KEYS", 16)
    chosen: list[int] = []
    real_auto = tri.auto_splits
    monkeypatch.setattr(tri, "auto_splits", lambda *a: chosen.append(real_auto(*a)) or chosen[-1])
    bench = make_bench(tiny_model(device=str(DEV)), page_size=4, max_batch=4, max_requests=8)
    bench.graph.attention = select_backend("paged_attention", "triton", DEV, torch.float32)
    # the reference runner attends with torch: its (dynamic, short) metadata is not split, and on
    # CUDA its Triton calls would be counted below
    bench.eager.attention = select_backend("paged_attention", "torch", DEV, torch.float32)
    bench.graph.capture()  # CUDA: graphs over the split kernels; CPU: nothing to capture
    rng = random.Random(5)
    reqs = bench.add_requests(rng, 3)
    for _ in range(2):
        commit(reqs, step_and_compare(bench, reqs))
    assert chosen and min(chosen) > 1, chosen  # every step (and capture) took the split path
