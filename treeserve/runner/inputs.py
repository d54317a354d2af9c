"""One vectorized builder of a step's model inputs, shared by every caller of the model forward.

The eager runner, the static (CUDA-graph) runner, the draft-model drafter and
:class:`~treeserve.runner.sequence.PagedSequence` all describe a step the same way: for each
request ``b`` a row of a per-token slot table, the position ``starts[b]`` of its first new token,
``qo_lens[b]`` new tokens, and optionally a token tree over them. :func:`build_step_inputs`
turns that into the flat token ids, positions, KV write slots, :class:`AttentionMetadata` and
logits rows of the model forward contract, with tensor ops only (no per-token Python loop) and
one host->device copy of the index data.

Everything here trusts its caller (the scheduler or the static runner built the description);
validation of hand-made metadata lives at the API boundary, ``AttentionMetadata.build``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import numpy as np
import torch

from treeserve.kvcache import AttentionMetadata, KernelBackend, KVPool
from treeserve.sampling import SamplingBatch, SamplingRows, bitmask_words, stack_bitmasks
from treeserve.scheduler import DraftTree, Request, ScheduledItem

__all__ = [
    "CausalLM",
    "admit_requests",
    "DraftArrays",
    "StepIndex",
    "StepInputs",
    "build_step_inputs",
    "draft_arrays",
    "draft_laws",
    "grammar_masks",
    "with_grammar_masks",
    "step_index",
    "step_token_ids",
    "tree_ancestors",
]


class CausalLM(Protocol):
    """What the runner needs of a model (``treeserve.models.LlamaForCausalLM`` is one)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class StepInputs:
    """The model forward's arguments for one step (all on the step's device).

    ``input_ids``, ``positions``, ``out_slots``: ``[N]`` (``N = sum(qo_lens)``);
    ``logits_indices``: the flat token rows whose logits the forward returns, item by item.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor


def tree_ancestors(parents: np.ndarray) -> np.ndarray:
    """Ancestor-or-self masks ``[B, M, M]`` (bool) of trees given as local parent arrays ``[B, M]``.

    ``parents[b, k] < k`` (topological order) or ``-1`` (a child of the cached prefix); one
    vectorized pass per node column, in numpy (host index arithmetic: a few microseconds per op,
    against several times that for a small torch op)."""
    b, m = parents.shape
    anc = np.zeros((b, m, m), dtype=bool)
    rows = np.arange(b)
    for k in range(m):
        par = parents[:, k]
        anc[:, k] = anc[rows, np.maximum(par, 0)] & (par >= 0)[:, None]
        anc[:, k, k] = True
    return anc


IntArray = Sequence[int] | np.ndarray | torch.Tensor


class StepIndex(NamedTuple):
    """A step's index arrays computed on the host (numpy, int64 unless said), before any gather
    from the slot table: see :func:`step_index` for the meaning of each."""

    slot_index: np.ndarray
    page_index: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    tree_mask: np.ndarray | None
    tree_mask_indptr: np.ndarray | None
    qo_max: int
    max_kv_len: int


def step_index(
    width: int,
    rows: IntArray,
    starts: IntArray,
    qo_lens: IntArray,
    page_size: int,
    logit_rows: IntArray,
    *,
    parents: np.ndarray | torch.Tensor | None = None,
    num_real: IntArray | None = None,
) -> StepIndex:
    """The host-side half of :func:`build_step_inputs` over a slot table of ``width`` columns:
    ``slot_index`` / ``page_index`` are flat indices into the table (``row * width + column``)
    of each new token's KV slot and of each KV page's first slot (gather them from
    ``ReqToTokenTable.host``); ``positions``, ``logits_indices``, ``qo_indptr``, ``kv_indptr``,
    ``last_page_len`` as in :class:`AttentionMetadata`; ``tree_mask`` (flat bool) and its
    ``tree_mask_indptr`` when ``parents`` is given."""
    rows_a, starts_a, qo, logit_a = (np.asarray(x, dtype=np.int64) for x in (rows, starts, qo_lens, logit_rows))
    bsz = qo.shape[0]
    qo_indptr = np.zeros(bsz + 1, dtype=np.int64)
    np.add.accumulate(qo, out=qo_indptr[1:])
    total = int(qo_indptr[-1])
    qo_max = 1 if total == bsz else int(qo.max())  # every qo_lens[b] >= 1
    real_len = qo if num_real is None else np.asarray(num_real, dtype=np.int64)
    kv_lens = starts_a + qo
    # Per-token arrays as a per-request base repeated over its tokens plus a flat counter
    # (token i of request b sits at flat index qo_indptr[b] + i, position starts[b] + i).
    if total == bsz:  # one new token per request (decodes): the bases are the answers
        chain_pos, row_base = starts_a.copy(), rows_a * width  # a copy: the caller's array may be shared
    else:
        chain_pos = np.arange(total) + np.repeat(starts_a - qo_indptr[:-1], qo)
        row_base = np.repeat(rows_a * width, qo)
    slot_index = row_base + chain_pos
    if num_real is not None:  # padding tokens write to slot 0
        slot_index = np.where(chain_pos < np.repeat(starts_a + real_len, qo), slot_index, 0)
    if total == bsz:  # a request's one token has logits or not
        logits_indices = np.flatnonzero(logit_a)
    else:  # the last logit_rows[b] tokens of request b
        logits_indices = np.flatnonzero(np.arange(total) >= np.repeat(qo_indptr[1:] - logit_a, qo))
    tree_mask = tree_indptr = None
    if parents is None:
        positions = chain_pos
    else:
        cols = np.arange(qo_max)
        valid = cols < qo[:, None]
        anc = _step_ancestors(np.asarray(parents, dtype=np.int64), valid)
        positions = (starts_a[:, None] + anc.sum(-1) - 1)[valid]
        mask = anc & (cols < real_len[:, None])[:, None, :]
        tree_mask = mask[valid[:, :, None] & valid[:, None, :]]
        tree_indptr = np.concatenate([[0], np.cumsum(qo * qo)])
    # KV pages: the table's pages while they hold real tokens, then the dummy page 0. Page j of
    # request b is table[row, j * page_size], flat index row * width + j * page_size.
    if page_size == 1:
        npages, last_page_len = kv_lens, np.ones(bsz, dtype=np.int64)
    else:
        npages = (kv_lens + page_size - 1) // page_size
        last_page_len = kv_lens - (npages - 1) * page_size
    kv_indptr = np.zeros(bsz + 1, dtype=np.int64)
    np.add.accumulate(npages, out=kv_indptr[1:])
    num_pages = int(kv_indptr[-1])
    page_index = np.arange(0, num_pages * page_size, page_size) + np.repeat(
        rows_a * width - kv_indptr[:-1] * page_size, npages
    )
    if num_real is not None:
        page_index = np.where(page_index < np.repeat(rows_a * width + starts_a + real_len, npages), page_index, 0)
    return StepIndex(slot_index, page_index, positions, logits_indices, qo_indptr, kv_indptr, last_page_len,
                     tree_mask, tree_indptr, qo_max, int(kv_lens.max()))  # fmt: skip


def build_step_inputs(
    table: torch.Tensor,
    rows: IntArray,
    starts: IntArray,
    qo_lens: IntArray,
    input_ids: IntArray,
    page_size: int,
    logit_rows: IntArray,
    *,
    parents: np.ndarray | torch.Tensor | None = None,
    num_real: IntArray | None = None,
    attention_backend: KernelBackend | None = None,
) -> StepInputs:
    """Model inputs of a step over the slot table ``table [R, W]`` (its device is the step's).

    Per request ``b`` (host ints: lists, numpy arrays or CPU tensors ``[B]``): ``rows[b]`` its
    table row, ``starts[b]`` the position of its first new token, ``qo_lens[b] >= 1`` its new
    tokens (``input_ids``, flat, request by request), ``logit_rows[b]`` how many of its last new
    tokens get logits (0, 1 or ``qo_lens[b]``). New token ``i`` writes its K/V to
    ``table[row, start + i]``.

    ``parents`` (``[B, max qo]``, optional): token ``i``'s parent among the request's new tokens
    (``-1``: the cached prefix); positions are then ``start + depth`` and attention follows the
    tree (a causal request is the chain ``-1, 0, 1, ...``). ``num_real[b]`` (default
    ``qo_lens``): only the first ``num_real[b]`` new tokens are real; the others are padding
    that writes to ``table[0, 0]`` (slot 0 of a ``ReqToTokenTable``'s dummy row), sees only the
    request's first new token and the prefix, and is seen by nobody, and KV pages past the real
    tokens read as the page of ``table[0, 0]`` (the dummy page).
    ``attention_backend``: the kernel the caller chose once, carried by the metadata.

    Index arithmetic runs in numpy on the host (:func:`step_index`: a few microseconds per
    array op, against several for a small torch op); on CPU the table is gathered in numpy too
    and the results wrap the arrays (no copy), on an accelerator they travel to the device in
    one copy.
    """
    dev = table.device
    idx = step_index(table.shape[1], rows, starts, qo_lens, page_size, logit_rows, parents=parents, num_real=num_real)
    total, num_pages, bsz = idx.slot_index.shape[0], idx.page_index.shape[0], idx.last_page_len.shape[0]
    tree_mask = tree_indptr = None
    if idx.tree_mask is not None:
        tree_mask = torch.from_numpy(idx.tree_mask).to(dev, non_blocking=True)
        tree_indptr = torch.from_numpy(idx.tree_mask_indptr).to(dev, torch.int32)
    ids = np.asarray(input_ids, dtype=np.int64) if not isinstance(input_ids, torch.Tensor) else input_ids.cpu().numpy()
    if dev.type == "cpu":  # numpy gathers straight from the table's memory; no copies
        flat = table.numpy().reshape(-1)
        out_slots = torch.from_numpy(flat[idx.slot_index])
        page_slots = flat[idx.page_index]
        kv_pages = torch.from_numpy((page_slots if page_size == 1 else page_slots // page_size).astype(np.int32))
        positions_d, logits_d, ids_d = (torch.from_numpy(x) for x in (idx.positions, idx.logits_indices, ids))
        qo_indptr_d, kv_indptr_d, last_d = (
            torch.from_numpy(x.astype(np.int32)) for x in (idx.qo_indptr, idx.kv_indptr, idx.last_page_len)
        )
    else:  # one host->device copy of every index, one gather from the table
        parts = (idx.slot_index, idx.page_index, idx.positions, idx.logits_indices, idx.qo_indptr, idx.kv_indptr,
                 idx.last_page_len, ids)  # fmt: skip
        packed = torch.from_numpy(np.concatenate(parts)).to(dev, non_blocking=True)
        gathered = table.view(-1)[packed[: total + num_pages]]
        sizes = (total, num_pages, total, idx.logits_indices.shape[0], bsz + 1, bsz + 1, bsz, total)
        _, _, positions_d, logits_d, qo_indptr_d, kv_indptr_d, last_d, ids_d = packed.split(sizes)
        out_slots = gathered[:total]
        kv_pages = torch.div(gathered[total:], page_size, rounding_mode="floor").to(torch.int32)
        qo_indptr_d, kv_indptr_d, last_d = (x.to(torch.int32) for x in (qo_indptr_d, kv_indptr_d, last_d))
    meta = AttentionMetadata(
        qo_indptr=qo_indptr_d,
        kv_indptr=kv_indptr_d,
        kv_page_indices=kv_pages,
        kv_last_page_len=last_d,
        page_size=page_size,
        max_qo_len=idx.qo_max,
        max_kv_len=idx.max_kv_len,
        num_qo_tokens=total,
        tree_mask=tree_mask,
        tree_mask_indptr=tree_indptr,
        attention_backend=attention_backend,
    )
    return StepInputs(ids_d, positions_d, out_slots, meta, logits_d)


def _step_ancestors(parents: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Ancestor-or-self masks ``[B, Q, Q]`` of a step's requests (``parents [B, Q]``, ``valid``
    their real columns): the chains (causal requests, drafted chains) as a lower triangle, the
    other trees walked over their own (small) width only."""
    b, q = parents.shape
    is_tree = ((parents != np.arange(q) - 1) & valid).any(1)
    anc = np.broadcast_to(np.tri(q, dtype=bool), (b, q, q)).copy()
    trees = np.flatnonzero(is_tree)
    if trees.size:
        width = int(valid[trees].sum(1).max())
        anc[trees, :width, :width] = tree_ancestors(parents[trees, :width])
    return anc


class DraftArrays(NamedTuple):
    """A step's draft trees as ``[B, K]`` CPU tensors (``K`` >= every item's node count).

    ``tokens`` (0 past a tree's end), ``parents`` (-1 past the end), ``num_draft [B]``, and
    ``slot_index``: the flat index into the request->slot table (``row * width + position``) of
    each node's KV slot, 0 (the dummy row's slot 0) past the end.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_draft: torch.Tensor
    slot_index: torch.Tensor


def draft_arrays(items: Sequence[ScheduledItem], width: int, k: int) -> DraftArrays:
    """Pack the draft trees of ``items`` (an item without one has 0 nodes) into ``K = k`` columns.

    Node ``j`` of an item starting at ``start`` sits at position ``start + 1 + j`` of its table
    row (``width`` = the table's ``max_context_len``).
    """
    b = len(items)
    tokens = np.zeros((b, k), dtype=np.int64)  # numpy, then wrapped: ~5x fewer microseconds than torch ops
    parents = np.full((b, k), -1, dtype=np.int64)
    num_draft = np.zeros(b, dtype=np.int64)
    for i, it in enumerate(items):
        if it.draft is not None and len(it.draft):
            n = len(it.draft)
            tokens[i, :n] = it.draft.tokens
            parents[i, :n] = it.draft.parents
            num_draft[i] = n
    rows = np.fromiter((it.req.row for it in items), np.int64, b)
    starts = np.fromiter((it.start for it in items), np.int64, b)
    node = np.arange(k)
    slot_index = np.where(node < num_draft[:, None], (rows * width + starts + 1)[:, None] + node, 0)
    return DraftArrays(*(torch.from_numpy(a) for a in (tokens, parents, num_draft, slot_index)))


def draft_laws(drafts: Sequence[DraftTree | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``verify``'s ``draft_probs [N, V]`` for these drafts (nodes in order, None or empty ones
    skipped): each node's law from a sampled draft (``DraftTree.probs``), a one-hot row for a
    point-mass draft's node; None when every draft is a point mass (verify's point-mass form)."""
    if all(d is None or d.probs is None for d in drafts):
        return None
    rows = []
    for d in drafts:
        if d is None or not len(d):
            continue
        if d.probs is not None:
            rows.append(d.probs.to(device=device, dtype=torch.float32))
        else:
            tok = torch.tensor(d.tokens, dtype=torch.long, device=device)
            rows.append(torch.zeros(len(d), vocab_size, device=device).scatter_(1, tok[:, None], 1.0))
    return torch.cat(rows)


def draft_bitmasks(items: Sequence[ScheduledItem], k: int, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``verify``'s ``draft_bitmask [B, K + 1, W]``: each drafted grammar-constrained item's
    ``DraftTree.bitmask`` (root row, then one per node), all ``-1`` elsewhere; None when no
    item's draft has one (no cost for unconstrained steps)."""
    if all(it.draft is None or it.draft.bitmask is None for it in items):
        return None
    out = torch.full((len(items), k + 1, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i, it in enumerate(items):
        if it.draft is not None and it.draft.bitmask is not None:
            out[i, : it.draft.bitmask.shape[0]] = it.draft.bitmask
    return out.to(device, non_blocking=True)


def step_token_ids(reqs: Sequence[Request], starts: Sequence[int], qo_lens: Sequence[int]) -> list[int]:
    """The flat input ids of a causal step: tokens ``[starts[b], starts[b] + qo_lens[b])`` of
    each ``reqs[b]``, request by request.

    A step of single tokens (decodes) reads each from the prompt or the output directly, with
    no per-request call or slice."""
    if max(qo_lens) == 1:
        return [
            r.output_ids[s - n] if s >= (n := len(r.prompt_ids)) else r.prompt_ids[s]
            for r, s in zip(reqs, starts)
        ]
    return [t for r, s, n in zip(reqs, starts, qo_lens) for t in r.tokens(s, s + n)]


def admit_requests(rows: SamplingRows, reqs: Sequence[Request]) -> None:
    """Admit into the resident ``rows`` each of ``reqs`` not yet admitted into its table row
    (first step there, the row's previous owner was another request, or its ``params`` object
    was replaced): its parameters are validated and written once."""
    holds = rows.holds
    for r in reqs:
        if not holds(r.row, r, r.params):
            rows.admit(r.row, r, r.params, r.seed, r.prompt_ids)


def grammar_masks(reqs: Sequence[Request], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """The batch token bitmask of ``reqs``' grammar-constrained rows (``Request.grammar``, refilled
    by the commit path after each token; row i = ``reqs[i]``), None when none is."""
    return stack_bitmasks([None if r.grammar is None else r.grammar.bitmask for r in reqs], vocab_size, device)


def with_grammar_masks(batch: SamplingBatch, reqs: Sequence[Request]) -> SamplingBatch:
    """``batch`` (row i = ``reqs[i]``) with ``grammar_masks``; unchanged when no row is constrained."""
    mask = grammar_masks(reqs, batch.vocab_size, batch.device)
    return batch if mask is None else replace(batch, token_bitmask=mask)
