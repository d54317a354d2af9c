"""treeserve (defaults) vs CPU peers on the embedded SmolLM2-135M-Instruct, same run, same prompts.

Peers (optional ``bench`` extra): llama.cpp (llama-cpp-python on the embedded Q4_1 GGUF),
transformers eager (float32; bf16 left-padded batches for ``uniform``) and CTranslate2 int8
(converted once from the same weights into ``--cache-dir``). A peer that is not installed is
reported as skipped. Greedy, EOS ignored (every system produces exactly the asked tokens),
prefill included, best of ``--reps``. ``treeserve-compiled`` (not in the default ``--systems``) is
``LLM(compile=True)``: the whole decode forward compiled per batch bucket (compile time printed).

Workloads: ``single`` (one chat prompt, 128 new tokens: issue 12), ``uniform`` (64 chat prompts
x 128 new tokens) and ``mixed`` (prompts 32-1024 tokens, outputs 16-512; issue 15).
Run: ``flock /tmp/treeserve-bench.lock python benches/bench_cpu_peers.py --workload single``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from treeserve import LLM, SamplingParams
from treeserve.bench import chat_prompts
from treeserve.models import resolve_model_path

MODEL = "smollm2-135m-instruct"


def _machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"


def _best(fn: Callable[[], int], reps: int) -> tuple[float, int]:
    """(best seconds, tokens generated) over ``reps`` runs of ``fn`` (which returns the token count)."""
    best, tokens = float("inf"), 0
    for _ in range(reps):
        t = time.perf_counter()
        tokens = fn()
        best = min(best, time.perf_counter() - t)
    return best, tokens


class Workload:
    """Token-id prompts and per-request output lengths."""

    def __init__(self, prompts: list[list[int]], outputs: list[int]) -> None:
        self.prompts, self.outputs = prompts, outputs


def make_workload(name: str, llm: LLM, quick: bool) -> Workload:
    tok = llm.tokenizer
    if name == "single":
        text = chat_prompts(llm, 1, seed=3)[0]
        return Workload([tok.encode(text, add_special_tokens=False)], [32 if quick else 128])
    if name == "uniform":
        n = 16 if quick else 64
        texts = chat_prompts(llm, n)
        return Workload([tok.encode(t, add_special_tokens=False) for t in texts], [32 if quick else 128] * n)
    rng = random.Random(15)
    n = 8 if quick else 32
    filler = tok.encode(" ".join(rng.choice("the of and to in is that for it as with".split()) for _ in range(1500)))
    lens = [rng.randint(32, 256 if quick else 1024) for _ in range(n)]
    outs = [rng.randint(16, 64 if quick else 512) for _ in range(n)]
    return Workload([filler[i : i + k] for i, k in enumerate(lens)], outs)


def run_treeserve(w: Workload, threads: int, reps: int, **config: object) -> tuple[float, int]:
    """The default ``LLM`` (plus ``config``); with ``compile=True`` one untimed warm-up run compiles
    every bucket the workload reaches first, and the compile time is printed."""
    t0 = time.perf_counter()
    llm = LLM(MODEL, num_threads=threads, **config)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in w.outputs]

    def go() -> int:
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    if config.get("compile"):
        go()
        forward = llm.runner.decode_graph.forward
        print(f"# treeserve-compiled: start + warm-up {time.perf_counter() - t0:.1f} s, of which compiling "
              f"{forward.compile_seconds:.1f} s ({forward.num_compiles} graphs, static={forward.static})")
    return _best(go, reps)


def run_llama_cpp(w: Workload, threads: int, reps: int) -> tuple[float, int]:
    from llama_cpp import Llama

    llm = Llama(str(resolve_model_path(MODEL)), n_threads=threads, n_ctx=2048, verbose=False, seed=0)

    def go() -> int:
        total = 0
        for prompt, n in zip(w.prompts, w.outputs):
            llm.reset()
            for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
                if i + 1 == n:
                    break
            total += n
        return total

    return _best(go, reps)


def _hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(MODEL)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def run_transformers(w: Workload, threads: int, reps: int) -> tuple[float, int]:
    torch.set_num_threads(threads)
    batched = len(w.prompts) > 1
    model = _hf(torch.bfloat16 if batched else torch.float32)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def go() -> int:
        total = 0
        groups: dict[int, list[list[int]]] = {}
        for p, n in zip(w.prompts, w.outputs):
            groups.setdefault(n, []).append(p)
        for n, prompts in groups.items():
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=pad)
            total += (out.shape[1] - width) * len(prompts)
        return total

    return _best(go, reps)


def run_ctranslate2(w: Workload, threads: int, reps: int, cache: Path) -> tuple[float, int]:
    import ctranslate2

    out_dir = cache / "smollm2-ct2-int8"
    if not (out_dir / "model.bin").is_file():
        hf_dir = cache / "smollm2-hf"
        if not (hf_dir / "config.json").is_file():
            from transformers import AutoTokenizer

            from treeserve.models import load, save_hf_dir

            save_hf_dir(load(MODEL).model, hf_dir)  # the GGUF dequantized, as HF safetensors

            path = resolve_model_path(MODEL)
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(hf_dir)
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out_dir), quantization="int8", force=True)
    gen = ctranslate2.Generator(str(out_dir), device="cpu", compute_type="int8", intra_threads=threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cache / "smollm2-hf"))
    prompts = [tok.convert_ids_to_tokens(p) for p in w.prompts]

    def go() -> int:
        total = 0
        groups: dict[int, list[list[str]]] = {}
        for p, n in zip(prompts, w.outputs):
            groups.setdefault(n, []).append(p)
        for n, batch in groups.items():
            res = gen.generate_batch(batch, max_length=n, min_length=n, sampling_topk=1,
                                     include_prompt_in_result=False, end_token=[])
            total += sum(len(r.sequences_ids[0]) for r in res)
        return total

    return _best(go, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", choices=["single", "uniform", "mixed"], default="single")
    ap.add_argument("--quick", action="store_true", help="fewer/shorter requests, 2 reps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", default="treeserve,llama.cpp,transformers,ctranslate2")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "treeserve-bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reps = 2 if args.quick else args.reps
    w = make_workload(args.workload, LLM(MODEL, kv_cache_tokens=64), args.quick)
    print(f"# {args.workload}: {len(w.prompts)} prompts ({sum(map(len, w.prompts))} tokens), "
          f"{sum(w.outputs)} new tokens, {args.threads} threads, best of {reps}; {_machine()}")
    runners = {
        "treeserve": run_treeserve,
        "treeserve-compiled": lambda w, t, r: run_treeserve(w, t, r, compile=True),
        "llama.cpp": run_llama_cpp,
        "transformers": run_transformers,
        "ctranslate2": lambda w, t, r: run_ctranslate2(w, t, r, args.cache_dir),
    }
    needs = {"llama.cpp": "llama_cpp", "transformers": "transformers", "ctranslate2": "ctranslate2"}
    rates: dict[str, float] = {}
    for name in args.systems.split(","):
        if name in needs and importlib.util.find_spec(needs[name]) is None:
            print(f"| {name} | skipped: {needs[name]} not installed (pip install 'treeserve[bench]') |")
            continue
        seconds, tokens = runners[name](w, args.threads, reps)
        rates[name] = tokens / seconds
        print(f"| {name} | {tokens} tok | {seconds:.2f} s | {rates[name]:.1f} tok/s | load {os.getloadavg()[0]:.2f} |",
              flush=True)
    if "treeserve" in rates:
        for peer, rate in rates.items():
            if peer != "treeserve":
                print(f"treeserve / {peer}: {rates['treeserve'] / rate:.2f}x")


if __name__ == "__main__":
    main()
