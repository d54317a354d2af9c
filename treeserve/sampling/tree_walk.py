"""The verification walk over a padded draft tree (torch reference; the Triton kernel matches it).

One pass over node indices k = 0..M-1 handles chains and trees alike: node k is *considered*
when its parent is the deepest node accepted so far (parents precede children, siblings are in
index order). A considered node with token x is accepted iff ``u_k < min(1, r(x) / q(x))`` where
``r`` is the current residual target and ``q`` the distribution x was drafted from. On accept,
``r`` becomes the target at node k; on reject, ``r <- normalize(max(r - q, 0))`` (SpecInfer's
recursive rejection over siblings; with ``q`` a point mass this zeroes x and renormalizes).
Special cases: ``q(x) == 0`` (x could not have been drafted) skips the node without touching
``r``; a residual of mass 0 (only possible through rounding) keeps ``r``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TreeWalk(NamedTuple):
    """Outcome of the walk for B requests with at most M draft nodes.

    ``accepted [B, M]`` accepted draft tokens then -1; ``path [B, M]`` their node indices then -1;
    ``accept_len [B]``; ``last_node [B]`` (-1 = root); ``residual [B, V]`` the distribution the
    final token is drawn from; ``pristine [B]`` True when ``residual`` is exactly the target row
    of ``last_node`` (no sibling was rejected after the last acceptance); ``accept_probs [B, M]``
    the acceptance probability each considered node was tested against (NaN if not considered).
    """

    accepted: torch.Tensor
    path: torch.Tensor
    accept_len: torch.Tensor
    last_node: torch.Tensor
    residual: torch.Tensor
    pristine: torch.Tensor
    accept_probs: torch.Tensor


class AcceptedPath:
    """A walk's bookkeeping for B requests of at most M nodes: the accepted tokens and node
    indices in order, their count and the deepest accepted node (``cur``, -1 = root); no host sync."""

    def __init__(self, b: int, m: int, device: torch.device) -> None:
        self.m = m
        self.rows = torch.arange(b, device=device)
        self.cur = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.count = torch.zeros(b, dtype=torch.int64, device=device)
        self.tokens = torch.full((b, m), -1, dtype=torch.int64, device=device)
        self.nodes = torch.full_like(self.tokens, -1)

    def considered(self, k: int, parents: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: node k is a real node whose parent is the deepest accepted node."""
        return (parents[:, k] == self.cur) & (k < num_draft)

    def take(self, k: int, accept: torch.Tensor, token: torch.Tensor) -> None:
        """Append node k (token ``token [B]``) to the requests where ``accept [B]``."""
        rows, slot = self.rows, torch.where(accept, self.count, self.m - 1)
        self.tokens[rows, slot] = torch.where(accept, token, self.tokens[rows, slot])
        self.nodes[rows, slot] = torch.where(accept, k, self.nodes[rows, slot])
        self.count = self.count + accept.to(torch.int64)
        self.cur = torch.where(accept, k, self.cur)

    def walk(self, residual: torch.Tensor, pristine: torch.Tensor, accept_probs: torch.Tensor) -> TreeWalk:
        return TreeWalk(self.tokens, self.nodes, self.count, self.cur, residual, pristine, accept_probs)


def one_hot(idx: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """``[..., num_classes]`` rows with 1 at ``idx`` (values in range, unchecked), built by a scatter:
    unlike ``F.one_hot`` it never validates the values on the host, so it is safe in a CUDA graph."""
    out = torch.zeros(*idx.shape, num_classes, dtype=dtype, device=idx.device)
    return out.scatter_(-1, idx[..., None], 1)


def walk_tree(
    target: torch.Tensor,
    draft: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_draft: torch.Tensor,
    u_accept: torch.Tensor,
) -> TreeWalk:
    """Walk the trees. ``target [B, M+1, V]``: row 0 the root's next-token law, row k+1 node k's.

    ``draft [B, M, V]`` the (normalized) law each node's token was drafted from (point-mass
    drafts are verified by ``verify.position_tokens``, not walked); ``tokens/parents [B, M]``;
    ``num_draft [B]``; ``u_accept [B, M]`` uniforms in [0, 1). Rows of a greedy request should be
    one-hot targets with ``draft`` one-hot at the token (the caller's job). No host sync; M
    iterations of batched work.
    """
    b, m = tokens.shape
    acc = AcceptedPath(b, m, tokens.device)
    accept_probs = torch.full((b, m), float("nan"), dtype=target.dtype, device=tokens.device)
    r = target[:, 0]
    pristine = torch.ones(b, dtype=torch.bool, device=tokens.device)
    for k in range(m):
        x = tokens[:, k].clamp(min=0)  # padding entries are never considered
        considered = acc.considered(k, parents, num_draft)
        px = r.gather(1, x[:, None])[:, 0]
        q_row = draft[:, k]
        qx = q_row.gather(1, x[:, None])[:, 0]
        a = torch.where(qx > 0, torch.clamp(px / qx.clamp(min=torch.finfo(r.dtype).tiny), max=1.0), 0.0)
        accept = considered & (u_accept[:, k] < a)
        accept_probs[:, k] = torch.where(considered, a, float("nan"))

        resid = torch.clamp(r - q_row, min=0.0)
        mass = resid.sum(1, keepdim=True)
        update = (considered & ~accept & (qx > 0) & (mass[:, 0] > 0))[:, None]
        r = torch.where(update, resid / mass.clamp(min=torch.finfo(r.dtype).tiny), r)
        r = torch.where(accept[:, None], target[:, k + 1], r)
        pristine = (pristine & ~update[:, 0]) | accept
        acc.take(k, accept, x)
    return acc.walk(r, pristine, accept_probs)
