"""The Triton interpreter rounded like the GPU: float32 -> bfloat16 to nearest even.

Triton's interpreter (``TRITON_INTERPRET=1``, how kernels run on CPU in tests) converts float32
to bfloat16 by truncating the mantissa, where the GPU (``cvt.rn.bf16.f32``) and torch round to
nearest even. A kernel that rounds exactly where torch rounds would then differ from torch by an
ulp under the interpreter only. :func:`gpu_rounding` swaps in the GPU's rounding for the
duration of a test (other conversions are left to the interpreter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def gpu_rounding() -> Iterator[None]:
    """While active, the interpreter rounds float32 -> bfloat16 to nearest even (as torch does)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):  # type: ignore[no-untyped-def]
        if src == tl.float32 and dst == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original
