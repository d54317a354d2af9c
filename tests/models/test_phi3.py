"""Phi-3: fused QKV / gate|up checkpoint tensors, longrope's short and long factors, the sliding-window cap,
its end-of-turn token, from HF directories and GGUF files (as llama.cpp's converter writes them)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.models._helpers import paged_logits, rel_err, write_gguf
from treeserve import LLM, SamplingParams
from treeserve.models import (
    ModelConfig,
    load,
    load_gguf_model,
    load_hf_model,
    open_gguf,
    random_model,
    save_hf_dir,
    tiny_config,
)
from treeserve.models.gguf_loader import gguf_config
from treeserve.models.gguf_op import gguf_op_available
from treeserve.models.parallel import check_tensor_parallel
from treeserve.models.rope import inv_frequencies, longrope_scale

SHORT = [1.0 + i / 8 for i in range(8)]
LONG = [1.5 + i for i in range(8)]
ROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32}
IDS = list(range(3, 27))  # 24 tokens: within the original context


@pytest.fixture(scope="module")
def phi3():
    return random_model(tiny_config("phi3", vocab_size=64, rope_scaling=ROPE), seed=3, init_std=0.1)


def test_longrope_takes_the_short_factors_for_a_context_within_the_original(phi3, tmp_path):
    """transformers rotates a sequence no longer than the original context with the short factors: so does
    a model fitted to such a context (the engine's default 4096 for Phi-3.5's 128k), and not one fitted to
    the full 512 positions (the long factors, as llama.cpp takes them for a context past the original)."""
    from transformers import AutoModelForCausalLM

    path = save_hf_dir(phi3, tmp_path / "hf")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    ours = load_hf_model(path)
    assert ours.config == phi3.config
    assert rel_err(paged_logits(ours, IDS, [10, 14], 4), ref) > 1e-3  # fitted to 512 positions: long factors
    ours.fit_context(32)
    assert rel_err(paged_logits(ours, IDS, [10, 14], 4), ref) <= 1e-4
    torch.testing.assert_close(inv_frequencies(ours.config, 32), inv_frequencies(ours.config) * torch.tensor(LONG)
                               / torch.tensor(SHORT), rtol=1e-6, atol=0)
    assert longrope_scale(ours.config) == pytest.approx(np.sqrt(1 + np.log(512 / 32) / np.log(32)))


def _write_phi3_gguf(model, path, qtype=GGMLQuantizationType.F32, **kv):  # type: ignore[no-untyped-def]
    extra = {f"rope_factors_{k}.weight": np.array(f, dtype=np.float32) for k, f in (("short", SHORT), ("long", LONG))}
    return write_gguf(model, path, qtype=qtype, extra=extra,
                      extra_kv={"phi3.rope.scaling.original_context_length": 32, **kv})


def test_a_phi3_gguf_loads_its_fused_tensors_and_longrope_exactly(phi3, tmp_path):
    g = open_gguf(_write_phi3_gguf(phi3, tmp_path / "m.gguf"))
    assert "blk.0.attn_qkv.weight" in g.tensors and "blk.0.attn_q.weight" not in g.tensors
    loaded = load_gguf_model(g)
    assert loaded.config.replace(rms_norm_eps=phi3.config.rms_norm_eps) == phi3.config
    for (name, a), b in zip(phi3.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    # llama.cpp's converter writes the attention factor: it is taken as written
    factor = {"phi3.rope.scaling.attn_factor": 1.25}
    written = gguf_config(open_gguf(_write_phi3_gguf(phi3, tmp_path / "f.gguf", **factor)))
    assert written.rope_scaling["attention_factor"] == 1.25 and longrope_scale(written) == 1.25


def test_a_phi3_gguf_matches_transformers_gguf_loader(phi3, tmp_path):
    """transformers' own GGUF reader (its phi3 tensor names, dequantization) agrees with ours."""
    from transformers import AutoModelForCausalLM

    plain = random_model(tiny_config("phi3", vocab_size=64), seed=4, init_std=0.1)
    # a padding id in the vocabulary: transformers' Phi3Config defaults to 32000
    pad = {"tokenizer.ggml.padding_token_id": 0}
    write_gguf(plain, tmp_path / "q.gguf", qtype=GGMLQuantizationType.Q8_0, extra_kv=pad)
    ours = load_gguf_model(open_gguf(tmp_path / "q.gguf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert rel_err(paged_logits(ours, IDS, [10, 14], 16), ref) <= 1e-4


def test_sliding_window_caps_the_context_and_end_of_turn_tokens_stop(phi3, tmp_path):
    g = open_gguf(_write_phi3_gguf(phi3, tmp_path / "w.gguf", **{"phi3.attention.sliding_window": 100}))
    assert gguf_config(g).max_position_embeddings == 100
    hf = {**phi3.config.to_hf(), "sliding_window": 100}
    assert ModelConfig.from_hf(hf).max_position_embeddings == 100
    tokens = list(g.metadata["tokenizer.ggml.tokens"])
    tokens[40], tokens[41] = "<|end|>", "<|endoftext|>"
    config = gguf_config(g._replace(metadata={**g.metadata, "tokenizer.ggml.tokens": tokens}))
    assert set(config.eos_token_ids) == {phi3.config.eos_token_ids[0], 40, 41}
    assert 40 not in gguf_config(g).eos_token_ids


def test_bad_phi3_input_is_refused_by_name(phi3, tmp_path):
    g = open_gguf(_write_phi3_gguf(phi3, tmp_path / "m.gguf"))
    with pytest.raises(ValueError, match=r"rope_factors_long.weight must be 8 F32 factors .* got missing"):
        gguf_config(g._replace(tensors={k: t for k, t in g.tensors.items() if k != "rope_factors_long.weight"}))
    with pytest.raises(ValueError, match="phi3.rope.scaling.original_context_length"):
        gguf_config(g._replace(metadata={k: v for k, v in g.metadata.items() if "original_context" not in k}))
    with pytest.raises(ValueError, match=r"rope_factors_long.weight must be 8 F32"):
        gguf_config(g._replace(tensors={**g.tensors, "rope_factors_long.weight": g.tensors["blk.0.attn_norm.weight"]}))
    with pytest.raises(ValueError, match="attention_bias must be False for phi3"):
        tiny_config("phi3", attention_bias=True)
    with pytest.raises(ValueError, match=r"rope_scaling.long_factor must be 8 numbers > 0"):
        tiny_config("phi3", rope_scaling={**ROPE, "long_factor": LONG[:3]})
    for bad in (0, 1, True, 2.5, None):
        with pytest.raises(ValueError, match="rope_scaling.original_max_position_embeddings must be an int >= 2"):
            tiny_config("phi3", rope_scaling={**ROPE, "original_max_position_embeddings": bad})
    with pytest.raises(ValueError, match="rope_scaling.factor must be a number > 0 for longrope, got 'x'"):
        tiny_config("phi3", rope_scaling={**ROPE, "factor": "x"})
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be 1.0 .* got 0.75"):
        ModelConfig.from_hf({**phi3.config.to_hf(), "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match=r"rope.dimension_count must be head_dim \(16: RoPE on whole heads\), got 12"):
        gguf_config(g._replace(metadata={**g.metadata, "phi3.rope.dimension_count": 12}))
    with pytest.raises(ValueError, match=r"context must be an int in \[1, 512\], got 513"):
        phi3.fit_context(513)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, got 2"):
        check_tensor_parallel(phi3.config, 2)


@pytest.mark.skipif(not gguf_op_available(), reason="needs the C++ GGUF operator")
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
def test_a_phi3_gguf_serves_batches_as_single_requests_on_the_fused_layers(phi3, tmp_path, qtype, monkeypatch):
    """Through the engine from the file's codes (the fused C++ decode layers, zero-copy fused tensors): a
    batch decodes exactly as each request alone (the GGUF operator serving every row count, whose rows are
    each the row alone; the crossovers to the int8 path are this machine's), its logits the file's
    dequantized weights'; the engine fits longrope to its context (256 > the original 32: long factors)."""
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    config = phi3.config.replace(intermediate_size=64)
    model = random_model(config, seed=5, init_std=0.1)
    path = _write_phi3_gguf(model, tmp_path / "q.gguf", qtype=qtype)
    packed, _ = load(path, quantization="auto")
    assert packed.decode_plan() is not None
    llm = LLM((packed, None), speculative=None, max_model_len=256)
    cos = torch.cos(5 * inv_frequencies(config, 256)) * longrope_scale(config)
    torch.testing.assert_close(packed.rope_cache[5, 0, :], cos)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    prompts = [[3 + i, 9, 17 + 2 * i, 30] for i in range(6)]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batch == alone and all(len(t) == 12 for t in batch)
    dense, _ = load(path, quantization=None)  # the file's weights dequantized: the packed layers' reference
    dense.fit_context(256)
    assert rel_err(paged_logits(packed, IDS, [len(IDS)], 4), paged_logits(dense, IDS, [len(IDS)], 4)) < 1e-4


def test_phi3_5_mini_config_json_as_published():
    """Phi-3.5-mini-instruct's config.json as published (longrope named "su" in older copies, its original
    context at the top level, 48 factors each, a 262144-token window past the context)."""
    short, long = [1.0 + i / 64 for i in range(48)], [1.1 + i for i in range(48)]
    for name in ("longrope", "su"):
        cfg = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
               "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 131072,
               "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
               "rope_scaling": {"type": name, "short_factor": short, "long_factor": long},
               "sliding_window": 262144, "tie_word_embeddings": False, "bos_token_id": 1,
               "eos_token_id": 32000, "pad_token_id": 32000}
        config = ModelConfig.from_hf(cfg)
        assert config.head_dim == 96 and config.max_position_embeddings == 131072
        assert config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["original_max_position_embeddings"] == 4096
        assert longrope_scale(config) == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
        assert ModelConfig.from_hf(config.to_hf()) == config
        torch.testing.assert_close(inv_frequencies(config, 4096),  # transformers' order: 1 / (factor theta^x)
                                   1.0 / (torch.tensor(short) * 10000.0 ** (torch.arange(0, 96, 2).float() / 96)),
                                   rtol=0, atol=0)
    mini_4k = {**cfg, "max_position_embeddings": 4096, "rope_scaling": None, "sliding_window": 2047}
    assert ModelConfig.from_hf(mini_4k).max_position_embeddings == 2047


def test_fit_context_updates_the_shared_table_in_place(phi3):
    """A drafter sharing the table (``layer_subset``) sees the engine's factor set."""
    from treeserve.models import layer_subset

    draft = layer_subset(phi3, [0])
    phi3.fit_context(32)
    assert draft.rope_cache.data_ptr() == phi3.rope_cache.data_ptr()
    scale = longrope_scale(phi3.config)  # either set: transformers scales cos / sin by the attention factor
    torch.testing.assert_close(draft.rope_cache[3, 0], torch.cos(3 * inv_frequencies(phi3.config, 32)) * scale)
    phi3.fit_context(512)  # the fixture's table again
    torch.testing.assert_close(draft.rope_cache[3, 0], torch.cos(3 * inv_frequencies(phi3.config, 512)) * scale)
