#!/usr/bin/env python3
"""Step times of checkpointing configurations, interleaved, with a caching host allocator
(dev-time tool, not needed to build memplan).

Usage:
    python tools/pytorch/step_times.py                                   # docs/benchmarks/data/step_time_cases.json
    python tools/pytorch/step_times.py --cases F --out F --rounds 5 --steps 5 [--compile 1.0,0.5,0.2 [--compile-models M,...]]
                                   [--system-malloc]

Why a separate tool: finetune_reference.py times each case once, one after the other, on glibc's
default allocator. On this 2-core machine that measure moved by 10 % between runs and, worse,
ranked configurations by their page faults rather than their compute: glibc serves every tensor of
more than a few MiB with a fresh mmap and returns it with munmap when freed, so each step touches
new pages again (ResNet-50 batch 8: 7.5 s of system time in 40 steps, against 1.2 s with the
settings below). CUDA's caching allocator, which memplan's plans are for, keeps freed blocks for
reuse, and a GPU step pays no page faults.

So, unless --system-malloc is given, the script re-executes itself with
    MALLOC_MMAP_THRESHOLD_=4294967296  (no mmap below 4 GiB: tensors come from the heap)
    MALLOC_TRIM_THRESHOLD_=68719476736 (the heap is never trimmed: freed memory is kept, as cached)
    MALLOC_TOP_PAD_=1073741824         (the heap grows 1 GiB at a time)
which makes glibc behave like a caching allocator. Peaks are not measured here (the profiler's
timeline counts tensor bytes, not the allocator's pages: finetune_reference.py measures them).

Every configuration's model is built (and, for --compile, compiled and warmed) once. Compiled
configurations compile again, untimed, before each of their blocks of steps, from an empty dynamo
cache and under their own activation_memory_budget (before 2026-12-04 they did not: every
compiled model then ran whatever dynamo had cached last, compiled under the budget set last, so
step times of compiled configurations measured together before that day are not theirs). Then
`--rounds` rounds each time `--steps` steps of every configuration in turn, so that drift of the
machine falls on all of them alike. step_seconds is the median of all timed steps of a
configuration (step_cpu_seconds: the same in process CPU time); see `baseline` for what each is
compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")  # the ONNX files and export.py
RUNS = os.path.join(ROOT, "docs", "benchmarks", "data")  # the measurement runs
sys.path.insert(0, MODELS)
sys.path.insert(0, HERE)  # finetune_reference.py

CACHING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": "4294967296",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}


def baseline(cases, c):
    """The configuration `c` is compared with: the same model without checkpointing, compiled with
    activation_memory_budget 1.0 when `c` is compiled and that was measured, else eager."""
    plain = [b for b in cases if b["model"] == c["model"] and not b.get("checkpoint") and not b.get("checkpoint_file")]
    if c.get("compile_budget") is not None:
        for b in plain:
            if b.get("compile_budget") == 1.0:
                return b
    return next(b for b in plain if b.get("compile_budget") is None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=os.path.join(RUNS, "step_time_cases.json"))
    ap.add_argument("--out", default=os.path.join(RUNS, "module_plan_times.json"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compile", default="", help="comma-separated activation_memory_budget values: "
                                                  "torch.compile configurations added per model")
    ap.add_argument("--compile-models", default="", help="comma-separated models the --compile configurations "
                                                         "are added for (default: every model of the cases)")
    ap.add_argument("--system-malloc", action="store_true", help="keep glibc's default allocator settings")
    a = ap.parse_args()

    if not a.system_malloc and any(os.environ.get(k) != v for k, v in CACHING_MALLOC.items()):
        env = dict(os.environ, **CACHING_MALLOC)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)

    import warnings

    import torch

    import export as E
    import finetune_reference as F

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    with open(a.cases) as f:
        cases = json.load(f)
    models = []
    for c in cases:
        if c["model"] not in models:
            models.append(c["model"])
    for budget in [b for b in a.compile.split(",") if b]:
        for m in [m for m in models if not a.compile_models or m in a.compile_models.split(",")]:
            base = next(c for c in cases if c["model"] == m)
            cases.append(dict(base, name="%s_b%d_compile_%s" % (m, base["batch"], budget), checkpoint=None,
                              checkpoint_file=None, compile_budget=float(budget)))

    built = {}
    for c in cases:
        t0 = time.perf_counter()
        torch._dynamo.reset() if c.get("compile_budget") is not None else None
        model, make_inputs, _, _ = E.build(c["model"])
        model.train()
        F.make_prepare(c, F.CheckpointRecorder(), {})(model)
        inputs = make_inputs(c["batch"])
        opt = E._make_optimizer(c.get("optimizer") or "sgd", model)
        torch.manual_seed(E.TRAIN_SEED)
        for _ in range(2):  # warm-up (and compile)
            E._train_step(model, opt, inputs, E._NullPhase())
        built[c["name"]] = (model, opt, inputs)
        print("built %s (%.0f s)" % (c["name"], time.perf_counter() - t0), flush=True)

    times = {c["name"]: [] for c in cases}
    cpu = {c["name"]: [] for c in cases}
    for r in range(a.rounds):
        for c in cases:
            model, opt, inputs = built[c["name"]]
            if c.get("compile_budget") is not None:
                # Compiled configurations share dynamo's code cache: instances of one model
                # class pass each other's guards, and activation_memory_budget is read when
                # compiling, not guarded. So each configuration's steps start from an empty
                # cache, under its own budget, with one untimed step that compiles again.
                torch._dynamo.reset()
                torch._functorch.config.activation_memory_budget = c["compile_budget"]
                E._train_step(model, opt, inputs, E._NullPhase())
            for _ in range(a.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                E._train_step(model, opt, inputs, E._NullPhase())
                times[c["name"]].append(time.perf_counter() - t0)
                cpu[c["name"]].append(time.process_time() - c0)
        print("round %d: %s" % (r, ", ".join("%s %.3f" % (k, statistics.median(v[-a.steps:]))
                                             for k, v in times.items())), flush=True)

    out = {}
    for c in cases:
        base = baseline(cases, c)
        med, med_base = statistics.median(times[c["name"]]), statistics.median(times[base["name"]])
        cmed, cmed_base = statistics.median(cpu[c["name"]]), statistics.median(cpu[base["name"]])
        out[c["name"]] = {
            "case": {k: v for k, v in c.items() if k != "name"},
            "baseline": base["name"],
            "step_seconds": round(med, 4),
            "overhead": round(med / med_base - 1, 4),
            "step_cpu_seconds": round(cmed, 4),
            "cpu_overhead": round(cmed / cmed_base - 1, 4),
            "step_seconds_all": [round(t, 4) for t in times[c["name"]]],
            "step_cpu_seconds_all": [round(t, 4) for t in cpu[c["name"]]],
        }
        print("%-32s wall %.4f s %+6.1f %%   cpu %.4f s %+6.1f %%   (vs %s)" % (
            c["name"], med, 100 * (med / med_base - 1), cmed, 100 * (cmed / cmed_base - 1), base["name"]))
    doc = {
        "_meta": {
            "generated_by": "python tools/pytorch/step_times.py " + " ".join(sys.argv[1:]),
            "versions": E._train_versions(),
            "device": "cpu",
            "torch_num_threads": torch.get_num_threads(),
            "host_allocator": "glibc defaults" if a.system_malloc else CACHING_MALLOC,
            "rounds": a.rounds,
            "steps_per_round": a.steps,
            "definitions": {
                "step_seconds": "median wall time of rounds x steps training steps (zero_grad..opt.step, SGD), "
                                "configurations interleaved round by round, after 2 warm-up steps each",
                "step_cpu_seconds": "median process CPU time (time.process_time, both threads) of the same steps: "
                                    "less sensitive than wall time to other work on the machine",
                "overhead": "step_seconds / the baseline's step_seconds - 1; the baseline is the same model "
                            "without checkpointing, eager for eager configurations and compiled with budget 1.0 "
                            "for compiled ones (when measured)",
                "cpu_overhead": "the same with step_cpu_seconds",
            },
        },
        "cases": out,
    }
    with open(a.out, "w") as f:
        f.write(E._json_compact(doc) + "\n")
    print("wrote %s" % a.out)


if __name__ == "__main__":
    main()
