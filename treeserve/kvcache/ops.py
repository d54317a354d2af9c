"""KV ops over the paged pool: store new K/V, compact an accepted draft path, plan a rollback.

Each op has one public function with ``backend="auto" | "torch" | "triton"``; ``auto`` is
Triton on CUDA and torch elsewhere (logged once). A layer's cache is
``[num_pages, page_size, num_kv_heads, head_dim]`` and a slot is ``page * page_size + offset``,
i.e. a row of the cache viewed as ``[num_pages * page_size, num_kv_heads, head_dim]``.

Inputs are validated before anything is written (state unchanged on error). Value checks that
need a device sync (slot ranges, uniqueness) run only with ``TREESERVE_DEBUG_CHECKS=1`` (the
tests turn it on) and never while a CUDA graph is being captured: the step's slots come from the
scheduler's own table, and a host read per layer would cost a sync per layer.
``backend`` is a name (memoized selection, see ``treeserve.kvcache.backends``) or a
:class:`~treeserve.kvcache.backends.KernelBackend` chosen once by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from treeserve.kvcache.backends import KernelBackend, select_backend
from treeserve.kvcache._checks import (
    check_cache_pair,
    check_distinct,
    check_index_tensor,
    check_range,
    debug_checks_enabled,
)

__all__ = ["RollbackPlan", "compact_tree_path", "padded_path_moves", "rollback_slots", "store_kv"]

def _num_slots(cache: torch.Tensor) -> int:
    return cache.shape[0] * cache.shape[1]


def _check_tokens(name: str, x: torch.Tensor, cache: torch.Tensor, n: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    want = (n, cache.shape[2], cache.shape[3])
    if tuple(x.shape) != want:
        raise ValueError(f"{name} must be [N={n}, num_kv_heads, head_dim] = {want}, got {tuple(x.shape)}")
    if x.dtype != cache.dtype:
        raise TypeError(f"{name} dtype {x.dtype} differs from the cache dtype {cache.dtype}")
    if x.device != cache.device:
        raise ValueError(f"{name} is on {x.device} but the cache is on {cache.device}")


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str | KernelBackend = "auto",
) -> None:
    """Write token ``i``'s K/V (``k, v: [N, num_kv_heads, head_dim]``) at slot ``slots[i]``.

    ``slots`` is an int32/int64 ``[N]`` tensor of flat slot indices in
    ``[0, num_pages * page_size)``. Slots may repeat only for padding that targets the dummy
    page 0 (which write wins is unspecified). Raises ``TypeError``/``ValueError`` on a dtype,
    shape or device mismatch (and, with debug checks on, a slot out of range) without writing.
    """
    check_cache_pair(k_cache, v_cache)
    check_index_tensor("slots", slots)
    n = slots.shape[0]
    _check_tokens("k", k, k_cache, n)
    _check_tokens("v", v, k_cache, n)
    if slots.device != k_cache.device:
        raise ValueError(f"slots is on {slots.device} but the cache is on {k_cache.device}")
    if debug_checks_enabled():
        check_range("slots", slots, 0, _num_slots(k_cache))
    _kernel("store_kv", backend, k_cache)(k_cache, v_cache, slots, k, v)


def compact_tree_path(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    backend: str | KernelBackend = "auto",
) -> None:
    """Copy the K/V at ``src_slots[i]`` to ``dst_slots[i]`` in every layer.

    Used after tree verification to make the accepted path contiguous. All sources are read
    before any destination is written, so ``src`` and ``dst`` may overlap in any order.
    ``dst_slots`` must be distinct (``ValueError`` otherwise) except on the dummy page 0, where
    fixed-shape padding moves (see :func:`padded_path_moves`) may repeat; both are ``[M]`` int
    tensors in range, and every layer's caches share one shape, dtype and device.
    """
    if len(k_caches) != len(v_caches) or len(k_caches) == 0:
        raise ValueError(
            f"k_caches and v_caches must be equally long and non-empty, got {len(k_caches)} and {len(v_caches)}"
        )
    ref = k_caches[0]
    for layer, (kc, vc) in enumerate(zip(k_caches, v_caches, strict=True)):
        check_cache_pair(kc, vc, name=f"k_caches[{layer}]")
        if kc.shape != ref.shape or kc.dtype != ref.dtype or kc.device != ref.device:
            raise ValueError(f"k_caches[{layer}] differs from layer 0 in shape, dtype or device")
    check_index_tensor("src_slots", src_slots)
    check_index_tensor("dst_slots", dst_slots)
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots and dst_slots must have the same length, got {src_slots.shape[0]} and {dst_slots.shape[0]}"
        )
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but the caches are on {ref.device}")
    if debug_checks_enabled():
        for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
            check_range(name, t, 0, _num_slots(ref))
        check_distinct("dst_slots", dst_slots, ignore_below=ref.shape[1])
    kernel = _kernel("compact_tree_path", backend, ref)
    if src_slots.numel():
        kernel(k_caches, v_caches, src_slots, dst_slots)


def _kernel(op: str, backend: str | KernelBackend, cache: torch.Tensor) -> KernelBackend:
    if isinstance(backend, KernelBackend):
        if backend.spec.op != op:
            raise ValueError(f"backend is a {backend.spec.op} kernel, expected one for {op}")
        return backend
    return select_backend(op, backend, cache.device, cache.dtype)


class RollbackPlan(NamedTuple):
    """What to do with a batch's draft slots after verification.

    - ``src_slots``/``dst_slots`` ``[M]``: moves that make each request's accepted nodes occupy
      the first ``num_kept[b]`` draft slots in path order (pass to ``compact_tree_path``; empty
      for chain drafts, whose accepted tokens are already in place).
    - ``free_slots`` ``[F]``: draft slots holding no accepted KV after the moves (return them
      to the allocator; with ``page_size > 1`` free only the pages they cover entirely).
    - ``num_kept`` ``[B]``: accepted draft tokens per request; request ``b`` keeps
      ``draft_slots[b, :num_kept[b]]``.
    """

    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    free_slots: torch.Tensor
    num_kept: torch.Tensor


def rollback_slots(
    draft_slots: torch.Tensor, num_draft: torch.Tensor, accepted: torch.Tensor
) -> RollbackPlan:
    """Plan the KV moves and frees after verifying a batch of (chain or tree) drafts.

    ``draft_slots [B, K]``: row ``b`` holds the slots of request ``b``'s draft nodes in node
    order (node ``i`` of the parent array at column ``i``), valid in the first ``num_draft[b]``
    columns (``num_draft [B]`` in ``[0, K]``). ``accepted`` is either

    - ``[B]`` accept lengths (chain drafts: nodes ``0 .. a-1`` accepted), each in
      ``[0, num_draft[b]]``; or
    - ``[B, P]`` accepted node indices of a tree path in root-to-leaf order, padded with ``-1``
      at the end, strictly increasing, each ``< num_draft[b]``, ``P <= K``.

    Returns a :class:`RollbackPlan`; fully vectorized (no loop over requests).
    """
    check_index_tensor("draft_slots", draft_slots, ndim=2)
    check_index_tensor("num_draft", num_draft)
    bsz, k_max = draft_slots.shape
    dev = draft_slots.device
    if num_draft.shape[0] != bsz:
        raise ValueError(f"num_draft must have B={bsz} entries, got {num_draft.shape[0]}")
    check_range("num_draft", num_draft, 0, k_max + 1)
    if not isinstance(accepted, torch.Tensor) or accepted.dim() not in (1, 2):
        raise ValueError(f"accepted must be a [B] tensor of accept lengths or [B, P] node indices, got {accepted!r}")
    check_index_tensor("accepted", accepted, ndim=accepted.dim())
    if accepted.shape[0] != bsz:
        raise ValueError(f"accepted must have B={bsz} rows, got {accepted.shape[0]}")
    num_draft = num_draft.long()
    cols = torch.arange(k_max, device=dev)
    if accepted.dim() == 1:
        num_kept = accepted.long()
        if bool((num_kept < 0).any()) or bool((num_kept > num_draft).any()):
            raise ValueError("accepted lengths must lie in [0, num_draft[b]]")
        empty = draft_slots.new_empty(0)
        src_slots, dst_slots = empty, empty
    else:
        nodes = accepted.long()
        p = nodes.shape[1]
        if p > k_max:
            raise ValueError(f"accepted has P={p} columns, more than draft_slots' K={k_max}")
        valid = nodes >= 0
        num_kept = valid.sum(1)
        if bool((valid != (cols[:p] < num_kept[:, None])).any()):
            raise ValueError("accepted rows must be node indices followed only by -1 padding")
        if bool((nodes < -1).any()) or bool((valid & (nodes >= num_draft[:, None])).any()):
            raise ValueError("accepted node indices must lie in [0, num_draft[b]) (or -1 as padding)")
        if p > 1 and bool((valid[:, 1:] & (nodes[:, 1:] <= nodes[:, :-1])).any()):
            raise ValueError("accepted node indices must be strictly increasing along each path")
        src, dst, move = _path_moves(draft_slots, nodes)
        src_slots, dst_slots = src[move], dst[move]
    free = (cols >= num_kept[:, None]) & (cols < num_draft[:, None])
    return RollbackPlan(src_slots, dst_slots, draft_slots[free], num_kept)


def _path_moves(draft_slots: torch.Tensor, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src, dst, move)``, each ``[B, P]``: the slot of accepted node ``path[b, d]`` goes to
    draft slot ``d``; ``move`` is False for padding and for nodes already in place."""
    src = draft_slots.gather(1, path.long().clamp(min=0))
    dst = draft_slots[:, : path.shape[1]]
    return src, dst, (path >= 0) & (src != dst)


def padded_path_moves(draft_slots: torch.Tensor, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compaction of accepted tree paths as fixed-shape ``(src_slots, dst_slots)``, ``[B * P]``.

    ``draft_slots [B, K]`` and ``path [B, P]`` (``P <= K``) are as in :func:`rollback_slots`.
    Entries that move nothing (padding, nodes already in place) become the no-op move 0 -> 0 on
    the dummy page, so the shapes never depend on the values: no host sync, safe inside a CUDA
    graph. Pass the result to :func:`compact_tree_path`; values are not validated here.
    """
    src, dst, move = _path_moves(draft_slots, path)
    return src.masked_fill(~move, 0).reshape(-1), dst.masked_fill(~move, 0).reshape(-1)
