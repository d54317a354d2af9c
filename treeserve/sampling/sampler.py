"""``sample``: draw one token per row from the processed distribution with counter-based randomness."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from treeserve.sampling.backend import resolve_backend
from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.bitmask import apply_token_bitmask, apply_token_bitmask_
from treeserve.sampling.processing import Filtered, filter_scaled, scale_logits, select_rows, work_dtype
from treeserve.sampling.rng import Purpose, uniform


class SampleOutput(NamedTuple):
    """Result of ``sample`` for B rows.

    ``tokens [B]`` int64 (-1 marks an invalid row: NaN/+inf logits or every token masked);
    ``logprobs [B]`` float32, log-probability of the chosen token under the processed
    distribution (post-penalty, post-temperature, post-top-k/top-p/min-p; greedy rows use
    temperature 1); ``top_ids / top_logprobs [B, N]`` the N most likely tokens of that same
    distribution, N = the largest ``logprobs`` asked for in the batch (entries outside the kept
    set have logprob -inf). When no row asked for logprobs (``batch.any_logprobs`` False and
    N == 0) they are not computed: ``logprobs`` is NaN.
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


EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}
"""Per work dtype (``processing.work_dtype``), the exponent under which ``inverse_cdf`` takes a
weight as 0: ``exp`` of it is still a normal number of that dtype."""


def inverse_cdf(
    values: torch.Tensor, threshold: torch.Tensor, row_max: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw over ``values [R, C]`` (scaled logits, in token-id order) >= ``threshold [R]``.

    Returns ``(column [R], logsumexp of the kept values [R])``. Weights ``exp(value - row_max)``
    are computed in the values' dtype and accumulated in float64. A weight below the dtype's
    smallest normal number (``EXP_FLOOR``: ``value - row_max`` under -87 in float32) is taken as
    0, as a masked (-inf) value's is: the exponent is clamped there first, because the vectorized
    ``exp`` of a value out of its normal range (-inf included: every token a grammar masks) runs
    ~10x slower per element on CPU (benches/RESULTS.md, issue 31). Such a token's probability is
    under ``e**-87`` (float32; ``e**-708`` in float64) of the row max's.
    """
    floor = EXP_FLOOR.get(values.dtype, float("-inf"))
    cut = torch.maximum(threshold, row_max + floor)[:, None]  # kept: value >= cut
    w = (values - row_max[:, None]).clamp_min_(floor).exp_()
    # torch.where, not masked_fill_: a blend, where masked_fill_ branches per element (~2x slower
    # on a grammar-masked row's mixed pattern)
    torch.where(values < cut, w.new_zeros(()), w, out=w)
    col = inverse_cdf_weights(w, u)
    return col, row_max.to(torch.float64) + torch.log(w.sum(1, dtype=torch.float64))


def draw(f: Filtered, u: torch.Tensor, sync_free: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``[R]`` drawn with uniforms ``u [R]`` from the filtered rows, and the kept logsumexp.

    The law is batch-independent: tokens are ordered by id whichever path is taken (candidates
    when the kept set fits in them, else the full row; the latter syncs to find those rows).
    ``sync_free`` draws every row from its full row, with no data-dependent branch.
    """
    m = f.cand_values[:, 0]
    slow = ~f.fits & f.valid
    if sync_free or not bool(f.fits.any()):  # every row from its full row (the same draw per row)
        return inverse_cdf(f.scaled, f.threshold, m, u)
    kept = f.cand_values >= f.threshold[:, None]
    ids, perm = torch.sort(torch.where(kept, f.cand_ids, f.scaled.shape[1]), dim=1)
    col, lse = inverse_cdf(f.cand_values.gather(1, perm), f.threshold, m, u)
    tokens = ids.gather(1, col[:, None])[:, 0]
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


ARGMAX_BLOCK = 128
"""Block width of ``first_argmax``'s two-level search (vocabularies that are a multiple of it)."""


def first_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max [R], first index of the max [R])`` of each row of ``x [R, V]`` (as ``torch.max``).

    When ``V`` is a multiple of ``ARGMAX_BLOCK`` (and ``x`` is contiguous) this is two passes
    that vectorize: the max of each block, then the first block holding the row max and the
    first max inside it -- the same index as ``argmax``, several times faster on CPU. A row with
    a NaN has max NaN (its index is then unspecified; ``sample`` flags such rows invalid).
    """
    rows, vocab = x.shape
    if vocab % ARGMAX_BLOCK or not x.is_contiguous():
        values, index = x.max(dim=1)
        return values, index
    blocks = x.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block_max = blocks.amax(dim=2)
    block = block_max.argmax(dim=1)
    inner = blocks[torch.arange(rows, device=x.device), block].argmax(dim=1)
    return block_max.amax(dim=1), block * ARGMAX_BLOCK + inner


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Tokens ``[B]`` of rows of ``logits [B, V]`` that are plain greedy (no penalty, ban, bias,
    allowed set or logprobs: ``SamplingRows.all_plain_greedy``): the first argmax of each row,
    ``-1`` for a row with a NaN or +inf logit -- exactly ``sample(...).tokens`` of such a batch,
    without building its ``SamplingBatch``."""
    x = logits.to(work_dtype(logits))
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0]:  # numpy's SIMD argmax: first max, NaN first
        a = x.numpy()
        idx = a.argmax(axis=1)
        best = np.take_along_axis(a, idx[:, None], 1)[:, 0]
        return torch.from_numpy(np.where(np.isfinite(best), idx, -1).astype(np.int64))
    row_max, tokens = first_argmax(x)
    return tokens.masked_fill(~torch.isfinite(row_max), -1)


def greedy_masked_tokens(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """``greedy_tokens`` of rows whose only logit change is a token mask (``bitmask [B, W]``, None:
    none; ``SamplingRows.all_plain_greedy(..., grammar=True)``), exactly ``sample(...).tokens`` of
    such a batch (``-1`` also for a row whose every token is masked). The mask is applied in place
    to ``logits`` when it is contiguous float32: the caller hands over logits it no longer needs."""
    x = logits.to(work_dtype(logits))
    if bitmask is None:
        return greedy_tokens(x)
    if x.dtype == torch.float64:  # the exact tests' dtype: the out-of-place reference
        return greedy_tokens(apply_token_bitmask(x, bitmask))
    return greedy_tokens(apply_token_bitmask_(x.contiguous(), bitmask))


class _Group(NamedTuple):
    """Sampling result of a group of rows (one mode): ``lse`` None when no logprob is asked."""

    tokens: torch.Tensor
    valid: torch.Tensor
    lse: torch.Tensor | None
    filtered: Filtered | None


def _greedy_group(scaled: torch.Tensor, batch: SamplingBatch, logprobs: bool) -> _Group:
    """Greedy rows: one argmax; the kept set's normalizer only when logprobs are asked."""
    row_max, tokens = first_argmax(scaled)
    if not logprobs:
        return _Group(tokens, torch.isfinite(row_max), None, None)
    f = filter_scaled(scaled, batch)
    return _Group(tokens, f.valid, _kept_logsumexp(f), f)


def _stochastic_group(
    scaled: torch.Tensor, batch: SamplingBatch, seeds: torch.Tensor, positions: torch.Tensor, logprobs: bool
) -> _Group:
    """Stochastic rows: thresholds, then one inverse-CDF draw keyed by (seed, position)."""
    f = filter_scaled(scaled, batch)
    tokens, lse = draw(f, uniform(seeds, positions, Purpose.SAMPLE))
    return _Group(tokens, f.valid, lse if logprobs else None, f)


def _output(scaled: torch.Tensor, g: _Group, n: int) -> SampleOutput:
    """The ``SampleOutput`` of one group: invalid rows flagged, logprobs NaN when not computed."""
    invalid = ~g.valid
    tokens = g.tokens.masked_fill(invalid, 0)
    rows = tokens.shape[0]
    if g.lse is None or g.filtered is None:
        nan = torch.full((rows,), float("nan"), device=tokens.device)
        top_ids = torch.zeros(rows, n, dtype=torch.int64, device=tokens.device)
        return SampleOutput(tokens.masked_fill(invalid, -1), nan, top_ids, nan[:, None].expand(rows, n).clone())
    f, lse = g.filtered, g.lse
    chosen = scaled.gather(1, tokens[:, None])[:, 0].to(torch.float64) - lse
    top = f.cand_values[:, :n]
    top_lp = torch.where(top >= f.threshold[:, None], top.to(torch.float64) - lse[:, None], float("-inf"))
    return SampleOutput(
        tokens=tokens.masked_fill(invalid, -1),
        logprobs=chosen.to(torch.float32).masked_fill(invalid, float("nan")),
        top_ids=f.cand_ids[:, :n],
        top_logprobs=top_lp.to(torch.float32).masked_fill(invalid[:, None], float("nan")),
    )


def _sample_by_mode(scaled: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor) -> SampleOutput:
    """torch backend: greedy and stochastic rows sampled as two groups (a greedy row never pays
    for thresholds or draws), each a row subset of the same per-row computation."""
    n = batch.num_logprobs
    logprobs = batch.any_logprobs or n > 0
    if batch.all_greedy:
        return _output(scaled, _greedy_group(scaled, batch, logprobs), n)
    if not batch.any_greedy:
        return _output(scaled, _stochastic_group(scaled, batch, batch.seeds, positions, logprobs), n)
    greedy = batch.greedy.nonzero()[:, 0]
    stochastic = (~batch.greedy).nonzero()[:, 0]
    parts = []
    for rows, is_greedy in ((greedy, True), (stochastic, False)):
        sub, sub_batch = scaled.index_select(0, rows), select_rows(batch, rows)
        if is_greedy:
            group = _greedy_group(sub, sub_batch, logprobs)
        else:
            group = _stochastic_group(sub, sub_batch, batch.seeds[rows], positions[rows], logprobs)
        parts.append((rows, _output(sub, group, n)))
    return SampleOutput(*(_scatter_rows(batch.num_rows, [(r, o[i]) for r, o in parts]) for i in range(4)))


def _scatter_rows(num_rows: int, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One ``[num_rows, ...]`` tensor from disjoint row groups ``(rows, values)`` covering every row."""
    first = parts[0][1]
    out = first.new_empty((num_rows, *first.shape[1:]))
    for rows, values in parts:
        out.index_copy_(0, rows, values)
    return out


def sample_together(
    scaled: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, backend: str
) -> SampleOutput:
    """Every row through the same op sequence, greedy rows then take the argmax: the triton
    path (no host sync, graph-capturable) and, with ``backend="torch"``, the reference that the
    grouped torch path must match token for token (tests)."""
    f = filter_scaled(scaled, batch, backend=backend)
    logprobs = batch.any_logprobs or batch.num_logprobs > 0
    if batch.all_greedy:  # no draw: the argmax, and the kept set's normalizer for the logprobs
        tokens = f.scaled.argmax(dim=1)
        lse = _kept_logsumexp(f) if logprobs else None
    else:
        u = uniform(batch.seeds, positions, Purpose.SAMPLE)
        tokens, lse = draw(f, u, sync_free=backend == "triton")
        lse = lse if logprobs else None
        if batch.any_greedy:  # greedy rows: the same argmax and normalizer as in an all-greedy batch
            tokens = torch.where(batch.greedy, f.scaled.argmax(dim=1), tokens)
            lse = torch.where(batch.greedy, _kept_logsumexp(f), lse) if logprobs else None
    return _output(scaled, _Group(tokens, f.valid, lse, f), batch.num_logprobs)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, backend: str = "auto"
) -> SampleOutput:
    """Sample one token per row of ``logits [B, V]``.

    ``positions [B]`` (int64) is the absolute position of the token being sampled; with the row's
    seed it keys the uniform (purpose SAMPLE), so a seeded request draws the same token whatever
    the batch. Greedy rows (temperature 0) take the first argmax of the processed logits.
    ``backend``: ``torch`` (CPU default: greedy and stochastic rows as separate groups,
    top-k-bounded thresholds, may sync for rare rows) or ``triton`` (CUDA default: sort-free
    threshold kernel, no host sync); both give the same law and, up to float rounding at a
    boundary, the same tokens. ``logprobs`` / ``top_logprobs`` are computed only when a row of
    the batch asked for them (``batch.any_logprobs``), else they are NaN.
    """
    if positions.shape != (batch.num_rows,):
        raise ValueError(f"positions must have shape [{batch.num_rows}], got {tuple(positions.shape)}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.device.type == "cpu" and bool((positions < 0).any()):  # no host sync on GPUs
        raise ValueError(f"positions must be >= 0, got {positions.min().item()}")
    backend = resolve_backend(backend, logits.device)
    scaled = scale_logits(logits, batch)
    if backend == "triton":
        return sample_together(scaled, batch, positions, backend)
    return _sample_by_mode(scaled, batch, positions)
