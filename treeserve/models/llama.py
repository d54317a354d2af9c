"""A Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV cache.

Tokens of every request in a step are flattened into one ``[N]`` batch; the attention metadata
(built once per step by the caller) says which tokens belong to which request and where their KV
lives. Each layer writes the new tokens' K/V with ``store_kv`` before attending with
``paged_attention``. Forward has no data-dependent Python control flow, so it can be compiled and
captured into a CUDA graph.

Weights use fused projections (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows): one
GEMM instead of three (two), which matters on CPU. ``treeserve.models.weights`` converts between
these names and the HF checkpoint layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kvcache import AttentionMetadata, KVPool, paged_attention, store_kv
from treeserve.models._decode_op import DecodePlan, decode_plan, run_decode_layers
from treeserve.models._norm_op import add_rms_norm
from treeserve.models.config import ModelConfig
from treeserve.models.quant import PackedLinear
from treeserve.models.rope import apply_rope, rope_table
from treeserve.models.triton_forward import triton_forward, uses_triton_layers

__all__ = ["LlamaForCausalLM", "check_forward_inputs", "layer_subset", "truncated_copy"]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Linear(nn.Module):
    """``x @ weight.T (+ bias)`` with UNINITIALISED parameters: weights always come from a loader.

    (``nn.Linear`` would spend seconds on a random init that is overwritten right away.)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding lookup with an uninitialised ``weight [vocab, hidden]`` (see ``Linear``)."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension (statistics in float32 for bf16).

    On CPU one C++ pass per row (``_norm_op``: 2-4x ``F.rms_norm`` at batch 1 and 64), else
    ``F.rms_norm``; ``add`` also folds in the residual add before it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[1]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, self(x + residual))`` in one pass."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention: fused QKV (optional bias), per-head query / key RMS norms (Qwen3), RoPE, store
    K/V, paged attention, output proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        # Qwen3: each query and key head RMS-normalized over head_dim before RoPE.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads, self.head_dim)
            qk = torch.cat((q, k), dim=1)
        # Q and K heads are adjacent in the fused projection: rotate them in one pass.
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        # A cache narrower than the model (bf16 KV under float32 activations) stores K/V rounded to
        # it and attends with q rounded to it; the output comes back in the model's dtype.
        kv_dtype = k_cache.dtype
        store_kv(k_cache, v_cache, out_slots, k.to(kv_dtype), v.view(n, self.num_kv_heads, self.head_dim).to(kv_dtype))
        o = paged_attention(q.to(kv_dtype), k_cache, v_cache, meta, scale=self.scale).to(x.dtype)
        return self.o_proj(o.reshape(n, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with a fused gate|up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.down_proj, PackedLinear):  # may fuse the SwiGLU into its int8 GEMM
            return self.down_proj.swiglu_forward(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, out_slots, meta)
        x, normed = self.post_attention_layernorm.add(x, attn)
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """The causal LM. Parameters are created UNINITIALISED on ``device``; build models with a
    loader (``load``, ``load_hf_model``, ``load_gguf_model``) or ``random_model``.

    Decoder layers compute in ``dtype`` (float32 or bfloat16); the LM head is float32 whatever
    ``dtype`` is, so logits keep full precision (on CUDA: a bf16 pass whose argmax candidates are
    re-scored in float32, ``triton_forward.TritonHead``).

    ``forward`` is the only entry point (see its docstring); the RoPE table is a non-persistent
    float32 buffer covering ``config.max_position_embeddings`` positions. With
    ``config.tie_word_embeddings`` the output projection shares the embedding matrix.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        super().__init__()
        self.config = config
        with torch.device(device):
            with _default_dtype(dtype):
                self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
                self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            # The LM head stays float32 (bf16 logits are rounded to ~0.06 near |logit| 10-20,
            # which flips near-tie argmaxes); a tied embedding shares that float32 matrix.
            with _default_dtype(torch.float32 if config.tie_word_embeddings else dtype):
                self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cache", rope_table(config).to(device), persistent=False)

    def fit_context(self, context: int) -> None:
        """Rebuild the RoPE table for sequences of at most ``context`` tokens where its scaling depends
        on the context (longrope: ``short_factor`` up to ``original_max_position_embeddings``, see
        ``rope.inv_frequencies``); a no-op for every other configuration. Call before sharing the table."""
        most = self.config.max_position_embeddings
        if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= most:
            raise ValueError(f"context must be an int in [1, {most}], got {context!r}")
        rs = self.config.rope_scaling
        if rs is not None and rs["rope_type"] == "longrope":  # in place: drafters and graphs share the table
            self.rope_cache.copy_(rope_table(self.config, context=context))

    layer_kernels: str = "auto"
    """``"auto"``: on CUDA the layers run hand-fused Triton kernels and the head the bf16 exact
    head (``triton_forward``); ``"triton"`` forces that path (CPU tests, under the interpreter),
    ``"torch"`` keeps the torch path everywhere."""

    _decode_plan: DecodePlan | None | bool = False
    """The fused decode operator's plan (``_decode_op``), ``None`` when it cannot serve this
    model, ``False`` until first needed (reset whenever tensors move: ``_apply``)."""

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._decode_plan = False
        return super()._apply(fn, recurse)

    def decode_plan(self) -> DecodePlan | None:
        """The plan of the fused C++ decode path (``_decode_op``), or ``None`` when this model
        is not eligible (computed once; packing the model after the first forward needs ``_apply``
        or a fresh model to be noticed)."""
        if self._decode_plan is False:
            self._decode_plan = decode_plan(list(self.layers), Linear)
        return self._decode_plan

    @property
    def plain_head_weight(self) -> torch.Tensor | None:
        """The float32 weight of the LM head when it is this module's bias-free ``Linear`` (what
        the bf16 exact head of ``triton_forward`` replaces on CUDA), else None."""
        head = self.lm_head
        plain = type(head) is Linear and head.bias is None and head.weight.dtype == torch.float32
        return head.weight if plain else None

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the decoder layers and KV (the LM head and logits are float32)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device holding the weights."""
        return self.norm.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run ``N`` flattened new tokens through the model; return float32 logits ``[M, vocab]``.

        - ``input_ids, positions, out_slots``: int ``[N]``; token ``i`` sits at ``positions[i]``
          (``< max_position_embeddings``) and its K/V is written to slot ``out_slots[i]`` of every
          layer's cache in ``kv`` (``kv.k_caches[l], kv.v_caches[l]``) before attention.
        - ``meta``: the step's attention metadata, shared by all layers; its ``kv_len`` counts these
          new tokens.
        - ``logits_indices``: int ``[M]`` rows of the batch whose logits are wanted (e.g. the last
          token of each prefill chunk); only those rows go through the final norm and LM head.
        """
        check_forward_inputs(input_ids, positions, out_slots, logits_indices)
        if len(kv.k_caches) != len(self.layers):
            raise ValueError(f"kv has {len(kv.k_caches)} layers, the model has {len(self.layers)}")
        if uses_triton_layers(self):
            return triton_forward(self, input_ids, positions, kv, out_slots, meta, logits_indices)
        dtype = self.dtype
        h = self.embed_tokens(input_ids).to(dtype)
        # Decode steps of a float32 CPU model: one C++ call for all layers (eager only;
        # batch-invariant models keep their row-tiled projections).
        fusable = not torch.compiler.is_compiling() and getattr(self, "batch_invariant_tile", None) is None
        plan = self.decode_plan() if fusable else None
        if plan is not None:
            out = run_decode_layers(plan, h, self.rope_cache, positions, kv, out_slots, meta)
            if out is not None:
                return self.lm_head(self.norm(out[logits_indices]).float())
        cos_sin = self.rope_cache[positions].to(dtype)  # [N, 2, D/2]
        cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
        for layer, k_cache, v_cache in zip(self.layers, kv.k_caches, kv.v_caches):
            h = layer(h, cos, sin, k_cache, v_cache, out_slots, meta)
        return self.lm_head(self.norm(h[logits_indices]).float())


def check_forward_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, logits_indices: torch.Tensor
) -> None:
    """``ValueError`` unless the token tensors of ``forward`` are 1-D of one length and
    ``logits_indices`` is 1-D (shapes only: no host read)."""
    n = input_ids.shape[0]
    if input_ids.dim() != 1 or positions.shape != (n,) or out_slots.shape != (n,):
        raise ValueError(
            "input_ids, positions and out_slots must be 1-D of equal length, got "
            f"{tuple(input_ids.shape)}, {tuple(positions.shape)}, {tuple(out_slots.shape)}"
        )
    if logits_indices.dim() != 1:
        raise ValueError(f"logits_indices must be 1-D, got shape {tuple(logits_indices.shape)}")


def truncated_copy(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A model running only the first ``num_layers`` decoder layers of ``model`` (``layer_subset``
    of them). ``ValueError`` unless ``1 <= num_layers <= model.config.num_layers``."""
    total = model.config.num_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be an int in [1, {total}], got {num_layers!r}")
    return layer_subset(model, range(num_layers))


def layer_subset(model: LlamaForCausalLM, layers: Sequence[int]) -> LlamaForCausalLM:
    """A model running only the decoder layers ``layers`` of ``model`` (strictly increasing
    indices), in order, the others skipped: a self-speculative drafter (truncated, or with layers
    skipped, as in Draft & Verify). Shares every parameter with ``model`` (no copy); embeddings,
    final norm and LM head are the target's; its KV pool needs ``len(layers)`` layers.
    ``ValueError`` unless ``layers`` is a non-empty increasing sequence of ints in
    ``[0, model.config.num_layers)``."""
    total = model.config.num_layers
    keep = list(layers)
    if (not keep or any(isinstance(i, bool) or not isinstance(i, int) for i in keep)
            or keep != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= total):
        raise ValueError(f"layers must be increasing ints in [0, {total}), at least one, got {keep!r}")
    draft = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(draft)
    draft.config = model.config.replace(num_layers=len(keep))
    draft.embed_tokens = model.embed_tokens
    draft.layers = nn.ModuleList([model.layers[i] for i in keep])
    draft.norm = model.norm
    draft.lm_head = model.lm_head
    draft.layer_kernels = model.layer_kernels
    draft.register_buffer("rope_cache", model.rope_cache, persistent=False)
    return draft
