"""``treeserve._cpu_load.interference``: the share of this process's CPUs that other work took."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treeserve import _cpu_load
from treeserve._cpu_load import interference

pytestmark = pytest.mark.skipif(not _cpu_load.STAT.exists(), reason="no /proc/stat: interference is 0.0 by contract")


def _spin(seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def test_busy_processes_on_our_cpus_are_seen() -> None:
    cpus = len(os.sched_getaffinity(0))
    # one busy process per CPU this process may use (children inherit the affinity), started first
    children = [subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True)\nwhile True: pass"],
                                 stdout=subprocess.PIPE) for _ in range(cpus)]
    try:
        for child in children:
            child.stdout.readline()  # it is running
        result, share = interference(lambda: time.sleep(0.6) or "done")
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert result == "done"
    assert share > 0.5, share


def test_our_own_work_is_not_interference() -> None:
    # this process's own CPU time (every thread) is subtracted; a quiet machine reads well under the limit
    n, share = interference(lambda: _spin(0.5))
    assert n > 0 and 0.0 <= share < 0.25, share


def test_too_short_or_unreadable_reads_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert interference(lambda: 7) == (7, 0.0)  # fewer than MIN_TICKS ticks of capacity
    monkeypatch.setattr(_cpu_load, "STAT", tmp_path / "missing")
    result, share = interference(lambda: _spin(0.3))  # long enough, but no /proc/stat
    assert result > 0 and share == 0.0
