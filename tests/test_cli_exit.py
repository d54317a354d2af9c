"""``treeserve generate`` run as a program ends with ``os._exit`` after closing its engine and flushing
its output (issue 33: the interpreter's teardown is ~0.7 s of a one-prompt run); called in-process
with arguments, ``main`` returns the exit code as before."""

from __future__ import annotations

import sys

import pytest

from treeserve import cli


class _Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _FakeLLM:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def stream(self, prompt: str, params: object) -> list[str]:
        self.events.append(f"stream {prompt}")
        return ["a", "b"]

    def close(self) -> None:
        self.events.append("close")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(cli, "LLM", lambda model, **kw: _FakeLLM(seen))

    def exit_now(code: int) -> None:
        seen.append(f"exit {code}")
        raise _Exited(code)

    monkeypatch.setattr(cli.os, "_exit", exit_now)
    return seen


def test_generate_as_a_program_closes_flushes_and_exits(events: list[str], monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["treeserve", "generate", "--prompt", "hi"])
    with pytest.raises(_Exited) as exited:
        cli.main()
    assert exited.value.code == 0
    assert events == ["stream hi", "close", "exit 0"]
    assert capsys.readouterr().out == "ab\n"


def test_main_with_arguments_returns(events: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    assert events == ["stream hi", "close"]  # closed, not exited: the caller's process goes on
    assert capsys.readouterr().out == "ab\n"

