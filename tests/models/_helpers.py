"""Shared helpers for the model tests: error metric, a teacher-forced paged runner, a GGUF writer."""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from treeserve.models import LlamaForCausalLM
from treeserve.runner import PagedSequence
from treeserve.models.synthetic_gguf import SyntheticSpec, add_metadata
from treeserve.models.weights import hf_state_dict


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (both cast to float64)."""
    ours, ref = ours.double(), ref.double()
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float((ours - ref).abs().max() / ref.abs().max())


def paged_logits(
    model: LlamaForCausalLM, ids: Sequence[int], chunks: Sequence[int], page_size: int, seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Feed ``ids`` in chunks of the given sizes (they must sum to ``len(ids)``) through a fresh
    ``PagedSequence`` with shuffled pages; return every position's logits ``[len(ids), vocab]``."""
    assert sum(chunks) == len(ids)
    seq = PagedSequence(model, len(ids), page_size=page_size, shuffle_seed=seed, kv_dtype=kv_dtype)
    out, start = [], 0
    for n in chunks:
        out.append(seq.extend(ids[start : start + n], all_logits=True))
        start += n
    return torch.cat(out)


def _permute_for_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion of HF Q/K rows (rotate-half) to its interleaved layout."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab(size: int) -> list[str]:
    """``size`` (5..67) tokens: 4 control tokens ``<|s0|>``..``<|s3|>``, single characters, then "ab"."""
    chars = string.digits + string.ascii_lowercase + string.ascii_uppercase
    return [f"<|s{i}|>" for i in range(4)] + list(chars[: size - 5]) + ["ab"]


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3's fused tensors
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_BLOCK[rest]}"


def write_gguf(
    model: LlamaForCausalLM,
    path: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    architecture: str | None = None,
    drop: Sequence[str] = (),
    extra: Mapping[str, np.ndarray] | None = None,
    extra_kv: Mapping[str, int | float] | None = None,
) -> Path:
    """Write ``model`` the way llama.cpp's converter would (Q/K permuted for ``llama``); 2-D
    weights in ``qtype``, norms/biases in F32. ``drop`` omits GGUF tensors by name; ``extra``
    adds tensors by GGUF name, as they are (e.g. ``rope_freqs.weight``), ``extra_kv`` metadata (ints as
    uint32, floats as float32). The tokenizer metadata is ``tiny_vocab`` with the single merge ``a b``."""
    cfg = model.config
    arch = architecture or (cfg.architecture if cfg.architecture in ("qwen2", "qwen3", "phi3") else "llama")
    w = GGUFWriter(str(path), arch)
    spec = SyntheticSpec(arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                         cfg.vocab_size, cfg.tie_word_embeddings, cfg.attention_bias, cfg.rope_theta,
                         cfg.max_position_embeddings,
                         None if cfg.head_dim == cfg.hidden_size // cfg.num_heads else cfg.head_dim)
    add_metadata(w, spec, cfg.rms_norm_eps, tiny_vocab(cfg.vocab_size), ["a b"], [3] * 4 + [1] * (cfg.vocab_size - 4),
                 bos=cfg.bos_token_id or 1, eos=cfg.eos_token_ids[0] if cfg.eos_token_ids else 2)
    for hf, t in hf_state_dict(model).items():
        name = _gguf_name(hf)
        if name in drop:
            continue
        arr = t.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            arr = _permute_for_llama_cpp(arr, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        if arr.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    for key, value in (extra_kv or {}).items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
