"""Keys of KV held outside the device pool: the layout digest and the chained hash per chunk.

A *chunk* is ``chunk_tokens`` consecutive tokens starting at a multiple of ``chunk_tokens`` (a
whole number of pages). Chunk ``i`` of a token sequence is keyed by
``h_i = blake2b(h_{i-1} || tokens[i*C:(i+1)*C])`` with ``h_{-1}`` the digest of the
:class:`TierLayout` (model identity, KV dtype, layers, heads, head size, page size, chunk size,
format version): the key names the whole prefix up to the chunk's end, so the KV stored under it
is the KV of exactly those tokens under exactly that model and layout. A key from another model,
dtype or layout never equals one of ours; a lookup that misses means recompute.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["FORMAT_VERSION", "TierLayout", "chunk_keys", "default_chunk_tokens", "module_fingerprint"]

FORMAT_VERSION = 1
_CHUNK_TARGET = 64  # tokens: small enough that an evicted leaf loses little, large enough per file


def default_chunk_tokens(page_size: int) -> int:
    """The smallest whole number of pages holding at least 64 tokens."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    return -(-_CHUNK_TARGET // page_size) * page_size


@dataclass(frozen=True, slots=True)
class TierLayout:
    """What a chunk of KV outside the device pool is: its model and its tensor layout.

    A chunk's tensor is ``[num_layers, 2 (K, V), chunk_tokens, num_kv_heads, head_dim]`` of
    ``dtype``. ``model_id`` names the weights (the engine uses the model name plus
    :func:`module_fingerprint`); two layouts share keys only when every field is equal.
    """

    model_id: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    chunk_tokens: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.chunk_tokens % self.page_size:
            raise ValueError(f"chunk_tokens must be a multiple of page_size={self.page_size}, got {self.chunk_tokens}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk's K and V over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return itemsize * self.num_layers * 2 * self.chunk_tokens * self.num_kv_heads * self.head_dim

    def digest(self) -> bytes:
        """16 bytes naming this layout (the chain's seed)."""
        text = (f"treeserve-kv/{FORMAT_VERSION}|{self.model_id}|{self.dtype}|{self.num_layers}|{self.num_kv_heads}|"
                f"{self.head_dim}|{self.page_size}|{self.chunk_tokens}|NHD")  # fmt: skip
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


def chunk_keys(seed: bytes, tokens: tuple[int, ...] | list[int], num_chunks: int, chunk_tokens: int) -> list[bytes]:
    """The chained keys of the first ``num_chunks`` chunks of ``tokens`` (all of them whole)."""
    if num_chunks * chunk_tokens > len(tokens):
        raise ValueError(f"num_chunks={num_chunks} of {chunk_tokens} tokens exceed the {len(tokens)} tokens given")
    data = np.asarray(tokens[: num_chunks * chunk_tokens], dtype=np.int64).tobytes()
    step = chunk_tokens * 8
    keys, h = [], seed
    for i in range(num_chunks):
        h = hashlib.blake2b(h + data[i * step : (i + 1) * step], digest_size=16).digest()
        keys.append(h)
    return keys


def module_fingerprint(module: torch.nn.Module, samples: int = 256) -> str:
    """A short hex digest of a module's weights: every parameter's and buffer's name, shape,
    dtype and ``samples`` evenly spaced values (cheap: it reads a few pages of each tensor, never
    the whole model). Two checkpoints that differ only at unsampled positions collide; the names
    and shapes alone already separate architectures. A submodule's tensors named in its
    ``derived_tensors`` (a weight rebuilt from codes the module also holds, which it may build
    or free at any time) are left out, so the digest does not depend on when they exist."""
    h = hashlib.blake2b(digest_size=12)
    with torch.no_grad():
        for name, t in _own_tensors(module):
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            flat = t.detach().reshape(-1)
            if flat.numel():
                k = min(samples, flat.numel())
                idx = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)
                h.update(flat[idx].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


def _own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of every parameter and buffer of ``module`` and its submodules,
    module by module, less each submodule's ``derived_tensors``."""
    out = []
    for prefix, sub in module.named_modules():
        derived = set(getattr(sub, "derived_tensors", ()))
        for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if name not in derived:
                out.append((f"{prefix}.{name}" if prefix else name, t))
    return out
