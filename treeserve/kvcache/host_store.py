"""The host-memory tier: KV chunks in an LRU bounded by a token capacity.

Ownership: the store owns every chunk tensor put into it; ``get`` hands out the tensor itself
(readers must not write to it). A chunk put with a CUDA ``ready`` event is being copied in on a
side stream: readers on the CPU call :meth:`HostChunk.wait` first; readers on that same stream
are ordered after the copy anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .pool import InvariantError
from .tier_key import TierLayout

__all__ = ["HostChunk", "HostStore"]


@dataclass(slots=True, eq=False)
class HostChunk:
    """One chunk's tokens (to check a disk entry against) and its KV tensor (``layout.chunk_shape``)."""

    tokens: tuple[int, ...]
    kv: torch.Tensor
    ready: Any = None  # a torch.cuda.Event while a device -> host copy is in flight

    def wait(self) -> torch.Tensor:
        """The KV tensor once its copy has landed (blocks the host on CUDA; no-op on CPU)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.kv


class HostStore:
    """LRU of :class:`HostChunk` by key, holding at most ``capacity_tokens`` tokens.

    ``put`` of a new key returns the chunks it pushed out (least recently used first) so that the
    caller can send them one tier down; a key already present is only marked used. ``pin``:
    allocate chunk tensors in pinned memory (the pool is on CUDA).
    """

    def __init__(self, layout: TierLayout, capacity_tokens: int, pin: bool = False) -> None:
        if not isinstance(capacity_tokens, int) or isinstance(capacity_tokens, bool) or capacity_tokens < 0:
            raise ValueError(f"kv_host_tokens must be an int >= 0, got {capacity_tokens!r}")
        self.layout = layout
        self.capacity_tokens = capacity_tokens
        self.pin = pin
        self._chunks: OrderedDict[bytes, HostChunk] = OrderedDict()

    @property
    def num_tokens(self) -> int:
        return len(self._chunks) * self.layout.chunk_tokens

    @property
    def max_chunks(self) -> int:
        return self.capacity_tokens // self.layout.chunk_tokens

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: bytes) -> bool:
        """Membership without marking the chunk used."""
        return key in self._chunks

    def empty_chunk(self) -> torch.Tensor:
        """An uninitialised tensor for one chunk (pinned when the store pins)."""
        return torch.empty(self.layout.chunk_shape, dtype=self.layout.dtype, pin_memory=self.pin)

    def get(self, key: bytes) -> HostChunk | None:
        """The chunk under ``key`` (marked most recently used), or None."""
        chunk = self._chunks.get(key)
        if chunk is not None:
            self._chunks.move_to_end(key)
        return chunk

    def put(self, key: bytes, chunk: HostChunk) -> list[tuple[bytes, HostChunk]]:
        """Store ``chunk`` under ``key`` (or mark the present one used); return the evicted chunks."""
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return []
        if self.max_chunks == 0:
            return [(key, chunk)]
        if chunk.kv.shape != self.layout.chunk_shape or chunk.kv.dtype != self.layout.dtype:
            raise ValueError(f"chunk must be {self.layout.dtype} of shape {self.layout.chunk_shape}, "
                             f"got {chunk.kv.dtype} {tuple(chunk.kv.shape)}")  # fmt: skip
        self._chunks[key] = chunk
        evicted = []
        while len(self._chunks) > self.max_chunks:
            evicted.append(self._chunks.popitem(last=False))
        return evicted

    def clear(self) -> None:
        self._chunks.clear()

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every chunk has the layout's shape, dtype and token
        count, no two chunks share memory, and the store is within capacity."""
        if self.num_tokens > self.capacity_tokens:
            raise InvariantError(f"host tier holds {self.num_tokens} tokens > capacity {self.capacity_tokens}")
        storages: set[int] = set()
        for key, chunk in self._chunks.items():
            where = f"host chunk {key.hex()}"
            if chunk.kv.shape != self.layout.chunk_shape or chunk.kv.dtype != self.layout.dtype:
                raise InvariantError(f"{where}: tensor {chunk.kv.dtype} {tuple(chunk.kv.shape)} is not the layout's")
            if len(chunk.tokens) != self.layout.chunk_tokens:
                raise InvariantError(f"{where}: {len(chunk.tokens)} tokens, expected {self.layout.chunk_tokens}")
            ptr = chunk.kv.untyped_storage().data_ptr()
            if ptr in storages:
                raise InvariantError(f"{where}: shares memory with another chunk")
            storages.add(ptr)
