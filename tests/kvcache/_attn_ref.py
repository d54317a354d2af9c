"""Dense float64 reference attention and random paged-batch builders for the kvcache tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ancestors(parents: list[int], i: int) -> set[int]:
    """Node i and all its ancestors, by walking the parent array (plain Python)."""
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


@dataclass
class PagedBatch:
    """A random batch laid out in a paged cache with non-contiguous page assignments."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q: torch.Tensor
    qo_lens: list[int]
    kv_lens: list[int]
    page_lists: list[list[int]]
    page_size: int
    parents: list[list[int] | None] | None

    def slot_rows(self, width: int) -> torch.Tensor:
        """ReqToTokenTable-style rows of per-token slots, padded with 0."""
        rows = torch.zeros(len(self.kv_lens), width, dtype=torch.int64)
        for b, (n, pages) in enumerate(zip(self.kv_lens, self.page_lists)):
            for j in range(n):
                rows[b, j] = pages[j // self.page_size] * self.page_size + j % self.page_size
        return rows


def make_batch(
    seed: int,
    qo_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    parents: list[list[int] | None] | None = None,
    dtype: torch.dtype = torch.float32,
    spare_pages: int = 3,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-k // page_size) for k in kv_lens]
    num_pages = 1 + sum(need) + spare_pages
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 = dummy
    page_lists, off = [], 0
    for n in need:
        page_lists.append(perm[off : off + n])
        off += n
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    # every slot that holds no token of the batch (dummy page, page tails, spare pages) is NaN:
    # a backend that lets a padding or masked slot leak into a real row fails
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for n, pages in zip(kv_lens, page_lists):
        slots = torch.tensor([pages[j // page_size] * page_size + j % page_size for j in range(n)])
        k_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_cache = k_cache.view(num_pages, page_size, num_kv_heads, head_dim)
    v_cache = v_cache.view(num_pages, page_size, num_kv_heads, head_dim)
    q = torch.randn(sum(qo_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedBatch(k_cache, v_cache, q, list(qo_lens), list(kv_lens), page_lists, page_size, parents)


def reference_attention(batch: PagedBatch, scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Per-request dense attention in float64 (plain loops; the oracle)."""
    kc, vc, q = batch.k_cache.double(), batch.v_cache.double(), batch.q.double()
    _, ps, hkv, d = kc.shape
    hq = q.shape[1]
    scale = d**-0.5 if scale is None else scale
    outs, qoff = [], 0
    for b, (qo, kv, pages) in enumerate(zip(batch.qo_lens, batch.kv_lens, batch.page_lists)):
        slots = torch.tensor([pages[j // ps] * ps + j % ps for j in range(kv)])
        k = kc.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, dim=1)
        v = vc.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, dim=1)
        qq = q[qoff : qoff + qo]
        qoff += qo
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        mask = torch.zeros(qo, kv, dtype=torch.bool)
        prefix = kv - qo
        par = batch.parents[b] if batch.parents is not None else None
        for i in range(qo):
            if not causal:
                mask[i, :] = True
            elif par is None:
                mask[i, : prefix + i + 1] = True
            else:
                mask[i, :prefix] = True
                for a in ancestors(par, i):
                    mask[i, prefix + a] = True
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)
