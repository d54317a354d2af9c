"""World size 2 against world size 1 on one synthetic model: same tokens, logits within 1e-5.

Both engines run chunked prefill, the prefix cache, preemption (a small KV pool) and n-gram
tree speculation; each test checks that the feature it is about actually ran.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tokenizers
import torch

from tests.distributed._helpers import FEATURES, greedy, prompts, run, tiny_model
from treeserve import LLM, SamplingParams
from treeserve.models import LlamaForCausalLM, save_hf_dir
from treeserve.runner import PagedSequence


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


@pytest.fixture(scope="module")
def ref(model: LlamaForCausalLM) -> LLM:
    return LLM((model, None), **FEATURES)


@pytest.fixture(scope="module")
def tp(model: LlamaForCausalLM) -> Iterator[LLM]:
    llm = LLM((model, None), tensor_parallel_size=2, **FEATURES)
    inner = llm.runner.compact_kv
    llm.compactions = 0  # type: ignore[attr-defined]

    def counted(*args: object) -> None:
        llm.compactions += 1  # type: ignore[attr-defined]
        inner(*args)

    llm.runner.compact_kv = counted
    yield llm
    llm.close()


def test_shards_hold_half_the_heads(tp: LLM, model: LlamaForCausalLM) -> None:
    assert tp.model.world_size == 2
    assert tp.kv.num_kv_heads == model.config.num_kv_heads // 2
    assert tp.model.local.layers[0].self_attn.num_heads == model.config.num_heads // 2


def test_logits_match_single_rank(tp: LLM, model: LlamaForCausalLM) -> None:
    """A prefill chunk then greedy decode steps through PagedSequence: logits within 1e-5."""
    one, two = PagedSequence(model, 64, shuffle_seed=1), PagedSequence(tp.model, 64, shuffle_seed=1)
    chunk = prompts()[2][:20]
    for _ in range(8):
        a, b = one.extend(chunk, all_logits=True), two.extend(chunk, all_logits=True)
        assert a.shape == b.shape == (len(chunk), model.config.vocab_size)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        chunk = [int(a[-1].argmax())]


def test_greedy_with_preemption_and_prefix_hits(ref: LLM, tp: LLM) -> None:
    before = tp.metrics.preemptions, tp.metrics.cached_prompt_tokens
    want, got = run(ref, prompts(), greedy(True)), run(tp, prompts(), greedy(True))
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), rtol=0, atol=1e-5)
    assert tp.metrics.preemptions > before[0], "the KV pool was meant to force preemption"
    assert tp.metrics.cached_prompt_tokens > before[1], "the shared prefix was meant to hit the cache"


def test_ngram_tree_speculation_compacts_every_rank(ref: LLM, tp: LLM) -> None:
    before = tp.compactions, tp.metrics.accepted_tokens
    assert [t for t, _ in run(tp, prompts(), greedy(False))] == [t for t, _ in run(ref, prompts(), greedy(False))]
    assert tp.metrics.accepted_tokens > before[1], "no draft token was accepted"
    assert tp.compactions > before[0], "no accepted branch needed KV compaction"


def test_seeded_sampling_matches_single_rank(ref: LLM, tp: LLM) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_new_tokens=24, n=2)
    want = [[c.token_ids for c in o.outputs] for o in ref.generate(prompts()[:3], sp, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in tp.generate(prompts()[:3], sp, use_tqdm=False)]
    assert got == want
    assert any(a != b for a, b in want), "two samples of a prompt should differ"


def test_draft_model_speculation_matches_single_rank(model: LlamaForCausalLM, tmp_path) -> None:
    """The draft model runs whole on rank 0; the target's verify steps run on both ranks."""
    path = save_hf_dir(model, tmp_path / "draft")
    words = {f"w{i}": i for i in range(model.config.vocab_size)}  # a loadable tokenizer of the same vocab
    tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0")).save(str(path / "tokenizer.json"))
    spec = dict(FEATURES, speculative=f"draft:{path}", speculative_tree_width=1)
    want = [t for t, _ in run(LLM((model, None), **spec), prompts()[:3], greedy(False, 16))]
    llm = LLM((model, None), tensor_parallel_size=2, **spec)
    try:
        assert [t for t, _ in run(llm, prompts()[:3], greedy(False, 16))] == want
        assert llm.metrics.accepted_tokens > 0
    finally:
        llm.close()
