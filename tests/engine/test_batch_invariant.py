"""Issue 16 item 5: with ``batch_invariant=True`` a request's tokens and logprobs are bitwise the
same alone and with any companions, in float32 and bfloat16 (seeded sampling and greedy)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treeserve import LLM, SamplingParams
from treeserve.models import random_model, tiny_config

from .test_engine import assert_drained, make_llm, prompts_for

CONFIG = tiny_config("llama", hidden_size=128, intermediate_size=384, num_heads=8, num_kv_heads=2, vocab_size=512)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request) -> torch.nn.Module:
    return random_model(CONFIG, seed=3, init_std=0.08, dtype=request.param)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, list(o.outputs[0].logprobs)) for o in outs]


def target_params(greedy: bool) -> SamplingParams:
    temp = 0.0 if greedy else 1.0
    return SamplingParams(temperature=temp, top_p=0.9, seed=1234, max_new_tokens=40, ignore_eos=True, logprobs=0)


def companion(i: int, seed: int) -> SamplingParams:
    """Companions of every sampling mode: plain, filtered (top-k/top-p/min-p) and greedy rows."""
    modes = [dict(temperature=0.8), dict(temperature=1.1, top_k=20, top_p=0.7), dict(temperature=0.0), dict(min_p=0.05)]
    return SamplingParams(seed=seed + i, max_new_tokens=5 + 7 * i, ignore_eos=True, **modes[(seed + i) % len(modes)])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), companions=st.integers(1, 6), greedy=st.booleans())
def test_request_alone_equals_request_in_any_batch(model, seed: int, companions: int, greedy: bool) -> None:
    prompts = prompts_for(seed, companions + 1)
    mine = target_params(greedy)
    others = [companion(i, seed) for i in range(companions)]
    alone = run(make_llm(model, batch_invariant=True), prompts[:1], [mine])[0]
    llm = make_llm(model, batch_invariant=True)
    together = run(llm, prompts, [mine, *others])[0]
    assert together[0] == alone[0], "tokens changed with the batch"
    assert together[1] == alone[1], "logprobs changed with the batch (bitwise)"
    assert_drained(llm)


def test_batch_invariant_config_is_validated() -> None:
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        LLM((random_model(tiny_config("llama")), None), batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant=True runs the eager path"):
        LLM((random_model(tiny_config("llama")), None), batch_invariant=True, cuda_graph=True)
