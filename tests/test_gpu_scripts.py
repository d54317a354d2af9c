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
def test_sampled_decode_table() -> None:
    out = run("decode", "--modes", "graph", "--sampled")
    assert "# graph sampled" in out, out
    rows = re.findall(r"^graph\s+(\d+)\s+([\d.]+)\s+\d+\s+[\d.]+%$", out, re.M)
    assert [b for b, _ in rows] == ["1", "2"] and all(float(ms) > 0 for _, ms in rows), out


@pytest.mark.slow
def test_prefill_and_phases_report() -> None:
    assert len(re.findall(r"^prefill \d+ x \d+: +\d+ tok/s", run("prefill"), re.M)) == 2
    out = run("phases", "--batch", "2")
    assert "ms/step" in out and "host schedule" in out and "host input load (_load)" in out, out


@pytest.mark.slow
def test_kernel_table_has_every_backend() -> None:
    """``benches/gpu_kernels.py`` in its smoke mode: every attention case has its torch, SDPA,
    unsplit, rule-chosen and split Triton rows, every case its tile sweep, and sampling
    and verify theirs; no row failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benches" / "gpu_kernels.py"), "--quick", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^(.+?) {2,}(torch|sdpa|triton auto|triton s=\d+|triton m\d+ n\d+ w\d+|triton) +[\d.]+ +[\d.]+ +[\d.]+%", proc.stdout,
                      re.M)
    got = {(k.strip(), b) for k, b in rows}
    for case in ("decode attn B=2 kv=64", "tree attn B=2 kv=40 nodes=4"):
        assert {(case, b) for b in ("torch", "sdpa", "triton auto", "triton s=1", "triton s=2")} <= got, proc.stdout
    assert {b for k, b in got if k.startswith("decode") and " w" in b} == {"triton m16 n16 w4", "triton m16 n64 w4",
                                                                             "triton m16 n32 w8"}, proc.stdout
    assert {b for k, b in got if k.startswith("tree") and " w" in b} == {"triton m16 n32 w8", "triton m16 n32 w4",
                                                                           "triton m32 n32 w8"}, proc.stdout
    assert {b for k, b in got if k.startswith(("sampling", "verify"))} == {"torch", "triton"}, proc.stdout
    assert {k.split(" ")[0] for k, b in got if b == "triton" and "kernel" in k} == {"thresholds", "walk"}, proc.stdout


@pytest.mark.slow
def test_kernels_report() -> None:
    out = run("kernels")
    assert re.search(r"^torch +\d+\.\d +-?\d+\.\d\d +nan$", out, re.M), out
    assert len(re.findall(r"rows +\d+: float32 +[\d.]+ ms, bf16 exact +[\d.]+ ms .* same argmax: True", out)) == 2, out


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "benches" / "gpu_check.sh")], check=True)
