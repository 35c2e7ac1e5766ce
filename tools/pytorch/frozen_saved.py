#!/usr/bin/env python3
"""What autograd saves for a frozen layer (weight requires_grad=False), with the input requiring
grad or not (dev-time check for how memplan models frozen layers). Prints a Markdown table.

    python tools/pytorch/frozen_saved.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(2)
torch.manual_seed(0)


def saved(fn, x, params):
    """Saved tensors of fn(x) (pack hook), named by identity: input / weight / bias / output / other."""
    out_holder = {}
    names = {id(x): "x"}
    for n, p in params.items():
        names[id(p)] = n
    pstor = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    out_holder["y"] = y
    res = []
    for t in packed:
        if id(t) in names:
            nm = names[id(t)]
        elif t.untyped_storage().data_ptr() in pstor:
            nm = pstor[t.untyped_storage().data_ptr()] + "(view)"
        elif t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr():
            nm = "output"
        elif t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            nm = "x(view)"
        else:
            nm = "other"
        res.append("%s%s" % (nm, list(t.shape)) if nm != "other" else "%s%s %s" % (nm, list(t.shape), str(t.dtype)[6:]))
    gfn = type(y.grad_fn).__name__ if y.grad_fn is not None else "-"
    return gfn, res


def case(label, make):
    rows = []
    for x_grad in (True, False):
        for w_grad in (False, True):
            mod, x, fn = make()
            for p in mod.parameters():
                p.requires_grad_(w_grad)
            x.requires_grad_(x_grad)
            if not (x_grad or w_grad):
                rows.append((label, x_grad, w_grad, "-", "nothing (no grad_fn)"))
                continue
            params = dict(mod.named_parameters())
            params.update(dict(mod.named_buffers()))
            gfn, res = saved(fn(mod), x, params)
            rows.append((label, x_grad, w_grad, gfn, ", ".join(res) or "nothing"))
    return rows


def main():
    rows = []
    rows += case("Conv2d(3->4, 3x3, bias)", lambda: (
        nn.Conv2d(3, 4, 3, padding=1), torch.randn(2, 3, 5, 5), lambda m: (lambda x: m(x))))
    rows += case("Linear 2-D input (addmm)", lambda: (
        nn.Linear(6, 4), torch.randn(2, 6), lambda m: (lambda x: m(x))))
    rows += case("Linear 3-D input", lambda: (
        nn.Linear(6, 4), torch.randn(2, 3, 6), lambda m: (lambda x: m(x))))
    rows += case("matmul x @ W (W [6,4] param)", lambda: (
        _P(torch.randn(6, 4)), torch.randn(2, 3, 6), lambda m: (lambda x: x @ m.w)))
    rows += case("Conv1D (GPT-2, addmm of x.view)", lambda: (
        _Conv1D(), torch.randn(2, 3, 6), lambda m: (lambda x: m(x))))
    rows += case("BatchNorm2d train", lambda: (
        nn.BatchNorm2d(3), torch.randn(2, 3, 5, 5), lambda m: (lambda x: m(x))))
    rows += case("LayerNorm", lambda: (
        nn.LayerNorm(6), torch.randn(2, 3, 6), lambda m: (lambda x: m(x))))
    rows += case("Embedding (ids input)", lambda: (
        nn.Embedding(10, 4), torch.randint(0, 10, (2, 3)), lambda m: (lambda x: m(x))))
    print("| op | x.requires_grad | weight.requires_grad | grad_fn | saved (pack hook) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %s | %s |" % r)


class _P(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)


class _Conv1D(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c = Conv1D(4, 6)

    def forward(self, x):
        return self.c(x)


if __name__ == "__main__":
    _orig_case = case

    def case(label, make):  # noqa: F811  (Embedding: integer input cannot require grad)
        if label.startswith("Embedding"):
            rows = []
            for w_grad in (False, True):
                mod, x, fn = make()
                for p in mod.parameters():
                    p.requires_grad_(w_grad)
                if not w_grad:
                    rows.append((label, False, w_grad, "-", "nothing (no grad_fn)"))
                    continue
                gfn, res = saved(fn(mod), x, dict(mod.named_parameters()))
                rows.append((label, False, w_grad, gfn, ", ".join(res)))
            return rows
        return _orig_case(label, make)

    main()
