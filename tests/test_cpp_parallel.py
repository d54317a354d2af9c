"""The C++ operators run their ``at::parallel_for`` on torch's intra-op threads.

ATen's ``parallel_for`` is an inline template over ``#pragma omp parallel``: an operator built
without ``-fopenmp`` compiles it to a serial loop, silently (``treeserve/_cpp.py`` builds with
it). Measured from the per-thread CPU time Linux keeps in ``/proc/self/task``: while the GEMM
operator runs on two threads, the threads other than the caller's must do a sizeable share of
the work (serial, they would do none: torch's pool only spins briefly after its own ops).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from treeserve.models.gguf_op import GGUFWeight, gguf_op_available

TASKS = Path("/proc/self/task")


def _thread_ticks() -> dict[int, int]:
    """User + system clock ticks of every thread of this process."""
    ticks = {}
    for task in TASKS.iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
    return ticks


@pytest.mark.skipif(not TASKS.exists(), reason="needs Linux /proc per-thread CPU times")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_gguf_operator_work_is_shared_by_the_intra_op_threads() -> None:
    assert gguf_op_available(), "the C++ GGUF operator did not build"
    n, k = 8192, 1024
    raw = torch.randint(0, 256, (n, k // 32 * 34), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw.view(n, k // 32, 34)[:, :, :2] = torch.tensor([0, 0x1C], dtype=torch.uint8)  # f16 scale 2^-8
    w = GGUFWeight.from_bytes("Q8_0", raw.reshape(-1), (n, k))
    x = torch.randn(4, k)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ops.treeserve.gguf_linear(x, w.raw, "Q8_0", k)  # starts the pool
        me = threading.get_native_id()
        before = _thread_ticks()
        for _ in range(150):
            torch.ops.treeserve.gguf_linear(x, w.raw, "Q8_0", k)
        after = _thread_ticks()
    finally:
        torch.set_num_threads(previous)
    mine = after[me] - before[me]
    others = sum(t - before.get(tid, 0) for tid, t in after.items() if tid != me)
    assert mine > 0
    assert others >= 0.3 * mine, f"caller {mine} ticks, other threads {others}: the operator ran serially"
