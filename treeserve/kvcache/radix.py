"""Radix prefix tree over token ids that shares KV pages between requests (SGLang-style).

Ownership: pages a request got from ``PageAllocator.alloc`` belong to the request until it hands
them to the tree (``insert`` / ``release_request``); from then on the tree owns them and gives them
back to the allocator only when it evicts them (or on ``reset``). Pages the tree owns are either
*protected* (on the path of a live lock) or *evictable*; at any time
``allocator.num_free + tree pages + pages held by requests == allocator.capacity``.

Matching and sharing are at page granularity: every edge key is a whole number of pages, children
are keyed by their first page (the first token when ``page_size == 1``), and a match never covers
the last token of the query, so at least one token is always computed.

Eviction removes least-recently-used unlocked leaves. Evictable leaves are kept incrementally in a
set plus a min-heap on last-access time with lazy invalidation (a stale entry is skipped when
popped), so one ``evict`` call costs O(k log n) for k evicted leaves, never a walk of the tree.

With ``tiers`` (:class:`~treeserve.kvcache.tiers.KVTiers`) the tree is the device tier of a
hierarchy: an evicted leaf's KV is demoted (host memory, then disk) instead of dropped, a
released request's KV is written through to disk, and a match that ends in the tree continues
through the lower tiers' chunks, which are promoted (copied into fresh device pages and inserted
as a node) instead of recomputed. Nodes in the tree always have their KV on the device; what
left it is found in the tiers by the chained hash of its token prefix (LightLLM's and SGLang's
HiCache's scheme), so it outlives the node and, on disk, the process.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from ._checks import debug_checks_enabled
from .pool import InvariantError, PageAllocator, pages_to_slots
from .radix_node import RadixNode, child_key, common_prefix_len

if TYPE_CHECKING:
    from .tiers import KVTiers

__all__ = ["LockHandle", "PrefixMatch", "RadixCache", "ReleaseResult"]

Tokens = Sequence[int] | torch.Tensor


class PrefixMatch(NamedTuple):
    """Result of ``match_prefix``: ``slots[:length]`` hold the KV of ``tokens[:length]``.

    ``slots`` is a fresh int64 tensor the caller may keep or modify; ``node`` is the deepest tree
    node of the match (the tree root when ``length == 0``), to be passed to ``lock``.
    """

    length: int
    slots: torch.Tensor
    node: RadixNode


@dataclass(frozen=True, slots=True, eq=False)
class LockHandle:
    """Receipt for one ``lock``: pass it to ``unlock`` exactly once."""

    serial: int
    node: RadixNode


class ReleaseResult(NamedTuple):
    """What ``release_request`` did with a request's pages.

    ``cached_tokens``: leading tokens of the request now held by the tree (its page-aligned part,
    0 when the cache is disabled). ``duplicate_tokens``: tokens of that part the tree already held
    in other slots, whose request pages were freed. ``freed_pages``: pages returned to the
    allocator (duplicates plus the unaligned tail page, or everything when disabled).
    """

    cached_tokens: int
    duplicate_tokens: int
    freed_pages: int


class _Walk(NamedTuple):
    node: RadixNode  # deepest node fully matched
    length: int  # tokens matched through ``node``
    values: list[torch.Tensor]  # slot tensors of the fully matched nodes, root to ``node``
    partial: RadixNode | None  # child of ``node`` matched only in part
    partial_len: int  # whole-page tokens of ``partial`` that matched


class _Inserted(NamedTuple):
    cached: int  # leading tokens already in the tree before this insert
    kept: int  # leading tokens the tree now holds for this sequence
    duplicate_pages: torch.Tensor  # caller pages within tokens[:cached] that differ from the tree's


class RadixCache:
    """Prefix tree mapping token sequences to KV slots; see the module docstring for ownership.

    Counters: ``evictable_tokens`` / ``protected_tokens`` (tree tokens outside / on a locked path),
    ``total_tokens`` (their sum), ``hit_tokens`` / ``query_tokens`` (matched / looked-up tokens),
    ``num_nodes`` (tree nodes, the root excluded).
    With ``disable=True`` nothing is ever cached: matches are empty and inserts keep nothing.
    Token sequences are lists/tuples of ints or 1-D integer tensors. ``tiers``: the host / disk
    tiers below this tree's pool (see the module docstring); ``tiers.stats`` counts their hits.
    """

    def __init__(
        self, allocator: PageAllocator, page_size: int = 1, disable: bool = False, tiers: KVTiers | None = None
    ) -> None:
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        if page_size != allocator.page_size:
            raise ValueError(f"page_size must equal allocator.page_size={allocator.page_size}, got {page_size!r}")
        if tiers is not None and (tiers.page_size != page_size or tiers.pool.allocator is not allocator):
            raise ValueError("tiers must be built over this allocator's KVPool with the same page_size")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.tiers = None if disable else tiers
        self._loads: list[tuple[Any, LockHandle, tuple[int, ...]]] = []  # CUDA promotions in flight
        self.device = allocator.device
        self._owned = torch.zeros(allocator.num_pages, dtype=torch.bool, device=self.device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._next_serial = 0
        self._clock = 0
        self._root = self._new_node((), self._empty, None)
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._leaves: set[RadixNode] = set()
        self._locks: dict[int, LockHandle] = {}
        self.num_nodes = 0
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def total_tokens(self) -> int:
        """Tokens held by the tree (evictable + protected)."""
        return self.evictable_tokens + self.protected_tokens

    # ------------------------------------------------------------------ public operations

    def match_prefix(self, tokens: Tokens) -> PrefixMatch:
        """Longest cached prefix of ``tokens``, whole pages only and at most ``len(tokens) - 1`` tokens.

        Splits a node when the match ends inside its edge (so the returned node covers exactly the
        match), marks the path as recently used and updates ``hit_tokens`` / ``query_tokens``.
        """
        key = self._as_key(tokens, "tokens")
        if self.tiers is not None:
            self._promote(key, headroom=0)
            self._wait_loads()
        self.query_tokens += len(key)
        walk = self._prefix_walk(key)
        if walk is None:
            return PrefixMatch(0, self._empty.clone(), self._root)
        node, length, values = walk.node, walk.length, walk.values
        if walk.partial is not None:
            node = self._split(walk.partial, walk.partial_len)
            values.append(node.value)
            length += walk.partial_len
        self._touch(node)
        self.hit_tokens += length
        return PrefixMatch(length, torch.cat(values) if values else self._empty.clone(), node)

    def prefetch(self, tokens: Tokens, headroom: int = 0) -> bool:
        """Promote what the lower tiers hold of ``tokens``' prefix (keeping ``headroom`` pages
        free or evictable); True when that prefix is ready on the device now.

        On CPU the copy is synchronous, so always True. On CUDA the copy runs on a side stream and
        this is False until it is done (the new node is locked meanwhile): the scheduler admits
        the request on a later step instead of waiting. Without tiers: True, nothing happens.
        """
        if self.tiers is None:
            return True
        key = self._as_key(tokens, "tokens")
        self._poll_loads()
        self._promote(key, headroom)
        return not any(key[: len(k)] == k for _, _, k in self._loads)

    def prefix_len(self, tokens: Tokens) -> int:
        """``match_prefix(tokens).length``, read-only: no split, no LRU touch, no counter update.

        For ranking waiting requests (longest-prefix-match admission) without disturbing the tree.
        """
        walk = self._prefix_walk(self._as_key(tokens, "tokens"))
        if walk is None:
            return 0
        return walk.length + (walk.partial_len if walk.partial is not None else 0)

    def insert(self, tokens: Tokens, slots: torch.Tensor) -> int:
        """Cache the page-aligned part of ``tokens`` whose KV is at ``slots``; return tokens already cached.

        Marks exactly that part as recently used (splitting an edge it ends inside).

        The first ``k`` (returned) tokens were in the tree before; if the caller's slots for them
        differ from the tree's, the caller still owns those pages and must free them. The tree
        takes ownership of the caller's pages for aligned tokens ``k:``; pages past the aligned
        part stay with the caller. ``ValueError`` / ``TypeError`` for length mismatch, slots that
        do not cover whole allocated pages, or pages the tree already owns; state unchanged.
        """
        key = self._as_key(tokens, "tokens")
        aligned = len(key) // self.page_size * self.page_size
        slots = self._checked_slots(slots, len(key), aligned)
        return self._insert(key[:aligned], slots[:aligned]).cached

    def release_request(self, tokens: Tokens, slots: torch.Tensor, handle: LockHandle | None) -> ReleaseResult:
        """Hand a finished or paused request's KV to the cache; afterwards the request owns no pages.

        ``tokens`` are the request's tokens whose KV is written, ``slots`` their slots (the
        request's pages, including the unaligned tail page), ``handle`` the lock taken on its
        matched prefix (or ``None``). Inserts the aligned part, unlocks ``handle``, and frees the
        request's duplicate pages and tail page. A paused request resumes later with
        ``match_prefix``. Bad input raises before anything changes.
        """
        key = self._as_key(tokens, "tokens")
        slots = self._checked_slots(slots, len(key), len(key))
        if handle is not None:
            self._check_handle(handle)
        aligned = len(key) // self.page_size * self.page_size
        done = self._insert(key[:aligned], slots[:aligned])
        if handle is not None:
            self.unlock(handle)
        ps = self.page_size
        if self.tiers is not None and aligned:
            self.tiers.write_through(key[:aligned], slots[:aligned])
        to_free = torch.cat([done.duplicate_pages, slots[done.kept :: ps] // ps])
        self.allocator.free(to_free)
        return ReleaseResult(done.kept, done.duplicate_pages.numel() * ps, to_free.numel())

    def lock(self, node: RadixNode) -> LockHandle:
        """Protect ``node`` and its ancestors from eviction until the returned handle is unlocked.

        ``ValueError`` if ``node`` is not in this tree (evicted, or from another cache).
        """
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref == 0:
                self.evictable_tokens -= len(n.key)
                self.protected_tokens += len(n.key)
            n.lock_ref += 1
        self._leaves.discard(node)
        handle = LockHandle(self._new_serial(), node)
        self._locks[handle.serial] = handle
        return handle

    def unlock(self, handle: LockHandle) -> None:
        """Release the lock ``handle`` stands for. ``ValueError`` if it was already released."""
        self._check_handle(handle)
        del self._locks[handle.serial]
        node = handle.node
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_tokens -= len(node.key)
                self.evictable_tokens += len(node.key)
            node = node.parent
        self._refresh_leaf(handle.node)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens (whole leaves) if possible; return tokens freed.

        Removes least-recently-used unlocked leaves one at a time (a parent whose last child goes
        becomes a candidate) and returns their pages to the allocator. Frees fewer tokens only
        when nothing evictable is left.
        """
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        freed = 0
        pages: list[torch.Tensor] = []
        ps = self.page_size
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node not in self._leaves or stamp != node.last_access:
                continue  # stale entry: node was touched, locked, got a child, or is gone
            parent = node.parent
            if self.tiers is not None:
                path_key, path_slots = self._path_of(node)
                self.tiers.demote(path_key, path_slots, len(path_key) - len(node.key))
            del parent.children[child_key(node.key, 0, ps)]
            self._leaves.discard(node)
            node.parent = None
            self.num_nodes -= 1
            self.evictable_tokens -= len(node.key)
            freed += len(node.key)
            pages.append(node.value[::ps] // ps)
            self._refresh_leaf(parent)
        if pages:
            freed_pages = torch.cat(pages)
            self._owned.index_fill_(0, freed_pages, False)
            self.allocator.free(freed_pages)
        return freed

    def reset(self) -> None:
        """Drop every cached entry (pages go back to the allocator) and zero the counters.

        ``ValueError`` while any lock is live (running requests still read those pages). The
        lower tiers keep their chunks.
        """
        self._wait_loads()
        if self._locks:
            raise ValueError(f"reset() with {len(self._locks)} live locks; unlock them first")
        pages = self._owned.nonzero().flatten()
        self.allocator.free(pages)
        self._owned.zero_()
        self._root = self._new_node((), self._empty, None)
        self._heap.clear()
        self._leaves.clear()
        self.num_nodes = 0
        self.evictable_tokens = self.protected_tokens = 0
        self.hit_tokens = self.query_tokens = 0

    # ------------------------------------------------------------------ integrity

    def check_invariants(self, request_pages: torch.Tensor | None = None) -> None:
        """Raise ``InvariantError`` with a precise message if any accounting is off.

        Checks the allocator, every node's shape / ownership / page structure, that no page is
        owned twice or also free, that lock counts equal the live locks below each node, the
        token counters, the evictable-leaf set and its heap. With ``request_pages`` (the pages
        running requests hold outside the tree) also checks
        ``free + tree pages + request pages == capacity``.
        """
        self.allocator.check_invariants()
        if self.tiers is not None:
            self.tiers.check_invariants()
        ps = self.page_size
        expected_ref: dict[RadixNode, int] = {}
        for handle in self._locks.values():
            node = handle.node
            while node is not self._root:
                if node is None:
                    raise InvariantError(f"live lock {handle.serial} is on a node no longer in the tree")
                expected_ref[node] = expected_ref.get(node, 0) + 1
                node = node.parent
        pages: list[torch.Tensor] = []
        storages: set[int] = set()
        evictable = protected = nodes = leaves = 0
        stack = [self._root]
        while stack:
            parent = stack.pop()
            for ck, node in parent.children.items():
                where = f"node {node.serial} ({len(node.key)} tokens)"
                if node.parent is not parent or ck != child_key(node.key, 0, ps):
                    raise InvariantError(f"{where}: wrong parent link or child key")
                n = len(node.key)
                if n == 0 or n % ps:
                    raise InvariantError(f"{where}: key length is not a positive multiple of page_size={ps}")
                v = node.value
                if v.dtype != torch.int64 or v.shape != (n,) or v._base is not None or not v.is_contiguous():
                    raise InvariantError(f"{where}: value must be an owned contiguous int64 tensor of {n} slots")
                if v.untyped_storage().data_ptr() in storages:
                    raise InvariantError(f"{where}: value shares storage with another node")
                storages.add(v.untyped_storage().data_ptr())
                node_pages = v[::ps] // ps
                if not torch.equal(pages_to_slots(node_pages, ps), v):
                    raise InvariantError(f"{where}: slots do not cover whole pages in order")
                pages.append(node_pages)
                if node.lock_ref != expected_ref.get(node, 0):
                    raise InvariantError(
                        f"{where}: lock_ref={node.lock_ref} but {expected_ref.get(node, 0)} live locks at or below it"
                    )
                if node.lock_ref:
                    protected += n
                else:
                    evictable += n
                is_leaf = not node.children and node.lock_ref == 0
                if is_leaf != (node in self._leaves):
                    raise InvariantError(f"{where}: evictable-leaf set membership is {not is_leaf}, expected {is_leaf}")
                leaves += is_leaf
                nodes += 1
                stack.append(node)
        if (nodes, leaves) != (self.num_nodes, len(self._leaves)):
            raise InvariantError(
                f"tree has {nodes} nodes / {leaves} evictable leaves, counters say {self.num_nodes} / {len(self._leaves)}"
            )
        if (evictable, protected) != (self.evictable_tokens, self.protected_tokens):
            raise InvariantError(
                f"tree holds evictable={evictable}, protected={protected} tokens; counters say "
                f"evictable={self.evictable_tokens}, protected={self.protected_tokens}"
            )
        live_entries = {node for stamp, _, node in self._heap if node in self._leaves and stamp == node.last_access}
        if live_entries != self._leaves:
            raise InvariantError(f"{len(self._leaves - live_entries)} evictable leaves have no current heap entry")
        tree_pages = torch.cat(pages) if pages else self._empty
        self._check_page_set(tree_pages, "tree pages")
        if int(self._owned.sum()) != tree_pages.numel() or not bool(self._owned[tree_pages].all()):
            raise InvariantError("tree-owned page mask disagrees with the pages held by nodes")
        if request_pages is not None:
            self._check_page_set(request_pages, "request pages")
            if bool(self._owned[request_pages].any()):
                raise InvariantError("a page is held both by a request and by the tree")
            total = self.allocator.num_free + tree_pages.numel() + request_pages.numel()
            if total != self.allocator.capacity:
                raise InvariantError(
                    f"free {self.allocator.num_free} + tree {tree_pages.numel()} "
                    f"(evictable {self.evictable_tokens // ps}, protected {self.protected_tokens // ps}) "
                    f"+ requests {request_pages.numel()} = {total} pages != capacity {self.allocator.capacity}"
                )

    # ------------------------------------------------------------------ tiers

    def _promote(self, key: tuple[int, ...], headroom: int) -> None:
        """Extend the tree's match of ``key`` with the chunks the lower tiers hold (see
        ``prefetch``): as many whole pages as can be had while ``headroom`` pages stay free."""
        walk = self._prefix_walk(key)
        if walk is None:
            return
        ps = self.page_size
        start = walk.length + walk.partial_len
        limit = (len(key) - 1) // ps * ps
        if start >= limit:
            return
        fetched = self.tiers.fetch(key, start, limit)
        if fetched is None:
            return
        end = min(limit, (fetched.first_chunk + len(fetched.chunks)) * self.tiers.chunk_tokens)
        if end <= start:
            return
        node = walk.node if walk.partial is None else self._split(walk.partial, walk.partial_len)
        need = (end - start) // ps
        handle = self.lock(node)  # the prefix being extended must survive the eviction below
        if self.allocator.num_free < need + headroom:
            self.evict((need + headroom - self.allocator.num_free) * ps)
        self.unlock(handle)
        need = min(need, self.allocator.num_free - headroom)
        if need <= 0:
            return
        new_slots = pages_to_slots(self.allocator.alloc(need), ps)
        event = self.tiers.load(fetched, start, new_slots)
        _, prefix_slots = self._path_of(node)
        self._insert(key[: start + need * ps], torch.cat([prefix_slots, new_slots]))
        if event is not None:  # lock the new node until the copy is done
            loaded = key[: start + need * ps]
            walk = self._descend(loaded)
            self._loads.append((event, self.lock(walk.node), loaded))

    def _poll_loads(self) -> None:
        """Unlock the nodes whose promotion copy has finished."""
        if self._loads:
            done = [load for load in self._loads if load[0].query()]
            for load in done:
                self._loads.remove(load)
                self.unlock(load[1])

    def _wait_loads(self) -> None:
        """Order every later kernel on the current stream after the promotions in flight."""
        for event, handle, _ in self._loads:
            torch.cuda.current_stream(self.device).wait_event(event)
            self.unlock(handle)
        self._loads.clear()

    def _path_of(self, node: RadixNode) -> tuple[tuple[int, ...], torch.Tensor]:
        """The tokens from the root through ``node`` and their slots."""
        keys, values = [], []
        while node is not self._root:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        path = tuple(itertools.chain.from_iterable(reversed(keys)))
        return path, torch.cat(values[::-1]) if values else self._empty

    # ------------------------------------------------------------------ internals

    def _check_page_set(self, pages: torch.Tensor, what: str) -> None:
        if pages.numel() == 0:
            return
        if int(pages.min()) < 1 or int(pages.max()) >= self.allocator.num_pages:
            raise InvariantError(f"{what}: page id out of [1, {self.allocator.num_pages})")
        if torch.unique(pages).numel() != pages.numel():
            raise InvariantError(f"{what}: a page is owned twice")
        if bool(self.allocator.is_free(pages).any()):
            raise InvariantError(f"{what}: a page is also on the allocator's free list")

    def _new_serial(self) -> int:
        self._next_serial += 1
        return self._next_serial

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: RadixNode | None) -> RadixNode:
        return RadixNode(key=key, value=value, parent=parent, serial=self._new_serial(), last_access=self._clock)

    @staticmethod
    def _as_key(tokens: Tokens, name: str) -> tuple[int, ...]:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
                raise TypeError(f"{name} must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
            return tuple(tokens.tolist())
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise TypeError(f"{name} must be a sequence of token ids or a 1-D integer tensor, got {type(tokens).__name__}")
        key = tokens if isinstance(tokens, tuple) else tuple(tokens)
        if not all(type(t) is int for t in key):  # exact type: bools and floats are not ids
            bad = next(t for t in key if type(t) is not int)
            raise TypeError(f"{name} must hold int token ids, got {type(bad).__name__} {bad!r}")
        return key

    def _checked_slots(self, slots: torch.Tensor, num_tokens: int, checked: int) -> torch.Tensor:
        """Validate ``slots`` for ``num_tokens`` tokens; ``slots[:checked]`` must cover allocated pages.

        Slot ``i`` must be ``page * page_size + i % page_size`` with one page per ``page_size``
        tokens (the value checks, which read the device, run only with debug checks on). Returns
        the slots on the cache's device.
        """
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise TypeError("slots must be a 1-D torch.int64 tensor")
        if slots.numel() != num_tokens:
            raise ValueError(f"tokens and slots must have the same length, got {num_tokens} tokens and {slots.numel()} slots")
        slots = slots.to(self.device)
        if checked == 0 or not debug_checks_enabled():  # the value checks read the device
            return slots
        ps = self.page_size
        part = slots[:checked]
        pages = part[::ps] // ps
        if ps > 1 and not torch.equal(pages_to_slots(pages, ps)[:checked], part):
            raise ValueError(f"slots must cover whole pages in order (slot i = page * {ps} + i % {ps})")
        if int(pages.min()) < 1 or int(pages.max()) >= self.allocator.num_pages:
            raise ValueError(f"slots must lie in pages [1, {self.allocator.num_pages}) (page 0 is the dummy page)")
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError("slots use the same page twice")
        if bool(self.allocator.is_free(pages).any()):
            raise ValueError("slots lie in pages that are free in the allocator (not owned by the caller)")
        return slots

    def _check_handle(self, handle: LockHandle) -> None:
        if not isinstance(handle, LockHandle):
            raise TypeError(f"handle must be a LockHandle, got {type(handle).__name__}")
        if self._locks.get(handle.serial) is not handle:
            raise ValueError(f"lock handle {handle.serial} was already unlocked or is not from this cache")

    def _path_to_root(self, node: RadixNode) -> list[RadixNode]:
        if not isinstance(node, RadixNode):
            raise TypeError(f"node must be a RadixNode, got {type(node).__name__}")
        path = []
        while node is not self._root:
            if node.parent is None:
                raise ValueError(f"node {node.serial} is not in this cache (evicted, or from another cache)")
            path.append(node)
            node = node.parent
        return path

    def _prefix_walk(self, key: tuple[int, ...]) -> _Walk | None:
        """Read-only walk along the longest matchable part of ``key`` (whole pages, at most
        ``len(key) - 1`` tokens); ``None`` when nothing can match (disabled cache, short key)."""
        limit = max(len(key) - 1, 0) // self.page_size * self.page_size
        if self.disable or limit == 0:
            return None
        return self._descend(key[:limit])

    def _descend(self, key: tuple[int, ...]) -> _Walk:
        """Read-only walk from the root along ``key`` (a whole number of pages)."""
        ps = self.page_size
        node, pos, values = self._root, 0, []
        while pos < len(key):
            child = node.children.get(child_key(key, pos, ps))
            if child is None:
                break
            edge = child.key
            segment = key[pos : pos + len(edge)]
            if segment != edge:
                matched = common_prefix_len(edge, segment)
                return _Walk(node, pos, values, child, matched - matched % ps)
            values.append(child.value)
            node, pos = child, pos + len(edge)
        return _Walk(node, pos, values, None, 0)

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node.

        Callers touch the path through the upper node right after, which sets its access time.
        """
        ps = self.page_size
        upper = self._new_node(child.key[:n], child.value[:n].clone(), child.parent)
        upper.lock_ref = child.lock_ref  # every lock at or below child is below upper too
        child.parent.children[child_key(upper.key, 0, ps)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        child.parent = upper
        upper.children[child_key(child.key, 0, ps)] = child
        self.num_nodes += 1
        return upper

    def _insert(self, key: tuple[int, ...], slots: torch.Tensor) -> _Inserted:
        """Insert aligned ``key`` with validated ``slots``; mutates only after the last check."""
        if self.disable or not key:
            return _Inserted(0, 0, self._empty)
        ps = self.page_size
        walk = self._descend(key)
        cached = walk.length + walk.partial_len
        tree_values = walk.values
        if walk.partial is not None:
            tree_values.append(walk.partial.value[: walk.partial_len])
        own_pages = slots[::ps] // ps
        dup_pages = own_pages[: cached // ps]
        if tree_values:
            dup_pages = dup_pages[dup_pages != torch.cat(tree_values)[::ps] // ps]
        new_pages = own_pages[cached // ps :]
        if debug_checks_enabled() and bool(self._owned.index_select(0, torch.cat([dup_pages, new_pages])).any()):
            raise ValueError("slots lie in pages the cache already owns for other tokens")
        node = walk.node
        if walk.partial is not None:  # split even when key ends there: touch exactly the key
            node = self._split(walk.partial, walk.partial_len)
        if cached < len(key):
            new_slots = slots[cached:].clone()
            leaf = self._new_node(key[cached:], new_slots, node)
            node.children[child_key(leaf.key, 0, ps)] = leaf
            self._leaves.discard(node)
            self._owned.index_fill_(0, new_pages, True)
            self.num_nodes += 1
            self.evictable_tokens += len(leaf.key)
            node = leaf
        self._touch(node)
        return _Inserted(cached, len(key), dup_pages)

    def _touch(self, node: RadixNode) -> None:
        """Mark ``node`` and its ancestors as used now (LRU clock)."""
        self._clock += 1
        n = node
        while n is not self._root:
            n.last_access = self._clock
            n = n.parent
        self._refresh_leaf(node)

    def _refresh_leaf(self, node: RadixNode) -> None:
        """Record whether ``node`` is an evictable leaf; queue it for eviction if so."""
        if node is self._root or node.children or node.lock_ref:
            self._leaves.discard(node)
            return
        self._leaves.add(node)
        heapq.heappush(self._heap, (node.last_access, node.serial, node))
        if len(self._heap) > 2 * len(self._leaves) + 64:
            # Drop stale entries; amortized O(1) since as many pushes happened since the last rebuild.
            self._heap = [(n.last_access, n.serial, n) for n in self._leaves]
            heapq.heapify(self._heap)
