#!/usr/bin/env bash
# GPU checks for pipekernel, in one run of a few minutes (see docs/gpu.md):
#   1. the GPU, driver, torch, CUDA and NCCL versions;
#   2. every CUDA-only test (pytest -m cuda), which must not skip for want of CUDA;
#   3. the GPU column of benchmarks/activation_checkpoint.py at a small size.
# Results go to $OUT when it is set, else ./gpu-out. Exit codes: 0 all passed,
# 1 a check failed, 2 no CUDA device here.
# Usage (repo root or anywhere): bash gpu/check.sh   [PYTHON=/path/to/python]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-./gpu-out}
export PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}

no_cuda() {
    echo "no CUDA device: run this on a GPU machine ($1)" >&2
    exit 2
}

# Fail fast, before any install, where there is no NVIDIA GPU at all.
command -v nvidia-smi >/dev/null 2>&1 || no_cuda "nvidia-smi not found"
nvidia-smi -L 2>/dev/null | grep -q "^GPU " || no_cuda "nvidia-smi lists no GPU"

started=$SECONDS

if ! "$PY" -c "import pipekernel" 2>/dev/null; then
    echo "== installing pipekernel (editable)"
    if "$PY" -c "import torch, pluggy, pytest" 2>/dev/null; then
        # torch and pytest already there (e.g. an offline GPU image): no downloads
        "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    else
        "$PY" -m pip install -q torch==2.13.0
        "$PY" -m pip install -q -e ".[test]"
    fi
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || no_cuda "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no GPU"
mkdir -p "$DEST"

failed=()

echo "== GPU" | tee "$DEST/gpu.txt"
nvidia-smi 2>&1 | tee -a "$DEST/gpu.txt" || failed+=("nvidia-smi")
rc=0
"$PY" - <<'EOF' 2>&1 | tee -a "$DEST/gpu.txt" || rc=$?
import torch
import pipekernel
print("device:", torch.cuda.get_device_name(0), "| count:", torch.cuda.device_count())
print("torch:", torch.__version__, "| cuda:", torch.version.cuda,
      "| nccl:", torch.cuda.nccl.version(),
      "| pipekernel:", pipekernel.__version__)
EOF
[ "$rc" -eq 0 ] || failed+=("torch device query (exit $rc)")

echo "== CUDA-only tests (pytest -m cuda)"
rc=0
timeout 300 "$PY" -m pytest tests -m cuda -v -ra -p no:cacheprovider \
    --junitxml="$DEST/pytest-cuda.xml" 2>&1 | tee "$DEST/pytest-cuda.log" || rc=$?
[ "$rc" -eq 0 ] || failed+=("pytest -m cuda (exit $rc)")
# A GPU is here, so a test skipped for want of CUDA means the check did not run.
if grep -E "^SKIPPED .*needs CUDA" "$DEST/pytest-cuda.log"; then
    failed+=("CUDA tests skipped although a GPU is present")
fi

echo "== benchmark: activation checkpointing, GPU column (small size)"
rc=0
timeout 180 "$PY" benchmarks/activation_checkpoint.py --devices cuda --blocks 16 --batch 8 \
    --seq 512 --dim 512 --intervals 0 1 2 4 8 --repeats 3 2>&1 \
    | tee "$DEST/activation_checkpoint.md" || rc=$?
[ "$rc" -eq 0 ] || failed+=("benchmarks/activation_checkpoint.py (exit $rc)")

{
    echo "gpu/check.sh: $((SECONDS - started)) s"
    if [ ${#failed[@]} -eq 0 ]; then
        echo "ALL GPU CHECKS PASSED"
    else
        printf 'FAILED: %s\n' "${failed[@]}"
    fi
    echo "results in $DEST: gpu.txt pytest-cuda.log pytest-cuda.xml activation_checkpoint.md"
} | tee "$DEST/summary.txt"
[ ${#failed[@]} -eq 0 ]
