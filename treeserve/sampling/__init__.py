"""treeserve.sampling: sampling parameters, logit processing, counter-based sampling,
lossless speculative verification (greedy / rejection, chain / tree) and grammar-constrained
(structured) output: specs, xgrammar matchers, token bitmasks.

Imports nothing from treeserve except ``treeserve._utils``.
"""

from __future__ import annotations

from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.bitmask import apply_token_bitmask, apply_token_bitmask_, bitmask_words, stack_bitmasks, unpack_bitmask
from treeserve.sampling.draft_sampling import DraftDraw, draw_siblings
from treeserve.sampling.grammar import DraftCheck, GrammarCompiler, GrammarState
from treeserve.sampling.params import MAX_LOGPROBS, SamplingParams
from treeserve.sampling.processing import process_logits
from treeserve.sampling.rng import Purpose, uniform
from treeserve.sampling.rows import HostRows, SamplingRows
from treeserve.sampling.sampler import SampleOutput, greedy_masked_tokens, greedy_tokens, sample
from treeserve.sampling.structured import STRUCTURED_KINDS, StructuredOutput
from treeserve.sampling.verify import VerifyOutput, verify

__all__ = [
    "DraftDraw",
    "DraftCheck",
    "GrammarCompiler",
    "GrammarState",
    "MAX_LOGPROBS",
    "Purpose",
    "STRUCTURED_KINDS",
    "SampleOutput",
    "SamplingBatch",
    "SamplingParams",
    "HostRows",
    "SamplingRows",
    "StructuredOutput",
    "apply_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_words",
    "draw_siblings",
    "greedy_masked_tokens",
    "greedy_tokens",
    "process_logits",
    "sample",
    "stack_bitmasks",
    "uniform",
    "unpack_bitmask",
    "verify",
    "VerifyOutput",
]
