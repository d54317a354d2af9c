"""Per-step messages from rank 0 to the workers: a fixed int64 header, then one int64 payload.

Two broadcasts per message, no pickling: the header (:data:`HEADER_LEN` int64s) says the
operation and every size, so a worker allocates the payload and splits it without any other
information. Operations:

- ``FORWARD``: the model call's tensors (input ids, positions, KV slots, logits rows) and the
  attention metadata (index tensors, host ints, optional tree mask), plus which KV pool
  (``pool_id``, with its ``num_pages`` / ``page_size``) the call writes;
- ``COMPACT``: speculative verification's KV moves ``src -> dst`` in a pool;
- ``STOP``: leave the worker loop.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch

from treeserve.kvcache import AttentionMetadata, select_backend
from treeserve.kvcache.backends import registered_backends

__all__ = ["HEADER_LEN", "Op", "Step", "pack_compact", "pack_forward", "pack_stop", "unpack"]

HEADER_LEN = 16


class Op(IntEnum):
    STOP = 0
    FORWARD = 1
    COMPACT = 2


# Header fields, by index.
(_OP, _POOL, _NUM_PAGES, _PAGE_SIZE, _N_TOK, _N_LOGITS, _BATCH, _N_PAGEIDX, _TREE, _MAX_QO, _MAX_KV, _NUM_QO,
 _N_MOVES, _BACKEND) = range(14)  # fmt: skip


class Step(NamedTuple):
    """One decoded message. ``forward`` holds the model call's arguments (``kv`` excluded) for
    ``FORWARD``; ``moves`` the ``(src, dst)`` slots for ``COMPACT``."""

    op: Op
    pool_id: int
    num_pages: int
    page_size: int
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor] | None
    moves: tuple[torch.Tensor, torch.Tensor] | None


def _header(op: Op, pool_id: int, num_pages: int, page_size: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[_OP], h[_POOL], h[_NUM_PAGES], h[_PAGE_SIZE] = int(op), pool_id, num_pages, page_size
    return h


def pack_stop() -> tuple[torch.Tensor, torch.Tensor]:
    return _header(Op.STOP, 0, 0, 0), torch.zeros(0, dtype=torch.int64)


def pack_forward(
    pool_id: int,
    num_pages: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_slots: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Header and payload (on ``input_ids``' device) of one model call."""
    h = _header(Op.FORWARD, pool_id, num_pages, meta.page_size)
    tree = meta.tree_mask
    h[_N_TOK], h[_N_LOGITS], h[_BATCH] = input_ids.numel(), logits_indices.numel(), meta.batch_size
    h[_N_PAGEIDX], h[_TREE] = meta.kv_page_indices.numel(), -1 if tree is None else tree.numel()
    h[_MAX_QO], h[_MAX_KV], h[_NUM_QO] = meta.max_qo_len, meta.max_kv_len, meta.num_qo_tokens
    if meta.attention_backend is not None:  # by its index among the registered names (0: none)
        h[_BACKEND] = 1 + registered_backends("paged_attention").index(meta.attention_backend.name)
    parts = [input_ids, positions, out_slots, logits_indices, meta.qo_indptr, meta.kv_indptr,
             meta.kv_page_indices, meta.kv_last_page_len]  # fmt: skip
    if tree is not None:
        parts += [meta.tree_mask_indptr, tree]
    dev = input_ids.device
    return h, torch.cat([p.reshape(-1).to(device=dev, dtype=torch.int64) for p in parts])


def pack_compact(pool_id: int, num_pages: int, page_size: int, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Header and payload of a KV compaction (``src``, ``dst``: equally long int slot tensors)."""
    h = _header(Op.COMPACT, pool_id, num_pages, page_size)
    h[_N_MOVES] = src.numel()
    return h, torch.cat([src.reshape(-1), dst.reshape(-1)]).to(torch.int64)


def payload_len(header: list[int]) -> int:
    """Payload elements the header announces."""
    op = Op(header[_OP])
    if op == Op.STOP:
        return 0
    if op == Op.COMPACT:
        return 2 * header[_N_MOVES]
    b, tree = header[_BATCH], header[_TREE]
    n = 3 * header[_N_TOK] + header[_N_LOGITS] + 2 * (b + 1) + header[_N_PAGEIDX] + b
    return n + (b + 1 + tree if tree >= 0 else 0)


def unpack(header: list[int], payload: torch.Tensor, dtype: torch.dtype = torch.float32) -> Step:
    """Decode a message (``header`` as host ints; ``payload`` of ``payload_len(header)``); an
    attention backend named by the header is selected for ``payload``'s device and ``dtype``."""
    op = Op(header[_OP])
    pool, pages, ps = header[_POOL], header[_NUM_PAGES], header[_PAGE_SIZE]
    if op != Op.FORWARD:
        moves = payload.view(2, -1).unbind(0) if op == Op.COMPACT else None
        return Step(op, pool, pages, ps, None, moves)
    n, m, b, tree = header[_N_TOK], header[_N_LOGITS], header[_BATCH], header[_TREE]
    sizes = [n, n, n, m, b + 1, b + 1, header[_N_PAGEIDX], b]
    if tree >= 0:
        sizes += [b + 1, tree]
    parts = payload.split(sizes)
    i32 = torch.int32
    backend = None
    if header[_BACKEND]:
        name = registered_backends("paged_attention")[header[_BACKEND] - 1]
        backend = select_backend("paged_attention", name, payload.device, dtype)
    meta = AttentionMetadata(
        qo_indptr=parts[4].to(i32),
        kv_indptr=parts[5].to(i32),
        kv_page_indices=parts[6].to(i32),
        kv_last_page_len=parts[7].to(i32),
        page_size=ps,
        max_qo_len=header[_MAX_QO],
        max_kv_len=header[_MAX_KV],
        num_qo_tokens=header[_NUM_QO],
        tree_mask=parts[9].bool() if tree >= 0 else None,
        tree_mask_indptr=parts[8].to(i32) if tree >= 0 else None,
        attention_backend=backend,
    )
    return Step(op, pool, pages, ps, (parts[0], parts[1], parts[2], meta, parts[3]), None)
