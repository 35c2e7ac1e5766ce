"""Module plans of every model with modules, for PyTorch to measure (dev-time tool).

For each TorchScript model in models/ (the dynamo exports carry no scopes) and two
budgets (0.8 and 0.6 of the no-recompute peak, batch 2, SGD), runs

    memplan plan models/M.onnx --batch 2 --optimizer sgd --granularity module
        --budget B --json --pytorch tests/data/pytorch/module_plans/M_b2_B.py

and writes tests/data/pytorch/module_plan_cases.json, whose cases `finetune_reference.py` measures
with each generated file's `apply(model)`:

    python tools/pytorch/module_plans.py            # plans and cases (needs target/release/memplan)
    python tools/pytorch/finetune_reference.py --cases tests/data/pytorch/module_plan_cases.json \\
        --out tests/data/pytorch/module_plan_reference.json --no-time

A model whose plan keeps no module (nothing to checkpoint) is listed in the cases
file's `skipped` with memplan's reason.
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
BUDGETS = ["0.8", "0.6"]
# Besides: the case of issue 49 (torchvision's DenseNet-121, whose blocks pass each layer
# the list of earlier features and append to it afterwards).
EXTRA = [("densenet121", 4, "297MiB")]
# The dynamo exports (no scopes) and the models PyTorch cannot rebuild by name.
EXCLUDED = {"resnet18_dynamo", "gpt2_dynamo", "transformer_dynamo_raw"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default="", help="comma-separated models (default: every one)")
    only = ap.parse_args().models
    sys.path.insert(0, MODELS)
    import export as E

    exe = os.path.join(ROOT, "target", "release", "memplan")
    cases, skipped = [], {}
    names = [n for n in E.MODELS if n not in EXCLUDED and os.path.exists(os.path.join(MODELS, n + ".onnx"))]
    if only:
        names = only.split(",")
    runs = [(n, BATCH, b) for n in names for b in BUDGETS]
    runs += [r for r in EXTRA if not only or r[0] in names]
    for name, batch, b in runs:
        tag = "%s_b%d_%s" % (name, batch, b.replace(".", ""))
        py = os.path.join("tests", "data", "pytorch", "module_plans", tag + ".py")
        cmd = [exe, "plan", "models/%s.onnx" % name, "--batch", str(batch), "--optimizer", "sgd",
               "--granularity", "module", "--budget", b, "--time-limit", "10", "--json", "--pytorch", py]
        if name in E.TRAIN_GRAPH_LOSS:
            cmd += ["--loss", "graph"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        # A budget no plan meets exits non-zero after printing the lowest-peak plan
        # (`"feasible": false`): that plan is measured too.
        try:
            plan = json.loads(r.stdout)
        except ValueError:
            plan = None
        if plan is None or (r.returncode != 0 and plan.get("feasible") is not False):
            skipped[tag] = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "exit %d" % r.returncode
            print("skip", tag, skipped[tag], flush=True)
            continue
        mods = plan["checkpoint_modules"]
        if not mods:
            skipped[tag] = "no module to checkpoint"
            if os.path.exists(os.path.join(ROOT, py)):
                os.remove(os.path.join(ROOT, py))
            print("skip", tag, "no module", flush=True)
            continue
        print(tag, plan["feasible"], plan["peak_bytes"], len(mods), mods[:4], flush=True)
        cases.append({"name": tag, "model": name, "batch": batch, "optimizer": None, "freeze": None,
                      "trainable": None, "checkpoint": None, "checkpoint_file": py,
                      "memplan": {"budget": b, "feasible": plan["feasible"], "peak_bytes": plan["peak_bytes"],
                                  "overhead": plan["overhead"], "method": plan.get("method"),
                                  "checkpoint_modules": mods}})
    with open(os.path.join(DATA, "module_plan_cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    with open(os.path.join(DATA, "module_plans", "skipped.json"), "w") as f:
        json.dump(skipped, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
