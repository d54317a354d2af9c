"""An operator's source built a second time for another instruction set, under its own library name.

Every host builds its operators for itself (``-march=native``), so each host kind runs only its own
paths; a test that builds the source again with other flags lets one host check the code another
kind runs (an AVX-512 host the AVX2-only code of the Zen 3 EPYC, any host the scalar loops).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treeserve._cpp import INCLUDE, cpu_flags

NO_AVX512 = ["-O3", "-march=native", "-mno-avx512f", "-mno-avxvnni"]
"""This host's features without AVX-512 or AVX-VNNI: what an AVX2+FMA host such as Zen 3 builds."""


def skip_without_avx512() -> None:
    """Skip where the host has no AVX-512: there the native build is the :data:`NO_AVX512` one."""
    if "avx512f" not in cpu_flags().split():
        pytest.skip("no AVX-512 here: the native build is the AVX2 one")


def build_variant(source: Path, library: str, flags: list[str], build_dir: Path) -> object:
    """Build and load ``source`` with ``flags`` and ``-DTREESERVE_LIBRARY=<library>`` (the torch library it
    registers into, ``treeserve_library.h``) in ``build_dir``; returns ``torch.ops.<library>``."""
    from torch.utils.cpp_extension import load

    load(name=f"{library}_{source.stem}_test", sources=[str(source)], extra_include_paths=[str(INCLUDE)],
         extra_cflags=[*flags, "-fopenmp", f"-DTREESERVE_LIBRARY={library}"], extra_ldflags=["-fopenmp"],
         build_directory=str(build_dir), is_python_module=False)
    return getattr(torch.ops, library)
