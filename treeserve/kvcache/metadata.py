"""One step's batch layout for paged attention (:class:`AttentionMetadata`) and tree masks.

Kept apart from the attention dispatcher so that the dispatcher and its backends all import it
from here (no import circle). ``AttentionMetadata.build`` validates what it is given (the API
boundary); the runner's step-input builder constructs it directly from tensors it made itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from treeserve.kvcache.backends import KernelBackend

__all__ = ["AttentionMetadata", "IntSeq", "build_tree_mask"]

IntSeq = Sequence[int] | torch.Tensor


def build_tree_mask(parents: IntSeq, device: torch.device | str | None = None) -> torch.Tensor:
    """Ancestor-or-self mask of a draft token tree given as a parent array.

    ``parents[i]`` is the parent node of node ``i`` (``-1``: the root, i.e. the last committed
    token, which lies in the cached prefix); it must satisfy ``-1 <= parents[i] < i``
    (topological order), else ``ValueError``. Returns a bool ``[n, n]`` tensor with
    ``mask[i, j]`` true iff node ``j`` is node ``i`` or one of its ancestors.
    """
    par = torch.as_tensor(parents, device=device)
    if par.dim() != 1:
        raise ValueError(f"parents must be a 1-D parent array, got shape {tuple(par.shape)}")
    if par.numel() and (par.dtype.is_floating_point or par.dtype == torch.bool):
        raise TypeError(f"parents must hold integers, got {par.dtype}")
    par = par.long()
    n = par.numel()
    idx = torch.arange(n, device=par.device)
    bad = (par < -1) | (par >= idx)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"parents[{i}] = {int(par[i])} must lie in [-1, {i - 1}] (parent before child, -1 = root)"
        )
    mask = torch.eye(n, dtype=torch.bool, device=par.device)
    cur = par.clone()
    while bool((cur >= 0).any()):  # one pass per tree level, vectorized over nodes
        live = cur >= 0
        mask[idx[live], cur[live]] = True
        cur = torch.where(live, par[cur.clamp(min=0)], cur)
    return mask


def _as_lens(name: str, lens: IntSeq) -> list[int]:
    if isinstance(lens, torch.Tensor):
        if lens.dim() != 1 or lens.dtype.is_floating_point:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints")
        return [int(x) for x in lens.tolist()]
    out = []
    for i, x in enumerate(lens):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}] must be an int, got {type(x).__name__}")
        out.append(x)
    return out


def _pages_from_slot_rows(
    rows: torch.Tensor, kv_lens: list[int], page_size: int, device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """Page ids of every request from ``ReqToTokenTable`` rows of per-token slots (validated)."""
    if rows.dim() != 2 or rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"page table rows must be a 2-D int tensor [B, max_context_len], got {rows.dtype} {tuple(rows.shape)}"
        )
    bsz, width = rows.shape
    if bsz != len(kv_lens):
        raise ValueError(f"page table rows has {bsz} rows, expected B={len(kv_lens)}")
    max_kv = max(kv_lens)
    if max_kv > width:
        raise ValueError(f"kv_lens max {max_kv} exceeds the page table width {width}")
    rows = rows[:, :max_kv].to(device=device, dtype=torch.long)
    kv = torch.tensor(kv_lens, device=device)
    j = torch.arange(max_kv, device=device)
    valid = j < kv[:, None]
    if bool((valid & (rows < 0)).any()):
        raise ValueError("page table rows hold negative slots within kv_lens")
    pages = torch.div(rows[:, ::page_size], page_size, rounding_mode="floor")  # [B, ceil(max/ps)]
    expect = pages.repeat_interleave(page_size, dim=1)[:, :max_kv] * page_size + j % page_size
    if bool((valid & (expect != rows)).any()):
        raise ValueError(
            f"page table rows are not page-aligned: token j must sit at slot page*{page_size} + j % {page_size}"
        )
    npages = [-(-n // page_size) for n in kv_lens]
    keep = torch.arange(pages.shape[1], device=device) < torch.tensor(npages, device=device)[:, None]
    return pages[keep], npages


def _pages_from_lists(
    page_lists: Sequence[IntSeq], kv_lens: list[int], page_size: int, device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    if len(page_lists) != len(kv_lens):
        raise ValueError(f"page lists has {len(page_lists)} entries, expected B={len(kv_lens)}")
    npages = [-(-n // page_size) for n in kv_lens]
    chunks = []
    for b, (pl, need) in enumerate(zip(page_lists, npages, strict=True)):
        t = torch.as_tensor(pl, dtype=torch.long).reshape(-1).cpu()
        if t.numel() < need:
            raise ValueError(f"page list {b} has {t.numel()} pages, kv_lens[{b}] needs {need}")
        chunks.append(t[:need])
    flat = torch.cat(chunks).to(device) if chunks else torch.empty(0, dtype=torch.long, device=device)
    if bool((flat < 0).any()):
        raise ValueError("page ids must be >= 0")
    return flat, npages


def _indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out.to(device)


@dataclass(slots=True, eq=False)
class AttentionMetadata:
    """One step's batch layout for paged attention, shared by every layer of the model.

    FlashInfer's paged layout: request ``b`` owns queries ``qo_indptr[b]:qo_indptr[b+1]`` of the
    flat ``[N, H, D]`` query tensor and pages ``kv_page_indices[kv_indptr[b]:kv_indptr[b+1]]``,
    of which the last holds ``kv_last_page_len[b]`` (in ``[1, page_size]``) tokens; entries past
    ``kv_indptr[B]`` are never read (a static runner's buffer is longer than a step). All index
    tensors are int32 on the step's device. ``tree_mask`` (bool, optional) concatenates each
    request's row-major ``qo_len x qo_len`` mask over its last ``qo_len`` KV tokens (the new
    ones), starting at ``tree_mask_indptr[b]``; the cached prefix is always visible. Requests
    without a tree in a tree batch get the causal mask. ``max_qo_len``, ``max_kv_len`` and
    ``num_qo_tokens`` are host ints. ``attention_backend``: the attention kernel the step's
    runner chose once for its engine (``paged_attention(backend="auto")`` uses it), or None.
    Immutable by convention; backends memoize derived data in ``derived``.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    max_qo_len: int
    max_kv_len: int
    num_qo_tokens: int
    tree_mask: torch.Tensor | None = None
    tree_mask_indptr: torch.Tensor | None = None
    attention_backend: KernelBackend | None = None
    derived: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.qo_indptr.device

    @classmethod
    def build(
        cls,
        qo_lens: IntSeq,
        kv_lens: IntSeq,
        pages: torch.Tensor | Sequence[IntSeq],
        page_size: int,
        tree_parents: Sequence[IntSeq | None] | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Build the metadata of one step (host-side work; once per step, not per layer).

        - ``qo_lens[b]``: new tokens of request ``b`` (``1 <= qo_lens[b] <= kv_lens[b]``).
        - ``kv_lens[b]``: its KV length including the new tokens.
        - ``pages``: either a sequence of per-request page-id lists (at least
          ``ceil(kv_len / page_size)`` pages each; extra trailing pages are ignored), or a 2-D
          int tensor ``[B, >= max_kv_len]`` of per-token slots (rows of
          ``ReqToTokenTable.table``), which must be page-aligned
          (token ``j`` at ``page * page_size + j % page_size``).
        - ``tree_parents``: optional per-request parent arrays (length ``qo_lens[b]``, see
          :func:`build_tree_mask`) or ``None`` for a causal request.
        - ``device``: where the tensors live (default: that of ``pages`` if a tensor, else CPU).
        """
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        qo = _as_lens("qo_lens", qo_lens)
        kv = _as_lens("kv_lens", kv_lens)
        if len(qo) != len(kv) or not qo:
            raise ValueError(f"qo_lens and kv_lens must be non-empty and equally long, got {len(qo)} and {len(kv)}")
        for b, (q, k) in enumerate(zip(qo, kv, strict=True)):
            if not 1 <= q <= k:
                raise ValueError(f"need 1 <= qo_lens[{b}] <= kv_lens[{b}], got qo_len={q}, kv_len={k}")
        if device is None:
            device = pages.device if isinstance(pages, torch.Tensor) else torch.device("cpu")
        device = torch.device(device)
        if isinstance(pages, torch.Tensor):
            page_indices, npages = _pages_from_slot_rows(pages, kv, page_size, device)
        else:
            page_indices, npages = _pages_from_lists(pages, kv, page_size, device)
        last = [k - (n - 1) * page_size for k, n in zip(kv, npages, strict=True)]
        tree_mask = tree_indptr = None
        if tree_parents is not None:
            tree_mask, tree_indptr = _flat_tree_masks(tree_parents, qo, device)
        return cls(
            qo_indptr=_indptr(qo, device),
            kv_indptr=_indptr(npages, device),
            kv_page_indices=page_indices.to(torch.int32),
            kv_last_page_len=torch.tensor(last, dtype=torch.int32, device=device),
            page_size=page_size,
            max_qo_len=max(qo),
            max_kv_len=max(kv),
            num_qo_tokens=sum(qo),
            tree_mask=tree_mask,
            tree_mask_indptr=tree_indptr,
        )


def _flat_tree_masks(
    tree_parents: Sequence[IntSeq | None], qo: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if len(tree_parents) != len(qo):
        raise ValueError(f"tree_parents has {len(tree_parents)} entries, expected B={len(qo)}")
    masks = []
    for b, (par, n) in enumerate(zip(tree_parents, qo, strict=True)):
        if par is None:
            masks.append(torch.ones(n, n, dtype=torch.bool, device=device).tril_())
            continue
        m = build_tree_mask(par, device=device)
        if m.shape[0] != n:
            raise ValueError(f"tree_parents[{b}] has {m.shape[0]} nodes, expected qo_lens[{b}] = {n}")
        masks.append(m)
    flat = torch.cat([m.reshape(-1) for m in masks])
    return flat, _indptr([n * n for n in qo], device)
