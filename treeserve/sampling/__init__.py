"""treeserve.sampling: sampling parameters, logit processing, counter-based sampling and
lossless speculative verification (greedy / rejection, chain / tree).

Imports nothing from treeserve except ``treeserve._utils``.
"""

from __future__ import annotations

from treeserve.sampling.batch import SamplingBatch
from treeserve.sampling.params import MAX_LOGPROBS, SamplingParams
from treeserve.sampling.processing import process_logits
from treeserve.sampling.rng import Purpose, uniform
from treeserve.sampling.rows import SamplingRows
from treeserve.sampling.sampler import SampleOutput, greedy_tokens, sample
from treeserve.sampling.verify import VerifyOutput, VerifyUniforms, verify

__all__ = [
    "MAX_LOGPROBS",
    "Purpose",
    "SampleOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRows",
    "greedy_tokens",
    "process_logits",
    "sample",
    "uniform",
    "verify",
    "VerifyOutput",
    "VerifyUniforms",
]
