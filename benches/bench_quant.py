"""Packed int4 vs dense GEMMs on SmolLM2-135M shapes: the numbers behind ``dtype="auto"`` and
the packed/dense crossover (``treeserve.models.quant.measure_crossover`` measures the same at load).

Prints ms per call for every projection shape and the LM head at several row counts, the total
for 30 layers + head, and the crossover that ``measure_crossover`` finds on this machine.
Run: ``flock /tmp/treeserve-bench.lock python benches/bench_quant.py --threads 2``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from treeserve._cpu import cpu_features
from treeserve.models.quant import PackedLinear, measure_crossover, quantize_int4, quantize_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def _ms(fn, reps: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    f = cpu_features()
    print(f"# {f.model_name} ({f.torch_capability}, bf16 native: {f.fast_bf16}), {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    for rows in map(int, args.rows.split(",")):
        total: dict[str, float] = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            x = torch.randn(rows, k)
            i4 = PackedLinear(quantize_int4(w), w, None)
            i8 = PackedLinear(quantize_int8(w), w, None)
            wb, xb = w.bfloat16(), x.bfloat16()
            cells = {
                "f32": _ms(lambda: F.linear(x, w)),
                "bf16": _ms(lambda: F.linear(xb, wb)),
                "int4": _ms(lambda: i4.packed_forward(x)),
                "int8(2x4)": _ms(lambda: i8.packed_forward(x)),
            }
            for key, v in cells.items():
                total[key] = total.get(key, 0.0) + v * (1 if name == "head" else 30)
            print(f"rows {rows:>3} {name:<8}" + "".join(f"{k:>11} {v:7.3f}" for k, v in cells.items()))
        print(f"rows {rows:>3} TOTAL   " + "".join(f"{k:>11} {v:7.2f}" for k, v in total.items()), flush=True)
    w = torch.randn(3072, 576) * 0.02
    print(f"measure_crossover(gate_up, float32 dense): {measure_crossover(PackedLinear(quantize_int4(w), w, None))} rows")


if __name__ == "__main__":
    main()
