"""The step API (add_request / step / abort_request) and the front ends built on it."""

from __future__ import annotations

import pytest
import torch

from treeserve import LLM, SampleDelta, SamplingParams
from treeserve.models import random_model, tiny_config

from .test_engine import VOCAB, assert_drained, make_llm


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0, init_std=0.3)


def drain_steps(llm: LLM, max_steps: int = 2000) -> list[SampleDelta]:
    deltas = []
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return deltas
        deltas.extend(llm.step())
    raise AssertionError("step API did not drain")


def test_step_api_matches_generate(tiny) -> None:
    sp = SamplingParams(temperature=1.0, seed=11, n=2, max_new_tokens=12, ignore_eos=True, logprobs=2)
    prompt = [5, 9, 33, 41, 7]
    (ref,) = make_llm(tiny).generate([prompt], sp, use_tqdm=False)
    llm = make_llm(tiny)
    rid = llm.add_request(prompt, sp, request_id="r1")
    other = llm.add_request([4, 5, 6], {"temperature": 0.0, "max_new_tokens": 3})
    assert rid == "r1" and isinstance(other, str) and other != rid
    deltas = drain_steps(llm)
    for idx in (0, 1):
        mine = [d for d in deltas if d.request_id == "r1" and d.index == idx]
        assert sum((d.token_ids for d in mine), []) == ref.outputs[idx].token_ids
        assert sum((d.logprobs for d in mine), []) == pytest.approx(ref.outputs[idx].logprobs, abs=1e-4)
        assert len(sum((d.top_logprobs for d in mine), [])) == 12
        assert [d.finish_reason for d in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == "length" and mine[-1].num_prompt_tokens == 5
    short = [d for d in deltas if d.request_id == other]
    assert sum((d.token_ids for d in short), []) and short[-1].finish_reason == "length"
    assert all(d.logprobs == [] and d.top_logprobs == [] for d in short)
    assert llm.step() == [] and not llm.has_unfinished_requests()
    assert_drained(llm)


def test_add_request_validates_before_queuing(tiny) -> None:
    llm = make_llm(tiny)
    cases = [
        ([], None, ValueError, "at least 1 token"),
        ([3] * 300, None, ValueError, "max_model_len"),
        ([3, VOCAB], None, ValueError, "token ids must be in"),
        ("text", None, ValueError, "tokenizer"),
        (b"\x03\x04", None, TypeError, "prompt"),
        ([True, False], None, TypeError, "prompt"),
        ([3, 4], {"temperature": -1}, ValueError, "temperature"),
        ([3, 4], {"tempeature": 1.0}, TypeError, "tempeature"),
        ([3, 4], SamplingParams(n=500, max_new_tokens=200), ValueError, "n=500"),
        ([3, 4], SamplingParams(stop=["x"]), ValueError, "tokenizer"),
        ([3, 4], 7, TypeError, "sampling params"),
    ]
    for prompt, sp, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            llm.add_request(prompt, sp)
        assert not llm.has_unfinished_requests()
    llm.add_request([3, 4], request_id="a")
    with pytest.raises(ValueError, match="already live"):
        llm.add_request([3, 4], request_id="a")
    with pytest.raises(TypeError, match="request_id"):
        llm.add_request([3, 4], request_id=5)  # type: ignore[arg-type]
    assert len(llm.scheduler.waiting) == 1
    assert llm.abort_request("a") and not llm.abort_request("a")
    assert not llm.has_unfinished_requests()
    assert_drained(llm)


def test_abort_request_frees_everything(tiny) -> None:
    llm = make_llm(tiny, page_size=4)
    rid = llm.add_request(list(range(10, 40)), SamplingParams(max_new_tokens=100, ignore_eos=True, n=3))
    for _ in range(5):
        llm.step()
    assert llm.kv.allocator.num_free < llm.kv.allocator.capacity
    assert llm.abort_request(rid)
    assert llm.step() == []
    assert not llm.has_unfinished_requests()
    assert_drained(llm)


def test_numpy_and_tensor_prompts_are_one_prompt(tiny) -> None:
    np = pytest.importorskip("numpy")
    llm = make_llm(tiny)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    ref = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), np.int16(7)], torch.tensor([5, 6, 7])):
        outs = llm.generate(prompt, sp, use_tqdm=False)
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == ref
    with pytest.raises(TypeError, match="prompts"):
        llm.generate(None, sp)  # type: ignore[arg-type]
    (bad,) = llm.generate([np.array([1.5, 2.0])], sp, use_tqdm=False)
    assert bad.error is not None and "prompt" in bad.error
    assert_drained(llm)


def test_max_model_len_checked_against_model_positions(tiny) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_llm(tiny, max_model_len=1024)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_llm(tiny, max_model_len=10**9)
    assert make_llm(tiny, max_model_len=512).max_model_len == 512


def test_engine_config_field_types(tiny) -> None:
    cases = [
        (dict(seed="abc"), TypeError, "seed"),
        (dict(max_model_len=2.5), TypeError, "max_model_len"),
        (dict(enable_prefix_cache="no"), TypeError, "enable_prefix_cache"),
        (dict(ngram_edits=1), TypeError, "ngram_edits must be a bool"),
        (dict(page_size=True), ValueError, "page_size"),
        (dict(num_threads=1.5), TypeError, "num_threads"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(device=7), TypeError, "device"),
        (dict(device="tpu"), ValueError, "device"),
    ]
    if torch.cuda.device_count() < 8:
        cases.append((dict(device="cuda:7"), ValueError, "does not exist"))
    for kw, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            make_llm(tiny, **kw)


def test_sampling_param_edges(tiny) -> None:
    cases = [
        (dict(stop=b"x"), TypeError, "stop"),
        (dict(logit_bias={3: 1e308}), ValueError, "logit_bias"),
        (dict(temperature=1e-45), ValueError, "temperature"),
        (dict(allowed_token_ids=[5], stop_token_ids=[5], min_new_tokens=2), ValueError, "allowed_token_ids"),
    ]
    for kw, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            SamplingParams(**kw)
    llm = make_llm(tiny)  # EOS (2) is known to the engine only
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.add_request([3, 4], SamplingParams(allowed_token_ids=[2], min_new_tokens=1))
    assert llm.add_request([3, 4], SamplingParams(allowed_token_ids=[2], min_new_tokens=1, ignore_eos=True))
    drain_steps(llm)
    assert_drained(llm)
