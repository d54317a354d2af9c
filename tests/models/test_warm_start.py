"""A warm start (issue 33): a second load of a GGUF file takes no load-time measurement and builds no
dense weight or int8 copy beyond what it keeps (the large batches' weights not before the first large
batch, from the int8 cache then), computes bitwise what the first load computed, and a damaged cache is
rebuilt. Counted, never timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treeserve._tuning import clear_memo
from treeserve.models import int8_cache, load, quant
from treeserve.models.gguf_op import GGUFWeight
from treeserve.models.quant import ExactHead, PackedLinear, prepare_large_weights
from treeserve.models.synthetic_gguf import SyntheticSpec, write_synthetic_gguf
from treeserve.runner import PagedSequence

OVERRIDES = ("TREESERVE_PACKED_MAX_ROWS", "TREESERVE_INT8", "TREESERVE_EXACT_HEAD", "TREESERVE_HEAD_PACKED_MAX_ROWS",
             "TREESERVE_HEAD_ROWS_MAX_ROWS", "TREESERVE_INT8_CACHE")
SPEC = SyntheticSpec("llama", 2, 128, 4, 2, 192, 320, True, False, 500000.0, 256)


class Counts:
    """What a load does that a warm start should not repeat: timed measurements (``_best_seconds``),
    int8 roundings (``round_rotated``) and dequantizations of whole weights (``GGUFWeight.dequantize``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.timings = self.roundings = self.dequantized = 0
        best, rounded, dequantize = quant._best_seconds, int8_cache.round_rotated, GGUFWeight.dequantize

        def timed(fn, reps=5):  # type: ignore[no-untyped-def]
            self.timings += 1
            return best(fn, reps)

        def rounding(w):  # type: ignore[no-untyped-def]
            self.roundings += 1
            return rounded(w)

        def dequantizing(w, dtype=torch.float32):  # type: ignore[no-untyped-def]
            self.dequantized += 1
            return dequantize(w, dtype)

        monkeypatch.setattr(quant, "_best_seconds", timed)
        monkeypatch.setattr(int8_cache, "round_rotated", rounding)
        monkeypatch.setattr(GGUFWeight, "dequantize", dequantizing)


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of a 20-token prompt (the large-batch path) and three one-token steps (the packed one)."""
    with torch.inference_mode():
        seq = PagedSequence(model, 64, page_size=4)
        out = [seq.extend(list(range(30, 50)), all_logits=True)]
        out += [seq.extend([60 + i]) for i in range(3)]
    return out


def _kept_dense(model: torch.nn.Module) -> int:
    """Dense weights a load keeps that it must dequantize: projections holding theirs, and the float32
    head (shared with the tied embedding)."""
    return sum(isinstance(m, PackedLinear) and m.has_dense for m in model.modules()) + isinstance(model.lm_head, ExactHead)


def test_a_warm_start_measures_nothing_builds_only_what_it_keeps_and_computes_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for env in OVERRIDES:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_synthetic_gguf(tmp_path / "m.gguf", SPEC, "Q4_1", seed=5)
    clear_memo()
    try:
        cold_counts = Counts(monkeypatch)
        cold, _ = load(path, quantization="auto")
        assert cold_counts.timings > 0
        expected = _logits(cold)
        int8_layers = sum(isinstance(m, PackedLinear) and m.large_int8 for m in cold.modules())  # built or deferred

        clear_memo()  # a new process: the disk cache only
        warm_counts = Counts(monkeypatch)
        warm, _ = load(path, quantization="auto")
        assert warm_counts.timings == 0 and warm_counts.roundings == 0
        assert warm_counts.dequantized == _kept_dense(warm)
        packed = [m for m in warm.modules() if isinstance(m, PackedLinear)]
        assert all(m.int8 is None and not m.has_dense for m in packed)  # built at the first large batch
        # deferred wherever large batches need weights of their own (none where the codes serve them)
        assert all(m.large_pending or m.large_q8 or m.packed_max_rows == quant._ALL_ROWS for m in packed)
        assert sum(m.large_int8 for m in packed) == int8_layers
        for a, b in zip(expected, _logits(warm), strict=True):
            assert torch.equal(a, b)
        assert not any(m.large_pending for m in packed if m.packed_max_rows < 20)  # the 20-token prompt built them
        pending = sum(m.large_pending for m in packed)  # the groups whose packed path serves 20 rows too
        assert prepare_large_weights(warm) == pending and not any(m.large_pending for m in packed)
        assert prepare_large_weights(warm) == 0
        assert sum(m.int8 is not None for m in packed) == int8_layers  # from the int8 cache: no rounding
        assert warm_counts.timings == 0 and warm_counts.roundings == 0

        damaged = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        assert damaged
        for p in damaged:  # truncated: neither JSON nor a torch file
            p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
        clear_memo()
        rebuilt_counts = Counts(monkeypatch)
        rebuilt, _ = load(path, quantization="auto")
        assert rebuilt_counts.timings > 0
        assert rebuilt_counts.roundings >= sum(isinstance(m, PackedLinear) and m.int8 is not None
                                               for m in rebuilt.modules())
        clear_memo()  # the rebuilt entries serve the next start whole
        again_counts = Counts(monkeypatch)
        load(path, quantization="auto")
        assert again_counts.timings == 0 and again_counts.roundings == 0
    finally:
        clear_memo()
