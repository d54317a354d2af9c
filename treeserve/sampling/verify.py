"""Lossless speculative verification of ragged draft trees (greedy and rejection sampling).

Inputs for B requests, request i with ``n_i = num_draft[i]`` draft nodes (0 allowed), M >= max n_i:

- ``target_logits [T, V]``, T = sum(1 + n_i): request i's rows are contiguous, its root row
  first (the law of the token after the last committed one), then one row per draft node k
  (the law of the token after node k), in node order; or the padded layout T = B * (M + 1),
  request i's rows at ``i * (M + 1) + j`` with the rows past ``1 + n_i`` ignored (fixed shapes
  for CUDA graphs);
- ``draft_tokens, draft_parents [B, M]`` int64: node k's token and parent (``parent < k``,
  -1 = root; a chain has ``parent[k] = k - 1``); entries past ``n_i`` are ignored;
- ``draft_probs [N, V]`` or None, N = sum(n_i) rows in the same order: the law node k's token was
  drawn from (siblings are independent draws; rows need not be normalized). None means
  deterministic drafts (n-gram, argmax children, jump-forward tokens): the point-mass form;
- ``positions [B]``: absolute position of the token the root row predicts;
- ``draft_bitmask [B, M+1, W]`` int32 or None: grammar masks per tree position (row 0 the
  root's, row k+1 node k's; ``sampling.bitmask`` layout, all ``-1`` for an unconstrained
  position), applied to each target row where ``sample`` applies ``token_bitmask``, so the
  law verified against is the constrained sampler's.

Every target row is processed exactly as ``sample`` would process it (``process_logits`` on a
batch expanded to one row per tree position, whose history includes the draft tokens on the path
to that position).

**Point-mass drafts** (``draft_probs`` None): each tree position's token is the one ``sample``
gives there (:func:`position_tokens`: the argmax of a greedy request; otherwise the draw keyed by
(seed, the position, SAMPLE)), and the request accepts the longest path whose nodes equal those
tokens, then emits the token after it. Node x is accepted with probability p(x) (siblings: the
sum of their p), as rejection sampling with a one-hot q would, and the emitted tokens are exactly
the ones the request would emit without any draft: a seeded request's output does not depend on
what was drafted, or on whether anything was.

**Sampled drafts** (``draft_probs`` given): the walk in ``tree_walk`` (Leviathan/Chen on chains,
SpecInfer's recursive rejection on trees) followed by one token from the final residual: the
output law equals the processed target's (the tokens follow the draft). Node k's coin is keyed by
(seed, position of node k, ACCEPT, k), the final token by (seed, its position, SAMPLE), so a
request with no drafts emits exactly ``sample``'s token.

No host sync on the way (shape checks only; value checks run when inputs are on CPU), except
the torch top-p refine fallback documented in ``processing``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch

from treeserve.sampling.backend import resolve_backend
from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.processing import CANDIDATES, Filtered, process_logits
from treeserve.sampling.rng import Purpose, uniform
from treeserve.sampling.sampler import draw, inverse_cdf, inverse_cdf_weights
from treeserve.sampling.tree_walk import AcceptedPath, TreeWalk, one_hot, walk_tree


class VerifyOutput(NamedTuple):
    """Result of ``verify`` for B requests (M = the padded number of draft nodes).

    ``tokens [B, M+1]``: the emitted tokens (accepted drafts, then the bonus/correction token),
    -1 padded; ``logprobs [B, M+1]`` float32: each emitted token's log-probability under the
    processed distribution of the position it was emitted at (``sample``'s definition), NaN
    padded, and all NaN when no row of the batch asked for logprobs (as ``sample``);
    ``num_tokens [B]`` = ``accept_len + 1`` (0 for an invalid request);
    ``accept_len [B]`` accepted draft tokens; ``last_node [B]`` index of the last accepted node
    (-1 = root; KV compaction keeps the nodes in ``path``); ``path [B, M]`` accepted node indices
    root-to-leaf, -1 padded; ``valid [B]`` False when a target or draft row of the request had
    NaN/inf values or no admissible token (its other outputs are then -1/0).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    num_tokens: torch.Tensor
    accept_len: torch.Tensor
    last_node: torch.Tensor
    path: torch.Tensor
    valid: torch.Tensor


class PreparedTree(NamedTuple):
    """Padded per-position laws: ``processed [B, M+1, V]`` logits, ``target`` their probabilities
    (one-hot argmax on greedy requests), ``draft [B, M, V]`` normalized (None for point-mass
    drafts, which have no laws to walk),
    ``depth [B, M]`` (root children have depth 1), ``valid [B]``."""

    processed: torch.Tensor
    target: torch.Tensor
    draft: torch.Tensor | None
    depth: torch.Tensor
    valid: torch.Tensor


def _check_inputs(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_draft: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    b, v = batch.num_rows, batch.vocab_size
    if tokens.dim() != 2 or tokens.shape[0] != b or parents.shape != tokens.shape:
        raise ValueError(f"draft_tokens and draft_parents must both have shape [{b}, M], got "
                         f"{tuple(tokens.shape)} and {tuple(parents.shape)}")
    for name, t in (("draft_tokens", tokens), ("draft_parents", parents), ("num_draft", num_draft),
                    ("positions", positions)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
    for name, t in (("num_draft", num_draft), ("positions", positions)):
        if t.shape != (b,):
            raise ValueError(f"{name} must have shape [{b}], got {tuple(t.shape)}")
    if target_logits.dim() != 2 or target_logits.shape[1] != v:
        raise ValueError(f"target_logits must have shape [T, {v}], got {tuple(target_logits.shape)}")
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[1] != v):
        raise ValueError(f"draft_probs must have shape [N, {v}], got {tuple(draft_probs.shape)}")
    if tokens.device.type != "cpu":
        return  # value checks would need a host sync
    m = tokens.shape[1]
    if ((num_draft < 0) | (num_draft > m)).any():
        raise ValueError(f"num_draft must be in [0, {m}], got {num_draft.tolist()}")
    n = int(num_draft.sum())
    if target_logits.shape[0] not in (b + n, b * (m + 1)):
        raise ValueError(
            f"target_logits has {target_logits.shape[0]} rows, expected B + sum(num_draft) = {b + n} "
            f"(ragged) or B * (M + 1) = {b * (m + 1)} (padded)"
        )
    if draft_probs is not None and draft_probs.shape[0] != n:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, expected sum(num_draft) = {n}")
    real = torch.arange(m) < num_draft[:, None]
    if ((tokens < 0) | (tokens >= v))[real].any():
        raise ValueError(f"draft_tokens must be in [0, {v}) for real nodes")
    if ((parents < -1) | (parents >= torch.arange(m)))[real].any():
        raise ValueError("draft_parents must satisfy -1 <= parent[k] < k for real nodes")


def tree_depth(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(depth [B, M], ancestors [B, M, M])``: depth 1 for root children; ``ancestors[b, k, j]``
    is True when node j is on the path root -> k (k included)."""
    b, m = parents.shape
    depth = torch.zeros(b, m, dtype=torch.int64, device=parents.device)
    anc = torch.zeros(b, m, m, dtype=torch.bool, device=parents.device)
    rows = torch.arange(b, device=parents.device)
    eye = torch.eye(m, dtype=torch.bool, device=parents.device)
    for k in range(m):
        par = parents[:, k]
        has = par >= 0
        p = par.clamp(min=0)
        depth[:, k] = torch.where(has, depth[rows, p] + 1, 1)
        anc[:, k] = (anc[rows, p] & has[:, None]) | eye[k]
    return depth, anc


def _expanded_batch(
    batch: SamplingBatch, tokens: torch.Tensor, num_draft: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor
) -> SamplingBatch:
    """One row per tree position; node rows' histories gain the draft tokens on their path."""
    b, m = tokens.shape
    reps = m + 1
    dev = tokens.device
    row_depth = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev), depth], 1).reshape(-1)
    if not batch.has_penalties:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return batch.expand_rows(reps, row_depth, empty, empty, empty.float())
    real = torch.arange(m, device=dev) < num_draft[:, None]
    node_row = torch.arange(b, device=dev)[:, None] * reps + 1 + torch.arange(m, device=dev)  # [B, M]
    weight = anc & real[:, None, :] & real[:, :, None]  # [B, k, j]
    extra_rows = node_row[:, :, None].expand(b, m, m).reshape(-1)
    extra_tokens = tokens.clamp(min=0)[:, None, :].expand(b, m, m).reshape(-1)
    return batch.expand_rows(reps, row_depth, extra_rows, extra_tokens, weight.reshape(-1).float())


def _processed_rows(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    draft_tokens: torch.Tensor,
    draft_parents: torch.Tensor,
    num_draft: torch.Tensor,
    backend: str,
    draft_bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(processed [B, M+1, V], depth [B, M], valid [B])``: the target rows padded to M + 1 per
    request and processed as ``sample`` would (histories extended along each node's path); a
    request is invalid when one of its real rows is NaN after processing."""
    b, m = draft_tokens.shape
    j = torch.arange(m + 1, device=draft_tokens.device)
    real_rows = j <= num_draft[:, None]  # [B, M+1]
    row_start = torch.cumsum(1 + num_draft, 0) - (1 + num_draft)
    src = torch.where(real_rows, row_start[:, None] + j, row_start[:, None])
    depth, anc = tree_depth(draft_parents)
    expanded = _expanded_batch(batch, draft_tokens, num_draft, depth, anc)
    if draft_bitmask is not None:
        words = draft_bitmask.shape[-1]
        if draft_bitmask.shape != (b, m + 1, words) or draft_bitmask.dtype != torch.int32:
            raise ValueError(f"draft_bitmask must be int32 [{b}, {m + 1}, W], got {draft_bitmask.dtype} "
                             f"{tuple(draft_bitmask.shape)}")
        expanded = replace(expanded, token_bitmask=draft_bitmask.reshape(b * (m + 1), words))
    # T == B * (M + 1) (a shape, no sync) means every request has M nodes: no padding to gather.
    rows = target_logits if target_logits.shape[0] == b * (m + 1) else target_logits[src.reshape(-1)]
    processed = process_logits(rows, expanded, backend).reshape(b, m + 1, batch.vocab_size)
    valid = ~(torch.isnan(processed[:, :, 0]) & real_rows).any(1)  # padding rows do not count
    return processed, depth, valid


def greedy_walk(best: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_draft: torch.Tensor) -> TreeWalk:
    """``walk_tree`` for greedy requests with point-mass drafts, from ``best [B, M+1]`` (the argmax
    of each processed row) alone: node k is accepted iff its parent is the deepest accepted node
    and its token is that node's argmax (with one-hot target and draft rows that is exactly
    ``walk_tree``'s rule, siblings in index order). ``residual`` is left empty ``[B, 0]``: the final
    token is ``best`` after the last accepted node; ``pristine`` is all True."""
    b, m = tokens.shape
    acc = AcceptedPath(b, m, tokens.device)
    accept_probs = torch.full((b, m), float("nan"), device=tokens.device)
    for k in range(m):
        considered = acc.considered(k, parents, num_draft)
        accept = considered & (tokens[:, k] == best[acc.rows, acc.cur + 1])
        accept_probs[:, k] = torch.where(considered, accept.float(), float("nan"))
        acc.take(k, accept, tokens[:, k])
    return acc.walk(best.new_empty((b, 0)), torch.ones(b, dtype=torch.bool, device=tokens.device), accept_probs)


class GreedyPath(NamedTuple):
    """One request's ``greedy_paths`` result: ``nodes`` the accepted draft nodes root to leaf,
    ``tokens`` their tokens then the argmax after the last one; ``tokens == ()`` for an invalid
    request (a row with a NaN or +inf logit: ``verify``'s ``valid`` False)."""

    nodes: tuple[int, ...]
    tokens: tuple[int, ...]


def greedy_paths(best: Sequence[int], draft_tokens: Sequence[Sequence[int]],
                 draft_parents: Sequence[Sequence[int]]) -> list[GreedyPath]:
    """``verify`` of plain greedy requests (no processing: ``SamplingRows.all_plain_greedy``) with
    point-mass drafts and no grammar, on the host from ``best``: the first argmax of each target
    row (``greedy_tokens``: -1 for a row with a NaN or +inf logit), rows in ``verify``'s ragged
    layout (request i's root row, then one per node of ``draft_tokens[i]`` / ``draft_parents[i]``).
    ``greedy_walk``'s rule: node k is accepted iff its parent is the deepest accepted node and its
    token is that node's argmax (siblings in index order); then the argmax after the last one. The
    same tokens and path as ``verify`` for such a batch, without a tensor op per node (a step of a
    few requests: ~1 ms of torch calls on a CPU, per step)."""
    out: list[GreedyPath] = []
    start = 0
    for toks, pars in zip(draft_tokens, draft_parents):
        rows = best[start : start + 1 + len(toks)]
        start += 1 + len(toks)
        if min(rows) < 0:
            out.append(GreedyPath((), ()))
            continue
        nodes: list[int] = []
        cur = -1
        for k, (tok, par) in enumerate(zip(toks, pars)):
            if par == cur and tok == rows[cur + 1]:
                nodes.append(k)
                cur = k
        out.append(GreedyPath(tuple(nodes), tuple(toks[k] for k in nodes) + (rows[cur + 1],)))
    return out


def prepare_tree(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    draft_tokens: torch.Tensor,
    draft_parents: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor,
    backend: str = "torch",
    draft_bitmask: torch.Tensor | None = None,
) -> PreparedTree:
    """Pad and process the target rows (under ``draft_bitmask`` when given), normalize the
    draft rows ``draft_probs [N, V]`` (sampled drafts; point-mass ones take ``position_tokens``),
    flag invalid requests.

    Rows of invalid requests are left as they are (NaN included): the walk runs on them without
    failing and ``assemble`` masks their outputs."""
    processed, depth, valid = _processed_rows(
        target_logits, batch, draft_tokens, draft_parents, num_draft, backend, draft_bitmask
    )
    b, m = draft_tokens.shape
    v = batch.vocab_size
    dev = draft_tokens.device
    j = torch.arange(m + 1, device=dev)
    row_start = torch.cumsum(1 + num_draft, 0) - (1 + num_draft)
    greedy = batch.greedy[:, None, None]
    target = torch.softmax(processed, dim=-1)
    if batch.any_greedy:
        onehot = one_hot(processed.argmax(-1), v, target.dtype)
        target = torch.where(greedy, onehot, target)

    real = j[:m] < num_draft[:, None]
    node_start = row_start - torch.arange(b, device=dev)
    nsrc = torch.where(real, node_start[:, None] + j[:m], 0).clamp(max=max(draft_probs.shape[0] - 1, 0))
    if draft_probs.shape[0] == b * m:
        q = draft_probs.to(target.dtype).reshape(b, m, v)
    elif draft_probs.shape[0]:
        q = draft_probs.to(target.dtype)[nsrc]
    else:
        q = target.new_ones(b, m, v)
    mass = q.sum(-1, keepdim=True)
    ok = torch.isfinite(mass[..., 0]) & (mass[..., 0] > 0) & (q.amin(-1) >= 0)
    valid = valid & (ok | ~real).all(1)
    draft = q / mass
    if batch.any_greedy:
        draft = torch.where(greedy, one_hot(draft_tokens.clamp(min=0), v, draft.dtype), draft)
    return PreparedTree(processed, target, draft, depth, valid)


def final_tokens(prep: PreparedTree, walk: TreeWalk, greedy: torch.Tensor, u_final: torch.Tensor) -> torch.Tensor:
    """The bonus/correction token: argmax for greedy requests; otherwise a draw from the residual,
    taken from the processed logits (exactly as ``sample``) while the residual is pristine."""
    b = walk.last_node.shape[0]
    rows = torch.arange(b, device=u_final.device)
    logits = prep.processed[rows, walk.last_node + 1]
    row_max = logits.amax(1).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    from_logits = inverse_cdf(logits, torch.full_like(row_max, float("-inf")), row_max, u_final)[0]
    from_residual = inverse_cdf_weights(walk.residual.to(torch.float64), u_final)
    token = torch.where(walk.pristine, from_logits, from_residual)
    return torch.where(greedy, walk.residual.argmax(1), token)


def _row_depth(depth: torch.Tensor) -> torch.Tensor:
    """``[B, M+1]``: each tree position's depth (column 0 the root, depth 0; then the nodes')."""
    return torch.nn.functional.pad(depth, (1, 0))


def position_tokens(processed: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor,
                    depth: torch.Tensor, backend: str = "torch") -> torch.Tensor:  # fmt: skip
    """``[B, M+1]``: the token ``sample`` gives at each tree position of ``processed [B, M+1, V]``
    (the argmax for a greedy request; else the draw keyed by (seed, the position's absolute
    position, SAMPLE)). With point-mass drafts these decide the walk, so a request emits the
    very tokens it would emit without drafts, whatever was drafted.

    As ``sample``'s draw, over each row's ``CANDIDATES`` largest values when its kept (finite)
    values are all among them, else over the whole row (one host sync; ``backend="triton"``
    always takes whole rows, with none): the same token either way, as dropped tokens weigh 0."""
    best = processed.argmax(-1)
    if batch.all_greedy:
        return best
    b, rows, v = processed.shape
    flat = processed.reshape(b * rows, v)
    u = uniform(batch.seeds[:, None], positions[:, None] + _row_depth(depth), Purpose.SAMPLE)
    values, ids = flat.topk(min(v, CANDIDATES), dim=1)
    fits = (values[:, -1] == float("-inf")) | (v <= CANDIDATES)  # every finite value is a candidate
    f = Filtered(flat, flat.new_full((b * rows,), float("-inf")), values, ids, fits, torch.isfinite(values[:, 0]))
    drawn = draw(f, u.reshape(-1), sync_free=backend == "triton")[0].reshape(b, rows)
    return torch.where(batch.greedy[:, None], best, drawn)


def verify_uniforms(batch: SamplingBatch, positions: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Node coins ``[B, M]`` keyed by (seed, position of node k, ACCEPT, k)."""
    k = torch.arange(depth.shape[1], device=depth.device)
    return uniform(batch.seeds[:, None], positions[:, None] + depth - 1, Purpose.ACCEPT, k)


def verify(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    draft_tokens: torch.Tensor,
    draft_parents: torch.Tensor,
    num_draft: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    backend: str = "auto",
    draft_bitmask: torch.Tensor | None = None,
) -> VerifyOutput:
    """Verify ragged draft trees against the target (see the module docstring for the layout).

    Raises ``ValueError``/``TypeError`` for inconsistent shapes/dtypes (and, on CPU, out-of-range
    tokens, parents or counts); NaN/inf rows are reported through ``valid``, never raised.
    ``backend``: ``torch`` (CPU default) or ``triton`` (CUDA default: threshold and walk kernels).
    Grammar masks come per tree position through ``draft_bitmask``; a batch with a
    ``token_bitmask`` (one mask per request) is refused (``ValueError``).
    """
    if batch.token_bitmask is not None:
        raise ValueError("verify takes no token_bitmask: give grammar masks per tree position as draft_bitmask")
    _check_inputs(target_logits, batch, draft_tokens, draft_parents, num_draft, positions, draft_probs)
    backend = resolve_backend(backend, target_logits.device)
    want_logprobs = batch.any_logprobs or batch.num_logprobs > 0
    if draft_probs is None:  # point-mass drafts: the token `sample` draws at each position decides
        processed, depth, valid = _processed_rows(
            target_logits, batch, draft_tokens, draft_parents, num_draft, backend, draft_bitmask
        )
        best = position_tokens(processed, batch, positions, depth, backend)
        walk = greedy_walk(best, draft_tokens, draft_parents, num_draft)
        final = best.gather(1, (walk.last_node + 1)[:, None])[:, 0]
        return assemble(PreparedTree(processed, processed, None, depth, valid), walk, final, want_logprobs)
    prep = prepare_tree(target_logits, batch, draft_tokens, draft_parents, num_draft, draft_probs, backend,
                        draft_bitmask)  # fmt: skip
    walk_fn = walk_tree
    if backend == "triton":
        from treeserve.sampling.triton_kernels import walk_tree_triton as walk_fn
    walk = walk_fn(prep.target, prep.draft, draft_tokens, draft_parents, num_draft,
                   verify_uniforms(batch, positions, prep.depth))  # fmt: skip
    last_depth = _row_depth(prep.depth).gather(1, (walk.last_node + 1)[:, None])[:, 0]
    u_final = uniform(batch.seeds, positions + last_depth, Purpose.SAMPLE)
    return assemble(prep, walk, final_tokens(prep, walk, batch.greedy, u_final), want_logprobs)


def assemble(prep: PreparedTree, walk: TreeWalk, final: torch.Tensor, logprobs: bool = True) -> VerifyOutput:
    """Pack the walk and the final token into ``VerifyOutput`` (invalid requests masked);
    ``logprobs=False`` leaves them NaN (no log-normalizer over the rows is computed)."""
    b, m = walk.accepted.shape
    valid = prep.valid
    tokens = torch.cat([walk.accepted, walk.accepted.new_full((b, 1), -1)], 1)
    tokens[torch.arange(b, device=final.device), walk.accept_len] = final
    tokens = tokens.masked_fill(~valid[:, None], -1)
    accept_len = walk.accept_len.masked_fill(~valid, 0)
    # Emitted token d was drawn at the root (d = 0) or after the path's node d - 1.
    if logprobs:
        rows = torch.cat([walk.path.new_zeros(b, 1), walk.path + 1], 1).clamp(min=0)
        v = prep.processed.shape[2]
        chosen = prep.processed.reshape(b, -1).gather(1, rows * v + tokens.clamp(min=0))
        lse = torch.logsumexp(prep.processed, 2, keepdim=False).gather(1, rows)
        lps = (chosen.to(torch.float64) - lse.to(torch.float64)).to(torch.float32).masked_fill(tokens < 0, float("nan"))
    else:
        lps = torch.full(tokens.shape, float("nan"), device=tokens.device)
    return VerifyOutput(
        tokens=tokens,
        logprobs=lps,
        num_tokens=(accept_len + 1).masked_fill(~valid, 0),
        accept_len=accept_len,
        last_node=walk.last_node.masked_fill(~valid, -1),
        path=walk.path.masked_fill(~valid[:, None], -1),
        valid=valid,
    )
