"""Issue 15: fused residual-add + RMSNorm (``treeserve.models._norm_op``, C++) vs torch's add +
``F.rms_norm``, SmolLM2-135M hidden size 576, batch 1 and 64, float32 and bf16, one thread,
interleaved in one process (min of 15 x 200 calls). Asserts only that both agree."""

from __future__ import annotations

import pytest
import torch

from _timing import min_seconds  # benches/ is on sys.path (no __init__.py)

from treeserve.models._norm_op import add_rms_norm, add_rms_norm_torch, load_norm_op

HIDDEN = 576


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_fused_add_rms_norm_vs_torch(rows: int, dtype: torch.dtype) -> None:
    if load_norm_op() is not None:
        pytest.skip(f"operator unavailable: {load_norm_op()}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    torch.testing.assert_close(add_rms_norm(x, r, w, 1e-5)[1].float(), add_rms_norm_torch(x, r, w, 1e-5)[1].float(),
                               rtol=1e-2, atol=1e-2)  # fmt: skip

    def many(fn):
        return lambda: [fn(x, r, w, 1e-5) for _ in range(200)]

    ours = theirs = float("inf")
    for _ in range(15):
        theirs = min(theirs, min_seconds(many(add_rms_norm_torch), 1) / 200)
        ours = min(ours, min_seconds(many(add_rms_norm), 1) / 200)
    torch.set_num_threads(before)
    print(f"\nadd+rms_norm {rows}x{HIDDEN} {str(dtype)[6:]}: fused {ours * 1e6:.1f} us, torch {theirs * 1e6:.1f} us "
          f"-> {theirs / ours:.2f}x")
