#!/usr/bin/env bash
# Installs what lathe needs on Debian 12 (idempotent; run as root or with sudo).
#   bash scripts/setup.sh          the runtime: compiler, CMake and the libraries the `lathe` binary
#                                  links (what scripts/quickstart.sh needs; no Python)
#   bash scripts/setup.sh --test   the runtime and the test extras: GoogleTest/benchmark, Python
#                                  with torch/numpy (the oracles), the PyPI oracles, llama-cpp-python,
#                                  Chromium, cuDNN frontend headers (what scripts/test.sh needs)
set -euo pipefail
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    -h | --help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected nothing or --test)" >&2; exit 2 ;;
  esac
done
RUNTIME_PKGS=(build-essential cmake pkg-config git
      libopenblas-openmp-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libfmt-dev
      libsentencepiece-dev libpcre2-dev libzstd-dev zlib1g-dev zstd openmpi-bin libopenmpi-dev libdnnl-dev)
# sentencepiece (spm_train/spm_encode): tokenizer oracle; libjemalloc2: PyTorch's allocator in bench/;
# ca-certificates: pip's downloads; python3-venv, ninja-build: tests/python/test_package.py's venv and
# the pip build of the extension (scikit-build-core, offline, takes CMake and Ninja from the system).
TEST_PKGS=(libgtest-dev libgmock-dev libbenchmark-dev sentencepiece libjemalloc2 ca-certificates
      python3 python3-pip python3-venv python3-numpy python3-torch python3-pil chromium ninja-build)
PKGS=("${RUNTIME_PKGS[@]}")
[ "$TEST" = 1 ] && PKGS+=("${TEST_PKGS[@]}")
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  # The runtime needs none of its packages' recommends (gfortran, Mesa/X11 libraries, OpenCL headers,
  # GnuPG, manuals: 108 more packages, 71 MB more to download); the test extras keep them.
  NOREC=(--no-install-recommends)
  [ "$TEST" = 1 ] && NOREC=()
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${NOREC[@]}" "${missing[@]}" >/dev/null
fi
[ "$TEST" = 1 ] || exit 0
# PyPI oracles for the tokenizer tests, installed into Debian's python3 (the one with torch).
PY=/usr/bin/python3
# The packages import, and those whose version others can move (transformers pulls in its own
# tokenizers range) are at their pins; otherwise (re)install requirements-test.txt.
if ! $PY -c "import importlib.metadata as m, tokenizers, sentencepiece, transformers, safetensors, gguf
assert (m.version('tokenizers'), m.version('transformers'), m.version('gguf')) == ('0.20.3', '4.45.2', '0.10.0')
import onnx, onnxruntime, tensorboard
assert (m.version('onnx'), m.version('onnxruntime')) == ('1.17.0', '1.20.1')
assert m.version('tensorboard') == '2.20.0'
import scikit_build_core, nanobind
assert (m.version('scikit-build-core'), m.version('nanobind')) == ('1.1.2', '3.1.0')" 2>/dev/null; then
  echo "setup: installing PyPI packages of requirements-test.txt for $PY"
  $PY -m pip install -q --break-system-packages -r "$(dirname "$0")/requirements-test.txt"
fi
# llama.cpp (llama-cpp-python) for the GGUF tests: a separate step because pip compiles llama.cpp
# (minutes; the wheel is cached in ~/.cache/pip afterwards), see requirements-llama-cpp.txt.
if ! $PY -c "import importlib.metadata as m, llama_cpp
assert m.version('llama_cpp_python') == '0.3.36'" 2>/dev/null; then
  echo "setup: building llama-cpp-python (llama.cpp from source; first time only, minutes) for $PY"
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" $PY -m pip install -q --break-system-packages \
    -r "$(dirname "$0")/requirements-llama-cpp.txt"
fi
# cuDNN's frontend headers (header-only C++; the CUDA build's model.attention_kernel: cudnn,
# src/kernels/cuda/attention_cudnn.cpp): taken from the nvidia-cudnn-frontend wheel on PyPI (its
# include/ folder) into /usr/local/include/cudnn-frontend/include, where CMake looks. Only where a CUDA
# toolkit with cuDNN is installed; without them the option is refused at run time.
if [ -f /usr/local/cuda/include/cudnn.h ] && [ ! -f /usr/local/include/cudnn-frontend/include/cudnn_frontend.h ]; then
  echo "setup: installing cuDNN frontend headers 1.32.0 into /usr/local/include/cudnn-frontend/include"
  tmp=$(mktemp -d)
  # Not fatal: without the headers the CUDA build compiles the option as a refusal naming the fix.
  $PY -m pip download -q --no-deps nvidia-cudnn-frontend==1.32.0 -d "$tmp" ||
    echo "setup: could not download nvidia-cudnn-frontend: model.attention_kernel: cudnn stays unavailable"
  ls "$tmp"/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1 && $SUDO $PY - "$tmp" <<'PYEOF'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "nvidia_cudnn_frontend-*.whl"))[0]
dst = "/usr/local/include/cudnn-frontend/include"  # its headers include "../include/..."
with zipfile.ZipFile(whl) as z:
    for m in z.namelist():
        if m.startswith("include/") and not m.endswith("/"):
            p = os.path.join(dst, m[len("include/"):])
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(z.read(m))
PYEOF
  rm -rf "$tmp"
fi
