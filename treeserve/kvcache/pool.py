"""Paged KV memory: the page allocator, the per-layer K/V buffers and the page -> slot helper.

Ownership: a ``PageAllocator`` hands out page ids; whoever received a page (a running request,
or the radix cache once it took the page over) owns it until it gives it back with ``free``.
Page 0 is the dummy page (padding writes land there): it is never handed out and never freed.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from ._checks import debug_checks_enabled

__all__ = [
    "InvariantError",
    "KVPool",
    "OutOfPagesError",
    "PageAllocator",
    "pages_to_slots",
]


class OutOfPagesError(RuntimeError):
    """Fewer pages are free than were asked for; the allocator is unchanged."""


class InvariantError(AssertionError):
    """A ``check_invariants()`` found inconsistent accounting; the message says what and where."""


def _check_page_tensor(pages: torch.Tensor, name: str = "pages") -> None:
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 page ids, got {type(pages).__name__}")
    if pages.dtype != torch.int64:
        raise TypeError(f"{name} must have dtype torch.int64, got {pages.dtype}")
    if pages.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(pages.shape)}")


def pages_to_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots covering ``pages`` in order: ``pages[i] * page_size + j`` for ``j < page_size``.

    Returns an int64 tensor of ``len(pages) * page_size`` slots on ``pages.device``.
    """
    _check_page_tensor(pages)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages[:, None] * page_size + offsets).reshape(-1)


class PageAllocator:
    """Hands out page ids ``1 .. num_pages - 1``; page 0 is the reserved dummy page.

    State is two tensors: a stack of free page ids (the top ``num_free`` entries are free) and a
    per-page ``free`` mask. ``alloc`` and ``free`` are vectorized (no Python loop per page) and
    validate their input completely before touching state, so a rejected call changes nothing.
    The mask is read and written with ``index_select`` / ``index_fill_``: on CPU, advanced indexing
    (``mask[pages]``) of a few thousand ids takes the intra-op-parallel path, which costs
    milliseconds on a busy machine.
    """

    __slots__ = ("num_pages", "page_size", "device", "_stack", "_is_free", "_num_free")

    def __init__(self, num_pages: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the dummy page), got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # Reversed so that the first allocations return low page ids (1, 2, ...): easier to read.
        self._stack = torch.arange(num_pages - 1, 0, -1, dtype=torch.int64, device=self.device)
        self._is_free = torch.ones(num_pages, dtype=torch.bool, device=self.device)
        self._is_free[0] = False
        self._num_free = num_pages - 1

    @property
    def capacity(self) -> int:
        """Number of pages that can ever be handed out (``num_pages - 1``)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Number of pages currently free."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Number of pages currently handed out."""
        return self.capacity - self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Hand out ``n`` distinct free pages as an int64 tensor (``0 <= n <= capacity``).

        Raises ``ValueError`` for ``n`` outside ``[0, capacity]`` and ``OutOfPagesError`` when fewer
        than ``n`` pages are free; either way nothing changes.
        """
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0 or n > self.capacity:
            raise ValueError(f"n must be in [0, capacity={self.capacity}], got {n}")
        if n > self._num_free:
            raise OutOfPagesError(f"asked for {n} pages, only {self._num_free} of {self.capacity} are free")
        start = self._num_free - n
        pages = self._stack[start : self._num_free].flip(0)
        self._is_free.index_fill_(0, pages, False)
        self._num_free = start
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Give ``pages`` (int64, 1-D) back.

        With debug checks on (``TREESERVE_DEBUG_CHECKS=1``), raises ``ValueError`` if a page is
        the dummy page 0, outside ``[1, num_pages)``, already free, or listed twice; nothing changes
        in that case. (Those checks read device data on the host, so the serving path skips them.)
        """
        _check_page_tensor(pages)
        k = pages.numel()
        if k == 0:
            return
        pages = pages.to(self.device)
        if debug_checks_enabled():
            self._check_freeable(pages)
        self._stack[self._num_free : self._num_free + k] = pages
        self._is_free.index_fill_(0, pages, True)
        self._num_free += k

    def _check_freeable(self, pages: torch.Tensor) -> None:
        k = pages.numel()
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi >= self.num_pages:
            raise ValueError(
                f"pages must be in [1, num_pages={self.num_pages}) (page 0 is the dummy page), "
                f"got values in [{lo}, {hi}]"
            )
        already = self._is_free.index_select(0, pages)
        if bool(already.any()):
            bad = pages[already].tolist()
            raise ValueError(f"pages {bad[:8]} are already free (double free)")
        if k > 1 and torch.unique(pages).numel() != k:
            raise ValueError("pages lists the same page more than once")

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each of ``pages`` is currently free (page ids must be in range)."""
        _check_page_tensor(pages)
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
            raise ValueError(f"pages must be in [0, num_pages={self.num_pages})")
        return self._is_free.index_select(0, pages.to(self.device))

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless the free stack and the free mask agree exactly."""
        if not 0 <= self._num_free <= self.capacity:
            raise InvariantError(f"allocator: num_free={self._num_free} outside [0, {self.capacity}]")
        if bool(self._is_free[0]):
            raise InvariantError("allocator: dummy page 0 is marked free")
        free = self._stack[: self._num_free]
        if free.numel() and (int(free.min()) < 1 or int(free.max()) >= self.num_pages):
            raise InvariantError("allocator: free stack holds a page id out of [1, num_pages)")
        if torch.unique(free).numel() != free.numel():
            raise InvariantError("allocator: a page appears twice on the free stack")
        mask_count = int(self._is_free.sum())
        if mask_count != self._num_free:
            raise InvariantError(f"allocator: free mask counts {mask_count} pages, num_free={self._num_free}")
        if free.numel() and not bool(self._is_free[free].all()):
            raise InvariantError("allocator: a page on the free stack is marked used in the mask")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from memory the OS maps (zero pages, lazily), aligned for the decode
    attention operator's random row reads.

    ``torch.zeros`` writes every byte: 1.5 GB for the default 32k-token float32 pool of SmolLM2,
    seconds at start-up, and resident memory for pages no request ever touches. Two alignments
    matter (benches/RESULTS.md, AVX-512 EPYC):

    - a cache line: ``calloc`` of a large block returns an address 16 bytes past a page boundary,
      where a 128-byte bfloat16 row of head_dim 64 straddles three cache lines instead of two; the
      decode attention operator ran 2.4x slower;
    - a 2 MiB huge page: decode reads K/V rows scattered over the whole pool (one slot per request
      per step), a TLB miss per row on 4 KiB pages. Buffers of at least ``_HUGE`` bytes are an
      anonymous ``mmap`` started on a ``_HUGE`` boundary and advised ``MADV_HUGEPAGE`` (Linux
      transparent huge pages, which hosts commonly enable only on request): decode attention at
      batch 64 x 168 ran 17-20% faster. Smaller buffers, and hosts without the advice, take the
      ``calloc`` path started on a ``_ALIGN`` boundary.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    align = _HUGE if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE") else _ALIGN
    if align == _HUGE:
        region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: the mapping serves as it is
            pass
        raw = np.frombuffer(region, dtype=np.uint8)  # holds the mapping alive as long as the tensor
    else:
        raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


_ALIGN = 4096  # a page: every cache line, and every row of a power-of-two size up to a page, aligned
_HUGE = 2 << 20  # a transparent huge page on x86-64


class KVPool:
    """Per-layer paged K and V buffers plus the ``PageAllocator`` that owns their pages.

    ``k_caches[l]`` and ``v_caches[l]`` have shape ``[num_pages, page_size, num_kv_heads, head_dim]``
    (NHD; slot ``s`` is ``[s // page_size, s % page_size]``). The pool only holds memory; page
    ownership is tracked by ``allocator``.
    """

    __slots__ = ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim", "dtype", "device",
                 "k_caches", "v_caches", "allocator")

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.allocator = PageAllocator(num_pages, page_size, device)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_caches = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]
        self.v_caches = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page takes across all layers, K and V together (for sizing ``num_pages``)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @property
    def memory_bytes(self) -> int:
        """Bytes held by all K and V buffers of this pool."""
        return self.num_pages * self.bytes_per_page(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )
