"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF): our loader + paged forward vs transformers."""

from __future__ import annotations

import pytest
import torch

from tests.models._helpers import paged_logits, rel_err
from treeserve.models import load

TEXT = (
    "Paged attention keeps each request's keys and values in fixed-size pages, so memory is "
    "allocated on demand and prefixes can be shared between requests."
)


@pytest.fixture(scope="module")
def ids(smol):
    return smol.tokenizer.encode(TEXT)[:16]


@pytest.fixture(scope="module")
def ref(hf_smol, ids):
    with torch.no_grad():
        return hf_smol(torch.tensor([ids])).logits[0]


def test_config_matches_transformers(smol, hf_smol):
    ours, theirs = smol.model.config, hf_smol.config
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.num_kv_heads) == (
        theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads
    )
    assert (ours.intermediate_size, ours.vocab_size, ours.max_position_embeddings) == (
        theirs.intermediate_size, theirs.vocab_size, theirs.max_position_embeddings
    )
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings and ours.eos_token_ids == (theirs.eos_token_id,)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunks", [[16], [3, 7, 6], [12] + [1] * 4], ids=["prefill", "chunked", "decode"])
def test_logits_match_transformers(smol, ids, ref, chunks, page_size):
    assert rel_err(paged_logits(smol.model, ids, chunks, page_size), ref) <= 1e-4


def test_weights_match_transformers_dequantization(smol, hf_smol):
    """Spot-check dequantized + un-permuted weights against transformers' own GGUF conversion."""
    ours = smol.model
    theirs = hf_smol.model
    q, kv = ours.config.q_size, ours.config.kv_size
    for layer in (0, 17, 29):
        qkv = ours.layers[layer].self_attn.qkv_proj.weight
        attn = theirs.layers[layer].self_attn
        torch.testing.assert_close(qkv[:q], attn.q_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(qkv[q : q + kv], attn.k_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(qkv[q + kv :], attn.v_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.embed_tokens.weight, theirs.embed_tokens.weight, rtol=0, atol=0)
    assert ours.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.slow
def test_bf16_top1_agrees_with_fp32(smol):
    """Teacher-forced next-token argmax of the bf16 model agrees with fp32 on >= 98% of positions."""
    text = " ".join([
        TEXT,
        "The scheduler batches prefill chunks and decode steps together.",
        "Speculative decoding drafts several tokens and verifies them in one forward pass.",
        "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
        "In the morning, the town market opens early: farmers sell apples, bread and fresh milk,",
        "and children walk to school along the river before the bells ring at eight o'clock.",
    ])
    ids = smol.tokenizer.encode(text)
    bf16 = load("smollm2-135m-instruct", dtype=torch.bfloat16).model
    assert bf16.dtype == torch.bfloat16 and bf16.lm_head.weight.dtype == torch.float32
    fp32_top = paged_logits(smol.model, ids, [len(ids)], 16).argmax(-1)
    bf16_logits = paged_logits(bf16, ids, [len(ids)], 16)
    assert bf16_logits.dtype == torch.float32
    agreement = (bf16_logits.argmax(-1) == fp32_top).float().mean().item()
    assert len(ids) >= 100 and agreement >= 0.98, (len(ids), agreement)
