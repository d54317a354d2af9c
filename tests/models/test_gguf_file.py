"""Our GGUF header reader against ``gguf.GGUFReader`` (the oracle), and bad bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.models import resolve_model_path
from treeserve.models import file_cache, gguf_file, weight_cache
from treeserve.models.gguf_file import read_gguf


def assert_same_as_reference(path) -> None:
    """Parsed, and read back from the header cache (the second read), both equal to ``GGUFReader``'s."""
    assert_read_is_reference(path)
    assert_read_is_reference(path)


def assert_read_is_reference(path) -> None:
    metadata, tensors = read_gguf(path)
    ref = GGUFReader(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert metadata == expected
    assert list(tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        ours = tensors[t.name]
        assert ours.tensor_type == t.tensor_type
        assert ours.shape == tuple(int(d) for d in t.shape)
        assert (ours.n_elements, ours.n_bytes, ours.data_offset) == (t.n_elements, t.n_bytes, t.data_offset)
        assert ours.data.dtype == t.data.dtype and ours.data.shape == t.data.shape
        assert np.array_equal(ours.data, t.data)


def test_embedded_model_matches_gguf_reader() -> None:
    assert_same_as_reference(resolve_model_path("smollm2-135m-instruct"))


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_values = st.one_of(
    st.integers(-(2**31), 2**31 - 1).map(lambda v: ("int32", v)),
    st.integers(0, 2**64 - 1).map(lambda v: ("uint64", v)),
    st.floats(width=32, allow_nan=False).map(lambda v: ("float32", v)),
    st.booleans().map(lambda v: ("bool", v)),
    _text.map(lambda v: ("string", v)),
    st.lists(_text, max_size=5).map(lambda v: ("strings", v)),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5).map(lambda v: ("ints", v)),
)
_QTYPES = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0]


def _write(path, values: dict, shapes: list[tuple[int, int]], qtype: GGMLQuantizationType) -> None:
    from gguf.quants import quantize

    w = GGUFWriter(str(path), "llama")
    for key, (kind, v) in values.items():
        if kind in ("strings", "ints"):
            w.add_array(key, v)
        else:
            getattr(w, f"add_{kind}")(key, v)
    rng = np.random.default_rng(0)
    for i, (rows, blocks) in enumerate(shapes):
        x = rng.standard_normal((rows, 32 * blocks)).astype(np.float32)
        data = x.astype(np.float16) if qtype == GGMLQuantizationType.F16 else x
        if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = quantize(x, qtype)
        w.add_tensor(f"t{i}", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@settings(max_examples=25, deadline=None)
@given(
    values=st.dictionaries(st.from_regex(r"[a-z]{1,6}\.[a-z]{1,6}", fullmatch=True), _values, max_size=6),
    shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3),
    qtype=st.sampled_from(_QTYPES),
    data=st.data(),
)
def test_written_files_match_gguf_reader(tmp_path_factory, values, shapes, qtype, data) -> None:
    path = tmp_path_factory.mktemp("g") / "m.gguf"
    _write(path, values, shapes, qtype)
    assert_same_as_reference(path)
    # Any truncation is a ValueError (never another exception, never a silent short read).
    full = path.read_bytes()
    end = max(t.data_offset + t.n_bytes for t in read_gguf(path)[1].values())  # then only padding
    cut = data.draw(st.integers(0, end - 1), label="cut")
    path.write_bytes(full[:cut])
    with pytest.raises(ValueError):
        read_gguf(path)


def test_bad_headers(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1 is not supported"):
        read_gguf(path)
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_the_header_cache_parses_once_and_rebuilds_a_bad_or_stale_entry(tmp_path, monkeypatch) -> None:
    """A second read of a file takes its header from the cache (no parse); a damaged entry, and a file
    rewritten in place (same size: a new modification time and first MiB), are parsed again."""
    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("x.count", 7)
    w.add_array("x.tokens", ["a", "b", "\u00e9"])
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parses = []
    real = gguf_file._parse_header
    monkeypatch.setattr(gguf_file, "_parse_header", lambda *a: parses.append(1) or real(*a))
    first = read_gguf(path)
    second = read_gguf(path)
    assert len(parses) == 1 and second[0] == first[0] and second[0]["x.tokens"] == ["a", "b", "\u00e9"]
    assert np.array_equal(second[1]["t"].data, first[1]["t"].data)
    (entry,) = (tmp_path / "cache" / "headers").iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    assert read_gguf(path)[0] == first[0] and len(parses) == 2
    assert read_gguf(path)[0] == first[0] and len(parses) == 2  # rewritten whole
    data = bytearray(path.read_bytes())
    data[data.index(b"x.count") + len(b"x.count") + 4] = 9  # the uint32 7 -> 9, same size
    path.write_bytes(bytes(data))
    assert read_gguf(path)[0]["x.count"] == 9 and len(parses) == 3
    assert len(list(entry.parent.iterdir())) == 2  # this process swept before the file changed
    weight_cache._swept.clear()  # a new process: its first written entry sweeps the stale one
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    read_gguf(other)
    assert len(list(entry.parent.iterdir())) == 2 and len(parses) == 4
    assert read_gguf(path)[0]["x.count"] == 9 and len(parses) == 4  # the current entry stayed
    # keyed by the mapped file's stat: a file put at the path after the open is not served this header
    old = os.stat(path)
    data = path.read_bytes()
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(data)  # the same first MiB, another inode
    os.replace(replacement, path)
    file_cache.cached_header(path, data, lambda: parses.append(1) or gguf_file._parse_header(memoryview(data), path),
                             old)
    assert len(parses) == 4  # the mapped (old) file's own entry
    assert read_gguf(path)[0]["x.count"] == 9 and len(parses) == 5  # the new file: parsed, not served the old
