#!/usr/bin/env bash
# Configures and builds lathe into ${BUILD_DIR:-build} (Release); BUILD_TARGET=lathe builds only the
# binary (several targets: space-separated). Extra args go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
# shellcheck disable=SC2086  # BUILD_TARGET may name several targets
cmake --build "$BUILD_DIR" -j"$(nproc)" ${BUILD_TARGET:+--target $BUILD_TARGET}
