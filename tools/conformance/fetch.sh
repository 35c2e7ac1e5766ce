#!/usr/bin/env bash
# Unpacks the ONNX backend test suite (the test data shipped in the onnx 1.22.0
# wheel; 1.23 ships none) into target/conformance/data for tests/conformance.rs.
# Dev- and CI-time only: `pip download` of the wheel (no install, no
# dependencies), cached under the target dir; memplan never needs it to run.
#
# Environment:
#   MEMPLAN_ONNX_WHEEL  a wheel file to unpack instead of downloading
#                       (offline: `pip download onnx==1.22.0 --no-deps`)
set -euo pipefail
cd "$(dirname "$0")/../.."

ONNX_VERSION=1.22.0
target="${CARGO_TARGET_DIR:-target}"
dir="$target/conformance"
data="$dir/data/onnx/backend/test/data"
mkdir -p "$dir"
if [ -d "$data/node" ]; then
    echo "conformance: data in $data"
    exit 0
fi
wheel="${MEMPLAN_ONNX_WHEEL:-}"
if [ -z "$wheel" ]; then
    wheel="$(ls "$dir"/onnx-"$ONNX_VERSION"-*.whl 2>/dev/null | head -1 || true)"
fi
if [ -z "$wheel" ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" "onnx==$ONNX_VERSION"
    wheel="$(ls "$dir"/onnx-"$ONNX_VERSION"-*.whl | head -1)"
fi
python3 - "$wheel" "$dir/data" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("onnx/backend/test/data/")]
    z.extractall(out, members=names)
print(f"conformance: {len(names)} files from {wheel}")
PY
test -d "$data/node" || { echo "conformance: no test data in $wheel" >&2; exit 1; }
