"""Seeded random models for tests and benchmarks, and saving a model as a HF checkpoint directory.

``save_hf_dir`` writes ``config.json`` + ``model.safetensors`` in the layout transformers loads,
so a test can run the very same weights through transformers and through ``load_model``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from treeserve.models.config import ModelConfig
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.weights import build_model, expected_hf_shapes, hf_state_dict

__all__ = ["random_model", "save_hf_dir"]


def random_model(
    config: ModelConfig,
    seed: int = 0,
    init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """A model whose weights are ``N(0, init_std)`` (norm weights ``1 + N(0, init_std)``), seeded.

    The same ``(config, seed, init_std)`` gives the same weights on every machine (drawn on CPU
    in float64 with a private generator, then cast).
    """
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_hf_shapes(config).items():
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * init_std
        tensors[name] = t + 1.0 if name.endswith("norm.weight") else t
    return build_model(config, tensors.__getitem__, tensors, dtype=dtype, device=device)


def save_hf_dir(model: LlamaForCausalLM, path: str | Path) -> Path:
    """Write ``model`` as a HF checkpoint (``config.json`` + ``model.safetensors``) into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    save_file(hf_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
