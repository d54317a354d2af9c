"""Weights in HF checkpoint layout <-> ``LlamaForCausalLM`` (fused QKV and gate|up projections).

Both loaders (safetensors and GGUF) produce tensors under HF names; ``build_model`` checks every
expected name and shape, fuses the projections and materialises the model without a throw-away
random initialisation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch

from treeserve.models.config import ModelConfig
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.parallel import TPShard

__all__ = ["MissingTensorError", "build_model", "expected_hf_shapes", "fused_names", "hf_state_dict"]

# A loader hands tensors over lazily: name -> tensor, called once per expected name.
TensorGetter = Callable[[str], torch.Tensor]
# Optional: (name, dim, start, stop) -> (that slice of the tensor, the tensor's full shape),
# reading only the slice where the format allows (tensor-parallel loading).
SliceGetter = Callable[[str, int, int, int], tuple[torch.Tensor, tuple[int, ...]]]


class MissingTensorError(ValueError):
    """A checkpoint lacks a tensor the configuration requires."""


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model needs, with its shape (``lm_head`` only when untied)."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        # In this order: random_model draws each tensor from one generator in it.
        fused = config.fused_checkpoint
        qkv = {"qkv_proj": (q + 2 * kv, h)} if fused else {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h)}
        gate_up = {"gate_up_proj": (2 * i, h)} if fused else {"gate_proj": (i, h), "up_proj": (i, h)}
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + f"self_attn.{n}.weight": shape for n, shape in qkv.items()}
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes |= {p + f"mlp.{n}.weight": shape for n, shape in gate_up.items()}
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,), p + "self_attn.k_norm.weight": (config.head_dim,)}
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def fused_names(config: ModelConfig) -> Iterable[tuple[str, tuple[str, ...]]]:
    """(our parameter name, the HF names concatenated along dim 0 to form it: one name where the
    checkpoint holds it fused, ``config.fused_checkpoint``)."""
    yield "embed_tokens.weight", ("model.embed_tokens.weight",)
    yield "norm.weight", ("model.norm.weight",)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head.weight",)
    for layer in range(config.num_layers):
        src, dst = f"model.layers.{layer}.", f"layers.{layer}."
        attn = src + "self_attn."
        yield dst + "input_layernorm.weight", (src + "input_layernorm.weight",)
        yield dst + "post_attention_layernorm.weight", (src + "post_attention_layernorm.weight",)
        fused = config.fused_checkpoint
        yield dst + "self_attn.qkv_proj.weight", ((attn + "qkv_proj.weight",) if fused else
                                                 tuple(attn + f"{x}_proj.weight" for x in "qkv"))
        if config.attention_bias:
            yield dst + "self_attn.qkv_proj.bias", tuple(attn + f"{x}_proj.bias" for x in "qkv")
        if config.qk_norm:
            yield dst + "self_attn.q_norm.weight", (attn + "q_norm.weight",)
            yield dst + "self_attn.k_norm.weight", (attn + "k_norm.weight",)
        yield dst + "self_attn.o_proj.weight", (attn + "o_proj.weight",)
        yield dst + "mlp.gate_up_proj.weight", ((src + "mlp.gate_up_proj.weight",) if fused else
                                               (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"))
        yield dst + "mlp.down_proj.weight", (src + "mlp.down_proj.weight",)


def build_model(
    config: ModelConfig,
    get: TensorGetter,
    available: Iterable[str],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    shard: TPShard | None = None,
    get_slice: SliceGetter | None = None,
    skip: Collection[str] = (),
) -> LlamaForCausalLM:
    """Materialise a model from HF-named tensors.

    ``available`` lists the names the checkpoint holds; ``get(name)`` returns one (any float
    dtype; it is converted to the parameter's dtype on ``device``: ``dtype`` for the decoder,
    float32 for the LM head and a tied embedding). Raises ``MissingTensorError`` naming the
    first absent tensor and ``ValueError`` naming a tensor whose shape disagrees with ``config``.

    With ``shard``, builds that tensor-parallel rank's shard (``TPShard.build``) and loads only
    its slices: through ``get_slice`` when given, else by narrowing ``get(name)``.

    ``skip``: parameters (our names, e.g. ``"layers.0.mlp.down_proj.weight"``) left uninitialised
    and never read from the checkpoint (never touched, so never resident): the caller replaces their
    modules (``pack_model`` building projections from a file's codes) and checks their tensors.
    """
    have = set(available)
    shapes = expected_hf_shapes(config)
    missing = [name for name in shapes if name not in have]
    if missing:
        raise MissingTensorError(
            f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )

    def fetch(name: str) -> torch.Tensor:
        cut = shard.weight_slice(name, config) if shard is not None else None
        if cut is not None and get_slice is not None:
            t, full = get_slice(name, *cut)
        else:
            t = get(name)
            full = tuple(t.shape)
        if full != shapes[name]:
            raise ValueError(f"tensor {name!r} has shape {full}, config expects {shapes[name]}")
        if cut is not None and tuple(t.shape) == full:
            t = t.narrow(cut[0], cut[1], cut[2] - cut[1])
        return t

    # uninitialised parameters
    model = LlamaForCausalLM(config, dtype=dtype, device=device) if shard is None else shard.build(config, dtype, device)
    target = model.state_dict()
    state = {}
    for ours, hf in fused_names(config):
        if ours in skip:
            continue
        parts = [fetch(n) for n in hf]
        fused = parts[0] if len(parts) == 1 else torch.cat(parts)
        state[ours] = fused.to(device=device, dtype=target[ours].dtype)
    model.load_state_dict(state, strict=not (config.tie_word_embeddings or skip), assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (projections split again), contiguous, on CPU."""
    config = model.config
    ours = model.state_dict()
    shapes = expected_hf_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for name, hf_names in fused_names(config):
        sizes = [shapes[n][0] for n in hf_names]
        for hf, part in zip(hf_names, ours[name].split(sizes)):
            out[hf] = part.detach().cpu().contiguous()
    return out
