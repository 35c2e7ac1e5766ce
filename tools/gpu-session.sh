#!/usr/bin/env bash
# The prepared GPU session (docs/CUDA.md, "The prepared GPU session"): every check
# that needs a GPU, in one run of about 10 minutes, writing what it measures under
# $OUT (default ./gpu-out).
#
#   # here (no GPU): build and strip what the GPU machine runs, into gpu-carry/
#   tools/gpu-session.sh prepare
#   # there (run it with carry: ["gpu-carry"]): run everything
#   tools/gpu-session.sh run [--gpu h200]
set -euo pipefail
cd "$(dirname "$0")/.."
carry=gpu-carry
case "${1:-}" in
prepare)
    rm -rf "$carry" && mkdir -p "$carry"
    cargo build --release --features cuda
    strip -o "$carry/memplan" target/release/memplan
    cargo test --release --features cuda --test cuda --test cuda_step --no-run --message-format=json \
        | python3 -c 'import json,sys
for m in map(json.loads, sys.stdin):
    if m.get("executable") and m.get("target", {}).get("name") in ("cuda", "cuda_step"):
        print(m["target"]["name"], m["executable"])' \
        | while read -r name exe; do strip -o "$carry/$name-tests" "$exe"; done
    du -sh "$carry"
    ;;
run)
    shift
    out="${OUT:-gpu-out}"
    mkdir -p "$out"
    nvidia-smi | tee "$out/nvidia-smi.txt" || true
    # 1. kernels, ops, models forward; the training step and verify (tests/cuda*.rs)
    tools/cuda-gpu-check.sh "$carry/cuda-tests" 2>&1 | tee "$out/cuda-tests.txt" || true
    tools/cuda-gpu-check.sh "$carry/cuda_step-tests" 2>&1 | tee "$out/cuda-step-tests.txt" || true
    # 2. verify --device cuda on models/ (the same library paths as step 1)
    export LD_LIBRARY_PATH="${TMPDIR:-/tmp}/memplan-cuda-libs:${LD_LIBRARY_PATH:-}"
    for spec in "mlp 4" "cnn 8" "transformer 4" "resnet18 8" "mobilenet_v2 8" "gpt2 2" "bert_base 4"; do
        set -- $spec
        for budget in 0.9 0.7; do
            timeout 120 "$carry/memplan" verify "models/$1.onnx" --batch "$2" --budget "$budget" \
                --device cuda --json > "$out/verify-$1-b$2-$budget.json" 2> "$out/verify-$1-b$2-$budget.err" || true
        done
    done
    # 3. PyTorch's allocator against memplan's (docs/ALLOCATOR.md)
    python3 tools/gpu-allocator-check.py --memplan "$carry/memplan" --expandable "$@" \
        --out "$out/allocator-check.json" 2>&1 | tee "$out/allocator-check.txt" || true
    ;;
*)
    echo "usage: tools/gpu-session.sh prepare | run [--gpu NAME]" >&2
    exit 2
    ;;
esac
