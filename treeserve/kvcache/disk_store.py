"""The disk tier: KV chunks as content-addressed files in a directory that outlives the process.

A chunk lives in ``<dir>/<key hex>.kv`` (the key: :func:`treeserve.kvcache.tier_key.chunk_keys`),
so a restarted engine, or another replica sharing the directory, finds it. File format: a
header (magic, format version, layout digest, key, token count, payload length, checksum), the
chunk's token ids (int64) and the KV payload; the checksum (blake2b) covers tokens and payload.

Writes are crash-safe: a temporary file in the same directory, written, ``fsync``-ed and renamed
over the final name (``os.replace``, atomic), then the directory is synced. A crash leaves at
most a temporary file, which is never read (and removed at start-up once older than
``STALE_TMP_S``). A read that finds the file missing, truncated, corrupt, of another layout or
of other tokens returns None with a warning (the caller recomputes) and drops the entry.

Capacity: ``capacity_bytes`` over the files of this store's index; writing past it deletes the
least recently used files (use refreshes a file's mtime, so the order survives a restart). The
index is loaded from the directory at start; a key missing from it is looked up on disk once
(``has``), so entries another replica wrote are found. Thread-safe (the tiers write from a
background thread).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from .pool import InvariantError
from .tier_key import FORMAT_VERSION, TierLayout

__all__ = ["DiskStore", "STALE_TMP_S"]

log = logging.getLogger("treeserve.kvcache")

_MAGIC = b"TSKV"
_HEADER = struct.Struct("<4sI16s16sIQ16s")  # magic, version, layout digest, key, tokens, payload bytes, checksum
_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0
"""Temporary files older than this (seconds) are crash leftovers and removed at start-up."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(_INT_VIEW[t.element_size()]).numpy()).cast("B")


class DiskStore:
    """Content-addressed KV chunks under ``directory``, at most ``capacity_bytes`` of files.

    ``ValueError`` naming ``kv_disk_dir`` when the directory cannot be created or written, and
    naming ``kv_disk_bytes`` for a negative capacity.
    """

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, layout: TierLayout) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise ValueError(f"kv_disk_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.check_directory(directory)
        self.dir = Path(directory)
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self._digest = layout.digest()
        self.file_bytes = _HEADER.size + 8 * layout.chunk_tokens + layout.chunk_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.num_bytes = 0
        self.num_errors = 0
        self._scan()

    @staticmethod
    def check_directory(directory: object) -> None:
        """Create ``directory`` if needed and prove it writable, else ``ValueError`` naming
        ``kv_disk_dir`` (``TypeError`` for something that is not a path)."""
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"kv_disk_dir must be a directory path (str), got {type(directory).__name__}")
        if not str(directory):
            raise ValueError("kv_disk_dir must be a directory path, got ''")
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f"{_TMP_PREFIX}probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"kv_disk_dir {str(directory)!r} is not a writable directory: {exc}") from exc

    # ------------------------------------------------------------------ lookups
    def __contains__(self, key: bytes) -> bool:
        """In the index (no file system access)."""
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def has(self, key: bytes) -> bool:
        """In the index, or on disk (written by another process since the scan: then indexed)."""
        if key in self._index:
            return True
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.num_bytes += size
        return True

    def read(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The KV chunk stored under ``key`` for ``tokens``, or None (with a warning, entry
        dropped) when the file is missing, truncated, corrupt, of another layout or other tokens."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            return self._bad(key, f"cannot be read ({exc.__class__.__name__})", delete=False)
        if len(data) != self.file_bytes:
            return self._bad(key, f"has {len(data)} bytes, expected {self.file_bytes} (truncated or foreign)")
        magic, version, digest, stored_key, ntok, nbytes, checksum = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != FORMAT_VERSION:
            return self._bad(key, "has a foreign header")
        if digest != self._digest or stored_key != key:
            return self._bad(key, "belongs to another model or layout")
        if ntok != self.layout.chunk_tokens or nbytes != self.layout.chunk_bytes:
            return self._bad(key, "has another chunk shape")
        body = memoryview(data)[_HEADER.size :]
        if hashlib.blake2b(body, digest_size=16).digest() != checksum:
            return self._bad(key, "fails its checksum (corrupt)")
        stored_tokens = np.frombuffer(body[: 8 * ntok], dtype=np.int64)
        if not np.array_equal(stored_tokens, np.asarray(tokens, dtype=np.int64)):
            return self._bad(key, "holds other tokens")
        payload = bytearray(body[8 * ntok :])
        kv = torch.frombuffer(payload, dtype=self.layout.dtype).view(self.layout.chunk_shape)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)
        except OSError:
            pass
        return kv

    # ------------------------------------------------------------------ writes
    def write(self, key: bytes, tokens: tuple[int, ...], kv: torch.Tensor) -> bool:
        """Store ``kv`` (CPU, the layout's shape) under ``key``, crash-safe; evict least recently
        used files to stay within capacity. False when it does not fit or the write failed (logged)."""
        if key in self._index:
            return True
        if self.file_bytes > self.capacity_bytes:
            return False
        if tuple(kv.shape) != self.layout.chunk_shape or kv.dtype != self.layout.dtype or kv.device.type != "cpu":
            raise ValueError(f"kv must be a CPU {self.layout.dtype} tensor of shape {self.layout.chunk_shape}")
        if len(tokens) != self.layout.chunk_tokens:
            raise ValueError(f"tokens must hold {self.layout.chunk_tokens} ids, got {len(tokens)}")
        self._make_room(self.file_bytes)
        token_bytes = np.asarray(tokens, dtype=np.int64).tobytes()
        payload = _as_bytes(kv)
        h = hashlib.blake2b(digest_size=16)
        h.update(token_bytes)
        h.update(payload)
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, self._digest, key, len(tokens), payload.nbytes, h.digest())
        tmp = self.dir / f"{_TMP_PREFIX}{key.hex()}-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for part in (header, token_bytes, payload):
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path(key))
            self._sync_dir()
        except OSError as exc:
            log.warning("treeserve: KV disk tier could not write %s: %s", key.hex(), exc)
            tmp.unlink(missing_ok=True)
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = self.file_bytes
                self.num_bytes += self.file_bytes
        return True

    def remove(self, key: bytes) -> None:
        """Forget ``key`` and delete its file (missing files are fine)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.num_bytes -= size
        self._path(key).unlink(missing_ok=True)

    # ------------------------------------------------------------------ integrity
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless the index and its byte count agree, every indexed file
        exists with its size, and the store is within capacity."""
        with self._lock:
            index = dict(self._index)
            num_bytes = self.num_bytes
        if sum(index.values()) != num_bytes:
            raise InvariantError(f"disk tier: index sums to {sum(index.values())} bytes, counter says {num_bytes}")
        if num_bytes > self.capacity_bytes:
            raise InvariantError(f"disk tier holds {num_bytes} bytes > capacity {self.capacity_bytes}")
        for key, size in index.items():
            path = self._path(key)
            if not path.is_file() or path.stat().st_size != size:
                raise InvariantError(f"disk tier: indexed entry {path.name} is missing or has another size")

    # ------------------------------------------------------------------ internals
    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{_SUFFIX}"

    def _bad(self, key: bytes, why: str, delete: bool = True) -> None:
        log.warning("treeserve: KV disk entry %s %s; recomputing it", key.hex(), why)
        self.num_errors += 1
        if delete:
            self.remove(key)
        else:
            with self._lock:
                size = self._index.pop(key, None)
                if size is not None:
                    self.num_bytes -= size

    def _make_room(self, nbytes: int) -> None:
        while True:
            with self._lock:
                if self.num_bytes + nbytes <= self.capacity_bytes or not self._index:
                    return
                victim = next(iter(self._index))
            self.remove(victim)

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.dir, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _scan(self) -> None:
        """Index the directory's entries, oldest use first; drop stale temporaries."""
        now = time.time()
        found: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.startswith(_TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            stem, dot, suffix = entry.name.partition(".")
            if dot and "." + suffix == _SUFFIX and len(stem) == 32:
                try:
                    found.append((st.st_mtime, bytes.fromhex(stem), st.st_size))
                except ValueError:
                    continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self.num_bytes += size
        self._make_room(0)
