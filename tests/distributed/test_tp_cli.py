"""``--tensor-parallel-size`` reaches the engine from every CLI command that builds one."""

from __future__ import annotations

from typing import Any

import pytest

from treeserve import cli


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"], ["serve"], ["bench"]])
def test_flag_reaches_the_engine(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli, "LLM", lambda model, **kw: seen.update(kw, model=model))
    cli._make_llm(cli.build_parser().parse_args([*command, "--tensor-parallel-size", "3"]))
    assert seen["tensor_parallel_size"] == 3
    cli._make_llm(cli.build_parser().parse_args(command))
    assert seen["tensor_parallel_size"] == 1  # the default: one process, no workers
