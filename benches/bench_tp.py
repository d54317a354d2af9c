"""Tensor parallelism (issue 14): time per engine step spent in collectives at N = 1, 2, 3 on CPU.

On CPU the ranks share the cores, so a speed-up is not the point: this reports, per engine step
on rank 0 (fastest of ``--reps`` runs), the wall time, the time inside the model collectives (the all-reduces after o_proj /
down_proj / the embedding and the LM head's gather) and inside the step broadcast (header +
payload of the step inputs), and checks that every N gives N=1's greedy tokens. Rank 0's
collective time includes waiting for the slowest rank (contention shows up there).

The model is synthetic with SmolLM2-135M's widths (hidden 576, intermediate 1536, vocab 49152)
but 12 query / 6 KV heads so that 2 and 3 both divide them; ``--quick`` keeps 6 of the 30 layers.
Run under the bench lock: ``flock /tmp/treeserve-bench.lock python benches/bench_tp.py --quick``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from treeserve import LLM, SamplingParams
from treeserve._cpu import cpu_features
from treeserve.models import random_model, tiny_config


def measure(llm: LLM, prompts: list[list[int]], new: int, reps: int) -> tuple[list[list[int]], dict[str, float]]:
    """Greedy tokens and per-step milliseconds of the fastest of ``reps`` runs."""
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2), use_tqdm=False)  # warm-up
    runs = [_run(llm, prompts, new) for _ in range(reps)]
    return runs[0][0], min((ms for _, ms in runs), key=lambda ms: ms["step"])


def _run(llm: LLM, prompts: list[list[int]], new: int) -> tuple[list[list[int]], dict[str, float]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    comm = getattr(llm.model, "comm", None)
    c0 = (comm.collective_seconds, comm.broadcast_seconds) if comm else (0.0, 0.0)
    s0 = llm.metrics.steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = llm.metrics.steps - s0
    c1 = (comm.collective_seconds, comm.broadcast_seconds) if comm else (0.0, 0.0)
    ms = {"step": wall / steps * 1e3, "collective": (c1[0] - c0[0]) / steps * 1e3,
          "broadcast": (c1[1] - c0[1]) / steps * 1e3, "steps": steps}  # fmt: skip
    return [o.outputs[0].token_ids for o in outs], ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="6 layers, batch 4 x 16 new tokens")
    ap.add_argument("--sizes", default="1,2,3")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cuda: N GPUs from cuda:0 on (NCCL)")
    args = ap.parse_args()
    layers, batch, new = (6, 4, 16) if args.quick else (30, 8, 32)
    cfg = tiny_config(
        "llama", num_layers=layers, hidden_size=576, intermediate_size=1536, num_heads=12, num_kv_heads=6,
        head_dim=48, vocab_size=49152, max_position_embeddings=1024, eos_token_ids=(2,),
    )  # fmt: skip
    model = random_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (32,), generator=gen).tolist() for _ in range(batch)]
    f = cpu_features()
    print(f"CPU: {f.model_name} ({platform.machine()}, {os.cpu_count()} logical cores), torch threads "
          f"{torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    print(f"model: {layers} layers, hidden 576, 12/6 heads, vocab 49152, float32; batch {batch} x 32 prompt + {new} new")
    print(f"{'N':>2} {'steps':>5} {'ms/step':>8} {'all-reduce+gather':>18} {'broadcast':>10} {'same tokens':>12}")
    want = None
    for n in (int(x) for x in args.sizes.split(",")):
        llm = LLM((model.to(args.device), None), dtype="float32", device=args.device, tensor_parallel_size=n, kv_cache_tokens=batch * (32 + new) + 64,
                  max_batched_tokens=256, enable_prefix_cache=False)  # fmt: skip
        tokens, ms = measure(llm, prompts, new, args.reps)
        want = want or tokens
        print(f"{n:>2} {ms['steps']:>5} {ms['step']:>8.2f} {ms['collective']:>15.2f} ms {ms['broadcast']:>7.2f} ms "
              f"{str(tokens == want):>12}")  # fmt: skip
        llm.close()
    print(f"load avg after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
