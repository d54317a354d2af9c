"""The int8 tier's rounded weights kept on disk per source file (issue 33: a warm start in seconds).

Building a projection's int8 copy (``int8_op``: dequantize the codes, rotate, round per row) is
most of a warm ``LLM()`` on the default model (the measurements themselves are cached by
``treeserve._tuning``). ``int8_weight`` keeps what that costs, the int8 codes and the float32 row
scales of ``round_rotated``, in one ``torch.save`` file per projection under
``cache_dir()/int8/``, and rebuilds the weight from it with ``Int8Weight.from_codes`` (oneDNN's
prepack only): bitwise the weight ``from_dense`` makes.

- key: the source file's identity (``source_id``: resolved path, size, modification time and
  inode, from the mapped file's ``fstat`` where the loader has it; a file rewritten in place is a
  new key), the projection's name and shape, a hash of ``int8_op.py`` (the rounding) and
  ``gguf_convert.py`` (the weights of GGUF types converted at load) and
  ``treeserve._tuning.host_key()`` (CPU, torch version, threads, operator sources);
- an entry is written through a temporary file and ``os.replace``; one that cannot be read, holds
  another key, or tensors of the wrong dtype or shape is built again and rewritten; a folder that
  cannot be written costs the build at every start, never an error;
- sources above ``CACHE_MAX_FILE_BYTES`` (2 GiB; ``TREESERVE_INT8_CACHE_MAX_GB`` sets another limit, in
  GiB) are not cached (the entries take 1 byte per projection weight on disk: 0.1 GB for
  SmolLM2-135M, 7 GB for an 8B model); ``TREESERVE_INT8_CACHE=0`` turns the cache off, and
  ``blocks_cache`` with it (``source_id`` keys both, each with its own size limit).
- At a process's first written entry, entries whose source file is gone or has changed, or written
  by other rounding code (keys no load can match again), are deleted (``weight_cache.sweep_once``).
  Entries of another host key stay: the same file may be served with other settings on this machine.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from treeserve._tuning import cache_dir, host_key
from treeserve.models.int8_op import Int8Weight, round_rotated
from treeserve.models.weight_cache import file_identity, max_file_bytes, source_changed, store

__all__ = ["CACHE_MAX_FILE_BYTES", "int8_weight", "source_id"]

CACHE_MAX_FILE_BYTES = 2 << 30
"""Sources larger than this are not cached (see the module docstring)."""
_VERSION = 1


def source_id(path: str | Path, st: os.stat_result | None = None) -> str | None:
    """``weight_cache.file_identity`` of ``path`` (as ``st`` says, where given) under the int8 cache's
    size limit, ``max_file_bytes("TREESERVE_INT8_CACHE_MAX_GB", CACHE_MAX_FILE_BYTES)``."""
    return file_identity(path, max_file_bytes("TREESERVE_INT8_CACHE_MAX_GB", CACHE_MAX_FILE_BYTES), st)


@lru_cache(maxsize=1)
def _rounding_hash() -> str:
    """A hash of the code the entries depend on: the rounding (``int8_op.py``) and the conversion of
    other GGUF types at load (``gguf_convert.py``: the weights a converted tensor's copy rounds)."""
    digest = hashlib.sha256()
    for name in ("int8_op.py", "gguf_convert.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:16]


def _entry(path: Path) -> dict | None:
    """An entry's contents (the codes mapped, not read), or None where it cannot be loaded."""
    try:
        entry = torch.load(path, weights_only=True, mmap=True)  # the codes stay the file's pages until prepacked
    except Exception:  # missing, truncated or not a torch file: build it again
        return None
    return entry if isinstance(entry, dict) and entry.get("version") == _VERSION else None


def _stale(path: Path) -> bool:
    """Whether no load can match the entry at ``path`` again: unreadable or of another version, written
    by other rounding code (the key's fourth item), or its source file (the first) gone or changed."""
    entry = _entry(path)
    key = entry.get("key") if entry is not None else None
    return not (isinstance(key, list) and len(key) > 3) or key[3] != _rounding_hash() or source_changed(key[0])


def _read(path: Path, key: list[str], shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    entry = _entry(path)
    if entry is None or entry.get("key") != key:
        return None
    codes, scales = entry.get("codes"), entry.get("scales")
    if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and tuple(codes.shape) == shape
            and isinstance(scales, torch.Tensor) and scales.dtype == torch.float32
            and tuple(scales.shape) == shape[:1]):  # fmt: skip
        return None
    return codes, scales.clone()  # a copy: the map (and the codes' pages) goes once the codes are prepacked


def int8_weight(source: str | None, name: str, shape: tuple[int, int], dense: Callable[[], torch.Tensor]) -> Int8Weight:
    """The int8 copy of projection ``name`` (``shape`` ``(N, K)``) of the file ``source``
    (``source_id``): from the disk cache, else ``round_rotated(dense())``, stored. ``source=None``:
    built, not cached."""
    if source is None:
        return Int8Weight.from_dense(dense())
    key = [str(k) for k in (source, name, tuple(shape), _rounding_hash(), *host_key())]  # plain str: weights_only loads
    path = cache_dir() / "int8" / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.pt"
    found = _read(path, key, tuple(shape))
    if found is None:
        weight = dense()
        if tuple(weight.shape) != tuple(shape):
            raise ValueError(f"dense() of {name!r} must have shape {tuple(shape)}, got {tuple(weight.shape)}")
        found = round_rotated(weight)
        entry = {"version": _VERSION, "key": key, "codes": found[0], "scales": found[1]}
        store(path, lambda f: torch.save(entry, f), "int8 weight cache: building at every start", _stale)
    return Int8Weight.from_codes(*found)
