"""``treeserve bench`` names the CPU, the KV cache dtype and how much of the CPU other work took while
the figures ran."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from treeserve import cli
from treeserve.bench import WorkloadResult


def _fake_engine(monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    metrics = SimpleNamespace(mean_ttft=0.1, mean_tpot=0.01, preemptions=0, steps=3, accepted_tokens=0, draft_tokens=0,
                              acceptance_rate=0.0, mean_accepted_length=0.0)
    llm = SimpleNamespace(config=SimpleNamespace(speculative=None), model=SimpleNamespace(dtype="float32"),
                          kv=SimpleNamespace(dtype="torch.float16"), metrics=metrics)
    monkeypatch.setattr(cli, "_make_llm", lambda args: llm)
    monkeypatch.setattr(cli, "_same_model", lambda llm, args, **kw: llm)
    for name in ("throughput", "shared_prefix", "single_decode", "single_stream_breakdown"):
        monkeypatch.setattr(cli.workloads, name, lambda *a, **k: WorkloadResult("fake", 1.0, 1, 4, 8, sample_text="hello"))
    monkeypatch.setattr(cli, "interference", lambda fn: (fn(), share))


@pytest.mark.parametrize("share, quiet", [(0.02, True), (0.6, False)])
def test_bench_header_names_the_cpu_and_its_sharing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                   share: float, quiet: bool) -> None:
    _fake_engine(monkeypatch, share)
    assert cli.cmd_bench(cli.build_parser().parse_args(["bench", "--quick"])) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("CPU: "))
    assert cli.cpu_features().describe() in line
    assert f"other work took {share:.0%} of this process's CPUs" in line
    assert ("not quiet" in line) != quiet
    assert "kv_cache_dtype=auto (float16)" in out  # the KV dtype "auto" chose on this CPU
