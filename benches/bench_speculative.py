"""Speculative decoding on an input-grounded workload (issues 6 and 32).

Rewrite / repeat a given passage with the embedded SmolLM2 in the default configuration
(``LLM()`` with no dtype: float32 over packed GGUF, fused C++ decode and verify layers), greedy,
128 new tokens: n-gram (prompt lookup) speculation vs none in the same run, same engine settings.
The assistant turn is primed with the passage's first words, as a rewriting service would do.
Targets (issue 32): >= 2.5x decode tokens/s for a single request, identical output; batches of
8 / 16 with drafting forced on (``speculative_max_batch=0``) give the crossover the default
rule (``CPU_SPECULATIVE_MAX_BATCH``) is set from, and the default rule must not be slower than
no speculation at batch 16. Self-speculation (``draft:self:N``) at temperature 0.8: sampled
drafts verified with their laws vs point-mass drafts, mean accepted length and tok/s (target
>= 1.3x accepted length).
"""

from __future__ import annotations

import os
import time

import pytest

from treeserve import LLM, SamplingParams
from treeserve.engine import CPU_SPECULATIVE_MAX_BATCH

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
NEW = int(os.environ.get("TREESERVE_BENCH_SPEC_TOKENS", "128"))
SELF_LAYERS = int(os.environ.get("TREESERVE_BENCH_SELF_LAYERS", "15"))


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM("smollm2-135m-instruct", num_threads=THREADS)


def _spec(base: LLM, **kw: object) -> LLM:
    return LLM((base.model, base.tokenizer), num_threads=THREADS, **kw)


def _prompts(llm: LLM, n: int) -> list[str]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Here is a passage:\n\n{PASSAGE}\n\n{TASKS[i % len(TASKS)]}"}],
            add_generation_prompt=True,
        )
        + PASSAGE[: 40 + 5 * i]  # primed answer; requests differ in how much is given
        for i in range(n)
    ]


def _run(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams] | None = None) -> tuple[float, list[list[int]]]:
    params = params or SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    m = llm.metrics
    return m.draft_tokens, m.accepted_tokens, m.verify_steps


def _accepted_length(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float]:
    """(acceptance rate, mean tokens per verify step) between two ``_spec_counts``."""
    drafted, accepted, steps = (a - b for a, b in zip(after, before))
    return (accepted / drafted if drafted else 0.0), ((accepted + steps) / steps if steps else 0.0)


@pytest.mark.parametrize("batch", [1, 8, 16])
def test_ngram_speculation_vs_none(benchmark, base: LLM, batch: int) -> None:
    forced = _spec(base, speculative="ngram", speculative_max_batch=0)
    # The default rule of a model loaded by name (a given module, as here, has no limit by default).
    rule = _spec(base, speculative="ngram", speculative_max_batch=CPU_SPECULATIVE_MAX_BATCH)
    prompts = _prompts(base, batch)
    for llm in (base, forced, rule):  # warm-up
        _run(llm, prompts[:1])
    base_s, base_out = _run(base, prompts)
    before = _spec_counts(forced)
    spec_s, spec_out = benchmark.pedantic(_run, args=(forced, prompts), rounds=1, iterations=1)
    rate, mean_len = _accepted_length(before, _spec_counts(forced))
    rule_s, rule_out = _run(rule, prompts)
    base2_s, _ = _run(base, prompts)  # again, so drift on a shared machine shows
    same = sum(a == b for a, b in zip(spec_out, base_out))
    if batch == 1:
        assert spec_out == base_out, "speculation must not change greedy output"
    ratio = min(base_s, base2_s) / spec_s
    rule_ratio = min(base_s, base2_s) / rule_s
    print(
        f"\nbatch {batch}: no spec {base_s:.2f}s / {base2_s:.2f}s ({batch * NEW / min(base_s, base2_s):.1f} tok/s), "
        f"ngram {spec_s:.2f}s -> {ratio:.2f}x (acceptance {rate:.1%}, mean tokens per verify step {mean_len:.2f}, "
        f"identical outputs {same}/{batch}); default rule {rule_s:.2f}s -> {rule_ratio:.2f}x"
    )
    benchmark.extra_info.update(speedup=ratio, rule_speedup=rule_ratio, acceptance=rate, mean_accepted_length=mean_len)
    assert ratio > (1.2 if batch == 1 else 0.5)  # regression guards; targets in RESULTS.md


def test_sampled_vs_point_mass_self_drafts(benchmark, base: LLM) -> None:
    """Temperature 0.8, top-p 0.95, seeded: the same self-speculative engine with sampled drafts
    (the default) and with point-mass drafts (``DraftModelDrafter.sample = False``)."""
    llm = _spec(base, speculative=f"draft:self:{SELF_LAYERS}")
    prompts = _prompts(base, 4)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_new_tokens=NEW, ignore_eos=True)
              for i in range(len(prompts))]
    _run(llm, prompts[:1], params[:1])  # warm-up
    rows = {}
    for mode in ("point-mass", "sampled", "point-mass again", "sampled again"):
        llm.drafter.sample = mode.startswith("sampled")
        before = _spec_counts(llm)
        secs = 0.0
        for p, sp in zip(prompts, params):  # one request at a time: the single-stream case
            secs += _run(llm, [p], sp)[0]
        rate, mean_len = _accepted_length(before, _spec_counts(llm))
        rows[mode] = (secs, rate, mean_len)
        print(f"\n{mode}: {len(prompts) * NEW / secs:.1f} tok/s, acceptance {rate:.1%}, "
              f"mean tokens per verify step {mean_len:.2f}")
    plain_s = sum(_run(base, [p], sp)[0] for p, sp in zip(prompts, params))
    print(f"no speculation: {len(prompts) * NEW / plain_s:.1f} tok/s")
    gain = (rows["sampled"][2] + rows["sampled again"][2]) / (rows["point-mass"][2] + rows["point-mass again"][2])
    print(f"accepted length sampled / point-mass: {gain:.2f}x (target >= 1.3x)")
    benchmark.extra_info.update(length_gain=gain)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert gain > 1.0  # regression guard; the target is in RESULTS.md
