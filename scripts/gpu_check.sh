#!/usr/bin/env bash
# One verdict on a GPU machine, within a time budget (default 8 minutes on a 16-core H200):
# preflight of the tools, build pagedkv from source against the local torch, the CUDA
# tests, compute-sanitizer memcheck + racecheck on a short run of every kernel, ptxas
# spill check (in the background), the kernel benchmark and a v1/v2 sweep, the
# benchmark's target rows, and a summary table with stage timings.
#
#   scripts/gpu_check.sh            # logs go to $OUT if set, else ./gpu_check_out
#
# Knobs: PYTHON (python3), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS (16), BUDGET_S (480: the
# whole run; every stage's limit is cut to what is left of it), and per-stage limits
# BUILD_TIMEOUT / TEST_TIMEOUT / ENGINE_TIMEOUT / SANITIZER_TIMEOUT / BENCH_TIMEOUT /
# SWEEP_TIMEOUT in seconds. SKIP_BENCH=1 skips the benchmarks (then no target verdict).
# Every stage runs even if an earlier one failed (except after a failed preflight or
# build); the exit status is 0 only when every stage passed and every target was met.
set -u

cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$LOG_DIR"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export PAGEDKV_CUDA=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
if [ -n "${CUDA_HOME:-}" ]; then export PATH="$CUDA_HOME/bin:$PATH"; fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S="${BUDGET_S:-480}"
START=$SECONDS

NAMES=()
RESULTS=()
FAILED=0

# record NAME VERDICT RC SECONDS [NOTE]: one row of the summary table.
record() {
  NAMES+=("$1")
  RESULTS+=("$(printf '%-8s rc=%-4s %5ss  %s' "$2" "$3" "$4" "${5:-}")")
  if [ "$2" != "ok" ] && [ "$2" != "skipped" ]; then FAILED=1; fi
}

# limit_for WANTED: the stage limit, cut to the time left in the budget (at least 10 s).
limit_for() {
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then left=10; fi
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

# stage NAME TIMEOUT CMD...: runs CMD with a time limit, logs to $LOG_DIR/NAME.log.
stage() {
  local name=$1 limit
  limit=$(limit_for "$2")
  shift 2
  echo "=== [$name] (limit ${limit}s) $*"
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
  record "$name" "$verdict" "$rc" "$took"
  return "$rc"
}

summary() {
  local total=$((SECONDS - START))
  if [ "$total" -gt "$BUDGET_S" ]; then
    record "budget" "MISSED" "-" "$total" "the run took longer than BUDGET_S=${BUDGET_S}s"
  fi
  echo
  echo "================ pagedkv gpu_check summary ================"
  printf '%-10s %s\n' "stage" "result"
  for i in "${!NAMES[@]}"; do printf '%-10s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
  if [ -f "$LOG_DIR/tests.log" ]; then
    echo "tests:     $(grep -E '(passed|failed|error)' "$LOG_DIR/tests.log" | tail -n 1)"
  fi
  if [ -f "$LOG_DIR/targets.log" ]; then sed 's/^/targets:   /' "$LOG_DIR/targets.log"; fi
  echo "total:     ${total}s of a ${BUDGET_S}s budget; logs: $LOG_DIR"
  if [ "$FAILED" -eq 0 ]; then echo "VERDICT: PASS"; else echo "VERDICT: FAIL"; fi
  return "$FAILED"
}

# ---- preflight: every tool the run needs, before spending time on a build -------------------------
# shellcheck disable=SC2329  # invoked through `bash -c preflight` (exported), under timeout
preflight() {
  local missing=0
  for tool in nvidia-smi nvcc "$PY"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "missing: $tool"
      missing=1
    fi
  done
  [ "$missing" -eq 0 ] || return 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || return 1
  nvcc --version | tail -n 2
  "$PY" - <<'EOF' || return 1
import sys
import torch
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("device:", torch.cuda.get_device_name(0), "SMs:", torch.cuda.get_device_properties(0).multi_processor_count)
for mod in ("pytest", "ninja", "pybind11", "cmake"):
    __import__(mod)
EOF
  if command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer: $(command -v compute-sanitizer)"
  else
    echo "compute-sanitizer: not found (sanitizer stages will be skipped)"
  fi
}
export PY
export -f preflight
if ! stage preflight 60 bash -c preflight; then
  summary
  exit 1
fi

if ! stage build "${BUILD_TIMEOUT:-240}" "$PY" setup.py build_ext --inplace --build-temp build/gpu_check; then
  summary
  exit 1
fi
stage import 60 "$PY" -c "import pagedkv, torch; assert pagedkv.built_with_cuda, 'built without CUDA'; print('cuda ops:', torch._C._dispatch_dump('pagedkv::paged_attention_v1').count('CUDA'))"

# ptxas figures and spill check: CPU-only work, run beside the GPU stages.
PTXAS_START=$SECONDS
timeout 300 "$PY" scripts/ptxas_report.py --arch sm_90 --check-spills >"$LOG_DIR/ptxas.log" 2>&1 &
PTXAS_PID=$!

stage tests "${TEST_TIMEOUT:-180}" "$PY" -m pytest -q -rs -p no:cacheprovider --maxfail=30 \
  tests/test_cuda.py tests/test_index_checks.py tests/test_device_errors.py --junitxml="$LOG_DIR/test_cuda.xml"
# The engine on CUDA against HF transformers on the same device (a tiny random Llama: no model package needed),
# decode steps through captured CUDA graphs and eagerly; with 2+ GPUs, tensor-parallel sizes 2/4/8 against size 1.
stage engine "${ENGINE_TIMEOUT:-120}" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_engine_cuda.py

if command -v compute-sanitizer >/dev/null 2>&1; then
  # No caching allocator: memcheck then sees each tensor's own bounds.
  stage memcheck "${SANITIZER_TIMEOUT:-120}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer \
    --tool memcheck --error-exitcode 1 "$PY" scripts/sanitizer_smoke.py
  stage racecheck "${SANITIZER_TIMEOUT:-120}" compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$PY" scripts/sanitizer_smoke.py
else
  record memcheck skipped - 0 "compute-sanitizer not found"
  record racecheck skipped - 0 "compute-sanitizer not found"
fi

if [ "${SKIP_BENCH:-0}" = "1" ]; then
  record bench skipped - 0 "SKIP_BENCH=1"
elif [ -f bench/bench_kernels.py ]; then
  stage bench "${BENCH_TIMEOUT:-150}" "$PY" bench/bench_kernels.py --device cuda --json "$LOG_DIR/kernels_cuda.json"
  stage v1v2 "${SWEEP_TIMEOUT:-90}" "$PY" bench/bench_kernels.py --device cuda --v1-vs-v2 \
    --json "$LOG_DIR/v1_vs_v2_cuda.json"
  # A target row that misses (or any row whose verdict is not PASS/empty) fails the run.
  stage targets 30 "$PY" - "$LOG_DIR/kernels_cuda.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1])).get("decode", [])
targets = [r for r in rows if r.get("target")]
bad = [r for r in rows if r.get("verdict") not in ("", "PASS", None)]
for r in bad:
    print("MISS:", {k: r.get(k) for k in ("dtype", "heads", "batch", "context", "pct_copy_bw", "sdpa_over_ours",
                                          "gather_over_ours", "max_abs_diff", "verdict")})
print(f"{len(targets) - sum(r in bad for r in targets)}/{len(targets)} target rows PASS, {len(bad)} rows missed")
sys.exit(1 if bad or not targets else 0)
EOF
else
  record bench skipped - 0 "no bench/bench_kernels.py"
fi

wait "$PTXAS_PID"
PTXAS_RC=$?
if [ "$PTXAS_RC" -eq 0 ]; then
  record ptxas ok 0 $((SECONDS - PTXAS_START)) "0 spills (table in ptxas.log)"
else
  record ptxas FAILED "$PTXAS_RC" $((SECONDS - PTXAS_START)) "spills or compile error, see ptxas.log"
fi
tail -n 5 "$LOG_DIR/ptxas.log"

summary
exit $?
