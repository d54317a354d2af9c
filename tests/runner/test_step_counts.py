"""Copies and operator launches of one decode step through the static (CUDA-graph) path, counted on
the CPU under the torch profiler, so a regression in host work shows without a GPU.

On CUDA, each ``aten::copy_`` of the input load (``DecodeGraphRunner._load``) is a host-to-device
copy and each ``aten::fill_`` a small kernel launched outside the graph; the forward's operators
are what one ``graph.replay()`` launches. Issue 28's design: a step's inputs are packed on the host
into one staging buffer (pinned on CUDA) and sent in exactly one copy, with no fill; before it the
load issued 15 copies (pageable, so synchronous on CUDA) and 9 fills (2026-12-04).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from torch.profiler import ProfilerActivity, profile

from ._helpers import decode_batch, make_bench, tiny_model



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
    sent = graph.staging.num_copies
    graph.run(batch)
    assert graph.staging.num_copies == sent + 1
    graph._load = load  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        graph.run(batch)
    return seen["load"], top_level_ops(prof.events())


def test_input_load_copies_do_not_grow(counts, capsys: pytest.CaptureFixture[str]) -> None:
    load, step = counts
    with capsys.disabled():
        print(f"\ndecode step (static path, 2-layer model): input load {load['aten::copy_']} copies + "
              f"{load['aten::fill_']} fills; {sum(step.values())} top-level aten ops in the whole step")
    assert load["aten::copy_"] == 1 and load["aten::fill_"] == 0, load


def test_the_forward_adds_operators_per_layer(counts) -> None:
    """The step's operators beyond the load grow with the model (a sanity check of the counter)."""
    load, step = counts
    assert sum(step.values()) > sum(load.values()) and step["aten::linear"] >= 2 * 4  # q/k/v/o or fused, 2 layers
