"""Synthetic GGUF files of real architectures, and loading projections from a file's codes alone."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tests.models._helpers import rel_err
from treeserve.models import load
from treeserve.models.gguf_loader import gguf_config, open_gguf
from treeserve.models.gguf_op import gguf_op_available
from treeserve.models.quant import PACKABLE, PackedLinear
from treeserve.models.synthetic_gguf import SPECS, SyntheticSpec, synthetic_tensor_shapes, write_synthetic_gguf
from treeserve.runner import PagedSequence

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]
TINY = {
    "llama": SyntheticSpec("llama", 2, 128, 4, 2, 192, 320, False, False, 500000.0, 256),
    "qwen2": SyntheticSpec("qwen2", 2, 128, 4, 2, 192, 320, True, True, 1000000.0, 256),
    "phi3": SyntheticSpec("phi3", 2, 128, 4, 4, 192, 320, False, False, 10000.0, 256),  # fused QKV, gate|up
}
needs_op = pytest.mark.skipif(not gguf_op_available(), reason="the C++ GGUF operator is not built here")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", sorted(TINY))
def test_the_file_states_the_spec_and_seeded_codes(tmp_path: Path, arch: str, qtype: str) -> None:
    spec = TINY[arch]
    path = write_synthetic_gguf(tmp_path / "a.gguf", spec, qtype, seed=3)
    cfg = gguf_config(open_gguf(path))
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.attention_bias,
            cfg.rope_theta, cfg.max_position_embeddings) == (
        spec.architecture, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
        spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings, spec.attention_bias,
        spec.rope_theta, spec.context_length)
    reader = GGUFReader(path)  # gguf's own reader, not ours
    shapes = synthetic_tensor_shapes(spec)
    assert [t.name for t in reader.tensors] == list(shapes)
    for t in reader.tensors:
        if len(shapes[t.name]) == 2:
            assert t.tensor_type == GGMLQuantizationType[qtype]
            w = dequantize(t.data, t.tensor_type).reshape(shapes[t.name])
            assert np.isfinite(w).all() and 0.01 < w.std() < 0.04, (t.name, w.std())
        else:
            assert t.tensor_type == GGMLQuantizationType.F32
    again = write_synthetic_gguf(tmp_path / "b.gguf", spec, qtype, seed=3)
    other = write_synthetic_gguf(tmp_path / "c.gguf", spec, qtype, seed=4)
    assert path.read_bytes() == again.read_bytes() != other.read_bytes()


def test_real_specs_and_bad_arguments(tmp_path: Path) -> None:
    assert SPECS["llama-3-8b"].head_dim == 128 and SPECS["llama-3.2-1b"].head_dim == 64
    params = {name: sum(int(np.prod(s)) for s in synthetic_tensor_shapes(spec).values()) for name, spec in SPECS.items()}
    assert 8.0e9 < params["llama-3-8b"] < 8.1e9 and 1.2e9 < params["llama-3.2-1b"] < 1.3e9
    assert 1.5e9 < params["qwen2.5-1.5b"] < 1.6e9
    assert 0.59e9 < params["qwen3-0.6b"] < 0.61e9 and SPECS["qwen3-0.6b"].head_dim == 128  # Qwen3-0.6B: 0.6B, tied
    assert 3.8e9 < params["phi-3-mini"] < 3.83e9 and SPECS["phi-3-mini"].head_dim == 96  # Phi-3-mini: 3.82B
    with pytest.raises(ValueError, match="spec must be one of"):
        write_synthetic_gguf(tmp_path / "x.gguf", "llama-9")
    with pytest.raises(ValueError, match="qtype must be one of"):
        write_synthetic_gguf(tmp_path / "x.gguf", TINY["llama"], "IQ2_XS")
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 2\]"):
        write_synthetic_gguf(tmp_path / "x.gguf", TINY["llama"], num_layers=3)


def _projections(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(f"{i}.{sub}", layer.get_submodule(sub)) for i, layer in enumerate(model.layers) for sub in PACKABLE]


@needs_op
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", sorted(TINY))
def test_projections_load_from_the_codes_alone(tmp_path: Path, arch: str, qtype: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY[arch], qtype, seed=1)
    dense, _ = load(path, quantization=None)
    packed, _ = load(path, quantization="auto")
    for name, m in _projections(packed):
        assert isinstance(m, PackedLinear), name
        ref = dict(_projections(dense))[name].weight
        assert torch.equal(m.dequantized(), ref), name  # the file's codes, rows unpermuted
        m.prepare_large()  # where the load deferred them (a warm measurement cache: test_warm_start)
        # a dense copy only where large batches need it (neither int8 copies nor the codes serve them),
        # and some path for them
        assert not m.has_dense or (m.int8 is None and not m.large_q8), name
        assert m.has_dense or m.int8 is not None or m.large_q8 or m.packed_max_rows >= 2**40, name
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    lean, _ = load(path, quantization="auto")
    for name, m in _projections(lean):
        assert not m.has_dense and m.int8 is None and m.packed_max_rows >= 2**40, name
    with pytest.raises(RuntimeError, match="dense_weight"):
        lean.layers[0].mlp.down_proj.large_forward(torch.ones(2, TINY[arch].intermediate_size))
    ids = list(range(260, 300))
    with torch.inference_mode():
        ref = PagedSequence(dense, 64, page_size=1).extend(ids, all_logits=True)
        got = PagedSequence(lean, 64, page_size=1).extend(ids, all_logits=True)
    assert rel_err(got, ref) < 1e-3  # activations rounded to int16 per block (gguf_op)


_MEMORY_PROBE = """
import json, sys, time
from pathlib import Path
import torch
from treeserve.models import load
from treeserve.runner import PagedSequence

def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

t = time.perf_counter()
model, tok = load(sys.argv[1], quantization="auto")
load_s = time.perf_counter() - t
rss = status("VmRSS")
with torch.inference_mode():
    seq = PagedSequence(model, 64, page_size=1)
    logits = seq.extend(list(range(300, 316)))
    tokens = []
    for _ in range(4):
        tokens.append(int(logits[-1].argmax()))
        logits = seq.extend(tokens[-1:])
print(json.dumps({"load_s": load_s, "rss": rss, "peak": status("VmHWM"), "tokens": tokens,
                  "finite": bool(torch.isfinite(logits).all())}))
"""


@needs_op
@pytest.mark.slow
@pytest.mark.parametrize(("qtype", "codes_per_file_byte"), [("Q4_0", 1.0), ("Q4_K_M", 1.25)])
def test_a_1b_model_loads_near_its_file_size(tmp_path: Path, qtype: str, codes_per_file_byte: float) -> None:
    """Llama-3.2-1B shapes in Q4_0 (0.7 GB), packed path for every batch: resident memory after the
    load is the file's codes (the tied embedding / head read as codes in
    place, ``vocab_codes``; q|k|v and gate|up copied once, fused) plus the runtime, and the peak
    over the load and four decode steps adds only the file pages those steps read (no dense copy of
    the model or of the head on the way). In llama.cpp's Q4_K_M mixture the codes are converted at
    load (``gguf_convert``: Q4_K as Q4_1, Q6_K and mixed q|k|v groups as Q8_0), ~1.2x the file's
    bytes, and the file's pages leave the resident set as each tensor is converted."""
    spec = SPECS["llama-3.2-1b"]
    path = write_synthetic_gguf(tmp_path / "1b.gguf", spec, qtype, seed=0)
    env = {"TREESERVE_PACKED_MAX_ROWS": "all", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(path)], capture_output=True, text=True,
                          env={**__import__("os").environ, **env}, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    file_bytes = path.stat().st_size
    # torch, the C++ operators, the RoPE table, the tokenizer: ~600 MB measured on the AVX2 EPYC;
    # the float32 head alone would add 1.05 GB, a dense copy of the projections 3.9 GB
    runtime = 700 * 2**20
    assert r["finite"] and len(r["tokens"]) == 4
    assert r["rss"] < codes_per_file_byte * file_bytes + runtime, r
    # the decode steps read the o/down and head codes' pages (0.34 GB); a float32 head would be 1.05 GB more
    assert r["peak"] < r["rss"] + 512 * 2**20, r


def test_the_phi3_file_has_phi3s_vocabulary_layout(tmp_path: Path) -> None:
    """Phi-3-mini's synthetic file: a SentencePiece vocabulary with Phi-3's added tokens at 32000-32010 (what
    llama.cpp needs to load a phi3 file); <|end|> ends a turn beside the file's EOS."""
    from treeserve.models.tokenizer import Tokenizer

    g = open_gguf(write_synthetic_gguf(tmp_path / "phi3.gguf", "phi-3-mini", "Q4_0", num_layers=1))
    tokens = g.metadata["tokenizer.ggml.tokens"]
    assert g.metadata["tokenizer.ggml.model"] == "llama" and len(tokens) == 32064
    assert (tokens[32000], tokens[32007], tokens[259]) == ("<|endoftext|>", "<|end|>", "\u2581t259")
    config = gguf_config(g)
    assert config.eos_token_ids == (32000, 32007) and config.head_dim == 96 and config.max_position_embeddings == 4096
    tok = Tokenizer.from_gguf_metadata(g.metadata, extra_eos_token_ids=config.eos_token_ids)
    assert tok.eos_token_ids == (32000, 32007) and tok.decode([300, 301]) == "t300 t301"
    assert "blk.0.attn_qkv.weight" in g.tensors and "blk.0.ffn_gate.weight" not in g.tensors
