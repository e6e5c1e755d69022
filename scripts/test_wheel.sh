#!/usr/bin/env bash
# Builds the wheel the way a user's `pip wheel .` does (build isolation, scikit-build-core from
# PyPI, only the CLI target: no tests, no benchmarks), installs it into a fresh venv and runs
# tests/python there, so the installed package is what is tested, never the build tree.
# Skips, saying so, when python3 with venv is missing. SHARDMERGE_FIXTURES (default
# build/fixtures) feeds the tests that merge a real checkpoint; SHARDMERGE_GEN (default
# build/bench/shardmerge-gen) writes the larger synthetic checkpoint of the API's interrupt test.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  echo "test_wheel: python3 with venv not found: wheel tests skipped"
  exit 0
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/shardmerge-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py=$work/venv/bin/python
"$py" -m pip install -q --upgrade pip pytest
# ccache (when present) makes a rebuild of an unchanged tree cheap; the build dir is a fresh temp dir.
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
start=$SECONDS
CMAKE_ARGS="${launcher[*]}" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$py" -m pip wheel -q --no-deps -w "$work/dist" "$repo"
"$py" -m pip install -q "$work"/dist/shardmerge-*.whl
echo "test_wheel: wheel built and installed in $((SECONDS - start)) s"
cd "$work"  # not the repo root: `import shardmerge` must find the installed package
SHARDMERGE_VERL_PYTHON=${SHARDMERGE_VERL_PYTHON:-$( [ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" )} \
  SHARDMERGE_GEN=${SHARDMERGE_GEN:-$repo/build/bench/shardmerge-gen} \
  SHARDMERGE_FIXTURES=${SHARDMERGE_FIXTURES:-$repo/build/fixtures} "$py" -m pytest -q -p no:cacheprovider --basetemp "$work/pytest" "$repo/tests/python"
