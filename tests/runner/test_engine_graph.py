"""The engine with the decode graph path forced on (eager static buffers on CPU) against it off."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_speculative import repetitive_prompts
from treeserve import LLM, SamplingParams
from treeserve.runner import CompiledForward
from treeserve.models import random_model, tiny_config

from ._helpers import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_llm(model, **kw) -> LLM:
    cfg = dict(dtype="float32", kv_cache_tokens=2048, max_batched_tokens=64, max_running=12, max_model_len=96, seed=0)
    cfg.update(kw)
    return LLM((model, None), **cfg)


@pytest.mark.parametrize("page_size", [1, 8])
def test_graph_path_gives_the_eager_outputs(model, page_size: int) -> None:
    rng = random.Random(page_size)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(14)]
    params = [
        SamplingParams(
            max_new_tokens=rng.randint(1, 12),
            temperature=0.0 if i % 2 else 0.9,
            top_k=5 if i % 3 == 0 else -1,
            top_p=0.8 if i % 4 == 0 else 1.0,
            min_new_tokens=1 if i % 5 == 0 else 0,
            repetition_penalty=1.3 if i == 7 else 1.0,  # not servable by the graph: eager fallback
            logprobs=2 if i % 3 == 1 else None,
            seed=i,
        )
        for i in range(len(prompts))
    ]
    outs = {}
    for graph in (False, True):
        llm = make_llm(model, page_size=page_size, cuda_graph=graph, cuda_graph_max_batch=8)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[graph] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
        lps = [o.outputs[0].logprobs for o in res]
        served = llm.runner.decode_graph.num_steps if graph else 0
        assert graph == (served > 0)
        outs[graph, "lp"] = lps
    assert outs[True] == outs[False]
    for a, b in zip(outs[True, "lp"], outs[False, "lp"]):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("page_size, width", [(1, 1), (4, 2)])
def test_speculative_graph_path_gives_the_eager_outputs(page_size: int, width: int) -> None:
    """n-gram speculation (chains, and trees of width 2) with the verify keys on: the same tokens
    and logprobs (accepted draft tokens included) as with the graph path off, and the verify
    keys really serve steps."""
    loopy = random_model(tiny_config("llama", vocab_size=32, eos_token_ids=(2,)), seed=3, init_std=0.5)
    prompts = repetitive_prompts(7 + page_size, 10)
    params = [
        SamplingParams(max_new_tokens=16, temperature=0.0 if i % 3 else 0.8, top_k=-1 if i % 2 else 8,
                       logprobs=0 if i % 4 == 0 else None, seed=i)
        for i in range(len(prompts))
    ]  # fmt: skip
    outs = {}
    for graph in (False, True):
        llm = make_llm(loopy, page_size=page_size, cuda_graph=graph, cuda_graph_max_batch=8, speculative="ngram",
                       num_speculative_tokens=3, speculative_tree_width=width)  # fmt: skip
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[graph] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
        outs[graph, "lp"] = [o.outputs[0].logprobs for o in res]
        assert llm.metrics.accepted_tokens > 0
        if graph:
            assert llm.runner.decode_graph.node_buckets == (0, 1, 2, 4)
            assert llm.runner.decode_graph.num_verify_steps > 0
    assert outs[True] == outs[False]
    for a, b in zip(outs[True, "lp"], outs[False, "lp"]):
        assert a == pytest.approx(b, abs=1e-4)  # no NaN: accepted draft tokens have logprobs too


def test_engine_config_fields(model) -> None:
    assert make_llm(model).runner.decode_graph is None  # CPU: off unless asked
    llm = make_llm(model, cuda_graph=True, cuda_graph_max_batch=300)
    assert llm.runner.decode_graph.max_batch == 12  # never more than max_running
    assert not llm.runner.decode_graph.use_cuda_graph  # CPU: the static path runs eagerly
    compiled = make_llm(model, compile=True).runner.decode_graph  # compile alone turns the path on
    assert isinstance(compiled.forward, CompiledForward) and compiled.forward.num_compiles == 0  # lazy
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="cuda_graph_max_batch"):
            make_llm(model, cuda_graph_max_batch=bad)
    with pytest.raises(TypeError, match="cuda_graph"):
        make_llm(model, cuda_graph="yes")
    with pytest.raises(TypeError, match="compile"):
        make_llm(model, compile=1)
