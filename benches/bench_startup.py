"""Start-up time and resident memory of ``LLM()`` on a real GGUF file, beside llama-cpp-python (issue 33).

Each figure comes from a fresh process (so imports, page faults and memory are that start's alone),
side by side in one run:

- ``torch``: the resident set of ``python -c "import torch"`` (the runtime's floor);
- ``warm``: ``--runs`` starts of ``LLM(model)`` with the measurement cache ``--cache`` (default: a new
  one, filled first by one cold ``LLM()``): import time, ``LLM()`` wall and process CPU time (a
  loaded machine inflates the wall; the CPU time is what the start itself costs), ``VmRSS`` /
  ``RssAnon`` / ``RssFile`` after ``LLM()`` and after a 16-token greedy ``generate``;
- ``generate``: ``treeserve generate --max-new-tokens 1`` from a cold process: wall and peak RSS;
- ``llama.cpp`` (``--peer``): ``Llama(path)`` load time and resident set at ``n_ctx`` 8192 (its KV
  cache is allocated and zeroed at load: resident) and 512.

    flock /work/bench.lock python benches/bench_startup.py [--model smollm2-135m-instruct] [--peer]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        field = line.split(":", 1)[0]
        if field in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[field] = int(line.split()[1]) / 1024
    return out


def child(which: str, model: str) -> dict[str, object]:
    """One fresh process's figures (printed as one JSON line by ``main``)."""
    t = time.perf_counter()
    if which == "torch":
        import torch  # noqa: F401

        return {"import_s": time.perf_counter() - t, **_status()}
    if which.startswith("llama.cpp"):  # "llama.cpp:<n_ctx>"; ``model`` is the file's path here
        from llama_cpp import Llama

        llm = Llama(model, n_threads=2, n_ctx=int(which.split(":")[1]), verbose=False)
        return {"load_s": time.perf_counter() - t, **_status(), "n_ctx": llm.n_ctx()}
    from treeserve import LLM, SamplingParams

    imported = time.perf_counter() - t
    t, cpu = time.perf_counter(), time.process_time()
    llm = LLM(model)
    out = {"import_s": imported, "llm_s": time.perf_counter() - t, "llm_cpu_s": time.process_time() - cpu,
           "after_load": _status()}
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_new_tokens=16), use_tqdm=False)
    out["after_16_tokens"] = _status()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache", default=None, help="measurement cache folder (default: a new one, filled by a cold start)")
    ap.add_argument("--peer", action="store_true", help="also llama-cpp-python on the same file")
    ap.add_argument("--pycache-prefix", default=None,
                    help="the children write and read bytecode under this folder (PYTHONPYCACHEPREFIX), as an "
                         "installed package has it; default: the environment's setting (PYTHONDONTWRITEBYTECODE=1 "
                         "compiles every module at every start)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model)))
        return
    with tempfile.TemporaryDirectory(prefix="treeserve-startup-") as fresh:
        env = {**os.environ, "TREESERVE_CACHE_DIR": args.cache or fresh}
        if args.pycache_prefix:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = args.pycache_prefix

        def fresh_process(which: str, model: str = args.model) -> dict[str, object]:
            done = subprocess.run([sys.executable, __file__, "--model", model, "--child", which], env=env,
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"{which} failed: {done.stderr.strip()[-2000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])

        print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}", flush=True)
        print("torch", json.dumps(fresh_process("torch")), flush=True)
        if args.cache is None:
            print("cold", json.dumps(fresh_process("treeserve")), flush=True)
        for i in range(args.runs):
            print(f"warm {i + 1}", json.dumps(fresh_process("treeserve")), flush=True)
        import treeserve  # (its __init__ is lazy) where this process's path finds it: ``-m`` runs that one,
        root = Path(treeserve.__file__).parents[1]  # not the working directory's checkout
        for i in range(2):
            cmd = [sys.executable, "-m", "treeserve", "generate", "--model", args.model, "--prompt", "Hello",
                   "--max-new-tokens", "1"]
            t = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, status, usage = os.wait4(proc.pid, 0)  # this process's own peak resident set
            if status:
                raise RuntimeError(f"{cmd} exited with status {status}")
            print(f"generate {i + 1}", json.dumps({"wall_s": time.perf_counter() - t, "max_rss_mb": usage.ru_maxrss / 1024}),
                  flush=True)
        if args.peer:
            from treeserve.models.loader import resolve_model_path

            path = str(resolve_model_path(args.model))
            for n_ctx in (8192, 512):
                print(f"llama.cpp n_ctx {n_ctx}", json.dumps(fresh_process(f"llama.cpp:{n_ctx}", path)), flush=True)
        print(f"end, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
