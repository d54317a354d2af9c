"""Failure behaviour of a tensor-parallel engine: bad sizes, dead and hung workers, shutdown.

Each failure test owns its engine (2 ranks, ``distributed_timeout_s=2``) since a failure closes
the group for good.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from tests.distributed._helpers import greedy, tiny_model
from treeserve import LLM
from treeserve.distributed import TensorParallelError, launch_tensor_parallel
from treeserve.engine import EngineConfig

TIMEOUT_S = 2.0
PROMPT = [[5, 6, 7, 8, 9]]


def _engine() -> LLM:
    return LLM((tiny_model(), None), dtype="float32", kv_cache_tokens=128, tensor_parallel_size=2,
               distributed_timeout_s=TIMEOUT_S)  # fmt: skip


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2", None])
def test_bad_tensor_parallel_size(size: object) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=size)


@pytest.mark.parametrize(
    "extra",
    [dict(compile=True), dict(cuda_graph=True), dict(batch_invariant=True), dict(quantization="int8"),
     dict(speculative="draft:self:1"), dict(distributed_timeout_s=0)],  # fmt: skip
)
def test_options_refused_with_tensor_parallelism(extra: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(tensor_parallel_size=2, **extra)


def test_heads_not_divisible_name_both_numbers_before_any_spawn() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) must be divisible by tensor_parallel_size \(3\)"):
        LLM((tiny_model(), None), dtype="float32", tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


def test_idle_past_the_timeout_then_close_joins_workers() -> None:
    llm = _engine()
    procs = list(llm.model._procs)
    first = llm.generate(PROMPT, greedy(False, 8), use_tqdm=False)[0].outputs[0].token_ids
    time.sleep(TIMEOUT_S + 0.5)  # an idle engine is not a hung one
    assert llm.generate(PROMPT, greedy(False, 8), use_tqdm=False)[0].outputs[0].token_ids == first
    llm.close()
    assert [p.exitcode for p in procs] == [0]
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPT, greedy(False, 8), use_tqdm=False)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_dead_or_hung_worker_raises_within_bounded_time(sig: signal.Signals) -> None:
    llm = _engine()
    procs = list(llm.model._procs)
    llm.generate(PROMPT, greedy(False, 4), use_tqdm=False)
    os.kill(procs[0].pid, sig)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="died" if sig == signal.SIGKILL else "timed out"):
        llm.generate(PROMPT, greedy(False, 8), use_tqdm=False)
    assert time.monotonic() - t0 < TIMEOUT_S + 10
    assert all(p.exitcode is not None for p in procs), "a worker outlived the failure"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):  # later calls fail at once with the same error
        llm.generate(PROMPT, greedy(False, 8), use_tqdm=False)
    assert time.monotonic() - t0 < 1.0
    llm.close()


def test_worker_dying_before_the_rendezvous_fails_the_launch_at_once() -> None:
    """A worker that exits before reaching the store (here: an invalid thread count) fails the
    launch as soon as it is gone, not after the rendezvous timeout."""
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="exited before joining"):
        launch_tensor_parallel((tiny_model(), None), 2, threads=-1)
    assert time.monotonic() - t0 < 60
    assert not multiprocessing.active_children()
