"""The int8 tier's rounded weights kept on disk per source file (``treeserve.models.int8_cache``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from treeserve.models import int8_cache, load, weight_cache
from treeserve.models.int8_cache import CACHE_MAX_FILE_BYTES, int8_weight, source_id
from treeserve.models.int8_op import Int8Weight, int8_available, int8_linear
from treeserve.models.quant import PackedLinear
from treeserve.models.synthetic_gguf import SyntheticSpec, write_synthetic_gguf
from treeserve.runner import PagedSequence

requires_int8 = pytest.mark.skipif(not int8_available(), reason="oneDNN's quantized linear is not in this torch build")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TREESERVE_INT8_CACHE", raising=False)
    weight_cache._swept.clear()
    return tmp_path / "cache" / "int8"


class Dense:
    """A ``dense()`` callable that counts its calls."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.calls = w, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.w


def _same(a: Int8Weight, b: Int8Weight) -> bool:
    x = torch.randn(5, a.in_features, generator=torch.Generator().manual_seed(0))
    return torch.equal(a.scales, b.scales) and torch.equal(int8_linear(x, a), int8_linear(x, b))


@requires_int8
def test_a_hit_is_bitwise_the_built_weight_and_skips_the_build(cache: Path, tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    dense = Dense(torch.randn(48, 128))
    first = int8_weight(source_id(src), "layers.0.mlp.down_proj", (48, 128), dense)
    again = int8_weight(source_id(src), "layers.0.mlp.down_proj", (48, 128), dense)
    assert dense.calls == 1 and len(list(cache.glob("*.pt"))) == 1
    assert _same(first, Int8Weight.from_dense(dense.w)) and _same(again, first)
    int8_weight(source_id(src), "layers.1.mlp.down_proj", (48, 128), dense)  # another name: another entry
    assert dense.calls == 2 and len(list(cache.glob("*.pt"))) == 2


@requires_int8
@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_key"])
def test_a_bad_entry_is_built_again(cache: Path, tmp_path: Path, damage: str) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    dense = Dense(torch.randn(16, 64))
    int8_weight(source_id(src), "p", (16, 64), dense)
    (entry,) = cache.glob("*.pt")
    if damage == "garbage":
        entry.write_bytes(b"not a torch file")
    elif damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:100])
    else:  # a (hash-colliding) entry of another key at this path
        other = tmp_path / "other.gguf"
        other.write_bytes(b"y")
        int8_weight(source_id(other), "p", (16, 64), Dense(dense.w))
        (new,) = set(cache.glob("*.pt")) - {entry}
        os.replace(new, entry)
    got = int8_weight(source_id(src), "p", (16, 64), dense)
    assert dense.calls == 2 and _same(got, Int8Weight.from_dense(dense.w))


@requires_int8
def test_entries_no_load_can_match_are_swept_at_a_process_first_write(cache: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries of a source file gone or changed, or of other rounding code, are deleted at a process's
    first written entry; those of another host key (other settings on this machine) and a damaged
    entry's rebuild stay."""
    files = [tmp_path / f"{i}.gguf" for i in range(5)]
    for f in files:
        f.write_bytes(b"z")
    w = torch.randn(16, 64)
    for f in files[:3]:
        int8_weight(source_id(f), "p", (16, 64), Dense(w))
    with monkeypatch.context() as mp:
        mp.setattr(int8_cache, "_rounding_hash", lambda: "other rounding")
        int8_weight(source_id(files[3]), "p", (16, 64), Dense(w))
    with monkeypatch.context() as mp:
        mp.setattr(int8_cache, "host_key", lambda: ["another host key"])
        int8_weight(source_id(files[2]), "p", (16, 64), Dense(w))
    assert len(list(cache.glob("*.pt"))) == 5
    files[0].unlink()
    files[1].write_bytes(b"zz")  # changed: another identity
    weight_cache._swept.clear()  # a new process
    int8_weight(source_id(files[4]), "p", (16, 64), Dense(w))
    kept = sorted((e["key"][0], e["key"][4]) for e in map(int8_cache._entry, cache.glob("*.pt")))
    host = str(int8_cache.host_key()[0])
    assert kept == sorted([(source_id(files[2]), host), (source_id(files[2]), "another host key"),
                           (source_id(files[4]), host)])


def test_source_identity_and_its_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREESERVE_INT8_CACHE", raising=False)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    first = source_id(src)
    assert first is not None and str(src.resolve()) in first
    os.utime(src, ns=(1, 2))  # rewritten: another modification time
    assert source_id(src) not in (None, first)
    assert source_id(tmp_path / "missing.gguf") is None
    monkeypatch.setattr(int8_cache, "CACHE_MAX_FILE_BYTES", 0)
    assert source_id(src) is None and CACHE_MAX_FILE_BYTES == 2 << 30
    monkeypatch.undo()
    monkeypatch.setenv("TREESERVE_INT8_CACHE", "0")
    assert source_id(src) is None
    monkeypatch.setenv("TREESERVE_INT8_CACHE", "yes")
    with pytest.raises(ValueError, match="TREESERVE_INT8_CACHE must be '0' or '1'"):
        source_id(src)
    monkeypatch.delenv("TREESERVE_INT8_CACHE")
    monkeypatch.setenv("TREESERVE_INT8_CACHE_MAX_GB", "0")  # another limit: nothing is small enough
    assert source_id(src) is None and weight_cache.file_identity(src, 1) is not None  # a cache's own limit wins
    monkeypatch.setenv("TREESERVE_INT8_CACHE_MAX_GB", "1e-9")  # 1 byte
    assert source_id(src) is not None and source_id(tmp_path / "missing.gguf") is None
    src.write_bytes(b"xx")
    assert source_id(src) is None
    for bad in ("-1", "inf", "nan", "big"):
        monkeypatch.setenv("TREESERVE_INT8_CACHE_MAX_GB", bad)
        with pytest.raises(ValueError, match="TREESERVE_INT8_CACHE_MAX_GB must be a number of GiB >= 0"):
            source_id(src)


def test_no_source_builds_without_writing(cache: Path) -> None:
    dense = Dense(torch.randn(16, 64))
    int8_weight(None, "p", (16, 64), dense)
    assert dense.calls == 1 and not cache.exists()
    with pytest.raises(ValueError, match="must have shape"):
        int8_weight("src", "p", (8, 64), dense)


@requires_int8
def test_a_second_load_reads_the_int8_copies_and_computes_the_same(cache: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SyntheticSpec("llama", 2, 128, 4, 2, 192, 320, True, False, 500000.0, 256)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec, "Q4_0", seed=3)
    monkeypatch.setenv("TREESERVE_INT8", "1")
    monkeypatch.setenv("TREESERVE_PACKED_MAX_ROWS", "2")
    first, _ = load(path, quantization="auto")
    assert not list(cache.glob("*.pt"))  # the int8 copies: built at the first large batch
    prompt = list(range(30, 50))  # 20 rows: the int8 tier
    with torch.inference_mode():
        a = PagedSequence(first, 64, page_size=1).extend(prompt, all_logits=True)
    entries = len(list(cache.glob("*.pt")))
    assert entries == 4 * spec.num_layers
    monkeypatch.setattr(int8_cache, "round_rotated", lambda w: pytest.fail("built again despite the cache"))
    second, _ = load(path, quantization="auto")
    layers = [m for m in second.modules() if isinstance(m, PackedLinear)]
    assert all(m.large_int8 and m.large_pending for m in layers)  # read at the first large batch
    with torch.inference_mode():
        b = PagedSequence(second, 64, page_size=1).extend(prompt, all_logits=True)
    assert torch.equal(a, b)
    assert all(m.int8 is not None and not m.large_pending for m in layers)
