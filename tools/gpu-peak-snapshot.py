#!/usr/bin/env python3
"""What PyTorch holds at its allocated peak while training on a GPU (docs/ALLOCATOR.md).

A dev-time tool for finding where memplan's allocated figure and PyTorch's
`max_memory_allocated` part. For each case a child process builds the model
(models/export.py's build(), Adam, fp32, the loop of models/export.py's
_train_step), runs one warm-up step, then records the allocator's history
(`torch.cuda.memory._record_memory_history`, Python frames) over one more step.
From the trace it finds the moment of the largest allocated total and lists every
block live then that the step allocated, grouped by the phase it was allocated in
(the line of _train_step on its stack) and the innermost module or optimizer frame.
What was allocated before the step (parameters, optimizer state, inputs, and the
warm-up step's gradients, which zero_grad frees inside the step) is `resident_bytes`;
what of it is still live at the peak is `resident_at_peak_bytes`. Request sizes are
rounded to the allocator's 512 B blocks (block()).

    python3 tools/gpu-peak-snapshot.py --cases "vit_b_16:8;resnet50:8" --out peak-snapshot.json
"""

import argparse
import collections
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAX_ENTRIES = 400000


def block(size):
    """The caching allocator's rounding of a request (512 B; the trace records requests).
    Large-pool remainders it leaves unsplit are not seen here, so the trace's peak can
    sit a little under max_memory_allocated."""
    return max(512, (size + 511) // 512 * 512)


def where(frames):
    """(phase, innermost frame of interest) of one allocation's Python stack."""
    # backward's allocations are made on autograd's device thread: no Python stack
    phase, inner = ("?", "?") if frames else ("no Python stack (backward)", "-")
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if inner == "?" and ("torch/nn/" in name or "torch/optim/" in name or "models/export.py" in name
                             or "torchvision" in name or "transformers" in name):
            inner = f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}"
        if name.endswith("export.py") and f.get("name") == "_train_step":
            phase = f"line {f.get('line')}"
    return phase, inner


def measure(name, batch):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "models"))
    import export

    model, make_inputs, _, _ = export.build(name)
    model.to("cuda").train()
    inputs = tuple(t.to("cuda") for t in make_inputs(batch))
    opt = export._make_optimizer("adam", model)
    export._train_step(model, opt, inputs, export._NullPhase())
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=MAX_ENTRIES)
    export._train_step(model, opt, inputs, export._NullPhase())
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_reported = torch.cuda.max_memory_allocated()

    trace = snap["device_traces"][0]
    if len(trace) >= MAX_ENTRIES:
        raise SystemExit(f"the trace holds {len(trace)} entries, the ring buffer's size: the step's start is lost")
    live, cur, best, best_live, best_at, events = {}, resident, resident, {}, 0, 0
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (block(e["size"]), e.get("frames", []))
            cur += block(e["size"])
            events += 1
            if cur > best:
                best, best_live, best_at = cur, dict(live), i
        elif a == "free_completed":  # blocks from before the step too (zero_grad frees the gradients)
            live.pop(e["addr"], None)
            cur -= block(e["size"])
    groups = collections.Counter()
    counts = collections.Counter()
    sizes = collections.defaultdict(list)
    for size, frames in best_live.values():
        phase, inner = where(frames)
        groups[(phase, inner)] += size
        counts[(phase, inner)] += 1
        sizes[(phase, inner)].append(size)
    # the allocations and frees around the peak: which step of the loop it is
    around = [{"action": e["action"], "size": e["size"], "where": where(e.get("frames", []))}
              for e in trace[max(0, best_at - 24):best_at + 6] if e["action"] in ("alloc", "free_completed")]
    return {
        "model": name, "batch": batch, "resident_bytes": resident,
        "max_memory_allocated": peak_reported, "trace_peak_bytes": best, "alloc_events": events,
        "resident_at_peak_bytes": best - sum(size for size, _ in best_live.values()),
        "live_at_peak": [{"phase": p, "frame": i, "bytes": b, "blocks": counts[(p, i)],
                          "sizes": sorted(sizes[(p, i)], reverse=True)}
                         for (p, i), b in groups.most_common()],
        "around_peak": around, "peak_event": best_at,
        "torch": torch.__version__, "device_name": torch.cuda.get_device_name(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="vit_b_16:8;resnet50:8")
    ap.add_argument("--out", default="peak-snapshot.json")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child[0], int(a.child[1]))))
        return
    results = []
    for case in a.cases.split(";"):
        name, batches = case.split(":")
        for b in (int(x) for x in batches.split(",")):
            child = subprocess.run([sys.executable, __file__, "--child", name, str(b)], capture_output=True, text=True)
            if child.returncode != 0:
                tail = (child.stderr.strip().splitlines() or ["?"])[-1]
                results.append({"model": name, "batch": b, "error": tail})
                print(f"{name} b{b}: failed: {tail}", flush=True)
            else:
                r = json.loads(child.stdout.strip().splitlines()[-1])
                results.append(r)
                print(f"{name} b{b}: max_memory_allocated {r['max_memory_allocated']} trace peak "
                      f"{r['trace_peak_bytes']} resident {r['resident_bytes']}", flush=True)
            with open(a.out + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
