"""Shared pieces of the tensor-parallel tests: a tiny synthetic model and an engine factory."""

from __future__ import annotations

from typing import Any

from treeserve import LLM, SamplingParams
from treeserve.models import LlamaForCausalLM, random_model, tiny_config

# Engine settings that exercise chunked prefill (prompts longer than a step's token budget),
# preemption (a KV pool smaller than the batch's needs), the prefix cache and tree speculation.
FEATURES: dict[str, Any] = dict(
    dtype="float32",
    kv_cache_tokens=160,
    max_batched_tokens=24,
    max_running=6,
    speculative="ngram",
    num_speculative_tokens=4,
    speculative_tree_width=2,
    seed=0,
)


def tiny_model() -> LlamaForCausalLM:
    """4 query / 2 KV heads, 2 layers, vocab 24: splits over 2 ranks. A small vocabulary makes
    greedy decoding repeat itself, which the n-gram drafter then predicts (tree drafts whose
    accepted branch must be compacted)."""
    return random_model(tiny_config("llama", eos_token_ids=(2,), vocab_size=24), seed=1, init_std=0.2)


def prompts() -> list[list[int]]:
    """Six prompts sharing a 24-token prefix (prefix-cache hits), each longer than a step's budget."""
    shared = [(7 * i + 3) % 13 + 3 for i in range(24)]
    return [shared + [10 + k, 4 + k, 3 + 2 * k] * (k + 1) for k in range(6)]


def greedy(logprobs: bool, n: int = 40) -> SamplingParams:
    """Greedy, ``n`` tokens; with ``logprobs`` (then requests decode without speculation)."""
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, logprobs=1 if logprobs else None)


def run(llm: LLM, ps: list[list[int]], sp: SamplingParams) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
