"""The C++ operators' build cache and start-up loading (``treeserve/_cpp.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import treeserve.engine  # noqa: F401  (imports every operator module, which registers its loader)
from treeserve import _cpp

SOURCE = Path(_cpp.__file__).parent / "models" / "csrc" / "int8_linear.cpp"


def test_build_name_separates_checkouts_and_follows_the_source(tmp_path: Path) -> None:
    """Two checkouts sharing one torch build cache get two names (torch would otherwise see the
    other's paths and rebuild over it on every switch); an edit gives a new name; the name is stable."""
    copy = tmp_path / SOURCE.name
    shutil.copy(SOURCE, copy)
    assert _cpp.build_name(SOURCE) == _cpp.build_name(SOURCE)
    assert _cpp.build_name(copy) != _cpp.build_name(SOURCE)
    assert _cpp.build_name(copy).startswith("treeserve_int8_linear_")
    before = _cpp.build_name(copy)
    copy.write_text(copy.read_text() + "\n// edited\n")
    assert _cpp.build_name(copy) != before


def test_engine_start_loads_every_operator() -> None:
    """``load_all_cpp_ops`` (called by ``LLM()`` on CPU) leaves every registered operator loaded,
    so no request's step waits for a compiler; the loaders are those of all operator modules."""
    modules = {load.__wrapped__.__module__ for load in _cpp._LOADERS}  # type: ignore[attr-defined]
    assert {"treeserve.models._decode_op", "treeserve.models._norm_op", "treeserve.models.gguf_op",
            "treeserve.models.gguf_convert", "treeserve.models.int8_op", "treeserve.models.quant",
            "treeserve.sampling._top_op", "treeserve.sampling.bitmask"} <= modules  # fmt: skip
    _cpp.load_all_cpp_ops()
    assert all(load.cache_info().currsize == 1 for load in _cpp._LOADERS)  # type: ignore[attr-defined]
    for op in ("decode_layers", "paged_decode_attention", "add_rms_norm", "gguf_linear", "gguf_linear_exact",
               "gguf_dequantize", "gguf_convert", "top_candidates", "exact_head_rescore",
               "apply_token_bitmask_"):  # fmt: skip
        assert hasattr(torch.ops.treeserve, op), op


def test_built_library_is_where_torch_builds(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``built_library`` names the file torch's ``load`` writes, with and without ``TORCH_EXTENSIONS_DIR``
    (it computes the folder without importing ``cpp_extension``)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    name = _cpp.build_name(SOURCE)
    assert _cpp.built_library(name) == Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert _cpp.built_library(name) == Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    assert _cpp.built_library(name).parent.parent == tmp_path


def test_a_built_library_loads_without_the_rebuild_check(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A process whose operators are already built loads them without importing ``cpp_extension``
    (torch's rebuild check); a library file that does not load is left to ``load`` (False)."""
    import subprocess
    import sys

    _cpp.load_all_cpp_ops()  # built here if this host has not yet
    code = ("import sys, treeserve.engine\nfrom treeserve import _cpp\n_cpp.load_all_cpp_ops()\n"
            "import torch\nassert hasattr(torch.ops.treeserve, 'gguf_dequantize')\n"
            "print('torch.utils.cpp_extension' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
    bad = tmp_path / "bad" / "bad.so"
    bad.parent.mkdir()
    bad.write_bytes(b"not a library")
    monkeypatch.setattr(_cpp, "built_library", lambda name: bad)
    assert not _cpp._load_built("bad")
    monkeypatch.setattr(_cpp, "built_library", lambda name: tmp_path / "missing.so")
    assert not _cpp._load_built("missing")
