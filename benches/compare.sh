#!/usr/bin/env bash
# Runs memplan's criterion bench (load + shape inference + profile, batch 8) and
# Python onnx's comparable work (onnx.load + onnx.shape_inference.infer_shapes) on
# the same model files, in one run, and prints the ratio. Then times the whole
# `memplan profile <model> --batch 8 --json` process (release binary, spawned
# $MEMPLAN_PROCESS_RUNS times, default 50, mean wall per run) against the same
# Python in-process figure, with the cost of spawning /bin/true beside it (what
# any process pays on this machine). Needs `pip install onnx`.
# Usage: benches/compare.sh [model ...]   (default: resnet50 gpt2)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- resnet50 gpt2
models=("$@")
list=$(IFS=,; echo "${models[*]}")
cargo build -q --release
MEMPLAN_BENCH_MODELS="$list" cargo bench -q -p memplan-bench --bench profile -- end_to_end >/dev/null
paths=()
for m in "${models[@]}"; do paths+=("models/$m.onnx"); done
python3 benches/py/onnx_infer.py "${paths[@]}" --iters 100 >target/onnx_py.jsonl
python3 - "${models[@]}" <<'PY'
import json, os, subprocess, sys, time
py = {json.loads(l)["model"]: json.loads(l) for l in open("target/onnx_py.jsonl")}
runs = int(os.environ.get("MEMPLAN_PROCESS_RUNS", "50"))

def spawn_mean(cmd):
    """Mean wall seconds of running cmd to completion (after 3 untimed runs)."""
    for _ in range(3):
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    t = time.perf_counter()
    for _ in range(runs):
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    return (time.perf_counter() - t) / runs

print(f"{'model':<12} {'memplan (ms)':>13} {'python onnx (ms)':>17} {'ratio':>7}"
      f" {'process (ms)':>13} {'ratio':>7}")
for m in sys.argv[1:]:
    est = json.load(open(f"target/criterion/end_to_end_{m}/new/estimates.json"))
    ours = est["mean"]["point_estimate"] / 1e6
    theirs = py[f"models/{m}.onnx"]["mean_seconds"] * 1e3
    proc = spawn_mean(["target/release/memplan", "profile", f"models/{m}.onnx",
                       "--batch", "8", "--json"]) * 1e3
    print(f"{m:<12} {ours:>13.3f} {theirs:>17.3f} {theirs / ours:>6.1f}x"
          f" {proc:>13.3f} {theirs / proc:>6.1f}x")
true = spawn_mean(["/bin/true"]) * 1e3
print(f"(memplan: criterion end_to_end, in-process; python onnx: onnx.load + "
      f"infer_shapes, in-process; process: the whole `memplan profile --batch 8 --json`, "
      f"{runs} runs; spawning /bin/true takes {true:.3f} ms here)")
PY
