#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: GPU tests, then export base and big, fuse them,
# validate fused and unfused (fp32 and fp16) across CPU and CUDA, a short profile and the
# fused-form table on CUDA, and a summary. On a machine without a GPU it says so and exits 0.
#
# Usage (repository root):  bash ci/gpu-check.sh [RESULTS_DIR]
#   PYTHON=python3            interpreter to use (default python3)
#   ORT_WHEEL_DIR=DIR         install onnxruntime-gpu from a local wheel folder (no registry)
#   RESULTS_DIR               where models, JSON reports, logs and the plot go (default gpu-results/);
#                             when $OUT is set (a device lease), the summary files are copied there
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${1:-gpu-results}
mkdir -p "$RESULTS"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi absent or failing); nothing to check."
  exit 0
fi

if [ -n "${ORT_WHEEL_DIR:-}" ]; then
  echo "== installing onnxruntime-gpu from $ORT_WHEEL_DIR"
  $PY -m pip install -q --no-index --no-deps --target /tmp/ort-site "$ORT_WHEEL_DIR"/onnxruntime_gpu-*.whl \
    && export PYTHONPATH="/tmp/ort-site:$PYTHONPATH"
fi

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY - <<'PY'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "onnxruntime", "onnx", "onnxscript", "onnx_ir", "numpy"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "unavailable:", exc)
import torch
print("torch cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import onnxruntime as ort
print("onnxruntime providers", ort.get_available_providers())
from mha_onnx.runtimes import cuda_available
print("CUDA EP starts:", cuda_available())
PY

status=0
step() {  # step NAME CMD...: run, log, remember failures
  local name=$1; shift
  echo "== $name"
  "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$RESULTS/$name.log"
  echo "-- $name: exit $rc"
  [ $rc -eq 0 ] || status=1
  return 0
}

CLI="$PY -m mha_onnx.cli"
M="$RESULTS/models"
step gpu-tests $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
step matrix $PY -m tools.gpu_matrix "$RESULTS" --providers cpu,cuda
step profile-base $CLI profile "$M/base-float32-none.onnx" "$M/base-float32-none.fused.onnx" \
  "$M/base-float32-causal.fused.onnx" "$M/base-float32-key-padding.fused.onnx" \
  --providers cuda --seq-lens 512,2048,8192,32768 --io-binding --iters 20 --pad-fraction 0.25 \
  --no-memory-check --json
# which attention kernel ORT's CUDA EP runs for each fused form (printed by ORT to stderr)
step kernels env ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 $PY - "$M" <<'PY'
import sys, glob
import numpy as np
from mha_onnx.graphio import read_model
from mha_onnx.inputs import case_for, input_specs, make_inputs
from mha_onnx.runtimes import OrtRunner
for path in sorted(glob.glob(sys.argv[1] + "/base-float16-*.fused.onnx")):
    specs = input_specs(read_model(path))
    feeds = make_inputs(specs, case_for(specs, "k", 2, [512]))
    print("== kernels of", path, flush=True)
    OrtRunner(path, "cuda", io_binding=True, strict=False).infer(feeds)
PY
step forms-cuda $PY -m tools.fusion_forms --provider cuda --seq-lens 1024,8192 --iters 10 \
  --out "$RESULTS/fusion-forms-cuda.md"

echo "== summary"
cat "$RESULTS/matrix.md" 2>/dev/null || echo "no matrix (see matrix.log)"
if [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then  # at most a few small files travel back
  for f in matrix.md matrix.json fusion-forms-cuda.md profile-base.log gpu-tests.log kernels.log; do
    [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT/"
  done
fi
echo "gpu-check: overall exit $status"
exit $status
