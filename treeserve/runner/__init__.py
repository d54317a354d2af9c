"""treeserve.runner: everything that runs a model for a step.

- ``inputs``: the one vectorized builder of a step's model inputs (:func:`build_step_inputs`).
- ``eager``: :class:`ModelRunner`, any batch, eager forward + sampling/verification.
- ``graph``: :class:`DecodeGraphRunner`, decode/verify steps from static buffers (CUDA graphs).
- ``compile``: ``torch.compile`` of the forward (:func:`compile_model`).
- ``outputs``: the host view of sampled/verified tokens (the step's one host sync).
- ``drafting``: the :class:`Drafter` protocol, :func:`fill_drafts` (the engine's drafting step:
  the scheduler only sets draft budgets) and :func:`draft_pool_tokens` (the draft KV pool size).
- ``ngram``: :class:`NgramDrafter`, prompt-lookup drafts (no model).
- ``draft_model``: :class:`DraftModelDrafter`, batched drafts from a smaller model over its own KV.
- ``self_draft``: :func:`self_draft_layers`, which of the target's layers a self-speculative
  drafter runs (``draft:self:N``: the most influential over a calibration text).
- ``sequence``: :class:`PagedSequence`, one sequence through a model (tests, benchmarks).
- ``step_cost``: :func:`measure_step_costs`, what a step of more query rows costs (and
  :func:`row_cost_of`, the line through it), and :func:`measure_draft_cost`, what a draft
  model's forward costs (the draft planner's inputs, measured once per machine and model).

Imports point down only: ``kvcache``, ``sampling``, ``scheduler`` (its batch/request types) and
``models`` (the draft model; ``quant.plain_rows``, the path a verify step's draft rows take).
"""

from __future__ import annotations

from treeserve.runner.compile import CompiledForward, compile_model
from treeserve.runner.draft_model import DraftModelDrafter
from treeserve.runner.drafting import DraftRequest, Drafter, draft_pool_tokens, fill_drafts
from treeserve.runner.eager import CausalLM, ModelRunner
from treeserve.runner.graph import DecodeGraphRunner, DecodeLaunch, decode_buckets
from treeserve.runner.inputs import StepInputs, build_step_inputs
from treeserve.runner.ngram import NgramDrafter
from treeserve.runner.self_draft import CALIBRATION_TEXT, layer_influence, self_draft_layers
from treeserve.runner.sequence import PagedSequence
from treeserve.runner.step_cost import (
    MAX_ROW_COST,
    MAX_TABLE_ROWS,
    ROW_COST_CONTEXT,
    measure_draft_cost,
    measure_step_costs,
    row_cost_of,
)

__all__ = [
    "CALIBRATION_TEXT",
    "MAX_ROW_COST",
    "MAX_TABLE_ROWS",
    "ROW_COST_CONTEXT",
    "CausalLM",
    "CompiledForward",
    "DecodeGraphRunner",
    "DecodeLaunch",
    "DraftModelDrafter",
    "DraftRequest",
    "Drafter",
    "ModelRunner",
    "NgramDrafter",
    "PagedSequence",
    "StepInputs",
    "build_step_inputs",
    "compile_model",
    "decode_buckets",
    "draft_pool_tokens",
    "fill_drafts",
    "layer_influence",
    "measure_draft_cost",
    "measure_step_costs",
    "row_cost_of",
    "self_draft_layers",
]
