"""Run-time CPU feature detection (never assume a feature: read what this machine reports).

Two sources: the kernel's ``/proc/cpuinfo`` flags (Linux x86) and the ISA level torch's own
kernels dispatched to (``torch.backends.cpu.get_cpu_capability()``: ``"DEFAULT"``, ``"AVX2"``,
``"AVX512"``, ...). A feature counts only where the flags report it; on a machine without
``/proc/cpuinfo`` every flag-based feature is False and only torch's capability is used.

Also the host's memory hygiene: ``release_free_memory`` returns freed C-heap pages to the OS.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CPUFeatures", "auto_dtype", "cpu_features", "parse_cpuinfo", "release_free_memory"]


@dataclass(frozen=True, slots=True)
class CPUFeatures:
    """What this CPU can do for inference kernels (all False where unknown)."""

    model_name: str
    torch_capability: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    avx512_vnni: bool
    amx: bool
    onednn_bf16: bool = False
    """oneDNN's bf16 matmul primitives run here (AVX-512 BW+VL+DQ, or AVX-NE-CONVERT): what
    ``mkldnn._reorder_linear_weight`` needs for a bf16 weight; it raises on an AVX2-only CPU."""
    family: int | None = None
    """``cpu family`` of ``/proc/cpuinfo`` (None where absent): with ``model``, the CPU's generation
    where a VM hides the model name (AMD family 25 model 1: Zen 3; model 17: Zen 4)."""
    model: int | None = None
    """``model`` of ``/proc/cpuinfo`` (None where absent)."""

    def describe(self) -> str:
        """``model name, family F model M, torch capability``: the CPU to write next to a figure."""
        generation = f", family {self.family} model {self.model}" if self.family is not None else ""
        return f"{self.model_name}{generation}, {self.torch_capability}"

    @property
    def fast_bf16(self) -> bool:
        """Native bf16 dot products (AVX-512 BF16 or AMX-BF16): bf16 GEMMs beat float32 ones."""
        return self.avx512_bf16 or self.amx


def parse_cpuinfo(text: str, torch_capability: str = "DEFAULT") -> CPUFeatures:
    """Features from ``/proc/cpuinfo`` text (the first processor's ``flags`` and ``model name``)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    flags: set[str] = set()
    model = "unknown"
    numbers: dict[str, int] = {}  # the first processor's "cpu family" and "model"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and model == "unknown":
            model = value.strip() or model
        elif key in ("cpu family", "model") and key not in numbers and value.strip().isdigit():
            numbers[key] = int(value)
    return CPUFeatures(
        model_name=model,
        family=numbers.get("cpu family"),
        model=numbers.get("model"),
        torch_capability=torch_capability,
        avx2="avx2" in flags,
        avx512="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        avx512_vnni="avx512_vnni" in flags,
        amx="amx_bf16" in flags and "amx_tile" in flags,
        onednn_bf16={"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags,
    )


@functools.cache
def cpu_features() -> CPUFeatures:
    """This machine's features (read once per process)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, torch.backends.cpu.get_cpu_capability())


def auto_dtype(device: str = "cpu", features: CPUFeatures | None = None) -> str:
    """The compute dtype ``dtype="auto"`` picks: measured, not assumed.

    - CUDA: ``"bfloat16"``.
    - CPU with AMX: ``"bfloat16"`` (the 2026-12-02 measurement on a Xeon with AMX-BF16, where
      bf16 dense GEMMs served prefill; not re-measured since the int8 GEMM tier and the fused
      float32 decode operator exist, no AMX machine has been available).
    - Every other CPU: ``"float32"`` activations over quantized weights (GGUF codes for small
      batches, the int8 GEMM tier for large ones), which the fused C++ decode operator serves.
      Measured with ``dtype`` forced, same session, SmolLM2 Q8_0, 2 threads: on an AVX-512
      BF16/VNNI EPYC (Zen 5) float32 is faster on the 64 x 128 uniform set (1278-1441 vs
      1168-1363 tok/s, three interleaved pairs) and for one stream (165-202 vs 123-132 tok/s); on
      the AVX2 EPYC (Zen 3) bf16 had no native dot product and lost from a few rows on.
    """
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if (features or cpu_features()).amx else "float32"


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``): loading a model
    frees hundreds of MB of temporary float32 copies in pieces glibc would otherwise keep (SmolLM2:
    resident memory after ``LLM()`` 961 -> 734 MB). Returns whether any memory was released;
    False where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))
