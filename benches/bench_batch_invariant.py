"""Cost of ``batch_invariant=True`` (issue 16 item 5): decode tok/s with and without, same run.

Runs the embedded SmolLM2 in the default dtype of the machine and in bfloat16, at batch 1 and a
larger batch, greedy, fixed token counts; prints the tok/s of each mode and the ratio. Run:
``python benches/bench_batch_invariant.py [--batch 64] [--new 32] [--reps 2]``.
"""

from __future__ import annotations

import argparse
import platform

from _timing import min_seconds

from treeserve import LLM, SamplingParams
from treeserve._cpu import cpu_features


def tok_per_s(llm: LLM, batch: int, new: int, reps: int) -> float:
    prompts = [f"Question {i}: name a prime number larger than {10 * i}." for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=2), use_tqdm=False)  # warm-up
    seconds = min_seconds(lambda: llm.generate(prompts, params, use_tqdm=False), reps)
    return batch * new / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    f = cpu_features()
    print(f"CPU: {f.model_name} ({platform.machine()}, torch ISA {f.torch_capability}, fast bf16 {f.fast_bf16})")
    for dtype in ("auto", "bfloat16"):
        for batch in (1, args.batch):
            rates = {}
            for invariant in (False, True):
                llm = LLM(dtype=dtype, batch_invariant=invariant, enable_prefix_cache=False)
                rates[invariant] = tok_per_s(llm, batch, args.new, args.reps)
                del llm
            print(
                f"dtype={dtype:8s} batch={batch:3d}  default {rates[False]:7.1f} tok/s"
                f"  batch_invariant {rates[True]:7.1f} tok/s  ratio {rates[True] / rates[False]:.2f}"
            )


if __name__ == "__main__":
    main()
