#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, run every CUDA and kernel unit-test suite (which
# compare the CUDA executor with the CPU executor byte for byte), a CLI merge + verify on the
# GPU, then the GPU benchmark table. Fits a 10-minute window on one H200: build ~3 min on 16
# cores, tests < 1 min, benchmark ~3 min.
#   bash bench/gpu_check.sh    # results under $OUT (default ./gpu-check-out)
# A machine that cannot install packages (the lent GPU machines reach no registry) can be given a
# prebuilt build instead: $BUILD_DIR holding shardmerge, tests/shardmerge_unit_tests,
# bench/shardmerge-gen, bench/shardmerge-gpu-bench and lib/ (shared libraries the machine lacks)
# but no CMakeCache.txt is used as it is. SHARDMERGE_FIXTURES (default build/fixtures, from
# tests/fixtures/generate.py) adds the fixture suite: every real fixture merged on the GPU under
# compute-sanitizer memcheck, compared with the CPU executor's tree (tests/e2e/test_cuda_fixtures.py).
# Writes $OUT/gpu_check.txt (one table: every step and every suite run, with counts) and
# $OUT/gpu_check.json (the same as data), beside the logs. The suites are the ones
# `--gtest_list_tests` lists whose names say CUDA, GPU, kernel or device, so a suite added or
# renamed later is still run (NcclGpuLink among them: the NCCL data plane's rounds on one GPU, and
# between GPUs where there are two or more). Exit: 0 all passed, 1 something failed, 3 no GPU is present (the
# build and the suites still run, and say so: every GPU test then skips).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BUILD_DIR=${BUILD_DIR:-build-gpu}
SUITE_PATTERN='cuda|gpu|kernel|device'

# --- the GPU, or why there is none
gpu="none"
if gpu_list=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) && [ -n "$gpu_list" ]; then
  gpu=$(echo "$gpu_list" | head -1)
  echo "$gpu_list" | tee "$OUT/gpu.txt"
else
  why=$(echo "${gpu_list:-nvidia-smi printed nothing}" | head -1)
  echo "gpu_check: NO GPU PRESENT ($why): the GPU tests will skip and the GPU steps will not run" | tee "$OUT/gpu.txt"
fi

# cuBLAS and NCCL are loaded at run time (kernels/cublas_api.cpp, src/exec/dist/nccl_api.cpp):
# find them where the toolkit or a wheel put them.
find_lib() {
  find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu /opt -name "$1" 2>/dev/null | head -1
}
cublas=$(find_lib 'libcublas.so.1[0-9]*')
nccl=$(find_lib 'libnccl.so.2*')
for lib in "$cublas" "$nccl"; do
  [ -n "$lib" ] && LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export LD_LIBRARY_PATH="$PWD/$BUILD_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "gpu_check: cuBLAS ${cublas:-not found}; NCCL ${nccl:-not found}"

build_rc=0
if [ -x "$BUILD_DIR/shardmerge" ] && [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  build="prebuilt"
  echo "== prebuilt binaries in $BUILD_DIR"
  "$BUILD_DIR/shardmerge" --version >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; build_rc=1; }
else
  build="built"
  missing=()
  for p in cmake pkg-config nlohmann-json3-dev libcli11-dev libgtest-dev libopenblas-dev libzstd-dev libisal-dev zlib1g-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check: installing ${missing[*]}"
    timeout 120 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  echo "== build (CUDA ON, sm_90)"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DSHARDMERGE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; build_rc=1; }
  if [ "$build_rc" = 0 ]; then
    cmake --build "$BUILD_DIR" -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; build_rc=1; }
  fi
fi

# --- unit suites: every CUDA / GPU / kernel / device suite the binary lists
unit_rc=1
suites=()
unit_bin="$BUILD_DIR/tests/shardmerge_unit_tests"
if [ "$build_rc" = 0 ]; then
  mapfile -t suites < <("$unit_bin" --gtest_list_tests 2>/dev/null |
    awk '/^[^ ]/ { sub(/\.$/, "", $1); print $1 }' | grep -iE "$SUITE_PATTERN" | sort -u)
  if [ ${#suites[@]} = 0 ]; then
    echo "gpu_check: the unit-test binary lists no CUDA/GPU/kernel/device suite" | tee "$OUT/unit.log"
  elif ! printf '%s\n' "${suites[@]}" | grep -q '^Cuda'; then
    echo "gpu_check: no Cuda* suite: this build has no CUDA executor (see $OUT/cmake.log)" | tee "$OUT/unit.log"
  else
    echo "== GPU unit tests: ${suites[*]}"
    filter=$(printf '%s.*:' "${suites[@]}")
    SHARDMERGE_FIXTURES=${SHARDMERGE_FIXTURES:-$PWD/build/fixtures} SHARDMERGE_BIN="$PWD/$BUILD_DIR/shardmerge" "$unit_bin" --gtest_filter="${filter%:}" 2>&1 | tee "$OUT/unit.log" | grep -E '^\[  (FAILED|PASSED|SKIPPED) |tests? ran' | tail -25
    unit_rc=${PIPESTATUS[0]}
  fi
fi

# --- the CLI on the GPU
cli_rc=skipped
work=${WORK:-/tmp/shardmerge-gpu}
if [ "$gpu" != none ] && [ "$build_rc" = 0 ]; then
  echo "== CLI on the GPU: merge + verify a synthetic checkpoint"
  rm -rf "$work/ckpt" "$work/out"; mkdir -p "$work"
  # The CUDA context and cuBLAS count against --memory-limit (several hundred MiB of host memory).
  "$BUILD_DIR/bench/shardmerge-gen" --model qwen2.5-0.5b --world-size 8 --lora-rank 16 --out "$work/ckpt" >/dev/null &&
    "$BUILD_DIR/shardmerge" merge --local_dir "$work/ckpt" --target_dir "$work/out" --force --device cuda --lora fold \
      --memory-limit 2GiB --verify 2>&1 | tee "$OUT/cli.log" | tail -4
  cli_rc=${PIPESTATUS[0]}
fi

# --- the fixture suite: every real fixture on the GPU, under memcheck where compute-sanitizer is
fixtures_rc=skipped
fixtures=${SHARDMERGE_FIXTURES:-$PWD/build/fixtures}
if [ "$gpu" != none ] && [ "$build_rc" = 0 ] && [ -f "$fixtures/manifest.json" ]; then
  wrapper=""
  if command -v compute-sanitizer >/dev/null; then
    wrapper="compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20"
  fi
  echo "== fixture suite on the GPU (${wrapper:-no compute-sanitizer: plain})"
  SHARDMERGE_GPU_WRAPPER="$wrapper" SHARDMERGE_FIXTURES="$fixtures" SHARDMERGE_BIN="$PWD/$BUILD_DIR/shardmerge" \
    PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -ra -p no:cacheprovider tests/e2e/test_cuda_fixtures.py \
    2>&1 | tee "$OUT/fixtures.log" | tail -15
  fixtures_rc=${PIPESTATUS[0]}
fi

# --- the benchmark
bench_rc=skipped
if [ "$gpu" != none ] && [ "$build_rc" = 0 ]; then
  echo "== benchmark"
  "$BUILD_DIR/bench/shardmerge-gpu-bench" --work "$work" --model qwen2.5-1.5b --world-size 8 --lora-rank 64 \
    --out "$OUT/table.txt" 2>&1 | tee "$OUT/bench.log" | tail -40
  bench_rc=${PIPESTATUS[0]}
fi

# --- one table and one JSON
status_of() { case "$1" in 0) echo passed ;; skipped) echo skipped ;; *) echo "failed (rc $1)" ;; esac; }
# "passed failed skipped" of one suite, from gtest's per-test result lines ("[ ... ] S.T (N ms)").
counts_of() {
  local s=$1 r n=()
  for r in "       OK " "  FAILED  " "  SKIPPED "; do
    n+=("$(grep -cE "^\[$r\] $s\.[^ ]+ \(" "$OUT/unit.log" 2>/dev/null)")
  done
  echo "${n[*]}"
}
{
  printf '%-34s %-16s %7s %7s %8s\n' "step / suite" "status" "passed" "failed" "skipped"
  printf '%-34s %-16s\n' "gpu" "$gpu"
  printf '%-34s %-16s\n' "build ($BUILD_DIR, $build)" "$(status_of "$build_rc")"
  for s in "${suites[@]}"; do
    read -r p f k < <(counts_of "$s")
    st=passed; [ "$f" != 0 ] && st=failed; [ "$p" = 0 ] && [ "$f" = 0 ] && st=skipped
    printf '%-34s %-16s %7s %7s %8s\n' "  unit: $s" "$st" "$p" "$f" "$k"
  done
  printf '%-34s %-16s\n' "unit tests (all suites above)" "$(status_of "$unit_rc")"
  printf '%-34s %-16s\n' "cli merge --device cuda --verify" "$(status_of "$cli_rc")"
  printf '%-34s %-16s %s\n' "fixtures on the GPU (memcheck)" "$(status_of "$fixtures_rc")" \
    "$(grep -oE '[0-9]+ (passed|failed|skipped|error)' "$OUT/fixtures.log" 2>/dev/null | tr '\n' ' ')"
  printf '%-34s %-16s %s\n' "benchmark" "$(status_of "$bench_rc")" "$([ -f "$OUT/table.txt" ] && echo "(table.txt)")"
} > "$OUT/gpu_check.txt"
{
  printf '{\n  "gpu": %s,\n' "$([ "$gpu" = none ] && echo null || printf '"%s"' "${gpu//\"/}")"
  printf '  "build": "%s",\n  "unit": {"status": "%s", "suites": [' "$(status_of "$build_rc")" "$(status_of "$unit_rc")"
  sep=""
  for s in "${suites[@]}"; do
    read -r p f k < <(counts_of "$s")
    printf '%s\n    {"suite": "%s", "passed": %s, "failed": %s, "skipped": %s}' "$sep" "$s" "$p" "$f" "$k"
    sep=","
  done
  printf '\n  ]},\n  "cli": "%s",\n  "fixtures": "%s",\n  "benchmark": "%s"\n}\n' "$(status_of "$cli_rc")" \
    "$(status_of "$fixtures_rc")" "$(status_of "$bench_rc")"
} > "$OUT/gpu_check.json"
cat "$OUT/gpu_check.txt"

if [ "$gpu" = none ]; then
  echo "gpu_check: NO GPU PRESENT: nothing ran on a GPU (build rc=$build_rc, unit rc=$unit_rc); results in $OUT"
  exit 3
fi
echo "gpu_check: build=$build_rc unit=$unit_rc cli=$cli_rc fixtures=$fixtures_rc bench=$bench_rc; results in $OUT"
[ "$build_rc" = 0 ] && [ "$unit_rc" = 0 ] && [ "$cli_rc" = 0 ] && [ "$fixtures_rc" = 0 ] && [ "$bench_rc" = 0 ]
