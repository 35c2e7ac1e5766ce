"""Pipeline-parallel per-stage memory references from real runs on CPU (dev-time; gloo, no GPU).

The fsdp_llama_b config of tools/pytorch/fsdp2_reference.py (transformers' llama, 4 layers, GQA,
SDPA, the model's own shifted cross entropy) cut into one stage per rank as memplan cuts it by
default (the decoder layers evenly, the first stages taking the remainder; the embedding on the
first stage, the final norm and lm_head on the last) and run by torch.distributed.pipelining
(PipelineStage, Schedule1F1B or ScheduleGPipe) over gloo, M micro-batches of the config's batch
(memplan's --batch is one micro-batch), AdamW(foreach=True) per stage; the last stage's step
does not keep the micro-batches' logits to return them (return_outputs=False, as torchtitan calls
it: by default the last stage holds every micro-batch's logits until the step ends, then their
concatenation). A warm-up step creates
AdamW's state; the measured step (zero_grad(set_to_none), the schedule's forwards and backwards,
opt.step()) is measured as fsdp2_reference.py measures a step: torch.profiler's allocation events
of the rank's main thread, resident bytes (the stage's parameters, buffers, optimizer state and
the whole batch's inputs) plus the step's peak delta. What gloo allocates inside its own c10d
ops is left out, as there.

One run:    torchrun --standalone --nproc_per_node N tools/pytorch/pp_reference.py --rank-out DIR \\
                [--schedule 1f1b|gpipe] [--microbatches M]
Everything: python tools/pytorch/pp_reference.py [--worlds 2,4] [--out tests/data/pytorch/pp_reference.json]
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fsdp2_reference as F  # noqa: E402  its config, model builder and measurement

CONFIG = "fsdp_llama_b"
OUT = os.path.join(ROOT, "tests", "data", "pytorch", "pp_reference.json")
SCHEDULES = ("1f1b", "gpipe")


def stage_bounds(layers, stages, rank):
    """Layers [lo, hi) of stage `rank`: even, the first stages taking the remainder."""
    base, extra = divmod(layers, stages)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def _stage_class():
    import torch

    class Stage(torch.nn.Module):
        """A stage's modules, taken from the whole model (nothing else of it kept)."""

        def __init__(self, embed_tokens, layers, rotary_emb, norm, lm_head):
            super().__init__()
            self.embed_tokens = embed_tokens
            self.layers = torch.nn.ModuleList(layers)
            self.rotary_emb = rotary_emb
            self.norm = norm
            self.lm_head = lm_head

        def forward(self, x):
            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            pe = self.rotary_emb(h, pos)
            for layer in self.layers:
                out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            return self.lm_head(self.norm(h)) if self.lm_head is not None else h

    return Stage


def stage_module(lm, lo, hi, first, last):
    """Stage `[lo, hi)` of a transformers causal LM: the embedding on the first stage, the final
    norm and lm_head on the last, the rotary embedding (no parameters) on every one."""
    inner = lm.model
    return _stage_class()(inner.embed_tokens if first else None, list(inner.layers[lo:hi]), inner.rotary_emb,
                          inner.norm if last else None, lm.lm_head if last else None)


def shifted_cross_entropy(logits, labels):
    """The model's own loss (transformers' ForCausalLMLoss, which the exported graph holds):
    logits upcast and flattened, labels padded and shifted."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, logits.shape[-1])


class Pipeline:
    """One rank's stage of `name` under `schedule` with `m` micro-batches on `device`."""

    def __init__(self, name, rank, world, schedule, m, device):
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        spec = F.CONFIGS[name]
        model, make_inputs, _ = F.build(name)
        lm = model.m
        self.layers = stage_bounds(len(lm.model.layers), world, rank)
        self.first, self.last = rank == 0, rank == world - 1
        self.module = stage_module(lm, *self.layers, self.first, self.last).to(device)
        del model, lm
        dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        stage = PipelineStage(self.module, rank, world, dev)
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.schedule = kind(stage, m, loss_fn=shifted_cross_entropy)
        self.inputs = tuple(t.to(device) for t in make_inputs(spec["batch"] * m, seed=1))
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3, foreach=True)

    def step(self, phase):
        ids, labels = self.inputs
        with phase("zero_grad"):
            self.opt.zero_grad(set_to_none=True)
        # The schedule interleaves the micro-batches' forwards and backwards: one phase.
        with phase("forward"):
            if self.first:
                self.schedule.step(ids)
            elif self.last:
                # The outputs (logits) are not kept to be returned (torchtitan's call).
                self.schedule.step(target=labels, losses=[], return_outputs=False)
            else:
                self.schedule.step()
        with phase("optimizer"):
            self.opt.step()


def measure(schedule, m):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = []

    def build():
        p = Pipeline(CONFIG, rank, world, schedule, m, "cpu")
        layers.extend(p.layers)
        return p.module, p.opt, p.inputs, p.step

    out = F.measure_step(build)
    out["layers"] = layers
    dist.destroy_process_group()
    return out


def driver(a):
    runs = []
    for world in [int(w) for w in a.worlds.split(",")]:
        for schedule in SCHEDULES:
            m = 2 * world
            ranks = F.torchrun_ranks(os.path.abspath(__file__), world, ["--schedule", schedule, "--microbatches", str(m)])
            runs.append({"world": world, "schedule": schedule, "microbatches": m,
                         "file": "models/llm/%s.onnx" % CONFIG, "ranks": ranks})
    spec = F.CONFIGS[CONFIG]
    res = {"script": "tools/pytorch/pp_reference.py", "config": CONFIG, "micro_batch": spec["batch"],
           "seq": spec["seq"], "model_config": spec["config"], "runs": runs}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--out", default=OUT)
    p.add_argument("--rank-out")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    a = p.parse_args()
    if a.rank_out:
        F.write_rank(a.rank_out, measure(a.schedule, a.microbatches))
    else:
        driver(a)


if __name__ == "__main__":
    main()
