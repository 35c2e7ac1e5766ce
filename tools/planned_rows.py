#!/usr/bin/env python3
"""fit on every census LLM and models/llm export: does checkpointing-planned reach at least
every-block's, the selective preset's and sqrt's batch on the device, at no more cost at
the same batch? Usage: python3 tools/planned_rows.py GPU (after cargo build --release)."""
import json, subprocess, sys, glob, time
models = sorted(glob.glob("models/census/hf_*.onnx")) + sorted(glob.glob("models/llm/*.onnx")) + ["models/gpt2.onnx", "models/resnet50.onnx"]
bad = 0
for m in models:
    args = ["target/release/memplan", "fit", m, "--gpu", sys.argv[1], "--json"]
    if "/llm/" in m:
        args += ["--precision", "bf16"]
        if "llama3_8b" in m: args += ["--loss", "graph", "--optimizer", "adamw"]
        if "lora" in m: args += ["--trainable", "lora_"]
    t = time.time()
    r = subprocess.run(args, capture_output=True, text=True)
    dt = time.time() - t
    if r.returncode != 0:
        # retry with --loss graph
        r = subprocess.run(args + ["--loss", "graph"], capture_output=True, text=True)
        if r.returncode != 0:
            print(m, "ERR", r.stderr.strip()[:150]); continue
    rows = {x["name"]: x for x in json.loads(r.stdout)["strategies"]}
    p = rows["checkpointing-planned"]
    msg = []
    for o in ["checkpoint-every-block", "checkpoint-every-block-selective", "checkpointing-sqrt"]:
        q = rows[o]
        if q["max_batch"] > p["max_batch"] or (q["max_batch"] == p["max_batch"] > 0 and q["overhead"] > p["overhead"] + 1e-12 and False) or (q["max_batch"] == p["max_batch"] > 0 and q["overhead"] < p["overhead"] - 1e-12):
            msg.append(f"LOSES to {o} {q['max_batch']}@{q['overhead']:.3f}")
            bad += 1
    print(f"{m:45s} {dt:5.1f}s planned {p['max_batch']}@{p['overhead']:.3f} every {rows['checkpoint-every-block']['max_batch']} sel {rows['checkpoint-every-block-selective']['max_batch']} sqrt {rows['checkpointing-sqrt']['max_batch']} {' '.join(msg)} | {p['note'][:90]}")
print("bad", bad)
