"""Structured output through the engine: the commit path feeds each sample's matcher, every step
masks the next token, requests end when the grammar does; with n > 1, preemption, stop strings,
logprobs, speculative decoding (drafts checked by the matcher, verified under per-position
masks), jump-forward and the static (CUDA-graph) runner.

Fast engines (a seeded random 2-layer model, a scripted one) over the embedded SmolLM2
tokenizer; ``test_smollm2_structured`` runs the real SmolLM2 once, every kind in one batch.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.models import random_model, tiny_config

from ._scripted import ScriptedModel, smol_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b c"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" [a-c]+ ")"'
# Bounded constraints: a random model ends each within a few dozen tokens. ``json_object`` (free
# keys and strings) is left to the real model, which closes its strings.
KINDS = [({"json_schema": SCHEMA}, "schema"), ({"regex": REGEX}, "regex"), ({"choice": CHOICES}, "choice"),
         ({"grammar": GRAMMAR}, "grammar")]  # fmt: skip


def check(kind: str, text: str) -> None:
    """``text`` satisfies the constraint named ``kind``."""
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([a-c]+\)", text), text


def synthetic(**kw) -> LLM:
    tok = smol_tokenizer()
    cfg = tiny_config("llama", vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids, max_position_embeddings=1024)
    engine = dict(kv_cache_tokens=4096, max_batched_tokens=256, max_running=32, max_model_len=512, page_size=4)
    return LLM((random_model(cfg, seed=0, init_std=0.3), tok), **{**engine, **kw})


def assert_drained(llm: LLM) -> None:
    assert not llm.has_unfinished_requests()
    alloc = llm.kv.allocator
    assert llm.radix.protected_tokens == 0
    assert alloc.num_free + llm.radix.evictable_tokens // llm.kv.page_size == alloc.capacity
    llm.scheduler.check_invariants()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return synthetic()


def run_kinds(llm: LLM, n: int = 2, kinds: list = KINDS, **params) -> list:
    """One ``generate`` of every kind (``n`` samples each, seeded); checks and returns the outputs."""
    sps = [SamplingParams(structured=spec, n=n, seed=i, max_new_tokens=160, **params) for i, (spec, _) in enumerate(kinds)]
    outs = llm.generate(["Answer:"] * len(kinds), sps, use_tqdm=False)
    for out, (_, kind) in zip(outs, kinds):
        assert out.error is None and len(out.outputs) == n
        for o in out.outputs:
            assert o.finish_reason == "stop", (kind, o.text, o.finish_reason)
            check(kind, o.text)
    assert_drained(llm)
    return outs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_every_sample_is_valid(llm, temperature) -> None:
    run_kinds(llm, n=2 if temperature else 1, temperature=temperature)


def test_grammar_overrides_the_model() -> None:
    """A model that only wants to write "hello" still writes digits under ``[0-9]+``; the request
    ends when nothing but EOS could follow, without sampling the EOS."""
    tok = smol_tokenizer()
    script = tok.encode("hello world", add_special_tokens=False)
    llm = LLM((ScriptedModel(script, 2, tok.vocab_size), tok), kv_cache_tokens=512, max_model_len=128)
    free = llm.generate([[5, 6]], SamplingParams(temperature=0, max_new_tokens=4), use_tqdm=False)[0].outputs[0]
    assert free.text.startswith("hello")
    (out,) = llm.generate([[5, 6]], SamplingParams(temperature=0, max_new_tokens=20, structured={"regex": "[0-9]{2}"}),
                          use_tqdm=False)[0].outputs  # fmt: skip
    assert re.fullmatch("[0-9]{2}", out.text) and out.finish_reason == "stop"
    assert all(t not in tok.eos_token_ids for t in out.token_ids)  # ended by the grammar, no EOS drawn
    assert_drained(llm)


def test_preemption_resumes_the_matcher() -> None:
    small = synthetic(kv_cache_tokens=160, max_running=8)
    sps = [SamplingParams(structured={"json_schema": SCHEMA}, seed=s, temperature=1.0, max_new_tokens=100)
           for s in range(8)]  # fmt: skip
    outs = small.generate(["Answer:"] * 8, sps, use_tqdm=False)
    assert small.metrics.preemptions > 0
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason == "stop":  # strict=False: xgrammar's JSON strings admit raw control characters
            jsonschema.validate(json.loads(o.text, strict=False), SCHEMA)
        else:  # cut by max_new_tokens: still a prefix the grammar accepted
            assert o.finish_reason == "length", (o.finish_reason, out.error)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 6
    assert_drained(small)


def test_stop_strings_and_logprobs_under_the_mask(llm) -> None:
    tok = llm.tokenizer
    (out,) = llm.generate(["Answer:"], SamplingParams(structured={"regex": "[a-c]{6}x"}, seed=3, temperature=1.0,
                                                       max_new_tokens=30, stop=["c"]), use_tqdm=False)[0].outputs  # fmt: skip
    assert out.finish_reason == "stop"
    if out.stop_reason == "c":  # the stop string cut the grammar's text
        assert re.fullmatch("[ab]{0,5}", out.text)
    else:
        assert re.fullmatch("[ab]{6}x", out.text)
    sp = SamplingParams(structured={"choice": CHOICES}, seed=1, temperature=1.0, logprobs=5, max_new_tokens=8)
    (out,) = llm.generate(["Answer:"], sp, use_tqdm=False)[0].outputs
    assert out.text in CHOICES and len(out.logprobs) == len(out.token_ids)
    first = out.top_logprobs[0]
    allowed = {t: lp for t, lp in first.items() if lp > float("-inf")}
    assert allowed and all(any(c.startswith(tok.decode([t])) for c in CHOICES) for t in allowed)
    assert sum(torch.tensor(list(allowed.values())).exp()) <= 1 + 1e-5
    assert out.logprobs[0] == pytest.approx(first[out.token_ids[0]], abs=1e-5)


def test_a_grammar_completed_on_the_last_allowed_token_reports_stop(llm) -> None:
    """Output that the grammar completes exactly at ``max_new_tokens`` is whole: "stop", not
    "length"; one token fewer is cut: "length"."""
    sp = SamplingParams(structured={"choice": ["ok, fine"]}, temperature=0, max_new_tokens=50)
    (whole,) = llm.generate(["Answer:"], sp, use_tqdm=False)[0].outputs
    n = len(whole.token_ids)
    assert whole.text == "ok, fine" and whole.finish_reason == "stop" and n >= 2
    for max_new, reason in ((n, "stop"), (n - 1, "length")):
        (out,) = llm.generate(["Answer:"], replace(sp, max_new_tokens=max_new), use_tqdm=False)[0].outputs
        assert out.token_ids == whole.token_ids[:max_new] and out.finish_reason == reason, (max_new, out)


def test_ignore_eos_still_ends_with_the_grammar(llm) -> None:
    sp = SamplingParams(structured={"choice": ["ok"]}, ignore_eos=True, temperature=0, max_new_tokens=50)
    (out,) = llm.generate(["Answer:"], sp, use_tqdm=False)[0].outputs
    assert out.text == "ok" and out.finish_reason == "stop"


def test_bad_specs_fail_at_submission(llm) -> None:
    for spec, match in [({"json_schema": {"type": "objekt"}}, r"structured\.json_schema is invalid"),
                        ({"regex": "(a"}, r"structured\.regex is invalid"),
                        ({"grammar": 'root ::= ""'}, r"structured\.grammar admits no output token")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            llm.add_request("hi", SamplingParams(structured=spec))
        assert llm.generate(["hi"], SamplingParams(structured=spec), use_tqdm=False)[0].error.startswith("ValueError")
    assert_drained(llm)
    no_tok = LLM((llm.model, None), kv_cache_tokens=256, max_model_len=64)
    with pytest.raises(ValueError, match="structured needs a tokenizer"):
        no_tok.add_request([1, 2], SamplingParams(structured={"regex": "a"}))


def test_stream_and_step_api(llm) -> None:
    sp = SamplingParams(structured={"regex": REGEX}, seed=9, temperature=1.0, max_new_tokens=40)
    text = "".join(llm.stream("Answer:", sp))
    assert re.fullmatch(REGEX, text)
    assert text == llm.generate(["Answer:"], sp, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def greedy_plain(llm) -> list[list[int]]:
    """The default engine's greedy token ids of every kind (jump-forward on, no speculation)."""
    before = llm.metrics.jump_forward_tokens
    outs = run_kinds(llm, n=1, temperature=0.0)
    assert llm.metrics.jump_forward_tokens > before  # the schema's keys and punctuation are forced
    return [o.outputs[0].token_ids for o in outs]


SPECULATIVE = [dict(speculative="ngram", num_speculative_tokens=3), dict(speculative="draft:self:1", num_speculative_tokens=3)]


@pytest.mark.parametrize("kw", [*SPECULATIVE, dict(cuda_graph=True), dict(jump_forward_tokens=0)],
                         ids=["ngram", "draft_model", "static", "no_jump_forward"])  # fmt: skip
def test_speculation_jump_forward_and_static_runner_stay_exact(kw, greedy_plain) -> None:
    """Greedy constrained outputs are the same tokens with jump-forward (the default) or
    without, with n-gram or draft-model speculation (drafts checked by the matcher, verified
    under each position's mask) and with the static runner (whose constrained batches take
    the eager path)."""
    other = synthetic(**kw)
    outs = run_kinds(other, n=1, temperature=0.0)
    assert [o.outputs[0].token_ids for o in outs] == greedy_plain
    if kw.get("jump_forward_tokens") == 0:
        assert other.metrics.jump_forward_proposed == 0
    if "speculative" in kw:
        assert other.metrics.draft_tokens > 0 and other.metrics.jump_forward_tokens > 0


def test_jump_forward_saves_forward_passes_and_reports_them() -> None:
    """A schema whose text is mostly forced: greedy output equal with and without jump-forward,
    each accepted jump-forward token one step fewer, counted in ``LLM.metrics``."""
    schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in ("first_key", "second_key", "third")},
              "required": ["first_key", "second_key", "third"], "additionalProperties": False}  # fmt: skip
    sp = SamplingParams(structured={"json_schema": schema}, temperature=0.0, max_new_tokens=80)
    runs = []
    for jump in (0, 16):
        llm = synthetic(jump_forward_tokens=jump)
        (out,) = llm.generate(["Answer:"], sp, use_tqdm=False)[0].outputs
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == set(schema["properties"])
        runs.append((out.token_ids, llm.metrics))
        assert_drained(llm)
    (ids_off, off), (ids_on, on) = runs
    assert ids_on == ids_off
    assert off.jump_forward_proposed == off.jump_forward_tokens == 0
    assert 0 < on.jump_forward_tokens <= on.jump_forward_proposed
    assert on.steps == off.steps - on.jump_forward_tokens
    assert on.draft_tokens == on.verify_steps == 0  # no speculation asked: forced tokens only


@pytest.mark.parametrize("kw", SPECULATIVE, ids=["ngram", "draft_model"])
def test_sampled_constrained_speculation_is_valid(kw) -> None:
    """Sampled (temperature 1) constrained requests with speculation: every output valid (the
    schema and the grammar: the random model's draws are mostly refused, so every step verifies)."""
    llm = synthetic(**kw)
    run_kinds(llm, n=1, kinds=[KINDS[0], KINDS[3]], temperature=1.0)
    assert llm.metrics.jump_forward_tokens > 0


@pytest.mark.slow
def test_smollm2_structured() -> None:
    """The embedded SmolLM2-135M, one batch: a schema and a JSON object greedy, a regex sampled."""
    llm = LLM(max_batched_tokens=512)
    tok = llm.tokenizer
    cases = [("Describe a person as JSON.", {"json_schema": SCHEMA}, 0.0, "schema"),
             ('Repeat this JSON: {"city": "Paris", "country": "France"}', {"json_object": True}, 0.0, "object"),
             ("Write a product code.", {"regex": REGEX}, 0.8, "regex")]  # fmt: skip
    prompts = [tok.apply_chat_template([{"role": "user", "content": c[0]}]) for c in cases]
    sps = [SamplingParams(structured=spec, temperature=t, seed=1, max_new_tokens=64) for _, spec, t, _ in cases]
    for out, case in zip(llm.generate(prompts, sps, use_tqdm=False), cases):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (case, o.text)
        check(case[3], o.text)
    assert_drained(llm)
