#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU, in order of what matters most, within one time
# budget: machine facts, the GPU tests, graphs exported elsewhere (tools/gpu_zoo, built and
# fused beforehand) validated on CUDA, which attention kernel ORT ran per fused node, the
# fused-form table on CUDA (fp16 and fp32; `fuse --ep cuda` reads it), TensorRT, the own
# export -> fuse -> validate matrix, a CUDA profile to L = 32768. On a machine without a GPU it
# says so and exits 0.
#
# Usage (repository root):  bash ci/gpu-check.sh [RESULTS_DIR]
#   PYTHON=python3            interpreter to use (default python3)
#   ORT_WHEEL_DIR=DIR         install onnxruntime-gpu from a local wheel folder (no registry)
#   GPU_MODELS=DIR            base-preset exports for profile-base (default RESULTS_DIR/models, which the matrix step fills)
#   GPU_ZOO=DIR               graphs from `python -m tools.gpu_zoo build DIR` (default .gpu/zoo)
#   GPU_CHECK_BUDGET=SECONDS  stop starting steps after this long (default 480)
#   GPU_CHECK_STEPS="zoo ..." the steps to run, in this order (default: all, as listed below)
#   GPU_FORMS_VARIANTS[_FP32] fusion_forms variants to time (default: all four)
#   GPU_CHECK_PROVIDER=cpu    dry run of the script itself on a CPU machine (no GPU needed), with
#                             GPU_FORMS_GRID, GPU_PROFILE_LENGTHS and GPU_MATRIX_ARGS made small
#   RESULTS_DIR               models, logs and tables (default gpu-results/); when $OUT is set
#                             (a device lease), $OUT/gpu-results.tgz holds the logs and tables
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${1:-gpu-results}
EP=${GPU_CHECK_PROVIDER:-cuda}
ZOO=${GPU_ZOO:-.gpu/zoo}
BUDGET=${GPU_CHECK_BUDGET:-480}
GRID=${GPU_FORMS_GRID:---batches 1,8 --seq-lens 128,1024,4096}  # a dry run takes a smaller one
LENGTHS=${GPU_PROFILE_LENGTHS:-512,2048,8192,32768}
START=$(date +%s)
mkdir -p "$RESULTS"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1

if [ "$EP" = cuda ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi absent or failing); nothing to check."
  exit 0
fi

if [ -n "${ORT_WHEEL_DIR:-}" ]; then
  echo "== installing onnxruntime-gpu from $ORT_WHEEL_DIR"
  $PY -m pip install -q --no-index --no-deps --target /tmp/ort-site "$ORT_WHEEL_DIR"/onnxruntime_gpu-*.whl \
    && export PYTHONPATH="/tmp/ort-site:$PYTHONPATH"
fi

keep() {  # logs and tables (not models) to $OUT/gpu-results.tgz after every step, so that a
  # run stopped at its limit still brings back what it found (a lease returns few files)
  if [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then
    tar czf "$OUT/gpu-results.tgz" -C "$RESULTS" --exclude=./models . 2>/dev/null || true
  fi
}

echo "== machine"
{
  date -u +"%Y-%m-%dT%H:%MZ"
  git log -1 --format='commit %H %s' 2>/dev/null || true
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  command -v nvidia-smi >/dev/null && nvidia-smi | head -4 | tail -2
  echo "TensorRT libraries: $(ldconfig -p 2>/dev/null | grep -c 'libnvinfer\.so') found by ldconfig"
  $PY - <<'PY'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "onnxruntime", "onnx", "onnxscript", "onnx_ir", "numpy", "transformers"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:
        print(name, "unavailable:", exc)
import torch
print("torch cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import onnxruntime as ort
print("onnxruntime providers", ort.get_available_providers())
from mha_onnx.runtime.ort import cuda_available
print("CUDA EP starts:", cuda_available())
PY
} 2>&1 | tee "$RESULTS/machine.log"
keep

status=0
step() {  # step NAME SECONDS CMD...: run within the budget, log, remember failures
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ $left -lt 20 ]; then echo "== $name: skipped, the budget of ${BUDGET}s is spent"; status=1; return 0; fi
  [ $limit -gt $left ] && limit=$left
  echo "== $name (at most ${limit}s)"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$RESULTS/$name.log"
  echo "-- $name: exit $rc in $(( $(date +%s) - t0 ))s$([ $rc -eq 124 ] && echo ' (timed out)')"
  [ $rc -eq 0 ] || status=1
  keep
  return 0
}

CLI="$PY -m mha_onnx.cli"
M=${GPU_MODELS:-$RESULTS/models}  # GPU_MODELS: exports made beforehand (profile-base reads them)
mkdir -p "$M"
VARIANTS=${GPU_FORMS_VARIANTS:-self-none,self-key-padding,cross-key-padding,self-causal}
VARIANTS32=${GPU_FORMS_VARIANTS_FP32:-$VARIANTS}

run_gpu-tests() { step gpu-tests 150 $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider; }
run_zoo() {
  [ -d "$ZOO" ] || { echo "== zoo: $ZOO absent (python -m tools.gpu_zoo build $ZOO)"; return 0; }
  step zoo 150 $PY -m tools.gpu_zoo check "$ZOO" --providers "cpu,$EP" --md "$RESULTS/zoo.md" \
    --json "$RESULTS/zoo.json"
}
# which attention kernel ORT's CUDA EP runs for each fused node (ORT prints it at run time)
run_kernels() { step kernels 60 env ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 $PY -m tools.gpu_zoo kernels "$ZOO" --providers "$EP"; }
run_forms() {  # run_forms DTYPE VARIANTS
  step "forms-$1" 150 $PY -m tools.fusion_forms --provider "$EP" --dtype "$1" --interleave \
    $GRID --iters 10 --min-time 0.05 --variants "$2" \
    --out "$RESULTS/forms-$EP-$1.md" --json "$RESULTS/forms-$EP-$1.json"
}
run_forms-fp16() { run_forms float16 "$VARIANTS"; }
run_forms-fp32() { run_forms float32 "$VARIANTS32"; }
run_tensorrt() { step tensorrt 60 $CLI validate "$ZOO/hf_bert.fused.onnx" --reference "$ZOO/hf_bert.onnx" --providers tensorrt; }
run_matrix() { step matrix 180 $PY -m tools.gpu_matrix "$RESULTS" --providers "cpu,$EP" ${GPU_MATRIX_ARGS:-}; }
run_profile-base() {  # the `--ep cuda` fusions too, where they were made beforehand
  local extra; extra=$(ls "$M"/base-float16-*.ep-cuda.fused.onnx 2>/dev/null)
  step profile-base 150 $CLI profile "$M/base-float16-none.onnx" "$M/base-float16-none.fused.onnx" \
    "$M/base-float16-causal.fused.onnx" "$M/base-float16-key-padding.fused.onnx" $extra \
    --providers "$EP" --seq-lens "$LENGTHS" --io-binding --iters 20 --pad-fraction 0.25 \
    --no-memory-check --json
}
for name in ${GPU_CHECK_STEPS:-zoo gpu-tests kernels forms-fp16 forms-fp32 tensorrt matrix profile-base}; do
  "run_$name"
done

echo "== summary"
cat "$RESULTS/zoo.md" "$RESULTS/matrix.md" 2>/dev/null
echo "gpu-check: overall exit $status in $(( $(date +%s) - START ))s"
exit $status
