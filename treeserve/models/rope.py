"""Rotary position embedding: inverse frequencies (default / linear / llama3 / longrope scaling, or a GGUF
file's per-frequency factors) and a cos/sin table.

The table is precomputed for every position below ``max_position_embeddings`` and gathered by the
``positions`` tensor, so applying RoPE has no data-dependent control flow (compile / CUDA-graph safe).
The rotation is the "rotate half" convention used by HF checkpoints (the GGUF loader undoes
llama.cpp's interleaving permutation so that this convention holds for GGUF weights too).
"""

from __future__ import annotations

import math

import torch

from treeserve.models.config import ModelConfig

__all__ = ["apply_rope", "inv_frequencies", "longrope_scale", "rope_table"]


def longrope_scale(config: ModelConfig) -> float:
    """The factor by which longrope scales cos and sin (1.0 for the other types): ``attention_factor``
    where given, else ``sqrt(1 + ln(s) / ln(original))`` with ``s`` its ``factor`` or
    ``max_position_embeddings / original`` (1.0 when ``s <= 1``), as transformers and llama.cpp's converter
    compute it."""
    rs = config.rope_scaling
    if rs is None or rs["rope_type"] != "longrope":
        return 1.0
    if "attention_factor" in rs:
        return float(rs["attention_factor"])
    original = float(rs["original_max_position_embeddings"])
    s = float(rs.get("factor") or config.max_position_embeddings / original)
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


def inv_frequencies(config: ModelConfig, context: int | None = None) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, with ``config.rope_scaling`` applied.

    Computed in float32 in the same order of operations as transformers, so tables agree bitwise.
    longrope divides them by ``long_factor`` where the context (``context``, default
    ``max_position_embeddings``) exceeds ``original_max_position_embeddings``, else by ``short_factor``:
    one set for every position, as llama.cpp picks it for its context size. transformers picks it per
    forward pass by the longest position, the same set for every sequence that fits the context.
    """
    d = config.head_dim
    powers = config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    inv = 1.0 / powers
    rs = config.rope_scaling
    if rs is None or rs["rope_type"] == "default":
        return inv
    if rs["rope_type"] == "freq_factors":  # llama.cpp's rope_freqs: each frequency divided by its factor
        return inv / torch.tensor(rs["factors"], dtype=torch.float32)
    if rs["rope_type"] == "longrope":  # 1 / (factor theta^(2i/d)), transformers' order: bitwise its table
        long = (context or config.max_position_embeddings) > rs["original_max_position_embeddings"]
        factors = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * powers)
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the band in between
    # interpolated linearly in 1/wavelen.
    old_ctx = float(rs["original_max_position_embeddings"])
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    wavelen = 2 * math.pi / inv
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / factor + smooth * inv


def rope_table(config: ModelConfig, inv_freq: torch.Tensor | None = None, context: int | None = None) -> torch.Tensor:
    """float32 ``[max_position_embeddings, 2, head_dim // 2]``: cos and sin of ``pos * inv_freq``
    (times ``longrope_scale``).

    ``inv_freq`` defaults to ``inv_frequencies(config, context)``; the angles are formed in float32 the
    way HF does, so positions agree with transformers to float32 rounding.
    """
    if inv_freq is None:
        inv_freq = inv_frequencies(config, context)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = pos[:, None] * inv_freq[None, :]
    table = torch.stack((angles.cos(), angles.sin()), dim=1)
    scale = longrope_scale(config)
    return table if scale == 1.0 else table * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, head_dim]`` by ``cos, sin [N, 1, head_dim // 2]`` (rotate-half pairing).

    Five kernels (two multiplies, two fused multiply-adds, one concat): on CPU these elementwise
    passes, not the math, are what RoPE costs.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)), dim=-1)
