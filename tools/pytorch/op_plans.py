"""Op plans of every model, for PyTorch to run and measure (dev-time tool).

For each TorchScript model in models/ (the dynamo exports carry no module scopes the
file could find values by), batch 2, SGD, a budget of 0.8 of the no-recompute peak:

    memplan plan models/M.onnx --batch 2 --optimizer sgd --budget 0.8
        -o tests/data/pytorch/op_plans/M_b2_08.plan.json --pytorch tests/data/pytorch/op_plans/M_b2_08.py

and writes tests/data/pytorch/op_plan_every_cases.json, whose cases `finetune_reference.py` runs with
each generated file's `apply(model)` (saved-tensor hooks):

    python tools/pytorch/op_plans.py            # plans and cases (needs target/release/memplan)
    python tools/pytorch/finetune_reference.py --cases tests/data/pytorch/op_plan_every_cases.json \\
        --out tests/data/pytorch/op_plan_every.json --no-time

tests/finetune.rs (`op_plans_of_every_model_run_in_pytorch`) replays the committed plans
and compares the bytes PyTorch keeps after forward. A model whose plan recomputes
nothing is listed in tests/data/pytorch/op_plans/skipped.json with memplan's reason.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")  # the ONNX files and export.py
DATA = os.path.join(ROOT, "tests", "data", "pytorch")  # the references tests compare with
BATCH = 2
BUDGET = "0.8"
EXCLUDED = {"resnet18_dynamo", "gpt2_dynamo", "transformer_dynamo_raw"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default="", help="comma-separated models (default: every one)")
    only = ap.parse_args().models
    sys.path.insert(0, MODELS)
    import export as E

    exe = os.path.join(ROOT, "target", "release", "memplan")
    names = [n for n in E.MODELS if n not in EXCLUDED and os.path.exists(os.path.join(MODELS, n + ".onnx"))]
    if only:
        names = only.split(",")
    cases, skipped = [], {}
    for name in names:
        tag = "%s_b%d_%s" % (name, BATCH, BUDGET.replace(".", ""))
        py = os.path.join("tests", "data", "pytorch", "op_plans", tag + ".py")
        pj = os.path.join("tests", "data", "pytorch", "op_plans", tag + ".plan.json")
        for f in (py, pj):
            if os.path.exists(os.path.join(ROOT, f)):
                os.remove(os.path.join(ROOT, f))
        cmd = [exe, "plan", "models/%s.onnx" % name, "--batch", str(BATCH), "--optimizer", "sgd",
               "--budget", BUDGET, "--time-limit", "20", "--json", "-o", pj, "--pytorch", py]
        if name in E.TRAIN_GRAPH_LOSS:
            cmd += ["--loss", "graph"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        try:
            plan = json.loads(r.stdout)
        except ValueError:
            plan = None
        if plan is None or (r.returncode != 0 and plan.get("feasible") is not False):
            skipped[tag] = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "exit %d" % r.returncode
            print("skip", tag, skipped[tag], flush=True)
            continue
        if not os.path.exists(os.path.join(ROOT, py)):
            skipped[tag] = "no file written: " + (r.stderr.strip().splitlines() or ["?"])[-1]
            print("skip", tag, skipped[tag], flush=True)
            continue
        if not plan["overhead"]:
            skipped[tag] = "the plan recomputes nothing (no activation is alive at the peak)"
            for f in (py, pj):
                os.remove(os.path.join(ROOT, f))
            print("skip", tag, skipped[tag], flush=True)
            continue
        print(tag, plan["feasible"], plan["peak_bytes"], plan.get("overhead"), flush=True)
        cases.append({"name": tag, "model": name, "batch": BATCH, "optimizer": "sgd", "freeze": None,
                      "trainable": None, "checkpoint": None, "checkpoint_file": py,
                      "memplan": {"budget": BUDGET, "feasible": plan["feasible"], "peak_bytes": plan["peak_bytes"],
                                  "overhead": plan["overhead"], "method": plan.get("method")}})
    with open(os.path.join(DATA, "op_plan_every_cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    with open(os.path.join(DATA, "op_plans", "skipped.json"), "w") as f:
        json.dump(skipped, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
