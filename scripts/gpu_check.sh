#!/usr/bin/env bash
# One-shot check on a GPU machine: build pagedkv from source against the local
# torch, run the CUDA tests, run the kernel benchmark, print a summary table.
#
#   scripts/gpu_check.sh            # logs go to $OUT if set, else ./gpu_check_out
#
# Knobs: PYTHON (python3), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS (16),
# BUILD_TIMEOUT / TEST_TIMEOUT / ENGINE_TIMEOUT / BENCH_TIMEOUT in seconds (300 / 300 / 300 / 180).
# Every stage runs even if an earlier one failed; the exit status is that of
# the first failed stage (0 when all pass).
set -u

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$LOG_DIR"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export PAGEDKV_CUDA=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

NAMES=()
RESULTS=()
FIRST_FAILURE=0

# stage NAME TIMEOUT CMD...: runs CMD with a time limit, logs to $LOG_DIR/NAME.log.
stage() {
  local name=$1 limit=$2
  shift 2
  echo "=== [$name] $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  tail -n 15 "$LOG_DIR/$name.log"
  local verdict="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMEOUT"
  elif [ "$rc" -ne 0 ]; then
    verdict="FAILED"
  fi
  echo "=== [$name] $verdict (rc=$rc, ${took}s)"
  NAMES+=("$name")
  RESULTS+=("$(printf '%-8s rc=%-4s %5ss' "$verdict" "$rc" "$took")")
  if [ "$rc" -ne 0 ] && [ "$FIRST_FAILURE" -eq 0 ]; then FIRST_FAILURE=$rc; fi
  return 0
}

stage env 60 bash -c "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; nvcc --version | tail -n 2"
stage build "${BUILD_TIMEOUT:-300}" "$PY" setup.py build_ext --inplace --build-temp build/gpu_check
stage import 60 "$PY" -c "import pagedkv, torch; assert pagedkv.built_with_cuda, 'built without CUDA'; print('cuda ops:', torch._C._dispatch_dump('pagedkv::paged_attention_v1').count('CUDA'))"
stage tests "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -rs --maxfail=30 tests/test_cuda.py --junitxml="$LOG_DIR/test_cuda.xml"
# The engine on CUDA against HF transformers on the same device (a tiny random Llama: no model package needed).
stage engine "${ENGINE_TIMEOUT:-300}" "$PY" -m pytest -q -rs tests/test_engine_cuda.py
if [ -f bench/bench_kernels.py ]; then
  touch "$LOG_DIR/.bench_start"
  stage bench "${BENCH_TIMEOUT:-180}" "$PY" bench/bench_kernels.py --device cuda
  # Keep whatever result files the benchmark wrote (JSON/CSV/PNG) with the logs.
  find bench -type f -newer "$LOG_DIR/.bench_start" \( -name '*.json' -o -name '*.csv' -o -name '*.png' \) \
    -exec cp {} "$LOG_DIR/" \; 2>/dev/null
  rm -f "$LOG_DIR/.bench_start"
else
  echo "=== [bench] bench/bench_kernels.py not found, skipped"
  NAMES+=("bench")
  RESULTS+=("skipped (no bench/bench_kernels.py)")
fi

echo
echo "================ pagedkv gpu_check summary ================"
printf '%-8s %s\n' "stage" "result"
for i in "${!NAMES[@]}"; do printf '%-8s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
if [ -f "$LOG_DIR/tests.log" ]; then
  echo "tests:   $(grep -E '(passed|failed|error|skipped)' "$LOG_DIR/tests.log" | tail -n 1)"
fi
if [ -f "$LOG_DIR/bench.log" ]; then
  echo "bench (last lines):"
  tail -n 25 "$LOG_DIR/bench.log"
fi
echo "logs: $LOG_DIR"
exit "$FIRST_FAILURE"
