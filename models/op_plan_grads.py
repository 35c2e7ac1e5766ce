#!/usr/bin/env python3
"""Check an op plan's PyTorch file (memplan plan --pytorch, op granularity): one training
step's gradients with the file applied against the same step without it, bitwise
(dev-time tool, not needed to build memplan).

Usage:
    python models/op_plan_grads.py MODEL BATCH FILE.py [FILE.py ...]
    (MODEL: a models/export.py MODELS name, e.g. resnet50, gpt2)

For each file: builds the model twice with the same weights (train mode; BatchNorm's
weight and bias drawn at random rather than left at ones and zeros), applies the file
to one, runs forward (torch.manual_seed(1) before each, so dropout draws alike) and
backward of out.mean() on both, and compares every parameter's gradient with torch.equal.
Prints the values the file did not find (model.memplan_missing) and the gradients that
differ; exits 1 if any differ.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    import torch

    import export as E  # noqa: E402  (models/export.py)

    if len(sys.argv) < 4:
        sys.exit(__doc__)
    name, batch, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
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
        plan.apply(model)
        inputs = make_inputs(batch)

        def step(m):
            torch.manual_seed(1)
            out = m(*inputs)
            out = out if isinstance(out, torch.Tensor) else out[0]
            out.float().mean().backward()

        step(model)
        step(ref)
        bad = [n for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
               if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad))]
        n = sum(1 for p in model.parameters() if p.grad is not None)
        print("%s: %d values to recompute, %d not found; %d gradients compared, %d differ %s"
              % (path, len(plan.RECOMPUTE), len(model.memplan_missing), n, len(bad), bad[:5]))
        bad_any = bad_any or bool(bad)
    sys.exit(1 if bad_any else 0)


if __name__ == "__main__":
    main()
