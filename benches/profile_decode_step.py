"""Issue 15: where one batched decode step goes on CPU: decoder layers (GEMMs, attention, norms,
or the fused C++ decode operator as one part), LM head, sampling, the rest, for the embedded
SmolLM2-135M (or ``--model``) at batch 64 x context 128 (page size 1, the engine default), in the default
configuration (the GGUF as shipped, ``quantization="auto"``) unless ``--quantization none``.

Each category is timed by wrapping its entry point with ``perf_counter``: ``gemm`` every
projection (``PackedLinear.forward`` and ``F.linear``; a timed call inside another counts for the outer one), ``head``
the LM head module (``ExactHead``: its first pass and re-scoring), ``attention`` the model's
``paged_attention`` + ``store_kv``, ``norm`` its residual-add + RMSNorm, ``fused layers`` the C++
operator running every decoder layer of a decode step (then the three before it read 0),
``sampling`` ``sample``; "rest" is the step's wall time minus the categories (RoPE, SiLU-mul,
embedding, adds, Python). ``--torch-table`` also prints ``torch.profiler``'s top ops of one step.
Best of ``--reps`` steps after warm-up; CPU model and load printed. Run under the bench lock:
``flock /tmp/treeserve-bench.lock python benches/profile_decode_step.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import treeserve.models.llama as llama
from treeserve.engine import EngineConfig
from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.models import load
from treeserve.models.quant import PackedLinear
from treeserve.sampling import SamplingBatch, SamplingParams, sample

MODEL = "smollm2-135m-instruct"
SPENT: dict[str, float] = defaultdict(float)


_OPEN: set[str] = set()  # the category being timed now: a call nested in it counts as part of it


def _timed(category: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if _OPEN:
            return fn(*args, **kwargs)
        _OPEN.add(category)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[category] += time.perf_counter() - t
            _OPEN.discard(category)

    return wrapper


def _instrument(model: torch.nn.Module) -> None:
    """Route the model's entry points through the timers (this process only)."""
    F.linear = _timed("gemm", F.linear)
    PackedLinear.forward = _timed("gemm", PackedLinear.forward)
    model.lm_head.forward = _timed("head", model.lm_head.forward)
    llama.paged_attention = _timed("attention", llama.paged_attention)
    llama.store_kv = _timed("attention", llama.store_kv)
    llama.add_rms_norm = _timed("norm", llama.add_rms_norm)
    llama.run_decode_layers = _timed("fused layers", llama.run_decode_layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=MODEL, help="a registry name or a model path (a GGUF file: e.g. "
                    "benches/bench_real_size.py --keep's synthetic one)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--quantization", default="auto", help="load()'s quantization ('none': dense)")
    ap.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="KV cache dtype (auto: what LLM() picks for this dtype and quantization on this CPU)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sampling", choices=["greedy", "top_p"], default="greedy")
    ap.add_argument("--torch-table", action="store_true")
    ap.add_argument("--no-fused", action="store_true", help="run the decoder layers in Python even where the "
                    "fused C++ decode operator (issue 12) would serve the step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    quantization = None if args.quantization == "none" else args.quantization
    model = load(args.model, dtype=dtype, quantization=quantization).model
    if args.no_fused:
        model._decode_plan = None
    fused = getattr(model, "decode_plan", lambda: None)() is not None
    cfg = model.config
    b, ctx = args.batch, args.context
    kv_dtype = EngineConfig(quantization=quantization, kv_cache_dtype=args.kv_dtype).kv_dtype(dtype, loaded=True)
    kv = KVPool(cfg.num_layers, 1 + b * (ctx + 1), 1, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype)
    gen = torch.Generator().manual_seed(0)
    for k, v in zip(kv.k_caches, kv.v_caches):
        k.copy_(torch.randn(k.shape, generator=gen) * 0.5)
        v.copy_(torch.randn(v.shape, generator=gen) * 0.5)
    perm = (torch.randperm(b * (ctx + 1), generator=gen) + 1).tolist()
    pages = [perm[i * (ctx + 1) : (i + 1) * (ctx + 1)] for i in range(b)]
    meta = AttentionMetadata.build([1] * b, [ctx + 1] * b, pages, 1)
    ids = torch.randint(0, cfg.vocab_size, (b,), generator=gen)
    positions = torch.full((b,), ctx, dtype=torch.int64)
    out_slots = torch.tensor([p[-1] for p in pages])
    rows = torch.arange(b)
    params = SamplingParams(temperature=0.0) if args.sampling == "greedy" else SamplingParams(temperature=0.8, top_p=0.9)
    batch = SamplingBatch.build([params] * b, list(range(b)), [[]] * b, cfg.vocab_size)
    timed_sample = _timed("sampling", sample)

    def step() -> None:
        with torch.no_grad():
            logits = model(ids, positions, kv, out_slots, meta, rows)
            timed_sample(logits, batch, positions)

    _instrument(model)
    step()
    best: tuple[float, dict[str, float]] = (float("inf"), {})
    for _ in range(args.reps):
        SPENT.clear()
        t = time.perf_counter()
        step()
        wall = time.perf_counter() - t
        if wall < best[0]:
            best = (wall, dict(SPENT))
    wall, spent = best
    spent["rest"] = wall - sum(spent.values())
    model_name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                       if ln.startswith("model name")), "unknown CPU")
    print(f"# decode step, batch {b} x context {ctx}, {args.dtype}, KV {str(kv_dtype)[6:]}, quantization {args.quantization}, "
          f"{args.sampling}, {args.threads} threads, fused layers {fused}; {model_name}, load {os.getloadavg()[0]:.2f}")
    print(f"| step | {wall * 1e3:.1f} ms | {b / wall:.0f} tok/s |")
    for name in ("fused layers", "gemm", "attention", "norm", "head", "sampling", "rest"):
        print(f"| {name} | {spent.get(name, 0.0) * 1e3:.1f} ms | {100 * spent.get(name, 0.0) / wall:.0f}% |")
    if args.torch_table:
        from torch.profiler import profile

        with profile() as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
