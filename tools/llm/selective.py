"""An every-block preset of an LLM in PyTorch (dev-time; CPU, float32; issue 50): the
selective checkpoint (default) or the offload to host memory (--preset every-block:offload).

For a family of tools/llm/reference.py (default llama, sequence 2048, batch 1, SGD):
  1. `memplan plan models/llm/<family>.onnx --checkpoint PRESET --pytorch F.py`
     (the release binary), its predicted peak and bytes kept after forward;
  2. the same model built in PyTorch (reference.py's builder), F.py's apply() on it, one
     training step measured as models/export.py measures every reference (profiler timeline:
     bytes alive when forward ends, the step peak and its device-equivalent);
  3. gradients of one step with the file against one without it, bitwise (torch.equal).
Writes tests/data/pytorch/llm_selective_reference.json, or tests/data/pytorch/llm_offload_reference.json for the
offload (or --out); tests/llm.rs reads them.

    python tools/llm/selective.py [--preset every-block:offload] [--family llama] [--seq 2048]
        [--batch 1] [--out PATH]
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import reference as R  # noqa: E402

ref = R.ref  # models/export.py
PRESET = "every-block:selective"
OUT = {"every-block:selective": "llm_selective_reference.json",
       "every-block:offload": "llm_offload_reference.json"}


def plan(fam, batch, py):
    exe = os.path.join(ROOT, "target", "release", "memplan")
    cmd = [exe, "plan", os.path.join(ROOT, "models", "llm", fam + ".onnx"), "--batch", str(batch),
           "--optimizer", "sgd", "--checkpoint", PRESET, "--json", "--pytorch", py]
    if R.FAMILIES[fam]["labels"]:
        cmd += ["--loss", "graph"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def load(py):
    spec = importlib.util.spec_from_file_location("memplan_plan", py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def count_transfers(mod):
    """An offload file's hooks, counting: bytes packed to the host and unpacked back
    (the last step measured; {} for a file that offloads nothing)."""
    if not hasattr(mod, "_offload_hooks"):
        return {}
    counts = {"to_host_bytes": 0, "to_device_bytes": 0, "packed": 0}
    seen = {}
    hooks = mod._offload_hooks

    def counted(keep):
        pack, unpack = hooks(keep)

        def p(t):
            out = pack(t)
            if not isinstance(out, type(t)) and id(out[4]) not in seen:
                seen[id(out[4])] = out[4]
                counts["to_host_bytes"] += out[4].nbytes
                counts["packed"] += 1
            return out

        def u(x):
            out = unpack(x)
            if not isinstance(x, type(out)):
                counts["to_device_bytes"] += out.numel() * out.element_size()
            return out

        return p, u

    mod._offload_hooks = counted
    return counts


def gradients_equal(fam, batch, seq, mod):
    import torch

    build = R._builder(fam, seq, "float32")
    grads = []
    for applied in (False, True):
        m, make_inputs, _, _ = build(fam)
        if applied:
            mod.apply(m.m)
        torch.manual_seed(1)
        out = m(*make_inputs(batch))
        first = out[0] if isinstance(out, (tuple, list)) else out
        (first if R.FAMILIES[fam]["labels"] else first.mean()).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    differ = [n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])]
    return len(grads[0]), differ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="llama")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--preset", default=PRESET, choices=sorted(OUT))
    ap.add_argument("--out")
    a = ap.parse_args()
    globals()["PRESET"] = a.preset
    a.out = a.out or os.path.join(ROOT, "tests", "data", "pytorch", OUT[a.preset])
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        py = os.path.join(d, "plan.py")
        p = plan(a.family, a.batch, py)
        mod = load(py)
        transfers = count_transfers(mod)
        build = R._builder(a.family, a.seq, "float32")
        outputs = {}

        def prepare(model):
            mod.apply(model.m)

        e, common, _ = ref._measure_one_optimizer(a.family, a.batch, "sgd", "cpu", analyse=False,
                                                  prepare=prepare, builder=build)
        m, make_inputs, _, _ = build(a.family)
        with torch.no_grad():
            out = m(*make_inputs(a.batch))
        outputs = sum(t.numel() * t.element_size() for t in (out if isinstance(out, tuple) else (out,))
                      if isinstance(t, torch.Tensor))
        for k in transfers:
            transfers[k] = 0
        # (the host copies counted by the measured step above are let go)
        n, differ = gradients_equal(a.family, a.batch, a.seq, mod)
        # gradients_equal ran one step with the file: its transfers.
        transfers = dict(transfers)
    doc = {
        "_meta": {"generated_by": "python tools/llm/selective.py --family %s --seq %d --batch %d"
                  % (a.family, a.seq, a.batch), "versions": ref.versions(), "device": "cpu",
                  "definitions": {
                      "forward_end_delta_bytes": "PyTorch: bytes alive when forward ends, relative to after "
                      "zero_grad (kept for backward, the outputs and loss, and one CPU RNG state per "
                      "checkpoint call)",
                      "output_bytes": "the model's outputs as it returns them",
                      "rng_state_bytes": "torch.get_rng_state() per checkpointed block (preserve_rng_state)",
                      "transfers": "offload: bytes the file's hooks copied to the host (each saved tensor "
                      "packed) and back (each unpack) in one training step"}},
        "family": a.family, "seq": a.seq, "batch": a.batch, "preset": PRESET,
        "memplan": {k: p[k] for k in ("peak_bytes", "baseline_peak_bytes", "saved_bytes_at_forward_end",
                                       "checkpoint_modules", "selective_modules", "offloaded_modules",
                                       "host_bytes", "pcie_bytes", "overhead") if k in p},
        "pytorch": {k: e[k] for k in ("forward_end_delta_bytes", "step_peak_bytes",
                                      "resident_bytes_before_step", "device_equivalent_step_peak_delta_bytes",
                                      "peak_phase")},
        "output_bytes": outputs,
        "rng_state_bytes": int(torch.get_rng_state().numel())
        * (len(p["checkpoint_modules"]) - len(p.get("offloaded_modules", []))),
        "transfers": transfers,
        "gradients_compared": n,
        "gradients_differ": differ,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(json.dumps({k: doc[k] for k in ("memplan", "pytorch", "output_bytes", "rng_state_bytes",
                                          "transfers", "gradients_differ")}, indent=1))


if __name__ == "__main__":
    main()
