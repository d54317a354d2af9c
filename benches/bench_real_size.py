"""Real-size models on CPU (issue 33): a synthetic GGUF of a real architecture, loaded and decoded.

Writes ``treeserve.models.synthetic_gguf`` (default: Llama-3-8B shapes in Q4_0, ~4.3 GiB) to a
temporary file, then, each in a fresh process (so resident memory is that load's alone):

- ``LLM(path)`` with a new, empty measurement cache (cold: every load-time measurement taken) and
  again with that cache (warm), for each configuration:
  - ``default``: what ``LLM()`` does (packed codes for small batches, the int8 tier for large
    ones where it measures faster, float32 embedding and head);
  - ``lean``: ``TREESERVE_PACKED_MAX_ROWS=all`` (the GGUF operator serves every batch: no int8
    copy, no dense weight), the least memory;
  - ``codes``: ``TREESERVE_LARGE_TIER_BYTES=0`` (what a model over the large-tier budget gets, as
    8B on 24 GB: the codes serve every batch, large ones with int8 activations where measured
    faster), the least memory with the large batches' kernel;
- resident memory after ``LLM()`` (``VmRSS``: anonymous + the mapped file's pages) and the peak
  (``VmHWM``) against the file size;
- with the warm cache (no speculation): single-stream greedy decode tok/s (the best of ``SINGLE_ROUNDS`` calls,
  each on a new prompt, as llama.cpp's) and a batch of 16 x 64 tokens (token-id
  prompts of 8, none seen before by the engine: the rates include the prompt steps, as llama.cpp's do; until
  2026-12-06 04:50 the measured calls reused the warm-up's prompts, whose KV the radix cache kept, so the
  batch figures left out ~4 s of prompt step at 8B), after a first batch of 16 x 2 tokens whose
  time (``first_batch_s``) includes building the large batches' weights (read from the disk
  cache of int8 copies on a warm start).

llama-cpp-python on the same file in the same run when it is installed (``--peer``: load, memory,
single stream, and the batch both as that many streams one after another and batched in one
context, one ``llama_decode`` per step as llama-server does; the faster is the peer's figure). The file is
deleted at the end unless ``--keep``. Run under ``flock /work/bench.lock`` where others benchmark.

An AVX2-only host (the Zen 3 EPYC's instruction set) on an AVX-512 one: ``--as-avx2`` runs treeserve's
processes under ``benches/as_avx2.py``, and ``--peer-path DIR`` puts a llama-cpp-python built for such a
host first on the peer's ``PYTHONPATH`` (built as in benches/RESULTS.md, "AVX2 hosts: one broadcast of the
codes for two lane groups").

    python benches/bench_real_size.py [--spec llama-3-8b] [--qtype Q4_0] [--configs lean,default]
        [--peer [--peer-path DIR]] [--as-avx2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_LEN = 8
SINGLE_ROUNDS = 3  # the single stream's rate is the best of this many calls on each side (since 2026-12-06 07:40)


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(path: str, threads: int, single_tokens: int, batch: int, batch_tokens: int) -> dict[str, float]:
    """One fresh process: load, memory, decode speed unless ``single_tokens`` is 0 (one JSON line)."""
    import torch

    from treeserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    t = time.perf_counter()
    # No speculation: a model of random weights repeats itself, which n-gram drafts would exploit
    # and real text would not; this measures the decode itself (llama.cpp drafts nothing either).
    llm = LLM(path, num_threads=threads, kv_cache_tokens=batch * (PROMPT_LEN + batch_tokens) + 256,
              max_model_len=PROMPT_LEN + max(single_tokens, batch_tokens) + 8, speculative=None)
    out: dict[str, float] = {"load_s": time.perf_counter() - t, "rss_mb": _status_mb("VmRSS"),
                             "anon_mb": _status_mb("RssAnon"), "file_mb": _status_mb("RssFile"),
                             "peak_mb": _status_mb("VmHWM")}
    if not single_tokens:
        return out
    vocab = llm.tokenizer.vocab_size

    def prompts(salt: int) -> list[list[int]]:
        """``batch`` token-id prompts; another ``salt``, other first tokens: no prefix in the radix cache
        from an earlier call, so every measured rate includes its prompt step, as llama.cpp's does."""
        return [[(7 * i + 13 * j + 1009 * salt) % (vocab - 300) + 257 for j in range(PROMPT_LEN)] for i in range(batch)]

    def tok_s(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)

    tok_s(prompts(1)[:1], 4)  # warm-up
    out["single_tok_s"] = max(tok_s(prompts(10 + r)[:1], single_tokens) for r in range(SINGLE_ROUNDS))
    t = time.perf_counter()
    tok_s(prompts(2), 2)  # the first large batch builds the large-batch weights (``PackedLinear.prepare_large``)
    out["first_batch_s"] = time.perf_counter() - t
    out[f"batch{batch}_tok_s"] = tok_s(prompts(3), batch_tokens)
    out["rss_after_decode_mb"] = _status_mb("VmRSS")
    return out


def batched_tok_s(model: object, threads: int, prompts: list[list[int]], tokens: int) -> float:
    """llama.cpp decoding ``prompts`` together, as llama-server's continuous batching does: one
    ``llama_decode`` per step over every sequence (the prompts in one call, then one token each),
    greedy (argmax of each row's logits), ``tokens`` new tokens per sequence; tok/s, prompts included.
    ``model``: a loaded ``llama_model`` pointer (a second context on the same weights)."""
    import llama_cpp as lc
    import numpy as np

    n = len(prompts)
    params = lc.llama_context_default_params()
    params.n_seq_max = n
    params.n_ctx = n * (PROMPT_LEN + tokens + 8)
    params.n_batch = params.n_ubatch = max(512, n * PROMPT_LEN)
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    try:
        t = time.perf_counter()
        step = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for _ in range(tokens):
            batch.n_tokens = len(step)
            outputs = []
            for i, (tok, pos, seq, out) in enumerate(step):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
                batch.seq_id[i][0] = seq
                if out:
                    outputs.append((i, pos, seq))
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            step = [(int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax()), pos + 1, seq, True)
                    for i, pos, seq in outputs]
        return n * tokens / (time.perf_counter() - t)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)


def peer(path: str, threads: int, single_tokens: int, batch: int, batch_tokens: int) -> dict[str, float]:
    """llama-cpp-python on the same file: load time, resident memory, single-stream tok/s, and
    ``batch`` requests of ``batch_tokens`` both as streams one after another (``Llama.generate``)
    and batched (``batched_tok_s``: llama-server's way); ``batch<N>_tok_s`` is the faster."""
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(path, n_threads=threads, n_ctx=PROMPT_LEN + max(single_tokens, batch_tokens) + 8, verbose=False)
    out = {"load_s": time.perf_counter() - t, "rss_mb": _status_mb("VmRSS"), "peak_mb": _status_mb("VmHWM")}
    prompts = [[(7 * i + 13 * j) % 100000 + 257 for j in range(PROMPT_LEN)] for i in range(batch)]

    def tok_s(todo: list[list[int]], tokens: int) -> float:
        t = time.perf_counter()
        for prompt in todo:
            llm.reset()
            for n, _ in enumerate(llm.generate(prompt, top_k=1), 1):  # endless: stop after tokens
                if n == tokens:
                    break
        return len(todo) * tokens / (time.perf_counter() - t)

    out["single_tok_s"] = max(tok_s([prompts[r % len(prompts)]], single_tokens) for r in range(SINGLE_ROUNDS))
    out[f"batch{batch}_streams_tok_s"] = tok_s(prompts, batch_tokens)
    out[f"batch{batch}_batched_tok_s"] = batched_tok_s(llm._model.model, threads, prompts, batch_tokens)
    out[f"batch{batch}_tok_s"] = max(out[f"batch{batch}_streams_tok_s"], out[f"batch{batch}_batched_tok_s"])
    out["rss_after_decode_mb"] = _status_mb("VmRSS")
    return out


AS_AVX2 = Path(__file__).with_name("as_avx2.py")


def run_child(args: argparse.Namespace, path: Path, env: dict[str, str], which: str, decode: bool) -> dict[str, float]:
    runner = [sys.executable, str(AS_AVX2)] if which == "treeserve" and args.as_avx2 else [sys.executable]
    cmd = [*runner, __file__, "--child", which, "--path", str(path), "--threads", str(args.threads),
           "--single-tokens", str(args.single_tokens if decode else 0), "--batch", str(args.batch),
           "--batch-tokens", str(args.batch_tokens)]
    if which == "llama.cpp" and args.peer_path:
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, (args.peer_path, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


CONFIGS = {"default": {}, "lean": {"TREESERVE_PACKED_MAX_ROWS": "all"}, "codes": {"TREESERVE_LARGE_TIER_BYTES": "0"}}


def table(args: argparse.Namespace, path: Path) -> dict[str, dict[str, float]]:
    """Each configuration of ``args.configs`` loaded cold and warm (fresh processes, one new
    measurement cache per configuration, or ``args.cache``'s, then warm only when it is filled),
    then the peer when ``args.peer``: printed, and returned by ``"<config> <start>"`` / ``"llama.cpp"``."""
    from treeserve._cpu import cpu_features

    size_mb = path.stat().st_size / 2**20
    print(f"{path.name}: {size_mb:.0f} MiB; CPU {cpu_features().model_name} ({cpu_features().torch_capability}"
          f"{'; treeserve as an AVX2 host' if args.as_avx2 else ''}), {args.threads} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows: dict[str, dict[str, float]] = {}
    for config in args.configs.split(","):
        with contextlib.ExitStack() as stack:
            if args.cache:  # an AVX2 host's measurements apart from this host's own
                cache = os.path.join(args.cache, config + ("-avx2" if args.as_avx2 else ""))
                os.makedirs(cache, exist_ok=True)
                starts = ("warm",) if os.listdir(cache) else ("cold", "warm")
            else:
                cache, starts = stack.enter_context(tempfile.TemporaryDirectory(prefix="treeserve-bench-cache-")), ("cold", "warm")
            env = {**CONFIGS[config], "TREESERVE_CACHE_DIR": cache}
            for start in starts:
                r = rows[f"{config} {start}"] = run_child(args, path, env, "treeserve", decode=start == "warm")
                extra = f" (rss {r['rss_mb'] / size_mb:.2f}x file, peak {r['peak_mb'] / size_mb:.2f}x)" if "rss_mb" in r else ""
                print(f"  {config:8s} {start}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})}{extra}",
                      flush=True)
    if args.peer:
        r = rows["llama.cpp"] = run_child(args, path, {}, "llama.cpp", decode=True)
        print(f"  llama.cpp: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})}")
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="llama-3-8b")
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--configs", default="lean,default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--single-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--path", default=None, help="the GGUF file (written when missing)")
    ap.add_argument("--keep", action="store_true", help="keep the written file")
    ap.add_argument("--cache", default=None, help="keep the measurement caches in DIR/<config> (default: a new "
                    "temporary one per run); a configuration whose cache is there already runs warm only")
    ap.add_argument("--peer", action="store_true", help="also llama-cpp-python on the same file")
    ap.add_argument("--peer-path", default=None, help="a folder holding another llama-cpp-python build (pip "
                    "--target), first on the peer's PYTHONPATH")
    ap.add_argument("--as-avx2", action="store_true", help="treeserve's processes as an AVX2-only host would run "
                    "(benches/as_avx2.py)")
    ap.add_argument("--child", choices=("treeserve", "llama.cpp"), help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.peer_path and not args.peer:
        ap.error("--peer-path needs --peer")
    if args.peer_path and not (Path(args.peer_path) / "llama_cpp").is_dir():  # else the installed one would run
        ap.error(f"--peer-path {args.peer_path!r} holds no llama_cpp package")
    if args.child == "treeserve":
        print(json.dumps(child(args.path, args.threads, args.single_tokens, args.batch, args.batch_tokens)))
        return
    if args.child == "llama.cpp":
        print(json.dumps(peer(args.path, args.threads, args.single_tokens, args.batch, args.batch_tokens)))
        return

    from treeserve.models.synthetic_gguf import write_synthetic_gguf

    path = Path(args.path or Path(tempfile.gettempdir()) / f"treeserve-{args.spec}-{args.qtype}.gguf")
    written = not path.exists()
    try:
        if written:
            t = time.perf_counter()
            write_synthetic_gguf(path, args.spec, args.qtype, seed=0)
            print(f"wrote {path} in {time.perf_counter() - t:.1f} s")
        table(args, path)
    finally:
        if written and not args.keep:
            path.unlink(missing_ok=True)


def test_llama_3_2_1b_table(benchmark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``make bench``: the table for Llama-3.2-1B shapes in Q4_0 (0.7 GB, written here), the lean
    configuration (the GGUF operator for every batch), 8 tokens single stream and 16 x 8 batched;
    llama-cpp-python on the same file in the same run where it is installed."""
    import importlib.util

    from treeserve.models.synthetic_gguf import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "llama-3.2-1b-Q4_0.gguf", "llama-3.2-1b", "Q4_0", seed=0)
    peer_flag = ["--peer"] if importlib.util.find_spec("llama_cpp") else []
    args = parser().parse_args(["--configs", "lean", "--single-tokens", "8", "--batch-tokens", "8", *peer_flag])
    rows = benchmark.pedantic(table, args=(args, path), rounds=1, iterations=1)
    warm = rows["lean warm"]
    assert "error" not in warm, warm
    benchmark.extra_info.update({f"warm_{k}": v for k, v in warm.items()})
    assert warm["single_tok_s"] > 0 and warm["rss_mb"] < 3 * path.stat().st_size / 2**20  # regression guard


if __name__ == "__main__":
    main()
