"""Copies and operator launches of one decode step through the static (CUDA-graph) path, counted on
the CPU under the torch profiler, so a regression in host work shows without a GPU.

On CUDA, each ``aten::copy_`` of the input load (``DecodeGraphRunner._load``) is a host-to-device
copy from pageable memory (synchronous) and each ``aten::fill_`` a small kernel launched outside the
graph; the forward's operators are what one ``graph.replay()`` launches. Issue 28's target is one
staged copy per step; the bounds below are today's counts (2026-12-04), so they can only go down.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from torch.profiler import ProfilerActivity, profile

from ._helpers import decode_batch, make_bench, tiny_model

LOAD_COPIES, LOAD_FILLS = 15, 9  # per decode step (no drafts), today


def top_level_ops(events) -> Counter[str]:
    """aten operators called from outside any other aten operator (what a step dispatches)."""
    return Counter(e.name for e in events if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


@pytest.fixture(scope="module")
def counts() -> tuple[Counter[str], Counter[str]]:
    bench = make_bench(tiny_model(), 1, max_batch=8)
    batch = decode_batch(bench.add_requests(random.Random(0), 4))
    graph = bench.graph
    assert graph.run(batch) is not None  # warm: the static path serves it
    load = graph._load
    seen: dict[str, Counter[str]] = {}

    def profiled_load(*args: object, **kwargs: object) -> None:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            load(*args, **kwargs)
        seen["load"] = top_level_ops(prof.events())

    graph._load = profiled_load  # type: ignore[method-assign]
    graph.run(batch)
    graph._load = load  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        graph.run(batch)
    return seen["load"], top_level_ops(prof.events())


def test_input_load_copies_do_not_grow(counts, capsys: pytest.CaptureFixture[str]) -> None:
    load, step = counts
    with capsys.disabled():
        print(f"\ndecode step (static path, 2-layer model): input load {load['aten::copy_']} copies + "
              f"{load['aten::fill_']} fills; {sum(step.values())} top-level aten ops in the whole step")
    assert load["aten::copy_"] <= LOAD_COPIES and load["aten::fill_"] <= LOAD_FILLS, load


def test_the_forward_adds_operators_per_layer(counts) -> None:
    """The step's operators beyond the load grow with the model (a sanity check of the counter)."""
    load, step = counts
    assert sum(step.values()) > sum(load.values()) and step["aten::linear"] >= 2 * 4  # q/k/v/o or fused, 2 layers
