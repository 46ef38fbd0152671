#!/usr/bin/env bash
# GPU checks for pipekernel, in one run under 7 minutes on one GPU (see docs/gpu.md):
#   info         the GPU, driver, torch, CUDA and NCCL versions
#   conformance  the transport conformance suite on nccl and cupy-nccl (every GPU up to 4
#                ranks; on one GPU the one-rank checks: NCCL refuses two ranks per GPU)
#   pipeline     several stages on one GPU via transport="staged": 1F1B, ZB-H1, ZBV fp32
#                parity and bf16/fp16 within tolerance (tests/test_cuda_pipeline.py)
#   engine       one-stage nccl engine parity, transport="auto" and bf16 (tests/test_cuda.py)
#   device       issue 20 on one GPU (tests/test_cuda_device.py): one host sync per CUDA
#                train step (counted calls and CUDA's sync debug mode), eager NCCL lanes
#                over a host-made gloo group, CUDA_DEVICE_MAX_CONNECTIONS, an unmatched
#                nccl receive ending in TransportTimeout, pinned batches reused at once
#   checkpoint   activation-checkpoint peak memory and gradients on CUDA
#   other        every remaining CUDA test (pytest -m cuda)
#   benchmark    the GPU column of benchmarks/activation_checkpoint.py (small size)
#   watch        the cost of the device watch (benchmarks/device_watch.py)
#   memory       issue 46: per stage, the planner's predicted peak against
#                torch.cuda.max_memory_allocated for 1f1b, zbv and v-half on the staged
#                transport, and activation offload's peak saving against its step-time
#                cost (gpu/memory_check.py; its own line "MEMORY CHECK: ..." in memory.log)
# Every step has its own time limit, all within one overall budget (BUDGET seconds,
# default 380; on an H200 the whole check took 198-206 s, and collecting the suite for
# 'other' alone takes 15 s there). Last line: "GPU CHECK: N passed, M failed, K skipped ...".
# Exit codes: 0 nothing failed, 1 a step failed, 2 no CUDA device here.
# Results go to $OUT when it is set, else ./gpu-out.
# Usage (repo root or anywhere): bash gpu/check.sh   [PYTHON=/path/to/python BUDGET=380]
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}
DEST=${OUT:-./gpu-out}
BUDGET=${BUDGET:-380}
export PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}

no_cuda() {
    echo "no CUDA device: run this on a GPU machine ($1)" >&2
    echo "GPU CHECK: 0 passed, 0 failed, 0 skipped (no CUDA device: $1)"
    exit 2
}

# Fail fast, before any install, where there is no NVIDIA GPU at all.
command -v nvidia-smi >/dev/null 2>&1 || no_cuda "nvidia-smi not found"
nvidia-smi -L 2>/dev/null | grep -q "^GPU " || no_cuda "nvidia-smi lists no GPU"

started=$SECONDS
# installed, not merely importable: from the repo root `import pipekernel` finds the
# folder, but pipekernel.transports and the entry points exist only once installed (the
# first run on an H200 skipped the install for that reason and failed 7 of 9 steps)
if ! (cd / && "$PY" -c "import pipekernel.transports.nccl, importlib.metadata as m; \
        m.version('pipekernel')") 2>/dev/null; then
    echo "== installing pipekernel (editable)"
    if "$PY" -c "import torch, pluggy, pytest" 2>/dev/null; then
        # torch and pytest already there (e.g. an offline GPU image): no downloads
        timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    else
        timeout 300 "$PY" -m pip install -q torch==2.13.0 \
            && timeout 120 "$PY" -m pip install -q -e ".[test]"
    fi
fi
timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || no_cuda "torch sees no GPU"
mkdir -p "$DEST"
started=$SECONDS  # the budget counts the checks, not the install

passed=() failed=() skipped=()

# run_step NAME LIMIT COMMAND...: run COMMAND with at most LIMIT seconds (less if the
# budget is nearly spent), its output in $DEST/NAME.log; record pass or fail.
run_step() {
    local name=$1 limit=$2 rc=0
    shift 2
    local left=$((BUDGET - (SECONDS - started)))
    if [ "$left" -lt 10 ]; then
        failed+=("$name (no time left in the ${BUDGET}s budget)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$DEST/$name.log" 2>&1 || rc=$?
    tail -n 25 "$DEST/$name.log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        failed+=("$name (timed out after ${limit}s)")
    elif [ "$rc" -ne 0 ]; then
        failed+=("$name (exit $rc)")
    # a GPU is here: a test skipped for want of CUDA means the check did not run
    elif grep -qE "^SKIPPED .*needs CUDA" "$DEST/$name.log"; then
        failed+=("$name (CUDA tests skipped although a GPU is present)")
    else
        passed+=("$name")
    fi
}

pytest_step() {  # pytest_step NAME LIMIT PYTEST-ARGS...
    local name=$1 limit=$2
    shift 2
    run_step "$name" "$limit" "$PY" -m pytest -m cuda -v -ra -p no:cacheprovider \
        --junitxml="$DEST/$name.xml" "$@"
}

run_step info 30 "$PY" - <<'EOF'
import subprocess
import torch
import pipekernel
print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
print("device:", torch.cuda.get_device_name(0), "| count:", torch.cuda.device_count())
print("torch:", torch.__version__, "| cuda:", torch.version.cuda,
      "| nccl:", torch.cuda.nccl.version(), "| pipekernel:", pipekernel.__version__)
EOF

if ! "$PY" -c "import cupy" 2>/dev/null; then
    skipped+=("cupy-nccl conformance (CuPy not installed: pip install \"pipekernel[cupy]\")")
fi
pytest_step conformance 90 tests/test_transports.py
pytest_step pipeline 130 tests/test_cuda_pipeline.py
pytest_step engine 50 tests/test_cuda.py
pytest_step device 90 tests/test_cuda_device.py
pytest_step checkpoint 50 tests/test_activation_checkpoint.py
pytest_step other 120 tests --ignore=tests/test_transports.py \
    --ignore=tests/test_cuda_pipeline.py --ignore=tests/test_cuda.py \
    --ignore=tests/test_cuda_device.py --ignore=tests/test_activation_checkpoint.py
run_step benchmark 60 "$PY" benchmarks/activation_checkpoint.py --devices cuda --blocks 16 \
    --batch 8 --seq 512 --dim 512 --intervals 0 1 2 4 8 --repeats 3
run_step watch 20 "$PY" benchmarks/device_watch.py
run_step memory 90 "$PY" gpu/memory_check.py --schedules 1f1b zbv v-half
grep -h "^MEMORY CHECK" "$DEST/memory.log" 2>/dev/null

join() {  # join ITEMS... with ", "
    local out="" item
    for item in "$@"; do out+="${out:+, }$item"; done
    echo "$out"
}
summary="GPU CHECK: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped"
summary+=" in $((SECONDS - started))s"
[ ${#failed[@]} -gt 0 ] && summary+=" | failed: $(join "${failed[@]}")"
[ ${#skipped[@]} -gt 0 ] && summary+=" | skipped: $(join "${skipped[@]}")"
{
    printf 'passed: %s\n' "${passed[@]}"
    [ ${#failed[@]} -gt 0 ] && printf 'FAILED: %s\n' "${failed[@]}"
    [ ${#skipped[@]} -gt 0 ] && printf 'skipped: %s\n' "${skipped[@]}"
    echo "logs in $DEST: <step>.log, <step>.xml (pytest steps)"
    echo "$summary"
} | tee "$DEST/summary.txt"
[ ${#failed[@]} -eq 0 ]
