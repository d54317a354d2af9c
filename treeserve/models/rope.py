"""Rotary position embedding: inverse frequencies (default / linear / llama3 scaling, or a GGUF file's
per-frequency factors) and a cos/sin table.

The table is precomputed for every position below ``max_position_embeddings`` and gathered by the
``positions`` tensor, so applying RoPE has no data-dependent control flow (compile / CUDA-graph safe).
The rotation is the "rotate half" convention used by HF checkpoints (the GGUF loader undoes
llama.cpp's interleaving permutation so that this convention holds for GGUF weights too).
"""

from __future__ import annotations

import math

import torch

from treeserve.models.config import ModelConfig

__all__ = ["apply_rope", "inv_frequencies", "rope_table"]


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, with ``config.rope_scaling`` applied.

    Computed in float32 in the same order of operations as transformers, so tables agree bitwise.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rs = config.rope_scaling
    if rs is None or rs["rope_type"] == "default":
        return inv
    if rs["rope_type"] == "freq_factors":  # llama.cpp's rope_freqs: each frequency divided by its factor
        return inv / torch.tensor(rs["factors"], dtype=torch.float32)
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


def rope_table(config: ModelConfig, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[max_position_embeddings, 2, head_dim // 2]``: cos and sin of ``pos * inv_freq``.

    ``inv_freq`` defaults to ``inv_frequencies(config)``; the angles are formed in float32 the way
    HF does, so positions agree with transformers to float32 rounding.
    """
    if inv_freq is None:
        inv_freq = inv_frequencies(config)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = pos[:, None] * inv_freq[None, :]
    return torch.stack((angles.cos(), angles.sin()), dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, head_dim]`` by ``cos, sin [N, 1, head_dim // 2]`` (rotate-half pairing).

    Five kernels (two multiplies, two fused multiply-adds, one concat): on CPU these elementwise
    passes, not the math, are what RoPE costs.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)), dim=-1)
