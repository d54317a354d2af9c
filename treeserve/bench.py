"""Offline workloads shared by ``treeserve bench`` and ``benches/bench_engine.py``.

Each workload builds its prompts deterministically, runs them through an :class:`LLM` and
returns a :class:`WorkloadResult`. Timings are wall-clock on whatever machine runs them: compare
ratios measured in the same run, never absolute numbers across machines.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import treeserve.models.llama as llama_module
from treeserve.engine import LLM, RequestOutput
from treeserve.sampling import SamplingParams

TOPICS = [
    "the history of tea", "how a bicycle gear works", "why the sky is blue", "a good bread recipe",
    "the rules of chess", "how vaccines train the immune system", "what a hash table is",
    "the water cycle", "how to learn a language", "the life of honeybees", "how rockets reach orbit",
    "what makes music sound happy", "the causes of tides", "how compilers work", "volcanoes",
    "the first computers",
]


@dataclass(slots=True)
class WorkloadResult:
    """Numbers of one workload run (seconds, tokens, rates)."""

    name: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    sample_text: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


PASSAGE = (
    "The water cycle describes how water moves between the oceans, the air and the land. The sun "
    "heats water in rivers, lakes and oceans and turns it into vapour, which rises into the air. "
    "As the vapour rises it cools and condenses into tiny droplets that form clouds. When the "
    "droplets grow heavy they fall back to the ground as rain, snow or hail. Some of that water "
    "flows over the land into rivers and back to the sea, some soaks into the soil and becomes "
    "groundwater, and some is taken up by plants and returned to the air through their leaves."
)
REWRITE_TASKS = [
    "Repeat the passage exactly.",
    "Rewrite the passage, keeping every sentence.",
    "Copy this text.",
    "Quote the passage.",
]


def rewrite_prompts(llm: LLM, num: int) -> list[str]:
    """``num`` input-grounded requests: a passage to repeat or rewrite, the assistant turn primed
    with its first words (as a rewriting service would), each request primed a little further."""
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Here is a passage:\n\n{PASSAGE}\n\n{REWRITE_TASKS[i % len(REWRITE_TASKS)]}"}],
            add_generation_prompt=True,
        )
        + PASSAGE[: 40 + 5 * i]
        for i in range(num)
    ]


def chat_prompts(llm: LLM, num: int, seed: int = 0) -> list[str]:
    """``num`` short chat-formatted questions (cycled topics, fixed order for a seed)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        topic = TOPICS[(i + rng.randrange(len(TOPICS))) % len(TOPICS)]
        msgs = [{"role": "user", "content": f"Explain {topic} in a few sentences."}]
        prompts.append(llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    return prompts


def _timed(llm: LLM, prompts: list[Any], params: SamplingParams) -> tuple[float, list[RequestOutput]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _result(name: str, seconds: float, outs: list[RequestOutput], **extra: Any) -> WorkloadResult:
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} requests failed, first: {errors[0]}")
    return WorkloadResult(
        name=name,
        seconds=seconds,
        num_requests=len(outs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        generated_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs),
        extra=extra,
        sample_text=outs[0].outputs[0].text if outs and outs[0].outputs else "",
    )


def throughput(llm: LLM, num_requests: int, max_new_tokens: int) -> WorkloadResult:
    """Batched chat requests, greedy, exactly ``max_new_tokens`` each (EOS ignored)."""
    prompts = chat_prompts(llm, num_requests)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    seconds, outs = _timed(llm, prompts, params)
    return _result(f"throughput {num_requests}x{max_new_tokens}", seconds, outs)


def shared_prefix_prompts(llm: LLM, groups: int, per_group: int, prefix_tokens: int) -> list[list[int]]:
    """``groups`` system prompts of ``prefix_tokens`` tokens, each followed by ``per_group`` questions."""
    rng = random.Random(1)
    words = "the of and to in is that for it as with was on be by at this from or have an are".split()
    prompts = []
    for g in range(groups):
        system: list[int] = []
        while len(system) < prefix_tokens:
            system += llm.tokenizer.encode(" ".join(rng.choice(words) for _ in range(64)))
        system = system[:prefix_tokens]
        for q in range(per_group):
            question = llm.tokenizer.encode(f" Question {g}.{q}: summarize {TOPICS[(g + q) % len(TOPICS)]}.")
            prompts.append(system + question)
    return prompts


def shared_prefix(llm: LLM, groups: int, per_group: int, prefix_tokens: int) -> WorkloadResult:
    """Prefill-dominated: one generated token per request; reports prefix-cache hit rate."""
    prompts = shared_prefix_prompts(llm, groups, per_group, prefix_tokens)
    before = llm.metrics.cached_prompt_tokens
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    seconds, outs = _timed(llm, prompts, params)
    prompt_tokens = sum(len(p) for p in prompts)
    hit = (llm.metrics.cached_prompt_tokens - before) / prompt_tokens
    llm.radix.reset()  # leave no cached prefix for the next workload
    return _result(f"shared prefix {groups}x{per_group}x{prefix_tokens}", seconds, outs, hit_rate=hit)


def single_decode(llm: LLM, max_new_tokens: int) -> WorkloadResult:
    """One request, greedy: decode tokens/s (prefill included in the time, it is one short chunk)."""
    prompts = chat_prompts(llm, 1, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    seconds, outs = _timed(llm, prompts, params)
    return _result(f"single request x{max_new_tokens}", seconds, outs)


def grounded_decode(llm: LLM, plain: LLM, max_new_tokens: int) -> WorkloadResult:
    """One input-grounded request (``rewrite_prompts``), greedy, timed on ``llm`` (its speculation
    setting) and on ``plain`` (the same model without speculation): the speed-up speculation gives
    this request, the draft tokens accepted and the tokens per verify step. Raises when the two
    outputs differ (greedy speculation is exact)."""
    prompts = rewrite_prompts(llm, 1)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    plain_s, plain_outs = _timed(plain, prompts, params)
    seconds, outs = _timed(llm, prompts, params)
    if outs[0].outputs[0].token_ids != plain_outs[0].outputs[0].token_ids:
        raise RuntimeError("grounded request: the output with speculation differs from the one without")
    counts = outs[0].metrics or {}
    steps, accepted = counts.get("verify_steps", 0), counts.get("accepted_draft_tokens", 0)
    return _result(f"grounded request x{max_new_tokens}", seconds, outs, speedup_vs_no_speculation=plain_s / seconds,
                   accepted_drafts=accepted, tokens_per_verify_step=(accepted + steps) / steps if steps else 0.0)


def single_stream_breakdown(llm: LLM, max_new_tokens: int) -> WorkloadResult:
    """``single_decode`` timed by part, in milliseconds per step: GEMMs (projections + LM head),
    attention (attention modules minus their projections), fused layers (the C++ ``decode_layers``
    call serving a step's decoder layers whole: their GEMMs, attention and norms, not separable;
    the LM head stays under GEMMs), sampling, and host (the rest: norms, RoPE, embedding,
    scheduling, Python). Module hooks time each call with ``perf_counter``, so this run is a little
    slower than an unhooked ``single_decode``."""
    spent = {"gemm": 0.0, "attention": 0.0, "attention_proj": 0.0, "fused": 0.0, "sampling": 0.0}
    starts: dict[int, float] = {}
    handles = []

    def timed(module: Any, *keys: str) -> None:
        def pre(mod: Any, args: Any) -> None:
            starts[id(mod)] = time.perf_counter()

        def post(mod: Any, args: Any, out: Any) -> None:
            elapsed = time.perf_counter() - starts.pop(id(mod))
            for key in keys:
                spent[key] += elapsed

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    for name, mod in llm.model.named_modules():
        if name.endswith(("qkv_proj", "o_proj")):
            timed(mod, "gemm", "attention_proj")
        elif name.endswith(("_proj", "lm_head")):
            timed(mod, "gemm")
        elif name.endswith("self_attn"):
            timed(mod, "attention")
    def clocked(fn: Any, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t

        return call

    runner = getattr(llm, "runner", None)
    inner_sample = getattr(runner, "_sample", None)
    if inner_sample is not None:
        runner._sample = clocked(inner_sample, "sampling")
    inner_fused = llama_module.run_decode_layers
    llama_module.run_decode_layers = clocked(inner_fused, "fused")
    steps0 = llm.metrics.steps
    try:
        result = single_decode(llm, max_new_tokens)
    finally:
        llama_module.run_decode_layers = inner_fused
        for h in handles:
            h.remove()
        if inner_sample is not None:
            del runner._sample
    ms = 1e3 / max(llm.metrics.steps - steps0, 1)
    attention = spent["attention"] - spent["attention_proj"]
    result.name = f"single stream x{max_new_tokens}"
    result.extra.update(
        gemm_ms=spent["gemm"] * ms,
        attention_ms=attention * ms,
        fused_layers_ms=spent["fused"] * ms,
        sampling_ms=spent["sampling"] * ms,
        host_ms=(result.seconds - spent["gemm"] - attention - spent["fused"] - spent["sampling"]) * ms,
    )
    return result
