#!/usr/bin/env bash
# Runs memplan's criterion bench (load + shape inference + profile, batch 8) and
# Python onnx's comparable work (onnx.load + onnx.shape_inference.infer_shapes) on
# the same model files, in one run, and prints the ratio. Needs `pip install onnx`.
# Usage: benches/compare.sh [model ...]   (default: resnet50 gpt2)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- resnet50 gpt2
models=("$@")
list=$(IFS=,; echo "${models[*]}")
MEMPLAN_BENCH_MODELS="$list" cargo bench -q -p memplan-bench --bench profile -- end_to_end >/dev/null
paths=()
for m in "${models[@]}"; do paths+=("models/$m.onnx"); done
python3 benches/py/onnx_infer.py "${paths[@]}" --iters 20 >target/onnx_py.jsonl
python3 - "${models[@]}" <<'PY'
import json, sys
py = {json.loads(l)["model"]: json.loads(l) for l in open("target/onnx_py.jsonl")}
print(f"{'model':<12} {'memplan (ms)':>13} {'python onnx (ms)':>17} {'ratio':>7}")
for m in sys.argv[1:]:
    est = json.load(open(f"target/criterion/end_to_end_{m}/new/estimates.json"))
    ours = est["mean"]["point_estimate"] / 1e6
    theirs = py[f"models/{m}.onnx"]["mean_seconds"] * 1e3
    print(f"{m:<12} {ours:>13.3f} {theirs:>17.3f} {theirs / ours:>6.1f}x")
PY
