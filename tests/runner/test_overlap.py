"""The overlapped engine loop (``overlap=True``: the next decode step is launched before the
running one's tokens are read) gives exactly the synchronous loop's outputs.

On CPU the static path runs eagerly, so a launched step has already run when ``launch``
returns; what these tests check is the loop's logic, which is the same on CUDA: the follow-up
step's pending tokens taken on the device from the step before (``prev_row``), the one-step-late
commit, stops / length limits / aborts applied at that commit, discarded tokens of finished
requests, and the page accounting around it. The order test records that a follow-up is launched
before the tokens of the step it follows are read.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_structured import assert_drained as drained
from treeserve import LLM, SamplingParams
from treeserve.runner import DecodeGraphRunner, DecodeLaunch

from ._helpers import VOCAB, tiny_model

MODEL = tiny_model()


def make_llm(overlap: bool, **kw) -> LLM:
    cfg = dict(dtype="float32", kv_cache_tokens=1024, max_batched_tokens=64, max_running=8, max_model_len=64,
               seed=0, cuda_graph=True, cuda_graph_max_batch=8, overlap=overlap)  # fmt: skip
    cfg.update(kw)
    return LLM((MODEL, None), **cfg)


params_st = st.builds(
    lambda **kw: _params(**kw),
    temperature=st.sampled_from([0.0, 0.9]),
    top_k=st.sampled_from([-1, 5]),
    max_new_tokens=st.integers(1, 14),
    min_new_tokens=st.integers(0, 2),
    stop_token_ids=st.lists(st.integers(3, VOCAB - 1), max_size=3),
    logprobs=st.none() | st.just(2),
    n=st.sampled_from([1, 1, 2]),
    seed=st.integers(0, 2**31),
).filter(lambda p: p is not None)


def _params(**kw) -> SamplingParams:
    kw["min_new_tokens"] = min(kw["min_new_tokens"], kw["max_new_tokens"])
    return SamplingParams(**kw)


@settings(max_examples=8, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20), params_st),
                  min_size=1, max_size=10),  # fmt: skip
    page_size=st.sampled_from([1, 4]),
)
def test_overlapped_loop_gives_the_synchronous_outputs(reqs, page_size: int) -> None:
    prompts = [p for p, _ in reqs]
    params = [sp for _, sp in reqs]
    outs = {}
    for overlap in (False, True):
        llm = make_llm(overlap, page_size=page_size)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[overlap] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in res]
        outs[overlap, "lp"] = [c.logprobs for o in res for c in o.outputs]
        drained(llm)
        assert overlap or llm.runner.decode_graph.num_follow_ups == 0
        assert llm.metrics.generated_tokens == sum(len(c[0]) for o in outs[overlap] for c in o)
    assert outs[True] == outs[False]
    # Logprobs up to float rounding: the two loops batch steps differently (mixed eager steps
    # against static decode steps), and a reduction's order follows the batch.
    for a, b in zip(outs[True, "lp"], outs[False, "lp"]):
        assert a == pytest.approx(b, abs=1e-4)


def test_follow_ups_launch_before_the_tokens_they_follow_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlap is real: a follow-up step is launched while the step before it is unread."""
    events: list[tuple[str, int]] = []
    launch, tokens = DecodeGraphRunner.launch, DecodeLaunch.tokens

    def logged_launch(self, batch, follows=None):  # noqa: ANN001, ANN202
        out = launch(self, batch, follows)
        events.append(("launch", id(out)) if follows is None else ("follow", id(out)))
        return out

    def logged_tokens(self):  # noqa: ANN001, ANN202
        events.append(("read", id(self)))
        return tokens(self)

    monkeypatch.setattr(DecodeGraphRunner, "launch", logged_launch)
    monkeypatch.setattr(DecodeLaunch, "tokens", logged_tokens)
    llm = make_llm(True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(5)] for _ in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True), use_tqdm=False)
    follows = [i for i, (kind, _) in enumerate(events) if kind == "follow"]
    assert len(follows) >= 8 and llm.runner.decode_graph.num_follow_ups == len(follows), events
    for i in follows:  # the step launched just before is read only after its follow-up launched
        previous = next(key for kind, key in reversed(events[:i]) if kind in ("launch", "follow"))
        assert ("read", previous) in events[i + 1 :], (i, events)
    drained(llm)


def test_aborts_and_new_requests_between_overlapped_steps() -> None:
    """Step API: requests aborted while a step is in flight free everything and emit nothing
    more; the others' outputs equal the synchronous loop's."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, ignore_eos=True, seed=3)
    results = {}
    for overlap in (False, True):
        llm = make_llm(overlap)
        ids = [llm.add_request(p, sp) for p in prompts[:4]]
        texts: dict[str, list[int]] = {i: [] for i in ids}
        for step in range(60):
            if step == 3:
                assert llm.abort_request(ids[1])
            if step == 5:
                ids.append(llm.add_request(prompts[4], sp))
                texts[ids[-1]] = []
            for d in llm.step():
                texts[d.request_id].extend(d.token_ids)
            if not llm.has_unfinished_requests():
                break
        drained(llm)
        results[overlap] = {i: t for i, t in texts.items() if i != ids[1]}
        assert len(texts[ids[1]]) < 10
    assert list(results[True].values()) == list(results[False].values())


def test_overlap_needs_the_static_path() -> None:
    with pytest.raises(ValueError, match="overlap=True needs the static decode path"):
        make_llm(True, cuda_graph=False)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        make_llm("yes")
    assert not make_llm(None)._overlap  # CPU: off by default (nothing runs asynchronously there)


def test_min_new_tokens_counts_the_token_in_flight() -> None:
    """A stop token that ``min_new_tokens`` allows from the 4th token on stops the 4th token in
    both loops (a follow-up step counts the token still in flight as generated)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(6)] for _ in range(4)]
    free = make_llm(False).generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
                                    use_tqdm=False)  # fmt: skip
    cases = [(p, o.outputs[0].token_ids) for p, o in zip(prompts, free) if o.outputs[0].token_ids[3] not in
             o.outputs[0].token_ids[:3]]  # fmt: skip
    assert cases
    for overlap in (False, True):
        llm = make_llm(overlap)
        for prompt, ids in cases:
            sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, stop_token_ids=[ids[3]], min_new_tokens=3)
            (out,) = llm.generate([prompt], sp, use_tqdm=False)[0].outputs
            assert out.token_ids == ids[:4] and out.finish_reason == "stop", (overlap, out.token_ids, ids)
        drained(llm)
