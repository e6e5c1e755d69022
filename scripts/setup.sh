#!/usr/bin/env bash
# Installs what shardmerge needs on a fresh Debian/Ubuntu machine and builds it.
#   scripts/setup.sh            build tools + C++ dependencies, then build (Release)
#   WITH_PYTHON=1 scripts/setup.sh   also a venv (.venv) with torch/transformers/peft/verl/megatron-core
#                                    for the fixture generator and the end-to-end tests
# Environment: BUILD_DIR (default build), WERROR=1 (warnings are errors), CMAKE_ARGS, TARGETS (what to
# build, default all: the demo builds only the shardmerge binary).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
WITH_PYTHON=${WITH_PYTHON:-0}

packages=(build-essential cmake pkg-config nlohmann-json3-dev libcli11-dev libgtest-dev libopenblas-dev libzstd-dev libisal-dev zlib1g-dev
          libopenmpi-dev openmpi-bin)
[ "$WITH_PYTHON" = 1 ] && packages+=(python3 python3-venv clang)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release)
[ "${WERROR:-0}" = 1 ] && cmake_args+=(-DSHARDMERGE_WERROR=ON)
if [ "$WITH_PYTHON" = 1 ]; then
  if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
  echo "setup: installing the fixture producers into .venv (torch, transformers, peft, verl)"
  .venv/bin/pip install -q -r tests/fixtures/requirements.txt pytest pytest-xdist
  .venv/bin/pip install -q --no-deps -r tests/fixtures/requirements-verl.txt ||
    echo "setup: verl could not be installed: tests against verl's merger will skip"
  .venv/bin/pip install -q -r tests/fixtures/requirements-megatron.txt ||
    echo "setup: megatron-core could not be installed: the Megatron fixtures and their tests will skip"
  cmake_args+=(-DSHARDMERGE_PYTHON="$PWD/.venv/bin/python")
fi
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" "${cmake_args[@]}" ${CMAKE_ARGS:-} >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$(nproc)" ${TARGETS:+--target $TARGETS}
