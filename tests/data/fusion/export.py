#!/usr/bin/env python3
"""Patterns PyTorch runs fused (or not), and what eager PyTorch saves for them: the
*.onnx files and saved.json next to this script are its output, committed;
tests/fusion.rs reads them (no Python needed to test). Dev-time tool:

    /work/venv/bin/python tests/data/fusion/export.py

Origin of the data: the models below, weights from torch.manual_seed(0), exported by
torch.onnx.export in training mode with a dynamic batch and no constant folding
(TorchScript exporter, dynamo=False, unless the name says dynamo; the dynamo file goes
through models/export.py's export_dynamo, which keeps the initializers exactly the
parameters). saved.json holds, per model and batch, what PyTorch (the version recorded
in its _about) saves during one eager forward + mean loss on CPU, float32: measured by
models/export.py's _saved_analysis, i.e. a torch.autograd.graph.saved_tensors_hooks
pack hook recording every packed tensor's untyped storage, deduplicated by storage,
parameters and buffers excluded, the model input included (saved_bytes), and the
storages attributed to the grad_fn attribute that saves them (saved_by_grad_fn_attr).
No model here has dropout, so CPU and CUDA save the same bytes.

Every model is Linear layers around the pattern, input [batch, S, D] (S = 64, D = 32):
  * layernorm_opset16: nn.LayerNorm three ways (affine; elementwise_affine=False;
    bias=False), opset 16, where the TorchScript exporter decomposes it into
    ReduceMean, Sub, Pow(2), ReduceMean, Add(eps), Sqrt, Div [, Mul(weight)] [, Add(bias)].
    Eager runs native_layer_norm (NativeLayerNormBackward0: input, weight, bias and the
    per-row mean and rstd, float32).
  * rmsnorm_llama: transformers' LlamaRMSNorm written out (hidden.to(float32),
    pow(2).mean(-1, keepdim=True), hidden * torch.rsqrt(variance + eps), weight *
    hidden.to(dtype)); opset 17, rsqrt exported as Div(1, Sqrt). Eager runs it op by op:
    PowBackward0 saves x, RsqrtBackward0 its result, the two MulBackward0 x, the rsqrt
    and the normalized value.
  * rmsnorm_llama_dynamo: the same model through the dynamo exporter (opset 20, rsqrt
    written as Reciprocal(Sqrt)).
  * rmsnorm_div: RMSNorm written `hidden / torch.sqrt(variance + eps)`: eager saves the
    sqrt's result (SqrtBackward0) and x and the sqrt (DivBackward0).
  * silu: F.silu twice (SiluBackward0 saves only x), exported as Sigmoid + Mul.
  * gelu_tanh: F.gelu(approximate="tanh") twice (GeluBackward0 saves only x),
    exported at opset 17 written out (Mul, Add, Tanh...).
"""
import contextlib
import importlib.util
import io
import json
import os

import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
# models/export.py: the repo's exporters and its saved-bytes measurement.
_spec = importlib.util.spec_from_file_location("repo_export", os.path.join(ROOT, "models", "export.py"))
repo_export = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(repo_export)

S, D = 64, 32
BATCHES = (2, 4)


class LlamaRMSNorm(nn.Module):
    """transformers.models.llama.modeling_llama.LlamaRMSNorm, as written there."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DivRMSNorm(nn.Module):
    """RMSNorm written with a division by the square root."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, h):
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h / torch.sqrt(variance + self.eps))


class Around(nn.Module):
    """Linear, then each of `mids` followed by a Linear."""

    def __init__(self, mids):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.mids = nn.ModuleList(mids)
        self.outs = nn.ModuleList([nn.Linear(D, D) for _ in mids])

    def forward(self, x):
        h = self.inp(x)
        for m, o in zip(self.mids, self.outs):
            h = o(m(h))
        return h


class Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def build(name):
    torch.manual_seed(0)
    if name == "layernorm_opset16":
        mids = [nn.LayerNorm(D), nn.LayerNorm(D, elementwise_affine=False), nn.LayerNorm(D, bias=False)]
    elif name.startswith("rmsnorm_llama"):
        mids = [LlamaRMSNorm(D)]
    elif name == "rmsnorm_div":
        mids = [DivRMSNorm(D)]
    elif name == "silu":
        mids = [Fn(F.silu), Fn(F.silu)]
    elif name == "gelu_tanh":
        mids = [Fn(lambda x: F.gelu(x, approximate="tanh")) for _ in range(2)]
    else:
        raise KeyError(name)
    m = Around(mids)
    m.train()
    return m


# name -> (exporter, opset)
MODELS = {
    "layernorm_opset16": ("torchscript", 16),
    "rmsnorm_llama": ("torchscript", 17),
    "rmsnorm_llama_dynamo": ("dynamo", None),
    "rmsnorm_div": ("torchscript", 17),
    "silu": ("torchscript", 17),
    "gelu_tanh": ("torchscript", 17),
}


def inputs(batch):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, S, D, generator=g),)


def export(name, path):
    exporter, opset = MODELS[name]
    m = build(name)
    args = inputs(2)
    if exporter == "torchscript":
        torch.onnx.export(
            m,
            args,
            path,
            dynamo=False,
            opset_version=opset,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            mp = repo_export.export_dynamo(m, args, [("input", "float32", [S, D])], ["output"])
        onnx.save(mp, path)
    mp = onnx.load(path)
    onnx.checker.check_model(mp)
    return [n.op_type for n in mp.graph.node if n.op_type != "Constant"]


def measure(name, batch):
    m = build(name)
    a = repo_export._saved_analysis(m, inputs(batch))
    assert a["dropout"]["count"] == 0
    return {"saved_bytes": a["saved_bytes"], "saved_by_grad_fn_attr": a["saved_by_grad_fn_attr"]}


def main():
    out = {
        "_about": (
            "PyTorch %s eager saved bytes of forward + mean loss, CPU float32 (no dropout: the same on "
            "CUDA): saved_tensors_hooks pack hook, distinct untyped storages, parameters and buffers "
            "excluded, the model input included (models/export.py _saved_analysis), per model and "
            "batch; written by tests/data/fusion/export.py with the .onnx files" % torch.__version__
        ),
    }
    for name in MODELS:
        ops = export(name, os.path.join(HERE, name + ".onnx"))
        entry = {"exporter": MODELS[name][0], "ops": ops}
        for b in BATCHES:
            entry["batch_%d" % b] = measure(name, b)
        out[name] = entry
        print(name, {k: v["saved_bytes"] for k, v in entry.items() if k.startswith("batch")}, " ".join(ops))
    with open(os.path.join(HERE, "saved.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":
    main()
