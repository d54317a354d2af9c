"""Child process of ``tests/test_cpp_bad_input.py``: every C++ operator called with bad input.

Each case prints ``start NAME`` before the call (flushed) and ``raised NAME: <error>`` or
``RETURNED NAME`` after it, so a crash names the case it died in. Raw operators are called
directly, past the Python wrappers' own checks: the operator itself must refuse.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from treeserve.kvcache._cpu_op import load_cpu_decode_op
from treeserve.models._decode_op import load_decode_op
from treeserve.models._norm_op import load_norm_op
from treeserve.models.gguf_op import load_gguf_linear_op
from treeserve.models.int8_op import int8_available
from treeserve.sampling._top_op import load_top_op
from treeserve.sampling.bitmask import load_bitmask_op

ops = torch.ops.treeserve
f32, i32 = torch.float32, torch.int32


def z(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def attn(q=None, cache=None, indptr=None, pages=None, last=None):  # noqa: ANN001, ANN202
    cache = z(4, 2, 1, 8) if cache is None else cache
    return lambda: ops.paged_decode_attention(
        z(1, 2, 8) if q is None else q, cache, cache,
        torch.tensor([0, 1], dtype=i32) if indptr is None else indptr,
        torch.tensor([1], dtype=i32) if pages is None else pages,
        torch.tensor([1], dtype=i32) if last is None else last, 0.3)


def layers(pos=None, slots=None, indptr=None, pages=None, last=None, m=3):  # noqa: ANN001, ANN202
    """A one-layer verify step of ``m`` query rows (hidden 8, one head of 8, dense projections),
    each row its own page list (``kvcache.query_view``'s layout), with one field replaced."""
    hidden, dim, inter = 8, 8, 16
    weights = [z(3 * dim, hidden), z(hidden, dim), z(2 * inter, hidden), z(hidden, inter)]
    cache = z(4, 2, 1, dim)
    return lambda: ops.decode_layers(
        z(m, hidden), z(16, 2, dim // 2), torch.arange(m) if pos is None else pos, [z(hidden), z(hidden)], weights,
        ["dense"] * 4, [cache], [cache.clone()], torch.arange(2, 2 + m) if slots is None else slots,
        torch.arange(m + 1, dtype=i32) * 2 if indptr is None else indptr,
        torch.tensor([1, 2] * m, dtype=i32) if pages is None else pages,
        torch.ones(m, dtype=i32) if last is None else last, 1, 1, 1e-6, 0.35)


CASES: dict[str, tuple[Callable[[], str | None], dict[str, Callable[[], object]]]] = {
    "top_candidates": (load_top_op, {
        "k 0": lambda: ops.top_candidates(z(2, 5), 0, False),
        "k above V": lambda: ops.top_candidates(z(2, 5), 6, False),
        "1-D x": lambda: ops.top_candidates(z(5), 1, False),
        "int x": lambda: ops.top_candidates(z(2, 5, dtype=i32), 1, False),
    }),
    "apply_token_bitmask_": (load_bitmask_op, {
        "mask too narrow": lambda: ops.apply_token_bitmask_(z(2, 40), z(2, 1, dtype=i32)),
        "mask rows": lambda: ops.apply_token_bitmask_(z(2, 40), z(3, 2, dtype=i32)),
        "int64 mask": lambda: ops.apply_token_bitmask_(z(2, 40), z(2, 2, dtype=torch.int64)),
        "float64 x": lambda: ops.apply_token_bitmask_(z(2, 40, dtype=torch.float64), z(2, 2, dtype=i32)),
        "1-D x": lambda: ops.apply_token_bitmask_(z(40), z(1, 2, dtype=i32)),
    }),
    "add_rms_norm": (load_norm_op, {
        "weight width": lambda: ops.add_rms_norm(z(2, 8), None, z(4), 1e-6),
        "weight dtype": lambda: ops.add_rms_norm(z(2, 8), None, z(8, dtype=torch.bfloat16), 1e-6),
        "residual shape": lambda: ops.add_rms_norm(z(2, 8), z(3, 8), z(8), 1e-6),
        "negative eps": lambda: ops.add_rms_norm(z(2, 8), None, z(8), -1.0),
        "int x": lambda: ops.add_rms_norm(z(2, 8, dtype=i32), None, z(8, dtype=i32), 1e-6),
    }),
    "paged_decode_attention": (load_cpu_decode_op, {
        "page index past the cache": attn(pages=torch.tensor([4], dtype=i32)),
        "negative page index": attn(pages=torch.tensor([-1], dtype=i32)),
        "last page longer than a page": attn(last=torch.tensor([3], dtype=i32)),
        "indptr past the page list": attn(indptr=torch.tensor([0, 2], dtype=i32)),
        "int64 metadata": attn(indptr=torch.tensor([0, 1])),
        "no KV heads": attn(cache=z(4, 2, 0, 8)),
        "empty pages": attn(cache=z(4, 0, 1, 8)),
        "dtype mismatch": attn(q=z(1, 2, 8, dtype=torch.bfloat16)),
        "head_dim mismatch": attn(q=z(1, 2, 4)),
    }),
    "decode_layers": (load_decode_op, {
        "verify row page past the cache": layers(pages=torch.tensor([1, 2, 1, 4, 1, 2], dtype=i32)),
        "verify row negative page": layers(pages=torch.tensor([1, 2, -1, 2, 1, 2], dtype=i32)),
        "verify row last page too long": layers(last=torch.tensor([1, 3, 1], dtype=i32)),
        "indptr past the page list": layers(indptr=torch.tensor([0, 2, 4, 7], dtype=i32)),
        "fewer page lists than rows": layers(indptr=torch.tensor([0, 2, 4], dtype=i32),
                                             last=torch.ones(2, dtype=i32)),
        "position past the rope table": layers(pos=torch.tensor([0, 1, 16])),
        "slot past the cache": layers(slots=torch.tensor([2, 3, 8])),
        "slot negative": layers(slots=torch.tensor([2, -1, 4])),
    }),
    "gguf_linear": (load_gguf_linear_op, {
        "unknown qtype": lambda: ops.gguf_linear(z(1, 32), z(4, 34, dtype=torch.uint8), "Q5_K", 32),
        "K not a multiple of 32": lambda: ops.gguf_linear(z(1, 16), z(4, 34, dtype=torch.uint8), "Q8_0", 16),
        "block bytes": lambda: ops.gguf_linear(z(1, 32), z(4, 33, dtype=torch.uint8), "Q8_0", 32),
        "x dtype": lambda: ops.gguf_linear(z(1, 32, dtype=torch.float64), z(4, 34, dtype=torch.uint8), "Q8_0", 32),
    }),
    "gguf_linear_q8": (load_gguf_linear_op, {
        "unknown qtype": lambda: ops.gguf_linear_q8(z(1, 32), z(4, 34, dtype=torch.uint8), "Q5_K", 32),
        "K not a multiple of 32": lambda: ops.gguf_linear_q8(z(1, 16), z(4, 34, dtype=torch.uint8), "Q8_0", 16),
        "block bytes": lambda: ops.gguf_linear_q8(z(1, 32), z(4, 33, dtype=torch.uint8), "Q4_0", 32),
        "x shape": lambda: ops.gguf_linear_q8(z(1, 64), z(4, 18, dtype=torch.uint8), "Q4_0", 32),
    }),
    "codes_row_norms": (load_gguf_linear_op, {
        "unknown qtype": lambda: ops.codes_row_norms(z(4, 34, dtype=torch.uint8), "Q5_K", 32),
        "K not a multiple of 32": lambda: ops.codes_row_norms(z(4, 34, dtype=torch.uint8), "Q8_0", 16),
        "block bytes": lambda: ops.codes_row_norms(z(4, 33, dtype=torch.uint8), "Q8_0", 32),
        "w dtype": lambda: ops.codes_row_norms(z(4, 34, dtype=torch.int8), "Q8_0", 32),
        "w rank": lambda: ops.codes_row_norms(z(136, dtype=torch.uint8), "Q8_0", 32),
    }),
    "int8_linear": (lambda: None if int8_available() else "oneDNN quantized linear unavailable", {
        "x dtype": lambda: ops.int8_linear(z(1, 64, dtype=torch.float64), z(4, 64, dtype=torch.int8), z(4), z(4), z(1, 1)),
        "K not a multiple of 64": lambda: ops.int8_linear(z(1, 32), z(4, 32, dtype=torch.int8), z(4), z(4), z(1, 1)),
        "mix shape": lambda: ops.int8_linear(z(1, 64), z(4, 64, dtype=torch.int8), z(4), z(4), z(2, 2)),
    }),
}


def main() -> int:
    for op, (load, cases) in CASES.items():
        reason = load()
        if reason is not None:
            print(f"unavailable {op}: {reason}", flush=True)
            continue
        for name, call in cases.items():
            print(f"start {op}: {name}", flush=True)
            try:
                call()
            except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as e:
                print(f"raised {op}: {name}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            else:
                print(f"RETURNED {op}: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
