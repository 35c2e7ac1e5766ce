"""FSDP2 per-rank memory references from real runs on CPU (dev-time; gloo, no GPU).

Two LLaMA-style configs (transformers' llama, built from their config, seed 0, real weights)
trained with FSDP2 (torch.distributed.fsdp.fully_shard): every decoder layer is one FSDP unit,
then the root (the model: embeddings, final norm, lm_head). Each rank runs the step of the
other references (models/README.md, "the measured step"; tools/llm/reference.py): a warm-up
step, which creates AdamW's state, then the measured step (zero_grad(set_to_none), forward,
loss, backward, optimizer.step) on its own batch. Its peak is measured as
tests/data/pytorch/training_reference.json's: torch.profiler's allocation events (every
allocation the rank's main thread makes through the CPU allocator; the session covers the
model's construction), resident bytes (sharded parameters, buffers, optimizer state,
inputs) plus the step's peak delta. The live allocations at the peak are sorted into FSDP's
categories (all-gather buffers, unsharded parameters and gradients, reduce-scatter buffers,
activations, ...). A third step runs under torch's FSDPMemTracker (a TorchDispatchMode) for
its peak and breakdown. Results: tests/data/pytorch/fsdp2_reference.json.

What gloo allocates inside its own c10d ops (a staging output for _allgather_base_, a clone of
the reduce-scatter input) is left out: NCCL allocates no tensors there. gloo's worker thread
sometimes drops the last reference to a tensor a collective used, a free the profiler does not
see; each rank checks its timeline (every free seen, the step's end equal to its gradients, the
third step's peak equal to the second's) and a run that fails a check is run again.

One run (N ranks, one process each):

    torchrun --standalone --nproc_per_node N tools/pytorch/fsdp2_reference.py \\
        --config fsdp_llama_a --reshard true --policy fp32 --out DIR     # DIR/rank<r>.json

Everything (each config at world 2 and 4, reshard_after_forward true and false, fp32 and the
bf16 MixedPrecisionPolicy; the single-process check against tools/llm/reference.py's method;
the ONNX files models/llm/fsdp_llama_{a,b}[_bfloat16].onnx), merged into the JSON:

    python tools/pytorch/fsdp2_reference.py [--configs fsdp_llama_a] [--worlds 2,4] \\
        [--policies fp32,bf16] [--no-export] [--out tests/data/pytorch/fsdp2_reference.json]
"""

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.relpath(os.path.abspath(__file__), ROOT)
sys.path.insert(0, os.path.join(ROOT, "models"))
sys.path.insert(0, os.path.join(ROOT, "python"))

import export as ref  # noqa: E402  models/export.py: the measurement machinery

# Each config: the transformers config, attention, whether the model computes its own loss
# (labels=, memplan --loss graph; else loss = logits.mean()), the sequence (fixed in the ONNX
# file) and the batch of each rank (memplan --batch).
CONFIGS = {
    # MHA, every parameter evenly sharded at world 2 and 4, eager attention, logits.mean()
    "fsdp_llama_a": dict(
        config=dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, vocab_size=2048,
                    tie_word_embeddings=False),
        attn="eager", labels=False, seq=128, batch=2),
    # GQA (6 heads, 2 kv heads), SDPA, in-model cross-entropy; uneven shards: vocab 1999
    # (embed_tokens, lm_head) and intermediate 514 (gate_proj, up_proj) do not divide by 4
    # (nor vocab by 2), so the last rank holds fewer rows
    "fsdp_llama_b": dict(
        config=dict(model_type="llama", hidden_size=192, intermediate_size=514, num_hidden_layers=4,
                    num_attention_heads=6, num_key_value_heads=2, vocab_size=1999,
                    tie_word_embeddings=False),
        attn="sdpa", labels=True, seq=64, batch=4),
}
POLICIES = {
    "fp32": None,  # MixedPrecisionPolicy(): parameters, compute and reduction in float32
    "bf16": ("bfloat16", "float32"),  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
}
OUT = os.path.join(ROOT, "tests", "data", "pytorch", "fsdp2_reference.json")

DEFINITIONS = {
    "step": "the second training step of each rank (the first creates AdamW's state): "
    "zero_grad(set_to_none=True), forward, loss (the model's own with labels=, else logits.mean()), "
    "backward, opt.step(); torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True) over the "
    "sharded (DTensor) parameters; torch.set_num_threads(1) per rank",
    "fsdp": "fully_shard(layer, mesh=init_device_mesh('cpu', (N,)), reshard_after_forward=R, "
    "mp_policy=P) on every decoder layer, then fully_shard(model, mesh=..., mp_policy=P) on the root "
    "(reshard_after_forward left None: FSDP's default, which keeps the root's parameters unsharded "
    "from forward to backward); gloo; each rank its own batch (input seed 1 + rank)",
    "resident_bytes_before_step": "distinct storages of the sharded parameters (DTensor local "
    "tensors: their storage is the padded shard, the same size on every rank), buffers, optimizer "
    "state (local tensors) and inputs, after the warm-up step",
    "step_peak_bytes": "resident_bytes_before_step + step_peak_delta_bytes: the peak of the rank's "
    "allocated bytes over the step (torch.profiler allocation events of the rank's main thread, "
    "running sum) relative to after zero_grad, as training_reference.json",
    "device_equivalent_step_peak_bytes": "the same timeline less, at every instant, what only a CPU "
    "kernel holds (models/export.py _alloc_kind: the float32 copy CPU's mean makes of a bf16 tensor)",
    "at_peak": "bytes alive at the step's peak instant by category (sum = session_live_at_peak_bytes): "
    "sharded_param, buffer, input, optimizer_state (resident, by storage); all_gather_output (FSDP's "
    "flat all-gather buffer, allocated in FSDP::all_gather); all_gather_copy_in (the param_dtype copy "
    "of the local shards a mixed-precision all-gather copies in); unsharded_param (the per-parameter "
    "tensors FSDP::all_gather_copy_out fills); unsharded_grad (the unsharded parameters' .grad, by the "
    "storages FSDPParamGroup.post_backward finds); reduce_scatter_input and sharded_grad (the reduce "
    "output the sharded .grad views) from FSDP::post_backward_reduce; activations (allocated in "
    "forward: saved tensors and the outputs); backward (allocated in backward: activation gradients, "
    "temporaries, the parameter gradients' producers before they are attributed); optimizer_temp; "
    "cpu_kernel_copy; other_before_step (allocated before the step, none of the above)",
    "fsdp_groups": "per FSDP unit: parameters, numel, padded_unsharded_numel (sum over its parameters "
    "of ceil(dim0 / N) * N * rest: FSDP pads dim 0 of each parameter to a multiple of N), "
    "local_numel (this rank's unpadded shard) and bytes in the param and reduce dtypes",
    "memtracker": "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker(model, opt) with "
    "track_inputs(inputs) around a third step of the same run: its peak snapshot (bytes by its "
    "categories, 'Total') and each FSDP module's local peak; step3_profiler_peak_bytes is the "
    "profiler's peak of that same third step",
}


def _lm_class():
    import torch

    class LM(torch.nn.Module):
        """input_ids (and labels) positionally, the output tuple as HF returns it."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, labels=None):
            return self.m(input_ids=input_ids, labels=labels, use_cache=False, return_dict=False)

    return LM


def build(name, dtype="float32"):
    """(model, make_inputs(batch, seed), input names) for a config, as tools/llm/reference.py."""
    import torch
    from transformers import AutoModelForCausalLM

    from memplan_export.hf import build_config

    spec = CONFIGS[name]
    cfg = build_config(spec["config"], attn=spec["attn"])
    torch.manual_seed(0)
    m = _lm_class()(AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)))
    m._memplan_graph_loss = spec["labels"]
    m.train()
    vocab, seq = spec["config"]["vocab_size"], spec["seq"]

    def make_inputs(batch, seed=1):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        return (ids, ids.clone()) if spec["labels"] else (ids,)

    names = [("input_ids", "int64", [seq])] + ([("labels", "int64", [seq])] if spec["labels"] else [])
    return m, make_inputs, names


def _mp_policy(policy):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if POLICIES[policy] is None:
        return MixedPrecisionPolicy()
    p, r = POLICIES[policy]
    return MixedPrecisionPolicy(param_dtype=getattr(torch, p), reduce_dtype=getattr(torch, r))


def shard(model, mesh, reshard, policy):
    from torch.distributed.fsdp import fully_shard

    mp = _mp_policy(policy)
    for layer in model.m.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


class Phase:
    """Phases as memplan::<prefix><name> profiler ranges."""

    def __init__(self, prefix):
        self.prefix = prefix

    def __call__(self, name):
        from torch.profiler import record_function

        return record_function("memplan::" + self.prefix + name)


TAG = "tag:unsharded_grad:"


def install_tags():
    """FSDPParamGroup.post_backward inside a memplan::tag range naming the storages of the
    unsharded gradients it is about to reduce (the allocations are told apart afterwards)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.profiler import record_function

    orig = FSDPParamGroup.post_backward
    if getattr(orig, "_memplan_tag", False):
        return

    def post_backward(self, *args):
        ptrs = []
        for p in self.fsdp_params:
            up = getattr(p, "_unsharded_param", None)
            if up is not None and up.grad is not None:
                ptrs.append(up.grad.untyped_storage().data_ptr())
        with record_function("memplan::%s%s:%s" % (TAG, self._module_fqn or "", ",".join(map(str, ptrs)))):
            return orig(self, *args)

    post_backward._memplan_tag = True
    FSDPParamGroup.post_backward = post_backward


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def resident(model, opt, inputs):
    """What a rank holds before the step, by storage: (its local parameters, the storage
    sets of each kind for analyse(), and the bytes of each kind: param, buffer, state, input)."""
    import torch

    params = [_local(p) for p in model.parameters()]
    buffers = list(model.buffers())
    state = [_local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    sets = {
        "sharded_param": {p.untyped_storage().data_ptr() for p in params},
        "buffer": {b.untyped_storage().data_ptr() for b in buffers},
        "input": {t.untyped_storage().data_ptr() for t in inputs},
        "optimizer_state": {t.untyped_storage().data_ptr() for t in state},
    }
    seen = set()
    sizes = [ref._sum_storages(ts, seen) for ts in (params, buffers, state, inputs)]
    return params, sets, sizes


def measure_step(build):
    """One rank's measured step for the other parallel references (tp_reference.py,
    pp_reference.py), measured as measure() measures FSDP2's: build() runs under the profiler and
    returns (module, opt, inputs, step), step(phase) being one training step; a warm-up step, the
    resident bytes, then the measured step. Returns the rank's record (rank_record)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()
    try:
        module, opt, inputs, step = build()
        torch.manual_seed(ref.TRAIN_SEED)
        step(ref._NullPhase())
        _, sets, sizes = resident(module, opt, inputs)
        torch.manual_seed(ref.TRAIN_SEED)
        with record_function("memplan::s2/step"):
            step(Phase("s2/"))
    finally:
        prof.__exit__(None, None, None)
    allocs, ranges = collect(prof)
    res = analyse(allocs, ranges, "s2/", sets, [])
    param_bytes, buffer_bytes, state_bytes, input_bytes = sizes
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "param_bytes": param_bytes,
        "buffers_bytes": buffer_bytes,
        "optimizer_state_bytes": state_bytes,
        "input_bytes": input_bytes,
        "resident_bytes_before_step": sum(sizes),
        "step_peak_bytes": sum(sizes) + res["step_peak_delta_bytes"],
        **{k: res.get(k) for k in ("peak_phase", "peak_at", "forward_end_delta_bytes", "end_delta_bytes",
                                   "phase_peak_delta_bytes", "collective_internal", "at_peak", "check")},
    }


def torchrun_ranks(script, world, args):
    """Runs `script --rank-out DIR args` on `world` ranks (torchrun); each rank's record."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["torchrun", "--standalone", "--nproc_per_node", str(world), script, "--rank-out", d] + list(args)
        subprocess.run(cmd, check=True, cwd=ROOT)
        return [json.load(open(os.path.join(d, "rank%d.json" % r))) for r in range(world)]


def write_rank(out_dir, record):
    with open(os.path.join(out_dir, "rank%d.json" % record["rank"]), "w") as f:
        json.dump(record, f)


def fsdp_groups(model, world):
    import torch

    out = []
    for mod in model.modules():
        get = getattr(mod, "_get_fsdp_state", None)
        g = get()._fsdp_param_group if get else None
        if g is None:
            continue
        fps = g.fsdp_params
        pdt = fps[0].param_dtype or fps[0].orig_dtype
        rdt = g._reduce_dtype or fps[0].orig_dtype
        shard = sum(fp.padded_sharded_param_size.numel() for fp in fps)
        local = sum(fp.sharded_param._local_tensor.numel() for fp in fps)
        out.append({
            "module": g._module_fqn or "(root)",
            "parameters": [fp._param_fqn for fp in fps],
            "numel": sum(fp._orig_size.numel() for fp in fps),
            "padded_unsharded_numel": shard * world,
            "padded_shard_numel": shard,
            "local_numel": local,
            "orig_dtype": str(fps[0].orig_dtype).replace("torch.", ""),
            "param_dtype": str(pdt).replace("torch.", ""),
            "reduce_dtype": str(rdt).replace("torch.", ""),
            "unsharded_bytes_param_dtype": shard * world * torch.empty(0, dtype=pdt).element_size(),
            "unsharded_bytes_reduce_dtype": shard * world * torch.empty(0, dtype=rdt).element_size(),
            "reshard_after_forward": g._reshard_after_forward,
        })
    return out


def collect(prof):
    """Allocation events, time-ordered: (t, seq, ptr, size, chain, op_end) with chain the names
    of the enclosing events (memplan:: ranges left out) and op_end the end of the innermost
    one; and the memplan:: ranges (name, start, end)."""
    from torch._C._profiler import _EventType

    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocs, ranges = [], []
    stack = [(e, (), None) for e in reversed(tree)]
    while stack:
        e, chain, end = stack.pop()
        tag, f = e.typed
        if tag == _EventType.Allocation:
            if f.device.type == "cpu":
                allocs.append((e.start_time_ns, len(allocs), f.ptr, f.alloc_size, chain, end))
            continue
        if e.name.startswith("memplan::"):
            ranges.append((e.name[len("memplan::"):], e.start_time_ns, e.end_time_ns))
        else:
            chain, end = chain + (e.name,), e.end_time_ns
        stack.extend((c, chain, end) for c in reversed(e.children))
    allocs.sort(key=lambda a: (a[0], a[1]))
    return allocs, ranges


def _fsdp_scope(chain):
    """The innermost FSDP:: event of the chain, split into (what, module)."""
    for name in reversed(chain):
        if name.startswith("FSDP::"):
            what, _, mod = name.partition(" (")
            return what, mod.rstrip(")")
    return None, None


def _collective(chain):
    return any(n.startswith(("c10d::", "gloo:")) for n in chain)


# What a CUDA step would not hold (device_equivalent_*): models/export.py's kinds, and
# cpu_kernel_scratch: memory an aten kernel allocates itself and frees before it returns (the
# bfloat16 CPU matmul's packing buffers; models/export.py looks for it in convolutions only).
CPU_ONLY = ("cpu_kernel_copy", "cpu_kernel_scratch", "dropout_noise", "rng_state")


def analyse(allocs, ranges, prefix, sets, groups):
    """The step of ranges <prefix>step: peak, phases and what is alive at the peak."""
    R = {n: (s, e) for n, s, e in ranges}
    t0, t1 = R[prefix + "step"]
    phases = {p: R[prefix + p] for p in ref.PHASES if prefix + p in R}
    tags = []  # (start, ptrs) of the unsharded-gradient tags in the step
    for n, s, e in ranges:
        if n.startswith(TAG) and t0 <= s <= t1:
            ptrs = n[len(TAG):].rpartition(":")[2]
            tags.append((s, {int(p) for p in ptrs.split(",") if p}))
    ag_out = {g["unsharded_bytes_param_dtype"] for g in groups}
    ag_in = {g["unsharded_bytes_param_dtype"] * g["padded_shard_numel"] // g["padded_unsharded_numel"]
             for g in groups}
    rs_in = {g["unsharded_bytes_reduce_dtype"] for g in groups}
    rs_out = {g["unsharded_bytes_reduce_dtype"] * g["padded_shard_numel"] // g["padded_unsharded_numel"]
              for g in groups}

    # What a collective allocates inside its c10d op (gloo's own staging: _allgather_base_'s
    # output, _reduce_scatter_base_'s clone of its input) is gloo's, not FSDP's (NCCL allocates
    # no tensors there), and gloo's worker thread may free it, unseen by the profiler: left out.
    internal = [a for a in allocs if a[3] > 0 and _collective(a[4])]
    internal_in_step = [a[3] for a in internal if t0 <= a[0] <= t1]
    internal_ptrs = {a[2] for a in internal}
    allocs = [a for a in allocs if not (a[3] > 0 and _collective(a[4]))]

    # when each allocation is freed
    open_at, freed_at = {}, {}
    phantom = 0  # an address allocated again while its allocation looks alive: freed unseen
    unmatched = 0
    for i, (t, _, ptr, size, _, _) in enumerate(allocs):
        if size > 0:
            phantom += ptr in open_at
            open_at[ptr] = i
        elif ptr in open_at:
            freed_at[open_at.pop(ptr)] = t
        elif t0 <= t <= t1 and ptr not in internal_ptrs:
            unmatched += 1
    kinds = {}
    for i, (t, _, ptr, size, chain, end) in enumerate(allocs):
        if size <= 0:
            continue
        k = ref._alloc_kind(chain, size)
        if k is None and chain and chain[-1].startswith("aten::") and end is not None \
                and freed_at.get(i, float("inf")) <= end:
            k = "cpu_kernel_scratch"
        if k:
            kinds[i] = k

    def phase_of(t):
        return next((p for p, (a, b) in phases.items() if a <= t <= b), None)

    def category(i):
        t, _, ptr, size, chain, _ = allocs[i]
        if t < t0:
            for k in ("sharded_param", "buffer", "input", "optimizer_state"):
                if ptr in sets[k]:
                    return k
            return "other_before_step"
        for s, ptrs in tags:
            if ptr in ptrs and t <= s and freed_at.get(i, float("inf")) > s:
                return "unsharded_grad"
        what, _ = _fsdp_scope(chain)
        if what == "FSDP::all_gather_copy_out":
            return "unsharded_param"
        if what == "FSDP::all_gather":
            return "all_gather_output" if size in ag_out else "all_gather_copy_in" if size in ag_in \
                else "all_gather_other"
        if what == "FSDP::post_backward_reduce":
            return "reduce_scatter_input" if size in rs_in else "sharded_grad" if size in rs_out \
                else "reduce_other"
        if i in kinds:
            return kinds[i]
        ph = phase_of(t)
        return {"forward": "activations", "backward": "backward", "optimizer": "optimizer_temp"}.get(ph, ph or "other")

    # the session's live bytes after every event; the step's peak, raw and device-equivalent
    live, level = {}, 0
    host = collections.Counter()  # CPU-only kinds alive
    levels = []  # (t, level) after each event
    best = best_i = dev_best = dev_i = None
    phase_best = {}
    window = []
    for i, (t, _, ptr, size, chain, _) in enumerate(allocs):
        if size > 0:
            live[ptr] = i
            level += size
            if kinds.get(i) in CPU_ONLY:
                host[kinds[i]] += size
        elif ptr in live:
            j = live.pop(ptr)
            level -= allocs[j][3]
            if kinds.get(j) in CPU_ONLY:
                host[kinds[j]] -= allocs[j][3]
        levels.append((t, level))
        if not t0 <= t <= t1:
            continue
        window.append(i)
        if best is None or level > best:
            best, best_i = level, i
        dev = level - sum(v * 3 // 4 if k == "dropout_noise" else v for k, v in host.items())
        if dev_best is None or dev > dev_best:
            dev_best, dev_i = dev, i
        ph = phase_of(t)
        if ph and (ph not in phase_best or level > phase_best[ph][0]):
            phase_best[ph] = (level, i)

    def level_at(tt):  # the live bytes after the last event at or before tt
        v = 0
        for t, lv in levels:
            if t > tt:
                break
            v = lv
        return v

    def live_at(idx):
        cur = {}
        for i, (t, _, ptr, size, _, _) in enumerate(allocs[:idx + 1]):
            if size > 0:
                cur[ptr] = i
            else:
                cur.pop(ptr, None)
        c = collections.Counter()
        for i in cur.values():
            c[category(i)] += allocs[i][3]
        return dict(sorted(c.items()))

    def where(i):
        chain = allocs[i][4]
        what, mod = _fsdp_scope(chain)
        node = next((n for n in reversed(chain) if n.startswith("autograd::engine::evaluate_function")), None)
        op = next((n for n in reversed(chain) if n.startswith(("aten::", "fsdp::"))), None)
        return {"phase": phase_of(allocs[i][0]), "fsdp": what, "module": mod or None,
                "autograd_node": node and node.split(": ", 1)[1], "op": op, "chain_tail": list(chain[-3:])}

    z = level_at(phases["zero_grad"][1])
    return {
        "step_peak_delta_bytes": best - z,
        "peak_phase": phase_of(allocs[best_i][0]),
        "peak_at": where(best_i),
        "device_equivalent_step_peak_delta_bytes": dev_best - z,
        "device_equivalent_peak_phase": phase_of(allocs[dev_i][0]),
        "device_equivalent_peak_at": where(dev_i),
        "phase_peak_delta_bytes": {p: v - z for p, (v, _) in phase_best.items()},
        "forward_end_delta_bytes": level_at(phases["forward"][1]) - z,
        "end_delta_bytes": level_at(t1) - z,
        "freed_in_zero_grad_bytes": level_at(phases["zero_grad"][0]) - z,
        "session_live_after_zero_grad_bytes": z,
        "session_live_at_peak_bytes": best,
        "at_peak": live_at(best_i),
        "at_device_equivalent_peak": live_at(dev_i),
        "at_phase_peak": {p: live_at(i) for p, (_, i) in phase_best.items()},
        "at_end": live_at(window[-1]),
        "collective_internal": {"allocations_in_step": len(internal_in_step),
                                "bytes_in_step": sum(internal_in_step),
                                "largest_bytes": max(internal_in_step, default=0)},
        "check": {"unmatched_frees_in_step": unmatched, "alloc_events_in_step": len(window),
                  "phantom_frees_in_session": phantom},
    }


def measure(name, world, reshard, policy, threads):
    """One rank's measurement (world 1: the plain model, no FSDP, no process group)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(threads)
    spec = CONFIGS[name]
    rank = 0
    mesh = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        install_tags()
    t_start = time.time()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()  # covers construction: every freed block was allocated inside it
    try:
        model, make_inputs, _ = build(name)
        if mesh is not None:
            shard(model, mesh, reshard, policy)
        inputs = make_inputs(spec["batch"], seed=1 + rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        torch.manual_seed(ref.TRAIN_SEED)
        ref._train_step(model, opt, inputs, ref._NullPhase())  # warm-up: AdamW's state

        params, sets, sizes = resident(model, opt, inputs)
        steps = [_local(st["step"]) for st in opt.state.values() if isinstance(st.get("step"), torch.Tensor)]
        param_bytes, buffer_bytes, state_bytes, input_bytes = sizes
        resident_bytes = sum(sizes)
        groups = fsdp_groups(model, world) if mesh is not None else []

        torch.manual_seed(ref.TRAIN_SEED)
        with record_function("memplan::s2/step"):
            ref._train_step(model, opt, inputs, Phase("s2/"))
        grads_bytes = ref._sum_storages([_local(p.grad) for p in model.parameters() if p.grad is not None])

        tracker = None
        if mesh is not None:
            tracker = {}
            try:
                from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

                fmt = FSDPMemTracker(model, opt)
                fmt.track_inputs(inputs)
                torch.manual_seed(ref.TRAIN_SEED)
                with record_function("memplan::s3/step"):
                    with fmt:
                        ref._train_step(model, opt, inputs, Phase("s3/"))
                snap = fmt.get_tracker_snapshot("peak")
                tracker["peak"] = {str(d): dict(v) for d, v in snap.items()}
                tracker["peak_bytes"] = sum(v.get("Total", 0) for v in snap.values())
                tracker["module_peaks"] = {
                    st.mod_fqn: {str(d): v for d, v in st.local_peak.items()}
                    for st in fmt.memory_tracking.values() if hasattr(st, "local_peak")}
            except Exception as e:  # noqa: BLE001  a failure is a result here
                tracker["error"] = ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:300]
    finally:
        prof.__exit__(None, None, None)

    allocs, ranges = collect(prof)
    res = analyse(allocs, ranges, "s2/", sets, groups)
    out = {
        "rank": rank,
        "world": world,
        "sharded_param_bytes": param_bytes,
        "sharded_param_bytes_unpadded": _nbytes(params),
        "params_numel_local": sum(p.numel() for p in params),
        "buffers_bytes": buffer_bytes,
        "input_bytes": input_bytes,
        "optimizer_state_bytes": state_bytes,
        "optimizer_state_scalar_bytes": ref._sum_storages(steps),
        "grads_bytes": grads_bytes,
        "resident_bytes_before_step": resident_bytes,
        "step_peak_bytes": resident_bytes + res["step_peak_delta_bytes"],
        "device_equivalent_step_peak_bytes": resident_bytes + res["device_equivalent_step_peak_delta_bytes"],
    }
    out.update(res)
    out["check"]["other_live_bytes_after_zero_grad"] = res["session_live_after_zero_grad_bytes"] - resident_bytes
    out["check"]["end_delta_equals_grads_bytes"] = res["end_delta_bytes"] == grads_bytes
    if groups:
        out["fsdp_groups"] = groups
    if tracker is not None:
        try:
            tracker["step3_profiler_peak_bytes"] = resident_bytes + analyse(allocs, ranges, "s3/", sets, groups)[
                "step_peak_delta_bytes"]
        except Exception as e:  # noqa: BLE001
            tracker["step3_profiler_peak_bytes"] = "failed: %s" % e
        out["memtracker"] = tracker
    out["seconds"] = round(time.time() - t_start, 1)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def reference_method_peak(name):
    """The step peak of tools/llm/reference.py's method (models/export.py _measure_one_optimizer,
    AdamW, 2 threads) for the config, single process."""
    import torch

    torch.set_num_threads(2)
    spec = CONFIGS[name]

    def builder(_n):
        m, mk, names = build(name)
        return m, lambda b: mk(b, seed=1), names, ["loss", "logits"] if spec["labels"] else ["logits"]

    e, common, _ = ref._measure_one_optimizer(name, spec["batch"], "adamw", "cpu", analyse=False, builder=builder)
    return {"step_peak_bytes": e["step_peak_bytes"], "resident_bytes_before_step": e["resident_bytes_before_step"],
            "step_peak_delta_bytes": e["step_peak_delta_bytes"], "peak_phase": e["peak_phase"],
            "params_bytes": common["params_bytes"]}


def export_fixture(name, dtype):
    from memplan_export import export_hf

    spec = CONFIGS[name]
    path = os.path.join(ROOT, "models", "llm", "%s.onnx" % name if dtype == "fp32" else "%s_bfloat16.onnx" % name)
    ex = export_hf(spec["config"], path, dtype=dtype, seq=spec["seq"], labels=spec["labels"], attn=spec["attn"])
    return os.path.relpath(ex.path, ROOT), ex.nodes


def _run_cmd(name, world, reshard, policy, out_dir):
    return ["torchrun", "--standalone", "--nproc_per_node", str(world), SCRIPT, "--config", name,
            "--reshard", "true" if reshard else "false", "--policy", policy, "--out", out_dir]


def _differs(ranks):
    """Keys whose values differ between ranks (numbers, and at_peak categories)."""
    out = {}
    for k, v in ranks[0].items():
        if k in ("rank", "seconds") or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        vals = [r.get(k) for r in ranks]
        if len(set(vals)) > 1:
            out[k] = vals
    for cat in sorted({c for r in ranks for c in r["at_peak"]}):
        vals = [r["at_peak"].get(cat, 0) for r in ranks]
        if len(set(vals)) > 1:
            out["at_peak." + cat] = vals
    return out


def _failed_checks(r):
    """What makes a rank's timeline doubtful: gloo's worker thread can drop the last reference
    to a tensor a collective used, and the profiler does not see that free."""
    c = r["check"]
    bad = [k for k in ("unmatched_frees_in_step", "phantom_frees_in_session", "other_live_bytes_after_zero_grad")
           if c[k]]
    if not c["end_delta_equals_grads_bytes"]:
        bad.append("end_delta_equals_grads_bytes")
    if "memtracker" in r and r["memtracker"].get("step3_profiler_peak_bytes") != r["step_peak_bytes"]:
        bad.append("step3_profiler_peak_bytes")
    return bad


def driver(a):
    import torch
    import transformers

    res = json.load(open(a.out)) if os.path.exists(a.out) else {}
    res["_meta"] = {
        "generated_by": "python %s" % SCRIPT,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "device": "cpu", "backend": "gloo",
        "definitions": DEFINITIONS,
    }
    for name in a.configs.split(","):
        spec = CONFIGS[name]
        entry = res.get(name, {})
        entry.update({"config": spec["config"], "attn": spec["attn"], "loss": "graph" if spec["labels"] else "mean",
                      "seq": spec["seq"], "batch": spec["batch"], "optimizer": "adamw"})
        if not a.no_export:
            for dt in ("fp32", "bf16"):
                path, nodes = export_fixture(name, dt)
                entry["file" if dt == "fp32" else "file_bf16"] = path
                print("exported %s (%d nodes)" % (path, nodes), flush=True)
        if a.single:
            t = time.time()
            mine = measure(name, 1, None, "fp32", 2)
            theirs = reference_method_peak(name)
            entry["single_process"] = {
                "command": "python %s --single-check %s" % (SCRIPT, name),
                "step_peak_bytes": mine["step_peak_bytes"],
                "resident_bytes_before_step": mine["resident_bytes_before_step"],
                "peak_phase": mine["peak_phase"],
                "reference_method": theirs,
                "equal": mine["step_peak_bytes"] == theirs["step_peak_bytes"],
                "seconds": round(time.time() - t, 1),
            }
            print(name, "single process:", entry["single_process"], flush=True)
        runs = entry.setdefault("runs", {})
        for policy in a.policies.split(","):
            for world in [int(w) for w in a.worlds.split(",")]:
                for reshard in (True, False):
                    key = "world%d_reshard_%s_%s" % (world, str(reshard).lower(), policy)
                    for tries in range(1, 6):
                        with tempfile.TemporaryDirectory() as d:
                            cmd = _run_cmd(name, world, reshard, policy, d)
                            t = time.time()
                            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                            if p.returncode != 0:
                                print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
                                raise SystemExit("%s %s failed" % (name, key))
                            ranks = [json.load(open(os.path.join(d, "rank%d.json" % r))) for r in range(world)]
                        failed = {r["rank"]: _failed_checks(r) for r in ranks if _failed_checks(r)}
                        if not failed:
                            break
                        print(name, key, "checks failed, again:", failed, flush=True)
                    shown = " ".join(shlex.quote(c) for c in _run_cmd(name, world, reshard, policy, "DIR"))
                    groups = ranks[0].get("fsdp_groups", [])
                    for r in ranks:
                        r["fsdp_groups_local_numel"] = [g["local_numel"] for g in r.pop("fsdp_groups", [])]
                    runs[key] = {
                        "world": world, "reshard_after_forward": reshard, "policy": policy,
                        "mp_policy": "MixedPrecisionPolicy()" if POLICIES[policy] is None else
                        "MixedPrecisionPolicy(param_dtype=torch.%s, reduce_dtype=torch.%s)" % POLICIES[policy],
                        "file": entry.get("file" if policy == "fp32" else "file_bf16"),
                        "command": shown, "torch": torch.__version__,
                        "seconds": round(time.time() - t, 1), "tries": tries,
                        "checks_pass": not failed,
                        "step_peak_bytes": [r["step_peak_bytes"] for r in ranks],
                        "memtracker_peak_bytes": [r.get("memtracker", {}).get("peak_bytes") for r in ranks],
                        "differs_between_ranks": _differs(ranks),
                        "fsdp_groups": [{k: v for k, v in g.items() if k != "local_numel"} for g in groups],
                        "ranks": ranks,
                    }
                    print(name, key, runs[key]["step_peak_bytes"], "tracker", runs[key]["memtracker_peak_bytes"],
                          "%.0fs" % (time.time() - t), flush=True)
                    res[name] = entry
                    _write(a.out, res)
        res[name] = entry
        _write(a.out, res)


def _write(path, res):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(ref._json_compact(res) + "\n")
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="worker: one config (run under torchrun)")
    ap.add_argument("--reshard", choices=["true", "false"], default="true")
    ap.add_argument("--policy", choices=list(POLICIES), default="fp32")
    ap.add_argument("--out", help="worker: a folder for rank<r>.json; driver: the JSON file")
    ap.add_argument("--single-check", metavar="CONFIG", help="world 1 (no FSDP) against the reference method")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--no-single", dest="single", action="store_false")
    a = ap.parse_args()
    if a.config:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        r = measure(a.config, world, a.reshard == "true", a.policy, 1)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "rank%d.json" % r["rank"]), "w") as f:
            json.dump(r, f, indent=1)
        return
    if a.single_check:
        mine = measure(a.single_check, 1, None, "fp32", 2)
        print(json.dumps({"mine": mine["step_peak_bytes"], "reference_method": reference_method_peak(a.single_check)}))
        return
    a.out = a.out or OUT
    driver(a)


if __name__ == "__main__":
    main()
