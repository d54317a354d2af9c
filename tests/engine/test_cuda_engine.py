"""``LLM(device="cuda")`` as a user starts it (skipped without CUDA): the defaults (CUDA graphs
with overlap scheduling, Triton kernels) start and give the greedy tokens of the eager path, and so does ``compile=True``,
on random weights of a small Llama shape. Token equality is checked in float32 (bf16 GEMMs of a
padded graph bucket may round differently from the eager batch and flip a near tie); bfloat16, the
CUDA default, must start and generate."""

from __future__ import annotations

import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.models import random_model, tiny_config

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2 + i, 9] for i in range(6)]


def greedy(dtype: torch.dtype = torch.float32, params: SamplingParams | None = None, **config: object) -> list[list[int]]:
    model = random_model(tiny_config(num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=16,
                                     intermediate_size=256, vocab_size=512), seed=3, init_std=0.05,
                         dtype=dtype, device="cuda")
    llm = LLM((model, None), device="cuda", seed=0, **config)
    params = params or SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    graph = llm.runner.decode_graph
    follow_ups = 0 if graph is None else graph.num_follow_ups
    assert (follow_ups > 0) == (config.get("overlap", True) and "cuda_graph" not in config)  # the CUDA default overlaps
    return [o.outputs[0].token_ids for o in out]


def test_defaults_start_and_match_the_eager_path() -> None:
    eager = greedy(cuda_graph=False)
    assert greedy() == eager
    assert [len(t) for t in greedy(torch.bfloat16)] == [24] * len(PROMPTS)


def test_compile_matches_the_eager_path() -> None:
    """``compile=True``: each captured batch bucket is compiled on its own (static shapes), so the
    graphs stop at batch 8 here (the default's 35 buckets up to 256 took over 100 s to compile on
    an H100 host)."""
    assert greedy(compile=True, cuda_graph_max_batch=8) == greedy(cuda_graph=False)


def test_overlap_gives_the_synchronous_tokens_when_sampling() -> None:
    """Seeded sampling with stops: the overlapped loop (the CUDA default) and the synchronous one
    give the same tokens on the device too."""
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_new_tokens=30, stop_token_ids=[7, 11])
    assert greedy(params=sp) == greedy(params=sp, overlap=False)
