"""treeserve.scheduler: request state machine, continuous batching, preemption, stop conditions.

Never imports ``treeserve.models`` or ``treeserve.runner``: the model (draft models included)
is reached only through the runner, which the engine drives.
"""

from __future__ import annotations

from treeserve.scheduler.request import FinishReason, Request, RequestMetrics, RequestState, SpecStats
from treeserve.scheduler.batch import DraftTree, SampledToken, ScheduledBatch, ScheduledItem
from treeserve.scheduler.scheduler import SampleGroup, Scheduler, SchedulerConfig, derive_seed
from treeserve.scheduler.stop import StopChecker, TextDecoder, TextState, WholeDecoder

__all__ = [
    "DraftTree",
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
