"""Tiny random Llama / Qwen2 / Qwen3 / Mistral / Phi-3 models: our paged forward vs transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models._helpers import paged_logits, rel_err
from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.models import load_hf_model, random_model, save_hf_dir, tiny_config

SEQ_LEN = 40
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
PHI3_ROPE = {
    "rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
    "long_factor": [1.5 + i for i in range(8)], "original_max_position_embeddings": 16,
}
CONFIGS = {
    # llama: llama3 RoPE scaling (with a short original context so it matters) + tied embeddings
    "llama": tiny_config("llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "qwen2": tiny_config("qwen2", rope_theta=1_000_000.0),
    # qwen3: per-head query / key RMS norms before RoPE, no QKV bias, tied embeddings
    "qwen3": tiny_config("qwen3", rope_theta=1_000_000.0, tie_word_embeddings=True),
    "mistral": tiny_config("mistral", num_kv_heads=1),
    # phi3: fused QKV / gate|up checkpoint tensors, longrope (a short original context: SEQ_LEN takes the
    # long factors in both, and the attention factor)
    "phi3": tiny_config("phi3", rope_scaling=PHI3_ROPE),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(our model loaded from a saved HF dir, token ids, transformers' logits for them)."""
    from transformers import AutoModelForCausalLM

    config = CONFIGS[request.param]
    path = save_hf_dir(random_model(config, seed=7, init_std=0.1), tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    return load_hf_model(path), ids.tolist(), ref


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "chunks",
    [[SEQ_LEN], [7, 16, 17], [8] + [1] * (SEQ_LEN - 8)],
    ids=["prefill", "chunked-prefill", "decode"],
)
def test_matches_transformers(case, chunks, page_size):
    model, ids, ref = case
    assert rel_err(paged_logits(model, ids, chunks, page_size), ref) <= 1e-4


@settings(max_examples=10)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 3, 16]), seed=st.integers(0, 1000))
def test_any_chunking_matches_transformers(case, data, page_size, seed):
    model, ids, ref = case
    cuts = data.draw(st.lists(st.integers(1, SEQ_LEN - 1), max_size=6, unique=True).map(sorted))
    bounds = [0, *cuts, SEQ_LEN]
    chunks = [b - a for a, b in zip(bounds, bounds[1:])]
    assert rel_err(paged_logits(model, ids, chunks, page_size, seed=seed), ref) <= 1e-4


def test_two_requests_in_one_batch(case):
    """Two sequences flattened into one forward: each gets exactly its own logits."""
    model, ids, ref = case
    cfg = model.config
    ps, a, b = 4, 24, SEQ_LEN  # request 0: first 24 tokens, request 1: all 40
    pool = KVPool(cfg.num_layers, 1 + (a + b) // ps, ps, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    pages = pool.allocator.alloc((a + b) // ps).flip(0)
    p0, p1 = pages[: a // ps], pages[a // ps :]
    slot = lambda p: (p[:, None] * ps + torch.arange(ps)).reshape(-1)  # noqa: E731
    meta = AttentionMetadata.build([a, b], [a, b], [p0.tolist(), p1.tolist()], ps)
    input_ids = torch.tensor(ids[:a] + ids)
    positions = torch.cat([torch.arange(a), torch.arange(b)])
    rows = torch.tensor([a - 1, a + b - 1, 0])
    with torch.inference_mode():
        out = model(input_ids, positions, pool, torch.cat([slot(p0), slot(p1)]), meta, rows)
    assert rel_err(out, ref[[a - 1, b - 1, 0]]) <= 1e-4


def test_sharded_transformers_checkpoint(case, tmp_path):
    """A checkpoint written by transformers (sharded, with an index) loads to the same logits."""
    from transformers import AutoModelForCausalLM

    model, ids, ref = case
    src = tmp_path / "src"
    save_hf_dir(model, src)
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    reloaded = load_hf_model(tmp_path / "sharded")
    assert rel_err(paged_logits(reloaded, ids, [SEQ_LEN], 16), ref) <= 1e-4


def test_forward_rejects_mismatched_shapes(case):
    model, ids, _ = case
    cfg = model.config
    pool = KVPool(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    meta = AttentionMetadata.build([3], [3], [[1]], 16)
    ids3, pos3 = torch.tensor(ids[:3]), torch.arange(3)
    with pytest.raises(ValueError, match="positions"):
        model(ids3, torch.arange(2), pool, torch.arange(16, 19), meta, torch.tensor([2]))
    with pytest.raises(ValueError, match="logits_indices"):
        model(ids3, pos3, pool, torch.arange(16, 19), meta, torch.tensor([[2]]))
    short = KVPool(cfg.num_layers + 1, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    with pytest.raises(ValueError, match="layers"):
        model(ids3, pos3, short, torch.arange(16, 19), meta, torch.tensor([2]))


def test_model_rejects_unsupported_dtype():
    from treeserve.models import LlamaForCausalLM

    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.bfloat16"):
        LlamaForCausalLM(tiny_config("llama"), dtype=torch.float16)
