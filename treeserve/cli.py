"""``treeserve generate | chat | serve | bench [serve]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from treeserve import bench as workloads
from treeserve._cpu import cpu_features
from treeserve._cpu_load import interference
from treeserve._tuning import INTERFERENCE_LIMIT
from treeserve.cluster.policy import RoutingThresholds
from treeserve.engine import LLM
from treeserve.sampling import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="name, .gguf file or HF directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default="auto", choices=["auto", "int4", "int8", "none"],
                   help="weight-only packing for decode (auto: a GGUF's codes as shipped)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache storage (auto, under float32 on CPU: bf16 with AVX-512 BF16, float16 on other "
                        "AVX2 CPUs; else the model's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--speculative", default="auto",
                   help="auto (n-gram drafting on CPU, lengths by the measured goodput rule), none, ngram, "
                        "draft:<model> or draft:self:<N> (default: auto)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--jump-forward-tokens", type=int, default=16,
                   help="structured output: tokens a grammar forces, proposed as one draft (0 = off)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="each request's output independent of its batch (slower; see README)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N worker processes (gloo on CPU, one GPU each on CUDA)")
    p.add_argument("--kv-host-tokens", type=int, default=None,
                   help="host-memory KV tier under the pool, in tokens (default: off on CPU, the pool's size on CUDA)")
    p.add_argument("--kv-disk-dir", default=None, help="directory of the disk KV tier (kept across restarts)")
    p.add_argument("--kv-disk-bytes", type=int, default=16 << 30, help="disk KV tier capacity in bytes")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM``'s arguments from the engine flags, except ``num_threads`` (``--threads``)."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        kv_cache_tokens=args.kv_cache_tokens,
        max_batched_tokens=args.max_batched_tokens,
        max_running=args.max_running,
        speculative=None if args.speculative == "none" else args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        jump_forward_tokens=args.jump_forward_tokens,
        batch_invariant=args.batch_invariant,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_host_tokens=args.kv_host_tokens,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_bytes=args.kv_disk_bytes,
    )


def _make_llm(args: argparse.Namespace) -> LLM:
    return LLM(num_threads=args.threads, **_llm_kwargs(args))


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    for piece in llm.stream(prompt, _params(args)):
        print(piece, end="", flush=True)
    print()
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("treeserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        reply = ""
        for piece in llm.stream(prompt, _params(args)):
            reply += piece
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
    llm.close()
    return 0


def _same_model(llm: LLM, args: argparse.Namespace, **overrides: Any) -> LLM:
    """A second engine over ``llm``'s model and tokenizer with the command's engine settings and
    the same KV dtype, for a side-by-side run: a given module, so no speculation unless asked."""
    return LLM((llm.model, llm.tokenizer), dtype=args.dtype, kv_cache_dtype=str(llm.kv.dtype).removeprefix("torch."),
               kv_cache_tokens=args.kv_cache_tokens, max_batched_tokens=args.max_batched_tokens,
               max_running=args.max_running, **overrides)  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> int:
    if args.quick:
        n_req, n_new, groups, per_group, prefix, single = 16, 32, 4, 4, 256, 32
    else:
        n_req, n_new, groups, per_group, prefix, single = 64, 128, 8, 8, 512, 128
    llm = _make_llm(args)

    def run() -> list[workloads.WorkloadResult]:
        rows = [workloads.throughput(llm, n_req, n_new)]
        cached = workloads.shared_prefix(llm, groups, per_group, prefix)
        llm_nocache = _same_model(llm, args, enable_prefix_cache=False)
        uncached = workloads.shared_prefix(llm_nocache, groups, per_group, prefix)
        del llm_nocache
        cached.extra["speedup_vs_no_cache"] = uncached.seconds / cached.seconds
        rows += [cached, uncached, workloads.single_decode(llm, single)]
        if llm.config.speculative:  # what speculation gives one input-grounded request, vs the same model without
            rows.append(workloads.grounded_decode(llm, _same_model(llm, args), single))
        rows.append(workloads.single_stream_breakdown(llm, single))
        return rows

    rows, shared = interference(run)  # the figures mean little where other work shared the cores
    sample = rows[0].sample_text
    print(f"\nmodel={args.model} dtype={args.dtype} ({llm.model.dtype}) quantization={args.quantization} "
          f"kv_cache_dtype={args.kv_cache_dtype} ({str(llm.kv.dtype).removeprefix('torch.')}) "
          f"threads={args.threads or 'default'}")
    quiet = "" if shared <= INTERFERENCE_LIMIT else " (not quiet: ratios only, or run again)"
    print(f"CPU: {cpu_features().describe()}; other work took {shared:.0%} of this process's CPUs during the run{quiet}")
    print(f"sample output: {sample[:300]!r}\n")
    print(f"{'workload':<34}{'requests':>9}{'prompt tok':>11}{'gen tok':>9}{'seconds':>9}{'gen tok/s':>11}  notes")
    for r in rows:
        notes = " ".join(f"{k}={v:.2f}" for k, v in r.extra.items())
        print(
            f"{r.name:<34}{r.num_requests:>9}{r.prompt_tokens:>11}{r.generated_tokens:>9}"
            f"{r.seconds:>9.2f}{r.tokens_per_second:>11.1f}  {notes}"
        )
    m = llm.metrics
    print(
        f"\nengine: mean TTFT {m.mean_ttft * 1e3:.0f} ms, mean TPOT {m.mean_tpot * 1e3:.1f} ms, "
        f"preemptions {m.preemptions}, steps {m.steps}"
    )
    if llm.config.speculative:
        print(f"speculation ({llm.config.speculative}): {m.accepted_tokens} of {m.draft_tokens} draft tokens accepted "
              f"({m.acceptance_rate:.1%}), {m.mean_accepted_length:.2f} tokens per verify step")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None or args.address is not None:
        return _serve_cluster(args)
    from treeserve.server.launch import serve

    return serve(lambda: _make_llm(args), host=args.host, port=args.port, model_name=args.served_model_name,
                 max_live_requests=args.max_live_requests)  # fmt: skip


def _serve_cluster(args: argparse.Namespace) -> int:
    try:
        from treeserve.cluster.launch import serve_cluster
    except ImportError as exc:
        print(f"treeserve serve --replicas needs Ray Serve: pip install 'treeserve[cluster]' ({exc})", file=sys.stderr)
        return 2
    thresholds = RoutingThresholds(cache_threshold=args.cache_threshold, balance_abs=args.balance_abs,
                                   balance_rel=args.balance_rel, capacity_tokens=args.kv_cache_tokens)  # fmt: skip
    replicas = 1 if args.replicas is None else args.replicas  # --address alone: one replica there
    return serve_cluster(_llm_kwargs(args), replicas=replicas, address=args.address, threads=args.threads,
                         host=args.host, port=args.port, served_model_name=args.served_model_name,
                         max_live_requests=args.max_live_requests, router=args.router, thresholds=thresholds)  # fmt: skip


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from treeserve.server.bench_client import BenchConfig, run_bench

    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, num_requests=args.num_requests,
        concurrency=args.concurrency, request_rate=args.request_rate, dataset=args.dataset, input_len=args.input_len,
        output_len=args.output_len, seed=args.seed, drop_every=args.drop_every,
        logit_bias=json.loads(args.logit_bias) if args.logit_bias else None,
    )  # fmt: skip
    report = asyncio.run(run_bench(cfg))
    print(json.dumps(report.as_dict()) if args.json else report.format())
    return 1 if report.errors else 0


def _serve_parsers(sub: argparse._SubParsersAction, bench: argparse.ArgumentParser) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see README: Serve)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--max-live-requests", type=int, default=1024, help="running + waiting; more get HTTP 503")
    c = s.add_argument_group("replicas (Ray Serve, the 'cluster' extra; README: Replicas)")
    c.add_argument("--replicas", type=int, default=None, help="N engine replicas behind this endpoint")
    c.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto or ray://host:10001)")
    c.add_argument("--router", default="prefix", choices=["prefix", "power-of-two"],
                   help="prefix-cache-aware routing, or Ray Serve's default")
    rt = RoutingThresholds()
    c.add_argument("--cache-threshold", type=float, default=rt.cache_threshold, help="prefix share of the prompt to follow a cache")
    c.add_argument("--balance-abs", type=int, default=rt.balance_abs, help="loads are skewed past this many requests apart ...")
    c.add_argument("--balance-rel", type=float, default=rt.balance_rel, help="... and this ratio: then least-loaded wins")
    s.set_defaults(func=cmd_serve)
    bs = bench.add_subparsers(dest="bench_target").add_parser("serve", help="load-test an OpenAI-compatible server")
    bs.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    bs.add_argument("--model", default=None, help="default: the server's first model")
    bs.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    bs.add_argument("--num-requests", type=int, default=32)
    bs.add_argument("--concurrency", type=int, default=32)
    bs.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    bs.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "mixed"])
    bs.add_argument("--input-len", type=int, default=64)
    bs.add_argument("--output-len", type=int, default=128)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--drop-every", type=int, default=0, help="every k-th client disconnects after 1 token")
    bs.add_argument("--logit-bias", default=None, help='JSON, e.g. \'{"2": -100}\' to ban EOS')
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(func=cmd_bench_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from one prompt (streams the text)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat")
    c.add_argument("--system", default=None)
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    b = sub.add_parser("bench", help="offline workloads, printed as a table")
    b.add_argument("--quick", action="store_true", help="smaller workloads (about a minute on 2 cores)")
    _engine_args(b)
    b.set_defaults(func=cmd_bench)
    _serve_parsers(sub, b)
    return parser


_QUICK_EXIT = (cmd_generate, cmd_chat)
"""Commands whose process, run as a program, ends with ``os._exit`` once its output is flushed."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments) and return its exit code.

    Run as a program (``argv`` None), ``generate`` and ``chat`` end the process themselves once
    their engine is closed (``LLM.close``: tensor-parallel workers joined, disk-tier writes
    finished) and stdout/stderr are flushed: ``os._exit`` skips the interpreter's teardown of torch
    and the model (~0.6-0.8 s on a 2-core EPYC, benches/RESULTS.md, issue 33), which nothing needs.
    """
    args = build_parser().parse_args(argv)
    code = args.func(args)
    if argv is None and args.func in _QUICK_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
