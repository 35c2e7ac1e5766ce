#!/usr/bin/env python3
"""Time Python onnx doing the work comparable to memplan's: load + shape inference.

For each model path, runs `onnx.load(path)` followed by
`onnx.shape_inference.infer_shapes(model)` --iters times (after one untimed warm-up
unless --no-warmup) and prints one JSON line per model:

    {"model": PATH, "mean_seconds": ..., "min_seconds": ..., "iters": N, ...}

Extra keys: "max_seconds", "load_mean_seconds", "infer_mean_seconds", "onnx_version".

Usage:
    python benches/py/onnx_infer.py models/resnet50.onnx models/gpt2.onnx --iters 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def bench(path: str, iters: int, warmup: bool, data_prop: bool) -> dict:
    import onnx

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        model = onnx.load(path)
        t1 = time.perf_counter()
        onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    if warmup:
        once()
    loads, infers, totals = [], [], []
    for _ in range(iters):
        lo, inf = once()
        loads.append(lo)
        infers.append(inf)
        totals.append(lo + inf)
    return {
        "model": path,
        "mean_seconds": statistics.fmean(totals),
        "min_seconds": min(totals),
        "max_seconds": max(totals),
        "iters": iters,
        "load_mean_seconds": statistics.fmean(loads),
        "infer_mean_seconds": statistics.fmean(infers),
        "onnx_version": onnx.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="ONNX model files")
    ap.add_argument("--iters", type=int, default=10, help="timed repetitions per model (default 10)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    ap.add_argument("--data-prop", action="store_true", help="pass data_prop=True to infer_shapes")
    a = ap.parse_args()
    if a.iters < 1:
        ap.error("--iters must be >= 1")
    for path in a.models:
        res = bench(path, a.iters, not a.no_warmup, a.data_prop)
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
