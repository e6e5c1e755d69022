#!/usr/bin/env bash
# The README's first command: set up, then merge the bundled demo checkpoint (a real verl
# FSDP2 run root: Qwen2-shaped tiny model, 2 ranks) and check the result bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=shardmerge scripts/setup.sh
BIN=${BUILD_DIR:-build}/shardmerge
OUT=${1:-demo-merged}
echo
"$BIN" inspect demo
echo
"$BIN" merge --local_dir demo --target_dir "$OUT" --force --verify
echo
echo "demo: the merged HuggingFace model is in $OUT:"
ls -l "$OUT"
