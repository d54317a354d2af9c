"""Kernel backend registry: selection once, as objects; the debug switch for host-reading checks."""

from __future__ import annotations

import pytest
import torch

from treeserve.kvcache import (
    AttentionMetadata,
    BackendSpec,
    KernelBackend,
    PageAllocator,
    paged_attention,
    register_backend,
    select_backend,
    set_debug_checks,
)
from treeserve.kvcache import backends as registry


@pytest.fixture
def scratch_op():
    """A throwaway op name whose specs are removed afterwards."""
    yield "test_op"
    registry._REGISTRY.pop("test_op", None)
    registry._CHOSEN.clear()


def test_auto_picks_highest_priority_usable_on_the_device(scratch_op) -> None:
    mod = "treeserve.kvcache._ops_torch"
    register_backend(BackendSpec(scratch_op, "low", mod, "store_kv_torch", ("cpu",), priority=1))
    register_backend(BackendSpec(scratch_op, "high", mod, "store_kv_torch", ("cpu",), priority=5))
    register_backend(
        BackendSpec(scratch_op, "unusable", mod, "store_kv_torch", ("cpu",), lambda d, t: False, "magic", 9)
    )
    register_backend(BackendSpec(scratch_op, "unsafe", mod, "store_kv_torch", ("cpu",), priority=7, graph_safe=False))
    assert select_backend(scratch_op, "auto", "cpu").name == "unsafe"
    assert select_backend(scratch_op, "auto", "cpu", graph_safe=True).name == "high"
    assert select_backend(scratch_op, "low", "cpu").name == "low"
    with pytest.raises(ValueError, match="backend='unusable' needs magic"):
        select_backend(scratch_op, "unusable", "cpu")
    with pytest.raises(ValueError, match="one of"):
        select_backend(scratch_op, "nope", "cpu")


def test_selection_is_memoized_and_bad_specs_rejected() -> None:
    a = select_backend("store_kv", "auto", "cpu", torch.float32)
    assert a is select_backend("store_kv", "auto", "cpu", torch.float32)
    assert a.name == "torch"
    with pytest.raises(ValueError, match="unknown op"):
        select_backend("no_such_op")
    with pytest.raises(TypeError, match="BackendSpec"):
        register_backend("torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved"):
        register_backend(BackendSpec("store_kv", "auto", "m", "f", ("cpu",)))


def test_paged_attention_uses_the_given_or_metadata_kernel() -> None:
    calls: list[str] = []
    real = select_backend("paged_attention", "torch", "cpu")

    def spy(*args):
        calls.append("spy")
        return real(*args)

    kernel = KernelBackend(real.spec, spy)
    kc = torch.randn(3, 2, 1, 4)
    vc = torch.randn(3, 2, 1, 4)
    q = torch.randn(1, 2, 4)
    meta = AttentionMetadata.build([1], [3], [[1, 2]], 2)
    ref = paged_attention(q, kc, vc, meta)
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, backend=kernel), ref)
    meta.attention_backend = kernel
    torch.testing.assert_close(paged_attention(q, kc, vc, meta), ref)
    assert calls == ["spy", "spy"]


def test_debug_switch_gates_host_reading_checks() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(1)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)
    previous = set_debug_checks(False)
    try:
        other = PageAllocator(4)
        other.free(torch.tensor([0]))  # the dummy page: only a debug check would refuse it
    finally:
        set_debug_checks(previous)
    assert previous is True
