"""Decode GEMMs of SmolLM2-135M on this CPU: the GGUF operator vs dense float32 vs torch int4pack.

One "step" is what a decode step multiplies: 30 layers x (qkv, o, gate_up, down), each layer its own
weights (so, as in the model, they do not stay in cache), plus the tied LM head. Layers are Q4_1
and the head Q8_0 (the embedded GGUF's types), random codes and f16 scales; every method reads
the same codes: ``treeserve::gguf_linear`` on the blocks as shipped (layers: ``gguf_linear``, int16
activations per 32-block, what ``PackedLinear`` runs, and ``gguf_linear_exact``, float32
activations; the head ``gguf_linear_exact``, as ``ExactHead`` runs it), float32 dense on
their dequantization, torch's ``_weight_int4pack_mm_for_cpu`` on the same codes (bf16
activations/scales). Prints ms per step (layers, head) at each row count, and the crossovers
``measure_crossover`` / ``ExactHead`` find at load.
Run: ``flock /tmp/treeserve-bench.lock python benches/bench_quant.py --threads 2``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from treeserve._cpu import cpu_features
from treeserve.models.gguf_op import BLOCK_BYTES, GGUFWeight, gguf_op_available
from treeserve.models.quant import ExactHead, PackedLinear, measure_crossover, planes_from_gguf

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30


def random_weight(qtype: str, n: int, k: int, rng: np.random.Generator) -> tuple[GGUFWeight, np.ndarray]:
    blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = 2 if qtype == "Q4_1" else 1
    blocks[..., : 2 * halves] = (rng.standard_normal((n, k // 32, halves)) * 0.01).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(-1)
    return GGUFWeight.from_bytes(qtype, raw, (n, k)), raw


def _ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not gguf_op_available():
        raise SystemExit("treeserve::gguf_linear did not build (see the log): nothing to compare")
    f = cpu_features()
    rng = np.random.default_rng(0)
    layers: list[PackedLinear] = []
    int4: list[PackedLinear] = []
    for _ in range(LAYERS):
        for n, k in LAYER_SHAPES.values():
            w, raw = random_weight("Q4_1", n, k, rng)
            dense = w.dequantize()
            layers.append(PackedLinear(w, dense, None))
            int4.append(PackedLinear(planes_from_gguf("Q4_1", raw, (n, k)), dense, None))
    hw, hraw = random_weight("Q8_0", *HEAD, rng)
    hdense = hw.dequantize()
    head_i4 = PackedLinear(planes_from_gguf("Q8_0", hraw, HEAD), hdense, None)
    print(f"# {f.model_name} ({f.torch_capability}), {args.threads} threads, load {os.getloadavg()[0]:.2f}; "
          f"ms per decode step: {LAYERS} layers (Q4_1) | head (Q8_0 {HEAD[0]}x{HEAD[1]})")
    print("| rows | gguf_linear (int16 act layers) | gguf_linear (float32 act) | float32 dense | int4pack (bf16 act) |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}

            def run(fn: Callable[[PackedLinear, torch.Tensor], object], mods: list[PackedLinear]) -> Callable[[], None]:
                return lambda: [fn(m, xs[m.in_features]) for m in mods] and None

            head_ms = _ms(lambda: torch.ops.treeserve.gguf_linear_exact(xs[576], hw.raw, "Q8_0", 576), args.reps)
            exact = run(lambda m, x: torch.ops.treeserve.gguf_linear_exact(x, m.raw, m.qtype, m.in_features), layers)
            cells = [
                (_ms(run(lambda m, x: m.packed_forward(x), layers), args.reps), head_ms),
                (_ms(exact, args.reps), head_ms),
                (_ms(run(lambda m, x: F.linear(x, m.weight), layers), args.reps),
                 _ms(lambda: F.linear(xs[576], hdense), args.reps)),
                (_ms(run(lambda m, x: m.packed_forward(x), int4), args.reps),
                 _ms(lambda: head_i4.packed_forward(xs[576]), args.reps)),
            ]
            print(f"| {rows} | " + " | ".join(f"{a:.1f} + {b:.1f} = {a + b:.1f}" for a, b in cells) + " |",
                  flush=True)
    by_k: dict[int, list[PackedLinear]] = {}
    for m in layers:
        by_k.setdefault(m.in_features, []).append(m)
    found = {k: measure_crossover(group) for k, group in by_k.items()}
    head = ExactHead(torch.nn.Parameter(hdense, requires_grad=False), packed=hw)
    print(f"# crossover (rows up to which the packed path is used): layers by K {found}, head {head.packed_max_rows}; "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
