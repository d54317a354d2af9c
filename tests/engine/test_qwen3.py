"""A Qwen3 GGUF (per-head query / key RMS norms before RoPE) through the engine, on the fused C++
decode layers (which normalize the heads as the torch layers do), batches and speculation included."""

from __future__ import annotations

from pathlib import Path

import pytest

from treeserve import LLM, SamplingParams
from treeserve.models import load
from treeserve.models.gguf_op import gguf_op_available
from treeserve.models.synthetic_gguf import SyntheticSpec, write_synthetic_gguf

from .test_speculative import repetitive_prompts

SPEC = SyntheticSpec("qwen3", 2, 128, 4, 2, 192, 320, True, False, 1_000_000.0, 256, key_length=64)


@pytest.mark.skipif(not gguf_op_available(), reason="needs the C++ GGUF operator")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_qwen3_gguf_decodes_batches_and_speculates_as_plain_decoding(tmp_path: Path, qtype: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The GGUF operator serves every row count (each row bit for bit the row alone): verify steps' rows would
    # otherwise cross this machine's measured crossover to the int8 path, whose rounding differs.
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    path = write_synthetic_gguf(tmp_path / "q3.gguf", SPEC, qtype, seed=5)
    model, _ = load(path, quantization="auto")
    plan = model.decode_plan()
    assert model.config.qk_norm and model.config.head_dim == 64 and plan is not None and len(plan.norms) == 4 * 2
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    prompts = repetitive_prompts(8, 3)
    plain = LLM((model, None), speculative=None).generate(prompts, params, use_tqdm=False)
    llm = LLM((model, None), speculative="draft:self:1", num_speculative_tokens=4, speculative_row_cost=0.0)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.metrics.verify_steps > 0 and all(len(o.outputs[0].token_ids) == 16 for o in plain)
