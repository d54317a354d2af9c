"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed), without spills
in the hot kernels and within sm_80's shared memory; the table goes to the test output.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (``tests/_triton_aot.py``); results
are cached per (Triton version, kernel module source, signature, target) in the user's cache, so
only a changed kernel is recompiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _triton_aot as aot

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def aot_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests._triton_aot", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=2400)
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc, data


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90(aot_run, capsys: pytest.CaptureFixture[str]) -> None:
    proc, data = aot_run
    with capsys.disabled():
        print("\n" + proc.stdout)
    assert "self-test" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = data["results"]
    assert {r["target"] for r in results} == set(aot.TARGETS)
    assert all(not r["error"] and r["registers"] > 0 for r in results)


@pytest.mark.slow
def test_every_jit_function_is_launched_or_called(aot_run) -> None:
    """No kernel escapes the check: each ``@triton.jit`` function of the kernel modules is either
    launched by a case or called from one (and so compiled inside it)."""
    _, data = aot_run
    launched = {x["kernel"] for x in data["launches"]}
    sources = "\n".join((ROOT / (m.replace(".", "/") + ".py")).read_text() for m in aot.KERNEL_MODULES)
    for name in set(data["kernels"]) - launched:
        assert re.search(rf"\b{name}\(", sources.replace(f"def {name}(", "")), f"{name} is never compiled"
    assert {"_paged_attn_kernel", "_merge_splits_kernel", "_threshold_kernel", "_walk_kernel",
            "_copy_kv_rows_kernel"} <= launched


def test_judge_fails_spills_in_hot_kernels_and_shared_memory_over_sm80() -> None:
    ok = aot.Compiled("_paged_attn_kernel", "c", 90, registers=128, spill_stores=0, spill_loads=0, shared=1024)
    assert aot.judge(ok) == []
    spill = aot.Compiled("_walk_kernel", "c", 80, registers=255, spill_stores=8, spill_loads=8, shared=0)
    assert "spills" in aot.judge(spill)[0]
    cold = aot.Compiled("_copy_kv_rows_kernel", "c", 80, registers=255, spill_stores=8, spill_loads=8, shared=0)
    assert aot.judge(cold) == []  # not a hot kernel: reported in the table, not failed
    smem = aot.Compiled("_paged_attn_kernel", "c", 90, registers=64, spill_stores=0, spill_loads=0,
                        shared=aot.SMEM_LIMIT[80] + 1)
    assert "shared memory" in aot.judge(smem)[0]
    broken = aot.Compiled("_threshold_kernel", "c", 90, error="CompilationError: type")
    assert aot.judge(broken)[0].startswith("compile error")


def test_arg_types_follow_triton() -> None:
    import torch

    assert aot._arg_type(torch.empty(1, dtype=torch.bfloat16)) == "*bf16"
    assert (aot._arg_type(True), aot._arg_type(7), aot._arg_type(2**40), aot._arg_type(0.5)) == ("i1", "i32", "i64", "fp32")
    with pytest.raises(TypeError, match="no Triton type"):
        aot._arg_type("x")
