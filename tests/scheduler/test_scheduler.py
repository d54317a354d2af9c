"""Scheduler scenarios and properties, run against the KV-checking null model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treeserve.kvcache import RadixCache, ReqToTokenTable
from treeserve.sampling import SamplingParams
from treeserve.scheduler import FinishReason, RequestState, Scheduler, SchedulerConfig, StopChecker
from treeserve.scheduler.ledger import DECODE_RUN

from .fake_runner import FakeRunner, make_pool, next_token

VOCAB = 97
EOS = 96


class Harness:
    """A scheduler wired to a real allocator / radix tree / table and the null model."""

    def __init__(
        self,
        num_pages: int = 256,
        page_size: int = 1,
        max_batched_tokens: int = 32,
        max_running: int = 8,
        max_model_len: int = 128,
        prefix_cache: bool = True,
        stop_strings: bool = False,
    ) -> None:
        self.kv = make_pool(num_pages, page_size)
        self.radix = RadixCache(self.kv.allocator, page_size, disable=not prefix_cache)
        width = -(-max_model_len // page_size) * page_size
        self.table = ReqToTokenTable(max_running, width)
        detok = (lambda ids: "".join(chr(97 + t % 26) for t in ids)) if stop_strings else None
        self.sched = Scheduler(
            SchedulerConfig(max_batched_tokens, max_running, max_model_len),
            self.kv.allocator,
            self.radix,
            self.table,
            StopChecker([EOS], detok),
        )
        self.runner = FakeRunner(self.kv, self.table, VOCAB)

    def add(self, prompt: list[int], **params) -> list:
        return self.sched.new_request(prompt, SamplingParams(**params), seed=1, vocab_size=VOCAB)

    def step(self) -> list:
        batch = self.sched.schedule()
        assert batch.items, "scheduler has work but scheduled nothing"
        assert batch.total_scheduled_tokens <= self.sched.config.max_batched_tokens
        finished = self.sched.update(batch, self.runner.run(batch))
        self.sched.check_invariants()
        return finished

    def drain(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not drain")

    def assert_no_leak(self) -> None:
        alloc = self.kv.allocator
        assert self.radix.protected_tokens == 0
        assert alloc.num_free + self.radix.evictable_tokens // self.kv.page_size == alloc.capacity
        assert self.table.num_free == self.table.max_requests


def expected_output(prompt: list[int], max_new: int, ignore_eos: bool = False) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_new:
        t = next_token(ids, VOCAB)
        ids.append(t)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


def random_prompts(rng: random.Random, n: int, shared: int) -> list[list[int]]:
    bases = [[rng.randrange(EOS) for _ in range(rng.randint(1, shared))] for _ in range(3)]
    return [rng.choice(bases) + [rng.randrange(EOS) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("pool_tokens", [96, 320, 4000])
def test_batched_equals_alone_with_preemption(page_size: int, pool_tokens: int) -> None:
    rng = random.Random(page_size * 1000 + pool_tokens)
    prompts = random_prompts(rng, 24, 30)  # <= 42 tokens, + <= 24 new: one request fits in 96
    max_news = [rng.randint(1, 24) for _ in prompts]
    h = Harness(num_pages=pool_tokens // page_size + 1, page_size=page_size, max_running=6)
    reqs = [h.add(p, max_new_tokens=m)[0] for p, m in zip(prompts, max_news)]
    h.drain()
    for req, p, m in zip(reqs, prompts, max_news):
        assert req.state is RequestState.FINISHED
        assert req.output_ids == expected_output(p, m), f"request {req.rid} diverged"
    h.assert_no_leak()
    if pool_tokens == 96:
        assert h.sched.num_preemptions > 0, "the tiny pool should force preemption"


def test_prefix_hits_and_cache_disabled_give_same_outputs() -> None:
    rng = random.Random(7)
    system = [rng.randrange(EOS) for _ in range(40)]
    prompts = [system + [rng.randrange(EOS) for _ in range(5)] for _ in range(10)]
    outs = {}
    for cache in (True, False):
        h = Harness(prefix_cache=cache, max_batched_tokens=64)
        reqs = [h.add(p, max_new_tokens=8, ignore_eos=True)[0] for p in prompts]
        h.drain()
        h.assert_no_leak()
        outs[cache] = [r.output_ids for r in reqs]
        cached = sum(r.metrics.cached_prompt_tokens for r in reqs)
        if cache:
            assert cached >= 9 * 40, f"later requests should reuse the system prompt, got {cached}"
        else:
            assert cached == 0
    assert outs[True] == outs[False]


def test_chunked_prefill_respects_budget_and_mixes_decode() -> None:
    h = Harness(max_batched_tokens=16, max_model_len=256, num_pages=512)
    short = h.add([1, 2, 3], max_new_tokens=20, ignore_eos=True)[0]
    h.step()  # short prefilled
    long = h.add(list(range(1, 90)), max_new_tokens=4, ignore_eos=True)[0]
    saw_mixed = False
    while h.sched.has_work():
        batch = h.sched.schedule()
        kinds = {(it.req is long, it.sample) for it in batch.items}
        if (False, True) in kinds and (True, False) in kinds:
            saw_mixed = True  # a decode and a non-final prefill chunk in one step
        h.sched.update(batch, h.runner.run(batch))
        h.sched.check_invariants()
    assert saw_mixed
    assert short.output_ids == expected_output([1, 2, 3], 20, ignore_eos=True)
    assert long.output_ids == expected_output(list(range(1, 90)), 4, ignore_eos=True)


def test_parallel_sampling_shares_the_prompt() -> None:
    h = Harness(max_batched_tokens=64)
    prompt = list(range(1, 31))
    reqs = h.add(prompt, max_new_tokens=5, n=4, ignore_eos=True)
    assert [r.sample_index for r in reqs] == [0, 1, 2, 3]
    assert len({r.seed for r in reqs}) == 4
    h.drain()
    h.assert_no_leak()
    assert reqs[0].metrics.cached_prompt_tokens == 0
    for r in reqs[1:]:
        assert r.metrics.cached_prompt_tokens == len(prompt) - 1
    computed = h.runner.steps
    assert computed <= 1 + 1 + 5  # leader prefill, siblings' last token, decodes


def test_stop_conditions() -> None:
    h = Harness(stop_strings=True)
    prompt = [5, 6, 7]
    full = expected_output(prompt, 30, ignore_eos=True)
    stop_tok = full[3]
    r_tok = h.add(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])[0]
    r_min = h.add(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok], min_new_tokens=10)[0]
    text = "".join(chr(97 + t % 26) for t in full)
    r_str = h.add(prompt, max_new_tokens=30, ignore_eos=True, stop=[text[5:8]])[0]
    r_len = h.add(prompt, max_new_tokens=7, ignore_eos=True)[0]
    h.drain()
    first = full.index(stop_tok)
    assert r_tok.output_ids == full[: first + 1] and r_tok.finish_reason is FinishReason.STOP
    assert r_tok.stop_reason == stop_tok
    later = [i for i, t in enumerate(full) if t == stop_tok and i + 1 >= 10]
    expected_min = full[: later[0] + 1] if later else full
    assert r_min.output_ids == expected_min
    assert r_str.finish_reason is FinishReason.STOP and r_str.text == text[: text.index(text[5:8])]
    assert r_len.output_ids == full[:7] and r_len.finish_reason is FinishReason.LENGTH
    h.assert_no_leak()


def test_abort_anywhere_frees_everything() -> None:
    h = Harness(max_batched_tokens=8)
    reqs = [h.add(list(range(1, 20)), max_new_tokens=10, ignore_eos=True)[0] for _ in range(4)]
    h.step()
    h.sched.abort(reqs[0])  # running mid-prefill
    h.sched.abort(reqs[3])  # still waiting
    h.sched.check_invariants()
    h.drain()
    assert reqs[0].finish_reason is FinishReason.ABORT and reqs[3].finish_reason is FinishReason.ABORT
    assert reqs[1].output_ids == expected_output(list(range(1, 20)), 10, ignore_eos=True)
    h.assert_no_leak()


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ([], {}, "at least 1 token"),
        ([1, VOCAB], {}, "token ids must be in"),
        ([-1], {}, "token ids must be in"),
        (list(range(1, 60)) * 3, {}, "max_model_len"),
        ([1, 2], {"n": 64, "max_new_tokens": 100}, "n=64"),
    ],
)
def test_bad_requests_are_rejected_without_side_effects(prompt, kwargs, match) -> None:
    h = Harness(num_pages=64)
    with pytest.raises(ValueError, match=match):
        h.add(prompt, **kwargs)
    assert not h.sched.has_work()
    h.sched.check_invariants()


@given(seed=st.integers(0, 2**16), page_size=st.sampled_from([1, 16]))
def test_random_workloads_match_alone_outputs(seed: int, page_size: int) -> None:
    rng = random.Random(seed)
    prompts = random_prompts(rng, rng.randint(1, 10), 40)
    max_news = [rng.randint(1, 12) for _ in prompts]
    num_pages = rng.choice([6, 10, 64]) if page_size == 16 else rng.choice([70, 120, 600])
    h = Harness(num_pages=num_pages, page_size=page_size, max_running=4, max_batched_tokens=rng.choice([8, 64]))
    reqs = [h.add(p, max_new_tokens=m)[0] for p, m in zip(prompts, max_news)]
    h.drain()
    assert [r.output_ids for r in reqs] == [expected_output(p, m) for p, m in zip(prompts, max_news)]
    h.assert_no_leak()


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort sequences; accounting checked after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(num_pages=48, page_size=4, max_running=4, max_batched_tokens=16)
        self.live: list = []
        self.rng = random.Random(0)

    @rule(plen=st.integers(1, 40), max_new=st.integers(1, 10), n=st.integers(1, 3), base=st.integers(0, 2))
    def add(self, plen: int, max_new: int, n: int, base: int) -> None:
        prompt = [(base * 7 + i) % EOS for i in range(plen)]
        self.live.extend(self.h.add(prompt, max_new_tokens=max_new, n=n))

    @precondition(lambda self: self.h.sched.has_work())
    @rule()
    def step(self) -> None:
        for r in self.h.step():
            assert r.output_ids == expected_output(r.prompt_ids, r.params.max_new_tokens)[: len(r.output_ids)]

    @precondition(lambda self: any(not r.is_finished for r in self.live))
    @rule(i=st.integers(0, 1000))
    def abort(self, i: int) -> None:
        alive = [r for r in self.live if not r.is_finished]
        self.h.sched.abort(alive[i % len(alive)])

    @invariant()
    def accounting(self) -> None:
        self.h.sched.check_invariants()

    def teardown(self) -> None:
        self.h.drain()
        self.h.assert_no_leak()


TestSchedulerMachine = SchedulerMachine.TestCase


def test_decoding_requests_get_consecutive_slot_runs() -> None:
    """Page size 1 with room to spare: a decoding request whose slots ran out gets a run of
    consecutive slots (``KVLedger.decode_run``: decode attention then streams its K/V rows), capped by
    the tokens the requests can still take; outputs are unchanged and the unused slots come back."""
    h = Harness(num_pages=1024, max_running=4)
    cap = h.sched.ledger.capacity
    (solo,) = h.add([1, 2], max_new_tokens=60, ignore_eos=True)
    h.step()
    h.step()
    assert cap(solo) == 2 + DECODE_RUN
    (a,) = h.add([5, 6, 7], max_new_tokens=40, ignore_eos=True)
    (b,) = h.add([8, 9], max_new_tokens=5, ignore_eos=True)
    h.step()  # both prefills, one token each (solo decodes within its run)
    h.step()  # both decode: their slots ran out, a run each, capped by b's 4 tokens left
    assert (cap(a), cap(b)) == (3 + 4, 2 + 4)
    for req in (solo, a, b):
        run = h.table.table[req.row, len(req.prompt_ids) : cap(req)].tolist()
        assert run == list(range(run[0], run[0] + len(run))), run
    h.drain()
    assert solo.output_ids == expected_output([1, 2], 60, ignore_eos=True)
    assert a.output_ids == expected_output([5, 6, 7], 40, ignore_eos=True)
    assert b.output_ids == expected_output([8, 9], 5, ignore_eos=True)
    h.assert_no_leak()


def test_decode_runs_give_way_to_a_nearly_full_pool() -> None:
    """Where a run would leave less than a quarter of the pool free, a decoding request gets one slot."""
    h = Harness(num_pages=12, max_running=1)
    (a,) = h.add([5, 6, 7], max_new_tokens=8, ignore_eos=True)
    h.step()
    h.step()
    assert h.sched.ledger.capacity(a) == 4
    h.drain()
    assert a.output_ids == expected_output([5, 6, 7], 8, ignore_eos=True)
    h.assert_no_leak()
