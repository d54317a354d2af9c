"""Kernels per layer and per decode step of the CUDA forward, counted on a CPU.

The forward runs its CUDA code path with the Triton kernels (under the interpreter here) and the
Triton attention backend; ``_kernel_count`` counts computing aten operators and Triton launches.
Per layer = a 2-layer model's count minus its 1-layer truncation's (``truncated_copy``: same
weights). The torch path is counted as CUDA runs it: torch's RMSNorm (the C++ CPU norm off; one
``_fused_rms_norm`` kernel, which the CPU decomposes) and the Triton KV store. Debug checks (host
reads) are off while counting, as in production.
Figures before/after: ``benches/RESULTS.md`` (issue 28 fused step).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import treeserve.kvcache.backends as kv_backends
import treeserve.models._norm_op as norm_op
from tests._devices import backend_device
from tests.models._kernel_count import as_one_kernel, count_kernels
from treeserve.kvcache import AttentionMetadata, KVPool, select_backend, set_debug_checks
from treeserve.models import random_model, tiny_config
from treeserve.models.llama import truncated_copy

DEV = backend_device("triton")
FUSED_PER_LAYER = 8  # norm, qkv, rope+store, o, add+norm, gate|up, silu*up, down; plus attention's
FUSED_STEP_EXTRA = 5  # embedding, final norm (gathering the logits rows), head: bf16 pass, threshold, re-scoring


def _forward_counts(kernels: str) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """(2-layer step, per layer, attention alone) of a bf16 decode step of 3 requests."""
    dtype, page = torch.bfloat16, 4
    model = random_model(tiny_config("llama"), seed=0, init_std=0.3, dtype=dtype).to(DEV)
    model.layer_kernels = kernels
    attention = select_backend("paged_attention", "triton", DEV, dtype)
    ids, pos, slots = (torch.tensor(v, device=DEV) for v in ([3, 4, 5], [4, 2, 0], [8, 14, 16]))
    rows = torch.arange(3, device=DEV)

    def step(m):  # type: ignore[no-untyped-def]
        kv = KVPool(len(m.layers), 6, page, 2, 16, dtype, DEV)
        meta = AttentionMetadata.build([1, 1, 1], [5, 3, 1], [[1, 2], [3], [4]], page, device=DEV)
        meta.attention_backend = attention
        return lambda: m(ids, pos, kv, slots, meta, rows)

    one = truncated_copy(model, 1)
    with torch.no_grad():  # (under inference_mode the dispatch mode misses some operators, e.g. clone)
        step(model)()  # warm: the head's bf16 copy and norms are made on first use
        full, single = count_kernels(step(model)), count_kernels(step(one))
        q = torch.zeros(3, 4, 16, dtype=dtype, device=DEV)
        kv = KVPool(1, 6, page, 2, 16, dtype, DEV)
        meta = AttentionMetadata.build([1, 1, 1], [5, 3, 1], [[1, 2], [3], [4]], page, device=DEV)
        attn = count_kernels(lambda: attention(q, kv.k_caches[0], kv.v_caches[0], meta, 0.25, True))
    return full, full - single, attn


@pytest.fixture(scope="module")
def counts() -> dict[str, tuple[Counter[str], Counter[str], Counter[str]]]:
    mp = pytest.MonkeyPatch()
    previous = set_debug_checks(False)
    try:
        out = {"triton": _forward_counts("triton")}
        # The torch path as on CUDA: torch's norm (no C++ CPU operator), the Triton KV store.
        mp.setattr(norm_op, "load_norm_op", lambda: "counted as on CUDA")
        fused_norm = as_one_kernel("aten::_fused_rms_norm", norm_op.F.rms_norm)
        mp.setattr(norm_op, "F", type("F", (), {"rms_norm": staticmethod(fused_norm)}))
        store = select_backend("store_kv", "triton", DEV, torch.bfloat16)
        mp.setitem(kv_backends._CHOSEN, ("store_kv", "auto", DEV.type, DEV.index, torch.bfloat16, False), store)
        out["torch"] = _forward_counts("torch")
    finally:
        mp.undo()
        set_debug_checks(previous)
    return out


def test_fused_layer_is_eight_kernels_plus_attention(counts, capsys: pytest.CaptureFixture[str]) -> None:
    full, per_layer, attn = counts["triton"]
    t_full, t_layer, _ = counts["torch"]
    n_attn = sum(attn.values())
    with capsys.disabled():
        print(f"\nkernels per layer: torch path {sum(t_layer.values())}, fused {sum(per_layer.values())} "
              f"(attention {n_attn}); per 2-layer step: {sum(t_full.values())} -> {sum(full.values())}")
        print(f"  fused layer: {dict(per_layer)}\n  torch layer: {dict(t_layer)}")
    assert n_attn >= 1
    assert sum(per_layer.values()) == FUSED_PER_LAYER + n_attn, per_layer
    assert per_layer["triton::_add_rms_norm_kernel"] == 2 and per_layer["triton::_rope_store_kernel"] == 1
    assert per_layer["triton::_silu_mul_kernel"] == 1
    assert sum(full.values()) == 2 * (FUSED_PER_LAYER + n_attn) + FUSED_STEP_EXTRA, full


def test_the_torch_path_launches_more_per_layer(counts) -> None:
    """The comparison is real: the unfused layer launches at least twice the fused one's own kernels."""
    _, per_layer, attn = counts["triton"]
    _, t_layer, _ = counts["torch"]
    own = sum(per_layer.values()) - sum(attn.values())
    assert sum(t_layer.values()) - sum(attn.values()) >= 2 * own, t_layer
