"""End-to-end GPU figures on random weights of real shapes (no checkpoint, no download).

    python benches/gpu_e2e.py decode  --shape smollm2|llama3-8b [--modes eager,graph,compile] [--sampled]
    python benches/gpu_e2e.py prefill --shape llama3-8b
    python benches/gpu_e2e.py phases  --shape smollm2|llama3-8b [--batch 1]
    python benches/gpu_e2e.py kernels --shape smollm2|llama3-8b [--batch 1]
    (add --quick --device cpu for a smoke run of the script itself on a machine without CUDA)

- ``decode``: ms per decode step and tok/s at batch 1..256, per mode (``eager``: no CUDA graph;
  ``graph``: the captured decode graphs; ``compile``: ``torch.compile`` inside them). A step's time
  is isolated as (generate LONG new tokens - generate SHORT) / (LONG - SHORT), so prefill cancels;
  each figure is the roofline fraction too: every weight plus every request's KV read once at the
  copy bandwidth measured in the same run.
- ``prefill``: prompt tokens per second for 1 x 2048 and 16 x 512, against the bf16 matmul peak
  measured in the same run (2 FLOPs per weight per token, attention excluded).
- ``kernels``: the fused step (issue 28) against the torch path (``layer_kernels``): kernels per
  decode step and per layer (torch profiler: CUDA kernels of generating LONG minus SHORT tokens,
  per token; per layer from the model against its half-depth ``truncated_copy``), the graph's GPU
  time per replay (CUDA events), and the LM head alone: the float32 head against the bf16 exact
  head (``TritonHead``), ms per call at 1 and 64 rows and how often their argmaxes agree.
- ``phases``: one decode step's wall time against the GPU time of the graph replay (CUDA events),
  with the host phases (schedule, input load, token read, update) timed around the engine's own
  methods.

The model is ``LlamaForCausalLM`` built by ``treeserve.models.weights.build_model`` from tensors
drawn on the device (N(0, 0.02), norms 1), in bfloat16 with the float32 LM head as loaded models have.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from treeserve import LLM, SamplingParams
from treeserve.models.config import ModelConfig
from treeserve.models.weights import build_model, expected_hf_shapes

SHAPES = {
    "smollm2": dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=256, tie_word_embeddings=False, rope_theta=10000.0),
}


def make_model(shape: str, device: str) -> torch.nn.Module:
    cfg = ModelConfig(architecture="llama", max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_ids=(2,), **SHAPES[shape])  # type: ignore[arg-type]
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = expected_hf_shapes(cfg)

    def get(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], device=device, dtype=torch.bfloat16)
        return torch.randn(shapes[name], device=device, generator=gen, dtype=torch.bfloat16) * 0.02

    return build_model(cfg, get, shapes, dtype=torch.bfloat16, device=device)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    n = 1 << (30 if device == "cuda" else 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / best_seconds(lambda: dst.copy_(src), device)


def matmul_peak(device: str) -> float:
    """bf16 FLOP/s of a large square matmul."""
    n = 8192 if device == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / best_seconds(lambda: a @ a, device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_seconds(fn: Callable[[], object], device: str, reps: int = 5) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def engine(model: torch.nn.Module, device: str, mode: str, max_batch: int, ctx: int) -> LLM:
    """``mode``: graph (the default: CUDA graphs with overlap), sync (graphs, no overlap), eager, compile."""
    return LLM((model, None), device=device, cuda_graph=mode != "eager", compile=mode == "compile",
               overlap=False if mode == "sync" else None,
               cuda_graph_max_batch=max(8, max_batch), max_running=max_batch, max_batched_tokens=max(2048, ctx),
               kv_cache_tokens=max_batch * ctx + 64, max_model_len=ctx, page_size=16, enable_prefix_cache=False,
               seed=0)


def generate_seconds(llm: LLM, batch: int, prompt: int, new: int, device: str, sampled: bool = False) -> float:
    """Seconds to generate ``new`` tokens for ``batch`` random prompts: greedy, or (``sampled``) a
    chat server's usual temperature 0.7 / top-p 0.9 / top-k 50, seeded per request."""
    rng = random.Random(batch * 1000 + prompt)
    vocab = llm.model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(batch)]
    if sampled:
        params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=i, max_new_tokens=new, ignore_eos=True)
                  for i in range(batch)]
    else:
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - t0


def roofline_bytes(model: torch.nn.Module, batch: int, ctx: int) -> int:
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * batch * ctx  # bf16 K and V
    return weights + kv


def decode(args: argparse.Namespace) -> None:
    batches = (1, 2) if args.quick else (1, 4, 16, 64, 128, 256)
    prompt, short, long_ = (8, 2, 6) if args.quick else (128, 8, 40)
    model = make_model(args.shape, args.device)
    bw = copy_bandwidth(args.device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; weights {roofline_bytes(model, 0, 0) / 1e9:.2f} GB")
    print(f"{'mode':8} {'batch':>5} {'ms/step':>8} {'tok/s':>9} {'roofline':>9}")
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        llm = engine(model, args.device, mode, max(batches), prompt + long_ + 8)
        generate_seconds(llm, 2, prompt, short, args.device, args.sampled)  # warm-up (and compile)
        print(f"# {mode}{' sampled' if args.sampled else ''}: engine + warm-up {time.perf_counter() - t0:.1f} s",
              flush=True)
        for b in batches:
            # best of 3 each: the difference of two single runs can even come out negative on a busy host
            step = (min(generate_seconds(llm, b, prompt, long_, args.device, args.sampled) for _ in range(3))
                    - min(generate_seconds(llm, b, prompt, short, args.device, args.sampled) for _ in range(3))
                    ) / (long_ - short)
            ideal = roofline_bytes(model, b, prompt + (short + long_) // 2) / bw
            print(f"{mode:8} {b:5} {step * 1e3:8.2f} {b / step:9.0f} {100 * ideal / step:8.1f}%", flush=True)
        del llm


def prefill(args: argparse.Namespace) -> None:
    model = make_model(args.shape, args.device)
    peak = matmul_peak(args.device)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    llm = engine(model, args.device, "eager", 16, 2100)
    print(f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; {params / 1e9:.2f} B matmul parameters")
    for b, n in ((1, 64), (2, 32)) if args.quick else ((1, 2048), (16, 512)):
        generate_seconds(llm, b, n, 1, args.device)
        s = min(generate_seconds(llm, b, n, 1, args.device) for _ in range(3))
        print(f"prefill {b} x {n}: {b * n / s:9.0f} tok/s, {100 * 2 * params * b * n / s / peak:5.1f}% of the peak")


class PhaseTimer:
    """Wraps bound methods of the engine's parts and accumulates their wall time per name."""

    def __init__(self) -> None:
        self.host: dict[str, float] = defaultdict(float)
        self.gpu: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.host[name] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def wrap_replay(self) -> Callable[[], None]:
        """Times every ``CUDAGraph.replay`` on the GPU with events; returns the undo."""
        original = torch.cuda.CUDAGraph.replay

        def replay(graph: torch.cuda.CUDAGraph) -> None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            original(graph)
            end.record()
            self.gpu.append((start, end))

        torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
        return lambda: setattr(torch.cuda.CUDAGraph, "replay", original)


def phases(args: argparse.Namespace) -> None:
    model = make_model(args.shape, args.device)
    llm = engine(model, args.device, "graph", max(args.batch, 8), 512)
    generate_seconds(llm, args.batch, 64, 8, args.device)  # warm-up
    timer = PhaseTimer()
    steps_before = llm.metrics.steps
    timer.wrap(llm.scheduler, "schedule", "schedule")
    timer.wrap(llm.scheduler, "update", "update (token read, stops)")
    graph = llm.runner.decode_graph
    if graph is not None:
        timer.wrap(graph, "_load", "input load (_load)")
    undo = timer.wrap_replay() if args.device == "cuda" else (lambda: None)
    new = 8 if args.quick else 129
    wall = generate_seconds(llm, args.batch, 64, new, args.device)
    undo()
    steps = llm.metrics.steps - steps_before
    gpu = sum(s.elapsed_time(e) for s, e in timer.gpu) / 1e3 if timer.gpu else float("nan")
    replays = max(len(timer.gpu), 1)
    print(f"{args.shape} batch {args.batch}: {steps} steps, wall {wall / steps * 1e3:.3f} ms/step "
          f"(prefill included), graph GPU time {gpu / replays * 1e3:.3f} ms/replay over {len(timer.gpu)} replays")
    for name, secs in sorted(timer.host.items(), key=lambda kv: -kv[1]):
        print(f"  host {name:28} {secs / steps * 1e3:7.3f} ms/step")


def profiled_kernels(llm: LLM, batch: int, new: int, device: str) -> int:
    """Kernels launched while generating ``new`` tokens for ``batch`` prompts of 64 tokens (CUDA:
    device kernels, copies and fills excluded; CPU smoke runs: top-level aten operators)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        generate_seconds(llm, batch, 64, new, device)
    events = prof.events()
    if device == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset")))
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def event_ms(fn: Callable[[], object], device: str, reps: int = 20) -> float:
    """Median ms per call (CUDA events on CUDA, the wall clock elsewhere)."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def kernels(args: argparse.Namespace) -> None:
    from treeserve.models.llama import truncated_copy
    from treeserve.models.triton_forward import TritonHead

    model = make_model(args.shape, args.device)
    layers = model.config.num_layers
    half = truncated_copy(model, max(1, layers // 2))
    short, long_ = (2, 4) if args.quick else (4, 20)
    print(f"{args.shape} batch {args.batch}, graph mode: kernels per decode step (LONG - SHORT tokens)")
    print(f"{'path':7} {'kernels/step':>12} {'kernels/layer':>13} {'GPU ms/replay':>14}")
    # (A CPU smoke run skips the fused path: the interpreter would take minutes over an engine's steps.)
    for path in ("torch",) if args.device == "cpu" else ("triton", "torch"):
        per_step = {}
        gpu_ms = float("nan")
        for name, m in (("full", model), ("half", half)):
            m.layer_kernels = path
            llm = engine(m, args.device, "graph", max(args.batch, 8), 256)
            generate_seconds(llm, args.batch, 64, short, args.device)  # warm-up
            per_step[name] = (profiled_kernels(llm, args.batch, long_, args.device)
                              - profiled_kernels(llm, args.batch, short, args.device)) / (long_ - short)
            if name == "full" and args.device == "cuda":
                timer = PhaseTimer()
                undo = timer.wrap_replay()
                generate_seconds(llm, args.batch, 64, long_, args.device)
                undo()
                gpu_ms = sum(s.elapsed_time(e) for s, e in timer.gpu) / max(len(timer.gpu), 1)
            del llm
        per_layer = (per_step["full"] - per_step["half"]) / (layers - half.config.num_layers)
        print(f"{path:7} {per_step['full']:12.1f} {per_layer:13.2f} {gpu_ms:14.3f}", flush=True)
    model.layer_kernels = "auto"
    weight = model.lm_head.weight
    triton_ok = args.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    head = TritonHead.of(weight, bf16_min_rows=1) if triton_ok else None  # the bf16 pass at every row count
    chosen = TritonHead.of(weight) if triton_ok else None  # the default: measured on a GPU
    print(f"LM head {tuple(weight.shape)}: float32 vs bf16 exact (TritonHead)"
          + (f"; the default takes the bf16 pass from {chosen.bf16_min_rows} rows" if chosen is not None else ""))
    for rows in (1, 2) if args.quick else (1, 64):
        x = torch.randn(rows, weight.shape[1], device=args.device, dtype=torch.bfloat16)
        f32 = event_ms(lambda: torch.nn.functional.linear(x.float(), weight), args.device)
        line = f"  rows {rows:3}: float32 {f32:8.3f} ms"
        if head is not None:
            ms = event_ms(lambda: head(x), args.device, reps=3 if args.quick else 20)
            same = bool(torch.equal(head(x).argmax(1), torch.nn.functional.linear(x.float(), weight).argmax(1)))
            line += f", bf16 exact {ms:8.3f} ms ({f32 / ms:.2f}x), same argmax: {same}"
        print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("decode", "prefill", "phases", "kernels"))
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="graph,eager,compile")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sampled", action="store_true", help="decode: temperature 0.7, top-p 0.9, top-k 50 (else greedy)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of the script")
    args = p.parse_args()
    {"decode": decode, "prefill": prefill, "phases": phases, "kernels": kernels}[args.what](args)


if __name__ == "__main__":
    main()
