"""What the caches of built weights share (``int8_cache``, ``blocks_cache``, ``file_cache``): the source
file's identity in their keys, their size limits, and the deletion of entries no load can match again.

- ``file_identity`` / ``stat_identity``: resolved path, size, modification time in ns and inode, one
  string (a file rewritten in place is a new identity), from the stat of the descriptor the caller
  mapped where it has one; ``file_identity`` gives ``None`` above a size limit or with
  ``TREESERVE_INT8_CACHE=0`` (which turns the weight caches off).
- ``sweep_once``: at a process's first written entry in a cache folder, the entries a predicate calls
  stale (their source file gone or changed, other code) are deleted, and temporary files an
  interrupted write left more than ``TMP_MAX_AGE_S`` ago. Without it every rebuilt or moved model
  leaves its old entries behind (the int8 copies of an 8B model take 7 GB). A source whose folder
  this process cannot see is not called gone (a cache folder shared with other containers or hosts);
  two treeserve versions sharing one cache folder do delete each other's entries (other code), so
  give each its own ``TREESERVE_CACHE_DIR``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from treeserve._tuning import write_entry

__all__ = ["TMP_MAX_AGE_S", "file_identity", "max_file_bytes", "source_changed", "stat_identity", "store",
           "sweep_once"]

TMP_MAX_AGE_S = 3600.0
"""A temporary file older than this is an interrupted write (a whole entry takes seconds) and is deleted."""


def max_file_bytes(variable: str, default: int) -> int:
    """The largest source file a weight cache keeps entries for: the environment ``variable`` (GiB, a
    number >= 0; ``ValueError`` naming it otherwise) where set, else ``default`` bytes."""
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not 0 <= gib < float("inf"):
        raise ValueError(f"{variable} must be a number of GiB >= 0, got {text!r}")
    return int(gib * 2**30)


def stat_identity(resolved: Path, st: os.stat_result) -> str:
    """The identity string of the file at the resolved path ``resolved`` whose stat is ``st``."""
    return f"{resolved}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def file_identity(path: str | Path, limit: int, st: os.stat_result | None = None) -> str | None:
    """The identity of the file at ``path`` for cache keys (module docstring), or None when it is larger
    than ``limit`` bytes, cannot be read, or ``TREESERVE_INT8_CACHE`` is ``0`` (``ValueError`` for a
    value other than ``0`` / ``1``). ``st``: the file's stat as the caller opened it (``fstat`` of the
    descriptor its data was read or mapped from; the path is stat'ed otherwise): the identity of the
    bytes the caller holds, not of a file that replaced them at ``path`` since."""
    env = os.environ.get("TREESERVE_INT8_CACHE")
    if env not in (None, "0", "1"):
        raise ValueError(f"TREESERVE_INT8_CACHE must be '0' or '1', got {env!r}")
    try:
        resolved = Path(path).resolve()
        if st is None:
            st = resolved.stat()
    except OSError:
        return None
    if env == "0" or st.st_size > limit:
        return None
    return stat_identity(resolved, st)


def source_changed(identity: object) -> bool:
    """Whether the file an identity (``file_identity``) names is gone or is no longer that file. A
    file whose folder this process cannot see either (a cache folder shared with other containers or
    hosts, which mount other files) is not called gone: its entries may serve them."""
    if not isinstance(identity, str) or identity.count(":") < 3:
        return True
    path = Path(identity.rsplit(":", 3)[0])
    try:
        return identity != stat_identity(path, path.stat())
    except OSError:
        return path.parent.is_dir()


_swept: set[Path] = set()


def sweep_once(folder: Path, pattern: str, keep: Path, stale: Callable[[Path], bool]) -> None:
    """Delete the entries ``folder/pattern`` other than ``keep`` for which ``stale(path)`` holds, and
    ``*.tmp`` files older than ``TMP_MAX_AGE_S``: once per folder and process (the caller's first
    written entry). Files that vanish or cannot be deleted meanwhile (another process) are skipped."""
    if folder in _swept:
        return
    _swept.add(folder)
    try:
        entries = list(folder.glob(pattern))
        temporary = list(folder.glob("*.tmp"))
    except OSError:
        return
    now = time.time()
    for path in entries:
        if path != keep and stale(path):
            with contextlib.suppress(OSError):
                path.unlink()
    for path in temporary:
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > TMP_MAX_AGE_S:
                path.unlink()


def store(path: Path, write: Callable[[IO[bytes]], object], what: str, stale: Callable[[Path], bool]) -> None:
    """Write a cache entry at ``path`` (``treeserve._tuning.write_entry``: atomic, a folder that cannot be
    written logged once as ``what``) and, where it was written, sweep its folder once (``sweep_once``
    over the entries of ``path``'s suffix, ``stale`` deciding)."""
    write_entry(path, write, what)
    if path.exists():
        sweep_once(path.parent, f"*{path.suffix}", path, stale)
