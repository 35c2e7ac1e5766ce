#!/usr/bin/env bash
# Peak memory of `memplan profile` on a ~1 GB ONNX model with inline weights.
# Writes the model with models/export.py --big (needs torch/onnx), then measures the
# maximum resident set size of memplan with GNU time. Usage: benches/big_model.sh [GiB]
set -euo pipefail
cd "$(dirname "$0")/.."
gb=${1:-1.0}
model=${TMPDIR:-/tmp}/memplan-big.onnx
python3 models/export.py --big "$model" --gb "$gb" >/dev/null
cargo build --release -q
size=$(stat -c %s "$model")
/usr/bin/time -f '%M %e' -o target/big_time.txt ./target/release/memplan profile "$model" --batch 8 --json >target/big_profile.json
read -r rss_kb secs <target/big_time.txt
python3 - "$size" "$rss_kb" "$secs" <<'PY'
import json, sys
size, rss_kb, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
p = json.load(open("target/big_profile.json"))
print(f"file {size} bytes ({size/2**30:.2f} GiB), params.bytes {p['params']['bytes']}")
print(f"memplan max RSS {rss_kb} KiB ({rss_kb/1024:.1f} MiB) = {rss_kb*1024/size*100:.2f}% of the file, {secs:.2f} s wall")
PY
rm -f "$model"
