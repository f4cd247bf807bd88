#!/usr/bin/env bash
# The main job: install, build, tokenize the bundled corpus byte-level into a Megatron dataset,
# train a small GPT-2 on it (configs/quickstart.yaml), evaluate and sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # the runtime only (scripts/setup.sh --test adds what the tests need)
# CPU-only (CUDA: README, "CUDA backend"); the binary only, so GoogleTest / benchmark are not needed.
BUILD_TARGET=lathe bash scripts/build.sh -DLATHE_CUDA=OFF -DLATHE_BUILD_TESTS=OFF -DLATHE_BUILD_BENCH=OFF
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
./build/lathe tokenize --tokenizer byte --input data/tinyshakespeare.txt --output data/shakespeare_byte --overwrite
./build/lathe train configs/quickstart.yaml $([[ " $* " == *" --resume"* ]] || echo --overwrite) "$@"  # a rerun replaces runs/quickstart (moved aside)
./build/lathe generate --model runs/quickstart/model --prompt "ROMEO:" --max-new-tokens 200 --seed 1
