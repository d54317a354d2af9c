"""``SamplingBatch``: the per-row tensors ``process_logits``/``sample``/``verify`` read, built once per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from treeserve.sampling.params import SamplingParams

_MAX_SEED = 2**63 - 1


@dataclass(slots=True, frozen=True)
class SamplingBatch:
    """Per-row sampling state for one step (row i = request i), all tensors on one device.

    Built on the host by ``build`` (the only place that loops over requests); consumers only
    do batched tensor work. Python-side flags (``has_penalties`` ...) let consumers skip whole
    stages without a device sync. Greedy rows have ``temperature`` 1 (used for their reported
    logprobs) and ``greedy`` True.

    History is stored sparsely: entry e says token ``hist_tokens[e]`` occurs in row
    ``hist_rows[e]``'s history with weight ``hist_weight[e]`` (1, or 0 for padding), of which
    ``hist_output[e]`` counts as generated output (frequency/presence penalties).
    """

    vocab_size: int
    temperature: torch.Tensor  # [R] float64 (as are the other per-row reals), 1.0 on greedy rows
    greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float64, 1.0 = off
    min_p: torch.Tensor  # [R] float64, 0.0 = off
    repetition_penalty: torch.Tensor  # [R] float64
    frequency_penalty: torch.Tensor  # [R] float64
    presence_penalty: torch.Tensor  # [R] float64
    hist_rows: torch.Tensor  # [E] int64
    hist_tokens: torch.Tensor  # [E] int64
    hist_weight: torch.Tensor  # [E] float32
    hist_output: torch.Tensor  # [E] float32
    bias_ids: torch.Tensor  # [R, L] int64 (padding: id 0, value 0)
    bias_values: torch.Tensor  # [R, L] float64
    allowed: torch.Tensor | None  # [R, V] bool, None when no row restricts its tokens
    ban_ids: torch.Tensor  # [R, S] int64, -1 = padding: EOS/stop ids banned before min_new_tokens
    min_tokens_left: torch.Tensor  # [R] int64: tokens still to generate before the ban lifts
    seeds: torch.Tensor  # [R] int64
    num_logprobs: int  # top logprobs returned per row (max over the batch)
    max_top_k: int  # largest active top_k (0 if none)
    has_penalties: bool
    any_greedy: bool
    all_greedy: bool  # every row is greedy: sampling needs no random draw
    any_top_p: bool
    any_filter: bool  # some row uses top_k, top_p or min_p
    any_logprobs: bool = True  # some row asked for logprobs (``logprobs`` not None); False: not computed
    # [R, ceil(V/32)] int32 (``sampling.bitmask``): tokens a grammar allows per row, all -1 on
    # unconstrained rows; None when no row is constrained. Not supported by ``verify``.
    token_bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Number of rows R."""
        return int(self.temperature.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of every tensor in the batch."""
        return self.temperature.device

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        histories: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        num_generated: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Build the batch for ``len(params)`` requests.

        ``histories[i]`` is request i's prompt + output so far (penalties read it);
        ``num_generated[i]`` how many of its trailing tokens are output (None: the whole history
        counts as output; required when a row has ``min_new_tokens > 0``). ``seeds[i]`` in
        [0, 2**63 - 1] keys the request's random numbers. Raises ``ValueError``/``TypeError``
        naming the argument on inconsistent lengths, out-of-vocab ids or bad seeds.
        """
        n = len(params)
        if n == 0:
            raise ValueError("params must list at least one request (a batch of 0 rows has nothing to sample)")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        for name, seq in (("seeds", seeds), ("histories", histories)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} entries, expected one per request ({n})")
        if num_generated is not None and len(num_generated) != n:
            raise ValueError(f"num_generated has {len(num_generated)} entries, expected {n}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
            p.validate_for_vocab(vocab_size)
            if not 0 <= int(seeds[i]) <= _MAX_SEED:
                raise ValueError(f"seeds[{i}] must be in [0, 2**63 - 1], got {seeds[i]}")
        bad_eos = [t for t in eos_token_ids if not 0 <= t < vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids outside [0, {vocab_size}): {bad_eos}")
        if num_generated is None and any(p.min_new_tokens > 0 for p in params):
            raise ValueError("num_generated is required when a request has min_new_tokens > 0")
        gen = [len(h) for h in histories] if num_generated is None else [int(g) for g in num_generated]
        for i, (g, h) in enumerate(zip(gen, histories)):
            if not 0 <= g <= len(h):
                raise ValueError(f"num_generated[{i}] must be in [0, len(histories[{i}])={len(h)}], got {g}")

        def vec(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        f32, f64, i64 = torch.float32, torch.float64, torch.int64
        hist = _history_entries(params, histories, gen, vocab_size)
        bias_ids, bias_values = _padded_pairs([list(p.logit_bias.items()) for p in params])
        ban_lists = [
            sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))) for p in params
        ]
        ban_width = max((len(b) for b in ban_lists), default=0)
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        return cls(
            vocab_size=vocab_size,
            temperature=vec([p.temperature if p.temperature > 0 else 1.0 for p in params], f64),
            greedy=vec([p.greedy for p in params], torch.bool),
            top_k=vec(top_ks, i64),
            top_p=vec([p.top_p for p in params], f64),
            min_p=vec([p.min_p for p in params], f64),
            repetition_penalty=vec([p.repetition_penalty for p in params], f64),
            frequency_penalty=vec([p.frequency_penalty for p in params], f64),
            presence_penalty=vec([p.presence_penalty for p in params], f64),
            hist_rows=vec(hist[0], i64),
            hist_tokens=vec(hist[1], i64),
            hist_weight=torch.ones(len(hist[0]), dtype=f32, device=device),
            hist_output=vec(hist[2], f32),
            bias_ids=torch.tensor(bias_ids, dtype=i64, device=device).reshape(n, -1),
            bias_values=torch.tensor(bias_values, dtype=f64, device=device).reshape(n, -1),
            allowed=_allowed_mask(params, vocab_size, device),
            ban_ids=vec([b + [-1] * (ban_width - len(b)) for b in ban_lists], i64).reshape(n, ban_width),
            min_tokens_left=vec([max(p.min_new_tokens - g, 0) for p, g in zip(params, gen)], i64),
            seeds=vec([int(s) for s in seeds], i64),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            max_top_k=max(top_ks, default=0),
            has_penalties=any(
                p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                for p in params
            ),
            any_greedy=any(p.greedy for p in params),
            all_greedy=all(p.greedy for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_filter=any(k > 0 or p.top_p < 1.0 or p.min_p > 0 for k, p in zip(top_ks, params)),
            any_logprobs=any(p.logprobs is not None for p in params),
        )

    def expand_rows(
        self,
        reps: int,
        depth: torch.Tensor,
        extra_rows: torch.Tensor,
        extra_tokens: torch.Tensor,
        extra_weight: torch.Tensor,
    ) -> SamplingBatch:
        """Batch with each row repeated ``reps`` times (row i -> rows ``i*reps .. i*reps+reps-1``).

        Used by verification: one row per draft-tree position. ``depth [R*reps]`` is how many
        tokens each new row is past the original one (it lowers ``min_tokens_left``);
        ``extra_*`` are additional generated-history entries on the new rows (the draft tokens
        on the path to the position), with weight 0 for padding. No host sync.
        """
        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(reps, dim=0)

        offsets = torch.arange(reps, device=self.device)
        rows = (self.hist_rows[:, None] * reps + offsets).reshape(-1)
        return replace(
            self,
            temperature=rep(self.temperature),
            greedy=rep(self.greedy),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            min_p=rep(self.min_p),
            repetition_penalty=rep(self.repetition_penalty),
            frequency_penalty=rep(self.frequency_penalty),
            presence_penalty=rep(self.presence_penalty),
            hist_rows=torch.cat([rows, extra_rows]),
            hist_tokens=torch.cat([rep(self.hist_tokens), extra_tokens]),
            hist_weight=torch.cat([rep(self.hist_weight), extra_weight]),
            hist_output=torch.cat([rep(self.hist_output), extra_weight]),
            bias_ids=rep(self.bias_ids),
            bias_values=rep(self.bias_values),
            allowed=None if self.allowed is None else rep(self.allowed),
            ban_ids=rep(self.ban_ids),
            min_tokens_left=rep(self.min_tokens_left) - depth,
            seeds=rep(self.seeds),
        )


def _history_entries(
    params: Sequence[SamplingParams], histories: Sequence[Sequence[int]], gen: list[int], vocab_size: int
) -> tuple[list[int], list[int], list[float]]:
    """Unique (row, token, output count) triples for rows that use a penalty."""
    rows: list[int] = []
    toks: list[int] = []
    outs: list[float] = []
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            continue
        h = list(h)
        counts: dict[int, int] = dict.fromkeys(h, 0)
        for t in h[len(h) - gen[i]:]:
            counts[t] += 1
        bad = [t for t in counts if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"histories[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        rows.extend([i] * len(counts))
        toks.extend(counts)
        outs.extend(float(c) for c in counts.values())
    return rows, toks, outs


def _padded_pairs(pairs: list[list[tuple[int, float]]]) -> tuple[list[list[int]], list[list[float]]]:
    width = max((len(p) for p in pairs), default=0)
    ids = [[t for t, _ in p] + [0] * (width - len(p)) for p in pairs]
    vals = [[b for _, b in p] + [0.0] * (width - len(p)) for p in pairs]
    return ids, vals


def _allowed_mask(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    if all(p.allowed_token_ids is None for p in params):
        return None
    mask = torch.ones(len(params), vocab_size, dtype=torch.bool)
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            mask[i] = False
            mask[i, list(p.allowed_token_ids)] = True
    return mask.to(device)
