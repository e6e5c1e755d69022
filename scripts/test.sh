#!/usr/bin/env bash
# The README's test command (and CI's, via .ci/run): installs everything, builds with
# warnings as errors, generates the real-checkpoint fixtures with torch/peft/verl, runs the
# whole ctest suite, then a short smoke run of the libFuzzer targets (built with clang).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_PYTHON=1 WERROR=1 scripts/setup.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j 2 --timeout 1800

if command -v clang++ >/dev/null; then
  FUZZ_DIR=${BUILD_DIR:-build}-fuzz
  cmake -S . -B "$FUZZ_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DSHARDMERGE_CUDA=OFF -DSHARDMERGE_FUZZ=ON >/dev/null
  cmake --build "$FUZZ_DIR" -j "$(nproc)" --target shardmerge_fuzzers
  ctest --test-dir "$FUZZ_DIR" --output-on-failure -R '^fuzz\.'
else
  echo "test: clang++ not found: fuzz smoke run skipped"
fi
