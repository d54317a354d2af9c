"""Output text: incremental detokenization, stop strings over multi-byte characters, hold-back,
stream == generate, and a per-token decode cost that does not grow with the output length."""

from __future__ import annotations

import pytest

from treeserve import LLM, SamplingParams
from treeserve.models import StreamDecoder
from treeserve.output import TrackedRequest
from treeserve.scheduler import Request, RequestState, StopChecker, TextState, WholeDecoder

from ._scripted import ScriptedModel, smol_tokenizer

PROMPT_LEN = 3


def scripted_llm(text: str, repeat: int = 1, **kw) -> tuple[LLM, list[int]]:
    tok = smol_tokenizer()
    script = tok.encode(text, add_special_tokens=False) * repeat
    model = ScriptedModel(script, PROMPT_LEN, tok.vocab_size)
    cfg = dict(kv_cache_tokens=8192, max_batched_tokens=64, max_running=8, max_model_len=512)
    cfg.update(kw)
    return LLM((model, tok), **cfg), script


def run_both(llm: LLM, n: int, **params) -> tuple[str, list[str], object]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **params)
    (out,) = llm.generate([[10, 11, 12]], sp, use_tqdm=False)
    pieces = list(llm.stream([10, 11, 12], sp))
    return out.outputs[0].text, pieces, out.outputs[0]


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("I like 😀 a lot", "😀", "I like "),
        ("a 你好 b", "你", "a "),
        ("xy你好z", "好z", "xy你"),
        (" Paris.\n\nThe answer is 42", " answer is", " Paris.\n\nThe"),
    ],
)
def test_stop_strings_over_multibyte_tokens(text, stop, expected) -> None:
    llm, script = scripted_llm(text)
    generated, pieces, out = run_both(llm, len(script), stop=[stop])
    assert generated == expected
    assert "".join(pieces) == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    for i in range(1, len(pieces) + 1):  # no piece boundary ever shows the start of the stop
        assert stop not in "".join(pieces[:i])


def test_stream_equals_generate_without_stop() -> None:
    llm, script = scripted_llm("héllo 😀 wörld, 你好! 🎉🎉 done")
    generated, pieces, out = run_both(llm, len(script))
    assert generated == smol_tokenizer().decode(script, skip_special_tokens=True)
    assert "".join(pieces) == generated and all("\ufffd" not in p for p in pieces)
    assert out.finish_reason == "length"


def test_stop_before_min_new_tokens_is_ignored() -> None:
    llm, script = scripted_llm("ab ab ab ab ab")
    text, pieces, out = run_both(llm, len(script), stop=["ab"], min_new_tokens=3)
    n_ab_tokens = len(smol_tokenizer().encode("ab ab", add_special_tokens=False))
    assert text.startswith("ab ab") and out.finish_reason == "stop"
    assert len(out.token_ids) >= max(3, n_ab_tokens)
    assert "".join(pieces) == text


def test_text_state_holds_back_stop_prefixes() -> None:
    state = TextState(WholeDecoder(lambda ids: "".join(chr(t) for t in ids)), stops=("STOP",))
    released = ""
    for ch in "xxSTxSTO":
        assert state.push([ord(ch)]) is None
        released += state.releasable()
    assert released == "xxSTx"  # "STO" may still become "STOP"
    assert state.push([ord("P")]) == "STOP"
    released += state.releasable()
    assert released == "xxSTx" and state.text == "xxSTx"


class CountingTokenizer:
    """Wraps a tokenizer; counts decode calls and the ids they decode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0
        self.ids_decoded = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens=False):
        ids = list(ids)
        self.calls += 1
        self.ids_decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


def test_per_token_decode_cost_is_flat_for_long_outputs() -> None:
    """The engine's text path (stop checker -> TextState -> StreamDecoder -> TrackedRequest),
    fed a 2,000-token output one committed token at a time, as the scheduler does."""
    tok = CountingTokenizer(smol_tokenizer())
    script = tok.inner.encode("The quick brown fox 😀 jumps over 你好 the lazy dog. ", add_special_tokens=False) * 150
    script = script[:2000]
    sp = SamplingParams(max_new_tokens=2000, ignore_eos=True, stop=["never appears"])
    req = Request(rid=0, prompt_ids=[1, 2, 3], params=sp, seed=0)
    req.text_state = TextState(StreamDecoder(tok, skip_special_tokens=True), sp.stop)
    checker, tracked = StopChecker([0], None), TrackedRequest("r", [req])
    costs, pieces = [], []
    for token in script:
        req.output_ids.append(token)
        assert checker.check(req) is None or len(req.output_ids) == 2000
        pieces.extend(d.text for d in tracked.collect())
        costs.append(tok.ids_decoded)
    req.state = RequestState.FINISHED
    pieces.extend(d.text for d in tracked.collect())
    assert "".join(pieces) == tok.inner.decode(script, skip_special_tokens=True)
    n = len(costs)
    first = costs[n // 4] / (n // 4)
    last = (costs[-1] - costs[3 * n // 4]) / (n - 1 - 3 * n // 4)
    assert last <= 1.2 * first, (first, last)  # ids decoded per token: no growth with length
    assert tok.ids_decoded <= 8 * n, tok.ids_decoded  # a full re-decode per token would be ~n*n/2


def test_chat_bad_conversation_fails_alone() -> None:
    tok = smol_tokenizer()
    llm = LLM((ScriptedModel(tok.encode("ok", add_special_tokens=False), 3, tok.vocab_size), tok), max_model_len=256)
    good = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    outs = llm.chat([good, [{"role": "user"}], [{"content": "x"}], "not a conversation", good], sp)
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "content" in outs[1].error and "role" in outs[2].error and "conversation" in outs[3].error
    with pytest.raises(TypeError, match="messages"):
        llm.chat(None, sp)  # type: ignore[arg-type]
    assert not llm.has_unfinished_requests()
