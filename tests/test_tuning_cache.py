"""The on-disk cache of load-time measurements (``treeserve._tuning``) and its use by ``models.quant``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from hypothesis import given
from hypothesis import strategies as st

from treeserve import _tuning
from treeserve._tuning import CACHE_VERSION, cache_dir, clear_memo, entry_path, host_key, measured
from treeserve.models import quant
from treeserve.models.gguf_op import GGUFWeight
from treeserve.models.quant import ExactHead, PackedLinear, measure_crossover


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder and an empty process memo (restored after the test)."""
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "cache"))
    clear_memo()
    yield tmp_path / "cache"
    clear_memo()


class Counter:
    """A measurement that returns ``value`` and counts its calls."""

    def __init__(self, value: int | bool | tuple) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> int | bool | tuple:
        self.calls += 1
        return self.value


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TREESERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "treeserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "treeserve"
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_the_suite_never_uses_a_real_cache() -> None:
    assert Path(_tuning.cache_dir()).name.startswith("treeserve-test-cache-")


@given(value=st.one_of(st.booleans(), st.integers(0, 2**62)), key=st.lists(st.integers(0, 9), max_size=4))
def test_a_hit_skips_the_measurement(value: int | bool, key: list[int]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREESERVE_CACHE_DIR", tempfile.mkdtemp(dir=_tuning.cache_dir()))  # empty per example
        clear_memo()
        kind_type = type(value)
        first = Counter(value)
        assert measured("probe", tuple(key), kind_type, first) == value
        clear_memo()  # a new process: the value comes from disk
        again = Counter(not value if kind_type is bool else value + 1)
        assert measured("probe", tuple(key), kind_type, again) == value
        assert measured("probe", tuple(key), kind_type, again) == value  # and then from the memo
        assert again.calls == 0
        clear_memo()


def test_entry_format(cache: Path) -> None:
    measured("probe", (3, "x"), int, Counter(17))
    path = entry_path("probe", ["3", "x", *host_key()])
    assert path.parent == cache / "measurements"
    entry = json.loads(path.read_text())
    # an instant measurement is too short to judge the CPUs' sharing: 0.0
    assert entry == {"version": CACHE_VERSION, "kind": "probe", "key": ["3", "x", *host_key()], "value": 17,
                     "interference": 0.0, "tries": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda e: "{not json",
        lambda e: json.dumps({**e, "version": CACHE_VERSION + 1}),
        lambda e: json.dumps({**e, "value": "17"}),
        lambda e: json.dumps({**e, "value": True}),  # a bool where an int is measured
        lambda e: json.dumps({**e, "key": e["key"][:-1]}),  # another key under this name
        lambda e: json.dumps({**e, "kind": "other"}),
        lambda e: json.dumps([e]),
        lambda e: "",
        lambda e: json.dumps({k: v for k, v in e.items() if k != "interference"}),
        lambda e: json.dumps({**e, "interference": "0"}),
        lambda e: json.dumps({**e, "interference": -0.1}),
        lambda e: json.dumps({**e, "interference": 1.5}),
        lambda e: json.dumps({**e, "tries": 0}),
        lambda e: json.dumps({**e, "tries": True}),
        lambda e: json.dumps({**e, "tries": 1.0}),
    ],
)
def test_a_corrupt_or_stale_entry_is_measured_again(cache: Path, corrupt) -> None:
    first = Counter(17)
    measured("probe", (1,), int, first)
    path = entry_path("probe", ["1", *host_key()])
    path.write_text(corrupt(json.loads(path.read_text())))
    clear_memo()
    again = Counter(23)
    assert measured("probe", (1,), int, again) == 23 and again.calls == 1
    assert json.loads(path.read_text())["value"] == 23  # rewritten


def test_a_key_change_is_measured_again(cache: Path) -> None:
    count = Counter(5)
    measured("probe", (1,), int, count)
    measured("probe", (2,), int, count)  # another shape
    measured("other", (1,), int, count)  # another kind of measurement
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count
        measured("probe", (1,), int, count)
    finally:
        torch.set_num_threads(threads)
    assert count.calls == 4
    measured("probe", (1,), int, count)
    assert count.calls == 4


@given(shares=st.lists(st.floats(0, 1), min_size=_tuning.MAX_TRIES, max_size=_tuning.MAX_TRIES),
       kind_type=st.sampled_from([int, bool]))
def test_a_measurement_taken_while_the_cpus_were_shared_is_taken_again(shares: list[float], kind_type: type) -> None:
    """Starts (a new process each) re-measure while every measurement so far was disturbed, at most
    MAX_TRIES in all; each start returns the value of the least disturbed measurement so far."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREESERVE_CACHE_DIR", tempfile.mkdtemp(dir=_tuning.cache_dir()))
        mp.delenv("TREESERVE_REMEASURE_SHARE")  # the default limit (the suite keeps every measurement)
        scripted = iter(shares)
        mp.setattr(_tuning, "interference", lambda fn: (fn(), next(scripted)))
        measurements: list[tuple[int | bool, float]] = []
        kept: tuple[int | bool, float] | None = None
        for start in range(_tuning.MAX_TRIES + 2):
            clear_memo()
            count = len(measurements)
            value = count % 2 == 1 if kind_type is bool else 100 + count  # what this start would measure
            probe = Counter(value)
            got = measured("probe", (), kind_type, probe)
            should = not measurements or (kept[1] > _tuning.INTERFERENCE_LIMIT and count < _tuning.MAX_TRIES)
            assert probe.calls == should, (start, measurements)
            if should:
                measurements.append((value, shares[count]))
                if kept is None or not kept[1] < shares[count]:
                    kept = measurements[-1]
            assert got == kept[0] and measured("probe", (), kind_type, probe) == got  # then from the memo
            assert probe.calls == should
        clear_memo()


def test_a_measurement_is_timed_with_the_cpus_load(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The share that other work took is stored with the value; a disturbed entry is re-measured."""
    monkeypatch.delenv("TREESERVE_REMEASURE_SHARE")
    monkeypatch.setattr(_tuning, "interference", lambda fn: (fn(), 0.6))
    measured("probe", (1,), int, Counter(40))
    path = entry_path("probe", ["1", *host_key()])
    assert json.loads(path.read_text())["interference"] == 0.6
    clear_memo()
    monkeypatch.setattr(_tuning, "interference", lambda fn: (fn(), 0.1))
    quiet = Counter(30)
    assert measured("probe", (1,), int, quiet) == 30 and quiet.calls == 1
    entry = json.loads(path.read_text())
    assert (entry["value"], entry["interference"], entry["tries"]) == (30, 0.1, 2)
    clear_memo()
    assert measured("probe", (1,), int, quiet) == 30 and quiet.calls == 1  # quiet now: kept for good


@pytest.mark.parametrize("share, remeasured", [("0.7", False), ("0.5", True), ("1", False), ("0", True)])
def test_the_limit_can_be_set(cache: Path, monkeypatch: pytest.MonkeyPatch, share: str, remeasured: bool) -> None:
    monkeypatch.setenv("TREESERVE_REMEASURE_SHARE", share)
    monkeypatch.setattr(_tuning, "interference", lambda fn: (fn(), 0.6))
    measured("probe", (1,), int, Counter(1))
    clear_memo()
    again = Counter(2)
    assert measured("probe", (1,), int, again) == (2 if remeasured else 1) and again.calls == remeasured


@pytest.mark.parametrize("bad", ["x", "-0.1", "1.5", "nan", ""])
def test_a_bad_limit_names_the_variable(cache: Path, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("TREESERVE_REMEASURE_SHARE", bad)
    with pytest.raises(ValueError, match=r"TREESERVE_REMEASURE_SHARE must be a number in \[0, 1\]"):
        measured("probe", (1,), int, Counter(1))


def test_a_cache_that_cannot_be_written_still_measures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(blocker))
    clear_memo()
    count = Counter(3)
    assert measured("probe", (1,), int, count) == 3
    clear_memo()
    assert measured("probe", (1,), int, count) == 3 and count.calls == 2
    clear_memo()


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_interrupted_write_leaves_no_temporary_file(tmp_path: Path, failure: BaseException) -> None:
    """``write_entry``: a write that fails part-way (a full disk: logged, the entry not written; an
    interrupt: raised) removes its temporary file; the folder holds what it held before."""
    target = tmp_path / "entries" / "e.json"

    def write(f) -> None:  # type: ignore[no-untyped-def]
        f.write(b"partial")
        raise failure

    if isinstance(failure, OSError):
        _tuning.write_entry(target, write, "test cache")
    else:
        with pytest.raises(KeyboardInterrupt):
            _tuning.write_entry(target, write, "test cache")
    assert list(target.parent.iterdir()) == []
    _tuning.write_entry(target, lambda f: f.write(b"whole"), "test cache")
    assert target.read_bytes() == b"whole" and list(target.parent.iterdir()) == [target]


def test_bad_arguments_name_the_field(cache: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        measured("a b", (), int, Counter(1))
    with pytest.raises(TypeError, match="value_type"):
        measured("probe", (), float, Counter(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'probe' must return int"):
        measured("probe", (), int, Counter(True))
    with pytest.raises(TypeError, match="'probe' must return a tuple of ints"):
        measured("probe", (), tuple, Counter((1, 2.5)))


def test_a_tuple_of_ints_is_kept_and_read_back(cache: Path) -> None:
    """A ``tuple`` measurement is stored as a JSON list and read back as the same tuple; an entry
    whose list holds something other than ints is measured again."""
    count = Counter((1000, 1250, 1700))
    assert measured("table", (2,), tuple, count) == (1000, 1250, 1700)
    clear_memo()
    assert measured("table", (2,), tuple, count) == (1000, 1250, 1700) and count.calls == 1
    (path,) = (cache / "measurements").glob("table-*.json")
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "value": [1000, "x"]}))
    clear_memo()
    assert measured("table", (2,), tuple, count) == (1000, 1250, 1700) and count.calls == 2
    clear_memo()


def _layer(seed: int) -> PackedLinear:
    w = np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32)
    codes = GGUFWeight.from_bytes("Q8_0", quantize(w, GGMLQuantizationType.Q8_0), (64, 64))
    return PackedLinear(codes, codes.dequantize(), None, torch.float32)


def _count_timings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = quant._best_seconds

    def counted(fn, reps=5):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(fn, reps)

    monkeypatch.setattr(quant, "_best_seconds", counted)
    return calls


def test_quant_measurements_are_taken_once_per_host(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("TREESERVE_PACKED_MAX_ROWS", "TREESERVE_INT8", "TREESERVE_EXACT_HEAD", "TREESERVE_HEAD_PACKED_MAX_ROWS",
                "TREESERVE_HEAD_ROWS_MAX_ROWS"):
        monkeypatch.delenv(env, raising=False)
    timings = _count_timings(monkeypatch)
    layer = _layer(0)
    rows = measure_crossover(layer)
    head = ExactHead(torch.nn.Parameter(torch.randn(96, 64)))
    kinds = {p.name.rsplit("-", 1)[0] for p in (cache / "measurements").iterdir()}
    # the float32 head's few-row range (a second entry when one row loses), then the bf16 pass
    required = {"packed-rows", "head-bf16-rows"} | ({"head-rows"} if quant._rows_op_available() else set())
    assert timings and required <= kinds <= required | {"head-rows-multi"}, kinds
    timings.clear()
    clear_memo()  # a new process
    assert measure_crossover(_layer(1)) == rows  # same shapes: same entry
    again = ExactHead(torch.nn.Parameter(torch.randn(96, 64)))
    assert (again.bf16_max_rows, again.rows_min_rows, again.rows_max_rows) == (
        head.bf16_max_rows, head.rows_min_rows, head.rows_max_rows)
    assert timings == []


def test_overrides_win_over_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREESERVE_PACKED_MAX_ROWS", raising=False)
    monkeypatch.delenv("TREESERVE_EXACT_HEAD", raising=False)
    layer = _layer(0)
    cached = measure_crossover(layer)
    head_rows = ExactHead(torch.nn.Parameter(torch.randn(96, 64))).bf16_max_rows
    timings = _count_timings(monkeypatch)
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", str(cached + 3))
    assert measure_crossover(layer) == cached + 3
    monkeypatch.setenv("TREESERVE_EXACT_HEAD", "f32" if head_rows else "bf16")
    assert bool(ExactHead(torch.nn.Parameter(torch.randn(96, 64))).bf16_max_rows) != bool(head_rows)
    assert timings == []
