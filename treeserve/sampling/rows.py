"""``SamplingRows``: per-row sampling state resident in tensors, written once per request.

A runner keeps one :class:`SamplingRows` with a row per request slot (the request->slot table's
rows). A request's parameters are validated and written into its row the first time it is
sampled in that row (:meth:`SamplingRows.admit`); a step then *gathers* its rows into a
:class:`SamplingBatch` (:meth:`SamplingRows.batch`) with a few ``index_select`` calls instead of
rebuilding every field from ``SamplingParams``. Penalty token counts (frequency/presence/
repetition) are kept per row and updated with the newly committed tokens only.

The gathered batch equals ``SamplingBatch.build`` of the same requests (tests check this), so
sampling does not change. A caller that stages a step's inputs itself (the static decode runner:
one host buffer, one host->device copy) gathers the per-row values on the host instead
(:meth:`SamplingRows.host_rows`, numpy mirrors of the resident tensors, no device work).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.params import SamplingParams

__all__ = ["HostRows", "SamplingRows"]

_MAX_SEED = 2**63 - 1
# Columns of the resident float64 block and int64 block (one gather each per step).
_REALS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_INTS = ("top_k", "seeds", "min_new_tokens")


class _RowState:
    """Host side of one row: what the flags and the sparse history need."""

    __slots__ = ("owner", "params", "ban", "bias", "counts", "num_counted", "penalized")

    def __init__(self, owner: object, params: SamplingParams, ban: list[int], penalized: bool) -> None:
        self.owner = owner
        self.params = params
        self.ban = ban
        self.bias = list(params.logit_bias.items())
        self.counts: dict[int, int] = {}
        self.num_counted = 0
        self.penalized = penalized


class HostRows(NamedTuple):
    """Per-row sampling values of a step gathered on the host (numpy, row ``i`` = the step's
    ``i``-th request), as :meth:`SamplingRows.batch` would gather them on the device;
    ``ban_ids`` is ``[n, width]`` padded with -1."""

    temperature: np.ndarray
    greedy: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    min_tokens_left: np.ndarray
    ban_ids: np.ndarray


class SamplingRows:
    """``num_rows`` rows of sampling parameters on ``device`` for a ``vocab_size`` vocabulary.

    ``eos_token_ids`` join every row's banned ids before ``min_new_tokens`` (unless
    ``ignore_eos``). Row ids are the caller's (a request's table row); a row belongs to the
    last ``owner`` admitted into it.
    """

    def __init__(
        self, num_rows: int, vocab_size: int, device: torch.device | str = "cpu", eos_token_ids: Sequence[int] = ()
    ) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows must be an int >= 1, got {num_rows!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        bad_eos = [t for t in eos_token_ids if not 0 <= t < vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids outside [0, {vocab_size}): {bad_eos}")
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos = set(eos_token_ids)
        self._reals = torch.zeros(len(_REALS), num_rows, dtype=torch.float64, device=self.device)
        self._ints = torch.zeros(len(_INTS), num_rows, dtype=torch.int64, device=self.device)
        self._greedy = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        self._ban = torch.full((num_rows, 0), -1, dtype=torch.int64, device=self.device)
        self._bias_ids = torch.zeros(num_rows, 0, dtype=torch.int64, device=self.device)
        self._bias_values = torch.zeros(num_rows, 0, dtype=torch.float64, device=self.device)
        self._allowed: torch.Tensor | None = None
        # Host flags per row, for the batch's stage switches (numpy: cheap gathers).
        self._flag_greedy = np.zeros(num_rows, dtype=bool)
        self._flag_top_p = np.zeros(num_rows, dtype=bool)
        self._flag_filter = np.zeros(num_rows, dtype=bool)
        self._flag_penalty = np.zeros(num_rows, dtype=bool)
        self._flag_allowed = np.zeros(num_rows, dtype=bool)
        self._flag_structured = np.zeros(num_rows, dtype=bool)
        self._top_k = np.zeros(num_rows, dtype=np.int64)
        self._logprobs = np.zeros(num_rows, dtype=np.int64)
        self._flag_logprobs = np.zeros(num_rows, dtype=bool)
        # Greedy with nothing that changes logits, a grammar's mask aside, or asks for logprobs (a
        # pending min_new_tokens ban is checked per step: ``_ban_until``, 0 when no id is banned);
        # such rows take ``greedy_tokens`` (those without structured output) or ``greedy_masked_tokens``.
        self._flag_plain_but_grammar = np.zeros(num_rows, dtype=bool)
        self._ban_until = np.zeros(num_rows, dtype=np.int64)
        self._ban_len = np.zeros(num_rows, dtype=np.int64)
        self._bias_len = np.zeros(num_rows, dtype=np.int64)
        self._state: list[_RowState | None] = [None] * num_rows
        # Host mirrors of the resident values (``host_rows``).
        self._reals_h = np.zeros((len(_REALS), num_rows), dtype=np.float64)
        self._ints_h = np.zeros((len(_INTS), num_rows), dtype=np.int64)
        self._ban_h = np.full((num_rows, 0), -1, dtype=np.int64)

    def admit(self, row: int, owner: object, params: SamplingParams, seed: int, prompt_ids: Sequence[int]) -> None:
        """Validate ``params`` and ``seed`` and write them into ``row`` for ``owner``.

        ``prompt_ids`` seed the penalty history (their output count is 0). ``ValueError`` /
        ``TypeError`` naming the field for an out-of-range row, id or seed; the row is
        unchanged then.
        """
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.num_rows:
            raise ValueError(f"row must be an int in [0, {self.num_rows}), got {row!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate_for_vocab(self.vocab_size)
        if not 0 <= int(seed) <= _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
        p = params
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else 0
        penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ban = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))
        state = _RowState(owner, p, ban, penalized)
        if penalized:
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_ids has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            state.counts = dict.fromkeys(prompt_ids, 0)
        reals = (p.temperature if p.temperature > 0 else 1.0, p.top_p, p.min_p, p.repetition_penalty,
                 p.frequency_penalty, p.presence_penalty)  # fmt: skip
        ints = (top_k, int(seed), p.min_new_tokens)
        self._reals_h[:, row] = reals
        self._ints_h[:, row] = ints
        if len(ban) > self._ban_h.shape[1]:
            self._ban_h = np.pad(self._ban_h, ((0, 0), (0, len(ban) - self._ban_h.shape[1])), constant_values=-1)
        self._ban_h[row] = -1
        self._ban_h[row, : len(ban)] = ban
        self._reals[:, row] = torch.from_numpy(self._reals_h[:, row].copy())
        self._ints[:, row] = torch.from_numpy(self._ints_h[:, row].copy())
        self._greedy[row] = p.greedy
        self._ban = _write_padded(self._ban, row, ban, -1)
        self._bias_ids = _write_padded(self._bias_ids, row, [t for t, _ in state.bias], 0)
        self._bias_values = _write_padded(self._bias_values, row, [b for _, b in state.bias], 0.0)
        if p.allowed_token_ids is not None and self._allowed is None:
            self._allowed = torch.ones(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        if self._allowed is not None:
            self._allowed[row] = p.allowed_token_ids is None
            if p.allowed_token_ids is not None:
                self._allowed[row, list(p.allowed_token_ids)] = True
        self._flag_greedy[row] = p.greedy
        self._flag_top_p[row] = p.top_p < 1.0
        self._flag_filter[row] = top_k > 0 or p.top_p < 1.0 or p.min_p > 0
        self._flag_penalty[row] = penalized
        self._flag_allowed[row] = p.allowed_token_ids is not None
        self._flag_structured[row] = p.structured is not None
        self._top_k[row] = top_k
        self._logprobs[row] = p.logprobs or 0
        self._flag_logprobs[row] = p.logprobs is not None
        self._ban_len[row] = len(ban)
        self._bias_len[row] = len(state.bias)
        changes_logits = penalized or bool(state.bias) or p.allowed_token_ids is not None
        self._flag_plain_but_grammar[row] = p.greedy and not changes_logits and p.logprobs is None
        self._ban_until[row] = p.min_new_tokens if ban else 0
        self._state[row] = state

    def owner(self, row: int) -> object:
        """Who was last admitted into ``row`` (None: nobody)."""
        state = self._state[row]
        return None if state is None else state.owner

    def holds(self, row: int, owner: object, params: SamplingParams) -> bool:
        """Whether ``row`` holds ``owner`` admitted with these very ``params`` (same object)."""
        state = self._state[row]
        return state is not None and state.owner is owner and state.params is params

    def all_plain_greedy(
        self,
        rows: Sequence[int],
        num_generated: Sequence[int] | Callable[[], Sequence[int]],
        grammar: bool = False,
    ) -> bool:
        """Whether every one of ``rows`` (admitted; row ``i`` has generated ``num_generated[i]``
        tokens) is plain greedy this step: temperature 0, no penalty, logit bias, allowed-token
        set, structured output, logprobs, nor a banned id still suppressed by ``min_new_tokens``. Sampling such rows
        is ``greedy_tokens`` of their logits (the same tokens as ``sample`` of their batch).
        With ``grammar``, rows with structured output count too: their grammar's token mask is
        then the only change to their logits (``greedy_masked_tokens``).

        ``num_generated`` may be a function returning the counts: it is called only when one of
        the rows bans ids until some count (the counts cost a pass over the requests)."""
        idx = np.asarray(rows, dtype=np.int64)
        if not self._flag_plain_but_grammar[idx].all() or (not grammar and self._flag_structured[idx].any()):
            return False
        ban_until = self._ban_until[idx]
        if not ban_until.any():
            return True
        counts = num_generated() if callable(num_generated) else num_generated
        return not (ban_until > np.asarray(counts, dtype=np.int64)).any()

    def per_row_only(self, rows: np.ndarray, max_ban: int, max_logprobs: int) -> bool:
        """Whether sampling ``rows`` (admitted) needs nothing beyond :class:`HostRows`: no
        penalty, logit bias, allowed-token set or structured output, at most ``max_ban`` banned
        ids and at most ``max_logprobs`` top logprobs per row."""
        return not (
            self._flag_penalty[rows].any()
            or self._flag_allowed[rows].any()
            or self._bias_len[rows].any()
            or self._flag_structured[rows].any()
            or self._ban_len[rows].max(initial=0) > max_ban
            or self._logprobs[rows].max(initial=0) > max_logprobs
        )

    def host_rows(self, rows: np.ndarray, num_generated: np.ndarray, ban_width: int) -> HostRows:
        """The per-row values of ``rows`` (admitted; row ``i`` has generated ``num_generated[i]``
        tokens) gathered from the host mirrors, banned ids padded to ``ban_width`` columns
        (``ValueError`` when a row bans more)."""
        if self._ban_len[rows].max(initial=0) > ban_width:
            raise ValueError(f"ban_width must be >= the rows' banned ids ({self._ban_len[rows].max()}), got {ban_width}")
        temperature, top_p, min_p = self._reals_h[:3, rows]
        top_k, seeds, min_new = self._ints_h[:, rows]
        ban = np.full((rows.shape[0], ban_width), -1, dtype=np.int64)
        width = min(ban_width, self._ban_h.shape[1])
        ban[:, :width] = self._ban_h[rows, :width]
        left = np.maximum(min_new - num_generated, 0)
        return HostRows(temperature, self._flag_greedy[rows], top_k, top_p, min_p, seeds, left, ban)

    def batch(self, rows: Sequence[int], outputs: Sequence[Sequence[int]]) -> SamplingBatch:
        """The :class:`SamplingBatch` of ``rows`` (admitted), row ``i`` having generated
        ``outputs[i]`` so far: penalty counts take in the tokens not seen yet, then the rows'
        tensors are gathered."""
        idx = np.asarray(rows, dtype=np.int64)
        num_generated = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=len(outputs))
        dev = self.device
        index = torch.from_numpy(idx).to(dev, non_blocking=True)
        reals = self._reals.index_select(1, index)
        ints = self._ints.index_select(1, index)
        temperature, top_p, min_p, rep, freq, pres = reals.unbind(0)
        top_k, seeds, min_new = ints.unbind(0)
        gen = torch.from_numpy(num_generated).to(dev, non_blocking=True)
        ban_width = int(self._ban_len[idx].max())
        bias_width = int(self._bias_len[idx].max())
        penalized = self._flag_penalty[idx]
        hist = self._history([int(r) for r in idx[penalized]], np.flatnonzero(penalized), outputs)
        greedy_flags = self._flag_greedy[idx]
        top_ks = self._top_k[idx]
        return SamplingBatch(
            vocab_size=self.vocab_size,
            temperature=temperature,
            greedy=self._greedy.index_select(0, index),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            hist_rows=torch.tensor(hist[0], dtype=torch.int64, device=dev),
            hist_tokens=torch.tensor(hist[1], dtype=torch.int64, device=dev),
            hist_weight=torch.ones(len(hist[0]), dtype=torch.float32, device=dev),
            hist_output=torch.tensor(hist[2], dtype=torch.float32, device=dev),
            bias_ids=self._bias_ids.index_select(0, index)[:, :bias_width],
            bias_values=self._bias_values.index_select(0, index)[:, :bias_width],
            allowed=self._allowed.index_select(0, index) if self._flag_allowed[idx].any() else None,
            ban_ids=self._ban.index_select(0, index)[:, :ban_width],
            min_tokens_left=(min_new - gen).clamp_(min=0),
            seeds=seeds,
            num_logprobs=int(self._logprobs[idx].max()),
            max_top_k=int(top_ks.max()),
            has_penalties=bool(penalized.any()),
            any_greedy=bool(greedy_flags.any()),
            all_greedy=bool(greedy_flags.all()),
            any_top_p=bool(self._flag_top_p[idx].any()),
            any_filter=bool(self._flag_filter[idx].any()),
            any_logprobs=bool(self._flag_logprobs[idx].any()),
        )

    def _history(
        self, rows: list[int], positions: np.ndarray, outputs: Sequence[Sequence[int]]
    ) -> tuple[list[int], list[int], list[float]]:
        """Sparse (batch row, token, output count) entries of the penalized rows, after adding
        each row's newly generated tokens to its counts."""
        out_rows: list[int] = []
        toks: list[int] = []
        counts_out: list[float] = []
        for row, i in zip(rows, positions.tolist()):
            state = self._state[row]
            assert state is not None
            new = outputs[i][state.num_counted :]
            counts = state.counts
            for t in new:
                counts[t] = counts.get(t, 0) + 1
            state.num_counted += len(new)
            out_rows.extend([i] * len(counts))
            toks.extend(counts)
            counts_out.extend(float(c) for c in counts.values())
        return out_rows, toks, counts_out


def _write_padded(buf: torch.Tensor, row: int, values: list, pad: float) -> torch.Tensor:
    """``buf[row, :len(values)] = values``, the rest of the row ``pad``; widens ``buf`` when needed."""
    if len(values) > buf.shape[1]:
        wider = torch.full((buf.shape[0], len(values)), pad, dtype=buf.dtype, device=buf.device)
        wider[:, : buf.shape[1]] = buf
        buf = wider
    buf[row] = pad
    if values:
        buf[row, : len(values)] = torch.tensor(values, dtype=buf.dtype)
    return buf
