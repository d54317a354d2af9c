"""Run-time CPU feature detection and the ``dtype="auto"`` rule."""

from __future__ import annotations

import pytest

from treeserve._cpu import auto_dtype, cpu_features, parse_cpuinfo

AVX2_EPYC = ("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma "
             "f16c\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
SPR = ("model name\t: Intel Xeon\nflags\t: avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 amx_bf16 "
       "amx_tile amx_int8\n")


def test_avx2_only_machine_gets_float32() -> None:
    f = parse_cpuinfo(AVX2_EPYC, "AVX2")
    assert (f.model_name, f.avx2, f.avx512, f.avx512_bf16, f.amx, f.fast_bf16, f.onednn_bf16) == (
        "AMD EPYC", True, False, False, False, False, False)
    assert auto_dtype("cpu", f) == "float32"
    assert (f.family, f.model) == (25, 1)  # the first processor's, not the model name's number
    assert f.describe() == "AMD EPYC, family 25 model 1, AVX2"


def test_amx_machines_and_cuda_get_bfloat16_avx512_bf16_alone_float32() -> None:
    f = parse_cpuinfo(SPR, "AVX512")
    assert f.avx512 and f.avx512_vnni and f.avx512_bf16 and f.amx and f.fast_bf16 and f.onednn_bf16
    assert parse_cpuinfo("flags: avx2 avx_ne_convert\n").onednn_bf16  # AVX-NE-CONVERT alone suffices
    assert not parse_cpuinfo("flags: avx512f avx512bw avx512vl\n").onednn_bf16  # DQ missing
    assert auto_dtype("cpu", f) == "bfloat16"
    no_amx = parse_cpuinfo("flags: avx512f avx512_bf16 amx_bf16\n")  # amx without tiles: not AMX
    assert no_amx.fast_bf16 and not no_amx.amx
    assert auto_dtype("cpu", no_amx) == "float32"  # measured: the fused float32 path wins there
    assert auto_dtype("cuda:0", parse_cpuinfo("")) == "bfloat16"


def test_empty_or_bad_input() -> None:
    f = parse_cpuinfo("")
    assert f.model_name == "unknown" and not (f.avx2 or f.avx512 or f.fast_bf16)
    assert f.family is None and f.model is None and f.describe() == "unknown, DEFAULT"
    assert parse_cpuinfo("cpu family\t: x\nmodel\t: \n").family is None  # not a number: absent
    with pytest.raises(TypeError, match="text must be str"):
        parse_cpuinfo(b"flags: avx2")  # type: ignore[arg-type]


def test_this_machine_is_read_once() -> None:
    assert cpu_features() is cpu_features()
    assert cpu_features().torch_capability != ""
