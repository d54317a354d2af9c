"""A GGUF file's parsed header kept in the cache folder (issue 33: a warm start in seconds).

Walking a header string by string costs a start 0.15 s for SmolLM2-135M's 49k-token vocabulary and
merges, and seconds for Llama-3's 128k tokens and 280k merges (AVX2 EPYC). ``cached_header`` keeps
what ``gguf_file`` parses (metadata, tensor infos, data start) as one JSON file per source under
``cache_dir()/headers/``, which ``json`` reads back in C:

- key: the file's identity (``weight_cache.stat_identity``: resolved path, size, modification time
  in ns, inode, from the mapped file's ``fstat``) and a hash of its first MiB (the header's start: a
  file rewritten in place with the same size and time is a new key), and a hash of ``gguf_file.py``
  (the parser);
- an entry is written through a temporary file and ``os.replace`` (``treeserve._tuning.write_entry``);
  one that cannot be read, holds another key or values of the wrong types is parsed again and
  rewritten; a folder that cannot be written costs the parse at every start, never an error.

Disk use: the header's size as JSON (1.6 MB for SmolLM2-135M, ~10 MB for a Llama-3 vocabulary). At a
process's first written entry, entries of a source file gone or changed, or of another parser, are
deleted (``weight_cache.sweep_once``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from treeserve._tuning import cache_dir
from treeserve.models.weight_cache import source_changed, stat_identity, store

__all__ = ["cached_header"]

_VERSION = 2
_HASHED_BYTES = 1 << 20

Header = tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]
"""``(metadata, [(name, dims, ggml type, offset)], data start)``."""


@lru_cache(maxsize=1)
def _parser_hash() -> str:
    return hashlib.sha256(Path(__file__).with_name("gguf_file.py").read_bytes()).hexdigest()[:16]


def _key(path: Path, head: bytes, st: os.stat_result | None) -> list[object]:
    resolved = path.resolve()
    return [_VERSION, stat_identity(resolved, st or resolved.stat()), hashlib.sha256(head).hexdigest()[:32],
            _parser_hash()]


def _read(entry_path: Path, key: list[object]) -> Header | None:
    try:
        entry = json.loads(entry_path.read_bytes())
        if entry["key"] != key or not isinstance(entry["metadata"], dict) or type(entry["start"]) is not int:
            return None
        infos = []
        for name, dims, ggml_type, offset in entry["tensors"]:
            if not (isinstance(name, str) and all(type(d) is int for d in dims)
                    and type(ggml_type) is int and type(offset) is int):  # fmt: skip
                return None
            infos.append((name, tuple(dims), ggml_type, offset))
    except (OSError, ValueError, KeyError, TypeError):  # missing, truncated, not JSON, another layout
        return None
    return entry["metadata"], infos, entry["start"]


def _stale(entry_path: Path) -> bool:
    """Whether no load can match the entry at ``entry_path`` again: unreadable, of another version or
    parser (the key's first and last items), or its source file (the second) gone or changed."""
    try:
        key = json.loads(entry_path.read_bytes())["key"]
        if key[0] != _VERSION or key[-1] != _parser_hash():
            return True
        return source_changed(key[1])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return True


def cached_header(path: Path, data: bytes | memoryview | Any, parse: Callable[[], Header],
                  st: os.stat_result | None = None) -> Header:
    """The header of the GGUF file at ``path`` (its bytes ``data``, e.g. the mapped file, whose stat is
    ``st``: ``fstat`` of the descriptor it was mapped from, else the path is stat'ed): from the cache,
    else ``parse()``, stored (see the module docstring)."""
    try:
        key = _key(path, bytes(memoryview(data)[:_HASHED_BYTES]), st)
    except OSError:
        return parse()
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    entry_path = cache_dir() / "headers" / f"{digest}.json"
    found = _read(entry_path, key)
    if found is None:
        found = parse()
        metadata, infos, start = found
        entry = {"key": key, "metadata": metadata, "tensors": [[n, list(d), t, o] for n, d, t, o in infos],
                 "start": start}
        store(entry_path, lambda f: f.write(json.dumps(entry, ensure_ascii=False).encode()),
              "GGUF header cache: parsing the header at every start", _stale)
    return found
