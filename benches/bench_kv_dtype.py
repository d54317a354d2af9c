"""KV cache dtypes on CPU: float32, bfloat16 and float16, side by side in one process.

Two parts, each in interleaved rounds (every round runs every dtype once, in the same order) and
reported as medians, so drift on a shared machine touches every dtype alike:

- ``--part op``: the C++ decode attention operator alone (``treeserve::paged_decode_attention``) on
  SmolLM2's head layout (9 query heads, 3 KV heads, head_dim 64) and Llama-3-8B's (32 / 8 / 128),
  one-token pages scattered at random, at batch x context sizes from a single stream to batch 64.
  ``--isa avx2`` times the operator built without AVX-512 (``tests/_isa_builds.py``: what an AVX2
  host such as the Zen 3 EPYC runs), under its own library name.
- ``--part engine``: the embedded SmolLM2 in the default configuration (``LLM()``, speculation off)
  with each ``kv_cache_dtype``, greedy, 128 new tokens: one request (tok/s) and 64 at once; then
  16 requests of ~1,000 prompt tokens, decode tok/s (64 new tokens minus 1, prompts cached).

Usage: ``python benches/bench_kv_dtype.py --part op|engine [--isa native|avx2] [--rounds N]``.
Threads: ``TREESERVE_BENCH_THREADS`` (default 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

THREADS = int(os.environ.get("TREESERVE_BENCH_THREADS", "2"))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (batch, context, query heads, KV heads, head_dim): SmolLM2's layout, then Llama-3-8B's.
OP_CASES = [(1, 300, 9, 3, 64), (1, 2000, 9, 3, 64), (16, 512, 9, 3, 64), (64, 129, 9, 3, 64), (64, 512, 9, 3, 64),
            (1, 1000, 32, 8, 128), (16, 512, 32, 8, 128)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int, slice_s: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in ``rounds`` rounds of ``slice_s`` each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0, n = time.perf_counter(), 0
            while n == 0 or time.perf_counter() - t0 < slice_s:  # at least one call
                f()
                n += 1
            times[k].append((time.perf_counter() - t0) / n)
    return {k: statistics.median(v) for k, v in times.items()}


def _operator(isa: str) -> Callable[..., torch.Tensor]:
    if isa == "native":
        from treeserve.kvcache._attention_cpu import load_cpu_decode_op

        reason = load_cpu_decode_op()
        if reason is not None:
            sys.exit(f"the operator is unavailable: {reason}")
        return torch.ops.treeserve.paged_decode_attention
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests._isa_builds import NO_AVX512, build_variant

    from treeserve.kvcache._cpu_op import SOURCE

    return build_variant(SOURCE, "treeserve_kvbench", NO_AVX512, Path(tempfile.mkdtemp())).paged_decode_attention


def bench_op(isa: str, rounds: int) -> None:
    op = _operator(isa)
    print(f"decode attention operator ({isa} build), {THREADS} threads, medians of {rounds} rounds (us per call)")
    for batch, ctx, hq, hkv, dim in OP_CASES:
        gen = torch.Generator().manual_seed(0)
        slots = batch * ctx + 1
        k, v = (torch.randn(slots, 1, hkv, dim, generator=gen) for _ in range(2))
        q = torch.randn(batch, hq, dim, generator=gen)
        pages = (torch.randperm(slots - 1, generator=gen) + 1).int()
        indptr = torch.arange(0, batch * ctx + 1, ctx, dtype=torch.int32)
        last = torch.ones(batch, dtype=torch.int32)
        fns = {_name(dt): (lambda q=q.to(dt), k=k.to(dt), v=v.to(dt): op(q, k, v, indptr, pages, last, dim**-0.5))
               for dt in DTYPES}  # fmt: skip
        med = _interleaved(fns, rounds, 0.1)
        cells = "  ".join(f"{k} {s * 1e6:8.1f}" for k, s in med.items())
        half = med["float16"]
        print(f"batch {batch:2d} x {ctx:4d}, heads {hq}/{hkv} x {dim:3d}: {cells}   "
              f"float16/bfloat16 {half / med['bfloat16']:.2f}, float16/float32 {half / med['float32']:.2f}")


def bench_engine(rounds: int) -> None:
    from treeserve import LLM, SamplingParams

    base = LLM("smollm2-135m-instruct", num_threads=THREADS, speculative=None)
    print(f"SmolLM2 default configuration ('auto' KV here: {_name(base.kv.dtype)}), {THREADS} threads, "
          f"medians of {rounds} rounds (tok/s)")
    engines = {_name(dt): LLM((base.model, base.tokenizer), num_threads=THREADS, speculative=None,
                              kv_cache_dtype=_name(dt)) for dt in DTYPES}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    workloads = {"single": ["Write a short story about a cat who learns to fly."],
                 "batch 64": [f"Tell me fact number {i} about the ocean and why it matters." for i in range(64)]}
    for label, prompts in workloads.items():
        fns = {k: (lambda llm=llm, prompts=prompts: llm.generate(prompts, params, use_tqdm=False))
               for k, llm in engines.items()}  # fmt: skip
        med = _interleaved(fns, rounds, 0.0)  # one call per round
        print(f"{label:8s}: " + "  ".join(f"{k} {len(prompts) * 128 / s:7.1f}" for k, s in med.items()))
    # Long contexts, where attention's share grows: 16 requests of ~1,000 prompt tokens (cached after the
    # first round), decode tok/s from 64 new tokens minus 1 (the prompt's cached steps cancel out).
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    long = [text[3000 * i : 3000 * i + 4000] for i in range(16)]
    short, full = (SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (1, 64))
    fns = {f"{k} {n}": (lambda llm=llm, p=p: llm.generate(long, p, use_tqdm=False))
           for k, llm in engines.items() for n, p in (("1", short), ("64", full))}  # fmt: skip
    med = _interleaved(fns, rounds, 0.0)
    tok_s = {k: 16 * 63 / (med[f"{k} 64"] - med[f"{k} 1"]) for k in engines}
    print("16 x ~1k : " + "  ".join(f"{k} {v:7.1f}" for k, v in tok_s.items()) + "  (decode only)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["op", "engine"], default="op")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native", help="op part: which build to time")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    print(f"CPU: {_cpu()}")
    if args.part == "op":
        bench_op(args.isa, args.rounds)
    else:
        bench_engine(args.rounds)


def _cpu() -> str:
    from treeserve._cpu import cpu_features

    f = cpu_features()
    return f"{f.model_name} family {f.family} model {f.model}, AVX-512 {f.avx512}, AVX-512 BF16 {f.avx512_bf16}"


if __name__ == "__main__":
    main()
