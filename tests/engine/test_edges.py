"""Issue 16 input edges below the engine: sampling batch, sample positions, radix keys, and the
page-size-64 admission estimate."""

from __future__ import annotations

import pytest
import torch

from treeserve.kvcache import PageAllocator, RadixCache
from treeserve.models import random_model, tiny_config
from treeserve.sampling import SamplingBatch, SamplingParams, sample

from .test_engine import assert_drained, make_llm


def test_sampling_batch_and_sample_edges() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        SamplingBatch.build([], [], [], 8)
    batch = SamplingBatch.build([SamplingParams()], [1], [[1]], 8, num_generated=[0])
    with pytest.raises(TypeError, match="positions must be an integer"):
        sample(torch.randn(1, 8), batch, torch.tensor([1.5]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        sample(torch.randn(1, 8), batch, torch.tensor([-3]))
    assert sample(torch.randn(1, 8), batch, torch.tensor([3])).tokens.shape == (1,)


@pytest.mark.parametrize("key", [[1.5, 2.0, 3.0], ["a", "b", "c"], [True, False, True]])
def test_match_prefix_refuses_non_integer_keys(key) -> None:
    radix = RadixCache(PageAllocator(10, 1))
    with pytest.raises(TypeError, match="int token ids"):
        radix.match_prefix(key)
    with pytest.raises(TypeError, match="int token ids"):
        radix.prefix_len(key)


def test_one_page_request_fits_at_page_size_64() -> None:
    model = random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0, init_std=0.3)
    llm = make_llm(model, page_size=64, kv_cache_tokens=64, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    (out,) = llm.generate([[4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], sp, use_tqdm=False)
    assert out.error is None and len(out.outputs[0].token_ids) == 20
    (two,) = llm.generate([[4, 5, 6]], SamplingParams(n=2, max_new_tokens=20), use_tqdm=False)
    assert two.error is not None and "n=2" in two.error  # two samples need two pages: refused
    assert_drained(llm)
