#!/usr/bin/env python3
"""Measure one PyTorch training step of fine-tuning / activation-checkpointing cases on CPU
(dev-time tool, not needed to build memplan).

Usage:
    python tools/pytorch/finetune_reference.py                  # every case of tests/data/pytorch/finetune_cases.json
    python tools/pytorch/finetune_reference.py --only a,b       # a subset (entries merged into the output)
    python tools/pytorch/finetune_reference.py --peers          # ResNet-50 / GPT-2 batch 8 (SGD): no checkpointing,
                                                         # every-block checkpointing, torch.compile with
                                                         # activation_memory_budget 1.0 / 0.5 / 0.2 -> "peers"
    python tools/pytorch/finetune_reference.py --peers --peer-models resnet50 --peer-configs none,compile_0.5
    options: --cases PATH, --out PATH (default tests/data/pytorch/finetune_reference.json), --no-time

A case (tests/data/pytorch/finetune_cases.json, a list):
    {"name": ..., "model": <export.py MODELS name>, "batch": 8,
     "optimizer": "sgd" | "adam" | null (both),
     "freeze": REGEX | null, "trainable": REGEX | null,
     "checkpoint": [module paths] | "every-block" | null,
     "checkpoint_file": PATH | null}
* freeze / trainable: re.search on the names of model.named_parameters(); a parameter is frozen
  (requires_grad_(False), left out of the optimizer, so no state) when `freeze` matches it or when
  `trainable` is given and does not match it.
* checkpoint: every listed module (model.get_submodule(path)) runs its forward through
  torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False, **kwargs). "every-block": the
  children of one parent whose names are 0, 1, ..., n-1 (n >= 2), outermost such level (ResNet's
  layerK.i, GPT-2's transformer.h.i). checkpoint_file: a Python file (as memplan writes it) with
  CHECKPOINT_MODULES and apply(model) (and SELECTIVE_MODULES, those of them checkpointed
  selectively, recorded as selective_modules); its apply() is called.
* "compile_plan": true, with an op plan's checkpoint_file and "compile_budget": 1.0: the file's
  compile_policy(model, *inputs) is called instead of apply() (one eager forward on the case's
  inputs finds the plan's ops; a selective activation checkpoint marks them MUST_RECOMPUTE),
  then the model is compiled; what the compiler's trace marked is recorded as compile_policy.

The step, the warm-up, the profiler memory timeline and the checks are export.py's
(_measure_one_optimizer with a `prepare` hook): see models/README.md, "training_reference.json".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")  # the ONNX files and export.py
DATA = os.path.join(ROOT, "tests", "data", "pytorch")  # the references tests compare with
sys.path.insert(0, MODELS)

import export as E  # noqa: E402  (models/export.py)

PEER_MODELS = ("resnet50", "gpt2")
PEER_BATCH = 8
PEER_CONFIGS = ("none", "every-block", "compile_1.0", "compile_0.5", "compile_0.2")
TIMED_STEPS = int(os.environ.get("MEMPLAN_TIMED_STEPS", "3"))

DEFINITIONS = {
    "step": "export.py's training step (models/README.md): warm-up step, then the measured step under the "
    "CPU profiler memory timeline; torch.set_num_threads(2), float32",
    "frozen": "parameters matched by `freeze` or not matched by `trainable` (re.search on named_parameters "
    "names): requires_grad_(False), not given to the optimizer",
    "checkpoint": "torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs) around each "
    "listed module's forward",
    "step_peak_bytes": "per optimizer: resident_bytes_before_step (params incl. frozen + buffers + optimizer "
    "state + inputs) + step_peak_delta_bytes (profiler timeline, relative to after zero_grad)",
    "forward_end_delta_bytes": "per optimizer: live bytes after loss = out.mean(), relative to after zero_grad "
    "(activations kept for backward, outputs, loss)",
    "saved_bytes": "export.py's definition (saved_tensors_hooks pack hook, distinct storages, parameters and "
    "buffers excluded). Inside a checkpointed module checkpoint's own hooks pack instead of ours, so what is saved "
    "inside is not counted. The tensor arguments of a checkpointed call are saved by checkpoint's "
    "_NoopSaveInputs outside its own hooks, so they are in saved_bytes (checkpoint_inputs_total_bytes: "
    "their distinct storages; checkpoint_inputs_bytes: those the hook did not see, expected 0; "
    "saved_plus_checkpoint_inputs_bytes: saved_bytes + that)",
    "dropout_alive_numel": "elements of the dropout calls (p > 0) during forward whose CPU float32 noise is "
    "alive at forward end: all dropout calls minus those run inside a checkpointed module "
    "(dropout_in_checkpoint_numel). CUDA-equivalent bytes: subtract 3 * dropout_alive_numel from saved "
    "bytes and forward-end bytes; for peaks use the peak_alive_* keys",
    "peak_alive_dropout_noise_bytes": "per optimizer: bytes of CPU dropout noise (float, 4 B per element where "
    "CUDA keeps a 1-byte mask) alive at the step peak's instant (export.py _alloc_kind)",
    "peak_alive_rng_state_bytes": "per optimizer: CPU RNG states (torch.get_rng_state(), 5,056 B, kept by each "
    "non-reentrant checkpoint call; host memory on a GPU) alive at the step peak's instant",
    "peak_alive_cpu_kernel_copy_bytes": "per optimizer: copies a CPU convolution kernel made of its operands "
    "(aten::contiguous inside convolution_backward / mkldnn_convolution) alive at the step peak's instant",
    "peak_alive_cpu_kernel_scratch_bytes": "per optimizer: memory a CPU convolution kernel allocates itself "
    "(not through a factory op; oneDNN weight reorders, conv3d column buffers) and frees before it returns, "
    "alive at the step peak's instant (export.py _collect_profile); a CUDA kernel uses a cuDNN workspace instead",
    "device_equivalent_step_peak_delta_bytes": "per optimizer: the step timeline's peak after taking out, at "
    "every instant, what is alive there that a CUDA run would not hold (the peak_alive_* kinds: 3/4 of CPU "
    "dropout noise, RNG states, CPU convolution kernels' copies and scratch); relative to after zero_grad like "
    "step_peak_delta_bytes",
    "device_equivalent_peak_phase": "per optimizer: the phase of that peak",
    "step_seconds": "median wall time of %d steps (zero_grad..opt.step) without profiler, after one warm-up "
    "step (compiled: two), 2 threads, on a machine shared with other work" % TIMED_STEPS,
}


# --------------------------------------------------------------------------------------
# Freezing and checkpointing
# --------------------------------------------------------------------------------------


def freeze(model, freeze_re=None, trainable_re=None):
    frozen = []
    for n, p in model.named_parameters():
        off = (freeze_re is not None and re.search(freeze_re, n)) or (
            trainable_re is not None and not re.search(trainable_re, n)
        )
        if off:
            p.requires_grad_(False)
            frozen.append(n)
    return frozen


def every_block(model):
    """Children of one parent whose names are 0..n-1 (n >= 2), outermost such level."""
    res = []

    def visit(prefix, mod):
        names = [n for n, _ in mod.named_children()]
        if len(names) >= 2 and names == [str(i) for i in range(len(names))]:
            res.extend(prefix + n for n in names)
            return
        for n, c in mod.named_children():
            visit(prefix + n + ".", c)

    visit("", model)
    return res


class CheckpointRecorder:
    """Wraps module forwards in non-reentrant checkpoint; while `recording`, notes the storages of
    the tensor arguments (kept by the checkpoint frame) and counts the dropouts run inside."""

    def __init__(self):
        self.recording = False
        self.inputs = {}  # storage ptr -> nbytes
        self.dropout = []
        self.depth = 0

    def wrap(self, model, paths, run_checkpoint=True):
        """run_checkpoint=False: the modules' forwards already run through checkpoint (a memplan
        file's apply(model)); only observe them."""
        import torch
        from torch.utils.checkpoint import checkpoint

        rec = self
        for path in paths:
            mod = model.get_submodule(path)
            orig = mod.forward

            def fwd(*args, _orig=orig, **kwargs):
                if rec.recording and rec.depth == 0:
                    for t in list(args) + list(kwargs.values()):
                        if isinstance(t, torch.Tensor):
                            p, nb = E._storage_id(t)
                            rec.inputs[p] = nb
                rec.depth += 1
                try:
                    with rec._mode() if rec.recording else contextlib.nullcontext():
                        if not run_checkpoint:
                            return _orig(*args, **kwargs)
                        return checkpoint(_orig, *args, use_reentrant=False, **kwargs)
                finally:
                    rec.depth -= 1

            mod.forward = fwd
        return paths

    def _mode(self):
        from torch.overrides import TorchFunctionMode

        rec = self

        class Count(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                d = E._dropout_call(func, args, kwargs)
                if d is not None:
                    rec.dropout.append(d)
                return func(*args, **kwargs)

        return Count()


def load_checkpoint_file(path):
    spec = importlib.util.spec_from_file_location("memplan_checkpoint_plan", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_prepare(case, rec, info):
    """prepare(model) for _measure_one_optimizer: freeze, then wrap checkpointed modules."""

    def prepare(model):
        info["frozen"] = freeze(model, case.get("freeze"), case.get("trainable"))
        ck = case.get("checkpoint")
        if ck == "every-block":
            ck = every_block(model)
        if ck:
            info["checkpointed"] = rec.wrap(model, ck)
        if case.get("checkpoint_file") and case.get("compile_plan"):
            # an op plan given to torch.compile: its values are marked for the compiler to recompute
            plan = load_checkpoint_file(case["checkpoint_file"])
            dev = next(model.parameters()).device
            plan.compile_policy(model, *(t.to(dev) for t in E.build(case["model"])[1](case["batch"])))
            info["checkpoint_file"] = case["checkpoint_file"]
            info["compile_policy"] = model.memplan_compiled  # filled in when the compiler traces
        elif case.get("checkpoint_file"):
            plan = load_checkpoint_file(case["checkpoint_file"])
            plan.apply(model)
            info["planned_model"] = model  # its memplan_missing is read after the step
            info["checkpointed"] = rec.wrap(model, list(getattr(plan, "CHECKPOINT_MODULES", [])),
                                            run_checkpoint=False)
            info["checkpoint_file"] = case["checkpoint_file"]
            info["selective"] = list(getattr(plan, "SELECTIVE_MODULES", []))
        compile_budget = case.get("compile_budget")
        if compile_budget is not None:
            import torch

            torch._functorch.config.activation_memory_budget = compile_budget
            model.compile()
        return model

    return prepare


# --------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------


def time_steps(case, kind, steps=TIMED_STEPS, warmups=1):
    """Median wall time of `steps` training steps (no profiler) after `warmups` warm-up steps."""
    import gc

    import torch

    gc.collect()
    rec = CheckpointRecorder()
    model, make_inputs, _, _ = E.build(case["model"])
    model.train()
    make_prepare(case, rec, {})(model)
    inputs = make_inputs(case["batch"])
    opt = E._make_optimizer(kind, model)
    torch.manual_seed(E.TRAIN_SEED)
    t0 = time.perf_counter()
    for _ in range(warmups):
        E._train_step(model, opt, inputs, E._NullPhase())
    warm = time.perf_counter() - t0
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        E._train_step(model, opt, inputs, E._NullPhase())
        ts.append(time.perf_counter() - t0)
    del model, opt, inputs
    gc.collect()
    return {"step_seconds": round(statistics.median(ts), 4), "step_seconds_all": [round(t, 4) for t in ts],
            "warmup_seconds": round(warm, 2)}


def measure_after_warmup(case, kind, warmups=2, timed_steps=0):
    """The profiler session starts after the warm-up steps (for torch.compile: compiling under the
    profiler is slow). The warm-up's gradients are freed before the session (zero_grad), so every
    block freed during the measured step was allocated inside the session; the same timeline
    analysis and checks as export.py's, except `freed_in_zero_grad` (0 here). timed_steps > 0:
    then that many steps without the profiler on the same (already compiled) model."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    rec = CheckpointRecorder()
    model, make_inputs, _, _ = E.build(case["model"])
    model.train()
    make_prepare(case, rec, {})(model)
    inputs = make_inputs(case["batch"])
    opt = E._make_optimizer(kind, model)
    torch.manual_seed(E.TRAIN_SEED)
    t0 = time.perf_counter()
    for _ in range(warmups):
        E._train_step(model, opt, inputs, E._NullPhase())
    warm = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    seen = set()
    resident = sum(E._sum_storages(ts, seen) for ts in (
        list(model.parameters()), list(model.buffers()), E._opt_state_tensors(opt), list(inputs)))
    torch.manual_seed(E.TRAIN_SEED)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ph = E._ProfilerPhase()
        with ph("step"):
            E._train_step(model, opt, inputs, ph)
    res, chk = E._analyse_timeline(*E._collect_profile(prof))
    grads = E._sum_storages([p.grad for p in model.parameters() if p.grad is not None])
    chk["end_delta_equals_grads_bytes"] = res["end_delta_bytes"] == grads
    ts = []
    for _ in range(timed_steps):
        t1 = time.perf_counter()
        E._train_step(model, opt, inputs, E._NullPhase())
        ts.append(time.perf_counter() - t1)
    out = {"resident_bytes_before_step": resident, "step_peak_bytes": resident + res["step_peak_delta_bytes"]}
    out.update(res)
    out.pop("freed_in_zero_grad_bytes", None)
    out["grads_bytes"] = grads
    out["warmup_seconds"] = round(warm, 2)
    if ts:
        out["step_seconds"] = round(statistics.median(ts), 4)
        out["step_seconds_all"] = [round(t, 4) for t in ts]
    out["check"] = chk
    del model, opt, inputs, prof
    gc.collect()
    return out


def measure_case(case, log, timing=True):
    import torch

    t0 = time.time()
    kinds = [case["optimizer"]] if case.get("optimizer") else list(E.TRAIN_OPTIMIZERS)
    entry = {"case": {k: v for k, v in case.items() if k != "name"}}
    per_opt = {}
    analysis = common = None
    for i, kind in enumerate(kinds):
        rec = CheckpointRecorder()
        info = {}
        ck = bool(case.get("checkpoint") or case.get("checkpoint_file"))
        stor = {}

        def prepare(model, _p=make_prepare(case, rec, info)):
            _p(model)
            # the analysis forward runs after the measured step: only then record
            return model

        akw = {"walk": not ck, "storages_out": stor}
        # record checkpoint inputs / dropouts only during the saved-tensor analysis forward:
        # _measure_one_optimizer calls _saved_analysis after the step, so switch on around it
        orig_sa = E._saved_analysis

        def sa(*a, **kw):
            if info.get("compile_policy") is not None:
                # what the training step's trace marked: the analysis forward below
                # runs under saved-tensor hooks, which dynamo leaves to eager mode
                info["compile_policy_step"] = dict(info["compile_policy"])
            rec.recording, rec.inputs, rec.dropout = True, {}, []
            try:
                return orig_sa(*a, **kw)
            finally:
                rec.recording = False

        E._saved_analysis = sa
        try:
            e, c, a = E._measure_one_optimizer(case["model"], case["batch"], kind, "cpu", analyse=(i == 0),
                                               prepare=prepare, analysis_kwargs=akw)
        finally:
            E._saved_analysis = orig_sa
        if i == 0:
            common, analysis = c, a
            entry["frozen_params"] = len(info.get("frozen", []))
            entry["frozen_examples"] = info.get("frozen", [])[:4]
            if info.get("checkpointed"):
                entry["checkpointed_modules"] = info["checkpointed"]
            if info.get("checkpoint_file"):
                entry["checkpoint_file"] = info["checkpoint_file"]
            if info.get("selective"):
                entry["selective_modules"] = info["selective"]
            if info.get("compile_policy"):
                entry["compile_policy"] = dict(info.get("compile_policy_step") or info["compile_policy"])
            if hasattr(info.get("planned_model"), "memplan_missing"):
                # the values of an op plan's file that its hooks did not find in forward (kept)
                entry["memplan_missing"] = list(info["planned_model"].memplan_missing)
            excl_hook = set(stor)
            ck_in = {p: nb for p, nb in rec.inputs.items() if p not in excl_hook}
            entry["_ck"] = (ck_in, sum(rec.inputs.values()), [d[2] for d in rec.dropout])
        if timing:
            e.update(time_steps(case, kind))
        per_opt[kind] = e
    # params
    model, _, _, _ = E.build(case["model"])
    freeze(model, case.get("freeze"), case.get("trainable"))
    entry["params_count"] = sum(p.numel() for p in model.parameters())
    entry["trainable_params_count"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    entry["trainable_params_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    del model
    ck_in, ck_total, drop_in = entry.pop("_ck")
    entry.update({k: common[k] for k in ("input_bytes", "params_bytes", "buffers_bytes", "grads_bytes")})
    entry["saved_bytes"] = analysis.pop("saved_bytes")
    entry["saved_tensors"] = analysis.pop("saved_tensors")
    entry["saved_bytes_by_view"] = analysis.pop("saved_bytes_by_view")
    if entry.get("checkpointed_modules") or entry.get("checkpoint_file"):
        entry["checkpoint_inputs_total_bytes"] = ck_total
        entry["checkpoint_inputs_bytes"] = sum(ck_in.values())
        entry["saved_plus_checkpoint_inputs_bytes"] = entry["saved_bytes"] + entry["checkpoint_inputs_bytes"]
        for k in ("saved_bytes_graph_walk", "saved_bytes_reachable_from_loss", "saved_hook_minus_walk_bytes",
                  "saved_by_grad_fn", "saved_by_grad_fn_attr", "walk_mismatch", "view_vs_storage"):
            analysis.pop(k, None)
    else:
        for k in ("saved_by_grad_fn", "saved_by_grad_fn_attr"):
            entry[k] = dict(list(analysis.pop(k).items())[:12])
        entry["saved_hook_minus_walk_bytes"] = analysis.pop("saved_hook_minus_walk_bytes")
        for k in ("saved_bytes_graph_walk", "saved_bytes_reachable_from_loss", "walk_mismatch", "view_vs_storage"):
            analysis.pop(k, None)
    d = analysis.pop("dropout")
    entry["dropout_numel"] = d["numel"]
    entry["dropout_in_checkpoint_numel"] = sum(drop_in)
    entry["dropout_alive_numel"] = d["numel"] - sum(drop_in)
    entry["dropout"] = {k: d[k] for k in ("count", "p_values", "module_calls", "functional_calls")}
    entry["first_output"] = analysis.pop("first_output")
    for kind, e in per_opt.items():
        entry[kind] = {k: e[k] for k in (
            "step_peak_bytes", "forward_end_delta_bytes", "step_peak_delta_bytes", "peak_phase",
            "phase_peak_delta_bytes", "resident_bytes_before_step", "optimizer_state_bytes",
            "optimizer_state_scalar_bytes", "end_delta_bytes", "peak_alive_dropout_noise_bytes",
            "peak_alive_rng_state_bytes", "peak_alive_cpu_kernel_copy_bytes",
            "peak_alive_cpu_kernel_scratch_bytes", "device_equivalent_step_peak_delta_bytes",
            "device_equivalent_peak_phase", "step_seconds", "step_seconds_all", "check") if k in e}
    msg = "%s: params %d (trainable %d), saved %d%s, dropout alive %d el; " % (
        case["name"], entry["params_count"], entry["trainable_params_count"], entry["saved_bytes"],
        (" (+ckpt inputs %d)" % entry["checkpoint_inputs_bytes"]) if "checkpoint_inputs_bytes" in entry else "",
        entry["dropout_alive_numel"])
    msg += "; ".join("%s peak %d fwd-end %d %s %s s" % (k, e["step_peak_bytes"], e["forward_end_delta_bytes"],
                                                     e["peak_phase"], e.get("step_seconds")) for k, e in per_opt.items())
    log(msg + " (%.0fs)" % (time.time() - t0))
    for kind, e in per_opt.items():
        chk = e["check"]
        if chk["unmatched_frees_in_step"]["count"] or not chk["end_delta_equals_grads_bytes"] \
                or not chk["freed_in_zero_grad_equals_old_grads"] or chk["total_allocated_order_violations"]:
            log("  WARNING %s %s: profiler check %s" % (case["name"], kind, chk))
    del torch
    return entry


def measure_peer(model_name, config, log, timing=True):
    t0 = time.time()
    case = {"name": "%s/%s" % (model_name, config), "model": model_name, "batch": PEER_BATCH, "optimizer": "sgd"}
    if config == "every-block":
        case["checkpoint"] = "every-block"
    if config.startswith("compile_"):
        import torch

        torch._dynamo.reset()
        case["compile_budget"] = float(config.split("_")[1])
        e = measure_after_warmup(case, "sgd", timed_steps=TIMED_STEPS if timing else 0)
        e["method"] = ("torch.compile (model.compile(), inductor defaults) with "
                       "torch._functorch.config.activation_memory_budget = %g; profiler memory timeline with "
                       "the session started after 2 warm-up (compiling) steps; see measure_after_warmup; step_seconds: "
                       "%d steps after the profiled one, same compiled model"
                       % (case["compile_budget"], TIMED_STEPS))
        torch._dynamo.reset()
    elif config == "none-after-warmup":
        e = measure_after_warmup(case, "sgd")
        e["method"] = "as the compiled configs (session after warm-up), uncompiled: cross-check of that method"
    else:
        e = dict(measure_case(case, lambda m: None, timing=False)["sgd"])
        e["method"] = "export.py's (profiler session over the whole model life)"
    if timing and not config.startswith("compile_"):
        e.update(time_steps(case, "sgd"))
    log("peer %s: peak %d (fwd-end %d, %s) %s s [%.0fs]" % (
        case["name"], e["step_peak_bytes"], e["forward_end_delta_bytes"], e["peak_phase"], e.get("step_seconds"),
        time.time() - t0))
    return e


# --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=os.path.join(DATA, "finetune_cases.json"))
    ap.add_argument("--out", default=os.path.join(DATA, "finetune_reference.json"))
    ap.add_argument("--only", help="comma-separated case names (or, with --peers, ignored)")
    ap.add_argument("--peers", action="store_true", help="measure the peers table instead of the cases")
    ap.add_argument("--peer-models", default=",".join(PEER_MODELS))
    ap.add_argument("--peer-configs", default=",".join(PEER_CONFIGS),
                    help="of: %s, none-after-warmup" % ",".join(PEER_CONFIGS))
    ap.add_argument("--no-time", action="store_true", help="skip step_seconds")
    a = ap.parse_args()

    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)

    ref = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            ref = json.load(f)

    def log(msg):
        print(msg, flush=True)

    def write():
        ref["_meta"] = {
            "generated_by": "python tools/pytorch/finetune_reference.py [--peers]",
            "versions": E._train_versions(),
            "device": "cpu",
            "torch_num_threads": torch.get_num_threads(),
            "seed": E.TRAIN_SEED,
            "definitions": DEFINITIONS,
        }
        ordered = {"_meta": ref["_meta"], "cases": ref.get("cases", {})}
        if "peers" in ref:
            ordered["peers"] = ref["peers"]
        with open(a.out, "w") as f:
            f.write(E._json_compact(ordered) + "\n")

    failed = []
    if a.peers:
        peers = ref.setdefault("peers", {})
        for m in a.peer_models.split(","):
            for cfg in a.peer_configs.split(","):
                try:
                    peers.setdefault("%s_batch%d_sgd" % (m, PEER_BATCH), {})[cfg] = measure_peer(
                        m, cfg, log, timing=not a.no_time)
                except Exception as e:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                    log("FAILED peer %s %s: %s" % (m, cfg, str(e).splitlines()[0][:300] if str(e) else type(e)))
                    peers.setdefault("%s_batch%d_sgd" % (m, PEER_BATCH), {})[cfg] = {
                        "failed": "%s: %s" % (type(e).__name__, str(e)[:300])}
                    failed.append("%s/%s" % (m, cfg))
                write()
    else:
        with open(a.cases) as f:
            cases = json.load(f)
        names = a.only.split(",") if a.only else [c["name"] for c in cases]
        cur = ref.setdefault("cases", {})
        for c in cases:
            if c["name"] not in names:
                continue
            try:
                cur[c["name"]] = measure_case(c, log, timing=not a.no_time)
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                log("FAILED %s: %s" % (c["name"], e))
                failed.append(c["name"])
                continue
            ref["cases"] = {k["name"]: cur[k["name"]] for k in cases if k["name"] in cur}
            write()
    write()
    log("wrote %s" % a.out)
    if failed:
        sys.exit("failed: %s" % ", ".join(failed))


if __name__ == "__main__":
    main()
