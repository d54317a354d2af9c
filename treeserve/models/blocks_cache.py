"""GGUF blocks built at load kept on disk per source file, mapped back on a warm start (issue 33).

A k-quant file's tensors are converted at load into the blocks the GGUF operator multiplies
(``gguf_convert``), and fused projections (q|k|v, gate|up) are written into one buffer, their parts
converted or unpermuted on the way (``gguf_loader``): on Llama-3.2-1B shapes in llama.cpp's ``Q4_K_M`` ~1.3 s of a warm
``LLM()`` (Zen 4), most of it the conversion and the first touch of fresh memory. ``cached_blocks``
keeps each such result as one file under ``cache_dir()/blocks/`` and maps it read-only on the next
load, as the GGUF file itself is mapped: no conversion, no copy, pages read as decode touches them.

- Entry: a 4 KiB header (JSON: version, key, rows, width; zero-padded), then the ``rows x width``
  bytes. Key: the source file's identity (``source_id``: resolved path, size, mtime, inode; ``None``
  for files above ``MAX_FILE_BYTES`` (16 GiB; ``TREESERVE_BLOCKS_CACHE_MAX_GB`` sets another limit,
  ``0`` turns this cache off) or with ``TREESERVE_INT8_CACHE=0``, which turns both weight caches off),
  the tensors' names, the block type, and a hash of what decides the bytes (``gguf_convert.py``,
  ``gguf_loader.py``, ``gguf_file.py``, ``csrc/gguf_convert.cpp``, the shared headers and the ``gguf``
  package's version, whose decoders serve the rarer types). The host is not in it: the conversion
  operator writes the same bytes on every build (tests/models/test_gguf_convert.py).
- An entry is written through a temporary file and ``os.replace``; one that cannot be read, holds
  another key or has the wrong size is built again and rewritten; a folder that cannot be written
  costs the build at every start, never an error.
- Disk use: the built blocks, about 1.1-1.5x the share of the file they come from (0.9 GB for a
  ``Q4_K_M`` Llama-3.2-1B, 5.5 GB for a ``Q4_K_M`` Llama-3-8B). At a process's first written entry,
  entries whose source file is gone or has changed, or written by other code or another version
  (keys no load can match again), are deleted, and so are temporary files an interrupted write of
  another process left over an hour ago (``weight_cache.sweep_once``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from treeserve._cpp import INCLUDE
from treeserve._tuning import cache_dir
from treeserve.models.gguf_op import shared_tensor
from treeserve.models.weight_cache import file_identity, max_file_bytes, source_changed, store

__all__ = ["HEADER_BYTES", "MAX_FILE_BYTES", "cached_blocks", "source_id"]

HEADER_BYTES = 4096
"""Bytes of an entry's header; the blocks follow it (page-aligned: they are mapped in place)."""
_VERSION = 1
MAX_FILE_BYTES = 16 << 30
"""Source files larger than this (unless ``TREESERVE_BLOCKS_CACHE_MAX_GB`` says otherwise) are not cached."""


def source_id(path: str | Path, st: os.stat_result | None = None) -> str | None:
    """``weight_cache.file_identity`` of ``path`` (as ``st`` says, where given) under this cache's size
    limit (module docstring)."""
    return file_identity(path, max_file_bytes("TREESERVE_BLOCKS_CACHE_MAX_GB", MAX_FILE_BYTES), st)


@lru_cache(maxsize=1)
def _code_hash() -> str:
    """A hash of the code an entry's bytes depend on (module docstring)."""
    here = Path(__file__).parent
    sources = [here / "gguf_convert.py", here / "gguf_loader.py", here / "gguf_file.py",
               here / "csrc" / "gguf_convert.cpp", *sorted(INCLUDE.glob("*.h"))]
    try:
        version = metadata.version("gguf")
    except metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256(version.encode())
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _folder() -> Path:
    return cache_dir() / "blocks"


def _header(path: Path) -> dict | None:
    """An entry's parsed header, or None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        entry = json.loads(head.rstrip(b"\0"))
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def _read(path: Path, key: list[str], rows: int, width: int) -> torch.Tensor | None:
    entry = _header(path)
    if entry is None or entry.get("version") != _VERSION or entry.get("key") != key:
        return None
    if entry.get("rows") != rows or entry.get("width") != width:
        return None
    try:
        if path.stat().st_size != HEADER_BYTES + rows * width:
            return None
        blocks = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(rows, width))
    except (OSError, ValueError):
        return None
    return shared_tensor(blocks)  # read-only map: the operator never writes its weights


def _stale(path: Path) -> bool:
    """Whether no load can match the entry at ``path`` again: unreadable or of another version, written
    by other code (the key's last item: the code hash), or its source file (the first) gone or changed."""
    entry = _header(path)
    if entry is None or entry.get("version") != _VERSION or not isinstance(entry.get("key"), list):
        return True
    key = entry["key"]
    return not key or key[-1] != _code_hash() or source_changed(key[0])


def cached_blocks(source: str | None, names: list[str], qtype: str, rows: int, width: int,
                  build: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
    """The uint8 ``[rows, width]`` blocks of ``names`` (one tensor or a fused group) of the file
    ``source`` (:func:`source_id`) as ``qtype``: mapped from the cache, else written by
    ``build(out)`` into a new buffer ``out`` (``build`` returns False where it cannot: None is
    returned and nothing stored), stored, and returned. ``source=None``: built, not cached."""
    key = [str(k) for k in (source, "|".join(names), qtype, rows, width, _code_hash())]
    path = _folder() / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.blocks"
    if source is not None:
        found = _read(path, key, rows, width)
        if found is not None:
            return found
    out = torch.empty(rows, width, dtype=torch.uint8)
    if not build(out):
        return None
    header = json.dumps({"version": _VERSION, "key": key, "rows": rows, "width": width}).encode()
    if source is not None and len(header) <= HEADER_BYTES:  # a longer key (a path of ~4k characters): not cached

        def write(f) -> None:  # type: ignore[no-untyped-def]
            f.write(header.ljust(HEADER_BYTES, b"\0"))
            f.write(memoryview(out.numpy()).cast("B"))

        store(path, write, "converted blocks cache: converting at every start", _stale)
    return out
