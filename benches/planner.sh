#!/usr/bin/env bash
# The planner tables of docs/BENCHMARKS.md: every solver on the shared
# rematerialization benchmark graphs and on the models of models/, at fixed
# fractions of each graph's no-recompute peak. Run on an otherwise idle machine
# (solve times are wall clock). Usage: benches/planner.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/planner-bench}
mkdir -p "$out"
cargo build --release -q
m=${CARGO_TARGET_DIR:-target}/release/memplan
g=tests/data/remat-graphs
# ilp and the baselines: 10 s per budget point.
$m bench "$g"/*.json --budgets 0.9,0.8,0.7,0.5 --solvers ilp,greedy,sqrt \
  --time-limit 10 --csv >"$out/dags.csv"
# The full Checkmate MILP where it is meant to be used: graphs up to 100 nodes, 60 s.
$m bench "$g"/vgg16_train.json "$g"/vgg19_train.json "$g"/fcn8_vgg_train.json \
  "$g"/segnet_train.json "$g"/vgg_unet_train.json "$g"/random_layered_n100.json \
  --budgets 0.9,0.8,0.7,0.5 --solvers checkmate --time-limit 60 --csv >"$out/checkmate.csv"
# Models: training step at batch 8 with SGD (with Adam, optimizer state often sets
# a floor above these budgets: see the floor column of `plan`).
$m bench models/*.onnx --batch 8 --optimizer sgd --budgets 0.9,0.7,0.5 \
  --solvers ilp,greedy,sqrt --time-limit 10 --csv >"$out/models.csv"
echo "written to $out"
