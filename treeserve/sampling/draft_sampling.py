"""Stochastic drafts: tokens drawn from a drafter's processed law, with the law each was drawn from.

``verify`` is lossless for any draft law as long as it is told the law each node's token was
drawn from (``draft_probs``). A drafter that samples from its own processed distribution (the
request's temperature / top-k / top-p applied to the draft model's logits) proposes tokens the
target is likely to accept at temperature > 0, where a point-mass (argmax) draft is accepted only
with the target's probability of that one token.

Siblings are drawn without replacement: sibling ``j`` comes from the law with siblings ``0..j-1``
removed and renormalized, and that renormalized law is what is handed over for it. Verification's
recursive rejection (``r <- normalize(max(r - q_j, 0))`` after a rejected sibling) then stays exact:
a rejected token has ``r(x) < q_j(x)``, so the residual already gives it zero mass (SpecInfer /
Sequoia). Random numbers are counter-based: sibling ``j`` at absolute position ``p`` uses
``uniform(seed, p, Purpose.DRAFT, j)``, a stream apart from the target's SAMPLE and ACCEPT draws,
so a seeded request drafts (and therefore emits) the same tokens in any batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.processing import process_logits
from treeserve.sampling.rng import Purpose, uniform
from treeserve.sampling.sampler import inverse_cdf_weights
from treeserve.sampling.tree_walk import one_hot

__all__ = ["DraftDraw", "draw_siblings"]


class DraftDraw(NamedTuple):
    """``tokens [R, W]`` drawn per row and ``probs [R, W, V]`` float32: the law sibling ``j`` was
    drawn from (rows of greedy requests: the processed argmax then the next ones by probability,
    each with a one-hot law: deterministic, so verification treats them as point masses)."""

    tokens: torch.Tensor
    probs: torch.Tensor


def draw_siblings(
    logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, width: int, backend: str = "auto"
) -> DraftDraw:
    """Draw ``width`` distinct tokens per row of ``logits [R, V]`` from ``batch``'s processed law.

    ``positions [R]`` int64: the absolute position of the token drawn (keys the random numbers).
    ``width`` must lie in ``[1, V]``. A row whose law has fewer than ``width`` tokens with mass
    fills the rest deterministically: the untaken token with the largest raw logit, with a
    one-hot law (that is the law it was drawn from, given the siblings before it; the target
    rarely accepts it, but verification stays exact). ``ValueError`` on a bad ``width`` or
    shapes that do not match ``batch``.
    """
    r, v = logits.shape if logits.dim() == 2 else (-1, -1)
    if logits.dim() != 2 or r != batch.num_rows or v != batch.vocab_size:
        raise ValueError(f"logits must have shape [{batch.num_rows}, {batch.vocab_size}], got {tuple(logits.shape)}")
    if positions.shape != (r,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 of shape [{r}], got {positions.dtype} {tuple(positions.shape)}")
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= v:
        raise ValueError(f"width must be an int in [1, {v}], got {width!r}")
    law = torch.softmax(process_logits(logits, batch, backend).float(), dim=-1).nan_to_num_(0.0)
    greedy = batch.greedy
    tokens = torch.empty(r, width, dtype=torch.int64, device=logits.device)
    probs = torch.empty(r, width, v, dtype=torch.float32, device=logits.device)
    top = torch.topk(law, width, dim=-1).indices if bool(greedy.any()) else None
    left = law.clone()
    untaken = logits.float().nan_to_num(0.0)  # the fill-in order of exhausted rows (a copy)
    for j in range(width):
        mass = left.sum(1, keepdim=True)
        q = left / mass.clamp(min=torch.finfo(left.dtype).tiny)
        tok = inverse_cdf_weights(q, uniform(batch.seeds, positions, Purpose.DRAFT, j))
        point = greedy | (mass[:, 0] <= 0)
        if bool(point.any()):
            fixed = untaken.argmax(1) if top is None else torch.where(greedy, top[:, j], untaken.argmax(1))
            tok = torch.where(point, fixed, tok)
            q = torch.where(point[:, None], one_hot(tok, v, q.dtype), q)
        tokens[:, j] = tok
        probs[:, j] = q
        left.scatter_(1, tok[:, None], 0.0)
        untaken.scatter_(1, tok[:, None], float("-inf"))
    return DraftDraw(tokens, probs)
