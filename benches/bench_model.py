"""SmolLM2-135M forward throughput: treeserve's paged model vs transformers eager, same weights.

Both models come from the embedded Q4_1 GGUF (ours via ``treeserve.models.load``, transformers
via its own GGUF loader), dequantized to the same dtype, run single-sequence in the same process
with the same torch thread count:
- prefill: 512 new tokens, logits for the last one only (transformers: ``logits_to_keep=1``);
- decode: one new token at context 512 (transformers: its KV cache cropped by one each round;
  ours: ``PagedSequence.truncate`` back to 511 tokens, page_size 1, shuffled pages).
Ratios (transformers time / ours) go to the printout and ``benchmark.extra_info``; the assertion
only guards against a gross regression (ours more than 2.5x slower: the fp32 prefill is bounded
by the torch paged-attention backend, see benches/RESULTS.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from _timing import min_seconds  # benches/ is on sys.path (no __init__.py)

from treeserve.models import load, resolve_model_path
from treeserve.runner import PagedSequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CTX = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_RATIO = 0.4


@pytest.fixture(scope="module", params=list(DTYPES))
def models(request):
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[request.param]
    path = resolve_model_path("smollm2-135m-instruct")
    ours = load("smollm2-135m-instruct", dtype=dtype).model
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = torch.randint(100, 40000, (CTX,), generator=torch.Generator().manual_seed(0))
    return request.param, ours, hf, ids


def _report(benchmark, label: str, ours_s: float, hf_s: float) -> None:
    ratio = hf_s / ours_s
    benchmark.extra_info.update(ours_ms=ours_s * 1e3, transformers_ms=hf_s * 1e3, speedup=ratio)
    print(f"\n{label} ({torch.get_num_threads()} threads): treeserve {ours_s * 1e3:.1f} ms, "
          f"transformers eager {hf_s * 1e3:.1f} ms -> {ratio:.2f}x")
    assert ratio > MIN_RATIO, f"{label}: ours is {1 / ratio:.2f}x slower than transformers"


def test_prefill_512(benchmark, models):
    name, ours, hf, ids = models
    seq = PagedSequence(ours, CTX, page_size=1, shuffle_seed=0)

    def run_ours() -> torch.Tensor:
        seq.truncate(0)
        return seq.extend(ids)

    @torch.inference_mode()
    def run_hf() -> torch.Tensor:
        return hf(ids[None], logits_to_keep=1).logits[0]

    torch.testing.assert_close(run_ours(), run_hf().float(), rtol=0.05, atol=0.05 * 30)
    benchmark.pedantic(run_ours, rounds=3, warmup_rounds=1)
    _report(benchmark, f"prefill {CTX} {name}", benchmark.stats.stats.min, min_seconds(run_hf, 3))


def test_decode_step_at_512(benchmark, models):
    from transformers import DynamicCache

    name, ours, hf, ids = models
    seq = PagedSequence(ours, CTX, page_size=1, shuffle_seed=0)
    seq.extend(ids[:-1])
    last = ids[-1:]

    def run_ours() -> torch.Tensor:
        seq.truncate(CTX - 1)
        return seq.extend(last)

    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(ids[None, :-1], cache=cache, use_cache=True, logits_to_keep=1)
    pos = torch.tensor([[CTX - 1]])

    @torch.inference_mode()
    def run_hf() -> torch.Tensor:
        logits = hf(last[None], cache=cache, position_ids=pos, use_cache=True).logits[0]
        cache.crop(-1)  # back to CTX - 1 cached tokens
        return logits

    torch.testing.assert_close(run_ours(), run_hf().float(), rtol=0.05, atol=0.05 * 30)
    benchmark.pedantic(run_ours, rounds=20, warmup_rounds=2)
    _report(benchmark, f"decode step @{CTX} {name}", benchmark.stats.stats.min, min_seconds(run_hf, 20))
