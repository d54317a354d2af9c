"""Measurements taken once per machine and kept on disk (like inductor's and Triton's caches).

Load-time choices that are measured rather than assumed (the packed/large crossover, whether the
int8 GEMM pays, the exact head's bf16 and packed row counts, ``treeserve.models.quant``) cost
seconds per start. ``measured(kind, key, measure)`` runs ``measure()`` once per machine and key and
keeps its result in one JSON file per entry under ``cache_dir()``:

- directory: ``TREESERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/treeserve``, else
  ``~/.cache/treeserve``; entries live in its ``measurements/`` folder;
- key: ``kind``, the caller's ``key`` (shapes, dtypes, ...) and this host: CPU model and flags,
  torch version and capability, intra-op thread count, and a hash of the C++ operators' sources
  (a kernel change is a new key);
- an entry is a JSON object ``{"version", "kind", "key", "value", "interference", "tries"}``
  written through a temporary file and ``os.replace`` (readers never see half a file); one that
  cannot be parsed, has another ``version`` or ``key`` (a hash collision), a value of the wrong
  type or a bad ``interference`` / ``tries`` is measured again and rewritten;
- a measurement taken while other work used more than ``interference_limit()`` of this process's
  CPUs (``treeserve._cpu_load.interference``: other processes, steal time) is provisional: each
  later start measures it again, up to ``MAX_TRIES`` measurements in all, until one is taken below
  the limit, and the entry keeps the value of the least disturbed measurement so far (a timing
  taken while the cores were shared would otherwise steer that choice for good);
- a directory that cannot be written costs the measurement at every start, never an error
  (logged once).

Results are also memoized in the process, so a key is read from disk at most once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import IO, NamedTuple, TypeVar

import torch

from treeserve._cpp import cpu_flags
from treeserve._cpu import cpu_features
from treeserve._cpu_load import interference
from treeserve._utils import log_once

__all__ = ["CACHE_VERSION", "INTERFERENCE_LIMIT", "MAX_TRIES", "cache_dir", "clear_memo", "entry_path", "host_key",
           "interference_limit", "measured", "write_entry"]

CACHE_VERSION = 2
"""Format version of an entry; entries of another version are measured again."""

INTERFERENCE_LIMIT = 0.25
"""Share of this process's CPUs that other work may use during a measurement that is kept for good
(the default of ``interference_limit``)."""

MAX_TRIES = 3
"""Measurements of one entry at most, while each is taken above ``INTERFERENCE_LIMIT``."""

_V = TypeVar("_V", int, bool, tuple)
_Value = int | bool | tuple[int, ...]
_memo: dict[str, _Value] = {}
_SOURCES = (Path(__file__).with_name("csrc"), Path(__file__).parent / "models" / "csrc")


def cache_dir() -> Path:
    """``TREESERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/treeserve``, else ``~/.cache/treeserve``."""
    env = os.environ.get("TREESERVE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "treeserve"


def interference_limit() -> float:
    """``TREESERVE_REMEASURE_SHARE`` where set (a number in ``[0, 1]``; 1 keeps every measurement,
    as on a host that is never quiet), else ``INTERFERENCE_LIMIT``. ``ValueError`` names the
    variable otherwise."""
    text = os.environ.get("TREESERVE_REMEASURE_SHARE")
    if text is None:
        return INTERFERENCE_LIMIT
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise ValueError(f"TREESERVE_REMEASURE_SHARE must be a number in [0, 1], got {text!r}")
    return share


@lru_cache(maxsize=1)
def _sources_hash() -> str:
    digest = hashlib.sha256()
    for folder in _SOURCES:
        for path in sorted(folder.glob("*.[ch]*")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def host_key() -> list[str]:
    """What makes a measurement specific to this host and process: CPU model and flags, torch
    version and capability, intra-op threads, operator sources."""
    feats = cpu_features()
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]
    return [feats.model_name, flags, torch.__version__, feats.torch_capability,
            f"threads={torch.get_num_threads()}", _sources_hash()]


def entry_path(kind: str, key: list[str]) -> Path:
    """The file holding ``kind``'s entry for the full ``key`` (``host_key()`` included)."""
    digest = hashlib.sha256(json.dumps([kind, key]).encode()).hexdigest()[:32]
    return cache_dir() / "measurements" / f"{kind}-{digest}.json"


class _Entry(NamedTuple):
    value: _Value
    interference: float
    tries: int


def _is_value(value: object, value_type: type) -> bool:
    """Whether ``value`` is of ``value_type`` exactly (bool is not int here, nor int bool; a tuple
    holds ints alone)."""
    if value_type is tuple:
        return type(value) is tuple and all(type(v) is int for v in value)
    return type(value) is value_type


def _read(path: Path, kind: str, key: list[str], value_type: type) -> _Entry | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("version") != CACHE_VERSION or entry.get("kind") != kind:
        return None
    value, share, tries = entry.get("value"), entry.get("interference"), entry.get("tries")
    if value_type is tuple and type(value) is list:  # JSON's form of a tuple
        value = tuple(value)
    if entry.get("key") != key or not _is_value(value, value_type):
        return None
    if type(share) not in (int, float) or not 0 <= share <= 1 or type(tries) is not int or tries < 1:
        return None
    return _Entry(value, float(share), tries)


def write_entry(path: Path, write: Callable[[IO[bytes]], object], what: str) -> None:
    """Write a cache entry at ``path`` through ``write(binary file)``, atomically (a temporary file in
    the same folder, then ``os.replace``); a folder that cannot be written (or a full disk) is logged
    once (``what``: the cache's name and the consequence), never raised. The temporary file is removed
    whatever stops the write (an error, an interrupt: re-raised)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        log_once(f"treeserve: {what} ({path.parent} not writable: {exc})")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _write(path: Path, kind: str, key: list[str], entry: _Entry) -> None:
    data = {"version": CACHE_VERSION, "kind": kind, "key": key, **entry._asdict()}
    write_entry(path, lambda f: f.write(json.dumps(data).encode()), "measurement cache: measuring at every start")


def _measure(kind: str, measure: Callable[[], _V], value_type: type, before: _Entry | None) -> _Entry:
    """A new measurement, or ``before`` where that was the less disturbed one; ``tries`` counted."""
    value, share = interference(measure)
    if not _is_value(value, value_type):
        what = "a tuple of ints" if value_type is tuple else value_type.__name__
        raise TypeError(f"measurement {kind!r} must return {what}, got {value!r}")
    tries = 1 if before is None else before.tries + 1
    if share > interference_limit():
        then = (f"measured again at the next start ({MAX_TRIES - tries} more at most)" if tries < MAX_TRIES
                else f"keeping the least disturbed of {MAX_TRIES}")
        log_once(f"treeserve: measurement {kind!r} taken while other work used {share:.0%} of this process's CPUs; "
                 f"{then}")
    if before is not None and before.interference < share:
        return before._replace(tries=tries)
    return _Entry(value, share, tries)


def measured(kind: str, key: tuple[object, ...], value_type: type[_V], measure: Callable[[], _V]) -> _V:
    """``measure()``'s result for ``kind`` and ``key`` on this host: from the process memo, else
    from the disk cache, else measured now and stored; an entry measured while the CPUs were
    shared is measured again (see the module docstring).

    ``kind`` is a short name (letters, digits, ``-``); ``key`` any values whose ``str`` is stable
    (ints, strings, dtypes, tuples of them); ``value_type`` ``int``, ``bool`` or ``tuple`` (of
    ints), what ``measure`` returns (``TypeError`` naming the measurement otherwise)."""
    if not kind or not kind.replace("-", "").isalnum():
        raise ValueError(f"kind must be a non-empty name of letters, digits and '-', got {kind!r}")
    if value_type not in (int, bool, tuple):
        raise TypeError(f"value_type must be int, bool or tuple, got {value_type!r}")
    full = [str(k) for k in key] + host_key()
    memo_key = json.dumps([kind, full])
    if memo_key in _memo:
        return _memo[memo_key]  # type: ignore[return-value]
    path = entry_path(kind, full)
    entry = _read(path, kind, full, value_type)
    if entry is None or (entry.interference > interference_limit() and entry.tries < MAX_TRIES):
        entry = _measure(kind, measure, value_type, entry)
        _write(path, kind, full, entry)
    _memo[memo_key] = entry.value
    return entry.value  # type: ignore[return-value]


def clear_memo() -> None:
    """Forget the process memo (the disk entries stay): the next ``measured`` call reads the disk."""
    _memo.clear()
