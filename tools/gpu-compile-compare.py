#!/usr/bin/env python3
"""Issue 14's comparison on a GPU: memplan's plans against every-block checkpointing and
torch.compile's activation_memory_budget, step time at measured peak (dev-time tool).

On this project's 2-core CPU the comparison cannot decide anything: compile's budget 0.5
costs nothing measurable there against its budget 1.0 (docs/BENCHMARKS.md, "Op plans given
to torch.compile"), so no plan can be shown faster at its peak, and two runs of the same
configurations moved by 5 to 10 %. The issue's reference figures (ResNet-50 at batch 8:
budget 0.5 at +10 % step time) come from a GPU, where a rerun costs time and the clock is
steady. This script runs the same configurations there.

Each configuration runs in a child process of its own (an empty dynamo cache, the allocator's
statistics from zero, its own activation_memory_budget): the model of models/export.py's
build() on the device, SGD, fp32, the step of export.py's _train_step; `--warmup` untimed
steps (they compile), then `--steps` timed steps, each between two torch.cuda.synchronize().
peak_allocated_bytes is torch.cuda.max_memory_allocated over the timed steps (parameters,
gradients and inputs included, the same for every configuration of a model);
step_peak_bytes is that less what was allocated before the first timed step. Configurations
of one model run in turn, `--rounds` times, interleaved, and step_seconds is the median of
all their timed steps; compiled configurations are compared with compile's budget 1.0, eager
ones with eager.

    python3 tools/gpu-compile-compare.py --models resnet50,gpt2 --out gpu-compile.json
    python3 tools/gpu-compile-compare.py --models resnet50 --device cpu --steps 1 --rounds 1 \\
        --warmup 1 --only none,compile_1.0   # a smoke test of the script itself

Configurations per model (batch 8): none (eager), every-block (eager), compile budgets
1.0 / 0.5 / 0.2, and memplan's op plans of tests/data/pytorch/op_plans/ given to the compiler
(`compile_policy`, budget 1.0) and run eagerly (`apply`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# memplan's op plans at batch 8 (tests/data/pytorch/op_plans/, made with `memplan plan MODEL --batch 8
# --optimizer sgd --budget B --time-limit 10 --pytorch ...`), by model.
PLANS = {
    "resnet50": ["resnet50_b8_510", "resnet50_b8_490", "resnet50_b8_467"],
    "gpt2": ["gpt2_b8_1700", "gpt2_b8_1510", "gpt2_b8_1445"],
}


def configurations(model, plans=None):
    base = {"model": model, "batch": 8, "optimizer": "sgd", "freeze": None, "trainable": None, "checkpoint": None}
    out = [dict(base, name="none"), dict(base, name="every-block", checkpoint="every-block")]
    for b in (1.0, 0.5, 0.2):
        out.append(dict(base, name="compile_%s" % b, compile_budget=b))
    for p in [p for p in (plans or PLANS.get(model, [])) if p.startswith(model + "_")]:
        f = "tests/data/pytorch/op_plans/%s.py" % p
        out.append(dict(base, name="compile_" + p, checkpoint_file=f, compile_plan=True, compile_budget=1.0))
        out.append(dict(base, name="eager_" + p, checkpoint_file=f))
    return out


def child(case, device, warmup, steps):
    """One configuration's steps; prints one JSON object."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "models"))
    sys.path.insert(0, os.path.join(ROOT, "tools", "pytorch"))  # finetune_reference.py
    import export as E
    import finetune_reference as F

    torch.manual_seed(E.TRAIN_SEED)
    model, make_inputs, _, _ = E.build(case["model"])
    model.to(device).train()
    info = {}
    F.make_prepare(case, F.CheckpointRecorder(), info)(model)
    inputs = tuple(t.to(device) for t in make_inputs(case["batch"]))
    opt = E._make_optimizer(case["optimizer"], model)
    cuda = device.startswith("cuda")
    if cuda and ":" in device:
        torch.cuda.set_device(torch.device(device))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        E._train_step(model, opt, inputs, E._NullPhase())
    sync()
    warm = time.perf_counter() - t0
    before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        E._train_step(model, opt, inputs, E._NullPhase())
        sync()
        ts.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    out = {
        "step_seconds_all": [round(t, 6) for t in ts],
        "warmup_seconds": round(warm, 3),
        "peak_allocated_bytes": peak,
        "allocated_before_bytes": before if cuda else None,
        "step_peak_bytes": (peak - before) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
    }
    compiled = getattr(model, "memplan_compiled", None)
    if compiled is not None:
        out["compile_policy"] = {k: (v if isinstance(v, (int, float, str, type(None))) else len(v))
                                 for k, v in compiled.items()}
    missing = getattr(model, "memplan_missing", None)
    if missing is not None:
        out["missing"] = len(missing)
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--only", default="", help="comma-separated configuration names to run (default: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--plans", default="", help="comma-separated op plans of tests/data/pytorch/op_plans/ to run "
                                                "(default: those of PLANS for the model)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--case-timeout", type=float, default=150.0, help="seconds per child process")
    ap.add_argument("--out", default="gpu-compile.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child), a.device, a.warmup, a.steps)
        return

    results = {}

    if a.steps < 1 or a.rounds < 1:
        ap.error("--steps and --rounds must be at least 1")

    def write():
        # Written whole, then renamed: an outer timeout never leaves half a file.
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"_meta": {"generated_by": "python3 tools/gpu-compile-compare.py " + " ".join(sys.argv[1:]),
                                 "device": a.device}, "cases": results}, f, indent=1)
        os.replace(tmp, a.out)

    only = [n for n in a.only.split(",") if n]
    for model in [m for m in a.models.split(",") if m]:
        plans = [p for p in a.plans.split(",") if p]
        cases = [c for c in configurations(model, plans) if not only or c["name"] in only]
        for r in range(a.rounds):
            for c in cases:
                key = "%s/%s" % (model, c["name"])
                cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(c), "--device", a.device,
                       "--warmup", str(a.warmup), "--steps", str(a.steps)]
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.case_timeout)
                    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                    got = json.loads(line[7:]) if line else {
                        "error": "exit status %d: %s" % (p.returncode, (p.stderr or p.stdout).strip()[-600:])}
                except subprocess.TimeoutExpired:
                    got = {"error": "timed out after %.0f s" % a.case_timeout}
                got["wall_seconds"] = round(time.perf_counter() - t0, 1)
                results.setdefault(key, {"case": c, "rounds": []})["rounds"].append(got)
                print("%s round %d: %s" % (key, r, got["error"] if "error" in got else "median %.4f s, peak %s" % (
                    statistics.median(got["step_seconds_all"]), got["peak_allocated_bytes"])), flush=True)
                write()
        # Summary against the baselines: eager against none, compiled against compile_1.0.
        def med(name):
            e = results.get("%s/%s" % (model, name))
            ts = [t for r in (e or {}).get("rounds", []) for t in r.get("step_seconds_all", [])]
            return statistics.median(ts) if ts else None

        for c in cases:
            e = results["%s/%s" % (model, c["name"])]
            m = med(c["name"])
            base = med("compile_1.0" if c.get("compile_budget") is not None else "none")
            peaks = [r["peak_allocated_bytes"] for r in e["rounds"] if r.get("peak_allocated_bytes")]
            e["step_seconds"] = m
            e["peak_allocated_bytes"] = max(peaks) if peaks else None
            e["overhead"] = round(m / base - 1, 4) if m and base else None
            print("%-10s %-24s %s  %s  %s" % (
                model, c["name"], "%.4f s" % m if m else "-",
                "%+.1f %%" % (100 * e["overhead"]) if e["overhead"] is not None else "",
                "%.1f MiB" % (e["peak_allocated_bytes"] / 2**20) if e["peak_allocated_bytes"] else ""), flush=True)
        write()
    print("wrote %s" % a.out)


if __name__ == "__main__":
    main()
