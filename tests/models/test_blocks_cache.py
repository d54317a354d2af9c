"""Blocks built at load kept on disk and mapped back (``treeserve.models.blocks_cache``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.test_gguf_convert import KSPEC
from treeserve.models import blocks_cache, gguf_convert, load, weight_cache
from treeserve.models.blocks_cache import HEADER_BYTES, MAX_FILE_BYTES, cached_blocks, source_id
from treeserve.models.gguf_convert import convert_op_available
from treeserve.models.gguf_op import gguf_op_available
from treeserve.models.synthetic_gguf import write_synthetic_gguf
from treeserve.runner import PagedSequence


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("TREESERVE_INT8_CACHE", "TREESERVE_INT8_CACHE_MAX_GB", "TREESERVE_BLOCKS_CACHE_MAX_GB"):
        monkeypatch.delenv(name, raising=False)
    weight_cache._swept.clear()
    return tmp_path / "cache" / "blocks"


def _filler(value: int, calls: list[int]):  # type: ignore[no-untyped-def]
    def build(out: torch.Tensor) -> bool:
        calls.append(1)
        out.copy_(torch.arange(out.numel(), dtype=torch.int64).add(value).remainder(256).to(torch.uint8).view_as(out))
        return True
    return build


def _mapping(t: torch.Tensor) -> tuple[str, str]:
    """The file and permissions of the mapping holding ``t``'s first byte (``/proc/self/maps``)."""
    at = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= at < hi:
            return (fields[5] if len(fields) > 5 else ""), fields[1]
    return "", ""


def test_an_entry_is_stored_then_mapped_read_only(tmp_path: Path, cache: Path) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x" * 100)
    source = source_id(src)
    calls: list[int] = []
    first = cached_blocks(source, ["a", "b"], "Q8_0", 3, 68, _filler(5, calls))
    again = cached_blocks(source, ["a", "b"], "Q8_0", 3, 68, _filler(9, calls))
    assert calls == [1] and first is not None and again is not None  # built once
    assert torch.equal(first, again) and again.shape == (3, 68) and again.dtype == torch.uint8
    (entry,) = cache.glob("*.blocks")
    assert entry.stat().st_size == HEADER_BYTES + 3 * 68
    assert _mapping(again) == (str(entry), "r--s") and _mapping(first)[0] != str(entry)  # the entry's pages
    # another name, type or shape is another entry
    other = cached_blocks(source, ["a"], "Q8_0", 3, 68, _filler(9, calls))
    assert calls == [1, 1] and not torch.equal(other, first) and len(list(cache.glob("*.blocks"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other-key"])
def test_a_bad_entry_is_built_again(tmp_path: Path, cache: Path, damage: str) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x" * 100)
    source = source_id(src)
    calls: list[int] = []
    cached_blocks(source, ["a"], "Q4_1", 2, 40, _filler(1, calls))
    (entry,) = cache.glob("*.blocks")
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[:-1])
    elif damage == "garbage":
        entry.write_bytes(b"\xff" * len(data))
    else:
        entry.write_bytes(data.replace(b'"Q4_1"', b'"Q4_0"', 1))
    got = cached_blocks(source, ["a"], "Q4_1", 2, 40, _filler(1, calls))
    assert calls == [1, 1] and got is not None
    assert torch.equal(got, torch.arange(80).add(1).remainder(256).to(torch.uint8).view(2, 40))
    again = cached_blocks(source, ["a"], "Q4_1", 2, 40, _filler(1, calls))
    assert calls == [1, 1] and torch.equal(again, got)  # rewritten


def test_no_source_a_failed_build_and_an_unwritable_folder_store_nothing(tmp_path: Path, cache: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    assert cached_blocks(None, ["a"], "Q8_0", 1, 34, _filler(0, calls)) is not None and not cache.exists()
    src = tmp_path / "m.gguf"
    src.write_bytes(b"y")
    assert cached_blocks(source_id(src), ["a"], "Q8_0", 1, 34, lambda out: False) is None and not cache.exists()
    monkeypatch.setenv("TREESERVE_INT8_CACHE", "0")  # turns the weight caches off: no source identity
    assert source_id(src) is None
    monkeypatch.setenv("TREESERVE_INT8_CACHE", "1")
    monkeypatch.setenv("TREESERVE_BLOCKS_CACHE_MAX_GB", "0")  # this cache's own limit: 0 turns it off
    assert source_id(src) is None
    monkeypatch.delenv("TREESERVE_BLOCKS_CACHE_MAX_GB")
    monkeypatch.setenv("TREESERVE_INT8_CACHE_MAX_GB", "0")  # the int8 cache's limit is not this one's
    assert source_id(src) is not None and MAX_FILE_BYTES == 16 << 30
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"a file where the folder would be")  # the folder cannot be made
    got = cached_blocks(source_id(src), ["a"], "Q8_0", 1, 34, _filler(0, calls))
    assert got is not None and calls == [1, 1] and cache.is_file()


def test_entries_no_load_can_match_and_old_temporary_files_are_swept(tmp_path: Path, cache: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """At a process's first written entry: entries of a source file gone or changed, or written by other
    code (another code hash), are deleted, and temporary files older than an hour; the rest stay."""
    calls: list[int] = []
    files = [tmp_path / f"{i}.gguf" for i in range(4)]
    for f in files:
        f.write_bytes(b"z" * 10)
    for f in files[:3]:
        cached_blocks(source_id(f), ["t"], "Q8_0", 1, 34, _filler(0, calls))
    with monkeypatch.context() as mp:
        mp.setattr(blocks_cache, "_code_hash", lambda: "other code")
        cached_blocks(source_id(files[3]), ["t"], "Q8_0", 1, 34, _filler(0, calls))
    assert len(list(cache.glob("*.blocks"))) == 4
    old, fresh = cache / "a.blocks123.tmp", cache / "b.blocks456.tmp"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * weight_cache.TMP_MAX_AGE_S,) * 2)
    files[0].unlink()
    files[1].write_bytes(b"w" * 11)  # changed: another identity
    weight_cache._swept.clear()  # a new process
    cached_blocks(source_id(files[2]), ["u"], "Q8_0", 1, 34, _filler(0, calls))
    kept = sorted((blocks_cache._header(p)["key"][0], blocks_cache._header(p)["key"][1])  # type: ignore[index]
                  for p in cache.glob("*.blocks"))
    assert kept == [(source_id(files[2]), "t"), (source_id(files[2]), "u")]
    assert not old.exists() and fresh.exists()


@pytest.mark.skipif(not (gguf_op_available() and convert_op_available()), reason="the C++ GGUF operators are not built")
def test_a_k_quant_model_loads_its_converted_blocks_from_the_cache(tmp_path: Path, cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The second load of a Q4_K_M file converts nothing (the operator is never called) and computes the
    same logits; every converted or fused projection, the converted head and embedding are entries."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", KSPEC, "Q4_K_M", seed=3)
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    monkeypatch.setenv("TREESERVE_HEAD_CODES", "1")
    first, _ = load(path, quantization="auto")
    entries = sorted(cache.glob("*.blocks"))
    # every projection is converted or fused, the Q6_K head and the Q4_K embedding converted
    assert len(entries) == 4 * KSPEC.num_layers + 2

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "_convert", refuse)
    monkeypatch.setattr(gguf_convert, "_q8_0_exact", refuse)
    second, _ = load(path, quantization="auto")
    assert sorted(cache.glob("*.blocks")) == entries
    layer = second.layers[1].self_attn.qkv_proj
    assert _mapping(layer.raw)[0] in {str(e) for e in entries}  # mapped from the cache
    ids = list(range(260, 290))
    with torch.inference_mode():
        a = PagedSequence(first, 64, page_size=1).extend(ids, all_logits=True)
        b = PagedSequence(second, 64, page_size=1).extend(ids, all_logits=True)
    assert torch.equal(a, b)
    assert os.path.getsize(entries[0]) > HEADER_BYTES and np.isfinite(a.numpy()).all()


@pytest.mark.skipif(not (gguf_op_available() and convert_op_available()), reason="the C++ GGUF operators are not built")
def test_a_file_replaced_during_a_load_keys_the_entries_by_the_bytes_mapped(tmp_path: Path, cache: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The entries are keyed by the mapped file's own stat: a file put at the path after it was opened
    (a download finishing) is not served the blocks built from the old one; it builds its own."""
    from treeserve.models.gguf_loader import load_gguf_model, open_gguf

    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "all")
    path = write_synthetic_gguf(tmp_path / "m.gguf", KSPEC, "Q4_K_M", seed=3)
    other = write_synthetic_gguf(tmp_path / "n.gguf", KSPEC, "Q4_K_M", seed=4)
    opened = open_gguf(path)
    os.replace(other, path)  # the path now names another file (another inode), the old one stays mapped
    first = load_gguf_model(opened, quantization="auto")
    keys = {blocks_cache._header(p)["key"][0] for p in cache.glob("*.blocks")}  # type: ignore[index]
    assert keys == {source_id(tmp_path / "m.gguf", opened.stat)} and all(map(weight_cache.source_changed, keys))
    second = load_gguf_model(open_gguf(path), quantization="auto")  # the new file: its own entries
    assert len({blocks_cache._header(p)["key"][0] for p in cache.glob("*.blocks")}) == 2  # type: ignore[index]
    ids = list(range(260, 290))
    with torch.inference_mode():
        a = PagedSequence(first, 64, page_size=1).extend(ids, all_logits=True)
        b = PagedSequence(second, 64, page_size=1).extend(ids, all_logits=True)
        fresh, _ = load(path, quantization="auto")
        c = PagedSequence(fresh, 64, page_size=1).extend(ids, all_logits=True)
    assert not torch.equal(a, b) and torch.equal(b, c)
