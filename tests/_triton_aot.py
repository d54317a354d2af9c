"""Ahead-of-time compile check of every Triton kernel in treeserve, on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``, how the numerics are tested on CPU) does not type-check:
a kernel it runs can still fail to compile for a GPU. This module compiles each kernel to PTX and
cubin for sm_80 and sm_90 with ``triton.compile(ASTSource(...), target=GPUTarget(...))`` (which
needs no driver) and reports, per kernel, launch case and target, the registers, spill bytes and
shared memory that ``ptxas`` allocated.

Signatures come from the launchers themselves: each case calls a treeserve launcher with CPU
tensors of the dtypes and shapes the engine passes it (real model shapes: SmolLM2-135M,
Llama-3.2-1B, Llama-3-8B, Qwen2.5-1.5B; decode, verify and prefill blocks; each accepted dtype),
while ``JITFunction.run`` is replaced by a recorder that turns the bound arguments into a
signature (tensors -> pointer types, Python ints -> i32/i64, floats -> fp32) and the constexpr
values, and launches nothing. A float scalar argument is compiled twice, typed fp32 (a plain
launch) and fp64 (how ``torch.compile`` types a Python float).

Run it as ``python -m tests._triton_aot [--json PATH] [--markdown]`` in a process where
``TRITON_INTERPRET`` is unset (``triton.jit`` then builds compilable kernels); the test
``tests/test_triton_aot.py`` does so in a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

TARGETS = (80, 90)
SMEM_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory one block may opt into
HOT = ("_paged_attn_kernel", "_merge_splits_kernel", "_threshold_kernel", "_walk_kernel",  # spills fail the check here
       "_add_rms_norm_kernel", "_rope_store_kernel", "_silu_mul_kernel", "_head_bf16_kernel", "_head_rescore_kernel")
KERNEL_MODULES = ("treeserve.kvcache._attention_triton", "treeserve.kvcache._triton_ops",
                  "treeserve.sampling.triton_kernels", "treeserve.models._triton_layers")

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}


@dataclass(frozen=True, slots=True)
class Launch:
    """One signature a launcher uses: kernel, argument types, constexpr values, launch options."""

    kernel: str
    case: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class Compiled:
    """What ptxas allocated for one (launch, target), or the compile error."""

    kernel: str
    case: str
    target: int
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared: int = -1
    error: str = ""
    problems: list[str] = field(default_factory=list)


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


class Recorder:
    """Replaces ``JITFunction.run`` while active: each launch is recorded, none is executed."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.case = ""

    @contextlib.contextmanager
    def active(self) -> Iterator[Recorder]:
        from triton.runtime.jit import JITFunction

        original = JITFunction.run

        def record(fn: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
            options = {k: int(kwargs.pop(k)) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = fn.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            sig, const = [], []
            for param in fn.params:
                value = bound.arguments[param.name]
                if param.is_constexpr or value is None:
                    sig.append((param.name, "constexpr"))
                    const.append((param.name, value))
                else:
                    sig.append((param.name, _arg_type(value)))
            self.launches.append(Launch(fn.__name__, self.case, tuple(sig), tuple(const), tuple(options.items())))

        JITFunction.run = record  # type: ignore[method-assign]
        try:
            yield self
        finally:
            JITFunction.run = original  # type: ignore[method-assign]


# ---------------------------------------------------------------- the launch cases

# (name, query heads, KV heads, head dim): the model shapes the engine serves.
SHAPES = (("smollm2-135m", 9, 3, 64), ("llama-3.2-1b", 32, 8, 64), ("llama-3-8b", 32, 8, 128),
          ("qwen2.5-1.5b", 12, 2, 128))
ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _attention_cases(rec: Recorder) -> None:
    from treeserve.kvcache import AttentionMetadata
    from treeserve.kvcache._attention_triton import paged_attention_triton

    page = 16
    modes = {  # qo_lens, kv_lens, tree parents, causal: decode / verify (chain + tree) / prefill chunk
        "decode": ([1, 1], [40, 17], None, True),
        "verify chain": ([5, 5], [45, 60], [[-1, 0, 1, 2, 3]] * 2, True),
        "verify tree": ([9], [60], [[-1, 0, 0, 1, 1, 2, 2, 3, 3]], True),
        # long contexts at batch 1: the split rule (kvcache/split_kv.py) cuts the KV in 16 splits
        "decode split": ([1], [4096], None, True),
        "verify tree split": ([9], [2048], [[-1, 0, 0, 1, 1, 2, 2, 3, 3]], True),
        "prefill": ([64, 3], [64, 80], None, True),
        "encode": ([8], [8], None, False),
    }
    for name, hq, hkv, d in SHAPES:
        for dtype in ATTN_DTYPES if name == "llama-3-8b" else (torch.bfloat16,):
            for mode, (qo, kv, parents, causal) in modes.items():
                if mode == "encode" and name != "llama-3-8b":
                    continue
                pages = [list(range(1 + 8 * b, 1 + 8 * b + -(-n // page))) for b, n in enumerate(kv)]
                meta = AttentionMetadata.build(qo, kv, pages, page, parents)
                q = torch.empty(sum(qo), hq, d, dtype=dtype)
                cache = torch.empty(32, page, hkv, d, dtype=dtype)
                rec.case = f"{name} {str(dtype)[6:]} {mode}"
                paged_attention_triton(q, cache, cache, meta, d**-0.5, causal)


def _kv_op_cases(rec: Recorder) -> None:
    from treeserve.kvcache._triton_ops import compact_tree_path_triton, store_kv_triton

    for dtype in ATTN_DTYPES:
        cache = torch.empty(8, 16, 8, 128, dtype=dtype)
        rows = torch.empty(3, 8, 128, dtype=dtype)
        slots = torch.tensor([17, 18, 19])
        rec.case = f"store_kv {str(dtype)[6:]}"
        store_kv_triton(cache, cache, slots, rows, rows)
        rec.case = f"compact {str(dtype)[6:]}"
        compact_tree_path_triton([cache], [cache], slots, slots)


def _sampling_cases(rec: Recorder) -> None:
    from treeserve.sampling.triton_kernels import thresholds_triton, walk_tree_triton

    for vocab in (49152, 128256):
        for work in (torch.float32, torch.float64):  # processing keeps float64 for exact tests
            rows = 4
            rec.case = f"thresholds V={vocab} {str(work)[6:]}"
            thresholds_triton(torch.empty(rows, vocab, dtype=work), torch.zeros(rows, dtype=torch.int64),
                              torch.ones(rows, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64))
            m = 4
            tokens = torch.zeros(rows, m, dtype=torch.int64)
            parents = torch.full((rows, m), -1, dtype=torch.int64)
            rec.case = f"verify V={vocab} {str(work)[6:]} q"
            walk_tree_triton(torch.empty(rows, m + 1, vocab, dtype=work), torch.empty(rows, m, vocab, dtype=work),
                             tokens, parents, torch.full((rows,), m, dtype=torch.int64), torch.empty(rows, m, dtype=work))


# (name, hidden, query heads, KV heads, head dim, intermediate, vocab) for the fused layer and the head.
# (Llama-3.2-1B adds no new kind of signature to these three: left out to keep the cold check short.)
LAYER_SHAPES = (("smollm2-135m", 576, 9, 3, 64, 1536, 49152), ("llama-3-8b", 4096, 32, 8, 128, 14336, 128256),
                ("qwen2.5-1.5b", 1536, 12, 2, 128, 8960, 151936))


def _qwen3_norm_case(rec: Recorder) -> None:
    """The q / k-norm rope+store kernel at Qwen3-0.6B's 16 query / 8 KV heads (another head block)."""
    from treeserve.models._triton_layers import rope_store_triton

    rec.case = "qwen3-0.6b bfloat16 rope+store with q / k norms, bfloat16 KV"
    idx, dtype = torch.zeros(4, dtype=torch.int64), torch.bfloat16
    cache, w = torch.empty(8, 16, 8, 128, dtype=dtype), torch.empty(128, dtype=dtype)
    rope_store_triton(torch.empty(4, 32 * 128, dtype=dtype), torch.empty(64, 2, 64), idx, idx, cache, cache, 16, 8,
                      w, w)


def _layer_cases(rec: Recorder) -> None:
    from treeserve.models._triton_layers import (add_rms_norm_triton, head_bf16_triton, head_bound_factor,
                                                 head_rescore_triton, rope_store_triton, silu_mul_triton)

    for name, hidden, hq, hkv, d, inter, vocab in LAYER_SHAPES:
        for dtype in (torch.bfloat16, torch.float32) if name == "llama-3-8b" else (torch.bfloat16,):
            tag = f"{name} {str(dtype)[6:]}"
            x = torch.empty(4, hidden, dtype=dtype)
            w = torch.empty(hidden, dtype=dtype)
            for kind, res, rows in (("", None, None), (" + residual", x, None),
                                    (" + residual, gathered rows", x, torch.zeros(2, dtype=torch.int64))):
                rec.case = f"{tag} norm{kind}"
                add_rms_norm_triton(x, res, w, 1e-5, rows=rows)
            idx = torch.zeros(4, dtype=torch.int64)
            for kv_dtype in {dtype, torch.bfloat16}:
                rec.case = f"{tag} rope+store, {str(kv_dtype)[6:]} KV"
                cache = torch.empty(8, 16, hkv, d, dtype=kv_dtype)
                rope_store_triton(torch.empty(4, (hq + 2 * hkv) * d, dtype=dtype), torch.empty(64, 2, d // 2), idx,
                                  idx, cache, cache, hq, hkv)
            if dtype == torch.bfloat16 and d == 128:  # Qwen3's q / k norms (head_dim 128; 8B: Qwen3-8B's heads)
                rec.case = f"{tag} rope+store with q / k norms, {str(dtype)[6:]} KV"
                cache = torch.empty(8, 16, hkv, d, dtype=dtype)
                rope_store_triton(torch.empty(4, (hq + 2 * hkv) * d, dtype=dtype), torch.empty(64, 2, d // 2), idx,
                                  idx, cache, cache, hq, hkv, torch.empty(d, dtype=dtype), torch.empty(d, dtype=dtype))
            rec.case = f"{tag} silu*up"
            silu_mul_triton(torch.empty(4, 2 * inter, dtype=dtype))
            # The first pass's row tile: 16 (decode at batch <= 16) everywhere, 64 (larger batches, verify) on 8B.
            for rows in (1, 64) if name == "llama-3-8b" else (1,):
                rec.case = f"{tag} head M={rows}"
                f = head_bound_factor(hidden)
                w = torch.empty(vocab, hidden)
                xr = torch.empty(rows, hidden, dtype=dtype)
                approx, partial, xn = head_bf16_triton(xr, torch.empty(vocab, hidden, dtype=torch.bfloat16),
                                                       torch.empty(vocab), f)
                head_rescore_triton(xr, w, torch.empty(vocab), approx, partial, xn, f)


CASES: tuple[Callable[[Recorder], None], ...] = (_attention_cases, _kv_op_cases, _sampling_cases, _layer_cases,
                                                 _qwen3_norm_case)


FP64_CASES = ("llama-3-8b",)
"""Cases whose float scalars are also compiled typed fp64 (what ``torch.compile`` passes): every
dtype and mode of one model shape; the type rules do not depend on the shape constants."""


def record_launches() -> list[Launch]:
    """Every distinct launch signature of the cases above (first case name kept per signature);
    the float scalar arguments of ``FP64_CASES`` once typed fp32 and once fp64."""
    rec = Recorder()
    with rec.active():
        for case in CASES:
            case(rec)
    seen: dict[tuple[object, ...], Launch] = {}
    for launch in rec.launches:
        variants = [launch]
        if launch.case.startswith(FP64_CASES) and any(t == "fp32" for _, t in launch.signature):
            fp64 = tuple((n, "fp64" if t == "fp32" else t) for n, t in launch.signature)
            variants.append(Launch(launch.kernel, launch.case + " [fp64 scalars]", fp64, launch.constexprs,
                                   launch.options))
        for v in variants:
            seen.setdefault((v.kernel, v.signature, v.constexprs, v.options), v)
    return list(seen.values())


def kernel_functions(modules: tuple[str, ...] = KERNEL_MODULES) -> dict[str, object]:
    """Every ``@triton.jit`` function of ``modules``, by name."""
    import importlib

    from triton.runtime.jit import JITFunction

    found = {}
    for mod_name in modules:
        mod = importlib.import_module(mod_name)
        found.update({k: v for k, v in vars(mod).items() if isinstance(v, JITFunction)})
    return found


# ---------------------------------------------------------------- compiling

_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _compile(job: tuple[Launch, int]) -> Compiled:
    launch, cc = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_functions((*KERNEL_MODULES, __name__))[launch.kernel]
    out = Compiled(launch.kernel, launch.case, cc)
    log = io.StringIO()
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    try:
        src = ASTSource(fn=fn, signature=dict(launch.signature), constexprs=dict(launch.constexprs))
        # A fresh Triton cache per job: a cached kernel skips ptxas, whose report is what is read.
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
            os.environ["TRITON_CACHE_DIR"] = cache
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(launch.options))
    except Exception as e:  # noqa: BLE001 - every compile error is a finding, reported whole
        out.error = f"{type(e).__name__}: {e}".strip()
        return out
    text = log.getvalue()
    regs, spills = _PTXAS.findall(text), _SPILL.findall(text)
    if not regs or not spills:
        out.error = f"no ptxas report in the compile log: {text[:300]!r}"
        return out
    out.registers = max(int(r) for r in regs)
    out.spill_stores = max(int(s) for s, _ in spills)
    out.spill_loads = max(int(s) for _, s in spills)
    out.shared = int(kernel.metadata.shared)
    return out


def judge(result: Compiled) -> list[str]:
    """The reasons ``result`` fails the check (empty: it passes)."""
    problems = []
    if result.error:
        problems.append(f"compile error: {result.error}")
        return problems
    if result.kernel in HOT and (result.spill_stores or result.spill_loads):
        problems.append(f"hot kernel spills ({result.spill_stores} B stored, {result.spill_loads} B loaded)")
    if result.shared > SMEM_LIMIT[80]:
        problems.append(f"shared memory {result.shared} B above sm_80's {SMEM_LIMIT[80]} B")
    return problems


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/treeserve/triton_aot`` (``~/.cache`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "treeserve" / "triton_aot"


def _key(launch: Launch, cc: int) -> str:
    """What a result depends on: Triton's version, the source of the kernel's module (its helpers
    live there too), the signature, constexprs, options and target."""
    import triton

    source = Path(inspect.getsourcefile(kernel_functions()[launch.kernel].fn)).read_bytes()  # type: ignore[attr-defined,arg-type]
    blob = json.dumps([triton.__version__, launch.kernel, launch.signature, launch.constexprs, launch.options, cc],
                      default=str).encode()
    return hashlib.sha1(blob + b"\0" + source).hexdigest()


def compile_all(launches: list[Launch], jobs: int | None = None, cache_dir: Path | None = None) -> list[Compiled]:
    """Compile every launch for every target in ``jobs`` worker processes. Results are kept in ``cache_dir`` (one JSON file per key, see ``_key``), so a rerun compiles only what
    changed; compile errors are never cached."""
    work = [(launch, cc) for launch in launches for cc in TARGETS]
    keys = [_key(launch, cc) for launch, cc in work]
    results: dict[int, Compiled] = {}
    if cache_dir is not None:
        for i, ((launch, _), key) in enumerate(zip(work, keys)):
            path = cache_dir / f"{key}.json"
            if path.is_file():
                with contextlib.suppress(ValueError, TypeError, OSError):
                    results[i] = Compiled(**{**json.loads(path.read_text()), "case": launch.case, "problems": []})
    todo = [i for i in range(len(work)) if i not in results]
    if todo:
        with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            for i, r in zip(todo, pool.map(_compile, [work[i] for i in todo])):
                results[i] = r
                if cache_dir is not None and not r.error:
                    cache_dir.mkdir(parents=True, exist_ok=True)
                    tmp = cache_dir / f"{keys[i]}.{os.getpid()}.tmp"
                    tmp.write_text(json.dumps(asdict(r)))
                    tmp.replace(cache_dir / f"{keys[i]}.json")
    out = [results[i] for i in range(len(work))]
    for r in out:
        r.problems = judge(r)
    return out


def markdown(results: list[Compiled]) -> str:
    """One row per (kernel, case): registers / spills / shared memory at each target."""
    rows: dict[tuple[str, str], dict[int, Compiled]] = {}
    for r in results:
        rows.setdefault((r.kernel, r.case), {})[r.target] = r
    head = "| kernel | case | " + " | ".join(f"sm_{cc} regs / spill B / smem B" for cc in TARGETS) + " | check |"
    lines = [head, "|---|---|" + "---|" * len(TARGETS) + "---|"]
    for (kernel, case), by_cc in rows.items():
        cells = []
        for cc in TARGETS:
            r = by_cc[cc]
            cells.append("error" if r.error else f"{r.registers} / {r.spill_stores} / {r.shared}")
        ok = all(not r.problems for r in by_cc.values())
        lines.append(f"| {kernel} | {case} | " + " | ".join(cells) + f" | {'ok' if ok else 'FAIL'} |")
    return "\n".join(lines)


@triton.jit
def _type_unstable_kernel(x_ptr, out_ptr):
    m = tl.load(x_ptr).to(tl.float64)
    thr = float("-inf")  # typed fp32 ...
    if m > 0:
        thr = m  # ... and redefined as fp64: the interpreter runs it, the compiler refuses it
    tl.store(out_ptr, thr)


def self_test() -> None:
    """The check must catch what the interpreter lets through: ``_type_unstable_kernel`` makes the
    first mistake seen on a real GPU (an fp32 value redefined as fp64 in a branch)."""
    launch = Launch("_type_unstable_kernel", "self-test", (("x_ptr", "*fp32"), ("out_ptr", "*fp64")), ())
    result = _compile((launch, 90))
    if "fp64" not in result.error:
        raise SystemExit(f"self-test: the type error went unnoticed ({result})")
    print("self-test: a kernel that redefines an fp32 value as fp64 fails to compile, as it must")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--cache", default=str(default_cache_dir()), help="result cache ('' = none)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("the AOT check needs compilable kernels: run it with TRITON_INTERPRET unset")
    self_test()
    launches = record_launches()
    results = compile_all(launches, args.jobs, Path(args.cache) if args.cache else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launches": [asdict(x) for x in launches], "results": [asdict(r) for r in results],
                       "kernels": sorted(kernel_functions())}, f, default=str)
    print(markdown(results))
    bad = [r for r in results if r.problems]
    for r in bad:
        print(f"FAIL {r.kernel} [{r.case}] sm_{r.target}: {'; '.join(r.problems)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
