"""The KV tiers' stores on their own: chained keys, the host LRU, the disk store's crash safety and
its refusal of missing, truncated, corrupt, foreign and other-token entries."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from treeserve.kvcache import DiskStore, HostChunk, HostStore, InvariantError, TierLayout, chunk_keys, module_fingerprint
from treeserve.kvcache import disk_store as disk_mod
from treeserve.kvcache.tier_key import default_chunk_tokens

LAYOUT = TierLayout("model-a", torch.float32, num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, chunk_tokens=4)


def chunk(seed: int, layout: TierLayout = LAYOUT) -> torch.Tensor:
    return torch.arange(torch.Size(layout.chunk_shape).numel(), dtype=torch.float32).view(layout.chunk_shape) + seed


def toks(seed: int) -> tuple[int, ...]:
    return tuple(range(seed, seed + LAYOUT.chunk_tokens))


def test_chunk_keys_are_chained_and_layout_bound() -> None:
    seed = LAYOUT.digest()
    a = chunk_keys(seed, list(range(12)), 3, 4)
    b = chunk_keys(seed, list(range(8)) + [99, 9, 10, 11], 3, 4)
    assert a[:2] == b[:2] and a[2] != b[2]
    c = chunk_keys(seed, [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11], 3, 4)  # chunk 1 differs: every later key too
    assert c[0] == a[0] and c[1] != a[1] and c[2] != a[2]
    other = TierLayout("model-b", torch.float32, 2, 1, 4, 2, 4).digest()
    assert not set(chunk_keys(other, list(range(12)), 3, 4)) & set(a)
    bf16 = TierLayout("model-a", torch.bfloat16, 2, 1, 4, 2, 4).digest()
    f16 = TierLayout("model-a", torch.float16, 2, 1, 4, 2, 4).digest()
    assert len({seed, bf16, f16}) == 3  # a cache of another dtype is never read as this one
    with pytest.raises(ValueError, match="num_chunks"):
        chunk_keys(seed, list(range(7)), 2, 4)


def test_layout_and_chunk_size_checks() -> None:
    assert default_chunk_tokens(1) == 64 and default_chunk_tokens(16) == 64 and default_chunk_tokens(48) == 96
    with pytest.raises(ValueError, match="chunk_tokens must be a multiple of page_size"):
        TierLayout("m", torch.float32, 1, 1, 1, page_size=4, chunk_tokens=6)
    with pytest.raises(ValueError, match="num_layers"):
        TierLayout("m", torch.float32, 0, 1, 1, 1, 1)


def test_host_store_lru_and_capacity() -> None:
    store = HostStore(LAYOUT, capacity_tokens=8)  # two chunks
    assert store.put(b"a", HostChunk(toks(0), chunk(0))) == []
    assert store.put(b"b", HostChunk(toks(1), chunk(1))) == []
    store.get(b"a")  # b is now least recently used
    evicted = store.put(b"c", HostChunk(toks(2), chunk(2)))
    assert [k for k, _ in evicted] == [b"b"] and b"a" in store and b"c" in store
    assert store.put(b"a", HostChunk(toks(9), chunk(9))) == [] and torch.equal(store.get(b"a").kv, chunk(0))
    store.check_invariants()
    with pytest.raises(ValueError, match="kv_host_tokens"):
        HostStore(LAYOUT, -1)
    with pytest.raises(ValueError, match="shape"):
        store.put(b"d", HostChunk(toks(3), torch.zeros(3)))
    del store._chunks[b"c"]
    store._chunks[b"e"] = store._chunks[b"a"]  # the same memory twice
    with pytest.raises(InvariantError, match="shares memory"):
        store.check_invariants()


def test_disk_store_roundtrip_and_restart(tmp_path) -> None:
    store = DiskStore(tmp_path, 1 << 20, LAYOUT)
    assert store.write(b"k" * 16, toks(5), chunk(5))
    store.check_invariants()
    again = DiskStore(tmp_path, 1 << 20, LAYOUT)  # a restart: the index is rebuilt from the directory
    assert b"k" * 16 in again
    assert torch.equal(again.read(b"k" * 16, toks(5)), chunk(5))
    for half in (torch.bfloat16, torch.float16):  # 16-bit caches: their raw bytes, read back as written
        layout = TierLayout("model-a", half, 2, 1, 4, 2, 4)
        hstore = DiskStore(tmp_path / str(half), 1 << 20, layout)
        assert hstore.write(b"b" * 16, toks(1), chunk(1, layout).to(half))
        assert torch.equal(hstore.read(b"b" * 16, toks(1)), chunk(1, layout).to(half))


def test_disk_store_capacity_evicts_least_recently_used(tmp_path) -> None:
    probe = DiskStore(tmp_path / "p", 1 << 20, LAYOUT)
    store = DiskStore(tmp_path / "s", 2 * probe.file_bytes, LAYOUT)
    keys = [bytes([i]) * 16 for i in range(3)]
    store.write(keys[0], toks(0), chunk(0))
    store.write(keys[1], toks(1), chunk(1))
    assert store.read(keys[0], toks(0)) is not None  # keys[1] is now the oldest
    store.write(keys[2], toks(2), chunk(2))
    assert keys[1] not in store and keys[0] in store and keys[2] in store
    assert not (tmp_path / "s" / f"{keys[1].hex()}.kv").exists()
    store.check_invariants()
    assert not DiskStore(tmp_path / "z", probe.file_bytes - 1, LAYOUT).write(keys[0], toks(0), chunk(0))


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupt", "foreign", "other_tokens", "garbage"])
def test_disk_store_bad_entry_means_none_with_a_warning(tmp_path, caplog, damage: str) -> None:
    key = b"q" * 16
    store = DiskStore(tmp_path, 1 << 20, LAYOUT)
    store.write(key, toks(3), chunk(3))
    path = tmp_path / f"{key.hex()}.kv"
    data = bytearray(path.read_bytes())
    query = toks(3)
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[:-7])
    elif damage == "corrupt":
        data[-5] ^= 0x40
        path.write_bytes(data)
    elif damage == "foreign":  # another model's entry under our name
        DiskStore(tmp_path / "b", 1 << 20, TierLayout("model-b", torch.float32, 2, 1, 4, 2, 4)).write(key, toks(3), chunk(3))
        path.write_bytes((tmp_path / "b" / path.name).read_bytes())
    elif damage == "other_tokens":
        query = toks(4)
    else:
        path.write_bytes(os.urandom(len(data)))
    with caplog.at_level(logging.WARNING, logger="treeserve.kvcache"):
        assert store.read(key, query) is None
    assert "recomputing" in caplog.text and store.num_errors == 1
    assert key not in store
    store.check_invariants()


def test_crash_between_write_and_rename_leaves_nothing_visible(tmp_path, monkeypatch) -> None:
    store = DiskStore(tmp_path, 1 << 20, LAYOUT)

    class Crash(BaseException):
        pass

    def crash(src: object, dst: object) -> None:
        raise Crash

    monkeypatch.setattr(disk_mod.os, "replace", crash)
    with pytest.raises(Crash):
        store.write(b"c" * 16, toks(0), chunk(0))
    monkeypatch.undo()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and b"c" * 16 not in store
    restarted = DiskStore(tmp_path, 1 << 20, LAYOUT)
    assert len(restarted) == 0 and not restarted.has(b"c" * 16)
    restarted.check_invariants()
    old = disk_mod.time.time() - 2 * disk_mod.STALE_TMP_S
    os.utime(leftovers[0], (old, old))
    DiskStore(tmp_path, 1 << 20, LAYOUT)  # a stale temporary is a crash leftover: removed
    assert not leftovers[0].exists()


def test_other_replica_entries_are_found(tmp_path) -> None:
    a = DiskStore(tmp_path, 1 << 20, LAYOUT)
    b = DiskStore(tmp_path, 1 << 20, LAYOUT)
    a.write(b"r" * 16, toks(7), chunk(7))
    assert b"r" * 16 not in b and b.has(b"r" * 16)
    assert torch.equal(b.read(b"r" * 16, toks(7)), chunk(7))


def test_disk_store_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="kv_disk_bytes"):
        DiskStore(tmp_path, -1, LAYOUT)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_disk_dir"):
        DiskStore(blocker / "sub", 1 << 20, LAYOUT)
    with pytest.raises(TypeError, match="kv_disk_dir"):
        DiskStore(3, 1 << 20, LAYOUT)
    store = DiskStore(tmp_path / "ok", 1 << 20, LAYOUT)
    with pytest.raises(ValueError, match="shape"):
        store.write(b"x" * 16, toks(0), torch.zeros(3))


class _Codes(torch.nn.Module):
    """A module holding codes and a weight rebuilt from them (``derived_tensors``), like a GGUF layer."""

    derived_tensors = ("weight",)

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("raw", torch.arange(64, dtype=torch.uint8))

    def build(self) -> None:
        self.weight = torch.nn.Parameter(self.raw.float() * 0.5, requires_grad=False)


def test_module_fingerprint_follows_weights_not_derived_tensors() -> None:
    """The digest changes with a weight value at a sampled position, a name or a shape, and not with
    a submodule's derived tensors being built, freed or changed (the disk tier's model id must be the
    same whether a process has built its large-batch weights yet or not)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), _Codes())
    base = module_fingerprint(model)
    model[1].build()
    assert module_fingerprint(model) == base
    model[1].weight.data.add_(1.0)
    assert module_fingerprint(model) == base
    del model[1]._parameters["weight"]
    assert module_fingerprint(model) == base
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0
    assert module_fingerprint(model) != base
    fresh = module_fingerprint(torch.nn.Sequential(model[0], _Codes()))
    model[1].raw[0] = 7  # the codes themselves are part of it
    assert module_fingerprint(model) != fresh
    assert module_fingerprint(torch.nn.Sequential(torch.nn.Linear(4, 3), _Codes())) != module_fingerprint(
        torch.nn.Sequential(torch.nn.Linear(4, 2), _Codes()))  # shapes
