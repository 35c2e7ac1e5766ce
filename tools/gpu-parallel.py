#!/usr/bin/env python3
"""Tensor and pipeline parallelism per rank on several GPUs (issue 52, item 5): what memplan's
--tp and --pp figures predict, measured with NCCL, one process per GPU.

tools/pytorch/tp_reference.py measures tensor parallelism with gloo on the CPU (torch's
allocator events). This runs, with NCCL on one GPU per rank, and records per rank the measured
step's torch.cuda.max_memory_allocated() and max_memory_reserved() (the peak statistics reset
just before it; the first step creates AdamW's state):

- tensor parallelism: tp_reference.py's plan (parallelize_module: q/k/v, gate/up ColwiseParallel,
  o/down RowwiseParallel, embed_tokens vocabulary-parallel, lm_head ColwiseParallel with the
  logits left sharded) on fsdp_llama_a (4 heads) and fsdp_llama_large (16 heads, 8 key/value
  heads), every rank the same batch, AdamW(foreach=True) over the split and the whole
  parameters, at the world size where the heads divide;
- pipeline parallelism: tools/pytorch/pp_reference.py's stages and step
  (torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe, one stage per rank split as
  memplan splits by default, 2 × world micro-batches of the config's batch, the model's own
  loss on the last stage, AdamW(foreach=True) per stage) on fsdp_llama_b and fsdp_llama_large.

    python3 -m torch.distributed.run --standalone --nproc_per_node N tools/gpu-parallel.py --out DIR \\
        [--cases tp,pp] [--configs fsdp_llama_a,fsdp_llama_b,fsdp_llama_large]

Each rank writes DIR/rank<r>.json after every case; then, with memplan's figures (`memplan
profile FILE --train --tp N` or `--pp N --microbatches M --pp-schedule S`, with --gpu from the
device's name) beside the measured ones:

    python3 tools/gpu-parallel.py --merge DIR --memplan gpu-carry/memplan [--onnx gpu-carry]

writes DIR/parallel_gpu.json. `--device cpu` runs the same with gloo on the CPU (the CUDA
figures null): the smoke test, which is all it has had (no machine with several GPUs lent yet).
"""

import argparse
import gc
import glob
import importlib.util
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.relpath(os.path.abspath(__file__), ROOT)
sys.path.insert(0, os.path.join(HERE, "pytorch"))


def _load_tool(name, file):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gf = _load_tool("gpu_fsdp", "gpu-fsdp.py")  # fsdp_llama_large, memplan_gpu, _run_memplan
fr = gf.fr  # tools/pytorch/fsdp2_reference.py: configs, build
import pp_reference as ppr  # noqa: E402  the pipeline's stages and step
import tp_reference as tpr  # noqa: E402  the tensor-parallel plan

DEFAULT_CONFIGS = "fsdp_llama_a,fsdp_llama_b,fsdp_llama_large"
# Which configs each kind runs: tensor parallelism needs the heads to divide, the pipeline
# enough layers and the model's own loss (labels).
TP_CONFIGS = ("fsdp_llama_a", "fsdp_llama_large")
PP_CONFIGS = ("fsdp_llama_b", "fsdp_llama_large")
PP_SCHEDULES = ("1f1b", "gpipe")


def _heads_divide(name, world):
    c = fr.CONFIGS[name]["config"]
    return c["num_attention_heads"] % world == 0 and c["num_key_value_heads"] % world == 0


def cases(kinds, configs, world):
    out = []
    for name in configs:
        if "tp" in kinds and name in TP_CONFIGS and _heads_divide(name, world):
            out.append({"kind": "tp", "config": name})
        layers = fr.CONFIGS[name]["config"]["num_hidden_layers"]
        if "pp" in kinds and name in PP_CONFIGS and layers >= world:
            for s in PP_SCHEDULES:
                out.append({"kind": "pp", "config": name, "schedule": s, "microbatches": 2 * world})
    return out


def key(case, world):
    k = "%s/%s%d" % (case["config"], case["kind"], world)
    return k + ("_%s_m%d" % (case["schedule"], case["microbatches"]) if case["kind"] == "pp" else "")


def _reset(device):
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks(device):
    import torch

    if device != "cuda":
        return {"max_memory_allocated_bytes": None, "max_memory_reserved_bytes": None}
    torch.cuda.synchronize()
    return {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
            "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
            "allocated_after_step_bytes": torch.cuda.memory_allocated()}


def run_tp(case, mesh, device):
    import torch
    from torch.distributed.tensor import DTensor

    spec = fr.CONFIGS[case["config"]]
    model, make_inputs, _ = fr.build(case["config"])
    model.to(device)
    tpr.parallelize(model.m, mesh)
    inputs = tuple(t.to(device) for t in make_inputs(spec["batch"], seed=1))
    split = [p for p in model.parameters() if isinstance(p, DTensor)]
    whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
    opt = torch.optim.AdamW([{"params": split}, {"params": whole}], lr=1e-3, foreach=True)
    torch.manual_seed(fr.ref.TRAIN_SEED)
    fr.ref._train_step(model, opt, inputs, fr.ref._NullPhase())
    _reset(device)
    t0 = time.time()
    torch.manual_seed(fr.ref.TRAIN_SEED)
    fr.ref._train_step(model, opt, inputs, fr.ref._NullPhase())
    out = {"batch": spec["batch"], "step_seconds": round(time.time() - t0, 4), **_peaks(device)}
    del model, opt, inputs, split, whole
    return out


def run_pp(case, rank, world, device):
    import torch

    p = ppr.Pipeline(case["config"], rank, world, case["schedule"], case["microbatches"], device)
    torch.manual_seed(fr.ref.TRAIN_SEED)
    p.step(fr.ref._NullPhase())
    _reset(device)
    t0 = time.time()
    torch.manual_seed(fr.ref.TRAIN_SEED)
    p.step(fr.ref._NullPhase())
    out = {"layers": list(p.layers), "micro_batch": fr.CONFIGS[case["config"]]["batch"],
           "step_seconds": round(time.time() - t0, 4),
           "param_bytes": sum(t.numel() * t.element_size() for t in p.module.parameters()), **_peaks(device)}
    del p
    return out


def worker(a):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(a.device, (world,))
    res = {"rank": rank, "world": world, "device": a.device, "torch": torch.__version__, "cases": {}}
    if a.device == "cuda":
        res["gpu_name"] = torch.cuda.get_device_name(local)
        res["gpu_total_bytes"] = torch.cuda.get_device_properties(local).total_memory
        res["memplan_gpu"] = gf.memplan_gpu(res["gpu_name"], res["gpu_total_bytes"])
        res["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    os.makedirs(a.out, exist_ok=True)
    for case in cases(a.cases.split(","), a.configs.split(","), world):
        k = key(case, world)
        try:
            r = run_tp(case, mesh, a.device) if case["kind"] == "tp" else run_pp(case, rank, world, a.device)
            r.update(case)
        except Exception as e:  # noqa: BLE001  one case failing must not lose the others
            r = dict(case, error="%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e) else ""))
        res["cases"][k] = r
        _reset(a.device)
        dist.barrier()
        with open(os.path.join(a.out, "rank%d.json" % rank), "w") as f:
            json.dump(res, f)
        print("rank %d: %s %s" % (rank, k, r.get("error") or r.get("max_memory_allocated_bytes")), flush=True)
    dist.destroy_process_group()


def memplan_command(case, world, gpu):
    spec = fr.CONFIGS[case["config"]]
    cmd = ["memplan", "profile", gf.memplan_file(case["config"], "fp32"), "--train", "--batch", str(spec["batch"]),
           "--optimizer", "adamw", "--gpu", gpu or "GPU", "--json"]
    if spec["labels"]:
        cmd += ["--loss", "graph"]
    if case["kind"] == "tp":
        return cmd + ["--tp", str(world)]
    return cmd + ["--pp", str(world), "--microbatches", str(case["microbatches"]), "--pp-schedule", case["schedule"]]


def merge(out, binary, onnx_dir=None, gpu_override=None):
    ranks = sorted((json.load(open(p)) for p in glob.glob(os.path.join(out, "rank*.json"))), key=lambda r: r["rank"])
    if not ranks:
        raise SystemExit("no rank<r>.json in %s" % out)
    r0 = ranks[0]
    world, gpu = r0["world"], gpu_override or r0.get("memplan_gpu")
    res = {"_meta": {"generated_by": "python3 -m torch.distributed.run --standalone --nproc_per_node %d %s --out DIR"
                     % (world, SCRIPT), "world": world, "device": r0["device"], "gpu_name": r0.get("gpu_name"),
                     "memplan_gpu": gpu, "torch": r0.get("torch"), "nccl": r0.get("nccl")}, "rows": []}
    for k, c0 in r0["cases"].items():
        cs = [r["cases"].get(k, {"error": "not written"}) for r in ranks]
        case = {x: c0[x] for x in ("kind", "config", "schedule", "microbatches") if x in c0}
        cmd = memplan_command(case, world, gpu)
        row = {"key": k, **case, "memplan_command": " ".join(shlex.quote(x) for x in cmd)}
        for f in ("max_memory_allocated_bytes", "max_memory_reserved_bytes", "param_bytes", "layers",
                  "step_seconds", "error"):
            row[f] = [c.get(f) for c in cs]
        if binary:
            m = gf._run_memplan(binary, cmd, out, onnx_dir)
            row["memplan"] = m
            worst = max((v for v in row["max_memory_allocated_bytes"] if v), default=None)
            if "error" not in m:
                row["compare"] = {"allocated_peak_vs_worst_max_memory_allocated":
                                  gf._rel(m["allocated_peak_bytes"], worst)}
                if case["kind"] == "pp" and len(m["ranks"]) == world:
                    row["compare"]["stage_peak_vs_max_memory_allocated"] = [
                        gf._rel(mr["peak_bytes"], v) for mr, v in zip(m["ranks"], row["max_memory_allocated_bytes"])]
        res["rows"].append(row)
    path = os.path.join(out, "parallel_gpu.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print("wrote %s: %d rows" % (path, len(res["rows"])), flush=True)
    for row in res["rows"]:
        print("%s: max_memory_allocated %s; memplan %s" % (
            row["key"], row["max_memory_allocated_bytes"],
            row.get("compare") or (row.get("memplan") or {}).get("error")), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the folder for rank<r>.json (and parallel_gpu.json)")
    ap.add_argument("--cases", default="tp,pp", help="tp, pp or both (default tp,pp)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="default " + DEFAULT_CONFIGS)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo (the smoke test)")
    ap.add_argument("--merge", action="store_true", help="merge DIR/rank<r>.json into DIR/parallel_gpu.json")
    ap.add_argument("--memplan", help="with --merge: the memplan binary whose figures go beside")
    ap.add_argument("--onnx", help="with --merge: where fsdp_llama_large's ONNX file is (gpu-carry)")
    ap.add_argument("--gpu", help="with --merge: memplan's --gpu name (default: from the device's name)")
    a = ap.parse_args()
    if a.merge:
        merge(a.out, a.memplan, a.onnx, a.gpu)
    else:
        worker(a)


if __name__ == "__main__":
    main()
