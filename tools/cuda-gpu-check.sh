#!/usr/bin/env bash
# The GPU checks of the `cuda` feature on a machine with a GPU but maybe no cargo
# (docs/CUDA.md, "On a GPU"). Runs a test binary built elsewhere, tests/cuda.rs's
# (kernels, ops, models forward) or tests/cuda_step.rs's (training step, verify):
#
#   # on the build machine
#   cargo test --release --features cuda --test cuda --test cuda_step --no-run --message-format=json \
#     | python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("executable")]'
#   cp <those executables> gpu-carry/     # cuda-tests, cuda-step-tests; carry gpu-carry/
#   # on the GPU machine, once per binary
#   tools/cuda-gpu-check.sh gpu-carry/cuda-tests
#   tools/cuda-gpu-check.sh gpu-carry/cuda-step-tests
#
# memplan's cudarc bindings are CUDA 12.8 and open libnvrtc / libcublas by the
# names libnvrtc.so, libnvrtc.so.12, ... (never .so.13). This script finds the
# installed libraries (LD_LIBRARY_PATH, /usr/local/cuda, the system, and the
# nvidia-* Python wheels PyTorch brings), links them under the unversioned names
# cudarc tries first, and puts both that directory and the libraries' own
# directories (NVRTC dlopens its builtins by name) on LD_LIBRARY_PATH.
set -euo pipefail
bin="${1:?usage: tools/cuda-gpu-check.sh path/to/cuda-test-binary [test filter]}"
shift
links="${TMPDIR:-/tmp}/memplan-cuda-libs"
mkdir -p "$links"

dirs=()
IFS=: read -r -a env_dirs <<< "${LD_LIBRARY_PATH:-}"
dirs+=("${env_dirs[@]}" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/lib64)
while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null || true
import glob, site, sys
roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
seen = set()
for r in roots:
    for d in glob.glob(r + "/nvidia/**/lib", recursive=True):
        if d not in seen:
            seen.add(d)
            print(d)
PY
)

find_lib() { # $1: library stem, e.g. nvrtc; prints the newest versioned file found
    local d f
    for d in "${dirs[@]}"; do
        [ -n "$d" ] && [ -d "$d" ] || continue
        for f in $(ls -1 "$d"/lib"$1".so.[0-9]* 2>/dev/null | sort -V -r); do
            echo "$f"
            return 0
        done
    done
    return 1
}

extra=""
for stem in cuda nvrtc cublas cublasLt; do
    if f="$(find_lib "$stem")"; then
        ln -sf "$f" "$links/lib$stem.so"
        extra="$extra:$(dirname "$f")"
        echo "cuda-gpu-check: lib$stem -> $f"
    else
        echo "cuda-gpu-check: lib$stem not found" >&2
    fi
done
# Kept for later commands on this machine (tools/gpu-session.sh runs memplan with it).
echo "$links$extra" > "$links/ld-library-path"
export LD_LIBRARY_PATH="$links$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# The GPU tests (skips would mean the device did not open: the line says why).
"$bin" --test-threads=1 --nocapture "$@"
