"""No C++ operator crashes on bad input: each refuses it with an error before touching memory.

The calls run in a child process (``tests/_cpp_bad_input.py``), so an operator that crashes fails
this test, naming the case, instead of killing the test run (as a segfault in
``top_candidates``' bad-input test did on a CUDA machine with torch 2.11).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import _cpp_bad_input as child

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def outcome() -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests._cpp_bad_input"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_child_survives_every_case(outcome: subprocess.CompletedProcess[str]) -> None:
    lines = outcome.stdout.splitlines()
    started = [x for x in lines if x.startswith("start ")]
    assert outcome.returncode == 0, f"crashed (rc {outcome.returncode}) in: {started[-1] if started else '?'}\n{outcome.stderr[-2000:]}"


@pytest.mark.parametrize(("op", "case"), [(op, case) for op, (_, cases) in child.CASES.items() for case in cases])
def test_operator_refuses(outcome: subprocess.CompletedProcess[str], op: str, case: str) -> None:
    lines = outcome.stdout.splitlines()
    if f"unavailable {op}" in "\n".join(lines):
        pytest.skip(f"{op} is not built on this machine (its torch fallback serves)")
    assert any(x.startswith(f"raised {op}: {case}:") for x in lines), f"{op} accepted {case!r}:\n{outcome.stdout[-3000:]}"
