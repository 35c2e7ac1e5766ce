#!/usr/bin/env python3
"""memplan's allocator figures against PyTorch on a GPU (issue 17; docs/ALLOCATOR.md).

For each model and batch: PyTorch trains it on the GPU (models/export.py's build(),
Adam, fp32, mean loss, the loop of models/export.py's _train_step) for a few steps
and records torch.cuda.max_memory_allocated, max_memory_reserved and nvidia-smi's
memory for this process; memplan profiles the exported ONNX for the same batch with
`--gpu` of the card and the CUDA context measured here (`--cuda-context`). Each model
runs in a fresh process, so the context and the allocator start empty.

    python3 tools/gpu-allocator-check.py --memplan target/release/memplan \\
        --gpu h200 --out "$OUT/allocator-check.json"

Prints one line per case and writes JSON. Needs torch (CUDA) and nvidia-smi; the
memplan binary is built elsewhere (`cargo build --release`) and carried over.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_CASES = "resnet50:8,32;gpt2:4,8;bert_base:8,16;vit_b_16:8,32;mobilenet_v2:32,64;cnn:64,256"
STEPS = 3


def smi_used_mib(pid):
    """nvidia-smi's used memory of process `pid` in MiB (None when not listed)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


VARIANTS = {
    "": "PyTorch's defaults",
    "no-cudnn": "torch.backends.cudnn.enabled = False (convolutions without cuDNN and its workspaces)",
    "math-sdpa": "scaled_dot_product_attention's math kernel only (attention as matmul and softmax)",
}


def measure(name, batch, expandable, variant=""):
    """One model in this process: the PyTorch figures (run as a child process)."""
    if expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if variant == "no-cudnn":
        torch.backends.cudnn.enabled = False
    elif variant == "math-sdpa":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)

    sys.path.insert(0, os.path.join(ROOT, "models"))
    import export

    free0, total = torch.cuda.mem_get_info()
    torch.zeros(1, device="cuda")
    a = torch.randn(64, 64, device="cuda")
    (a @ a).sum().item()  # cuBLAS loaded and its first workspace made
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    reserved1 = torch.cuda.memory_reserved()
    ctx_smi = smi_used_mib(os.getpid())
    # The context at start: the process's memory (nvidia-smi) after the first tensor
    # and matmul, less what the allocator reserved by then (mem_get_info's change
    # misses the context itself: the first call makes it). Modules loaded later
    # (cuDNN's, more of cuBLAS's) add to it: see process_minus_reserved_bytes.
    context = (ctx_smi << 20) - reserved1 if ctx_smi else None
    del a
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    model, make_inputs, _, _ = export.build(name)
    model.to("cuda").train()
    inputs = tuple(t.to("cuda") for t in make_inputs(batch))
    opt = export._make_optimizer("adam", model)
    for _ in range(STEPS):
        export._train_step(model, opt, inputs, export._NullPhase())
    torch.cuda.synchronize()
    smi = smi_used_mib(os.getpid())
    reserved_end = torch.cuda.memory_reserved()
    return {
        "variant": variant,
        "reserved_after_context": reserved1,
        "context_mem_get_info_bytes": (free0 - free1) - reserved1,
        "reserved_at_end": reserved_end,
        # What the process holds beyond the allocator while it trains: the context
        # with every module loaded lazily by then (cuDNN's, cuBLAS's kernels).
        "process_minus_reserved_bytes": (smi << 20) - reserved_end if smi else None,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "nvidia_smi_mib": smi,
        "context_smi_mib": ctx_smi,
        "context_bytes": context,
        "device_total_bytes": total,
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def memplan(binary, name, batch, gpu, context, expandable):
    cmd = [binary, "profile", os.path.join(ROOT, "models", name + ".onnx"), "--batch", str(batch),
           "--train", "--json"]
    if gpu:
        cmd += ["--gpu", gpu]
    if context:
        cmd += ["--cuda-context", str(context)]
    if expandable:
        cmd += ["--allocator", "expandable"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()}
    t = json.loads(out.stdout)["training"]
    return {"peak_bytes": t["peak_bytes"], "device_bytes": t["device_bytes"], **t["allocator"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memplan", default=os.path.join(ROOT, "target", "release", "memplan"))
    ap.add_argument("--gpu", help="memplan's --gpu name of this card (h100, a100-80gb, ...)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="model:batch,batch;... (default: %(default)s)")
    ap.add_argument("--expandable", action="store_true", help="also with expandable_segments:True")
    ap.add_argument("--variant", default="", choices=list(VARIANTS),
                    help="PyTorch run differently, to find what a difference comes from: "
                    + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items() if k))
    ap.add_argument("--out", default="allocator-check.json")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "BATCH", "EXPANDABLE", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child[0], int(a.child[1]), a.child[2] == "1", a.child[3])))
        return
    results = []
    for case in a.cases.split(";"):
        name, batches = case.split(":")
        for b in (int(x) for x in batches.split(",")):
            for exp in ([False, True] if a.expandable else [False]):
                child = subprocess.run([sys.executable, __file__, "--child", name, str(b), "1" if exp else "0", a.variant],
                                       capture_output=True, text=True)
                if child.returncode != 0:
                    tail = (child.stderr.strip().splitlines() or ["?"])[-1]
                    results.append({"model": name, "batch": b, "expandable": exp, "variant": a.variant,
                                    "torch_error": tail})
                    print(f"{name} b{b}{' exp' if exp else ''}{' ' + a.variant if a.variant else ''}: "
                          f"PyTorch failed: {tail}", flush=True)
                    continue
                t = json.loads(child.stdout.strip().splitlines()[-1])
                # the context as memplan's --gpu default is measured: what the process
                # holds beyond the allocator while training (else right after start)
                m = memplan(a.memplan, name, b, a.gpu, t.get("process_minus_reserved_bytes") or t["context_bytes"], exp)
                row = {"model": name, "batch": b, "expandable": exp, "variant": a.variant, "torch": t, "memplan": m}
                if "reserved_bytes" in m:
                    row["reserved_rel_diff"] = m["reserved_bytes"] / t["max_memory_reserved"] - 1
                    row["allocated_rel_diff"] = m["allocated_peak_bytes"] / t["max_memory_allocated"] - 1
                    if t["nvidia_smi_mib"]:
                        row["device_rel_diff"] = m["device_bytes"] / (t["nvidia_smi_mib"] << 20) - 1
                results.append(row)
                print(f"{name} b{b}{' exp' if exp else ''}{' ' + a.variant if a.variant else ''}: torch allocated {t['max_memory_allocated']} "
                      f"reserved {t['max_memory_reserved']} smi {t['nvidia_smi_mib']} MiB | memplan "
                      f"allocated {m.get('allocated_peak_bytes')} reserved {m.get('reserved_bytes')} "
                      f"device {m.get('device_bytes')} | reserved diff "
                      f"{row.get('reserved_rel_diff', float('nan')) * 100:+.1f}%", flush=True)
                with open(a.out + ".tmp", "w") as f:  # whole or not at all, if killed
                    json.dump(results, f, indent=1)
                os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
