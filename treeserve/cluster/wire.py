"""What a replica's ``generate`` stream carries to the ingress (pickled by Ray; no Ray here).

A stream starts with exactly one :class:`Accepted` or :class:`Refused`, then lists of
``SampleDelta`` (at most one merged delta per sample each), and ends either when every sample
finished or with one :class:`Closed` (the replica aborted or shut the request down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Accepted", "Closed", "EngineInfo", "Refused"]


@dataclass(frozen=True, slots=True)
class Accepted:
    """The replica queued the request."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The replica refused the request before queuing it. ``kind``: ``"ValueError"`` /
    ``"TypeError"`` (bad input, HTTP 400), ``"QueueFullError"`` (503) or ``"EngineDeadError"``."""

    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class Closed:
    """The request ended before all samples finished (``reason``: the engine stream's)."""

    reason: str


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the ingress needs to tokenize and validate for the replicas' model."""

    model_name: str
    tokenizer: Any
    max_model_len: int
