"""Plain-Python float64 references for the sampling tests (readable, per row, no torch tricks)."""

from __future__ import annotations

import math

from treeserve.sampling import SamplingParams

NEG_INF = float("-inf")


def penalize(row: list[float], p: SamplingParams, history: list[int], num_generated: int) -> list[float]:
    """Repetition over the whole history (HF), frequency/presence over the generated tail (OpenAI)."""
    out = list(row)
    generated = history[len(history) - num_generated:]
    for t in set(history):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(generated):
        c = generated.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def process_row(
    row: list[float],
    p: SamplingParams,
    history: list[int] = (),
    num_generated: int | None = None,
    eos: tuple[int, ...] = (),
) -> list[float]:
    """The documented pipeline for one row; filtered tokens are -inf."""
    history = list(history)
    num_generated = len(history) if num_generated is None else num_generated
    x = penalize(row, p, history, num_generated)
    if num_generated < p.min_new_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = NEG_INF
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.allowed_token_ids is not None:
        x = [v if i in p.allowed_token_ids else NEG_INF for i, v in enumerate(x)]
    temp = p.temperature if p.temperature > 0 else 1.0
    x = [v / temp for v in x]
    return [v if v >= threshold(x, p) else NEG_INF for v in x]


def threshold(x: list[float], p: SamplingParams) -> float:
    """Keep threshold: max of the top-k, top-p and min-p thresholds (ties at a boundary kept)."""
    desc = sorted(x, reverse=True)
    m = desc[0]
    thr = NEG_INF
    if 0 < p.top_k < len(x):
        thr = desc[p.top_k - 1]
    if p.top_p < 1.0:
        weights = [math.exp(v - m) for v in desc if v >= thr]
        mass = sum(weights)
        cum = 0.0
        for v, w in zip(desc, weights):
            cum += w
            if cum >= p.top_p * mass:
                thr = max(thr, v)
                break
    if p.min_p > 0:
        thr = max(thr, m + math.log(p.min_p))
    return thr


def softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v > NEG_INF else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]
