"""The goodput rule of ``scheduler.draft_plan``: checked against exhaustive search, its limits and
its bad input; and the scheduler feeding it each request's acceptance."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.kvcache import RadixCache, ReqToTokenTable
from treeserve.sampling import SamplingParams
from treeserve.scheduler import DraftTree, SampledToken, Scheduler, SchedulerConfig, StopChecker
from treeserve.scheduler.draft_plan import ACCEPT_DECAY, acceptance, plan_draft_lengths

from .fake_runner import make_pool
from .test_scheduler import EOS, VOCAB


def step_rate(lengths, alphas, rows: int, tokens: float, row_cost: float) -> float:
    """Expected tokens per unit time of a step (fixed part = 1) with chain drafts of ``lengths``."""
    gain = sum(a ** j for n, a in zip(lengths, alphas) for j in range(1, n + 1))
    return (tokens + gain) / (1 + (rows + sum(lengths)) * row_cost)


cases = st.tuples(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 4)), min_size=1, max_size=4),
    st.integers(0, 20),  # rows already in the step
    st.floats(0.1, 2.0),  # row cost
    st.integers(0, 12),  # token budget
)


@settings(max_examples=300, deadline=None)
@given(cases)
def test_plan_is_as_good_as_any_allocation(case) -> None:
    reqs, extra_rows, row_cost, budget = case
    alphas = [a for a, _ in reqs]
    rooms = [r for _, r in reqs]
    rows, tokens = len(reqs) + extra_rows, float(len(reqs))
    got = plan_draft_lengths(alphas, rooms, rows, tokens, row_cost, budget)
    assert all(0 <= n <= r for n, r in zip(got, rooms)) and sum(got) <= budget
    best = max(
        step_rate(ls, alphas, rows, tokens, row_cost)
        for ls in itertools.product(*(range(r + 1) for r in rooms))
        if sum(ls) <= budget
    )
    assert step_rate(got, alphas, rows, tokens, row_cost) >= best * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(cases, st.floats(0.0, 2.0))
def test_dearer_rows_draft_no_more(case, more: float) -> None:
    reqs, extra_rows, row_cost, budget = case
    alphas, rooms = [a for a, _ in reqs], [r for _, r in reqs]
    rows, tokens = len(reqs) + extra_rows, float(len(reqs))
    cheap = plan_draft_lengths(alphas, rooms, rows, tokens, row_cost, budget)
    dear = plan_draft_lengths(alphas, rooms, rows, tokens, row_cost + more, budget)
    assert sum(dear) <= sum(cheap)


def test_free_rows_give_every_room_in_order() -> None:
    assert plan_draft_lengths([0.0, 0.9, 0.1], [4, 4, 4], 3, 3.0, 0.0, 10) == [4, 4, 2]


def test_the_measured_cases() -> None:
    """Row cost 0.49 (the 2-core AVX2 EPYC, 5 rows = 2.3 x 1 row): a quoting request (acceptance
    0.83) drafts 3 alone and nothing in a batch of 16; a chat request at the prior (0.5) drafts
    one node; a request whose drafts keep failing (0.2) drafts none."""
    rho = 0.49
    assert plan_draft_lengths([0.83], [4], 1, 1.0, rho, 64) == [3]
    assert plan_draft_lengths([0.83] * 16, [4] * 16, 16, 16.0, rho, 64) == [0] * 16
    assert plan_draft_lengths([0.5], [4], 1, 1.0, rho, 64) == [1]
    assert plan_draft_lengths([0.2], [4], 1, 1.0, rho, 64) == [0]


def test_acceptance_estimate() -> None:
    assert acceptance(0.0, 0.0) == 0.5
    assert acceptance(8.0, 0.0) == 0.9 and acceptance(0.0, 8.0) == 0.1
    with pytest.raises(ValueError, match="hits and misses"):
        acceptance(-1.0, 0.0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([0.5], [1, 2], 1, 1.0, 0.5, 4), "differ in length"),
        (([0.5], [1], 1, 1.0, -0.1, 4), "row_cost"),
        (([0.5], [1], 1, 1.0, 0.5, -1), "budget"),
        (([1.5], [1], 1, 1.0, 0.5, 4), "alphas"),
    ],
)
def test_bad_input(args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_draft_lengths(*args)


def _scheduler(row_cost: float) -> Scheduler:
    kv = make_pool(1024, 1)
    return Scheduler(
        SchedulerConfig(max_batched_tokens=64, max_running=4, max_model_len=1024, num_speculative_tokens=4,
                        speculative_row_cost=row_cost),
        kv.allocator, RadixCache(kv.allocator, 1), ReqToTokenTable(4, 1024), StopChecker([EOS], None),
    )  # fmt: skip


def test_scheduler_follows_each_requests_acceptance() -> None:
    """A request whose drafts are all accepted is asked for more nodes than at the start; one
    whose drafts are all rejected stops being asked, then is asked again as its counts decay."""
    sched = _scheduler(0.49)
    req = sched.new_request([1, 2, 3, 4], SamplingParams(max_new_tokens=500), seed=1, vocab_size=VOCAB)[0]
    batch = sched.schedule()  # the prompt
    sched.update(batch, [SampledToken(5, 0.0, None)])
    asked = []
    for accept in [True] * 6 + [False] * 80:
        batch = sched.schedule()
        (item,) = batch.items
        asked.append(item.draft_budget)
        if not item.draft_budget:
            sched.update(batch, [SampledToken(6, 0.0, None)])
            continue
        n = item.draft_budget
        draft = DraftTree([7] * n, list(range(-1, n - 1)))
        batch.items[0] = item._replace(draft=draft, num_scheduled_tokens=1 + n)
        accepted = tuple([7] * n) if accept else ()
        sched.update(batch, [SampledToken(8, 0.0, None, accepted)])
        sched.check_invariants()
    assert asked[0] == 1 and max(asked[:6]) > 1, asked
    stopped = asked.index(0, 6)
    assert 0 in asked[6:] and any(asked[stopped:]), asked  # stopped, then tried again
    assert req.draft_misses > 0 and ACCEPT_DECAY < 1
