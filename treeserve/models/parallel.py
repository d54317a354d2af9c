"""Tensor-parallel shards of :class:`LlamaForCausalLM` (Megatron-style, one all-reduce per block half).

Rank ``r`` of ``world`` ranks holds:

- ``qkv_proj`` (column-parallel): its query heads ``[r*Hq/N, (r+1)*Hq/N)`` and KV heads
  ``[r*Hkv/N, ...)`` fused as ``q_r | k_r | v_r``; attention runs on those heads only, over this
  rank's share of the paged KV pool (``kv_heads_per_rank`` heads per layer);
- ``o_proj`` (row-parallel): the matching input columns, then one all-reduce (sum);
- ``gate_up_proj`` (column-parallel, ``gate_r | up_r``) and ``down_proj`` (row-parallel, one
  all-reduce); the intermediate size is split as evenly as possible;
- the embedding and LM head (vocab-parallel): a contiguous vocab range; the embedding zeroes
  ids outside it and all-reduces, the LM head computes its vocab columns for the rows asked
  for and gathers them to rank 0 (other ranks get their own block back and ignore it).

Norms and the RoPE table are replicated. The collectives come from a :class:`Collectives`
object set on :attr:`TPShard.comm` after the process group exists (``treeserve.distributed``
provides it); this module never imports it. ``num_kv_heads % world == 0`` and
``num_heads % world == 0`` are required (``ValueError`` naming both numbers otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from treeserve.models.config import ModelConfig
from treeserve.models.llama import Embedding, Linear, LlamaForCausalLM, _default_dtype

__all__ = ["Collectives", "TPShard", "check_shard_quantization", "check_tensor_parallel", "shard_range"]


class Collectives(Protocol):
    """The two collectives a shard's forward needs (implemented by ``treeserve.distributed``)."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over all ranks in place and return it (every rank gets the sum)."""
        ...

    def gather_cols(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rank 0: the ranks' ``[M, sizes[r]]`` blocks concatenated along dim 1; others: ``t``."""
        ...


def shard_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s share of ``total`` items (first ranks get one more)."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """``ValueError`` unless ``config`` can be split over ``world`` ranks (naming the numbers)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world!r}")
    if world > 1 and config.fused_checkpoint:
        raise ValueError(f"tensor parallelism does not split {config.architecture}'s fused QKV / gate|up checkpoint "
                         f"tensors: tensor_parallel_size must be 1, got {world}")
    for name in ("num_kv_heads", "num_heads"):
        if getattr(config, name) % world:
            raise ValueError(
                f"{name} ({getattr(config, name)}) must be divisible by tensor_parallel_size ({world})"
            )
    for name in ("intermediate_size", "vocab_size"):
        if getattr(config, name) < world:
            raise ValueError(f"{name} ({getattr(config, name)}) must be >= tensor_parallel_size ({world})")


def check_shard_quantization(shard: TPShard | None, quantization: str | None) -> None:
    """``ValueError`` when a tensor-parallel shard is asked for packed (quantized) weights:
    shards are dense (``quantization`` must be None)."""
    if shard is not None and quantization is not None:
        raise ValueError(
            f"quantization must be None when loading a tensor-parallel shard (world {shard.world}), got {quantization!r}"
        )


@dataclass(slots=True)
class TPShard:
    """Rank ``rank`` of ``world``: which slices it owns, and (once connected) its ``comm``."""

    rank: int
    world: int
    comm: Collectives | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.world!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}), got {self.rank!r}")

    def range(self, total: int) -> tuple[int, int]:
        return shard_range(total, self.rank, self.world)

    def weight_slice(self, hf_name: str, config: ModelConfig) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of the HF tensor ``hf_name`` this rank loads, ``None`` = all of it."""
        hd = config.head_dim
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.range(config.vocab_size))
        leaf = hf_name.rsplit(".", 2)[-2]  # e.g. "q_proj" of "...self_attn.q_proj.weight"
        if leaf == "q_proj":
            a, b = self.range(config.num_heads)
            return 0, a * hd, b * hd
        if leaf in ("k_proj", "v_proj"):
            a, b = self.range(config.num_kv_heads)
            return 0, a * hd, b * hd
        if leaf == "o_proj":
            a, b = self.range(config.num_heads)
            return 1, a * hd, b * hd
        if leaf in ("gate_proj", "up_proj"):
            return (0, *self.range(config.intermediate_size))
        if leaf == "down_proj":
            return (1, *self.range(config.intermediate_size))
        return None

    def build(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
        """This rank's uninitialised shard of a ``config`` model (see the module docstring).

        ``model.config`` stays the full configuration; ``model.kv_heads_per_rank`` gives the
        heads of this rank's KV pool.
        """
        check_tensor_parallel(config, self.world)
        heads = config.num_heads // self.world
        kv_heads = config.num_kv_heads // self.world
        inter = self.range(config.intermediate_size)
        vocab = self.range(config.vocab_size)
        local = config.replace(
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=inter[1] - inter[0],
            vocab_size=vocab[1] - vocab[0],
            eos_token_ids=(),
            bos_token_id=None,
        )
        model = LlamaForCausalLM(local, dtype=dtype, device=device)
        with torch.device(device):
            with _default_dtype(dtype):
                for layer in model.layers:
                    attn, mlp = layer.self_attn, layer.mlp
                    attn.o_proj = _RowParallelLinear(self, attn.q_size, config.hidden_size)
                    mlp.down_proj = _RowParallelLinear(self, mlp.intermediate_size, config.hidden_size)
            with _default_dtype(model.embed_tokens.weight.dtype):  # float32 when tied to the head
                model.embed_tokens = _VocabParallelEmbedding(self, vocab, config.hidden_size)
            with _default_dtype(torch.float32):
                model.lm_head = _VocabParallelLMHead(self, config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.config = config
        model.kv_heads_per_rank = kv_heads
        return model

    def _comm(self) -> Collectives:
        if self.comm is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} has no process group yet (TPShard.comm unset)")
        return self.comm


class _RowParallelLinear(Linear):
    """This rank's input columns of a projection; the partial products are summed by one all-reduce."""

    def __init__(self, shard: TPShard, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard._comm().all_reduce(F.linear(x, self.weight))


class _VocabParallelEmbedding(Embedding):
    """Rows ``[start, stop)`` of the embedding; other ids give zeros here and the sum over ranks."""

    def __init__(self, shard: TPShard, vocab: tuple[int, int], dim: int) -> None:
        super().__init__(vocab[1] - vocab[0], dim)
        self.shard = shard
        self.start, self.stop = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).clamp_(0, self.stop - self.start - 1)
        out = F.embedding(local, self.weight).masked_fill_(outside[:, None], 0.0)
        return self.shard._comm().all_reduce(out)


class _VocabParallelLMHead(Linear):
    """This rank's vocab rows of the LM head (float32); logits are gathered to rank 0 only."""

    def __init__(self, shard: TPShard, vocab_size: int, hidden: int) -> None:
        start, stop = shard.range(vocab_size)
        super().__init__(hidden, stop - start)
        self.shard = shard
        self.sizes = [b - a for a, b in (shard_range(vocab_size, r, shard.world) for r in range(shard.world))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard._comm().gather_cols(F.linear(x, self.weight), self.sizes)
