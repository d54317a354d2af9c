"""World size 3 on the embedded SmolLM2-135M (9 query / 3 KV heads, GGUF Q4_1): every rank
dequantizes only its rows of QKV, gate|up and the vocabulary. Greedy tokens equal world size 1.

Logits: 30 layers of float32 sums re-associated by the all-reduces move them by a few 1e-5 at
magnitudes near 40, so they are compared within 1e-5 of the logit scale (relative), while the
synthetic model's test holds them within 1e-5 absolute.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.runner import PagedSequence

pytestmark = pytest.mark.slow  # three ranks each load the GGUF: ~1 min on 2 shared cores

MODEL = "smollm2-135m-instruct"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLM, LLM]]:
    ref = LLM(MODEL, dtype="float32", max_batched_tokens=64)
    tp = LLM(MODEL, dtype="float32", max_batched_tokens=64, tensor_parallel_size=3)
    yield ref, tp
    tp.close()


def test_three_ranks_split_the_heads(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    assert (ref.model.config.num_heads, ref.model.config.num_kv_heads) == (9, 3)
    assert tp.kv.num_kv_heads == 1 and tp.model.world_size == 3


def test_greedy_tokens_match_single_rank(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    prompts = [ref.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in CHATS]
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, sp, use_tqdm=False)] == want


def test_prefill_logits_match_single_rank(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True))
    a = PagedSequence(ref.model, 64).extend(ids, all_logits=True)
    b = PagedSequence(tp.model, 64).extend(ids, all_logits=True)
    scale = float(a.abs().max())
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * scale)
