"""Counting the kernels a forward would launch on a GPU, on a CPU.

A *kernel* here is one dispatched aten operator that computes (views, allocations and metadata
operators launch nothing on a GPU and are not counted), or one Triton launch (counted by kernel
name, whether it runs compiled or under the interpreter; the interpreter's own tensor traffic is
not counted). On CUDA each such operator is one kernel launch, give or take operators that launch
two (e.g. a sort); the count is what a CUDA graph of the forward would replay, so a regression
in the number of kernels per layer shows on a CPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "_unsafe_view", "lift_fresh", "alias", "detach",
                       "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size"})
"""aten operators (overload packets) that launch nothing, besides those whose schema makes them views."""


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.counts[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_triton(counts: Counter[str]) -> Iterator[None]:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def patched(cls: type) -> Callable[..., object]:
        def run(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[f"triton::{fn.__name__}"] += 1
            with _disable_current_modes():  # the interpreter's copies are not the kernel's launches
                return originals[cls](fn, *args, **kwargs)

        return run

    for cls in originals:
        cls.run = patched(cls)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run  # type: ignore[method-assign]


_ACTIVE: list[Counter[str]] = []


def count_kernels(fn: Callable[[], object]) -> Counter[str]:
    """The kernels ``fn()`` launches (see the module docstring), by operator / Triton kernel name."""
    counts: Counter[str] = Counter()
    _ACTIVE.append(counts)
    try:
        with _count_triton(counts), _AtenCounter(counts):
            fn()
    finally:
        _ACTIVE.pop()
    return counts


def as_one_kernel(name: str, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` counted as the one kernel ``name`` (what it is on CUDA; e.g. torch's RMSNorm, one
    ``_fused_rms_norm`` there, which the CPU decomposes into seven operators)."""

    def wrapped(*args: object, **kwargs: object) -> object:
        if _ACTIVE:
            _ACTIVE[-1][name] += 1
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return wrapped
