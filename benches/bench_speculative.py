"""Speculative decoding on an input-grounded workload (issues 6 and 32).

Rewrite / repeat a given passage with the embedded SmolLM2 in the default configuration
(``LLM()`` with no dtype: float32 over packed GGUF, fused C++ decode and verify layers), greedy,
128 new tokens: n-gram (prompt lookup) speculation vs none in the same run, same engine settings.
The assistant turn is primed with the passage's first words, as a rewriting service would do.
Targets (issue 32): >= 2.5x decode tokens/s for a single request, identical output; batches of
8 / 16 with drafting forced on (``speculative_max_batch=0``, every draft its whole room) give the
crossover the batch cap (``CPU_SPECULATIVE_MAX_BATCH``) is set from; the default configuration
(``speculative="auto"``: n-gram drafts, lengths by the goodput rule over the measured row cost,
``scheduler.draft_plan``) must not be slower than no speculation at batch 16, nor on chat that
does not quote its input (``CHAT``). Self-speculation (``draft:self:N``, the N most influential
layers) at temperature 0.8, on the rewrite and on chat: sampled drafts verified with their laws vs
point-mass drafts, mean accepted length and tok/s (target >= 1.3x accepted length). The n-gram
lookup's one-edit alignment (``ngram_edits``) vs exact lookup alone on the rewrite.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import pytest

from treeserve import LLM, SamplingParams
from treeserve.bench import rewrite_prompts as _prompts
from treeserve.engine import CPU_SPECULATIVE_MAX_BATCH, row_cost_rows
from treeserve.runner import measure_step_costs, row_cost_of

CHAT = [
    "Write a short story about a cat who learns to fly.",
    "Explain how photosynthesis works to a ten year old.",
    "What are three tips for staying productive when working from home?",
    "Describe the city of Paris in spring.",
]
THREADS = int(os.environ.get("TREESERVE_BENCH_THREADS", "2"))
NEW = int(os.environ.get("TREESERVE_BENCH_SPEC_TOKENS", "128"))
# 29 of SmolLM2's 30 layers: skipping more leaves too little of its law for sampled drafts to show
# their gain (benches/RESULTS.md, "Issue 32 on Zen 3: self-speculation that skips layers").
SELF_LAYERS = int(os.environ.get("TREESERVE_BENCH_SELF_LAYERS", "29"))
EDIT_ROUNDS = int(os.environ.get("TREESERVE_BENCH_EDIT_ROUNDS", "12"))


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM("smollm2-135m-instruct", num_threads=THREADS, speculative=None)


def _spec(base: LLM, **kw: object) -> LLM:
    """An engine over ``base``'s model with ``base``'s KV dtype (a given module would otherwise get the
    model's float32 KV where ``base``, loaded by name on an AVX-512 BF16 CPU, got bfloat16: other logits)."""
    return LLM((base.model, base.tokenizer), num_threads=THREADS, kv_cache_dtype=str(base.kv.dtype).removeprefix("torch."),
               **kw)


def _default(base: LLM) -> LLM:
    """What ``LLM()`` picks on this machine (``speculative="auto"`` for a model loaded by name: n-gram
    drafts planned on the measured table of verify-step costs, ``runner.measure_step_costs``)."""
    costs = measure_step_costs(base.model, base.kv, row_cost_rows(base.config.num_speculative_tokens))
    llm = _spec(base, speculative="ngram", speculative_max_batch=CPU_SPECULATIVE_MAX_BATCH,
                speculative_row_cost=row_cost_of(costs))
    llm.scheduler.config = dataclasses.replace(llm.scheduler.config, speculative_step_costs=costs)
    return llm


def _chat_prompts(llm: LLM, n: int) -> list[str]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT[i % len(CHAT)]}], add_generation_prompt=True)
            for i in range(n)]


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


@pytest.mark.parametrize(("workload", "batch"), [("rewrite", 1), ("rewrite", 8), ("rewrite", 16), ("chat", 1), ("chat", 8)])
def test_ngram_speculation_vs_none(benchmark, base: LLM, workload: str, batch: int) -> None:
    forced = _spec(base, speculative="ngram", speculative_max_batch=0)
    default = _default(base)
    prompts = (_prompts if workload == "rewrite" else _chat_prompts)(base, batch)
    for llm in (base, forced, default):  # warm-up
        _run(llm, prompts[:1])
    base_s, base_out = _run(base, prompts)
    before = _spec_counts(forced)
    spec_s, spec_out = benchmark.pedantic(_run, args=(forced, prompts), rounds=1, iterations=1)
    rate, mean_len = _accepted_length(before, _spec_counts(forced))
    before = _spec_counts(default)
    default_s, default_out = _run(default, prompts)
    default_rate, default_len = _accepted_length(before, _spec_counts(default))
    base2_s, _ = _run(base, prompts)  # again, so drift on a shared machine shows
    same = sum(a == b for a, b in zip(spec_out, base_out))
    if batch == 1:
        assert spec_out == base_out == default_out, "speculation must not change greedy output"
    ratio = min(base_s, base2_s) / spec_s
    default_ratio = min(base_s, base2_s) / default_s
    print(
        f"\n{workload} batch {batch}: no spec {base_s:.2f}s / {base2_s:.2f}s ({batch * NEW / min(base_s, base2_s):.1f} tok/s), "
        f"ngram (whole room) {spec_s:.2f}s -> {ratio:.2f}x (acceptance {rate:.1%}, mean tokens per verify step "
        f"{mean_len:.2f}, identical outputs {same}/{batch}); default (auto, step costs "
        f"{default.scheduler.config.speculative_step_costs}) {default_s:.2f}s -> {default_ratio:.2f}x "
        f"(acceptance {default_rate:.1%}, {default_len:.2f} tokens per verify step)"
    )
    benchmark.extra_info.update(speedup=ratio, default_speedup=default_ratio, acceptance=rate, mean_accepted_length=mean_len)
    if workload == "rewrite" and batch == 1:
        # Regression guards (targets in RESULTS.md): the default gains on its best case; whole-room drafting,
        # which ignores the row cost, does not lose beyond noise.
        assert default_ratio > 1.05 and ratio > 0.95


def test_ngram_edits_vs_exact_lookup(benchmark, base: LLM) -> None:
    """The default configuration on the rewrite, one request: the lookup's one-edit alignment
    (``ngram_edits``, the default) vs exact lookup alone vs no speculation, in rotating order over
    ``EDIT_ROUNDS`` rounds (this VM's drift moves single rounds +-20%); medians per engine and of
    the per-round ratios, and the (deterministic) tokens per verify step."""
    edits, exact = _default(base), _default(base)
    exact.drafter.edits = False
    engines = {"none": base, "edits": edits, "exact": exact}
    prompts = _prompts(base, 1)
    outs = {name: _run(llm, prompts)[1] for name, llm in engines.items()}  # warm-up
    assert outs["edits"] == outs["exact"] == outs["none"], "speculation must not change greedy output"
    times: dict[str, list[float]] = {name: [] for name in engines}
    counts = {name: _spec_counts(llm) for name, llm in engines.items() if name != "none"}
    names = list(engines)
    for r in range(EDIT_ROUNDS):
        for name in names[r % 3 :] + names[: r % 3]:
            times[name].append(_run(engines[name], prompts)[0])
    lengths = {name: _accepted_length(counts[name], _spec_counts(engines[name])) for name in counts}
    ratio = {name: statistics.median(a / b for a, b in zip(times["none"], times[name])) for name in counts}
    print(f"\nrewrite batch 1, {EDIT_ROUNDS} rotating rounds: with edits {ratio['edits']:.2f}x "
          f"({lengths['edits'][1]:.2f} tokens per verify step, acceptance {lengths['edits'][0]:.1%}), exact lookup "
          f"{ratio['exact']:.2f}x ({lengths['exact'][1]:.2f}, {lengths['exact'][0]:.1%}); exact / edits per round, "
          f"median {statistics.median(a / b for a, b in zip(times['exact'], times['edits'])):.3f}")
    benchmark.extra_info.update(edits_speedup=ratio["edits"], exact_speedup=ratio["exact"])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert lengths["edits"][1] > lengths["exact"][1]  # regression guard: the alignment drafts past edits


@pytest.mark.parametrize("workload", ["rewrite", "chat"])
def test_sampled_vs_point_mass_self_drafts(benchmark, base: LLM, workload: str) -> None:
    """Temperature 0.8, top-p 0.95, seeded: the same self-speculative engine with sampled drafts
    (the default) and with point-mass drafts (``DraftModelDrafter.sample = False``)."""
    llm = _spec(base, speculative=f"draft:self:{SELF_LAYERS}")
    prompts = (_prompts if workload == "rewrite" else _chat_prompts)(base, 4)
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
    print(f"{workload}, draft:self:{SELF_LAYERS}: accepted length sampled / point-mass: {gain:.2f}x (target >= 1.3x)")
    benchmark.extra_info.update(length_gain=gain)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert gain > 1.0  # regression guard; the target is in RESULTS.md
