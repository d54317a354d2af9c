"""KV tiers under the device pool: host memory, then an optional disk directory (HiCache-style).

:class:`KVTiers` moves whole chunks (:mod:`treeserve.kvcache.tier_key`) between one
:class:`KVPool` and the stores below it; the :class:`~treeserve.kvcache.RadixCache` decides when:

- **demote**: when the tree evicts a node from the device pool, every chunk that ends inside
  the node is copied to the host tier (its earlier tokens sit in the node's ancestors, still on
  the device). A chunk already on the host is only marked used. The host tier's LRU spills to
  the disk tier (a chunk already there is just dropped).
- **write-through**: a finished request's whole chunks (``RadixCache.release_request``) are
  written to the disk tier in the background, so a restart, or another replica, finds them.
- **promote**: a prefix match that ends in the tree continues through the chunks the host and
  disk tiers hold, in order; their KV is copied into freshly allocated device pages and
  inserted into the tree (disk chunks pass through the host tier). A chunk that is missing,
  truncated, corrupt or of another model stops the walk there: those tokens are recomputed.

On CPU every copy is synchronous. On CUDA the host tier is pinned and copies run on one side
stream (so a promotion is ordered after the demotion that produced its chunk); a promotion
returns a CUDA event the tree records on the new node. Only a fully copied chunk is published
to a lower tier: host chunks carry their copy's event, disk entries appear by atomic rename.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .disk_store import DiskStore
from .host_store import HostChunk, HostStore
from .pool import InvariantError, KVPool
from .tier_key import TierLayout, chunk_keys

__all__ = ["Fetched", "KVTiers", "TierStats"]

log = logging.getLogger("treeserve.kvcache")

HOST, DISK = "host", "disk"
_MAX_PENDING_BYTES = 1 << 30  # queued disk writes beyond this are dropped (the writer is behind)


@dataclass(slots=True)
class TierStats:
    """Counters since the tiers were built.

    ``host_hit_tokens`` / ``disk_hit_tokens``: tokens promoted into the device pool from that
    tier. ``bytes_*``: KV bytes copied device -> host (demotions), host -> device and disk ->
    device (promotions), and written to disk. ``disk_writes_dropped``: chunks not written because
    the writer was 1 GiB behind. ``disk_errors``: entries found missing, truncated, corrupt or
    foreign (each recomputed).
    """

    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_disk_to_device: int = 0
    bytes_to_disk: int = 0
    disk_writes_dropped: int = 0
    disk_errors: int = 0


class Fetched(NamedTuple):
    """Chunks ``first_chunk, first_chunk + 1, ...`` of a query, found in the tiers in order."""

    first_chunk: int
    chunks: list[HostChunk]
    sources: list[str]


class _DiskWriter:
    """One background thread that writes queued chunks to a :class:`DiskStore`."""

    def __init__(self, disk: DiskStore, stats: TierStats) -> None:
        self.disk = disk
        self.stats = stats
        self.pending: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, HostChunk] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="treeserve-kv-disk", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, chunk: HostChunk) -> None:
        with self._lock:
            if key in self.pending or key in self.disk:
                return
            if sum(self.pending.values()) + self.disk.file_bytes > _MAX_PENDING_BYTES:
                self.stats.disk_writes_dropped += 1
                return
            self.pending[key] = self.disk.file_bytes
        self._queue.put((key, chunk))

    def flush(self) -> None:
        """Wait until every queued chunk is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, chunk = item
                if self.disk.write(key, chunk.tokens, chunk.wait().cpu()):
                    self.stats.bytes_to_disk += self.disk.file_bytes
            except Exception:  # a failed write costs a recompute later, never the engine
                log.exception("treeserve: KV disk tier write failed")
            finally:
                if item is not None:
                    with self._lock:
                        self.pending.pop(item[0], None)
                self._queue.task_done()


class KVTiers:
    """Host (``host_tokens``) and disk (``disk_dir``, ``disk_bytes``) tiers under ``pool``.

    ``layout`` must describe ``pool`` (layers, KV heads, head size, dtype, page size); its
    ``model_id`` names the weights, so keys of another model never match. ``host_tokens`` 0 and
    no ``disk_dir`` is allowed (nothing is kept). Bad values raise ``ValueError`` naming
    ``kv_host_tokens``, ``kv_disk_dir`` or ``kv_disk_bytes``. Call :meth:`close` (or
    :meth:`flush`) to wait for background disk writes.
    """

    def __init__(
        self,
        pool: KVPool,
        layout: TierLayout,
        host_tokens: int,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
    ) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size"):
            if getattr(layout, name) != getattr(pool, name):
                raise ValueError(f"layout.{name}={getattr(layout, name)} does not match the pool's {getattr(pool, name)}")
        self.pool = pool
        self.layout = layout
        self.chunk_tokens = layout.chunk_tokens
        self.page_size = layout.page_size
        self.device = pool.device
        self._cuda = pool.device.type == "cuda"
        self.host = HostStore(layout, host_tokens, pin=self._cuda)
        self.disk = DiskStore(disk_dir, disk_bytes, layout) if disk_dir is not None else None
        self.stats = TierStats()
        self._seed = layout.digest()
        self._writer = _DiskWriter(self.disk, self.stats) if self.disk is not None else None
        # Queued writes land even when the engine is never closed (at exit, or when collected).
        self._closer = weakref.finalize(self, self._writer.close) if self._writer is not None else None
        self._side = torch.cuda.Stream(pool.device) if self._cuda else None
        self._token_bytes = layout.chunk_bytes // layout.chunk_tokens

    def keys(self, tokens: tuple[int, ...], num_chunks: int) -> list[bytes]:
        """Chained keys of the first ``num_chunks`` chunks of ``tokens``."""
        return chunk_keys(self._seed, tokens, num_chunks, self.chunk_tokens)

    # ------------------------------------------------------------------ device -> tiers
    def demote(self, tokens: tuple[int, ...], slots: torch.Tensor, start: int) -> None:
        """``tokens`` (whose KV is at device ``slots``) leave the device pool from ``start`` on:
        keep every whole chunk that ends after ``start`` (host tier, else disk tier)."""
        c = self.chunk_tokens
        first, last = start // c, len(tokens) // c
        if first >= last or (self.host.max_chunks == 0 and self.disk is None):
            return
        keys = self.keys(tokens, last)
        for i in reversed(range(first, last)):  # a prefix's first chunks end most recently used
            key = keys[i]
            if key in self.host:
                self.host.get(key)
            elif self.host.max_chunks:
                self._to_host(key, self._gather(tokens, slots, i))
                self.stats.bytes_device_to_host += self.layout.chunk_bytes
            elif self._writer is not None and key not in self.disk:
                self._writer.submit(key, self._gather(tokens, slots, i))

    def write_through(self, tokens: tuple[int, ...], slots: torch.Tensor) -> None:
        """Queue the whole chunks of ``tokens`` (KV at device ``slots``) the disk tier lacks."""
        if self._writer is None:
            return
        c = self.chunk_tokens
        keys = self.keys(tokens, len(tokens) // c)
        for i, key in enumerate(keys):
            if key in self.disk or key in self._writer.pending:
                continue
            chunk = self.host.get(key) if key in self.host else self._gather(tokens, slots, i)
            self._writer.submit(key, chunk)

    # ------------------------------------------------------------------ tiers -> device
    def fetch(self, tokens: tuple[int, ...], start: int, limit: int) -> Fetched | None:
        """The chunks continuing a match of ``start`` tokens, up to ``limit`` tokens, found in
        order (host first, then disk); None when none is. Reads disk chunks (checked) into the
        host tier. Changes nothing in the device pool."""
        c = self.chunk_tokens
        first, end = start // c, min(len(tokens) // c, -(-limit // c))
        if first >= end or (not len(self.host) and self.disk is None):
            return None
        keys = self.keys(tokens, end)
        chunks: list[HostChunk] = []
        sources: list[str] = []
        for i in range(first, end):
            key = keys[i]
            chunk = self.host.get(key)
            source = HOST
            if chunk is None:
                chunk = self._read_disk(key, tuple(tokens[i * c : (i + 1) * c]))
                source = DISK
            if chunk is None:
                break
            chunks.append(chunk)
            sources.append(source)
        for i in reversed(range(first, first + len(chunks))):  # the earliest chunks most recently used
            self.host.get(keys[i])
        return Fetched(first, chunks, sources) if chunks else None

    def load(self, fetched: Fetched, start: int, slots: torch.Tensor) -> Any:
        """Copy the KV of tokens ``start .. start + len(slots)`` from ``fetched`` into the device
        pool at ``slots``. Returns None (CPU: done) or a CUDA event recorded after the copy.

        On CUDA, on the side stream: one host -> device copy per whole chunk (pinned, contiguous),
        one concatenation of the wanted tokens on the device, then one scatter per layer and K/V
        for the whole load, so the launches do not grow with the number of chunks. On CPU each
        chunk's tokens are scattered straight from the host tier (no staging copy)."""
        c = self.chunk_tokens
        end = start + slots.numel()
        pieces: list[tuple[torch.Tensor, int, int]] = []  # (chunk KV, first, end token within the chunk)
        pos = start
        for j, chunk in enumerate(fetched.chunks):
            base = (fetched.first_chunk + j) * c
            a, b = pos - base, min(end, base + c) - base
            if b <= a:
                break
            pieces.append((chunk.kv, a, b))
            n = b - a
            if fetched.sources[j] == HOST:
                self.stats.host_hit_tokens += n
                self.stats.bytes_host_to_device += n * self._token_bytes
            else:
                self.stats.disk_hit_tokens += n
                self.stats.bytes_disk_to_device += n * self._token_bytes
            pos += n
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # the pages' previous readers
            slots.record_stream(self._side)
        with torch.cuda.stream(self._side) if self._side is not None else nullcontext():
            if self._cuda:
                parts = [kv.to(self.device, non_blocking=True)[:, :, a:b] for kv, a, b in pieces]
                sources = [(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0], slots[: pos - start])] if parts else []
            else:
                sources, off = [], 0
                for kv, a, b in pieces:
                    sources.append((kv[:, :, a:b], slots[off : off + b - a]))
                    off += b - a
            for kv, part in sources:
                for layer in range(self.layout.num_layers):
                    for which, caches in enumerate((self.pool.k_caches, self.pool.v_caches)):
                        flat = caches[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim)
                        flat.index_copy_(0, part, kv[layer, which])
        if self._side is None:
            return None
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    # ------------------------------------------------------------------ housekeeping
    def flush(self) -> None:
        """Wait for queued disk writes."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Finish queued disk writes and stop the writer thread (idempotent; also run at exit)."""
        if self._closer is not None:
            self._closer()
            self._writer = None

    def check_invariants(self) -> None:
        """Each tier's own accounting (:meth:`HostStore.check_invariants`,
        :meth:`DiskStore.check_invariants`; queued writes flushed first)."""
        self.host.check_invariants()
        if self.disk is not None:
            self.flush()
            self.disk.check_invariants()
            if self._writer is not None and self._writer.pending:
                raise InvariantError(f"{len(self._writer.pending)} disk writes still pending after a flush")

    # ------------------------------------------------------------------ internals
    def _to_host(self, key: bytes, chunk: HostChunk) -> None:
        """Put ``chunk`` in the host tier; what that pushes out goes to the disk tier."""
        for spilled_key, spilled in self.host.put(key, chunk):
            if self._writer is not None:
                self._writer.submit(spilled_key, spilled)

    def _read_disk(self, key: bytes, tokens: tuple[int, ...]) -> HostChunk | None:
        if self.disk is None or not self.disk.has(key):
            return None
        kv = self.disk.read(key, tokens)
        if kv is None:
            self.stats.disk_errors = self.disk.num_errors
            return None
        chunk = HostChunk(tokens, kv.pin_memory() if self._cuda else kv)
        self._to_host(key, chunk)
        return chunk

    def _gather(self, tokens: tuple[int, ...], slots: torch.Tensor, i: int) -> HostChunk:
        """Copy chunk ``i``'s KV out of the device pool into a host chunk."""
        c, lay = self.chunk_tokens, self.layout
        part = slots[i * c : (i + 1) * c]
        dst = torch.empty(lay.chunk_shape, dtype=lay.dtype, device=self.device) if self._cuda else self.host.empty_chunk()
        for layer in range(lay.num_layers):
            for which, caches in enumerate((self.pool.k_caches, self.pool.v_caches)):
                flat = caches[layer].view(-1, lay.num_kv_heads, lay.head_dim)
                torch.index_select(flat, 0, part, out=dst[layer, which])
        chunk_tokens = tuple(tokens[i * c : (i + 1) * c])
        if not self._cuda:
            return HostChunk(chunk_tokens, dst)
        host = self.host.empty_chunk()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            host.copy_(dst, non_blocking=True)
        dst.record_stream(self._side)
        event = torch.cuda.Event()
        event.record(self._side)
        return HostChunk(chunk_tokens, host, event)

