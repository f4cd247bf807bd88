#!/usr/bin/env bash
# The test suite: install, build (Release), run every test with CTest; then build the C++ unit
# tests with AddressSanitizer + UndefinedBehaviorSanitizer and run them too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
export OMP_NUM_THREADS=2
# ctest -j2 runs two tests at once on 2 cores: spinning OpenMP workers (lathe's default ACTIVE wait
# policy, fastest on dedicated cores) would then take each other's time slices, and a small
# training test ran at ~2 s/step instead of ~0.15 s. Tests measure results, not speed: wait passively.
export OMP_WAIT_POLICY=PASSIVE
(cd build && ctest --output-on-failure -j2 --timeout 900)
if [ "${LATHE_SKIP_SANITIZE:-0}" != 1 ]; then
  BUILD_DIR=build-asan bash scripts/build.sh -DLATHE_SANITIZE=ON -DLATHE_BUILD_BENCH=OFF
  # Python-driven tests exercise the same code through the Release binary; under the sanitizers
  # run the C++ unit tests (kernels, data, optim, io, config, tokenizer, models).
  (cd build-asan && ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -j2 --timeout 1800 -E '^py_')
fi
