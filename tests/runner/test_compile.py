"""torch.compile of the model forward under the bucketed decode path.

Compiled with ``backend="aot_eager"`` here: Dynamo tracing, guards and recompiles are what is
under test, and inductor's C++ codegen would take minutes on a 2-core CI machine
(``benches/bench_compile.py`` measures inductor).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo

from treeserve.runner import compile_model

from ._helpers import commit, make_bench, step_and_compare, tiny_model


def test_compiled_forward_matches_eager_and_never_recompiles_inside_a_bucket() -> None:
    torch._dynamo.reset()
    model = tiny_model(num_layers=1)  # every layer runs the same code: one layer covers it
    compiled = compile_model(model, backend="aot_eager")
    bench = make_bench(model, page_size=2, max_batch=16, max_requests=16, forward=compiled)
    reqs = bench.add_requests(random.Random(0), 16)
    commit(reqs[:9], step_and_compare(bench, reqs[:9]))  # first step of bucket 16 compiles
    assert compiled.num_compiles > 0 and compiled.compile_seconds > 0
    compiles = compiled.num_compiles
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, 20):
            n = 9 + step % 8  # batch sizes 9..16, all padded to bucket 16
            commit(reqs[:n], step_and_compare(bench, reqs[:n]))
    assert compiled.num_compiles == compiles
    assert bench.graph.num_steps == 20


def test_compile_model_bad_input() -> None:
    with pytest.raises(TypeError, match="model"):
        compile_model(lambda x: x)
