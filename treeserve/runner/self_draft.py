"""Which of the target's own layers a self-speculative drafter runs (``speculative="draft:self:N"``).

A drafter that runs the target's first N layers under its final norm and head predicts it badly:
the last layers shape the logits. Skipping instead the layers that change the hidden state least
keeps far more of the target's law at the same cost (Draft & Verify, Zhang et al. 2023, skip
layers the same way). A layer's influence is ShortGPT's Block Influence: one minus the mean cosine
similarity of its input and output hidden states over a calibration text, from one forward of the
target. On SmolLM2-135M at temperature 0.8 (benches/RESULTS.md, issue 32), 26 of 30 layers chosen
this way agree with the full model's processed law on 55% of tokens (sum of min(p, q)), the first
26 on 38%.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from treeserve.models import LlamaForCausalLM, layer_subset
from treeserve.runner.sequence import PagedSequence

__all__ = ["CALIBRATION_TEXT", "layer_influence", "self_draft_layers"]

CALIBRATION_TEXT = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, a baker stacked warm "
    "loaves by the window, and children ran past the old stone bridge on their way to school.\n\n"
    "To make a simple tomato sauce:\n1. Warm two spoons of olive oil in a pan.\n2. Add a chopped onion "
    "and cook it until soft.\n3. Pour in the tomatoes, season with salt, and simmer for twenty minutes.\n\n"
    "Question: Why do leaves change color in autumn?\nAnswer: As days grow shorter, trees stop making "
    "chlorophyll, the green pigment, so the yellow and orange pigments that were there all along show "
    "through.\n\ndef mean(values):\n    return sum(values) / len(values)\n"
)
"""A short mixed text (prose, a list, a question and answer, code) whose forward ranks the layers."""


@torch.inference_mode()
def layer_influence(model: LlamaForCausalLM, token_ids: Sequence[int]) -> list[float]:
    """Per decoder layer of ``model``, ``1 - mean cos(input, output)`` of its hidden states over
    ``token_ids`` (at least 2 tokens, at most ``max_position_embeddings``), from one forward
    through the layers' torch modules (the fused operators do not expose a layer's output)."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError(f"token_ids must hold at least 2 tokens, got {len(ids)}")
    probe = layer_subset(model, range(model.config.num_layers))  # shares the weights
    probe._decode_plan = None  # every layer through its module (hooks), on every device
    probe.layer_kernels = "torch"
    influence: list[float] = []

    def record(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        influence.append(1.0 - F.cosine_similarity(args[0].float(), out.float(), dim=-1).mean().item())

    hooks = [layer.register_forward_hook(record) for layer in probe.layers]
    try:
        PagedSequence(probe, len(ids)).extend(ids)
    finally:
        for h in hooks:
            h.remove()
    return influence


def self_draft_layers(model: LlamaForCausalLM, num_layers: int, token_ids: Sequence[int] | None) -> list[int]:
    """The ``num_layers`` layers (increasing indices) a self-speculative drafter of ``model`` runs:
    those of highest ``layer_influence`` over ``token_ids`` (at most the model's
    ``max_position_embeddings`` first ones; ties to the lower index), or the first ``num_layers``
    when ``token_ids`` is None or shorter than 2 (an engine without a tokenizer has no calibration
    text). ``ValueError`` unless ``1 <= num_layers <= model.config.num_layers``."""
    total = model.config.num_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"draft:self:N needs N an int in [1, {total}], got {num_layers!r}")
    ids = [] if token_ids is None else list(token_ids)[: model.config.max_position_embeddings]
    if len(ids) < 2 or num_layers == total:
        return list(range(num_layers))
    influence = layer_influence(model, ids)
    ranked = sorted(range(total), key=lambda i: (-influence[i], i))
    return sorted(ranked[:num_layers])
