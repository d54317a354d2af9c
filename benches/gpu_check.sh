#!/usr/bin/env bash
# treeserve GPU check: GPU tests, kernel table, end-to-end decode / prefill / host phases.
#
# Runs on a CUDA machine's own Python as it is (torch with CUDA, triton, numpy, tokenizers,
# safetensors, jinja2, tqdm, pytest, hypothesis preinstalled; nothing is fetched):
#
#     bash benches/gpu_check.sh [WHEEL_DIR]
#
# WHEEL_DIR (default ./.whl when it exists) holds only the few wheels that Python lacks (gguf;
# optionally flashinfer-python): they are installed with --no-index --no-deps into a private
# --target folder put on PYTHONPATH, so the image's own packages are never replaced. Models are
# random weights of real shapes (benches/gpu_e2e.py): no checkpoint travels. Stages share a budget
# of GPU_CHECK_BUDGET_S seconds (default 420: the whole check within 7.5 minutes); a stage that runs
# out of time is cut and reported, and the next one still runs. Output: each stage's table on
# stdout, full logs in $GPU_CHECK_OUT (default ./gpu_check_out).
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_OUT.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
WHEELS=${1:-}
[[ -z "$WHEELS" && -d .whl ]] && WHEELS=.whl
OUT=${GPU_CHECK_OUT:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
START=$(date +%s)
mkdir -p "$OUT"
declare -a SUMMARY=()

left() { echo $((BUDGET - ($(date +%s) - START))); }

# run_stage NAME MAX_SECONDS CMD...: run with a timeout (at most what is left), record the outcome.
run_stage() {
    local name=$1 limit=$2
    shift 2
    local l
    l=$(left)
    ((limit > l)) && limit=$l
    if ((limit < 15)); then
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

# ---------------------------------------------------------------- Python: the machine's own
PY=${PYTHON:-python3}
if [[ -n "$WHEELS" ]]; then
    SITE=$(mktemp -d /tmp/treeserve-gpu-site.XXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || {
        echo "gpu_check: installing the wheels of $WHEELS failed" >&2
        exit 1
    }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" - <<'EOF' || exit 1
import importlib.util
import sys

import torch
import triton

missing = [m for m in ("gguf", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
assert not missing, f"gpu_check: missing {missing}: put their wheels in the wheel folder"
assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
SUMMARY+=("setup: ok ($(($(date +%s) - START))s)")

# ---------------------------------------------------------------- 1. GPU tests
# The gpu-marked tests, every Triton test (on CUDA tensors here; the interpreter is for CPUs) and
# the C++ operators fed bad input in a child process (a torch 2.11 image once segfaulted there).
mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
run_stage gpu_tests 100 "$PY" -m pytest -q -p no:cacheprovider --hypothesis-profile=ci -rfE \
    tests/kvcache/test_attention.py tests/kvcache/test_ops.py tests/sampling/test_sampling_triton.py "${GPU_TESTS[@]}" \
    tests/models/test_triton_layers.py tests/models/test_kernel_counts.py tests/runner/test_fused_step.py \
    tests/test_cpp_bad_input.py

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
run_stage kernels 45 "$PY" "$OUT/kernels.py" cuda

# ---------------------------------------------------------------- 3. end to end, random weights of real shapes
run_stage decode_smollm2 70 "$PY" benches/gpu_e2e.py decode --shape smollm2 --modes graph,sync,eager,compile
run_stage decode_8b 70 "$PY" benches/gpu_e2e.py decode --shape llama3-8b --modes graph,sync,eager
run_stage prefill_8b 25 "$PY" benches/gpu_e2e.py prefill --shape llama3-8b
run_stage phases_smollm2 20 "$PY" benches/gpu_e2e.py phases --shape smollm2 --batch 1
run_stage phases_8b 25 "$PY" benches/gpu_e2e.py phases --shape llama3-8b --batch 1
# Issue 28's fused step: kernels per step / per layer and GPU ms per replay, fused vs the torch
# path, and the LM head alone (float32 vs the bf16 exact head).
run_stage kernels_smollm2 40 "$PY" benches/gpu_e2e.py kernels --shape smollm2 --batch 1
run_stage kernels_8b 50 "$PY" benches/gpu_e2e.py kernels --shape llama3-8b --batch 1

echo
echo "== gpu_check summary ($(($(date +%s) - START))s, logs in $OUT/)"
printf '  %s\n' "${SUMMARY[@]}"
[[ ! "${SUMMARY[*]}" =~ (FAILED|TIMED) ]]
