#!/usr/bin/env bash
# treeserve GPU check: GPU tests, kernel table, end-to-end decode / prefill / host phases.
#
# Runs on a CUDA machine's own Python as it is (torch with CUDA, triton, numpy, tokenizers,
# safetensors, jinja2, tqdm, pytest, hypothesis preinstalled; nothing is fetched):
#
#     bash benches/gpu_check.sh [WHEEL_DIR]
#
# WHEEL_DIR (default ./.whl when it exists) holds only the few wheels that Python lacks (gguf and
# its pyyaml; optionally flashinfer-python): they are installed with --no-index --no-deps into a
# private --target folder put on PYTHONPATH, so the image's own packages are never replaced. Made
# on a machine with the package index, for a Python 3.12 x86-64 image (untracked, not ignored, so
# it travels with the working tree):
#
#     pip download -q --no-deps -d .whl gguf==0.19.0
#     pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#         --platform manylinux2014_x86_64 -d .whl pyyaml
#
# Models are
# random weights of real shapes (benches/gpu_e2e.py): no checkpoint travels. Stages share a budget
# of GPU_CHECK_BUDGET_S seconds (default 540: the whole check within 9.5 minutes); a stage that runs
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
BUDGET=${GPU_CHECK_BUDGET_S:-540}
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
    timeout -s INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
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
run_stage gpu_tests 180 "$PY" -m pytest -q -p no:cacheprovider --hypothesis-profile=ci -rfE \
    tests/kvcache/test_attention.py tests/kvcache/test_attention_split.py tests/kvcache/test_ops.py tests/sampling/test_sampling_triton.py "${GPU_TESTS[@]}" \
    tests/models/test_triton_layers.py tests/models/test_kernel_counts.py tests/runner/test_fused_step.py \
    tests/test_cpp_bad_input.py

# ---------------------------------------------------------------- 2. kernel benchmarks
# Achieved bytes/s over the copy bandwidth: attention (split vs unsplit, vs torch SDPA), sampling,
# verify (benches/gpu_kernels.py; its smoke mode runs in tests/test_gpu_scripts.py).
run_stage kernels 80 "$PY" benches/gpu_kernels.py --device cuda

# ---------------------------------------------------------------- 3. end to end, random weights of real shapes
run_stage decode_smollm2 50 "$PY" benches/gpu_e2e.py decode --shape smollm2 --modes graph,sync,eager
run_stage decode_8b 80 "$PY" benches/gpu_e2e.py decode --shape llama3-8b --modes graph,sync,eager
# sampled decoding (temperature 0.7, top-p 0.9, top-k 50): the threshold kernel inside the graph
run_stage decode_8b_sampled 40 "$PY" benches/gpu_e2e.py decode --shape llama3-8b --modes graph --sampled
run_stage prefill_8b 25 "$PY" benches/gpu_e2e.py prefill --shape llama3-8b
run_stage phases_smollm2 20 "$PY" benches/gpu_e2e.py phases --shape smollm2 --batch 1
run_stage phases_8b 25 "$PY" benches/gpu_e2e.py phases --shape llama3-8b --batch 1
# Issue 28's fused step: kernels per step / per layer and GPU ms per replay, fused vs the torch
# path, and the LM head alone (float32 vs the bf16 exact head).
run_stage kernels_smollm2 40 "$PY" benches/gpu_e2e.py kernels --shape smollm2 --batch 1
run_stage kernels_8b 50 "$PY" benches/gpu_e2e.py kernels --shape llama3-8b --batch 1
# Issue 29: promotion from the pinned host tier into the device pool vs a plain pinned copy.
run_stage kv_promotion 30 bash -c "$PY benches/bench_kv_tiers.py --bandwidth --shape smollm2 && $PY benches/bench_kv_tiers.py --bandwidth --shape llama3-8b"

echo
echo "== gpu_check summary ($(($(date +%s) - START))s, logs in $OUT/)"
printf '  %s\n' "${SUMMARY[@]}"
[[ ! "${SUMMARY[*]}" =~ (FAILED|TIMED) ]]
