"""``ModelConfig``: the shape of a Llama-family model, parsed from HF ``config.json`` or GGUF metadata.

One dataclass covers every architecture this package runs (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2):
they differ only in QKV bias, per-head query / key norms (Qwen3), RoPE parameters, embedding tying and
whether the checkpoint fuses the projections (Phi-3).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from treeserve._utils import log_once

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "cap_to_window", "tiny_config"]

# Architecture names as they appear in HF ``config.json`` ``model_type`` and in GGUF
# ``general.architecture``. Mistral GGUF files say "llama" (llama.cpp converts them as such).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder; validated on construction.

    ``rope_scaling`` is ``None`` or a dict with ``rope_type`` in ``("default", "linear", "llama3",
    "freq_factors", "longrope")`` plus that type's fields (``factor``; for llama3 also ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``; for ``freq_factors``, a GGUF file's
    ``rope_freqs.weight`` (how llama.cpp's converter writes Llama 3.1+'s llama3 scaling), ``factors``:
    ``head_dim // 2`` numbers > 0 that divide the inverse frequencies; for ``longrope`` (Phi-3's 128k
    models), ``short_factor`` and ``long_factor`` (``head_dim // 2`` such divisors each),
    ``original_max_position_embeddings`` (an int >= 2) and optionally ``factor`` / ``attention_factor``: see
    ``rope.inv_frequencies``, ``rope.longrope_scale``).
    ``eos_token_ids`` lists every token that ends a turn.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {SUPPORTED_ARCHITECTURES}, got {self.architecture!r}"
            )
        for name in (
            "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias must be True for qwen2 (its QKV projections always have bias)")
        if self.fused_checkpoint and self.attention_bias:
            raise ValueError(f"attention_bias must be False for {self.architecture} (its QKV projection has none)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _check_rope_scaling(self.rope_scaling, self.head_dim)
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"eos_token_ids must lie in [0, {self.vocab_size}), got {tok}")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(f"bos_token_id must lie in [0, {self.vocab_size}), got {self.bos_token_id}")

    @property
    def fused_checkpoint(self) -> bool:
        """Whether checkpoints hold the QKV and gate|up projections fused (Phi-3: ``qkv_proj``,
        ``gate_up_proj``, the rows in the order this package fuses them) rather than one tensor each."""
        return self.architecture == "phi3"

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalized over ``head_dim`` before RoPE (Qwen3)."""
        return self.architecture == "qwen3"

    @property
    def q_size(self) -> int:
        """Width of the query projection (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Parse a HF ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``).

        Attention is always full; a ``sliding_window`` shorter than ``max_position_embeddings``
        (Mistral v0.1, Qwen2 with ``use_sliding_window``) caps the context at the window, where
        both agree exactly.

        Raises ``ValueError`` naming the architecture when ``model_type`` is not supported and
        naming the key when a required field is missing.
        """
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type must be one of {SUPPORTED_ARCHITECTURES}, got {arch!r}"
            )

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json is missing required key {key!r}")
            return cfg[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "su":  # Phi-3's first name for longrope
            rope_type = "longrope"
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:  # Phi-4-mini's phi3 config
            raise ValueError(f"config.json partial_rotary_factor must be 1.0 (RoPE on whole heads), "
                             f"got {cfg['partial_rotary_factor']!r}")
        if rope_type == "longrope":  # the top-level original wins, as in transformers (Phi-3's configs keep it there)
            top = cfg.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = int(top if top is not None else
                                                           need("original_max_position_embeddings"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Qwen2 always has QKV bias (its config has no key for it); Llama/Mistral say when they do.
        bias = arch == "qwen2" or bool(cfg.get("attention_bias", False))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None
        max_pos = cap_to_window(max_pos, window, f"{arch} sliding_window", rope if rope_type == "longrope" else None)
        return cls(
            architecture=arch,
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            max_position_embeddings=max_pos,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict describing this model (``from_hf`` inverts it)."""
        hf_arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [hf_arch[self.architecture]],
            "model_type": self.architecture,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if self.architecture != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.architecture == "phi3":
            out["pad_token_id"] = None  # Phi3Config's default, 32000, need not be in the vocabulary
        if self.rope_scaling is not None:
            if self.rope_scaling["rope_type"] == "freq_factors":
                raise ValueError("rope_scaling of type 'freq_factors' (a GGUF file's rope_freqs) has no HF config form")
            out["rope_scaling"] = dict(self.rope_scaling)
            if self.rope_scaling["rope_type"] == "longrope":  # where Phi-3's config keeps it
                out["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        return out


def cap_to_window(context: int, window: int | None, what: str, longrope: dict[str, Any] | None = None) -> int:
    """``context`` capped at a sliding ``window`` shorter than it (logged once, ``what`` naming the setting):
    sequences no longer than the window attend identically with full attention. ``longrope``: the model's
    longrope scaling, whose attention factor stays the uncapped context's (its ``factor`` set from it
    unless it gives one)."""
    if window is None or int(window) >= context:
        return context
    log_once(f"treeserve.models: {what}={window}: context capped at {window} tokens")
    if longrope is not None and "attention_factor" not in longrope and "factor" not in longrope:
        longrope["factor"] = context / longrope["original_max_position_embeddings"]
    return int(window)


def _check_rope_scaling(rs: dict[str, Any] | None, head_dim: int) -> None:
    if rs is None:
        return
    kind = rs.get("rope_type")
    if kind not in _ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type must be one of {_ROPE_TYPES}, got {kind!r}")
    if kind == "default":
        return
    if kind in ("freq_factors", "longrope"):
        for key in ("factors",) if kind == "freq_factors" else ("short_factor", "long_factor"):
            factors = rs.get(key)
            if (not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2
                    or not all(isinstance(f, (int, float)) and 0 < f < math.inf for f in factors)):  # fmt: skip
                raise ValueError(f"rope_scaling.{key} must be {head_dim // 2} numbers > 0 (head_dim // 2), "
                                 f"got {factors!r:.80}")
        if kind == "longrope":
            original = rs.get("original_max_position_embeddings")
            if isinstance(original, bool) or not isinstance(original, int) or original < 2:
                raise ValueError(f"rope_scaling.original_max_position_embeddings must be an int >= 2 for longrope, "
                                 f"got {original!r}")
            for key in ("factor", "attention_factor"):  # optional
                value = rs.get(key, 1.0)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"rope_scaling.{key} must be a number > 0 for longrope, got {value!r}")
        return
    factor = rs.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling.factor must be a number > 0, got {factor!r}")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(rs.get(key), (int, float)) or rs[key] <= 0:
                raise ValueError(f"rope_scaling.{key} must be a number > 0 for llama3, got {rs.get(key)!r}")
        if rs["high_freq_factor"] <= rs["low_freq_factor"]:
            raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")


def tiny_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """A small configuration of ``arch`` (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"phi3"`` or ``"mistral"``) for fast
    tests.

    2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), vocab 256; Qwen2 gets QKV bias.
    Any field can be overridden by keyword.
    """
    base: dict[str, Any] = dict(
        architecture=arch,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=arch == "qwen2",
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)
