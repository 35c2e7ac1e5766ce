#!/usr/bin/env python3
"""Check an op plan's PyTorch file (memplan plan --pytorch, op granularity): one training
step's gradients with the file applied against the same step without it, bitwise
(dev-time tool, not needed to build memplan).

Usage:
    python tools/pytorch/op_plan_grads.py [--compiled] MODEL BATCH FILE.py [FILE.py ...]
    (MODEL: a models/export.py MODELS name, e.g. resnet50, gpt2)

For each file: builds the model twice with the same weights (train mode; BatchNorm's
weight and bias drawn at random rather than left at ones and zeros), applies the file
to one, runs forward (torch.manual_seed(1) before each, so dropout draws alike) and
backward of out.mean() on both, and compares every parameter's gradient with torch.equal.
Prints the values the file did not find (model.memplan_missing) and the gradients that
differ; exits 1 if any differ.

--compiled: the file's compile_policy(model, *inputs) instead of apply(model), and both
models compiled (model.compile(), inductor, no memory budget); the step runs twice (the
first compiles). Inductor generates other kernels when it recomputes, so gradients need
not be bitwise equal there. It prints the largest difference relative to the gradient's
largest magnitude, beside the same between the compiled step and the eager one (both
without the plan, a third model), and exits 1 where the plan's is the larger.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")  # the ONNX files and export.py
sys.path.insert(0, MODELS)


def main():
    import torch

    import export as E  # noqa: E402  (models/export.py)

    args = sys.argv[1:]
    compiled = "--compiled" in args
    args = [a for a in args if a != "--compiled"]
    if len(args) < 3:
        sys.exit(__doc__)
    name, batch, files = args[0], int(args[1]), args[2:]
    torch.set_num_threads(2)
    bad_any = False
    for path in files:
        spec = importlib.util.spec_from_file_location("memplan_op_plan", path)
        plan = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plan)
        model, make_inputs, _, _ = E.build(name)
        model.train()
        # BatchNorm's weight and bias made random (a fresh model's ones and zeros would
        # let a BatchNorm rerun that rounds its shift another way pass unnoticed)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.affine:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
        ref, _, _, _ = E.build(name)
        ref.train()
        ref.load_state_dict(model.state_dict())
        inputs = make_inputs(batch)
        eager = None
        if compiled:
            eager, _, _, _ = E.build(name)
            eager.train()
            eager.load_state_dict(model.state_dict())
            torch._dynamo.reset()
            plan.compile_policy(model, *inputs)
            model.compile()
            ref.compile()
        else:
            plan.apply(model)

        def step(m):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            out = m(*inputs)
            out = out if isinstance(out, torch.Tensor) else out[0]
            out.float().mean().backward()

        def largest(a_model, b_model):
            """Largest gradient difference relative to b's largest magnitude, over parameters."""
            return max([((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                        for p, q in zip(a_model.parameters(), b_model.parameters())
                        if p.grad is not None and q.grad is not None] or [0.0])

        for _ in range(2 if compiled else 1):
            for m in (model, ref) + ((eager,) if compiled else ()):
                step(m)
        pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())]
        differ = [n for n, a, b in pairs if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))]
        bad = differ
        extra = ""
        if compiled:  # inductor's kernels: no further from the compiled step than it is from eager
            worst, base = largest(model, ref), largest(ref, eager)
            bad = [n for n, a, b in pairs if (a is None) != (b is None)] + (["largest difference"] if worst > base else [])
            extra = "; compiler marked %(marked)d of %(to_mark)d, first difference %(first_difference)s" % model.memplan_compiled
            extra += ("; largest difference %.3g of the gradient's magnitude (compiled against eager without the plan: %.3g)"
                      % (worst, base))
        n = sum(1 for p in model.parameters() if p.grad is not None)
        print("%s: %d values to recompute, %d not found; %d gradients compared, %d differ %s%s"
              % (path, len(plan.RECOMPUTE), len(model.memplan_missing), n, len(differ), differ[:5], extra))
        bad_any = bad_any or bool(bad)
    sys.exit(1 if bad_any else 0)


if __name__ == "__main__":
    main()
