#!/usr/bin/env bash
# Compile (and link) the sources against another torch's headers and libraries,
# without installing it: e.g. the torch 2.11 that GPU machines may carry.
#
#   pip download torch==2.11.0 --no-deps -d /tmp/t && (cd /tmp/t && python -m zipfile -e torch-*.whl x)
#   scripts/check_torch_compat.sh /tmp/t/x/torch [ON|OFF]    # second arg: build the CUDA sources (default ON if nvcc)
set -euo pipefail
TORCH_DIR=${1:?usage: $0 PATH/TO/torch [ON|OFF]}
CUDA=${2:-$([ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && echo ON || echo OFF)}
cd "$(dirname "$0")/.."
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
PY=${PYTHON:-python3}
CMAKE=$(dirname "$(command -v "$PY")")/cmake
[ -x "$CMAKE" ] || CMAKE=cmake
args=(-S . -B "$BUILD" -GNinja -DTORCH_DIR="$TORCH_DIR" -DPAGEDKV_OUTPUT_DIR="$BUILD/out"
      -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$PY")" -DPAGEDKV_CUDA="$CUDA")
if [ "$CUDA" = ON ]; then
  cuda_home=${CUDA_HOME:-/usr/local/cuda}
  args+=(-DCUDAToolkit_ROOT="$cuda_home" -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" -DCMAKE_CUDA_ARCHITECTURES=90-real)
fi
"$CMAKE" "${args[@]}" >/dev/null
"$CMAKE" --build "$BUILD" -j "${MAX_JOBS:-2}"
echo "built against $TORCH_DIR (CUDA=$CUDA): OK"
