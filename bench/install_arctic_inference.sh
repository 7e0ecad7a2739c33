#!/usr/bin/env bash
# Build and install arctic-inference (SuffixDecoding baseline) into the current Python
# environment, CPU-only and without touching torch. Idempotent: exits at once when the
# suffix decoding extension already imports. Usage: bench/install_arctic_inference.sh [python]
# See bench/INSTALL_SUFFIX_DECODING.md for why each step is needed.
set -euo pipefail

PY="${1:-python}"
VERSION="0.3.0"

if "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    echo "arctic-inference suffix decoding already installed"
    exit 0
fi

# setup.py imports torch at build time; it must be the environment's own torch, never one
# that pip downloads, so fail rather than let anything resolve it.
"$PY" -c "import torch" || { echo "torch must be installed first" >&2; exit 1; }

# Build requirements of the sdist that the suffix-tree extension needs (nanobind pinned as
# in its pyproject). grpcio-tools/protobuf only generate optional embedding-server stubs
# (their failure is caught by setup.py), and torch is already here: neither is installed.
"$PY" -m pip install "nanobind==2.9.2" wheel "setuptools>=61"
command -v cmake >/dev/null || "$PY" -m pip install --only-binary :all: "cmake>=3.18" ninja

# No build isolation (keeps the environment's torch), no dependencies (the base package has
# none; the vllm extras would pull torch). Without ARCTIC_INFERENCE_PRECOMPILED_OPS=1 only
# the C++ suffix tree (arctic_inference.suffix_decoding._C) is compiled: no CUDA.
unset ARCTIC_INFERENCE_PRECOMPILED_OPS
CMAKE_ARGS="-DPython_EXECUTABLE=$("$PY" -c 'import sys; print(sys.executable)')" \
    "$PY" -m pip install --no-deps --no-build-isolation \
    --no-binary arctic-inference "arctic-inference==${VERSION}"

"$PY" -c "import arctic_inference.suffix_decoding; print('arctic-inference suffix decoding OK')"
