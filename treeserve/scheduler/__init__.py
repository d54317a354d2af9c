"""treeserve.scheduler: request state machine, continuous batching, preemption, stop conditions.

Never imports ``treeserve.models``: the model is reached only through the runner.
"""

from __future__ import annotations

from treeserve.scheduler.drafter import Drafter, DraftTree, NgramDrafter
from treeserve.scheduler.request import FinishReason, Request, RequestMetrics, RequestState
from treeserve.scheduler.batch import SampledToken, ScheduledBatch, ScheduledItem, SpecStats
from treeserve.scheduler.scheduler import SampleGroup, Scheduler, SchedulerConfig, derive_seed
from treeserve.scheduler.stop import StopChecker, TextDecoder, TextState, WholeDecoder

__all__ = [
    "DraftTree",
    "Drafter",
    "NgramDrafter",
    "SpecStats",
    "FinishReason",
    "Request",
    "RequestMetrics",
    "RequestState",
    "SampleGroup",
    "SampledToken",
    "ScheduledBatch",
    "ScheduledItem",
    "Scheduler",
    "SchedulerConfig",
    "StopChecker",
    "TextDecoder",
    "TextState",
    "WholeDecoder",
    "derive_seed",
]
