#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with everything bench/device_check.sh carries to the H200, in one
# command, on the development machine (x86-64, PyPI reachable, CUDA 13's nvcc for the
# prebuilt FlashInfer modules; no GPU needed). Usage, from the repository root:
#
#     bash bench/prepare_device_carry.sh [python]      # python: one with torch (the venv's)
#
# then: run(command="bash bench/device_check.sh", carry=[".whl"], timeout_s=500).
# Fails when the carried tree (tracked files + .whl) would not fit the device tool's 64 MiB.
# Steps whose output is already there are skipped, so a rerun only redoes what is missing.
set -euo pipefail
PY=${1:-python}
cd "$(git rev-parse --show-toplevel)"
W=.whl
DL=${TMPDIR:-/tmp}/agspec-device-dl
DEV=${DEV_TRAJECTORIES:-../shared/data/trajectories/dev}
mkdir -p "$W" "$DL"
grep -qx '/.whl/' .gitignore || { echo ".gitignore must list /.whl/" >&2; exit 1; }

# wheels for the device image's Python 3.12 (manylinux x86-64), never installed here
P=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
FI=flashinfer_python-0.7.2.post1-py3-none-any.whl
TVM_FFI="apache-tvm-ffi>=0.1.11,<0.2"  # what FlashInfer 0.7.2.post1 requires
ls "$W"/apache_tvm_ffi-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${P[@]}" -d "$W" "$TVM_FFI"
ls "$W"/nvtx-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${P[@]}" -d "$W" nvtx==0.2.17
# pytest-xdist (and its execnet): device_check.sh's GPU tests on four workers (~0.1 MB)
ls "$W"/pytest_xdist-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${P[@]}" -d "$W" \
  pytest-xdist==3.8.0 execnet==2.1.2
[ -f "$DL/$FI" ] || "$PY" -m pip download -q --no-deps --only-binary=:all: "${P[@]}" -d "$DL" \
  flashinfer-python==0.7.2.post1
# 62 MB -> ~24 MB: only the kernel sources the modules below compile from
[ -f "$W/$FI" ] || "$PY" bench/prune_flashinfer_wheel.py "$DL/$FI" "$W/"
ls "$W"/arctic_inference-*.tar.gz >/dev/null 2>&1 || "$PY" -m pip download -q --no-deps \
  --no-binary :all: --no-build-isolation -d "$W" arctic-inference==0.3.0

# the sessions the e2e replays (../shared does not travel) and dev half 0's global tier
cp -f "$DEV"/*.jsonl.gz "$W"/
# rebuilt every time (5 s): one kept from an older checkout may follow another split of the
# halves (before 2026-12-04: by session id) or record no tasks to refuse a leak with
"$PY" -m agspec_gpu build-global --trajectories "$DEV" --half 0 -o "$DL/dev-half0.agspec"
gzip -c "$DL/dev-half0.agspec" >"$W/dev-half0.agspec.gz"

# FlashInfer's modules compiled here for sm_90a (no nvcc minutes on the device). They link
# against libcuda, which a machine without a driver lacks: an empty stub with the driver's
# soname serves (the device's driver provides the real library at load time).
if [ ! -d "$W/flashinfer-aot" ]; then
  SITE=$DL/site
  # FlashInfer's import-time dependencies, for this machine's Python (torch: the venv's)
  if [ ! -d "$SITE/flashinfer" ]; then
    "$PY" -m pip install -q --target "$SITE" "$TVM_FFI" nvidia-ml-py einops click tabulate ninja
    "$PY" -m pip install -q --no-deps --target "$SITE" "$DL/$FI"
  fi
  CUDA=${CUDA_HOME:-$(ls -d /usr/local/cuda-13* 2>/dev/null | tail -n1)}
  if [ -x "$CUDA/bin/nvcc" ]; then
    HOME_SHADOW=$DL/cuda-home  # CUDA_HOME with lib64/stubs/libcuda.so added, system untouched
    mkdir -p "$HOME_SHADOW/lib64/stubs"
    for e in "$CUDA"/*; do [ "$(basename "$e")" = lib64 ] || ln -sfn "$e" "$HOME_SHADOW/"; done
    for e in "$CUDA"/lib64/*; do ln -sfn "$e" "$HOME_SHADOW/lib64/"; done
    [ -f "$HOME_SHADOW/lib64/stubs/libcuda.so" ] || echo 'void agspec_stub(void) {}' | \
      gcc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 -o "$HOME_SHADOW/lib64/stubs/libcuda.so"
    CUDA_HOME=$HOME_SHADOW FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-2} \
      PYTHONPATH=$SITE "$PY" bench/prebuild_flashinfer.py "$W/flashinfer-aot.tmp"
    mv "$W/flashinfer-aot.tmp" "$W/flashinfer-aot"
  else
    echo "no CUDA 13 nvcc (set CUDA_HOME): the device will JIT-compile FlashInfer (minutes)" >&2
  fi
fi

# the carry limit: the tracked tree plus .whl/ (64 MiB)
TREE=$(git ls-files -z | du -cb --files0-from=- | tail -n1 | cut -f1)
WHL=$(du -sb "$W" | cut -f1)
echo "carry: tree $((TREE >> 20)) MiB + .whl $((WHL >> 20)) MiB (limit 64 MiB)"
ls -la "$W"
[ $((TREE + WHL)) -lt $((64 << 20)) ] || { echo "over the 64 MiB carry limit" >&2; exit 1; }
