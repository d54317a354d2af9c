"""Issue 16 regressions: threads sharing one LLM, faults inside steps, abandoned and interleaved
streams, and a stateful fault-injection run that raises inside schedule / runner / sampling /
update / drafter at random steps."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treeserve import LLM, SamplingParams
from treeserve.models import random_model, tiny_config

from ._scripted import ScriptedModel, smol_tokenizer
from .test_engine import assert_drained, make_llm, prompts_for

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0, init_std=0.3)


def reference(model, prompts, sp=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in make_llm(model).generate(prompts, sp, use_tqdm=False)]


def test_two_threads_share_one_llm(tiny) -> None:
    prompts = prompts_for(5, 8)
    expected = reference(tiny, prompts)
    llm = make_llm(tiny, max_running=4, max_batched_tokens=32)
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(3):
                outs = llm.generate(prompts[k * 4 : k * 4 + 4], GREEDY, use_tqdm=False)
                results.setdefault(k, []).extend(o.outputs[0].token_ids for o in outs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results[0] == expected[:4] * 3 and results[1] == expected[4:] * 3
    assert_drained(llm)


class RaisingModel(torch.nn.Module):
    """Raises in forward while a row's last input token is ``BAD`` (or always, when armed)."""

    BAD = 13

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.always = False

    def forward(self, input_ids, positions, kv, out_slots, meta, logits_indices):
        if self.always or bool((input_ids[logits_indices] == self.BAD).any()):
            raise IndexError("injected model fault")
        return self.inner(input_ids, positions, kv, out_slots, meta, logits_indices)


def test_request_that_breaks_the_step_fails_alone(tiny) -> None:
    model = RaisingModel(tiny)
    llm = make_llm(model)
    good = [[4, 5, 6], [7, 8, 9, 10]]
    outs = llm.generate([good[0], [4, 5, RaisingModel.BAD], good[1]], GREEDY, use_tqdm=False)
    assert outs[1].error is not None and "injected model fault" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == reference(tiny, good)
    assert_drained(llm)
    model.always = True  # a fault no single request explains: the call aborts its requests, re-raises
    with pytest.raises(IndexError, match="injected"):
        llm.generate(good, GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert_drained(llm)
    model.always = False
    assert [o.outputs[0].token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)] == reference(tiny, good)


def test_closing_a_stream_aborts_its_request() -> None:
    tok = smol_tokenizer()
    script = tok.encode("one two three four five six seven", add_special_tokens=False)
    llm = LLM((ScriptedModel(script, 3, tok.vocab_size), tok), kv_cache_tokens=2048, max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    gen = llm.stream([10, 11, 12], sp)
    first = next(gen)
    assert first and llm.scheduler.has_work()
    gen.close()
    assert not llm.has_unfinished_requests()
    assert_drained(llm)
    with pytest.raises(ValueError, match="n=1"):
        next(llm.stream([10, 11, 12], SamplingParams(n=2)))
    assert not llm.has_unfinished_requests()


def test_suspended_stream_keeps_its_output_while_others_step() -> None:
    tok = smol_tokenizer()
    script = tok.encode("The quick brown fox 😀 jumps over the lazy dog, 你好!", add_special_tokens=False)
    llm = LLM((ScriptedModel(script, 3, tok.vocab_size), tok), kv_cache_tokens=2048, max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_new_tokens=len(script), ignore_eos=True)
    gen = llm.stream([10, 11, 12], sp)
    pieces = [next(gen)]
    (other,) = llm.generate([[10, 11, 12]], sp, use_tqdm=False)  # steps the stream's request too
    rid = llm.add_request([10, 11, 12], sp)
    deltas = llm.step() + llm.step()
    pieces.extend(gen)  # steps the step-API request too, without taking its output
    assert "".join(pieces) == other.outputs[0].text == tok.decode(script)
    for _ in range(len(script) + 2):
        if not llm.has_unfinished_requests():
            break
        deltas += llm.step()
    assert "".join(d.text for d in deltas if d.request_id == rid) == other.outputs[0].text
    assert deltas[-1].finish_reason == "length"
    assert not llm.has_unfinished_requests()


def test_runtime_failure_raises_in_the_stream(tiny) -> None:
    from .test_engine import PoisonedModel

    llm = make_llm(PoisonedModel(tiny))
    with pytest.raises(RuntimeError, match="invalid logits"):
        list(llm.stream([4, 5, PoisonedModel.POISON], GREEDY))
    assert_drained(llm)


# ---------------------------------------------------------------------------- fault injection
class Fault(RuntimeError):
    pass


TARGETS = ["scheduler.schedule", "runner.run", "sample", "scheduler.update", "drafter.propose"]


FAULT_PROMPTS = prompts_for(7, 6)
FAULT_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def fault_expected(tiny) -> list[list[int]]:
    return reference(tiny, FAULT_PROMPTS, FAULT_PARAMS)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=st.lists(st.tuples(st.sampled_from(TARGETS), st.integers(0, 8)), min_size=1, max_size=4))
def test_faults_at_random_steps_leave_a_clean_engine(tiny, fault_expected, faults) -> None:
    import treeserve.runner.eager as runner_mod

    llm = make_llm(tiny, speculative="ngram", num_speculative_tokens=3, kv_cache_tokens=600, max_running=6)
    owners = {
        "scheduler.schedule": (llm.scheduler, "schedule"),
        "runner.run": (llm.runner, "run"),
        "sample": (runner_mod, "sample"),
        "scheduler.update": (llm.scheduler, "update"),
        "drafter.propose": (llm.drafter, "propose"),
    }
    calls = dict.fromkeys(TARGETS, 0)

    def faulty(name: str, original):
        when = {k for t, k in faults if t == name}

        def wrapped(*args, **kwargs):
            calls[name] += 1
            if calls[name] - 1 in when:
                raise Fault(f"injected into {name}")
            return original(*args, **kwargs)

        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        for name, (owner, attr) in owners.items():
            mp.setattr(owner, attr, faulty(name, getattr(owner, attr)))
        for _ in range(len(faults) + 1):
            try:
                outs = llm.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)
            except Fault:
                assert not llm.has_unfinished_requests()
                assert_drained(llm)
                continue
            for out, exp in zip(outs, fault_expected):
                if out.error is None:
                    assert out.outputs[0].token_ids == exp
                else:  # failed alone: only an injected fault may explain it
                    assert "injected" in out.error and out.outputs[0].finish_reason == "error"
            assert_drained(llm)
    outs = llm.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)  # faults gone: exact again
    assert [o.outputs[0].token_ids for o in outs] == fault_expected
    assert_drained(llm)
