"""Run a script or module as an AVX2-only host would (the Zen 3 EPYC's instruction set) on an AVX-512 host.

What changes, before treeserve is imported:
- ``/proc/cpuinfo`` as treeserve reads it loses the AVX-512, AVX-VNNI, AMX and AVX-NE-CONVERT flags, so
  feature detection (``treeserve._cpu.cpu_features``) and the operators' build keys see an AVX2 host;
- the C++ operators are built with ``-mno-avx512f -mno-avxvnni`` (their AVX2 paths), in their own
  ``TORCH_EXTENSIONS_DIR``; the measured crossovers go to their own ``TREESERVE_CACHE_DIR``;
- oneDNN and ATen are capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``).

This emulates the instruction set, not the microarchitecture: timings say which path is faster on
this CPU's cores, which a real Zen 3 can order differently. Subprocesses do not inherit the mask.

Usage: ``python benches/as_avx2.py SCRIPT [ARGS]`` or ``python benches/as_avx2.py -m MODULE [ARGS]``.
"""

from __future__ import annotations

import os
import pathlib
import re
import runpy
import sys

_MASKED = re.compile(r"\b(avx512\w*|avx_vnni\w*|amx\w*|avx_ne_convert)\b ?")


def _mask() -> None:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/treeserve_as_avx2/extensions")
    os.environ.setdefault("TREESERVE_CACHE_DIR", "/tmp/treeserve_as_avx2/cache")
    read_text = pathlib.Path.read_text

    def masked(self: pathlib.Path, *args: object, **kwargs: object) -> str:
        text = read_text(self, *args, **kwargs)  # type: ignore[arg-type]
        return _MASKED.sub("", text) if str(self) == "/proc/cpuinfo" else text

    pathlib.Path.read_text = masked  # type: ignore[method-assign]
    import treeserve._cpp as cpp

    cpp._CFLAGS[:] = ["-O3", "-march=native", "-mno-avx512f", "-mno-avxvnni", "-fopenmp"]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    _mask()
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
