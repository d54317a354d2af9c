"""``speculative="auto"`` (the default) and the measured row cost the draft planner runs on."""

from __future__ import annotations

import pytest
import torch

import treeserve.engine as engine_module
from treeserve import LLM
from treeserve._tuning import clear_memo
from treeserve.engine import EngineConfig
from treeserve.kvcache import KVPool
from treeserve.models import random_model, tiny_config
from treeserve.runner import measure_draft_cost, measure_step_costs, row_cost_of
from treeserve.runner.step_cost import MAX_ROW_COST, ROW_COST_CONTEXT


def test_auto_resolves_where_it_was_measured() -> None:
    cfg = EngineConfig()
    assert cfg.speculative == "auto"
    assert cfg.resolved_speculative(loaded=True) == "ngram"  # a model loaded by name, on CPU
    assert cfg.resolved_speculative(loaded=False) is None  # a given module decodes plainly
    assert EngineConfig(batch_invariant=True).resolved_speculative(loaded=True) is None
    assert EngineConfig(speculative="draft:self:2").resolved_speculative(loaded=True) == "draft:self:2"
    assert EngineConfig(speculative=None).resolved_speculative(loaded=True) is None


@pytest.mark.parametrize("name", ["speculative_row_cost", "speculative_draft_cost"])
@pytest.mark.parametrize("bad", [-0.5, float("inf"), float("nan"), True, "1"])
def test_bad_costs_are_refused(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be None or a finite number >= 0"):
        EngineConfig(**{name: bad})


def test_given_module_keeps_plain_decoding_and_an_explicit_cost_reaches_the_scheduler() -> None:
    model = random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0, init_std=0.3)
    plain = LLM((model, None), kv_cache_tokens=512, max_model_len=128)
    assert plain.config.speculative is None and plain.drafter is None
    assert plain.scheduler.config.num_speculative_tokens == 0
    spec = LLM((model, None), kv_cache_tokens=512, max_model_len=128, speculative="ngram", speculative_row_cost=0.25)
    assert spec.scheduler.config.speculative_row_cost == 0.25
    free = LLM((model, None), kv_cache_tokens=512, max_model_len=128, speculative="ngram")
    assert free.scheduler.config.speculative_row_cost == 0.0  # nothing measured for a given module


def test_row_cost_is_measured_once_and_gives_the_pages_back(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path))
    clear_memo()
    model = random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0)
    c = model.config
    kv = KVPool(c.num_layers, 64, 4, c.num_kv_heads, c.head_dim, torch.float32)
    calls = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a: calls.append(a[0].numel()) or real(*a))
    free = kv.allocator.num_free
    costs = measure_step_costs(model, kv, 5)
    assert len(costs) == 5 and costs[0] == 1.0 and list(costs) == sorted(costs)
    assert all(1.0 <= c <= r * MAX_ROW_COST for r, c in enumerate(costs, 1))
    assert 0.0 <= row_cost_of(costs) <= MAX_ROW_COST
    assert kv.allocator.num_free == free
    assert set(calls) == {1, 2, 3, 4, 5}, "forwards of one to five rows, nothing else"
    n = len(calls)
    clear_memo()  # from the disk entry now
    assert measure_step_costs(model, kv, 5) == costs and len(calls) == n
    clear_memo()


@pytest.mark.parametrize(("costs", "rho"), [((1.0, 1.5), 1.0), ((1.0, 1.2, 1.5, 1.7, 2.5), 0.6), ((1.0, 2.0), 20.0),
                                            ((1.0, 1.0, 1.0), 0.0)])
def test_the_line_through_a_table(costs: tuple[float, ...], rho: float) -> None:
    """``row_cost_of``: ``T(r) / T(1) = (1 + r rho) / (1 + rho)`` at the table's last entry; a step
    of r rows costing r one-row steps (nothing fixed) is ``MAX_ROW_COST``."""
    assert row_cost_of(costs) == pytest.approx(min(rho, MAX_ROW_COST))


def test_a_small_kv_pool_measures_a_shorter_context(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM`` on a pool smaller than the usual measured context (``ROW_COST_CONTEXT`` + rows) measures
    the row cost after as many tokens as the pool can lend, and a pool that cannot lend one gets
    ``MAX_ROW_COST``: neither fails (the measurement's own ``ValueError``)."""
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path))
    clear_memo()
    model = random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0)
    seen = []

    def spy(m, kv, rows, context=ROW_COST_CONTEXT):  # noqa: ANN001, ANN202
        seen.append((kv.allocator.num_free * kv.page_size, rows, context))
        return measure_step_costs(m, kv, rows, context)

    monkeypatch.setattr(engine_module, "measure_step_costs", spy)
    monkeypatch.setattr(EngineConfig, "measured_setting", lambda self, loaded: True)  # as for a model loaded by name
    small = LLM((model, None), kv_cache_tokens=64, max_model_len=48, speculative="ngram")
    free, rows, context = seen[-1]
    assert rows == 1 + small.config.num_speculative_tokens and context == free - rows < ROW_COST_CONTEXT
    sc = small.scheduler.config
    assert 0.0 <= sc.speculative_row_cost <= MAX_ROW_COST and len(sc.speculative_step_costs) == rows
    assert sc.speculative_row_cost == row_cost_of(sc.speculative_step_costs)
    large = LLM((model, None), kv_cache_tokens=1024, max_model_len=128, speculative="ngram")
    assert seen[-1][2] == ROW_COST_CONTEXT and large.scheduler.config.speculative_row_cost <= MAX_ROW_COST
    n = len(seen)
    tiny = LLM((model, None), kv_cache_tokens=4, max_model_len=4, speculative="ngram", num_speculative_tokens=4)
    assert len(seen) == n and tiny.scheduler.config.speculative_row_cost == MAX_ROW_COST
    assert tiny.scheduler.config.speculative_step_costs == ()
    clear_memo()


@pytest.mark.parametrize(("k", "rows"), [(4, 5), (1, 2), (7, 8), (8, 9), (16, 9)])
def test_row_cost_rows_are_a_lone_requests_verify_step(k: int, rows: int) -> None:
    assert engine_module.row_cost_rows(k) == rows


def test_row_cost_bad_input() -> None:
    model = random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0)
    c = model.config
    kv = KVPool(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, torch.float32)
    with pytest.raises(ValueError, match="rows must be an int >= 2"):
        measure_step_costs(model, kv, 1)
    with pytest.raises(ValueError, match="needs 34 free KV pages, the pool has 7"):
        measure_step_costs(model, kv, 5)


def test_draft_cost_is_measured_for_a_draft_model_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter that runs a model gets its measured cost per node where the row cost is measured
    (``measure_draft_cost``: its one-token forward over the target's, times ``1 + row_cost``; the
    pages of both pools given back, kept on disk); n-gram drafts and given costs get none measured."""
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path))
    clear_memo()
    model = random_model(tiny_config("llama", num_layers=4, eos_token_ids=(2,)), seed=0)
    c = model.config
    monkeypatch.setattr(EngineConfig, "measured_setting", lambda self, loaded: True)  # as for a model loaded by name
    seen = []
    real = engine_module.measure_draft_cost

    def spy(*args):  # noqa: ANN002, ANN202
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(engine_module, "measure_draft_cost", spy)
    llm = LLM((model, None), kv_cache_tokens=512, max_model_len=128, speculative="draft:self:2")
    sched = llm.scheduler.config
    assert len(seen) == 1 and seen[0][2] is llm.drafter.model and seen[0][4] == sched.speculative_row_cost
    assert 0.0 < sched.speculative_draft_cost <= MAX_ROW_COST
    assert llm.kv.allocator.num_free == llm.kv.allocator.num_pages - 1  # all but the dummy page given back
    assert llm.drafter.kv.allocator.num_free == llm.drafter.kv.allocator.num_pages - 1
    ratio = sched.speculative_draft_cost / (1 + sched.speculative_row_cost)
    clear_memo()  # from the disk entry now: the same ratio, scaled by the given row cost
    again = measure_draft_cost(model, llm.kv, llm.drafter.model, llm.drafter.kv, 1.0, seen[0][5])
    assert again == pytest.approx(2 * ratio, abs=2e-3)
    assert LLM((model, None), kv_cache_tokens=512, max_model_len=128, speculative="ngram").scheduler.config.speculative_draft_cost == 0.0
    given = LLM((model, None), kv_cache_tokens=512, max_model_len=128, speculative="draft:self:2", speculative_draft_cost=0.7)
    assert given.scheduler.config.speculative_draft_cost == 0.7 and len(seen) == 1
    with pytest.raises(ValueError, match="row_cost must be a finite number >= 0"):
        measure_draft_cost(model, llm.kv, llm.drafter.model, llm.drafter.kv, -1.0)
    with pytest.raises(ValueError, match="context must be an int >= 1"):
        measure_draft_cost(model, llm.kv, llm.drafter.model, llm.drafter.kv, 0.5, 0)
    small = KVPool(2, 8, 1, c.num_kv_heads, c.head_dim, torch.float32)  # 7 free pages; the entry is kept
    with pytest.raises(ValueError, match="measuring the draft cost needs 129 free KV pages, the pool has 7"):
        measure_draft_cost(model, llm.kv, llm.drafter.model, small, 0.5, seen[0][5])
    clear_memo()
