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
            "treeserve.models.int8_op", "treeserve.models.quant", "treeserve.sampling._top_op"} <= modules  # fmt: skip
    _cpp.load_all_cpp_ops()
    assert all(load.cache_info().currsize == 1 for load in _cpp._LOADERS)  # type: ignore[attr-defined]
    for op in ("decode_layers", "paged_decode_attention", "add_rms_norm", "gguf_linear", "gguf_linear_exact",
               "top_candidates", "exact_head_rescore"):  # fmt: skip
        assert hasattr(torch.ops.treeserve, op), op
