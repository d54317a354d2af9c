"""The CLI's speculation flags reach the engine (``treeserve bench --speculative ngram``;
``auto`` by default, ``none`` turns it off)."""

from __future__ import annotations

import pytest

from treeserve import cli


def test_speculation_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(cli, "LLM", lambda model, **kw: seen.update(kw, model=model))
    args = cli.build_parser().parse_args(["bench", "--speculative", "ngram", "--num-speculative-tokens", "6"])
    cli._make_llm(args)
    assert seen["speculative"] == "ngram" and seen["num_speculative_tokens"] == 6
    cli._make_llm(cli.build_parser().parse_args(["bench"]))
    assert seen["speculative"] == "auto", "the default is the engine's measured rule"
    cli._make_llm(cli.build_parser().parse_args(["bench", "--speculative", "none"]))
    assert seen["speculative"] is None
