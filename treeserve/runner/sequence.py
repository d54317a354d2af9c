"""``PagedSequence``: run one token sequence through a model over its own paged KV pool.

The smallest caller of ``LlamaForCausalLM.forward``: it allocates pages and builds each chunk's
inputs with the runner's step-input builder (its page slots are a one-row slot table). Used by
tests, benchmarks and examples; the engine's runner does the same for many sequences at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treeserve.kvcache import KVPool
from treeserve.models import LlamaForCausalLM
from treeserve.runner.inputs import build_step_inputs

__all__ = ["PagedSequence"]


class PagedSequence:
    """One sequence of at most ``max_len`` tokens over a private ``KVPool``.

    Pages are allocated up front; with ``shuffle_seed`` they are used in a random order, so page
    tables are non-contiguous (as they are in a busy server). ``extend`` feeds new tokens and
    returns their logits; ``truncate`` rolls back; ``length`` counts the tokens whose K/V is cached.
    A tensor-parallel model (``treeserve.distributed``) gets a pool of its ``kv_heads_per_rank``.
    ``kv_dtype``: the pool's dtype (default the model's; bfloat16 under a float32 model stores K/V
    rounded, as ``EngineConfig.kv_cache_dtype`` does).
    """

    __slots__ = ("model", "pool", "page_size", "max_len", "_pages", "_slots", "length")

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_len: int,
        page_size: int = 1,
        shuffle_seed: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        if max_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_len must be <= max_position_embeddings={model.config.max_position_embeddings}, got {max_len}"
            )
        cfg = model.config
        num_pages = -(-max_len // page_size)
        self.model = model
        self.page_size = page_size
        self.max_len = max_len
        self.pool = KVPool(
            cfg.num_layers, num_pages + 1, page_size, getattr(model, "kv_heads_per_rank", cfg.num_kv_heads), cfg.head_dim,
            dtype=kv_dtype or model.dtype, device=model.device,
        )
        pages = self.pool.allocator.alloc(num_pages)
        if shuffle_seed is not None:
            gen = torch.Generator().manual_seed(shuffle_seed)
            pages = pages[torch.randperm(num_pages, generator=gen).to(pages.device)]
        self._pages = pages
        offsets = torch.arange(page_size, device=pages.device)
        self._slots = (pages[:, None] * page_size + offsets).reshape(-1)
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (their slots are overwritten by the next extend)."""
        if not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an int in [0, {self.length}], got {length!r}")
        self.length = length

    @torch.inference_mode()
    def extend(self, token_ids: Sequence[int] | torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Append ``token_ids`` (one chunk); return float32 logits ``[n, vocab]`` (``[1, vocab]``:
        only the last token's, unless ``all_logits``). Raises ``ValueError`` past ``max_len``."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n < 1 or self.length + n > self.max_len:
            raise ValueError(f"chunk must hold 1..{self.max_len - self.length} tokens, got {n}")
        start, end = self.length, self.length + n
        step = build_step_inputs(self._slots[None], [0], [start], [n], ids, self.page_size, [n if all_logits else 1])
        logits = self.model(step.input_ids, step.positions, self.pool, step.out_slots, step.meta, step.logits_indices)
        self.length = end
        return logits
