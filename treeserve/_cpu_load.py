"""How much of this process's CPUs other work took while a function ran (Linux ``/proc/stat``).

A timing taken while other processes, or the hypervisor (steal time), share the cores measures the
sharing as much as the machine. ``interference(fn)`` runs ``fn`` and reports, over that interval,
the busy time of the CPUs this process may run on (``os.sched_getaffinity``; per CPU the user,
nice, system, irq, softirq and steal clock ticks of ``/proc/stat``) that was not this process's own
(``os.times``: every thread of it), as a fraction of those CPUs' capacity, in ``[0, 1]``.

It is 0.0 where ``/proc/stat`` cannot be read (not Linux) and where the interval holds fewer than
``MIN_TICKS`` clock ticks of capacity (too short to tell: ticks are 10 ms on most kernels).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["MIN_TICKS", "STAT", "interference"]

STAT = Path("/proc/stat")
"""The kernel's per-CPU time counters."""

MIN_TICKS = 20
"""Clock ticks of capacity (interval x CPUs) below which an interval is too short to judge."""

_T = TypeVar("_T")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks since boot summed over ``cpus``; None when ``/proc/stat`` is unreadable."""
    try:
        lines = STAT.read_text().splitlines()
    except OSError:
        return None
    total, seen = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
        seen += 1
    return total if seen else None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def interference(fn: Callable[[], _T]) -> tuple[_T, float]:
    """``fn()``'s result and the share of this process's CPUs that other work used meanwhile."""
    cpus = _cpus()
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy0, own0, wall0 = _busy_ticks(cpus), _own_seconds(), time.monotonic()
    result = fn()
    busy1, own1, wall1 = _busy_ticks(cpus), _own_seconds(), time.monotonic()
    capacity = (wall1 - wall0) * hz * len(cpus)
    if busy0 is None or busy1 is None or capacity < MIN_TICKS:
        return result, 0.0
    others = (busy1 - busy0) - (own1 - own0) * hz
    return result, min(1.0, max(0.0, others / capacity))
