"""Speculative decoding on an input-grounded workload (issue 6).

Rewrite / repeat a given passage with the embedded SmolLM2 (float32: on this CPU fp32 GEMV is as
fast as bf16, and identical greedy output across batch shapes is only meaningful where rounding
does not flip near-ties), greedy, 96 new tokens: n-gram (prompt lookup) speculation vs none in
the same run, same engine settings. The assistant turn is primed with the passage's first words,
as a rewriting service would do. Target: >= 1.8x decode tokens/s for a single request, with
identical output; a batch of 16 reports where the gain shrinks (on a compute-bound CPU, verifying
rejected draft tokens costs real FLOPs).
"""

from __future__ import annotations

import os
import time

import pytest

from treeserve import LLM, SamplingParams

PASSAGE = (
    "The water cycle describes how water moves between the oceans, the air and the land. The sun "
    "heats water in rivers, lakes and oceans and turns it into vapour, which rises into the air. "
    "As the vapour rises it cools and condenses into tiny droplets that form clouds. When the "
    "droplets grow heavy they fall back to the ground as rain, snow or hail. Some of that water "
    "flows over the land into rivers and back to the sea, some soaks into the soil and becomes "
    "groundwater, and some is taken up by plants and returned to the air through their leaves."
)
TASKS = [
    "Repeat the passage exactly.",
    "Rewrite the passage, keeping every sentence.",
    "Copy this text.",
    "Quote the passage.",
]
THREADS = int(os.environ.get("TREESERVE_BENCH_THREADS", "2"))
NEW = int(os.environ.get("TREESERVE_BENCH_SPEC_TOKENS", "96"))


@pytest.fixture(scope="module")
def llms() -> tuple[LLM, LLM]:
    base = LLM("smollm2-135m-instruct", dtype="float32", num_threads=THREADS)
    spec = LLM((base.model, base.tokenizer), num_threads=THREADS, speculative="ngram", num_speculative_tokens=8)
    return base, spec


def _prompts(llm: LLM, n: int) -> list[str]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Here is a passage:\n\n{PASSAGE}\n\n{TASKS[i % len(TASKS)]}"}],
            add_generation_prompt=True,
        )
        + PASSAGE[: 40 + 5 * i]  # primed answer; requests differ in how much is given
        for i in range(n)
    ]


def _run(llm: LLM, prompts: list[str]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("batch", [1, 16])
def test_ngram_speculation_vs_none(benchmark, llms, batch: int) -> None:
    base, spec = llms
    prompts = _prompts(base, batch)
    _run(base, prompts[:1])  # warm-up both
    _run(spec, prompts[:1])
    base_s, base_out = _run(base, prompts)
    before = (spec.metrics.draft_tokens, spec.metrics.accepted_tokens, spec.metrics.verify_steps)
    spec_s, spec_out = benchmark.pedantic(_run, args=(spec, prompts), rounds=1, iterations=1)
    same = sum(a == b for a, b in zip(spec_out, base_out))
    if batch == 1:
        assert spec_out == base_out, "speculation must not change greedy output"
    drafted = spec.metrics.draft_tokens - before[0]
    accepted = spec.metrics.accepted_tokens - before[1]
    steps = spec.metrics.verify_steps - before[2]
    ratio = base_s / spec_s
    rate = accepted / drafted if drafted else 0.0
    mean_len = (accepted + steps) / steps if steps else 0.0
    print(
        f"\nbatch {batch}: no spec {base_s:.2f}s, ngram {spec_s:.2f}s -> {ratio:.2f}x "
        f"(acceptance {rate:.1%}, mean accepted length {mean_len:.2f}, identical outputs {same}/{batch}; "
        "target >= 1.8x at batch 1)"
    )
    benchmark.extra_info.update(speedup=ratio, acceptance=rate, mean_accepted_length=mean_len)
    assert ratio > (1.2 if batch == 1 else 0.5)  # regression guards; targets in RESULTS.md
