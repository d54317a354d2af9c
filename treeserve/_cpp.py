"""Building and loading treeserve's C++ CPU operators (``torch.library`` ops under ``treeserve::``).

One builder for every operator: the source is compiled once per host with torch's
``cpp_extension`` (``-O3 -march=native``; the cache key is the source with its path, the shared
headers of ``treeserve/csrc`` (on the include path), the host's CPU flags and the torch version, so
a machine with other features builds its own copy, and two checkouts sharing one build cache do not
rebuild over each other: torch's own check would see the other's paths and recompile) and loaded
into the process.
An operator that cannot be built (no compiler, no headers, no ninja) is reported once and its
callers use their torch path: a missing compiler costs speed, never correctness.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import torch

from treeserve._utils import log_once

__all__ = ["INCLUDE", "build_name", "built_library", "cpp_op_loader", "cpu_flags", "load_all_cpp_ops", "load_cpp_op"]

INCLUDE = Path(__file__).with_name("csrc")
"""Headers shared by the operators (``#include "treeserve_vec.h"``)."""


@lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The host CPU's feature flags (Linux ``/proc/cpuinfo``), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


_LOADERS: list[Callable[[], object]] = []
_T = TypeVar("_T")


def cpp_op_loader(fn: Callable[[], _T]) -> Callable[[], _T]:
    """Decorator for a module's operator loader (no arguments, calls :func:`load_cpp_op`): caches
    it and registers it with :func:`load_all_cpp_ops`."""
    cached = lru_cache(maxsize=1)(fn)
    _LOADERS.append(cached)
    return cached  # type: ignore[return-value]


def load_all_cpp_ops() -> None:
    """Build (first run on a host: seconds to a minute each) and load every registered operator of
    the modules imported so far. The engine calls it at start-up so the first request never waits
    for a compiler; an operator that cannot be built is reported once, as in :func:`load_cpp_op`."""
    for load in _LOADERS:
        load()


@lru_cache(maxsize=None)
def load_cpp_op(source: Path, op_name: str, what: str, fake: Callable[..., Any] | None = None) -> str | None:
    """Build (first time on this host) and load ``source``, which registers ``treeserve::op_name``.

    Returns ``None`` when ``torch.ops.treeserve.<op_name>`` is usable, else the reason it is not
    (logged once as "``what`` unavailable"). ``source`` must be a path to a ``.cpp`` file.
    ``fake``: the operator's shape-and-dtype implementation for tracing (``torch.compile``),
    registered once with ``torch.library.register_fake`` when the operator is usable."""
    reason = _build(source, op_name, what)
    if reason is None and fake is not None:
        torch.library.register_fake(f"treeserve::{op_name}")(fake)
    return reason


# -fopenmp: ATen's parallel_for is an inline template over ``#pragma omp parallel``, so an operator
# built without it runs every parallel_for on one thread. The library it links (libgomp.so.1) is the
# one torch has already loaded.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def build_name(source: Path) -> str:
    """The extension's name in torch's build cache: ``treeserve_<stem>_<key>``, the key a hash of
    everything the build depends on (module docstring), the source's absolute path included."""
    headers = b"".join(h.read_bytes() for h in sorted(INCLUDE.glob("*.h")))
    blob = b"\0".join((str(source.resolve()).encode(), source.read_bytes(), headers, cpu_flags().encode(),
                       torch.__version__.encode(), str(_CFLAGS).encode()))  # fmt: skip
    return f"treeserve_{source.stem}_{hashlib.sha1(blob).hexdigest()[:12]}"


def built_library(name: str) -> Path:
    """Where torch's ``load`` puts the library ``name``: ``<root>/<name>/<name>.so``, the root
    ``TORCH_EXTENSIONS_DIR`` or torch's user cache folder per Python and accelerator (what
    ``cpp_extension._get_build_directory`` computes, without importing ``cpp_extension``, which
    imports setuptools: ~0.3 s per start)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                 else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"
        root = str(Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))) / folder)
    return Path(root) / name / f"{name}.so"


def _load_built(name: str) -> bool:
    """Load the library ``name`` when a previous process built it, skipping torch's rebuild check
    (importing ``cpp_extension``, hashing the sources, running ninja); the name is the hash of
    everything the build depends on, so an existing library is this source's. False when there is
    none or it does not load (``load`` then builds it as usual)."""
    built = built_library(name)
    if not built.is_file():
        return False
    try:
        torch.ops.load_library(str(built))
    except OSError:  # truncated or foreign: rebuilt by ``load``
        return False
    return True


def _build(source: Path, op_name: str, what: str) -> str | None:
    if hasattr(torch.ops.treeserve, op_name):
        return None
    name = build_name(source)
    if _load_built(name) and hasattr(torch.ops.treeserve, op_name):
        return None
    try:
        from torch.utils.cpp_extension import load

        load(
            name=name,
            sources=[str(source)],
            extra_include_paths=[str(INCLUDE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler / headers / ninja: the caller's torch path serves
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
        log_once(f"treeserve: {what} unavailable, using the torch path ({reason})")
        return reason
    if not hasattr(torch.ops.treeserve, op_name):
        reason = f"{source.name} built but did not register treeserve::{op_name}"
        log_once(f"treeserve: {what} unavailable, using the torch path ({reason})")
        return reason
    return None
