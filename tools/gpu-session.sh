#!/usr/bin/env bash
# The prepared GPU session (docs/CUDA.md, "The prepared GPU session"): every check
# that needs a GPU, in one device call of at most about 9 minutes, packed into
# $OUT/gpu-session.tgz (default ./gpu-out) with the main logs beside it.
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
    # tools/gpu-fsdp.py's larger config has no committed ONNX file (the GPU machine may lack
    # the exporter's onnx): without it only those rows lack memplan's figures.
    python3 tools/gpu-fsdp.py --export fsdp_llama_large --export-dir "$carry" \
        || echo "fsdp_llama_large not exported: its rows in fsdp_gpu.json will lack memplan's figures" >&2
    # The working tree and gpu-carry travel together, 64 MiB at most: compressed.
    gzip -9 "$carry"/*
    # The test binaries find models/ through the build's CARGO_MANIFEST_DIR.
    pwd > "$carry/manifest-dir"
    du -sh "$carry"
    ;;
run)
    shift
    # Every step has its own time limit, so the whole run ends inside one device
    # call (10 minutes at most) and its results come back even when a step hangs.
    # A device call returns at most 8 files: everything is written to $work and
    # packed into $out/gpu-session.tgz, and the main logs are copied beside it.
    out="${OUT:-gpu-out}"
    work="${TMPDIR:-/tmp}/gpu-session"
    rm -rf "$work" && mkdir -p "$out" "$work"
    pack() {
        tar czf "$out/gpu-session.tgz" -C "$work" .
        for f in nvidia-smi.txt cuda-tests.txt cuda-step-tests.txt allocator-check.txt peak-snapshot.json \
            fsdp/fsdp_gpu.json parallel/parallel_gpu.json; do
            [ -f "$work/$f" ] && cp "$work/$f" "$out/" || true
        done
    }
    trap pack EXIT
    for f in "$carry"/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
    if [ -f "$carry/manifest-dir" ]; then
        m="$(cat "$carry/manifest-dir")"
        [ -e "$m" ] || { mkdir -p "$(dirname "$m")" && ln -s "$PWD" "$m"; } || true
    fi
    nvidia-smi 2>&1 | tee "$work/nvidia-smi.txt" || true
    # 1. kernels, ops, models forward; the training step and verify (tests/cuda*.rs)
    timeout -k 10 90 tools/cuda-gpu-check.sh "$carry/cuda-tests" 2>&1 | tee "$work/cuda-tests.txt" || true
    timeout -k 10 90 tools/cuda-gpu-check.sh "$carry/cuda_step-tests" 2>&1 | tee "$work/cuda-step-tests.txt" || true
    # 2. verify --device cuda on models/ (the same library paths as step 1), 120 s in all
    # The library directories cuda-gpu-check.sh found (NVRTC dlopens its builtins by name).
    links="${TMPDIR:-/tmp}/memplan-cuda-libs"
    export LD_LIBRARY_PATH="$(cat "$links/ld-library-path" 2>/dev/null || echo "$links")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    deadline=$((SECONDS + 120))
    # Budgets each model can reach (4 December 2026: mlp, transformer at batch 4,
    # gpt2 at batch 2 and bert_base at batch 4 peak in the optimizer step, where
    # recomputation cannot help, and a budget of 0.9 there is refused).
    for spec in "cnn 8 0.9" "cnn 8 0.7" "transformer 8 0.8" "resnet18 8 0.9" "mobilenet_v2 8 0.7" \
        "resnet50 8 0.8" "gpt2 8 0.9" "bert_base 32 0.9"; do
        read -r model batch budget <<< "$spec"
        run="verify-$model-b$batch-$budget"
        left=$((deadline - SECONDS))
        [ "$left" -gt 5 ] || { echo "$run: skipped (time)" >> "$work/verify-skipped.txt"; continue; }
        timeout -k 5 "$((left < 45 ? left : 45))" "$carry/memplan" verify "models/$model.onnx" --batch "$batch" \
            --budget "$budget" --device cuda --json > "$work/$run.json" 2> "$work/$run.err" || true
    done
    # 3. PyTorch's allocator against memplan's (docs/ALLOCATOR.md): 10 to 15 s a case on
    # the H200 (4 December 2026), so about 16 of the 24 cases fit in 240 s; each case is
    # written as it ends, and `--cases` runs the rest in another call
    timeout -k 10 240 python3 tools/gpu-allocator-check.py --memplan "$carry/memplan" --expandable "$@" \
        --out "$work/allocator-check.json" 2>&1 | tee "$work/allocator-check.txt" || true
    # 4. what PyTorch holds at its allocated peak, by phase and frame (it found vit_b_16's
    # attention layout on 4 December 2026), about 15 s a case
    timeout -k 10 90 python3 tools/gpu-peak-snapshot.py --cases "vit_b_16:8;resnet50:8;gpt2:8" \
        --out "$work/peak-snapshot.json" 2>&1 | tee "$work/peak-snapshot.txt" || true
    # 5. FSDP2 per rank with NCCL, one process per GPU (tools/gpu-fsdp.py), only where two or
    # more GPUs are lent: every configuration in one torchrun (time on a GPU not known yet),
    # then memplan's figures put beside the measured ones
    ngpu="$( (nvidia-smi -L 2>/dev/null || true) | wc -l)"
    if [ "$ngpu" -ge 2 ]; then
        timeout -k 10 180 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" \
            tools/gpu-fsdp.py --out "$work/fsdp" 2>&1 | tee "$work/fsdp.txt" || true
        timeout -k 5 90 python3 tools/gpu-fsdp.py --merge "$work/fsdp" --memplan "$carry/memplan" \
            --onnx "$carry" 2>&1 | tee -a "$work/fsdp.txt" || true
    else
        echo "5. FSDP2 on several GPUs: skipped ($ngpu GPU; tools/gpu-fsdp.py needs 2 or more)" \
            | tee "$work/fsdp.txt"
    fi
    # 6. tensor and pipeline parallelism per rank with NCCL (tools/gpu-parallel.py), where two
    # or more GPUs are lent: at most 4 ranks (fsdp_llama_a's 4 heads), then memplan's figures
    if [ "$ngpu" -ge 2 ]; then
        np=$((ngpu >= 4 ? 4 : 2))
        timeout -k 10 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$np" \
            tools/gpu-parallel.py --out "$work/parallel" 2>&1 | tee "$work/parallel.txt" || true
        timeout -k 5 90 python3 tools/gpu-parallel.py --merge --out "$work/parallel" --memplan "$carry/memplan" \
            --onnx "$carry" 2>&1 | tee -a "$work/parallel.txt" || true
    else
        echo "6. TP/PP on several GPUs: skipped ($ngpu GPU; tools/gpu-parallel.py needs 2 or more)" \
            | tee "$work/parallel.txt"
    fi
    ;;
*)
    echo "usage: tools/gpu-session.sh prepare | run [--gpu NAME]" >&2
    exit 2
    ;;
esac
