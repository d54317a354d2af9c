"""What the weight caches share (``treeserve.models.weight_cache``): file identities and the sweep."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.models import weight_cache
from treeserve.models.weight_cache import TMP_MAX_AGE_S, file_identity, source_changed, sweep_once


def test_an_identity_changes_with_the_file_and_goes_with_it(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    ident = file_identity(src, 10)
    assert ident is not None and not source_changed(ident)
    os.utime(src, ns=(1, 2))  # rewritten in place: another modification time
    assert source_changed(ident) and not source_changed(file_identity(src, 10))
    ident = file_identity(src, 10)
    src.write_bytes(b"y")  # the same size, another write
    os.utime(src, ns=(1, 2))
    assert not source_changed(ident)  # size, time and inode alike: the same identity, by design
    src.write_bytes(b"yy")
    assert source_changed(ident)
    ident = file_identity(src, 10)
    src.unlink()
    assert source_changed(ident)
    hidden = tmp_path / "mount" / "m.gguf"  # a folder this process cannot see (another container's mount)
    hidden.parent.mkdir()
    hidden.write_bytes(b"x")
    ident = file_identity(hidden, 10)
    hidden.unlink()
    hidden.parent.rmdir()
    assert not source_changed(ident)
    for bad in (None, 3, "", "no colons", "a:b"):
        assert source_changed(bad)
    assert file_identity(tmp_path / "missing", 10) is None
    assert file_identity(tmp_path, -1) is None  # over the limit


def test_an_identity_from_an_open_descriptor_names_the_bytes_it_holds(tmp_path: Path) -> None:
    src, new = tmp_path / "m.gguf", tmp_path / "new.gguf"
    src.write_bytes(b"old")
    new.write_bytes(b"newer")
    with open(src, "rb") as f:
        os.replace(new, src)  # replaced after the open: the descriptor still holds the old file
        st = os.fstat(f.fileno())
    held = file_identity(src, 10, st)
    assert held is not None and held != file_identity(src, 10) and source_changed(held)
    assert held.startswith(f"{src.resolve()}:3:")
    assert file_identity(src, 4, st) == held and file_identity(src, 4) is None  # the limit reads the held size


@settings(max_examples=40, deadline=None)
@given(stale=st.lists(st.booleans(), min_size=1, max_size=8), keep=st.integers(0, 7),
       ages=st.lists(st.sampled_from([0.0, 0.5, 2.0]), max_size=4))
def test_the_sweep_deletes_exactly_the_stale_entries_and_old_temporary_files(
        tmp_path_factory: pytest.TempPathFactory, stale: list[bool], keep: int, ages: list[float]) -> None:
    folder = tmp_path_factory.mktemp("sweep")
    entries = [folder / f"{i}.e" for i in range(len(stale))]
    for path in entries:
        path.write_bytes(b"entry")
    other = folder / "other.json"  # another pattern: never looked at
    other.write_bytes(b"{}")
    temporary = [folder / f"{i}.e{i}.tmp" for i in range(len(ages))]
    now = time.time()
    for path, age in zip(temporary, ages):
        path.write_bytes(b"part")
        os.utime(path, (now - age * TMP_MAX_AGE_S,) * 2)
    keep_path = entries[keep % len(entries)]
    asked: list[Path] = []

    def is_stale(path: Path) -> bool:
        asked.append(path)
        return stale[entries.index(path)]

    sweep_once(folder, "*.e", keep_path, is_stale)
    expect = {p for p, s in zip(entries, stale) if not s or p == keep_path} | {other}
    expect |= {p for p, age in zip(temporary, ages) if age < 1}
    assert set(folder.iterdir()) == expect and keep_path not in asked
    entries[0].write_bytes(b"entry")  # the same folder again in this process: not swept twice
    sweep_once(folder, "*.e", keep_path, lambda p: True)
    assert entries[0].exists()


def test_an_entry_that_vanishes_or_a_folder_that_is_gone_is_no_error(tmp_path: Path) -> None:
    sweep_once(tmp_path / "missing", "*.e", tmp_path / "k.e", lambda p: True)
    (tmp_path / "a.e").write_bytes(b"x")

    def gone(path: Path) -> bool:  # another process deleted it between the listing and the unlink
        path.unlink()
        return True

    sweep_once(tmp_path, "*.e", tmp_path / "k.e", gone)
    assert not (tmp_path / "a.e").exists() and tmp_path in weight_cache._swept
