"""The large batches' weights fit a memory budget (issue 33): a model whose projections hold more
weights than ``large_tier_budget()`` bytes runs its codes for every batch, as the lean configuration
(``TREESERVE_PACKED_MAX_ROWS=all``) does, bitwise up to the measured row count above which its large
batches take the codes with int8 activations; ``TREESERVE_INT8=1`` still forces the int8 tier;
a group whose dense large-batch weights would not fit what is left keeps its codes; bad values of
the override are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treeserve._tuning import clear_memo
from treeserve.models import load, quant
from treeserve.models.gguf_op import q8_lanes
from treeserve.models.quant import PackedLinear, large_tier_budget
from treeserve.models.synthetic_gguf import SyntheticSpec, write_synthetic_gguf
from treeserve.runner import PagedSequence

OVERRIDES = ("TREESERVE_PACKED_MAX_ROWS", "TREESERVE_INT8", "TREESERVE_LARGE_TIER_BYTES", "TREESERVE_EXACT_HEAD",
             "TREESERVE_HEAD_PACKED_MAX_ROWS", "TREESERVE_HEAD_ROWS_MAX_ROWS")
SPEC = SyntheticSpec("llama", 2, 128, 4, 2, 192, 320, True, False, 500000.0, 256)


@pytest.fixture
def gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for env in OVERRIDES:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "cache"))
    clear_memo()
    yield write_synthetic_gguf(tmp_path / "m.gguf", SPEC, "Q4_0", seed=3)
    clear_memo()


def _packed(model: torch.nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """A 20-token prompt (a large batch) and two one-token steps."""
    with torch.inference_mode():
        seq = PagedSequence(model, 64, page_size=4)
        return [seq.extend(list(range(30, 50)), all_logits=True), seq.extend([61]), seq.extend([62])]


def test_the_default_budget_is_a_quarter_of_physical_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREESERVE_LARGE_TIER_BYTES", raising=False)
    total = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                     if ln.startswith("MemTotal:"))) * 1024
    assert abs(large_tier_budget() - total // 4) <= total // 400  # MemTotal leaves out the kernel's reserve
    monkeypatch.setenv("TREESERVE_LARGE_TIER_BYTES", "12345")
    assert large_tier_budget() == 12345


@pytest.mark.parametrize("bad", ["-1", "1.5", "lots", ""])
def test_a_bad_budget_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("TREESERVE_LARGE_TIER_BYTES", bad)
    with pytest.raises(ValueError, match="TREESERVE_LARGE_TIER_BYTES"):
        large_tier_budget()


def test_a_model_over_the_budget_runs_its_codes_for_every_batch(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the budget, with the int8-activation path above 8 rows (``TREESERVE_PACKED_MAX_ROWS=8``,
    as a measurement may choose): nothing but the codes is ever built; steps of up to 8 rows are the
    lean configuration's bit for bit, the 20-row prompt is within the int8 rounding of it."""
    monkeypatch.setenv("TREESERVE_LARGE_TIER_BYTES", "0")
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "8")
    model, _ = load(gguf, quantization="auto")
    packed = _packed(model)
    assert packed and all(m.packed_max_rows == 8 and m.large_q8 for m in packed)
    assert not any(m.large_pending or m.int8 is not None or m.has_dense for m in packed)
    got = _logits(model)
    assert not any(m.large_pending or m.int8 is not None or m.has_dense for m in packed)  # the prompt built nothing

    monkeypatch.delenv("TREESERVE_LARGE_TIER_BYTES")
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    lean, _ = load(gguf, quantization="auto")
    assert not any(m.large_q8 for m in _packed(lean))
    want = _logits(lean)
    assert not torch.equal(got[0], want[0])  # the prompt took the int8 activations
    assert float((got[0] - want[0]).abs().max()) < 0.05 * float(want[0].abs().max())
    with torch.inference_mode():  # one-row steps of a fresh sequence: the int16 path, bitwise
        a, b = PagedSequence(model, 64, page_size=4), PagedSequence(lean, 64, page_size=4)
        for tok in (30, 31, 32):
            assert torch.equal(a.extend([tok]), b.extend([tok]))


def test_over_the_budget_the_int8_activation_rows_are_measured(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an override the row count where the int8-activation path takes over is measured per
    group (kept in the measurement cache): at least 1 when it is ever faster (a single stream keeps
    int16), else every batch on the int16 path (always, on a host without VNNI); a second load reads
    the same choice back."""
    monkeypatch.setenv("TREESERVE_LARGE_TIER_BYTES", "0")
    packed = _packed(load(gguf, quantization="auto")[0])
    for m in packed:
        assert m.large_q8 == (m.packed_max_rows < quant._ALL_ROWS) and m.packed_max_rows >= 1
    if not q8_lanes():  # no vector kernel on this host: its scalar loop is neither measured nor taken
        assert not any(m.large_q8 for m in packed)
    clear_memo()
    again = _packed(load(gguf, quantization="auto")[0])
    assert [(m.packed_max_rows, m.large_q8) for m in again] == [(m.packed_max_rows, m.large_q8) for m in packed]


def test_int8_forced_ignores_the_budget(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREESERVE_LARGE_TIER_BYTES", "0")
    monkeypatch.setenv("TREESERVE_INT8", "1")
    packed = _packed(load(gguf, quantization="auto")[0])
    assert packed and all(m.large_int8 for m in packed)


def test_a_group_whose_dense_weights_do_not_fit_what_is_left_keeps_its_codes(
        gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = 2 * (128 * 128 + 2 * 64 * 128 + 128 * 128 + 2 * 192 * 128 + 128 * 192)  # every projection of SPEC
    monkeypatch.setenv("TREESERVE_LARGE_TIER_BYTES", str(weights))  # the model fits at a byte per weight
    monkeypatch.setenv("TREESERVE_INT8", "0")  # dense large-batch weights: 4 bytes per weight
    packed = _packed(load(gguf, quantization="auto")[0])
    assert sum(m.in_features * m.out_features for m in packed) == weights
    wide = [m for m in packed if m.in_features == 128]  # 4 x 196,608 bytes > the budget
    down = [m for m in packed if m.in_features == 192]  # 4 x 49,152 bytes fit
    assert wide and all((m.packed_max_rows == quant._ALL_ROWS) != m.large_q8 and not m.large_pending for m in wide)
    # built (the crossover's measurement ran a large batch) or deferred: dense either way
    assert down and all((m.large_pending or m.has_dense) and not m.large_int8 for m in down)
    assert all(m.packed_max_rows <= 128 for m in down)


@pytest.mark.parametrize(("rows", "expect"), [("8", {8}), ("all", {quant._ALL_ROWS}), ("2", {2}), ("0", {0})])
def test_the_packed_rows_override_reaches_every_projection(
        gguf: Path, monkeypatch: pytest.MonkeyPatch, rows: str, expect: set[int]) -> None:
    """``TREESERVE_PACKED_MAX_ROWS``: every projection's ``packed_max_rows`` (``all``: the codes
    serve every batch)."""
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", rows)
    model, _ = load(gguf, quantization="auto")
    assert {m.packed_max_rows for m in _packed(model)} == expect


def test_codes_that_serve_large_batches_as_fast_keep_no_large_weights(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``use_codes_large``: where the codes with int8 activations are measured at least as fast as the
    large-batch weights, a group under the budget makes none (no int8 copy, no dense weight, nothing
    deferred) and reads its codes for every batch, bitwise the lean configuration up to the row count
    ``use_q8_large`` measured; where they are slower, the weights are made as before. The choice is
    measured once (a second load times nothing), never without the vector kernel, and an explicit
    ``TREESERVE_INT8`` keeps its own choice untimed."""
    timed: list[int] = []
    best = quant._best_seconds
    monkeypatch.setattr(quant, "_best_seconds", lambda fn, reps=5: timed.append(1) or best(fn, reps))
    group = [m for m in _packed(load(gguf, quantization="auto")[0]) if m.in_features == 128]
    assert timed  # the load measured
    timed.clear()
    choice = quant.use_codes_large(group)
    assert timed == [] and choice == quant.use_codes_large(group)  # pack_model measured it: cached
    clear_memo()  # a new process: the disk cache only
    assert quant.use_codes_large(group) == choice and timed == []
    monkeypatch.setattr(quant, "q8_lanes", lambda: False)
    assert not quant.use_codes_large(group)
    monkeypatch.undo()
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(gguf.parent / "cache"))
    for env in ("0", "1"):
        monkeypatch.setenv("TREESERVE_INT8", env)
        assert not quant.use_codes_large(group)
    monkeypatch.delenv("TREESERVE_INT8")

    for codes in (True, False):
        monkeypatch.setattr(quant, "use_codes_large", lambda layers, rows=64, codes=codes: codes)
        monkeypatch.setattr(quant, "use_int8", lambda layers, rows=64, defer=False: False)  # else dense weights
        model = load(gguf, quantization="auto")[0]
        packed = _packed(model)
        for m in packed:
            assert m.int8 is None and not m.large_int8
            if codes:
                assert not (m.large_pending or m.has_dense) and m.large_q8 == (m.packed_max_rows < quant._ALL_ROWS)
            else:
                assert m.large_pending or m.has_dense
        if codes:
            rows = {m.packed_max_rows for m in packed}
            monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
            lean = load(gguf, quantization="auto")[0]
            monkeypatch.delenv("TREESERVE_PACKED_MAX_ROWS")
            with torch.inference_mode():  # one-row steps: the int16 path on both, bitwise
                a, b = PagedSequence(model, 64, page_size=4), PagedSequence(lean, 64, page_size=4)
                for tok in (30, 31, 32):
                    assert torch.equal(a.extend([tok]), b.extend([tok]))
            assert all(r >= 1 for r in rows)
