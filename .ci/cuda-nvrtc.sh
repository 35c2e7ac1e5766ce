#!/usr/bin/env bash
# CI for the `cuda` feature on a machine without a GPU (docs/CUDA.md):
# installs NVRTC from the PyPI wheel nvidia-cuda-nvrtc-cu12 (libnvrtc.so.12 and
# its builtins, no toolkit, no driver) into a cache under the cargo target dir,
# points the loader at it, and runs tests/cuda.rs with MEMPLAN_REQUIRE_NVRTC=1,
# so every kernel in kernels/ must compile with NVRTC (a skip is a failure), and
# MEMPLAN_REQUIRE_CXX=1, so the launchers and kernels also run on the host
# emulation (c++) against the CPU kernels. The GPU tests print why they skip.
#
# Environment:
#   MEMPLAN_NVRTC_WHEEL  a wheel file to install instead of downloading
#                        (offline machines: `pip download nvidia-cuda-nvrtc-cu12 --no-deps`)
#   MEMPLAN_NVRTC_DIR    install directory (default: ${CARGO_TARGET_DIR:-target}/nvrtc)
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=12.9.86
dir="${MEMPLAN_NVRTC_DIR:-${CARGO_TARGET_DIR:-target}/nvrtc}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
lib="$dir/nvidia/cuda_nvrtc/lib"
if [ ! -e "$lib/libnvrtc.so.12" ]; then
    src="${MEMPLAN_NVRTC_WHEEL:-nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION}"
    python3 -m pip install --quiet --no-deps --target "$dir" "$src"
fi
test -e "$lib/libnvrtc.so.12" || { echo "cuda-nvrtc: no libnvrtc.so.12 under $lib" >&2; exit 1; }
# cudarc dlopens "libnvrtc.so.12" (one of the names it tries); NVRTC dlopens its
# builtins library by name too: both are found through LD_LIBRARY_PATH.
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
MEMPLAN_REQUIRE_NVRTC=1 MEMPLAN_REQUIRE_CXX=1 cargo test --features cuda --test cuda --test cuda_step -- --nocapture
echo "cuda-nvrtc: ok"
