"""treeserve.kvcache: paged KV memory, the request -> slot table, the radix prefix cache, KV ops and attention."""

from __future__ import annotations

# --- memory layer: pool, allocator, request table, radix prefix cache ---
from .pool import InvariantError, KVPool, OutOfPagesError, PageAllocator, pages_to_slots
from .radix import LockHandle, PrefixMatch, RadixCache, ReleaseResult
from .radix_node import RadixNode
from .table import OutOfRowsError, ReqToTokenTable

__all__ = [
    "InvariantError",
    "KVPool",
    "LockHandle",
    "OutOfPagesError",
    "OutOfRowsError",
    "PageAllocator",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
    "ReleaseResult",
    "ReqToTokenTable",
    "pages_to_slots",
]

# --- KV ops and attention ---
from .attention import paged_attention  # noqa: E402
from ._checks import debug_checks_enabled, set_debug_checks  # noqa: E402
from .backends import BackendSpec, KernelBackend, register_backend, select_backend  # noqa: E402
from .metadata import AttentionMetadata, build_tree_mask  # noqa: E402
from .ops import RollbackPlan, compact_tree_path, padded_path_moves, rollback_slots, store_kv  # noqa: E402
from .query_view import QueryView, query_view  # noqa: E402

__all__ += [
    "AttentionMetadata",
    "BackendSpec",
    "KernelBackend",
    "debug_checks_enabled",
    "register_backend",
    "select_backend",
    "set_debug_checks",
    "RollbackPlan",
    "build_tree_mask",
    "compact_tree_path",
    "padded_path_moves",
    "paged_attention",
    "QueryView",
    "query_view",
    "rollback_slots",
    "store_kv",
]

# --- tiers below the device pool: host memory, disk ---
from .disk_store import DiskStore  # noqa: E402
from .host_store import HostChunk, HostStore  # noqa: E402
from .tier_key import TierLayout, chunk_keys, default_chunk_tokens, module_fingerprint  # noqa: E402
from .tiers import KVTiers, TierStats  # noqa: E402

__all__ += [
    "DiskStore",
    "HostChunk",
    "HostStore",
    "KVTiers",
    "TierLayout",
    "TierStats",
    "chunk_keys",
    "default_chunk_tokens",
    "module_fingerprint",
]
