"""Tensor-parallel per-rank memory references from real runs on CPU (dev-time; gloo, no GPU).

The fsdp_llama_a config of tools/pytorch/fsdp2_reference.py (transformers' llama, 2 layers, MHA,
eager attention, loss logits.mean()), split with torch.distributed.tensor.parallel's
parallelize_module over init_device_mesh("cpu", (N,)) as Megatron splits it: q/k/v_proj and
gate/up_proj ColwiseParallel, o_proj and down_proj RowwiseParallel, embed_tokens
RowwiseParallel(input_layouts=Replicate()) (vocabulary-parallel), lm_head ColwiseParallel with
the logits left sharded and local (Shard(-1), use_local_output=True): the loss, logits.mean(), is
each rank's mean of its vocabulary shard, so its gradient stays split as a vocabulary-parallel
cross entropy's does. (On the sharded DTensor instead, MeanBackward materialises the gradient of
the whole logits and the redistribution clones this rank's shard of it: 2 MiB + 1 MiB more at
world 2, a peak 10 % above memplan's, an artefact of that loss, not of tensor parallelism.) Every rank runs
the same batch (tensor-parallel ranks share their data); AdamW(foreach=True) over two parameter
groups, the split DTensors and the whole norms (one foreach call takes one kind). The step and its peak are measured as
fsdp2_reference.py measures them (torch.profiler's allocation events of the rank's main thread,
a warm-up step first; what gloo allocates inside its own collectives left out).

One run:    torchrun --standalone --nproc_per_node N tools/pytorch/tp_reference.py --out DIR
Everything: python tools/pytorch/tp_reference.py [--worlds 2,4] [--out tests/data/pytorch/tp_reference.json]
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fsdp2_reference as F  # noqa: E402  its config, model builder and measurement

CONFIG = "fsdp_llama_a"
OUT = os.path.join(ROOT, "tests", "data", "pytorch", "tp_reference.json")


def parallelize(hf, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
    }
    for i in range(len(hf.model.layers)):
        p = "model.layers.%d." % i
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + m] = ColwiseParallel()
        for m in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + m] = RowwiseParallel()
    parallelize_module(hf, mesh, plan)


def measure():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    spec = F.CONFIGS[CONFIG]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build():
        model, make_inputs, _ = F.build(CONFIG)
        parallelize(model.m, mesh)
        inputs = make_inputs(spec["batch"], seed=1)
        # Two parameter groups (the split DTensors, the whole norms): a foreach update
        # takes one kind at a time.
        split = [p for p in model.parameters() if isinstance(p, DTensor)]
        whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
        opt = torch.optim.AdamW([{"params": split}, {"params": whole}], lr=1e-3, foreach=True)
        return model, opt, inputs, lambda phase: F.ref._train_step(model, opt, inputs, phase)

    out = F.measure_step(build)
    dist.destroy_process_group()
    return out


def driver(a):
    runs = [{"world": w, "file": "models/llm/%s.onnx" % CONFIG, "ranks": F.torchrun_ranks(os.path.abspath(__file__), w, [])}
            for w in [int(w) for w in a.worlds.split(",")]]
    spec = F.CONFIGS[CONFIG]
    res = {"script": "tools/pytorch/tp_reference.py", "config": CONFIG, "batch": spec["batch"],
           "seq": spec["seq"], "model_config": spec["config"], "runs": runs}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--out", default=OUT)
    p.add_argument("--rank-out")
    a = p.parse_args()
    if a.rank_out:
        F.write_rank(a.rank_out, measure())
    else:
        driver(a)


if __name__ == "__main__":
    main()
