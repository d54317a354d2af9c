"""The static (CUDA-graph) decode path with the fused CUDA forward (``models.triton_forward``):
the same greedy tokens as the eager runner's torch path, step after step.

On CPU the static path runs eagerly and the fused kernels under the interpreter; the graph
runner's forward is a weight-sharing copy of the model (``truncated_copy`` at full depth) forced
onto the fused path, the eager runner keeps the torch path.
"""

from __future__ import annotations

import random

import torch

from tests._devices import backend_device
from tests.models._triton_rounding import gpu_rounding
from treeserve.models.llama import truncated_copy

from ._helpers import commit, decode_batch, make_bench, tiny_model


def test_static_decode_with_fused_layers_gives_the_torch_paths_tokens() -> None:
    model = tiny_model(device=str(backend_device("triton")))
    model.layer_kernels = "torch"
    fused = truncated_copy(model, model.config.num_layers)
    fused.layer_kernels = "triton"
    bench = make_bench(model, 4, max_batch=8, forward=fused)
    reqs = bench.add_requests(random.Random(3), 3)
    with gpu_rounding(), torch.inference_mode():
        for _ in range(3):
            batch = decode_batch(reqs)
            want = [t.token for t in bench.eager.run(batch)]
            got = bench.graph.run(batch)
            assert got is not None and [t.token for t in got] == want
            logits = bench.graph_rec.last
            assert logits is not None and logits.shape[0] == bench.graph.bucket_for(len(reqs))
            commit(reqs, want)
