"""Kernel backends of the KV ops and attention: a registry of specs, chosen once as objects.

A :class:`BackendSpec` names one implementation of one op (``paged_attention``, ``store_kv``,
``compact_tree_path``): where its function lives, on which device types ``auto`` may pick it,
a ``usable(device, dtype)`` predicate, its priority, and whether it may run inside a CUDA graph
capture (it never reads metadata on the host). :func:`register_backend` adds a spec (a new
kernel is a one-line registration); :func:`select_backend` turns ``(op, name, device, dtype)``
into a :class:`KernelBackend`, a callable holding the imported function. Selection is memoized
(the import and availability probes run once per combination), and the runner selects its
backends once per engine and hands them to every step, so no layer resolves a name.

``auto`` picks the usable spec of highest priority whose ``devices`` include the device type
(flashinfer > triton on CUDA, torch on CPU); an explicit name must be registered for the op and
usable on the device, otherwise ``ValueError``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from treeserve._utils import flashinfer_available, log_once, triton_usable

__all__ = ["BackendSpec", "KernelBackend", "register_backend", "registered_backends", "select_backend"]

Usable = Callable[[torch.device, torch.dtype], bool]


def _always(device: torch.device, dtype: torch.dtype) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One implementation ``module.function`` of ``op`` named ``name``.

    ``devices``: device types on which ``auto`` may choose it (``"*"``: any); ``usable``: whether it can run
    for a device and dtype at all (an explicit choice needs only this); ``needs``: what it needs,
    for the error message; ``priority``: higher wins under ``auto``; ``graph_safe``: it may run
    inside a CUDA-graph capture.
    """

    op: str
    name: str
    module: str
    function: str
    devices: tuple[str, ...]
    usable: Usable = _always
    needs: str = ""
    priority: int = 0
    graph_safe: bool = True


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """A chosen implementation: call it with the op's internal signature (inputs validated)."""

    spec: BackendSpec
    fn: Callable[..., Any] = field(repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


_REGISTRY: dict[str, dict[str, BackendSpec]] = {}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) ``spec`` for its op; later selections see it."""
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"spec must be a BackendSpec, got {type(spec).__name__}")
    if spec.name == "auto":
        raise ValueError("'auto' is reserved for automatic selection")
    _REGISTRY.setdefault(spec.op, {})[spec.name] = spec
    _CHOSEN.clear()


def registered_backends(op: str) -> tuple[str, ...]:
    """Names registered for ``op``, in registration order."""
    return tuple(_REGISTRY.get(op, {}))


def select_backend(
    op: str,
    name: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    graph_safe: bool = False,
) -> KernelBackend:
    """The backend ``name`` (or the automatic choice) of ``op`` for ``device`` and ``dtype``.

    ``graph_safe`` restricts ``auto`` to backends that may run inside a CUDA-graph capture.
    ``ValueError`` for an unknown op or name, or a backend not usable on ``device``.
    """
    device = torch.device(device)
    key = (op, name, device.type, device.index, dtype, graph_safe)
    chosen = _CHOSEN.get(key)  # a plain dict lookup: what a traced (compiled) caller sees
    if chosen is None:
        chosen = _CHOSEN[key] = _choose(*key)
        if name == "auto":
            log_once(f"treeserve.kvcache.{op}: backend={chosen.name} on {device.type}")
    return chosen


_CHOSEN: dict[tuple[str, str, str, int | None, torch.dtype, bool], KernelBackend] = {}
"""Memo of ``select_backend``: each choice is made (and logged) once per process."""


def _choose(op: str, name: str, device_type: str, index: int | None, dtype: torch.dtype, graph_safe: bool) -> KernelBackend:
    specs = _REGISTRY.get(op)
    if not specs:
        raise ValueError(f"unknown op {op!r}; ops with backends: {sorted(_REGISTRY)}")
    device = torch.device(device_type, index)
    if name == "auto":
        candidates = [
            s
            for s in specs.values()
            if (device_type in s.devices or "*" in s.devices) and (s.graph_safe or not graph_safe) and s.usable(device, dtype)
        ]
        if not candidates:
            raise ValueError(f"no {op} backend runs on {device_type} ({dtype}); registered: {tuple(specs)}")
        spec = candidates[0]
        for s in candidates[1:]:  # the first of the highest priority (a loop: traceable by Dynamo)
            if s.priority > spec.priority:
                spec = s
    else:
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"backend must be 'auto' or one of {tuple(specs)}, got {name!r}")
        if not spec.usable(device, dtype):
            raise ValueError(f"backend={name!r} needs {spec.needs} (device {device})")
    return KernelBackend(spec, getattr(importlib.import_module(spec.module), spec.function))


def _triton_ok(device: torch.device, dtype: torch.dtype) -> bool:
    return triton_usable(device)


def _flashinfer_ok(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and flashinfer_available()


def _cpu_op_ok(device: torch.device, dtype: torch.dtype) -> bool:
    from treeserve.kvcache._cpu_op import cpu_decode_op_usable  # builds the operator once

    return cpu_decode_op_usable(device, dtype)


_TRITON_NEEDS = "a CUDA tensor or TRITON_INTERPRET=1"
_KV = "treeserve.kvcache"
for _spec in (
    BackendSpec("paged_attention", "torch", f"{_KV}._attention_torch", "paged_attention_torch", ("*",)),
    # Batch-invariant (one call per request): chosen by name only, e.g. EngineConfig(batch_invariant=True).
    BackendSpec(
        "paged_attention", "torch_per_request", f"{_KV}._attention_torch", "paged_attention_torch_per_request", (),
        graph_safe=False,
    ),
    BackendSpec(
        "paged_attention", "triton", f"{_KV}._attention_triton", "paged_attention_triton", ("cuda",),
        _triton_ok, _TRITON_NEEDS, priority=10,
    ),
    BackendSpec(
        "paged_attention", "flashinfer", f"{_KV}._attention_flashinfer", "paged_attention_flashinfer", ("cuda",),
        _flashinfer_ok, "CUDA and the flashinfer package", priority=20, graph_safe=False,
    ),
    # C++ decode operator, torch elsewhere; built on first use (usable() builds it, False without a compiler).
    BackendSpec(
        "paged_attention", "cpu", f"{_KV}._attention_cpu", "paged_attention_cpu", ("cpu",),
        _cpu_op_ok, "a float32 (or, on AVX2, bfloat16 / float16) CPU tensor and a C++ compiler for cpp_extension",
        priority=5,
    ),
    BackendSpec("store_kv", "torch", f"{_KV}._ops_torch", "store_kv_torch", ("*",)),
    BackendSpec("store_kv", "triton", f"{_KV}._triton_ops", "store_kv_triton", ("cuda",), _triton_ok, _TRITON_NEEDS, 10),
    BackendSpec("compact_tree_path", "torch", f"{_KV}._ops_torch", "compact_tree_path_torch", ("*",)),
    BackendSpec(
        "compact_tree_path", "triton", f"{_KV}._triton_ops", "compact_tree_path_triton", ("cuda",),
        _triton_ok, _TRITON_NEEDS, 10,
    ),
):  # fmt: skip
    register_backend(_spec)
