#!/usr/bin/env python3
"""The census sample under mixed precision: memplan's `--precision amp-fp16` saved bytes against
what PyTorch saves under CUDA autocast, measured without a GPU (tools/pytorch/amp_reference.py's method:
the model on fake CUDA tensors, autocast switched on at the C++ level, a saved-tensor hook).

    python tools/census/amp_check.py [--only a,b] [--batch 4] [--memplan PATH] [--cache DIR]

Each sample model (census.py's `sample_names`) is built as census.py builds it and read from its
committed export (models/census/) or the census cache (<cache>/onnx/, `census.py export`); a model
with neither is listed as not exported. Beside the AMP figures: memplan's fp32 saved bytes at the
same batch against PyTorch's CUDA equivalent (tools/census/measure.json), so that what autocast
adds is told apart from what float32 already differs by. Writes tools/census/amp_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "models"))
sys.path.insert(0, os.path.join(ROOT, "tools", "pytorch"))  # amp_reference.py

import census  # noqa: E402

OUT = os.path.join(HERE, "amp_check.json")


def memplan_saved(memplan, path, batch, precision):
    cmd = [memplan, "profile", path, "--batch", str(batch), "--train", "--optimizer", "sgd",
           "--precision", precision, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed")
    return json.loads(r.stdout)["training"]["saved_activation_bytes"]


def main():
    import torch

    warnings.filterwarnings("ignore")
    import amp_reference

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--memplan", default=census.DEFAULT_MEMPLAN)
    ap.add_argument("--cache", default=census.DEFAULT_CACHE)
    a = ap.parse_args()
    entries = {e.name: e for e in census.all_entries()}
    names = census.sample_names(list(entries.values()))
    if a.only:
        names = [n for n in a.only.split(",") if n]
    measured = census._load(census.MEASURE, {})
    res = census._load(OUT, {})
    res["_meta"] = {
        "generated_by": "python tools/census/amp_check.py",
        "batch": a.batch,
        "versions": {"torch": torch.__version__},
        "memplan": "profile FILE --batch B --train --optimizer sgd --precision amp-fp16 --json: "
        "training.saved_activation_bytes (fp32: the same without --precision)",
        "pytorch": "tools/pytorch/amp_reference.py's measure_model, fp16 (bf16 saved the same bytes on "
        "every model of tests/data/pytorch/amp_reference.json)",
    }
    for name in names:
        t0 = time.time()
        path = os.path.join(census.SUBSET_DIR, name + ".onnx")
        if not os.path.exists(path):
            path = os.path.join(a.cache, "onnx", name + ".onnx")
        if not os.path.exists(path):
            res[name] = {"error": "not exported here (census.py export --only %s)" % name}
            print(name, res[name]["error"], flush=True)
            continue
        r = {}
        try:
            model, make_inputs, _, _ = census.build_entry(entries[name])
            m = amp_reference.measure_model(model, make_inputs(a.batch), torch.float16)
            r["pytorch"] = m["saved_bytes"]
            r["saved_by"] = m["saved_by"]
        except Exception as e:  # noqa: BLE001
            r["error"] = "PyTorch: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])
        try:
            r["memplan"] = memplan_saved(a.memplan, path, a.batch, "amp-fp16")
            r["memplan_fp32"] = memplan_saved(a.memplan, path, a.batch, "fp32")
        except Exception as e:  # noqa: BLE001
            r["error"] = "memplan: %s" % str(e)[:200]
        fp32 = measured.get(name, {}).get("batch_%d" % a.batch, {})
        if "saved_bytes_cuda_equivalent" in fp32:
            r["pytorch_fp32_cuda_equivalent"] = fp32["saved_bytes_cuda_equivalent"]
        if "pytorch" in r and "memplan" in r:
            r["pct"] = round(100.0 * (r["memplan"] / r["pytorch"] - 1), 3)
        if "pytorch_fp32_cuda_equivalent" in r and "memplan_fp32" in r:
            r["pct_fp32"] = round(100.0 * (r["memplan_fp32"] / r["pytorch_fp32_cuda_equivalent"] - 1), 3)
        r["seconds"] = round(time.time() - t0, 1)
        res[name] = r
        print("%-32s amp %s fp32 %s %s" % (name, r.get("pct"), r.get("pct_fp32"), r.get("error", "")), flush=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
