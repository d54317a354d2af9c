"""``process_logits``: the one logit pipeline shared by sampling and verification.

Order (per row, batched, no Python loop over rows):

1. penalties on the history: repetition (HF: divide positive / multiply negative logits of every
   token seen in prompt + output), then frequency (``- f * count``) and presence (``- p``) over
   generated tokens only;
2. min-token ban: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get -inf while fewer than
   ``min_new_tokens`` tokens have been generated;
3. ``logit_bias`` (added), then ``allowed_token_ids`` (everything else -inf), then the grammar's
   token bitmask (``SamplingBatch.token_bitmask``: tokens it disallows -inf);
4. temperature (greedy rows use 1);
5. top-k, top-p, min-p as one per-row threshold on the scaled logits: a token is kept iff its
   scaled logit is >= the threshold (ties at the boundary are kept). top-k keeps the k largest;
   top-p keeps, in descending order, the shortest prefix of the top-k-renormalized distribution
   whose mass reaches ``top_p``; min-p keeps tokens with probability >= ``min_p * max``.

Thresholds are found without sorting the vocabulary: a top-k (``_top_op``: a C++ CPU operator,
``torch.topk`` elsewhere) with a bound
``K = max(256, max top_k, logprobs)`` and a cumulative sum over those K candidates; a row whose
answer is not inside its candidates (a flat distribution, ties at the K-th value) is redone with
8x more candidates, or directly with a full sort when the candidates held under half the mass
top-p needs (host syncs, on those rows only). That is the ``torch`` backend, the CPU default.
The ``triton`` backend (CUDA default) finds the same thresholds with a sort-free kernel and no
host sync (``triton_kernels``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from treeserve.sampling._top_op import top_candidates, topk_rows
from treeserve.sampling.backend import resolve_backend
from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.bitmask import apply_token_bitmask, apply_token_bitmask_

CANDIDATES = 256
"""Default bound K on the candidate set (``torch.topk``) used to find thresholds."""


class Filtered(NamedTuple):
    """Scaled logits and the per-row keep threshold, before the mask is materialized.

    ``scaled [R, V]`` (penalties, bans, bias, temperature applied), ``threshold [R]``,
    ``cand_values/cand_ids [R, K]`` the K largest scaled logits (descending), ``fits [R]``
    True when every kept token of the row is among its candidates, ``valid [R]`` False for rows
    with NaN/+inf logits or no finite logit.
    """

    scaled: torch.Tensor
    threshold: torch.Tensor
    cand_values: torch.Tensor
    cand_ids: torch.Tensor
    fits: torch.Tensor
    valid: torch.Tensor


def work_dtype(logits: torch.Tensor) -> torch.dtype:
    """float64 inputs stay float64 (exact tests); everything else is processed in float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition / frequency / presence penalties (stage 1), dense per-row counts, no sync."""
    rows, vocab = x.shape
    seen = x.new_zeros(rows, vocab).index_put_(
        (batch.hist_rows, batch.hist_tokens), batch.hist_weight.to(x.dtype), accumulate=True
    )
    out = x.new_zeros(rows, vocab).index_put_(
        (batch.hist_rows, batch.hist_tokens), batch.hist_output.to(x.dtype), accumulate=True
    )
    rp = batch.repetition_penalty.to(x.dtype)[:, None]
    x = torch.where(seen > 0, torch.where(x > 0, x / rp, x * rp), x)
    fp = batch.frequency_penalty.to(x.dtype)[:, None]
    pp = batch.presence_penalty.to(x.dtype)[:, None]
    return x - fp * out - pp * (out > 0).to(x.dtype)


def scale_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Stages 1-4: penalties, min-token ban, logit bias, allowed tokens, grammar mask, temperature."""
    if logits.dim() != 2 or logits.shape != (batch.num_rows, batch.vocab_size):
        raise ValueError(
            f"logits must have shape [{batch.num_rows}, {batch.vocab_size}] (rows x vocab), got {tuple(logits.shape)}"
        )
    x = logits.to(work_dtype(logits))
    if batch.has_penalties:
        x = apply_penalties(x, batch)
    if batch.ban_ids.shape[1] > 0 and _needed(batch.min_tokens_left > 0):
        banned = (batch.ban_ids >= 0) & (batch.min_tokens_left > 0)[:, None]
        ids = batch.ban_ids.clamp(min=0)
        # amin, not a plain scatter: a padding entry (-1 -> id 0) must not overwrite a real ban
        # of id 0 in the same row (duplicate scatter indices have no defined winner).
        x = x.scatter_reduce(1, ids, torch.where(banned, float("-inf"), x.gather(1, ids)), reduce="amin")
    if batch.bias_ids.shape[1] > 0:
        x = x.scatter_add(1, batch.bias_ids, batch.bias_values.to(x.dtype))
    if batch.allowed is not None:
        x = x.masked_fill(~batch.allowed, float("-inf"))
    mask = batch.token_bitmask
    if mask is not None and x.dtype == torch.float64:  # exact tests: the reference
        x = apply_token_bitmask(x, mask)
        mask = None
    if _needed(batch.temperature != 1.0):  # dividing by 1 is exact: skipping it changes no bit
        x = x / batch.temperature.to(x.dtype)[:, None]
    elif mask is not None and x is logits:
        x = x.clone()  # the mask is applied in place, never to the caller's logits
    # The mask after the temperature, in place on the quotient (no copy): -inf / t is -inf, so the
    # values are those of masking first.
    return x if mask is None else apply_token_bitmask_(x.contiguous(), mask)


def _needed(rows: torch.Tensor) -> bool:
    """Whether a stage flagged per row by ``rows [R]`` (bool) must run.

    On CPU the answer is read (microseconds), so neutral stages skip their full-vocabulary pass;
    on other devices it is always True (no host sync, the op sequence stays graph-capturable).
    """
    return rows.device.type != "cpu" or bool(rows.any())


def thresholds(
    cand: torch.Tensor, vocab_size: int, batch: SamplingBatch, full_mass: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row keep threshold from the K largest scaled logits ``cand [R, K]`` (descending).

    ``full_mass [R]`` is ``sum(exp(scaled - max))`` over the whole row (needed by top-p rows
    without top-k; None when K == V or no such row). Returns ``(threshold, exact)``; rows with
    ``exact`` False need a larger K. With K == vocab_size every row is exact (the reference).
    """
    k = cand.shape[1]
    complete = k == vocab_size
    m = cand[:, :1]
    neg_inf = torch.full_like(m[:, 0], float("-inf"))
    k_on = batch.top_k > 0
    thr_k = torch.where(k_on, cand.gather(1, (batch.top_k.clamp(1, k) - 1)[:, None])[:, 0], neg_inf)

    weights = torch.exp(cand - m) * (cand >= thr_k[:, None])
    p_on = batch.top_p < 1.0
    if complete:
        mass = weights.sum(1)
    else:
        mass = torch.where(k_on, weights.sum(1), full_mass if full_mass is not None else weights.sum(1))
    cum = torch.cumsum(weights, 1)
    hit = cum >= batch.top_p.to(cand.dtype)[:, None] * mass[:, None]
    found = hit.any(1)
    pivot = cand.gather(1, hit.to(torch.int8).argmax(1, keepdim=True))[:, 0]
    thr_p = torch.where(p_on & found, pivot, neg_inf)

    log_min_p = torch.log(batch.min_p.to(cand.dtype))
    thr_m = torch.where(batch.min_p > 0, m[:, 0] + log_min_p, neg_inf)
    threshold = torch.maximum(torch.maximum(thr_k, thr_p), thr_m)
    if complete:
        return threshold, torch.ones_like(found)
    tie_at_k = k_on & (cand[:, -1] == thr_k)
    exact = ~(p_on & (tie_at_k | (~k_on & ~found)))
    return threshold, exact


def _top_candidates(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values (descending) and their ids, ties by id (lower first) as the CPU
    operator orders them (``topk_rows``); a full stable sort when k is most of the row. So the
    reported top ids of a row do not depend on which path its batch took."""
    if 2 * k > scaled.shape[1]:
        return torch.sort(scaled, dim=1, descending=True, stable=True)
    return topk_rows(scaled, k)


def _refine(
    scaled: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor, full_mass: torch.Tensor | None, k: int,
    coverage: torch.Tensor,
) -> torch.Tensor:
    """Thresholds of ``rows`` whose answer was not among their first ``k`` candidates.

    Retries with 8x more candidates, then with the whole row (host syncs; rare rows only). When a
    row's candidates covered less than half the mass top-p needs (``coverage`` = their share of
    the row's mass), 8x more will not do: the whole row is sorted at once.
    """
    vocab = batch.vocab_size
    sub = _select_rows(batch, rows)
    sub_mass = None if full_mass is None else full_mass[rows]
    flat = bool((coverage[rows] < 0.5 * sub.top_p).any())
    k = vocab if flat else min(vocab, 8 * k)
    cand = _top_candidates(scaled[rows], k)[0]
    k = cand.shape[1]
    threshold, exact = thresholds(cand, vocab, sub, sub_mass)
    if k < vocab and not bool(exact.all()):
        bad = (~exact).nonzero()[:, 0]
        threshold[bad] = _refine(scaled[rows], sub, bad, sub_mass, k, torch.ones_like(sub.top_p))
    return threshold


def filter_logits(logits: torch.Tensor, batch: SamplingBatch, backend: str = "torch") -> Filtered:
    """Stages 1-5 without materializing the mask (``sample`` uses candidates when they suffice).

    The candidate bound is the module's ``CANDIDATES``. ``backend="triton"`` finds the
    thresholds with the sort-free kernel (no host sync; ``fits`` is then all False and the
    candidates are only the top logprobs).
    """
    return filter_scaled(scale_logits(logits, batch), batch, backend)


def filter_scaled(scaled: torch.Tensor, batch: SamplingBatch, backend: str = "torch") -> Filtered:
    """Stage 5 on already scaled logits ``scaled [R, V]`` (``scale_logits``'s output): the same
    thresholds and candidates as ``filter_logits``. Only the filter fields of ``batch`` are read
    (``top_k/top_p/min_p`` and the host flags), so a row subset from ``select_rows`` will do."""
    vocab = batch.vocab_size
    if not batch.any_filter or backend == "triton":
        # Candidates only serve the reported top logprobs (and the row max); every row is drawn
        # from its full row.
        if batch.num_logprobs:
            cand, cand_ids = topk_rows(scaled, batch.num_logprobs)
        else:
            cand, cand_ids = scaled.max(dim=1, keepdim=True)
        valid = torch.isfinite(cand[:, 0])
        if batch.any_filter:
            from treeserve.sampling.triton_kernels import thresholds_triton

            threshold = thresholds_triton(scaled, batch.top_k, batch.top_p, batch.min_p).to(scaled.dtype)
        else:
            threshold = torch.full_like(cand[:, 0], float("-inf"))
        return Filtered(scaled, threshold, cand, cand_ids, torch.zeros_like(valid), valid)
    k = min(vocab, max(CANDIDATES, batch.max_top_k, batch.num_logprobs))
    full_mass = None
    if 2 * k <= vocab and batch.any_top_p:  # top-p rows without top-k need the row's mass
        cand, cand_ids, full_mass = top_candidates(scaled, k)
    else:
        cand, cand_ids = _top_candidates(scaled, k)
    k = cand.shape[1]
    valid = torch.isfinite(cand[:, 0])
    cand = torch.where(valid[:, None], cand, torch.zeros_like(cand))
    if full_mass is not None:  # an invalid row's mass is never used: any finite value will do
        full_mass = torch.where(valid, full_mass, torch.ones_like(full_mass))
    threshold, exact = thresholds(cand, vocab, batch, full_mass)
    if k < vocab and not bool(exact.all()):
        rows = (~exact).nonzero()[:, 0]
        mass = full_mass if full_mass is not None else torch.ones_like(batch.top_p)
        coverage = torch.exp(cand - cand[:, :1]).sum(1) / mass
        threshold[rows] = _refine(scaled, batch, rows, full_mass, k, coverage)
    # Every kept token is a candidate when the threshold is above the K-th value, or when the
    # K-th value is already -inf (the rest of the row has probability 0).
    fits = (threshold > cand[:, -1]) | torch.isneginf(cand[:, -1]) if k < vocab else torch.ones_like(valid)
    return Filtered(scaled, threshold, cand, cand_ids, fits & valid, valid)


def _select_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The filter parameters of a subset of rows (only the fields ``thresholds`` reads)."""
    return replace(batch, top_k=batch.top_k[rows], top_p=batch.top_p[rows], min_p=batch.min_p[rows])


def select_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The filter view of ``rows [R']`` (CPU int64) for ``filter_scaled``: their ``top_k/top_p/
    min_p`` and ``any_filter / any_top_p`` narrowed to them (both only switch stages that are
    no-ops on rows without a filter, so a row's thresholds do not change). The candidate bound
    (``max_top_k``, ``num_logprobs``) stays the batch's, as it was when every row was filtered
    together."""
    sub = _select_rows(batch, rows)
    on_p = sub.top_p < 1.0
    return replace(sub, any_top_p=bool(on_p.any()), any_filter=bool(((sub.top_k > 0) | on_p | (sub.min_p > 0)).any()))


def process_logits(logits: torch.Tensor, batch: SamplingBatch, backend: str = "auto") -> torch.Tensor:
    """Processed logits ``[R, V]``: stages 1-5 applied, filtered tokens set to -inf.

    ``softmax`` of the result is the distribution ``sample`` draws from and ``verify`` verifies
    against (the processed, post-temperature distribution). Rows with NaN/+inf logits or no
    finite logit come back all-NaN. float64 in -> float64 out, else float32. No host sync unless
    a row needs the full-sort fallback of the torch backend (see module docstring).
    ``backend``: ``auto`` | ``torch`` | ``triton`` (see ``backend.resolve_backend``).
    """
    f = filter_logits(logits, batch, backend=resolve_backend(backend, logits.device))
    out = f.scaled
    if batch.any_filter:
        out = out.masked_fill(out < f.threshold[:, None], float("-inf"))
    return out.masked_fill(~f.valid[:, None], float("nan"))
