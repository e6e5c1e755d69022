#!/usr/bin/env bash
# The README's test command (and CI's, via .ci/run): installs everything, builds with
# warnings as errors, generates the real-checkpoint fixtures with torch/peft/verl, runs the
# whole ctest suite, builds the pip wheel and runs its tests in a fresh venv
# (scripts/test_wheel.sh), runs the unit tests again built with AddressSanitizer and UBSan, then a
# short smoke run of the libFuzzer targets (built with clang, also under both sanitizers).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
WITH_PYTHON=1 WERROR=1 scripts/setup.sh
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 --timeout 1800
# The pip wheel, installed into a fresh venv, and the Python package's tests run there.
SHARDMERGE_FIXTURES="$PWD/$BUILD_DIR/fixtures" SHARDMERGE_GEN="$PWD/$BUILD_DIR/bench/shardmerge-gen" scripts/test_wheel.sh

# Only the unit-test target (and the binary its CLI tests run) is built under the sanitizers,
# at -O0 with asserts on: the extra build is the largest part of the extra time (-O1 compiled
# 30-40 % slower; the suites then ran in 24 s, at -O0 in about a minute). The unit
# tests read the fixtures the main build generated. -fno-sanitize-recover makes any UB report
# fatal. No -Werror here: GCC's flow warnings are noisy with the sanitizers.
ASAN_DIR=$BUILD_DIR-asan
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
cmake -S . -B "$ASAN_DIR" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O0 -g1" \
  -DCMAKE_CXX_FLAGS="-fno-omit-frame-pointer $sanitize" -DCMAKE_EXE_LINKER_FLAGS="$sanitize" -DSHARDMERGE_CUDA=OFF >/dev/null
cmake --build "$ASAN_DIR" -j "$(nproc)" --target shardmerge_unit_tests
# The executors count the process's resident memory against --memory-limit; ASan's default
# 256 MiB quarantine of freed blocks would push it past the limits the tests use, and so would
# what earlier suites left resident in one long process: one process per suite, two at a time.
"$ASAN_DIR/tests/shardmerge_unit_tests" --gtest_list_tests | awk '/^[^ ]/ { print $1 "*" }' |
  ASAN_OPTIONS=quarantine_size_mb=32 SHARDMERGE_FIXTURES="$PWD/$BUILD_DIR/fixtures" \
  xargs -P 2 -I{} "$ASAN_DIR/tests/shardmerge_unit_tests" --gtest_brief=1 --gtest_filter={}

if command -v clang++ >/dev/null; then
  FUZZ_DIR=$BUILD_DIR-fuzz
  cmake -S . -B "$FUZZ_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DSHARDMERGE_CUDA=OFF -DSHARDMERGE_FUZZ=ON >/dev/null
  cmake --build "$FUZZ_DIR" -j "$(nproc)" --target shardmerge_fuzzers
  ctest --test-dir "$FUZZ_DIR" --output-on-failure -j 2 -R '^fuzz\.'
else
  echo "test: clang++ not found: fuzz smoke run skipped"
fi
