"""Is a compiled step's gradient the derivative of the loss its forward computed?

    python tools/pytorch/compiled_grad_check.py MODEL (BUDGET | PLAN.py) [...]

For each configuration (torch.compile with activation_memory_budget BUDGET, or an op
plan's compile_policy and no budget): one training forward and backward of MODEL at
batch 8 from fixed seeds, then the loss again, forward only, at the parameters moved
by +-eps along a random direction v (1e-3 x N(0, 1) per element), from the same random
state (so the same dropout masks). The central difference (L(+eps) - L(-eps)) / 2 eps
against g . v: where backward used the forward's dropout masks, the relative error
falls as eps^2 (curvature); a backward that drew other masks would leave it at a
constant. Gradients of two compiled graphs cannot be compared with each other for this:
inductor gives each graph's random ops their own seeds (compile's budget 1.0 and 0.5
differ by 0.76 of a gradient's magnitude on GPT-2). Dev tool (docs/BENCHMARKS.md).
"""
import os, sys, importlib.util
# models/export.py: the models and their inputs
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models"))
if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
    raise SystemExit(__doc__)
import torch
torch.set_num_threads(2)
import export as E
name = sys.argv[1]


def check(cfg):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, make_inputs, _, _ = E.build(name)
    model.train()
    torch.manual_seed(1)
    inputs = make_inputs(8)
    if cfg.endswith(".py"):
        spec = importlib.util.spec_from_file_location("plan", cfg); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        mod.compile_policy(model, *inputs)
        torch._functorch.config.activation_memory_budget = 1.0
    else:
        torch._functorch.config.activation_memory_budget = float(cfg)
    model.compile()
    def loss_of():
        torch.manual_seed(2)
        out = model(*inputs)
        return (out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)).float().mean()
    L = loss_of(); L.backward()
    params = [p for p in model.parameters()]
    g = [p.grad.detach().clone() for p in params]
    torch.manual_seed(3)
    v = [torch.randn_like(p) * 1e-3 for p in params]
    gv = sum((a * b).sum().item() for a, b in zip(g, v))
    res = []
    for eps in (1.0, 0.5, 0.25):
        with torch.no_grad():
            for p, d in zip(params, v): p.add_(d, alpha=eps)
        Lp = loss_of().item()
        with torch.no_grad():
            for p, d in zip(params, v): p.add_(d, alpha=-2 * eps)
        Lm = loss_of().item()
        with torch.no_grad():
            for p, d in zip(params, v): p.add_(d, alpha=eps)
        fd = (Lp - Lm) / (2 * eps)
        res.append((eps, fd, gv, abs(fd - gv) / abs(gv)))
    print(name, cfg, " ".join("eps %g fd %.6g g.v %.6g rel %.2e" % r for r in res))


for c in sys.argv[2:]:
    check(c)
