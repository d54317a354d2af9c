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


def _cpu_op_ready() -> bool:
    from treeserve.kvcache._cpu_op import load_cpu_decode_op

    return load_cpu_decode_op() is None


@pytest.mark.skipif(not _cpu_op_ready(), reason="no C++ compiler: the CPU decode operator is unavailable")
def test_cpu_forward_compiles_whole_and_static() -> None:
    """On CPU (float32, the C++ decode operator) the forward traces without a graph break, so it is
    compiled whole with static shapes: one graph per bucket, none per step."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=1)
    compiled = compile_model(model, backend="aot_eager")
    bench = make_bench(model, page_size=2, max_batch=4, max_requests=4, forward=compiled)
    reqs = bench.add_requests(random.Random(1), 4)
    for step in range(6):
        n = 3 + step % 2  # bucket 4 every step
        commit(reqs[:n], step_and_compare(bench, reqs[:n]))
    assert compiled.static and compiled.num_compiles == 1


class _HostRead(torch.nn.Module):
    """A forward with a deliberate graph break (a host read of a tensor value)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids, positions, kv, out_slots, meta, logits_indices):  # type: ignore[no-untyped-def]
        if int(input_ids.max()) < 0:  # never true; Dynamo must still break the graph here
            raise AssertionError("negative token id")
        return self.model(input_ids, positions, kv, out_slots, meta, logits_indices)


def test_graph_break_falls_back_to_the_dynamic_compile() -> None:
    torch._dynamo.reset()
    model = tiny_model(num_layers=1)
    compiled = compile_model(_HostRead(model), backend="aot_eager")
    bench = make_bench(model, page_size=2, max_batch=4, max_requests=4, forward=compiled)
    reqs = bench.add_requests(random.Random(2), 3)
    for _ in range(3):
        commit(reqs, step_and_compare(bench, reqs))  # still equal to the eager runner's logits
    assert not compiled.static and compiled.num_compiles > 0


@pytest.mark.skipif(not _cpu_op_ready(), reason="no C++ compiler: the CPU decode operator is unavailable")
def test_cpu_decode_operator_passes_opcheck() -> None:
    """Schema, fake (meta) implementation and dispatch of the C++ operator agree (what tracing uses)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k = torch.randn(5, 2, 2, 8, generator=g)
    v = torch.randn(5, 2, 2, 8, generator=g)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    pages = torch.tensor([1, 2, 4], dtype=torch.int32)
    last = torch.tensor([1, 2], dtype=torch.int32)
    torch.library.opcheck(torch.ops.treeserve.paged_decode_attention.default, (q, k, v, indptr, pages, last, 0.35))
