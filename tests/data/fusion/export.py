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

Fake quantization (QAT), exported at opset 17 with the observers disabled (scales and
zero points frozen: the exporter refuses the observers' in-place buffer updates); each
fake quantization is QuantizeLinear -> DequantizeLinear (with Clip(, 127) between them
for the (0, 127) range), and eager runs fake_quantize_*_cachemask, whose backward saves
only a bool mask (FakeQuantize*CachemaskBackward0._saved_mask):
  * qat_convnet: torch.ao.quantization's eager QAT, as prepare_qat makes it: a float
    stem Conv2d (no qconfig), QuantStub, Conv2d + ReLU fused (qat.ConvReLU2d, weight
    fake-quantized per channel, qint8 [-128, 127]), Linear (qat.Linear, weight per
    tensor), DeQuantStub; activations quint8 with reduce_range ([0, 127]: the Clip).
    Input [batch, 3, 8, 8]; calibrated on two seeded batches before the observers
    are disabled.
  * fake_quant_fn: the functional forms between Linear layers (input [batch, S, D]):
    torch.fake_quantize_per_tensor_affine with Python scalars (exported as Constant
    and Cast), torch.fake_quantize_per_channel_affine of a weight with buffer qparams,
    and torch.fake_quantize_per_tensor_affine with tensor qparams, [0, 255].

GroupNorm, which ONNX below opset 21 cannot say per channel: the exporters write
Reshape to [N, G, -1], InstanceNormalization with constant ones and zeros, Reshape
back, Mul(weight), Add(bias); eager runs native_group_norm
(NativeGroupNormBackward0: input, weight and the per-(image, group) mean and rstd,
float32):
  * groupnorm: GroupNormNet (Conv2d layers each followed by GroupNorm(2, 8),
    GroupNorm(1, 8) and GroupNorm(4, 8, affine=False), then a Linear), input
    [batch, 3, 8, 8], opset 17; groupnorm_dynamo: the same through the dynamo exporter.

Weight normalization (torch.nn.utils.parametrizations.weight_norm), exported as
ReduceL2(v), Div(v, norm), Mul(., g); eager runs _weight_norm_interface over the first or
last dim (WeightNormInterfaceBackward0: v, g and the norms):
  * weightnorm: WeightNormNet (a Conv1d normalized over dim 2 as wav2vec 2.0's positional
    convolution, a Conv1d and a Linear over dim 0, GELUs between), input [batch, 4, 32].
saved.json's fake_quant_reference: PyTorch's fake_quantize_per_{tensor,channel}_affine
on a small input (ties of round-half-to-even, values beyond the range), its outputs and
the gradient of their sum (the mask), for tests/fake_quant.rs to compare bit for bit;
and each QAT model's "reference": one eager step at batch 2 on a computed input (output
and each parameter's gradient summed, the mean loss), which tests/fake_quant.rs runs on
the CPU executor.

With model names as arguments, only those are exported and measured; saved.json keeps
the other entries.
"""
import contextlib
import importlib.util
import io
import json
import os
import sys

import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.ao.quantization as tq

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


class QatConvNet(nn.Module):
    """A float stem, then torch.ao.quantization's eager QAT modules (prepare_qat)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 10)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.quant(self.stem(x))
        x = self.relu(self.conv(x))
        return self.dequant(self.fc(torch.flatten(x, 1)))


class GroupNormNet(nn.Module):
    """Conv2d layers, each followed by nn.GroupNorm: 2 groups affine, 1 group
    (PoolFormer's and ConvNeXt-style GroupNorm(1, C)), 4 groups without affine."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.g1 = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.g2 = nn.GroupNorm(1, 8)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.g3 = nn.GroupNorm(4, 8, affine=False)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = F.relu(self.g1(self.c1(x)))
        x = F.relu(self.g2(self.c2(x)))
        x = F.relu(self.g3(self.c3(x)))
        return self.fc(torch.flatten(x, 1))


class WeightNormNet(nn.Module):
    """Weight-normalized layers: a Conv1d normalized over its last weight dim (dim=2,
    wav2vec 2.0's positional convolution), a Conv1d and a Linear over dim 0 (the
    default), through torch.nn.utils.parametrizations.weight_norm."""

    def __init__(self):
        super().__init__()
        wn = torch.nn.utils.parametrizations.weight_norm
        self.c1 = wn(nn.Conv1d(4, 16, 5, padding=2), dim=2)
        self.c2 = wn(nn.Conv1d(16, 16, 3, padding=1))
        self.fc = wn(nn.Linear(16 * 32, 10))

    def forward(self, x):
        x = F.gelu(self.c1(x))
        x = F.gelu(self.c2(x))
        return self.fc(torch.flatten(x, 1))


def qat_convnet():
    m = QatConvNet()
    m.train()
    m = tq.fuse_modules_qat(m, [["conv", "relu"]])
    m.qconfig = tq.QConfig(activation=tq.default_fake_quant, weight=tq.default_per_channel_weight_fake_quant)
    m.stem.qconfig = None
    m.fc.qconfig = tq.default_qat_qconfig
    tq.prepare_qat(m, inplace=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        m(torch.randn(4, 3, 8, 8, generator=g))
    m.apply(tq.disable_observer)
    return m


class FakeQuantFn(nn.Module):
    """Linear layers around the functional fake quantizations."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        w = self.mid.weight.detach()
        self.register_buffer("w_scale", (w.abs().amax(1) / 127).float())
        self.register_buffer("w_zp", torch.zeros(D, dtype=torch.int32))
        self.register_buffer("a_scale", torch.tensor([0.02]))
        self.register_buffer("a_zp", torch.tensor([128], dtype=torch.int32))

    def forward(self, x):
        h = self.inp(x)
        h = torch.fake_quantize_per_tensor_affine(h, 0.05, 3, -128, 127)
        w = torch.fake_quantize_per_channel_affine(self.mid.weight, self.w_scale, self.w_zp, 0, -128, 127)
        h = F.linear(h, w, self.mid.bias)
        h = torch.fake_quantize_per_tensor_affine(h, self.a_scale, self.a_zp, 0, 255)
        return self.out(h)


def fake_quant_reference():
    """PyTorch's fake quantization of a small input, forward values and the mask."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g) * 8
    # Exact ties at scale 0.25 (x / scale = k + 1/2), and zero.
    x[0] = torch.tensor([0.125, 0.375, -0.125, -0.375, 0.0])
    x[1, 0] = 40.0
    x[1, 1] = -40.0
    cases = [
        ("per_tensor", torch.tensor([0.25]), torch.tensor([3], dtype=torch.int32), None, 0, 255),
        ("per_tensor_int8", torch.tensor([0.1]), torch.tensor([-2], dtype=torch.int32), None, -128, 127),
        ("per_tensor_reduced", torch.tensor([0.0228]), torch.tensor([53], dtype=torch.int32), None, 0, 127),
        (
            "per_channel_axis1",
            torch.tensor([0.25, 0.1, 0.05, 0.3, 0.07]),
            torch.tensor([0, 1, -3, 5, 0], dtype=torch.int32),
            1,
            -128,
            127,
        ),
        ("per_channel_axis0", torch.tensor([0.25, 0.02, 0.5]), torch.tensor([0, 0, 0], dtype=torch.int32), 0, -128, 127),
    ]
    out = {"x": x.tolist(), "shape": list(x.shape), "cases": []}
    for name, scale, zp, axis, qmin, qmax in cases:
        xx = x.clone().requires_grad_()
        if axis is None:
            y = torch.fake_quantize_per_tensor_affine(xx, scale, zp, qmin, qmax)
        else:
            y = torch.fake_quantize_per_channel_affine(xx, scale, zp, axis, qmin, qmax)
        y.sum().backward()
        out["cases"].append(
            {
                "name": name,
                "scale": scale.tolist(),
                "zero_point": zp.tolist(),
                "axis": axis,
                "qmin": qmin,
                "qmax": qmax,
                "out": y.detach().flatten().tolist(),
                "mask": (xx.grad.flatten() != 0).tolist(),
            }
        )
    return out


def build(name):
    torch.manual_seed(0)
    if name == "qat_convnet":
        return qat_convnet()
    if name == "fake_quant_fn":
        m = FakeQuantFn()
        m.train()
        return m
    if name == "weightnorm":
        m = WeightNormNet()
        m.train()
        return m
    if name.startswith("groupnorm"):
        m = GroupNormNet()
        m.train()
        return m
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
    "qat_convnet": ("torchscript", 17),
    "fake_quant_fn": ("torchscript", 17),
    "groupnorm": ("torchscript", 17),
    "groupnorm_dynamo": ("dynamo", None),
    "weightnorm": ("torchscript", 17),
}


def inputs(batch, name=None):
    g = torch.Generator().manual_seed(1)
    if name == "qat_convnet" or name.startswith("groupnorm"):
        return (torch.randn(batch, 3, 8, 8, generator=g),)
    if name == "weightnorm":
        return (torch.randn(batch, 4, 32, generator=g),)
    return (torch.randn(batch, S, D, generator=g),)


def export(name, path):
    exporter, opset = MODELS[name]
    m = build(name)
    args = inputs(2, name)
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
            dims = list(args[0].shape[1:])
            mp = repo_export.export_dynamo(m, args, [("input", "float32", dims)], ["output"])
        onnx.save(mp, path)
    mp = onnx.load(path)
    onnx.checker.check_model(mp)
    return [n.op_type for n in mp.graph.node if n.op_type != "Constant"]


def measure(name, batch):
    m = build(name)
    a = repo_export._saved_analysis(m, inputs(batch, name))
    assert a["dropout"]["count"] == 0
    return {"saved_bytes": a["saved_bytes"], "saved_by_grad_fn_attr": a["saved_by_grad_fn_attr"]}


def reference_input(shape):
    """x[i] = ((37 i) mod 101 - 50) / 25 in float32: exact to recompute anywhere
    (one correctly rounded division), in [-2, 2]."""
    i = torch.arange(int(torch.tensor(shape).prod()))
    return (((37 * i) % 101 - 50).float() / 25.0).reshape(shape)


def sums(t):
    t = t.detach().double()
    return [t.sum().item(), t.abs().sum().item(), (t * t).sum().item()]


def reference(name):
    """One eager step of a QAT model at batch 2 on reference_input: the output and
    each parameter's gradient summed (plain, absolute, squared) and the mean loss,
    for tests/fake_quant.rs to run the same step on memplan's CPU executor."""
    m = build(name)
    shape = [2, 3, 8, 8] if name == "qat_convnet" else [2, S, D]
    out = m(reference_input(shape))
    loss = out.mean()
    loss.backward()
    return {
        "input_shape": shape,
        "output": sums(out),
        "loss": loss.item(),
        "grads": {n: sums(p.grad) for n, p in m.named_parameters()},
    }


def main():
    names = sys.argv[1:] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit("unknown models: %s" % " ".join(unknown))
    path = os.path.join(HERE, "saved.json")
    old = {}
    if sys.argv[1:] and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    out = {
        "_about": (
            "PyTorch %s eager saved bytes of forward + mean loss, CPU float32 (no dropout: the same on "
            "CUDA): saved_tensors_hooks pack hook, distinct untyped storages, parameters and buffers "
            "excluded, the model input included (models/export.py _saved_analysis), per model and "
            "batch; written by tests/data/fusion/export.py with the .onnx files" % torch.__version__
        ),
    }
    for name in MODELS:
        if name not in names:
            if name in old:
                out[name] = old[name]
            continue
        ops = export(name, os.path.join(HERE, name + ".onnx"))
        entry = {"exporter": MODELS[name][0], "ops": ops}
        for b in BATCHES:
            entry["batch_%d" % b] = measure(name, b)
        if name in ("qat_convnet", "fake_quant_fn"):
            entry["reference"] = reference(name)
        out[name] = entry
        print(name, {k: v["saved_bytes"] for k, v in entry.items() if k.startswith("batch")}, " ".join(ops))
    out["fake_quant_reference"] = fake_quant_reference()
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":
    main()
