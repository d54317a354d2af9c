"""Speculation from the scheduler's side: it only asks for drafts (``draft_budget``) and holds
their slots and token budget; it never runs a drafter. Drafting itself is the runner's
(tests/runner/test_drafting.py)."""

from __future__ import annotations

import random

import pytest

from treeserve.kvcache import RadixCache, ReqToTokenTable
from treeserve.sampling import SamplingParams
from treeserve.scheduler import Request, SampledToken, ScheduledBatch, Scheduler, SchedulerConfig, StopChecker

from .fake_runner import FakeRunner, make_pool
from .test_scheduler import EOS, VOCAB, expected_output, random_prompts


def run_workload(k: int, prompts, max_news, page_size: int, num_pages: int, budget: int, check=None):
    kv = make_pool(num_pages, page_size)
    radix = RadixCache(kv.allocator, page_size)
    table = ReqToTokenTable(4, -(-128 // page_size) * page_size)
    released = []
    sched = Scheduler(
        SchedulerConfig(max_batched_tokens=budget, max_running=4, max_model_len=128, num_speculative_tokens=k),
        kv.allocator, radix, table, StopChecker([EOS], None), on_release=released.append,
    )  # fmt: skip
    runner = FakeRunner(kv, table, VOCAB)
    reqs = [sched.new_request(p, SamplingParams(max_new_tokens=m), seed=1, vocab_size=VOCAB)[0] for p, m in zip(prompts, max_news)]
    for _ in range(10_000):
        if not sched.has_work():
            break
        batch = sched.schedule()
        if check is not None:
            check(sched, batch)
        sched.update(batch, runner.run(batch))  # nobody drafted: every item decodes plainly
        sched.check_invariants()
    assert not sched.has_work()
    assert radix.protected_tokens == 0 and table.num_free == table.max_requests
    assert kv.allocator.num_free + radix.evictable_tokens // page_size == kv.allocator.capacity
    assert {id(r) for r in released} == {id(r) for r in reqs}, "every request's release is reported"
    return [r.output_ids for r in reqs]


def check_budgets(k: int, budget: int):
    def check(sched: Scheduler, batch: ScheduledBatch) -> None:
        assert sum(it.num_scheduled_tokens + it.draft_budget for it in batch.items) <= budget
        for it in batch.items:
            r = it.req
            assert it.draft is None, "the scheduler never drafts"
            if it.draft_budget:
                assert r.seq_len - it.start == 1 and it.num_scheduled_tokens == 1, "only decodes ask"
                assert it.draft_budget <= min(k, r.params.max_new_tokens - len(r.output_ids) - 1)
                assert sched.ledger.capacity(r) >= it.start + 1 + it.draft_budget, "draft slots are held"

    return check


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("budget", [4, 9, 64])
def test_draft_budgets_change_no_output_and_leak_nothing(page_size: int, budget: int) -> None:
    rng = random.Random(page_size * 100 + budget)
    prompts = random_prompts(rng, 10, 30)
    max_news = [rng.randint(1, 16) for _ in prompts]
    num_pages = 200 // page_size + 1
    plain = run_workload(0, prompts, max_news, page_size, num_pages, budget)
    asked = run_workload(3, prompts, max_news, page_size, num_pages, budget, check_budgets(3, budget))
    assert plain == asked == [expected_output(p, m) for p, m in zip(prompts, max_news)]


def test_draft_budget_never_displaces_a_running_decode() -> None:
    """With a step budget of one token per running request, every decode is still scheduled
    (the drafts get nothing)."""
    seen = []

    def check(sched: Scheduler, batch: ScheduledBatch) -> None:
        if len(sched.running) == 4 and all(r.seq_len - r.num_computed_tokens == 1 for r in sched.running):
            seen.append(batch)
            assert len(batch.items) == 4 and all(it.draft_budget == 0 for it in batch.items)

    prompts = [[1 + i, 2, 3] for i in range(4)]
    run_workload(4, prompts, [6] * 4, 1, 200, 4, check)
    assert seen


def _drafting(num_pages: int, prompt_len: int, max_new: int) -> tuple[Scheduler, FakeRunner, Request]:
    """A scheduler over ``num_pages`` pages (page size 1) whose one request (``max_new`` tokens) has
    prefilled a prompt of ``prompt_len`` tokens."""
    kv = make_pool(num_pages, 1)
    radix = RadixCache(kv.allocator, 1)
    table = ReqToTokenTable(2, 64)
    sched = Scheduler(SchedulerConfig(64, 2, 64, num_speculative_tokens=5), kv.allocator, radix, table, StopChecker([EOS], None))
    runner = FakeRunner(kv, table, VOCAB)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    (req,) = sched.new_request(list(range(1, 1 + prompt_len)), params, 1, VOCAB)
    batch = sched.schedule()  # prefill
    sched.update(batch, runner.run(batch))
    return sched, runner, req


def test_draft_slots_are_a_run_kept_while_the_pool_has_room() -> None:
    """A drafting request reserves a run of slots (``KVLedger.decode_run``) and keeps its unused ones
    after the step: its next steps reserve nothing."""
    sched, runner, req = _drafting(100, 3, 20)
    alloc = sched.ledger.allocator
    for step in range(3):
        free = alloc.num_free
        batch = sched.schedule()
        assert batch.items[0].draft_budget == 5 and sched.ledger.capacity(req) >= req.seq_len + 5
        if step:
            assert alloc.num_free == free, "the run already held the draft's slots"
        sched.update(batch, runner.run(batch))
        assert alloc.num_free >= alloc.capacity // 4 and sched.ledger.capacity(req) > req.seq_len
        sched.check_invariants()


def test_unused_draft_slots_are_freed_when_the_pool_is_short() -> None:
    """Under a quarter of the pool free at a drafting step's commit, its unused and rejected slots go back."""
    sched, runner, req = _drafting(15, 6, 8)
    alloc = sched.ledger.allocator
    batch = sched.schedule()
    assert batch.items[0].draft_budget == 5 and sched.ledger.capacity(req) == req.seq_len + 5  # no run: short pool
    assert alloc.num_free < alloc.capacity // 4  # and still so at the commit, which frees
    sched.update(batch, runner.run(batch))
    assert sched.ledger.capacity(req) == req.seq_len, "only the committed tokens keep slots"
    sched.check_invariants()


@pytest.mark.parametrize("limit", [0, 2, 3])
def test_batch_heavy_steps_ask_for_no_drafts(limit: int) -> None:
    """``speculative_max_batch``: a step with more decoding requests than the limit gives no
    item a draft budget; at or under it (or with no limit, 0) every decode gets one."""
    sched, runner, batch = first_decode_step(3, SchedulerConfig(256, 4, 64, num_speculative_tokens=2,
                                                                speculative_max_batch=limit))
    budgets = [it.draft_budget for it in batch.items]
    assert budgets == ([0, 0, 0] if limit == 2 else [2, 2, 2])
    sched.update(batch, runner.run(batch))
    sched.check_invariants()


@pytest.mark.parametrize("speculative", [0, 2])
def test_decodes_that_draft_nothing_keep_their_slot_runs(speculative: int) -> None:
    """With speculation on or off, a decode step over the draft batch limit (nothing drafted) gives
    each request a run of consecutive slots (``KVLedger.decode_run``), which later steps use in
    order: its K/V rows stay one stream, not one row every ``len(batch)`` slots."""
    sched, runner, batch = first_decode_step(3, SchedulerConfig(256, 4, 64, num_speculative_tokens=speculative,
                                                                speculative_max_batch=2))
    for _ in range(4):
        assert all(it.draft_budget == 0 for it in batch.items)
        sched.update(batch, runner.run(batch))
        sched.check_invariants()
        batch = sched.schedule()
    for req in sched.running:
        slots = sched.ledger.table.table[req.row, : req.seq_len].tolist()
        decoded = slots[3:]  # the pending and decoded tokens' slots, after the 3 prompt tokens
        assert decoded == list(range(decoded[0], decoded[0] + len(decoded))), slots


def first_decode_step(n: int, config: SchedulerConfig) -> tuple[Scheduler, FakeRunner, ScheduledBatch]:
    """A scheduler under ``config`` with ``n`` short requests prefilled, and its first step of
    ``n`` decodes (not yet run)."""
    kv = make_pool(200, 1)
    table = ReqToTokenTable(4, 64)
    sched = Scheduler(config, kv.allocator, RadixCache(kv.allocator, 1), table, StopChecker([EOS], None))
    runner = FakeRunner(kv, table, VOCAB)
    for i in range(n):
        sched.new_request([1 + i, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True), 1, VOCAB)
    batch = sched.schedule()  # the prefills
    sched.update(batch, runner.run(batch))
    batch = sched.schedule()
    assert len(batch.items) == n
    return sched, runner, batch


def test_speculative_max_batch_is_checked() -> None:
    with pytest.raises(ValueError, match="speculative_max_batch must be >= 0"):
        SchedulerConfig(num_speculative_tokens=2, speculative_max_batch=-1)


@pytest.mark.parametrize(("jump", "spec_k", "expect"), [(4, 0, 2), (1, 0, 1), (0, 0, 0), (4, 5, 5), (0, 2, 2)])
def test_a_grammar_that_forces_tokens_asks_for_a_jump_forward_draft(jump: int, spec_k: int, expect: int) -> None:
    """A structured request whose grammar forces its next 2 tokens asks for a draft of
    ``max(num_speculative_tokens, forced)`` with jump-forward on (capped by
    ``jump_forward_tokens``), speculation or not; an unconstrained request only for speculation."""
    from treeserve.sampling import GrammarCompiler, StructuredOutput

    names = ["<eos>", "a", "b", "c", "d"] + [f"t{i}" for i in range(VOCAB - 5)]
    compiler = GrammarCompiler(names, VOCAB, [0], vocab_type="raw")
    kv = make_pool(200, 1)
    radix = RadixCache(kv.allocator, 1)
    table = ReqToTokenTable(4, 64)
    config = SchedulerConfig(256, 4, 64, num_speculative_tokens=spec_k, jump_forward_tokens=jump)
    sched = Scheduler(config, kv.allocator, radix, table, StopChecker([EOS], None))
    spec = StructuredOutput(regex="abc(a|d)+")
    (constrained,) = sched.new_request([1, 2, 3], SamplingParams(max_new_tokens=20, structured=spec), 1, VOCAB)
    constrained.grammar = compiler.new_state(spec)
    (free,) = sched.new_request([2, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True), 1, VOCAB)
    batch = sched.schedule()  # the prefills, each committing one token: "a" for the grammar
    assert [it.draft_budget for it in batch.items] == [0, 0]
    sched.update(batch, [SampledToken(1, 0.0, None), SampledToken(5, 0.0, None)])
    assert constrained.grammar.jump_forward(8) == [2, 3]  # "bc" is forced
    batch = sched.schedule()
    assert [it.draft_budget for it in batch.items] == [expect, spec_k]
    sched.abort(constrained)
    sched.abort(free)
    sched.check_invariants()


def test_jump_forward_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match="jump_forward_tokens must be >= 0"):
        SchedulerConfig(jump_forward_tokens=-1)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_step_of_decodes_grows_by_every_draft_its_room_allows(n: int) -> None:
    """With rows free (row cost 0), each of ``n`` decodes drafts its whole room: no row count caps a
    step's drafts (the runner computes draft rows on the plain rows' path, ``quant.plain_rows``)."""
    sched, runner, batch = first_decode_step(n, SchedulerConfig(256, 4, 64, num_speculative_tokens=4))
    assert [it.draft_budget for it in batch.items] == [4] * n
    sched.update(batch, runner.run(batch))
    sched.check_invariants()