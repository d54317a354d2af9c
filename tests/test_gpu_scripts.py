"""The GPU check's scripts run: ``benches/gpu_e2e.py`` end to end on the CPU in its smoke mode
(tiny shape), and ``benches/gpu_check.sh`` parses. A GPU session has minutes of device time, so a
script that only breaks there costs the whole check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benches" / "gpu_e2e.py"), *args, "--quick", "--device", "cpu",
                           "--shape", "tiny"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_decode_table_has_every_mode_and_batch() -> None:
    out = run("decode", "--modes", "eager,graph,sync")
    rows = re.findall(r"^(eager|graph|sync)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)%$", out, re.M)
    assert {(m, b) for m, b, *_ in rows} == {(m, b) for m in ("eager", "graph", "sync") for b in ("1", "2")}, out
    assert all(float(ms) > 0 for _, _, ms, _, _ in rows)


@pytest.mark.slow
def test_prefill_and_phases_report() -> None:
    assert len(re.findall(r"^prefill \d+ x \d+: +\d+ tok/s", run("prefill"), re.M)) == 2
    out = run("phases", "--batch", "2")
    assert "ms/step" in out and "host schedule" in out and "host input load (_load)" in out, out


@pytest.mark.slow
def test_kernels_report() -> None:
    out = run("kernels")
    assert re.search(r"^torch +\d+\.\d +-?\d+\.\d\d +nan$", out, re.M), out
    assert len(re.findall(r"rows +\d+: float32 +[\d.]+ ms, bf16 exact +[\d.]+ ms .* same argmax: True", out)) == 2, out


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "benches" / "gpu_check.sh")], check=True)
