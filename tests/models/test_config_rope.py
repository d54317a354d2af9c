"""ModelConfig parsing/validation and RoPE tables against float64 and transformers references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treeserve.models import ModelConfig, tiny_config
from treeserve.models.rope import apply_rope, inv_frequencies, rope_table

ARCHS = st.sampled_from(["llama", "qwen2", "mistral"])


@given(
    arch=ARCHS,
    kv=st.integers(1, 4),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([8, 16, 64]),
    tie=st.booleans(),
    theta=st.floats(100.0, 1e7),
    eos=st.lists(st.integers(0, 255), max_size=3, unique=True),
)
def test_hf_round_trip(arch, kv, group, head_dim, tie, theta, eos):
    cfg = tiny_config(arch, num_kv_heads=kv, num_heads=kv * group, head_dim=head_dim,
                      tie_word_embeddings=tie, rope_theta=theta, eos_token_ids=tuple(eos))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_from_hf_formats():
    base = tiny_config("llama").to_hf()
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    # transformers 5.x nests rope_theta inside rope_parameters
    v5 = {k: v for k, v in base.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 5e5, **llama3}}
    cfg = ModelConfig.from_hf(v5)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == llama3
    # legacy "type" key, missing head_dim / num_key_value_heads, list eos
    legacy = {k: v for k, v in base.items() if k not in ("head_dim", "num_key_value_heads")}
    legacy |= {"rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [2, 3]}
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert cfg.head_dim == 64 // 4 and cfg.num_kv_heads == 4 and cfg.eos_token_ids == (2, 3)
    assert ModelConfig.from_hf({**base, "model_type": "qwen2"}).attention_bias


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architecture": "gpt2"}, "architecture must be one of"),
        ({"num_layers": 0}, "num_layers must be an int >= 1"),
        ({"num_heads": 3}, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"rope_theta": 0.0}, "rope_theta must be > 0"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be > 0"),
        ({"eos_token_ids": (256,)}, r"eos_token_ids must lie in \[0, 256\)"),
        ({"bos_token_id": -1}, r"bos_token_id must lie in \[0, 256\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling.rope_type must be one of"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor must be a number > 0"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"rope_scaling": {"rope_type": "freq_factors"}}, r"rope_scaling.factors must be \d+ numbers > 0"),
        ({"rope_scaling": {"rope_type": "freq_factors", "factors": [1.0]}}, "rope_scaling.factors must be"),
        ({"rope_scaling": {"rope_type": "freq_factors", "factors": [0.0] * 8}}, "rope_scaling.factors must be"),
        ({"rope_scaling": {"rope_type": "freq_factors", "factors": [float("inf")] * 8}}, "factors must be"),
        ({"rope_scaling": {"rope_type": "freq_factors", "factors": ["1"] * 8}}, "rope_scaling.factors must be"),
    ],
)
def test_config_rejects_bad_values(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("llama", **changes)


def test_from_hf_rejects_unknown_architecture_and_missing_keys():
    base = tiny_config("llama").to_hf()
    with pytest.raises(ValueError, match="model_type must be one of .*'gpt_neox'"):
        ModelConfig.from_hf({**base, "model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="missing required key 'intermediate_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"})


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
)
def test_inv_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config("llama", head_dim=32, rope_theta=50000.0, rope_scaling=scaling)
    params = {"rope_theta": 50000.0, "rope_type": "default", **(scaling or {})}
    hf_cfg = LlamaConfig(**{**cfg.to_hf(), "rope_parameters": params})
    if scaling is None:
        hf_cfg.head_dim = 32
        expected = 1.0 / (50000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(inv_frequencies(cfg), expected, rtol=0, atol=0)


@given(pos=st.integers(0, 511), head_dim=st.sampled_from([8, 32]))
def test_rope_rotation_matches_float64_reference(pos, head_dim):
    """The rotate-half rotation by the table equals the complex-number definition in float64."""
    cfg = tiny_config("llama", head_dim=head_dim)
    table = rope_table(cfg)
    x = torch.randn(1, 2, head_dim, generator=torch.Generator().manual_seed(pos), dtype=torch.float64)
    cos, sin = table[pos, 0].double()[None, None], table[pos, 1].double()[None, None]
    half = head_dim // 2
    z = torch.complex(x[..., :half], x[..., half:])
    angle = pos * inv_frequencies(cfg).double()
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, rtol=0, atol=1e-6 * (1 + pos))
    assert math.isclose(float(table[pos, 0, 0]), math.cos(pos), abs_tol=1e-5)


def test_sliding_window_caps_context():
    base = tiny_config("mistral").to_hf()
    assert ModelConfig.from_hf({**base, "sliding_window": 128}).max_position_embeddings == 128
    assert ModelConfig.from_hf({**base, "sliding_window": 4096}).max_position_embeddings == 512
    qwen = tiny_config("qwen2").to_hf() | {"sliding_window": 64}
    assert ModelConfig.from_hf(qwen).max_position_embeddings == 512  # window unused by default
    assert ModelConfig.from_hf(qwen | {"use_sliding_window": True}).max_position_embeddings == 64
