#!/usr/bin/env python3
"""FSDP2 per rank on several GPUs (issue 52, item 5): what memplan's --fsdp rows predict.

tools/pytorch/fsdp2_reference.py measures FSDP2 with gloo on the CPU. This runs the same
configs, model building, sharding and step (imported from it: build, shard, the step of
models/export.py) with NCCL on one GPU per rank, and records per rank and configuration:

- the measured step's (the second; the first creates AdamW's state)
  torch.cuda.max_memory_allocated() and max_memory_reserved(), the peak statistics reset
  just before it: compare with memplan's training.allocator.allocated_peak_bytes and
  reserved_bytes;
- torch.cuda.mem_get_info() before init_process_group (the CUDA context, a first tensor
  and a matmul made), after it, after the device mesh, after a first collective and after
  each measured step, so that what the process holds outside the caching allocator can be
  read off at each point (device used - reserved) and NCCL's share is that less the same
  figure before init_process_group: compare with memplan's training.device.nccl_bytes;
- a third step under per-phase peaks (models/export.py _CudaPhase): the phase of the peak;
- torch, CUDA and NCCL versions (torch.cuda.nccl.version()), the GPU's name, the world size.

    python3 -m torch.distributed.run --standalone --nproc_per_node N tools/gpu-fsdp.py --out DIR \\
        [--configs fsdp_llama_a,fsdp_llama_b,fsdp_llama_large] [--reshard true,false] [--policy fp32,bf16]

(torchrun is the same program.) Each rank writes DIR/rank<r>.json after every configuration;
rank 0 merges them into DIR/fsdp_gpu.json at the end, with each row's memplan command. After a
run that was cut short, or to put memplan's figures beside the measured ones (a memplan binary
built elsewhere; a config without a committed ONNX file is exported into DIR/onnx/ first, which
needs onnx and onnx_ir):

    python3 tools/gpu-fsdp.py --merge DIR [--memplan gpu-carry/memplan [--onnx gpu-carry]]

`--device cpu` runs the same with gloo on the CPU (the CUDA-only figures null): the smoke test.
fsdp_llama_large (8 layers, hidden 1024, sequence 1024; defined here) is large enough that the
allocator's figures are not dominated by cuBLAS's workspaces and the context; it has no
committed ONNX file: `python3 tools/gpu-fsdp.py --export fsdp_llama_large [--export-dir DIR]`
writes fsdp_llama_large.onnx and fsdp_llama_large_bfloat16.onnx into models/llm/ (or DIR;
tools/gpu-session.sh prepare puts them in gpu-carry/).
"""

import argparse
import datetime
import gc
import glob
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.relpath(os.path.abspath(__file__), ROOT)
sys.path.insert(0, os.path.join(HERE, "pytorch"))

import fsdp2_reference as fr  # noqa: E402  configs, build, shard, _local (and models/export.py as fr.ref)

ref = fr.ref

# A config where the step's tensors, not cuBLAS's workspaces and the context, make the figures:
# about 159 M parameters (0.64 GB in float32), GQA, SDPA, the model's own loss.
fr.CONFIGS.setdefault("fsdp_llama_large", dict(
    config=dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                max_position_embeddings=2048, tie_word_embeddings=False),
    attn="sdpa", labels=True, seq=1024, batch=2))
DEFAULT_CONFIGS = "fsdp_llama_a,fsdp_llama_b,fsdp_llama_large"

DEFINITIONS = {
    "step": "fsdp2_reference.py's (models/README.md, 'the measured step'): build(config) on the CPU "
    "(seed 0, float32), shard() (fully_shard per decoder layer, then the root; FSDP moves the "
    "parameters to the mesh's device), torch.optim.AdamW(lr=1e-3, foreach=True), each rank its own "
    "batch (input seed 1 + rank); a warm-up step, then the measured step (zero_grad(set_to_none), "
    "forward, loss, backward, opt.step()), torch.manual_seed(1234) before each; the configurations "
    "run one after another in the same processes, each model freed (gc, empty_cache) before the next",
    "max_memory_allocated_bytes": "torch.cuda.max_memory_allocated() over the measured step, "
    "reset_peak_memory_stats() just before it: compare with memplan's "
    "training.allocator.allocated_peak_bytes (which counts cuBLAS's workspaces, as PyTorch's does)",
    "max_memory_reserved_bytes": "torch.cuda.max_memory_reserved() over the same step: compare with "
    "training.allocator.reserved_bytes (the segments reserved by earlier configurations were released "
    "by empty_cache before this one was built)",
    "points": "per process: mem_get_info (free, total; used = total - free, the whole device's, one "
    "rank per device), memory_allocated, memory_reserved and process_minus_reserved = used - reserved "
    "at before_init_process_group (the context made by mem_get_info, a tensor and a 64x64 matmul), "
    "after_init_process_group (NCCL: device_id given, so the communicator is made here where "
    "torch supports it), after_mesh (init_device_mesh), after_first_collective (an all_reduce on "
    "the mesh's group); smi_used_mib is nvidia-smi's figure for the process where it lists it",
    "context_bytes": "process_minus_reserved at before_init_process_group: the CUDA context with "
    "cuBLAS loaded (and whatever else the device had in use; before_context_smi_used_mib is the "
    "device's use before this process made its context). memplan: training.device.context_bytes "
    "(--cuda-context)",
    "nccl_init_bytes": "process_minus_reserved after the first collective less context_bytes: "
    "NCCL's memory outside the allocator for the process group(s) made by then (process_groups "
    "counts them). memplan: training.device.nccl_bytes (--nccl-memory, per process group)",
    "outside_allocator_after_step_bytes": "process_minus_reserved after the measured step less "
    "context_bytes: NCCL's memory after FSDP's all-gathers and reduce-scatters ran, plus the modules "
    "the step's kernels loaded (cuDNN's, more of cuBLAS's)",
    "phase_peak_bytes": "a third step with reset_peak_memory_stats at each phase (models/export.py "
    "_CudaPhase): max_memory_allocated per phase; peak_phase is the largest",
    "resident_bytes_before_step": "distinct storages of the sharded parameters (DTensor local "
    "tensors), buffers, optimizer state and inputs after the warm-up step (as fsdp2_reference.py)",
    "memplan_command": "the memplan command each row compares with (as tests/fsdp.rs runs them); "
    "memplan_command_measured adds the context and NCCL figures measured on rank 0",
}


def _load_tool(name, file):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_TOOLS = {}


def smi_used_mib(pid):
    """nvidia-smi's memory for the process (tools/gpu-allocator-check.py), None without it."""
    if "allocator" not in _TOOLS:
        _TOOLS["allocator"] = _load_tool("gpu_allocator_check", "gpu-allocator-check.py")
    return _TOOLS["allocator"].smi_used_mib(pid)


def _smi(args):
    try:
        return subprocess.run(["nvidia-smi"] + args, capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _smi_gpu_used_mib(local_rank):
    """The device's used memory (nvidia-smi) before this process makes a context on it."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = str(local_rank)
    if vis:
        ids = [v.strip() for v in vis.split(",")]
        index = ids[local_rank] if local_rank < len(ids) else index
    out = _smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index])
    try:
        return int(out.strip()) if out else None
    except ValueError:
        return None


def memplan_gpu(name, total_bytes):
    """memplan's --gpu name for torch.cuda.get_device_name (None when memplan has no such card)."""
    n = (name or "").upper()
    gib = (total_bytes or 0) / 2**30
    for key, card in (("H200", "h200"), ("H100", "h100"), ("B200", "b200"), ("L40S", "l40s"),
                      ("4090", "rtx4090"), ("L4", "l4"), ("A10", None), ("T4", "t4")):
        if key in n:
            if key == "A10":
                if "A100" in n:
                    return "a100-80gb" if gib > 50 else "a100-40gb"
                return "a10"
            return card
    if "V100" in n:
        return "v100-32gb" if gib > 20 else "v100-16gb"
    return None


def _key(name, world, reshard, policy):
    return "%s/world%d_reshard_%s_%s" % (name, world, str(reshard).lower(), policy)


def memplan_file(name, policy):
    return "models/llm/%s%s.onnx" % (name, "" if policy == "fp32" else "_bfloat16")


def memplan_command(name, world, reshard, policy, gpu):
    spec = fr.CONFIGS[name]
    cmd = ["memplan", "profile", memplan_file(name, policy), "--train", "--batch", str(spec["batch"]),
           "--optimizer", "adamw", "--fsdp", str(world), "--reshard-after-forward", str(reshard).lower(),
           "--gpu", gpu or "GPU", "--json"]
    if spec["labels"]:
        cmd += ["--loss", "graph"]
    if policy == "bf16":
        cmd += ["--precision", "bf16", "--param-dtype", "bf16", "--reduce-dtype", "fp32"]
    return cmd


class Rank:
    """One rank's process: the process group, the points, one configuration after another."""

    def __init__(self, a):
        import torch

        self.torch = torch
        self.cuda = a.device == "cuda"
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.out = a.out
        self.res = {"rank": self.rank, "local_rank": self.local_rank, "world": self.world,
                    "device": a.device, "pid": os.getpid(), "points": {}, "cases": {}}
        if self.cuda:
            self.res["before_context_smi_used_mib"] = _smi_gpu_used_mib(self.local_rank)
            torch.cuda.set_device(self.local_rank)
            self.dev = torch.device("cuda", self.local_rank)
            torch.cuda.mem_get_info(self.dev)  # makes the context
            x = torch.randn(64, 64, device=self.dev)
            (x @ x).sum().item()  # cuBLAS loaded, its first workspace made
            del x
        else:
            self.dev = torch.device("cpu")
            torch.set_num_threads(1)
        self.point("before_init_process_group")

    def point(self, name=None):
        """The memory figures now, kept under points[name] when named."""
        torch = self.torch
        if not self.cuda:
            if name:
                self.res["points"][name] = None
            return None
        torch.cuda.synchronize(self.dev)
        free, total = torch.cuda.mem_get_info(self.dev)
        reserved = torch.cuda.memory_reserved(self.dev)
        p = {"free": free, "total": total, "used": total - free,
             "allocated": torch.cuda.memory_allocated(self.dev), "reserved": reserved,
             "process_minus_reserved": total - free - reserved, "smi_used_mib": smi_used_mib(os.getpid())}
        if name:
            self.res["points"][name] = p
        return p

    def _outside(self, p):
        base = self.res["points"]["before_init_process_group"]
        return None if p is None or base is None else p["process_minus_reserved"] - base["process_minus_reserved"]

    def init(self, pg_timeout):
        torch = self.torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        kw = {"timeout": datetime.timedelta(seconds=pg_timeout)}
        eager = False
        if self.cuda:
            try:
                dist.init_process_group("nccl", device_id=self.dev, **kw)
                eager = True
            except TypeError:  # a torch without device_id: the communicator is made lazily
                dist.init_process_group("nccl", **kw)
        else:
            dist.init_process_group("gloo", **kw)
        self.res["backend"] = dist.get_backend()
        self.res["device_id_given"] = eager
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.res.update(rank=self.rank, world=self.world)
        self.point("after_init_process_group")
        self.mesh = init_device_mesh(self.dev.type, (self.world,))
        self.point("after_mesh")
        group = self.mesh.get_group()
        default = group is dist.group.WORLD or \
            getattr(group, "group_name", None) == getattr(dist.group.WORLD, "group_name", None)
        self.res["mesh_group_is_default"] = default
        t = torch.ones(1, device=self.dev)
        dist.all_reduce(t, group=group)
        if not default:  # the default group's communicator too (the final barrier uses it)
            dist.all_reduce(t)
        p = self.point("after_first_collective")
        try:
            self.res["process_groups"] = len(dist.distributed_c10d._world.pg_map)
        except Exception:  # noqa: BLE001  a private table
            self.res["process_groups"] = None
        base = self.res["points"]["before_init_process_group"]
        self.res["context_bytes"] = base and base["process_minus_reserved"]
        self.res["nccl_init_bytes"] = self._outside(p)
        self.res["nccl_after_init_process_group_bytes"] = self._outside(self.res["points"]["after_init_process_group"])
        self.versions()

    def versions(self):
        torch = self.torch
        import transformers

        v = {"torch": torch.__version__, "transformers": transformers.__version__,
             "python": sys.version.split()[0], "cuda": torch.version.cuda, "nccl": None}
        if self.cuda:
            try:
                nv = torch.cuda.nccl.version()
                v["nccl"] = ".".join(map(str, nv)) if isinstance(nv, tuple) else str(nv)
            except Exception as e:  # noqa: BLE001
                v["nccl"] = "unknown: %s" % e
            props = torch.cuda.get_device_properties(self.dev)
            self.res["gpu_name"] = torch.cuda.get_device_name(self.dev)
            self.res["gpu_total_bytes"] = props.total_memory
            self.res["memplan_gpu"] = memplan_gpu(self.res["gpu_name"], props.total_memory)
        else:
            self.res["gpu_name"] = self.res["gpu_total_bytes"] = self.res["memplan_gpu"] = None
        self.res["versions"] = v
        self.res["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
        self.res["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")

    def _free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)
            self.torch.cuda.empty_cache()

    def case(self, name, reshard, policy):
        torch = self.torch
        spec = fr.CONFIGS[name]
        self._free()
        c = {"config": name, "reshard_after_forward": reshard, "policy": policy}
        if self.cuda:
            c["allocated_left_before_case_bytes"] = torch.cuda.memory_allocated(self.dev)
        t0 = time.time()
        model, make_inputs, _ = fr.build(name)
        fr.shard(model, self.mesh, reshard, policy)
        for m in model.modules():  # FSDP moves what it manages; a buffer left behind follows
            for n, b in list(m.named_buffers(recurse=False)):
                if b is not None and b.device != self.dev:
                    m._buffers[n] = b.to(self.dev)
        bad = [n for n, p in model.named_parameters() if fr._local(p).device.type != self.dev.type]
        if bad:
            raise RuntimeError("parameters not on %s after fully_shard: %s" % (self.dev, bad[:3]))
        inputs = tuple(t.to(self.dev) for t in make_inputs(spec["batch"], seed=1 + self.rank))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        torch.manual_seed(ref.TRAIN_SEED)
        ref._train_step(model, opt, inputs, ref._NullPhase())  # warm-up: AdamW's state
        c["build_and_warmup_seconds"] = round(time.time() - t0, 2)

        params = [fr._local(p) for p in model.parameters()]
        state = [fr._local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        seen = set()
        c["sharded_param_bytes"] = ref._sum_storages(params, seen)
        c["buffers_bytes"] = ref._sum_storages(list(model.buffers()), seen)
        c["optimizer_state_bytes"] = ref._sum_storages(state, seen)
        c["input_bytes"] = ref._sum_storages(inputs, seen)
        c["resident_bytes_before_step"] = (c["sharded_param_bytes"] + c["buffers_bytes"]
                                           + c["optimizer_state_bytes"] + c["input_bytes"])
        if self.rank == 0:
            c["fsdp_groups"] = fr.fsdp_groups(model, self.world)

        if self.cuda:
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            c["allocated_before_step_bytes"] = torch.cuda.memory_allocated(self.dev)
            c["reserved_before_step_bytes"] = torch.cuda.memory_reserved(self.dev)
        t1 = time.time()
        torch.manual_seed(ref.TRAIN_SEED)
        ref._train_step(model, opt, inputs, ref._NullPhase())  # the measured step
        if self.cuda:
            torch.cuda.synchronize(self.dev)
        c["step_seconds"] = round(time.time() - t1, 4)
        c["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(self.dev) if self.cuda else None
        c["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(self.dev) if self.cuda else None
        c["grads_bytes"] = ref._sum_storages([fr._local(p.grad) for p in model.parameters() if p.grad is not None])
        after = self.point()
        c["after_step"] = after
        c["outside_allocator_after_step_bytes"] = self._outside(after)

        if self.cuda:
            ph = ref._CudaPhase()
            torch.manual_seed(ref.TRAIN_SEED)
            ref._train_step(model, opt, inputs, ph)
            torch.cuda.synchronize(self.dev)
            c["phase_peak_bytes"] = dict(ph.peak)
            c["peak_phase"] = max(ph.peak, key=ph.peak.get) if ph.peak else None
        else:
            c["phase_peak_bytes"] = c["peak_phase"] = None
        del model, opt, inputs, params, state
        self._free()
        return c

    def write(self):
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, "rank%d.json" % self.rank)
        with open(path + ".tmp", "w") as f:
            json.dump(self.res, f, indent=1)
        os.replace(path + ".tmp", path)


def worker(a):
    import torch.distributed as dist

    r = Rank(a)
    r.write()  # the context's figures stay even when NCCL's start hangs
    r.init(a.pg_timeout)
    if r.rank == 0:
        print("world %d, %s, %s, torch %s, NCCL %s; context %s B, NCCL after the first collective %s B"
              % (r.world, r.res["backend"], r.res["gpu_name"] or "cpu", r.res["versions"]["torch"],
                 r.res["versions"]["nccl"], r.res["context_bytes"], r.res["nccl_init_bytes"]), flush=True)
    r.write()
    for name in a.configs.split(","):
        for policy in a.policy.split(","):
            for reshard in [s == "true" for s in a.reshard.split(",")]:
                key = _key(name, r.world, reshard, policy)
                try:
                    c = r.case(name, reshard, policy)
                except Exception as e:  # noqa: BLE001  recorded; a rank that fails a collective ends the run
                    c = {"config": name, "reshard_after_forward": reshard, "policy": policy,
                         "error": ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:400]}
                    r._free()
                r.res["cases"][key] = c
                r.write()
                if r.rank == 0:
                    print(key, "error: " + c["error"] if "error" in c else
                          "max_memory_allocated %s, reserved %s, outside the allocator %s, step %.3f s"
                          % (c["max_memory_allocated_bytes"], c["max_memory_reserved_bytes"],
                             c["outside_allocator_after_step_bytes"], c["step_seconds"]), flush=True)
    dist.barrier()
    if r.rank == 0:
        merge(a.out, None)
    dist.destroy_process_group()


def _validate(a):
    for n in a.configs.split(","):
        if n not in fr.CONFIGS:
            raise SystemExit("unknown config '%s' (known: %s)" % (n, ", ".join(fr.CONFIGS)))
    for s in a.reshard.split(","):
        if s not in ("true", "false"):
            raise SystemExit("--reshard takes true, false or true,false")
    for p in a.policy.split(","):
        if p not in fr.POLICIES:
            raise SystemExit("--policy takes %s" % ",".join(fr.POLICIES))


def _export(name, dtype, path):
    from memplan_export import export_hf

    spec = fr.CONFIGS[name]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return export_hf(spec["config"], path, dtype=dtype, seq=spec["seq"], labels=spec["labels"], attn=spec["attn"])


def _run_memplan(binary, cmd, out, onnx_dir=None):
    """memplan's figures for a row's command. An ONNX file that is not committed is taken from
    onnx_dir (`--export CONFIG --export-dir DIR` made it elsewhere) or exported into out/onnx."""
    cmd = list(cmd)
    cmd[0] = binary
    path = cmd[2]
    if not os.path.exists(os.path.join(ROOT, path)):
        local = os.path.join(os.path.abspath(out), "onnx", os.path.basename(path))
        given = onnx_dir and os.path.join(os.path.abspath(onnx_dir), os.path.basename(path))
        if given and os.path.exists(given):
            local = given
        elif not os.path.exists(local):
            name = os.path.basename(path)[:-len(".onnx")]
            dtype = "bf16" if name.endswith("_bfloat16") else "fp32"
            try:
                _export(name[:-len("_bfloat16")] if dtype == "bf16" else name, dtype, local)
            except Exception as e:  # noqa: BLE001
                return {"error": "no %s, and exporting it failed: %s" % (path, str(e).splitlines()[0][:300])}
        cmd[2] = local
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)[:300]}
    if p.returncode != 0:
        return {"error": (p.stderr.strip() or "exit %d" % p.returncode)[-400:]}
    t = json.loads(p.stdout)["training"]
    return {"file": os.path.relpath(cmd[2], ROOT) if cmd[2].startswith(ROOT) else cmd[2],
            "peak_bytes": t["peak_bytes"], "peak_phase": t.get("peak_phase"),
            "allocated_peak_bytes": t["allocator"]["allocated_peak_bytes"],
            "reserved_bytes": t["allocator"]["reserved_bytes"], "device_bytes": t.get("device_bytes"),
            "context_bytes": t["device"].get("context_bytes"), "nccl_bytes": t["device"].get("nccl_bytes"),
            "sharded_param_bytes": t.get("fsdp", {}).get("sharded_param_bytes"),
            "ranks": [{"peak_bytes": r["peak_bytes"], "reserved_bytes": r["reserved_bytes"],
                       "param_bytes": r["param_bytes"]} for r in t.get("parallel", {}).get("ranks", [])]}


def _rel(ours, theirs):
    return None if not ours or not theirs else round((ours - theirs) / theirs, 5)


def merge(out, binary, gpu_override=None, onnx_dir=None):
    """DIR/rank<r>.json into DIR/fsdp_gpu.json (rows by configuration, per-rank lists)."""
    ranks = sorted((json.load(open(p)) for p in glob.glob(os.path.join(out, "rank*.json"))),
                   key=lambda r: r["rank"])
    if not ranks:
        raise SystemExit("no rank<r>.json in %s" % out)
    r0 = ranks[0]
    world = r0["world"]
    gpu = gpu_override or r0.get("memplan_gpu")
    res = {"_meta": {
        "generated_by": "python3 -m torch.distributed.run --standalone --nproc_per_node %d %s --out DIR"
        % (world, SCRIPT),
        "world": world, "ranks_written": [r["rank"] for r in ranks], "device": r0["device"],
        "backend": r0.get("backend"), "gpu_name": r0.get("gpu_name"), "gpu_total_bytes": r0.get("gpu_total_bytes"),
        "memplan_gpu": gpu, "versions": r0.get("versions"), "nccl_env": r0.get("nccl_env"),
        "alloc_conf": r0.get("alloc_conf"), "device_id_given": r0.get("device_id_given"),
        "process_groups": r0.get("process_groups"), "mesh_group_is_default": r0.get("mesh_group_is_default"),
        "definitions": DEFINITIONS,
    }}
    if r0["device"] == "cuda":
        res["_meta"]["nvidia_smi"] = _smi(["--query-gpu=index,name,driver_version,memory.total,memory.used",
                                           "--format=csv,noheader"])
        res["_meta"]["nvidia_smi_topo"] = _smi(["topo", "-m"])
    res["process"] = {k: [r.get(k) for r in ranks] for k in
                      ("context_bytes", "nccl_after_init_process_group_bytes", "nccl_init_bytes",
                       "before_context_smi_used_mib")}
    res["process"]["points"] = [r["points"] for r in ranks]
    ctx, nccl = r0.get("context_bytes"), r0.get("nccl_init_bytes")
    rows = []
    for key in r0["cases"]:
        cs = [r["cases"].get(key, {"error": "not written"}) for r in ranks]
        c0 = cs[0]
        name, reshard, policy = c0["config"], c0["reshard_after_forward"], c0["policy"]
        spec = fr.CONFIGS[name]
        cmd = memplan_command(name, world, reshard, policy, gpu)
        row = {"key": key, "config": name, "world": world, "reshard_after_forward": reshard, "policy": policy,
               "mp_policy": "MixedPrecisionPolicy()" if fr.POLICIES[policy] is None else
               "MixedPrecisionPolicy(param_dtype=torch.%s, reduce_dtype=torch.%s)" % fr.POLICIES[policy],
               "batch": spec["batch"], "seq": spec["seq"], "loss": "graph" if spec["labels"] else "mean",
               "memplan_command": " ".join(shlex.quote(x) for x in cmd)}
        if ctx and nccl:
            row["memplan_command_measured"] = row["memplan_command"] + " --cuda-context %d --nccl-memory %d" % (
                ctx, nccl)
        if not os.path.exists(os.path.join(ROOT, memplan_file(name, policy))):
            row["export_command"] = "python3 %s --export %s" % (SCRIPT, name)
        errors = {r["rank"]: c["error"] for r, c in zip(ranks, cs) if "error" in c}
        if errors:
            row["errors"] = errors
        for k in ("max_memory_allocated_bytes", "max_memory_reserved_bytes", "allocated_before_step_bytes",
                  "reserved_before_step_bytes", "outside_allocator_after_step_bytes", "resident_bytes_before_step",
                  "sharded_param_bytes", "optimizer_state_bytes", "grads_bytes", "peak_phase", "step_seconds",
                  "allocated_left_before_case_bytes"):
            row[k] = [c.get(k) for c in cs]
        row["phase_peak_bytes"] = [c.get("phase_peak_bytes") for c in cs]
        row["fsdp_groups"] = c0.get("fsdp_groups")
        if binary:
            m = _run_memplan(binary, cmd, out, onnx_dir)
            row["memplan"] = m
            if "error" not in m:
                worst = max((v for v in row["max_memory_allocated_bytes"] if v), default=None)
                worst_r = max((v for v in row["max_memory_reserved_bytes"] if v), default=None)
                row["compare"] = {
                    "allocated_peak_vs_max_memory_allocated": _rel(m["allocated_peak_bytes"], worst),
                    "reserved_vs_max_memory_reserved": _rel(m["reserved_bytes"], worst_r),
                    "nccl_bytes_vs_nccl_init_bytes": _rel(m["nccl_bytes"], nccl),
                }
            m2 = None
            if row.get("memplan_command_measured"):
                m2 = _run_memplan(binary, shlex.split(row["memplan_command_measured"]), out, onnx_dir)
            row["memplan_measured_context"] = m2
        rows.append(row)
    res["rows"] = rows
    path = os.path.join(out, "fsdp_gpu.json")
    with open(path + ".tmp", "w") as f:
        f.write(ref._json_compact(res) + "\n")
    os.replace(path + ".tmp", path)
    print("wrote %s: %d rows, ranks %s" % (path, len(rows), res["_meta"]["ranks_written"]), flush=True)
    for row in rows:
        line = "%s: max_memory_allocated %s" % (row["key"], row["max_memory_allocated_bytes"])
        if row.get("compare"):
            line += ", memplan %s (%s)" % (row["memplan"]["allocated_peak_bytes"],
                                          row["compare"]["allocated_peak_vs_max_memory_allocated"])
        elif row.get("memplan"):
            line += ", memplan: %s" % row["memplan"]["error"][:160]
        print(line, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the folder for rank<r>.json and fsdp_gpu.json")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="default " + DEFAULT_CONFIGS)
    ap.add_argument("--reshard", default="true,false", help="reshard_after_forward values (default true,false)")
    ap.add_argument("--policy", default="fp32,bf16", help="fp32, bf16 or both (default fp32,bf16)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo (the smoke test)")
    ap.add_argument("--pg-timeout", type=int, default=300, help="the process group's timeout, seconds")
    ap.add_argument("--merge", metavar="DIR", help="merge DIR/rank<r>.json into DIR/fsdp_gpu.json (no torchrun)")
    ap.add_argument("--memplan", metavar="BIN", help="with --merge: run each row's memplan command with BIN")
    ap.add_argument("--gpu", help="with --merge: memplan's --gpu name (default: from the device's name)")
    ap.add_argument("--onnx", metavar="FOLDER", help="with --merge: where ONNX files not committed lie")
    ap.add_argument("--export", metavar="CONFIG", help="write CONFIG.onnx and CONFIG_bfloat16.onnx")
    ap.add_argument("--export-dir", default="models/llm", help="with --export: the folder (default models/llm)")
    a = ap.parse_args()
    if a.export:
        if a.export not in fr.CONFIGS:
            raise SystemExit("unknown config '%s' (known: %s)" % (a.export, ", ".join(fr.CONFIGS)))
        for dt in ("fp32", "bf16"):
            path = os.path.join(ROOT, a.export_dir, os.path.basename(memplan_file(a.export, dt)))
            ex = _export(a.export, dt, path)
            print("exported %s (%d nodes)" % (ex.path, ex.nodes), flush=True)
        return
    if a.merge:
        merge(a.merge, a.memplan, a.gpu, a.onnx)
        return
    if not a.out:
        ap.error("--out DIR is needed")
    _validate(a)
    if "WORLD_SIZE" not in os.environ:
        ap.error("run it under torchrun (python3 -m torch.distributed.run --standalone --nproc_per_node N ...)")
    worker(a)


if __name__ == "__main__":
    main()
