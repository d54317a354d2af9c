"""Load a HF checkpoint directory: ``config.json`` + safetensors (one file or sharded with an index)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from treeserve.models.config import ModelConfig
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.parallel import TPShard, check_shard_quantization
from treeserve.models.quant import pack_model
from treeserve.models.weights import build_model

__all__ = ["load_hf_config", "load_hf_model"]


def load_hf_config(path: str | Path) -> ModelConfig:
    """Parse ``path/config.json``; ``generation_config.json`` EOS ids are added to the config's."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not a HF model directory: no config.json")
    raw = _read_json(cfg_file)
    config = ModelConfig.from_hf(raw)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = _read_json(gen_file).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        config = config.replace(eos_token_ids=merged)
    return config


def load_hf_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    shard: TPShard | None = None,
) -> LlamaForCausalLM:
    """Build the model stored in a HF directory (``model.safetensors`` or an indexed set of shards).

    ``quantization`` ``"int4"`` / ``"int8"`` packs the decoder projections weight-only (see
    ``treeserve.models.quant.pack_model``); ``"auto"`` and None keep the float weights.
    ``shard``: build that tensor-parallel rank's shard (dense only), reading only its slices.

    Raises ``ValueError`` for a missing/unreadable config or weight file (truncated safetensors
    included), an unsupported architecture, a missing tensor or a shape mismatch.
    """
    check_shard_quantization(shard, quantization)
    path = Path(path)
    config = load_hf_config(path)
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = _read_json(index_file).get("weight_map", {})
        if not weight_map:
            raise ValueError(f"{index_file} has no weight_map")
        shards = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        shards, weight_map = ["model.safetensors"], {}
    else:
        raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with ExitStack() as stack:
        handles = {}
        for file in shards:
            try:
                handles[file] = stack.enter_context(safe_open(str(path / file), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"cannot read safetensors file {path / file}: {exc}") from exc
        if not weight_map:
            weight_map = {name: shards[0] for name in handles[shards[0]].keys()}

        def get(name: str) -> torch.Tensor:
            try:
                return handles[weight_map[name]].get_tensor(name)
            except Exception as exc:
                raise ValueError(f"cannot read tensor {name!r} from {weight_map[name]}: {exc}") from exc

        def get_slice(name: str, dim: int, start: int, stop: int) -> tuple[torch.Tensor, tuple[int, ...]]:
            try:
                sl = handles[weight_map[name]].get_slice(name)
                full = tuple(sl.get_shape())
                index = (slice(None),) * dim + (slice(start, stop),)
                return (sl[index] if len(full) > dim else torch.empty(0)), full
            except Exception as exc:
                raise ValueError(f"cannot read tensor {name!r} from {weight_map[name]}: {exc}") from exc

        model = build_model(
            config, get, weight_map, dtype=dtype, device=device, shard=shard, get_slice=get_slice
        )
    return pack_model(model, lambda name: None, quantization)


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot parse {file}: {exc}") from exc
