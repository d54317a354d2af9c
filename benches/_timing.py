"""Timing helper shared by the benchmark modules."""

from __future__ import annotations

import time
from collections.abc import Callable


def min_seconds(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` calls of ``fn`` (wall-clock seconds): the least noisy estimate."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
