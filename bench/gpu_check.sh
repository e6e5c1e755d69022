#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, run the CUDA unit tests (which compare the CUDA
# executor with the CPU executor byte for byte), then the GPU benchmark table. Fits a 10-minute
# window on one H200: build ~3 min on 16 cores, tests < 1 min, benchmark ~3 min.
#   bash bench/gpu_check.sh            # results also under $OUT (default ./gpu-check-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BUILD_DIR=${BUILD_DIR:-build-gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

missing=()
for p in cmake pkg-config nlohmann-json3-dev libcli11-dev libgtest-dev libopenblas-dev libzstd-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_check: installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

echo "== build (CUDA ON, sm_90)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DSHARDMERGE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build "$BUILD_DIR" -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }

echo "== GPU unit tests"
"$BUILD_DIR/tests/shardmerge_unit_tests" --gtest_filter='Cuda*:KernelMath*:DeviceChoice*' \
  --gtest_brief=1 2>&1 | tee "$OUT/unit.log" | tail -25
unit_rc=${PIPESTATUS[0]}

echo "== CLI on the GPU: merge + verify a synthetic checkpoint"
work=${WORK:-/tmp/shardmerge-gpu}
rm -rf "$work/ckpt" "$work/out"; mkdir -p "$work"
"$BUILD_DIR/bench/shardmerge-gen" --model qwen2.5-0.5b --world-size 8 --lora-rank 16 --out "$work/ckpt" >/dev/null &&
  "$BUILD_DIR/shardmerge" merge --local_dir "$work/ckpt" --target_dir "$work/out" --force --device cuda --lora fold \
    --verify 2>&1 | tee "$OUT/cli.log" | tail -4
cli_rc=${PIPESTATUS[0]}

echo "== benchmark"
"$BUILD_DIR/bench/shardmerge-gpu-bench" --work "$work" --model qwen2.5-1.5b --world-size 8 --lora-rank 64 \
  --out "$OUT/table.txt" 2>&1 | tee "$OUT/bench.log" | tail -40
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: unit rc=$unit_rc cli rc=$cli_rc bench rc=$bench_rc"
[ "$unit_rc" = 0 ] && [ "$cli_rc" = 0 ] && [ "$bench_rc" = 0 ]
