"""How many KV splits (flash-decoding) the Triton attention kernel uses for a step.

A program of the kernel owns one (request, KV head, block of query rows) and walks that
request's KV serially; when there are too few such programs to fill the GPU (small batches,
few KV heads) each program's walk is split into ``num_splits`` equal, ``block_n``-aligned
chunks of the request's actual KV length, each chunk gets its own program writing a partial
softmax (output and log-sum-exp), and a small reduce kernel merges the partials.

The rule, :func:`kv_splits` (pure, host ints only):

``splits = clamp(CTAS_PER_SM * num_sms // programs, 1, min(MAX_SPLITS, max_kv_len // MIN_SPLIT_KEYS))``

with ``programs = batch x num_kv_heads x query blocks``. So a batch that already gives every SM
``CTAS_PER_SM`` programs is not split, and a split never holds fewer than ``MIN_SPLIT_KEYS``
keys of the longest request. Every input is a size the step's metadata fixes on the host: under
CUDA-graph capture (the decode runner's static metadata) ``max_kv_len`` is the buffers' full
context (``pages_per_req * page_size``) and the batch is the captured bucket, so the split count
is fixed per captured key; a replay with shorter contexts leaves the trailing splits empty (they
write an empty partial that the reduce ignores).
"""

from __future__ import annotations

__all__ = ["CTAS_PER_SM", "MAX_SPLITS", "MIN_SPLIT_KEYS", "kv_splits"]

CTAS_PER_SM = 4
"""Programs per SM that count as a full GPU: the 4-warp decode tile takes 200-250 registers per
thread (the AOT table in benches/RESULTS.md), so an SM holds two at once; four per SM is two full
waves, enough to keep every SM busy to the end."""

MAX_SPLITS = 16
"""Upper bound on splits (bounds the reduce's reads and the float32 workspace)."""

MIN_SPLIT_KEYS = 128
"""Fewest keys of the longest request a split may cover (four 32-key blocks)."""


def kv_splits(programs: int, max_kv_len: int, num_sms: int) -> int:
    """Number of KV splits for a launch of ``programs`` programs (``batch x KV heads x query
    blocks``) over contexts of at most ``max_kv_len`` keys on a GPU with ``num_sms`` SMs; see the
    module docstring. Each argument must be an int >= 1 (``ValueError`` otherwise)."""
    for name, value in (("programs", programs), ("max_kv_len", max_kv_len), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    by_length = min(MAX_SPLITS, max_kv_len // MIN_SPLIT_KEYS)
    return max(1, min(CTAS_PER_SM * num_sms // programs, by_length))
