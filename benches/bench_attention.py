"""Torch paged attention (the CPU default) vs a naive per-request gather + softmax loop.

Both run in the same process on the same paged cache, float32, SmolLM2-135M head layout
(9 query heads, 3 KV heads, head_dim 64), page_size 1 (the engine default), random
non-contiguous pages. The metadata is built once per step and shared by all layers, so ours is
timed per layer with its derived gather plan already memoized (what layers 2..30 pay); the
first-layer cost (plan derivation included) is printed too. The naive baseline gets its
per-request slot tensors precomputed for free. Ratios are asserted with a wide margin only.
Threads: ``TREESERVE_BENCH_THREADS`` (default 1: on a shared 2-core machine, two intra-op
threads make both sides' timings depend mostly on the neighbours' load).
"""

from __future__ import annotations

import os

import pytest
import torch

from _timing import min_seconds  # benches/ is on sys.path (no __init__.py)

from treeserve.kvcache import AttentionMetadata, paged_attention

HQ, HKV, D, PAGE = 9, 3, 64, 1
THREADS = int(os.environ.get("TREESERVE_BENCH_THREADS", "1"))


def _case(qo_lens: list[int], kv_lens: list[int], parents: list | None = None):
    gen = torch.Generator().manual_seed(0)
    need = [-(-k // PAGE) for k in kv_lens]
    num_pages = 1 + sum(need)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    pages, off = [], 0
    for n in need:
        pages.append(perm[off : off + n])
        off += n
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    q = torch.randn(sum(qo_lens), HQ, D, generator=gen)
    meta = AttentionMetadata.build(qo_lens, kv_lens, pages, PAGE, tree_parents=parents)
    slots = [torch.tensor([p[j // PAGE] * PAGE + j % PAGE for j in range(n)]) for p, n in zip(pages, kv_lens)]
    masks = None
    if parents is not None:
        masks = [meta.tree_mask[a:b].view(n, n) for a, b, n in
                 zip(meta.tree_mask_indptr[:-1].tolist(), meta.tree_mask_indptr[1:].tolist(), qo_lens)]
    return q, k_cache, v_cache, pages, meta, slots, masks


def _naive(q, k_cache, v_cache, slots, masks, qo_lens, kv_lens) -> torch.Tensor:
    """What one writes first: per request, gather K/V, repeat KV heads, masked softmax."""
    outs, start = [], 0
    kf, vf = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    for b, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        k = kf[slots[b]].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [H, kv, D]
        v = vf[slots[b]].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
        qq = q[start : start + qo].transpose(0, 1)  # [H, qo, D]
        start += qo
        s = qq @ k.transpose(1, 2) * D**-0.5
        mask = torch.ones(qo, kv, dtype=torch.bool).tril(kv - qo)
        if masks is not None:
            mask[:, kv - qo :] = masks[b]
        s = s.masked_fill(~mask, float("-inf"))
        outs.append((s.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def _tree_parents(n: int) -> list[int]:
    return [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary tree in BFS order


# name -> (qo_lens, kv_lens, tree parents, asserted speedup floor). The extend case has only 4
# big loop iterations, so the loop is nearly as good there: its floor only says "not slower".
CASES = {
    "decode_b32_ctx512": ([1] * 32, [480 + 2 * i for i in range(32)], None, 1.3),
    "mixed_31decode_1chunk256": ([1] * 31 + [256], [480 + 2 * i for i in range(31)] + [256], None, 1.3),
    "prefill_4x128_over_prefix": ([128] * 4, [128, 192, 384, 128], None, 0.8),
    "tree_b8_16nodes_ctx512": ([16] * 8, [512] * 8, [_tree_parents(16)] * 8, 1.3),
}


@pytest.fixture
def threads():
    """Run with ``THREADS`` intra-op threads, restoring the previous count for later benches."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield THREADS
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_attention_vs_naive_loop(benchmark, threads: int, name: str) -> None:
    qo, kv, parents, floor = CASES[name]
    q, kc, vc, pages, meta, slots, masks = _case(qo, kv, parents)
    first_layer = min_seconds(
        lambda: paged_attention(q, kc, vc, AttentionMetadata.build(qo, kv, pages, PAGE, parents), backend="torch"), 5
    )
    ours = benchmark.pedantic(lambda: paged_attention(q, kc, vc, meta, backend="torch"), rounds=30, warmup_rounds=2)
    torch.testing.assert_close(ours, _naive(q, kc, vc, slots, masks, qo, kv), atol=1e-4, rtol=1e-4)
    ours_s = benchmark.stats.stats.min
    naive_s = min_seconds(lambda: _naive(q, kc, vc, slots, masks, qo, kv), 30)
    ratio = naive_s / ours_s
    benchmark.extra_info.update(naive_ms=naive_s * 1e3, ours_ms=ours_s * 1e3, speedup=ratio)
    print(
        f"\n{name} ({threads} thread(s)): torch paged_attention {ours_s * 1e3:.3f} ms/layer "
        f"(first layer incl. metadata build + plan {first_layer * 1e3:.3f} ms), "
        f"naive loop {naive_s * 1e3:.3f} ms -> {ratio:.2f}x"
    )
    assert ratio > floor, f"torch attention vs the naive loop: {ratio:.2f}x, expected > {floor}x"



def test_cpu_decode_operator_crossover() -> None:
    """Issue 15: the C++ decode operator (backend ``cpu``) vs the torch backend on pure decode
    steps, batch 1/16/64 x context 128/1024 x page size 1/16, float32 and bf16. Prints a table
    (ms per layer, plan memoized for torch); asserts only that both agree."""
    from treeserve.kvcache._attention_cpu import load_cpu_decode_op, paged_decode_attention

    if load_cpu_decode_op() is not None:
        pytest.skip(f"C++ operator unavailable: {load_cpu_decode_op()}")
    torch.set_num_threads(THREADS)
    print(f"\nthreads={THREADS}  batch ctx page dtype: torch ms / cpu ms = speedup")
    for dtype in (torch.float32, torch.bfloat16):
        for page in (1, 16):
            for bsz in (1, 16, 64):
                for ctx in (128, 1024):
                    gen = torch.Generator().manual_seed(bsz + ctx)
                    need = -(-ctx // page)
                    perm = (torch.randperm(bsz * need, generator=gen) + 1).tolist()
                    pages = [perm[i * need : (i + 1) * need] for i in range(bsz)]
                    kc = torch.randn(1 + bsz * need, page, HKV, D, generator=gen).to(dtype)
                    vc = torch.randn(1 + bsz * need, page, HKV, D, generator=gen).to(dtype)
                    q = torch.randn(bsz, HQ, D, generator=gen).to(dtype)
                    meta = AttentionMetadata.build([1] * bsz, [ctx] * bsz, pages, page)
                    ref = paged_attention(q, kc, vc, meta, backend="torch")
                    # the operator itself: bfloat16 is not offered as the 'cpu' backend
                    got = paged_decode_attention(q, kc, vc, meta, D**-0.5)
                    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
                    t_torch = min_seconds(lambda: paged_attention(q, kc, vc, meta, backend="torch"), 5)
                    t_cpu = min_seconds(lambda: paged_decode_attention(q, kc, vc, meta, D**-0.5), 5)
                    print(f"{bsz:3d} {ctx:5d} {page:3d} {str(dtype)[6:]:8s}: {t_torch * 1e3:7.3f} / "
                          f"{t_cpu * 1e3:7.3f} = {t_torch / t_cpu:5.2f}x")
