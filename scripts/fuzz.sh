#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser: builds tests/fuzz/fuzz_*.cpp with clang + libFuzzer +
# ASan/UBSan into build-fuzz/ and runs each target for SECONDS (default 600) on a copy of its seed
# corpus, with a 10 s per-input timeout and a 2 GB RSS limit. New inputs that raised coverage are
# kept in build-fuzz/corpus/<name>/ (merge the useful ones into tests/fuzz/corpus/<name>/); a
# crash, hang or out-of-memory input is written to build-fuzz/findings/<name>/ and the script exits
# non-zero. Add such an input to tests/fuzz/regressions/<name>/ once fixed: CI replays it.
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-600}
shift || true
if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y -qq clang libclang-rt-14-dev libomp-dev >/dev/null
fi
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLATHE_FUZZ=ON \
  ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER} >/dev/null
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in tests/fuzz/fuzz_*.cpp; do n=$(basename "$f" .cpp); targets+=("${n#fuzz_}"); done
fi
cmake --build build-fuzz -j"$(nproc)" --target $(printf 'fuzz_%s ' "${targets[@]}")
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export OMP_NUM_THREADS=1
status=0
for t in "${targets[@]}"; do
  mkdir -p build-fuzz/corpus/$t build-fuzz/findings/$t
  cp -n tests/fuzz/corpus/$t/* build-fuzz/corpus/$t/ 2>/dev/null || true
  dict=(); [ -f tests/fuzz/dict/$t.dict ] && dict=(-dict=tests/fuzz/dict/$t.dict)
  echo "== fuzz_$t: ${SECONDS_EACH} s"
  if ./build-fuzz/tests/fuzz/fuzz_$t build-fuzz/corpus/$t "${dict[@]}" -max_total_time="$SECONDS_EACH" -timeout=10 \
      -rss_limit_mb=2048 -max_len=65536 -artifact_prefix=build-fuzz/findings/$t/ -print_final_stats=1 \
      > build-fuzz/fuzz_$t.log 2>&1; then
    echo "   no finding: $(grep -E 'stat::number_of_executed_units' build-fuzz/fuzz_$t.log | awk '{print $2}') runs, corpus $(ls build-fuzz/corpus/$t | wc -l) inputs"
  else
    status=1
    echo "   FINDING (see build-fuzz/fuzz_$t.log):"; grep -E "ERROR|SUMMARY|Test unit written" build-fuzz/fuzz_$t.log | head -5
  fi
done
exit $status
