"""End-to-end engine tests on a tiny random model (init_std 0.3: peaked logits, no near-ties)."""

from __future__ import annotations

import random

import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.models import random_model, tiny_config

VOCAB = 256


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0, init_std=0.3)


def make_llm(model, **kw) -> LLM:
    cfg = dict(dtype="float32", kv_cache_tokens=4096, max_batched_tokens=64, max_running=16, max_model_len=256)
    cfg.update(kw)
    return LLM((model, None), **cfg)


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    return [
        (shared[: rng.randint(0, 24)] if rng.random() < 0.7 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        for _ in range(n)
    ]


def alone_outputs(model, prompts, params_list) -> list[list[int]]:
    outs = []
    for p, sp in zip(prompts, params_list):
        llm = make_llm(model, enable_prefix_cache=False, max_batched_tokens=256)
        (res,) = llm.generate([p], sp, use_tqdm=False)
        outs.append(res.outputs[0].token_ids)
    return outs


def assert_drained(llm: LLM) -> None:
    alloc = llm.kv.allocator
    assert llm.radix.protected_tokens == 0
    assert alloc.num_free + llm.radix.evictable_tokens // llm.kv.page_size == alloc.capacity
    llm.scheduler.check_invariants()


@pytest.mark.parametrize(
    "kw",
    [
        dict(page_size=1),
        dict(page_size=16, kv_cache_tokens=4096),
        dict(page_size=1, kv_cache_tokens=160, max_running=8),  # forces preemption
        dict(page_size=4, kv_cache_tokens=200, max_batched_tokens=16),
    ],
)
def test_greedy_batched_equals_alone(tiny, kw) -> None:
    prompts = prompts_for(1, 12)
    rng = random.Random(2)
    params = [SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    expected = alone_outputs(tiny, prompts, params)
    llm = make_llm(tiny, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_drained(llm)
    if kw.get("kv_cache_tokens") == 160:
        assert llm.metrics.preemptions > 0


def test_seeded_sampling_is_batch_invariant(tiny) -> None:
    prompt = [5, 9, 33, 41, 7]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=16, ignore_eos=True)
    alone = make_llm(tiny).generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts_for(3, 63)
    batch = [prompt] + others
    params = [sp] + [SamplingParams(temperature=0.8, max_new_tokens=12, seed=i) for i in range(63)]
    crowded = make_llm(tiny, max_running=64).generate(batch, params, use_tqdm=False)[0].outputs[0].token_ids
    tight = make_llm(tiny, kv_cache_tokens=120, max_running=8)
    paused = tight.generate(batch[:12], params[:12], use_tqdm=False)[0].outputs[0].token_ids
    assert tight.metrics.preemptions > 0
    assert alone == crowded == paused


def test_parallel_sampling_n(tiny) -> None:
    llm = make_llm(tiny)
    prompt = list(range(10, 50))
    (out,) = llm.generate([prompt], SamplingParams(temperature=1.0, n=4, seed=7, max_new_tokens=8), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
    assert out.metrics["cached_prompt_tokens"] == 0
    assert_drained(llm)


def test_bad_requests_fail_alone(tiny) -> None:
    llm = make_llm(tiny, kv_cache_tokens=512)
    good = [3, 4, 5]
    prompts = [good, [], [3] * 300, [3, VOCAB + 5], good, good, good]
    params = [
        SamplingParams(max_new_tokens=4, temperature=0.0),
        None,
        None,
        None,
        {"temperature": -1.0},
        SamplingParams(n=100, max_new_tokens=200),
        SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias={VOCAB + 1: 1.0}),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    expected_errors = ["at least 1 token", "max_model_len", "token ids must be in", "temperature", "n=100", "logit_bias"]
    for out, needle in zip(outs[1:], expected_errors):
        assert out.error is not None and needle in out.error, (needle, out.error)
        assert out.outputs == []
    assert llm.metrics.num_errors == 6
    assert_drained(llm)


def test_stream_rejects_bad_input(tiny) -> None:
    llm = make_llm(tiny)
    with pytest.raises(ValueError, match="need a tokenizer"):
        list(llm.stream("hello"))
    with pytest.raises(ValueError, match="at least 1 token"):
        list(llm.stream([]))


class PoisonedModel(torch.nn.Module):
    """Wraps a model; a row whose last input token is ``POISON`` gets NaN logits."""

    POISON = 13

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, positions, kv, out_slots, meta, logits_indices):
        logits = self.inner(input_ids, positions, kv, out_slots, meta, logits_indices)
        bad = input_ids[logits_indices] == self.POISON
        return logits.masked_fill(bad[:, None], float("nan"))


def test_invalid_logits_fail_only_their_request(tiny) -> None:
    llm = make_llm(PoisonedModel(tiny))
    prompts = [[4, 5, 6], [4, 5, PoisonedModel.POISON], [7, 8]]
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].error is not None and "invalid logits" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    for i in (0, 2):
        assert outs[i].error is None and len(outs[i].outputs[0].token_ids) == 5
    assert_drained(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_16_bit_kv_cache_under_a_float32_model(tiny, kv_cache_dtype: str) -> None:
    """``kv_cache_dtype="bfloat16"`` / ``"float16"``: the pool holds that dtype, greedy output is the
    same batched (with prefix sharing) as alone, every page comes back; ``"auto"`` keeps a given
    model's dtype; a bad value is named."""
    assert make_llm(tiny).kv.dtype == torch.float32
    prompts = prompts_for(7, 6)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    llm = make_llm(tiny, kv_cache_dtype=kv_cache_dtype)
    assert llm.kv.dtype == getattr(torch, kv_cache_dtype) and next(llm.model.parameters()).dtype == torch.float32
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [make_llm(tiny, kv_cache_dtype=kv_cache_dtype, enable_prefix_cache=False)
             .generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]  # fmt: skip
    assert batched == alone and all(len(t) == 12 for t in batched)
    assert_drained(llm)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got 'h"):
        make_llm(tiny, kv_cache_dtype="half")
    from treeserve.engine import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'.*tensor_parallel_size > 1"):
        EngineConfig(kv_cache_dtype="bfloat16", tensor_parallel_size=2)


def test_kv_cache_dtype_auto_rule(monkeypatch) -> None:
    """``"auto"``: a 16-bit cache only for the default float32 CPU configuration of a model loaded by
    name: bf16 on an AVX-512 BF16 CPU, float16 on another AVX2 CPU; the model's dtype otherwise
    (no AVX2: float32); an explicit value always wins."""
    from types import SimpleNamespace

    import treeserve.engine as engine
    from treeserve.engine import EngineConfig

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for has_bf16, has_avx2 in ((True, True), (False, True), (False, False)):
        features = SimpleNamespace(avx512_bf16=has_bf16, avx2=has_avx2)
        monkeypatch.setattr(engine, "cpu_features", lambda f=features: f)
        want = bf16 if has_bf16 else (f16 if has_avx2 else f32)
        assert EngineConfig().kv_dtype(f32, loaded=True) == want
        assert EngineConfig().kv_dtype(f32, loaded=False) == f32  # a given model
        assert EngineConfig(dtype="float32").kv_dtype(f32, loaded=True) == f32  # the parity configuration
        assert EngineConfig(quantization=None).kv_dtype(f32, loaded=True) == f32
        assert EngineConfig(batch_invariant=True).kv_dtype(f32, loaded=True) == f32
        assert EngineConfig().kv_dtype(bf16, loaded=True) == bf16
        assert EngineConfig(kv_cache_dtype="bfloat16").kv_dtype(f32, loaded=False) == bf16
        assert EngineConfig(kv_cache_dtype="float32").kv_dtype(bf16, loaded=True) == f32
        assert EngineConfig(kv_cache_dtype="float16").kv_dtype(f32, loaded=False) == f16


def test_speculative_max_batch_rule(tiny) -> None:
    """``None``: the measured CPU limit for a model loaded by name, no limit for a given module;
    an explicit value always wins and reaches the scheduler; bad values are named."""
    from treeserve.engine import CPU_SPECULATIVE_MAX_BATCH, EngineConfig

    assert EngineConfig().draft_batch_limit(loaded=True) == CPU_SPECULATIVE_MAX_BATCH
    assert EngineConfig().draft_batch_limit(loaded=False) == 0
    assert EngineConfig(speculative_max_batch=3).draft_batch_limit(loaded=False) == 3
    assert make_llm(tiny, speculative="ngram", speculative_max_batch=5).scheduler.config.speculative_max_batch == 5
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="speculative_max_batch must be None or an int >= 0"):
            EngineConfig(speculative_max_batch=bad)
