"""``sample``: draw one token per row from the processed distribution with counter-based randomness."""

from __future__ import annotations

from typing import NamedTuple

import torch

from treeserve.sampling.backend import resolve_backend
from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.processing import Filtered, filter_logits
from treeserve.sampling.rng import Purpose, uniform


class SampleOutput(NamedTuple):
    """Result of ``sample`` for B rows.

    ``tokens [B]`` int64 (-1 marks an invalid row: NaN/+inf logits or every token masked);
    ``logprobs [B]`` float32, log-probability of the chosen token under the processed
    distribution (post-penalty, post-temperature, post-top-k/top-p/min-p; greedy rows use
    temperature 1); ``top_ids / top_logprobs [B, N]`` the N most likely tokens of that same
    distribution, N = the largest ``logprobs`` asked for in the batch (entries outside the kept
    set have logprob -inf).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def inverse_cdf_weights(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column ``[R]`` drawn with uniforms ``u [R]`` from non-negative weights ``w [R, C]`` (id order).

    The chosen column is the first whose cumulative weight exceeds ``u * total`` (float64),
    clamped to the last positive column, so a zero-weight column is never chosen.
    """
    cdf = torch.cumsum(w, dim=1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    col = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last_positive = torch.searchsorted(cdf, total)  # first column reaching the total
    return torch.minimum(col, last_positive)[:, 0].clamp(max=w.shape[1] - 1)


def inverse_cdf(
    values: torch.Tensor, threshold: torch.Tensor, row_max: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw over ``values [R, C]`` (scaled logits, in token-id order) >= ``threshold [R]``.

    Returns ``(column [R], logsumexp of the kept values [R])``. Weights ``exp(value - row_max)``
    are computed in the values' dtype and accumulated in float64.
    """
    w = torch.exp(values - row_max[:, None]).masked_fill(values < threshold[:, None], 0.0)
    col = inverse_cdf_weights(w, u)
    return col, row_max.to(torch.float64) + torch.log(w.sum(1, dtype=torch.float64))


def draw(f: Filtered, u: torch.Tensor, sync_free: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``[R]`` drawn with uniforms ``u [R]`` from the filtered rows, and the kept logsumexp.

    The law is batch-independent: tokens are ordered by id whichever path is taken (candidates
    when the kept set fits in them, else the full row; the latter syncs to find those rows).
    ``sync_free`` draws every row from its full row, with no data-dependent branch.
    """
    m = f.cand_values[:, 0]
    if sync_free:
        return inverse_cdf(f.scaled, f.threshold, m, u)
    kept = f.cand_values >= f.threshold[:, None]
    ids, perm = torch.sort(torch.where(kept, f.cand_ids, f.scaled.shape[1]), dim=1)
    col, lse = inverse_cdf(f.cand_values.gather(1, perm), f.threshold, m, u)
    tokens = ids.gather(1, col[:, None])[:, 0]
    slow = ~f.fits & f.valid
    if bool(slow.any()):
        rows = slow.nonzero()[:, 0]
        tokens[rows], lse[rows] = inverse_cdf(f.scaled[rows], f.threshold[rows], m[rows], u[rows])
    return tokens, lse


def _kept_logsumexp(f: Filtered) -> torch.Tensor:
    """float64 ``[R]``: logsumexp of each row's kept values (a greedy row's logprob normalizer).

    One row-wise reduction, so a greedy row's logprobs do not depend on its companions' modes.
    """
    kept = f.scaled.masked_fill(f.scaled < f.threshold[:, None], float("-inf"))
    return torch.logsumexp(kept, dim=1).to(torch.float64)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, backend: str = "auto"
) -> SampleOutput:
    """Sample one token per row of ``logits [B, V]``.

    ``positions [B]`` (int64) is the absolute position of the token being sampled; with the row's
    seed it keys the uniform (purpose SAMPLE), so a seeded request draws the same token whatever
    the batch. Greedy rows (temperature 0) take the first argmax of the processed logits.
    ``backend``: ``torch`` (CPU default: top-k-bounded thresholds, may sync for rare rows) or
    ``triton`` (CUDA default: sort-free threshold kernel, no host sync); both give the same law
    and, up to float rounding at a boundary, the same tokens.
    """
    if positions.shape != (batch.num_rows,):
        raise ValueError(f"positions must have shape [{batch.num_rows}], got {tuple(positions.shape)}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.device.type == "cpu" and bool((positions < 0).any()):  # no host sync on GPUs
        raise ValueError(f"positions must be >= 0, got {positions.min().item()}")
    backend = resolve_backend(backend, logits.device)
    f = filter_logits(logits, batch, backend=backend)
    if batch.all_greedy:  # no draw: the argmax, and the kept set's normalizer for the logprobs
        tokens = f.scaled.argmax(dim=1)
        lse = _kept_logsumexp(f)
    else:
        u = uniform(batch.seeds, positions, Purpose.SAMPLE)
        tokens, lse = draw(f, u, sync_free=backend == "triton")
        if batch.any_greedy:  # greedy rows: the same argmax and normalizer as in an all-greedy batch
            tokens = torch.where(batch.greedy, f.scaled.argmax(dim=1), tokens)
            lse = torch.where(batch.greedy, _kept_logsumexp(f), lse)
    invalid = ~f.valid
    tokens = tokens.masked_fill(invalid, 0)
    chosen = f.scaled.gather(1, tokens[:, None])[:, 0].to(torch.float64) - lse
    n = batch.num_logprobs
    top = f.cand_values[:, :n]
    top_lp = torch.where(top >= f.threshold[:, None], top.to(torch.float64) - lse[:, None], float("-inf"))
    return SampleOutput(
        tokens=tokens.masked_fill(invalid, -1),
        logprobs=chosen.to(torch.float32).masked_fill(invalid, float("nan")),
        top_ids=f.cand_ids[:, :n],
        top_logprobs=top_lp.to(torch.float32).masked_fill(invalid[:, None], float("nan")),
    )
