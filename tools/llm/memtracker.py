"""memplan beside PyTorch's MemTracker on the LLM references (dev-time, CPU).

For each family of tools/llm/reference.py at one batch, SGD (the step of tests/data/pytorch/llm_reference.json:
zero_grad(set_to_none), forward, the model's loss or logits.mean(), backward, step, after a warm-up):
  * MemTracker on real tensors (torch.distributed._tools.mem_tracker), its peak and seconds;
  * MemTracker under FakeTensorMode (the model built and run on fake tensors), its peak and seconds;
  * memplan profile --train on the shape-only export, its peak and seconds (wall clock of the process);
each peak against the reference's step peak (resident + the profiler's delta: real PyTorch).

    python tools/llm/memtracker.py [--families llama,qwen3] [--batch 1] [--out docs/benchmarks/data/llm_memtracker.json]
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import reference as R  # noqa: E402


def step(model, opt, inputs, graph_loss):
    opt.zero_grad(set_to_none=True)
    out = model(*inputs)
    first = out[0] if isinstance(out, (tuple, list)) else out
    loss = first if graph_loss else first.mean()
    loss.backward()
    opt.step()


def tracked_peak(fam, batch, fake):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    spec = R.FAMILIES[fam]
    build = R._builder(fam, 2048, "float32")
    t = time.time()
    if fake:
        with FakeTensorMode():
            model, mk, _, _ = build(fam)
            inputs = mk(batch)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            step(model, opt, inputs, spec["labels"])  # warm-up, as the reference
            mt = MemTracker()
            mt.track_external(model, opt, *inputs)
            with mt:
                step(model, opt, inputs, spec["labels"])
    else:
        model, mk, _, _ = build(fam)
        inputs = mk(batch)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        step(model, opt, inputs, spec["labels"])
        mt = MemTracker()
        mt.track_external(model, opt, *inputs)
        with mt:
            step(model, opt, inputs, spec["labels"])
    secs = time.time() - t
    snap = mt.get_tracker_snapshot("peak")
    total = sum(v.get("Total", 0) for v in snap.values())
    return total, secs


def memplan_peak(entry, batch):
    exe = os.path.join(ROOT, "target", "release", "memplan")
    args = [exe, "profile", os.path.join(ROOT, entry["file"]), "--batch", str(batch), "--train",
            "--optimizer", "sgd", "--json"]
    if entry["loss"] == "graph":
        args += ["--loss", "graph"]
    if entry.get("trainable"):
        args += ["--trainable", entry["trainable"]]
    if entry.get("weight_dtype"):
        args += ["--weight-dtype", entry["weight_dtype"]]
    if entry.get("moe_routing"):
        args += ["--moe-routing", entry["moe_routing"]]
    t = time.time()
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["training"]["peak_bytes"], time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(f for f in R.FAMILIES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "data", "llm_memtracker.json"))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    ref = json.load(open(os.path.join(ROOT, "tests", "data", "pytorch", "llm_reference.json")))
    rows = {}
    for fam in a.families.split(","):
        x = ref[fam]["batch_%d" % a.batch]["sgd"]
        want = x["resident_bytes_before_step"] + x["step_peak_delta_bytes"]
        row = {"pytorch_step_peak_bytes": want}
        for key, fn in (("memplan", lambda: memplan_peak(ref[fam], a.batch)),
                        ("memtracker_real", lambda: tracked_peak(fam, a.batch, False)),
                        ("memtracker_fake", lambda: tracked_peak(fam, a.batch, True))):
            try:
                peak, secs = fn()
                row[key] = {"peak_bytes": peak, "seconds": round(secs, 3),
                            "vs_pytorch": round(peak / want - 1, 5)}
            except Exception as e:  # noqa: BLE001  a failure is a result here
                row[key] = {"error": ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:200]}
            print(fam, key, row[key], flush=True)
        rows[fam] = row
    meta = {"generated_by": "python tools/llm/memtracker.py --batch %d" % a.batch,
            "torch": torch.__version__, "batch": a.batch, "seq": 2048, "optimizer": "sgd",
            "pytorch_step_peak_bytes": "tests/data/pytorch/llm_reference.json: resident_bytes_before_step + "
            "step_peak_delta_bytes (torch.profiler allocation events, real tensors, CPU)"}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"_meta": meta, **rows}, f, indent=1)


if __name__ == "__main__":
    main()
