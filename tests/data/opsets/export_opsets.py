"""Exports for tests/opsets.rs: two small models, each through both PyTorch exporters at the
opsets users pick, with what PyTorch saves for backward in one training step at batch 2
(pytorch.json). The spellings differ by exporter and opset:

* `Blocks` (Conv -> GroupNorm -> GELU -> Conv -> Hardswish -> mean):
  - the TorchScript exporter below opset 14 writes Hardswish as `x * HardSigmoid(x)`;
  - the dynamo exporter below opset 20 writes the exact GELU as
    `x * (0.5 * (1 + erf(x / sqrt(2))))`;
  - the dynamo exporter below opset 21 writes GroupNorm through InstanceNormalization with
    scale and bias expanded from CastLike constants, and its affine part through CastLike.
* `Attention` (q, k, v projections, `scaled_dot_product_attention` with a boolean padding
  mask, an output projection): the dynamo exporter below opset 23 zeroes fully masked rows
  after the Softmax (`Where(IsNaN(p), 0, p)`).

    python tests/data/opsets/export_opsets.py   # torch 2.15, onnx 1.23, onnxscript 0.7
"""

import json
import os
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
DYNAMO_OPSETS = (18, 20, 23)


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):  # [batch, 3, 8, 8]
        y = F.gelu(self.norm(self.conv1(x)))
        return F.hardswish(self.conv2(y)).mean(dim=(2, 3))


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):  # [batch, 16, 8]; a token whose first feature is below -1 is padding
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        keep = (x[:, :, 0] > -1.0).view(b, 1, 1, s)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(o.transpose(1, 2).reshape(b, s, 8))


def saved_bytes(m, x):
    """What PyTorch saves for backward in one training step: distinct storages through
    saved_tensors_hooks (keyed by storage: q, k and v are views of one projection),
    parameters excluded."""
    m.train()
    fixed = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in fixed:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).mean().backward()
    return sum(seen.values())


def main():
    torch.manual_seed(0)
    # The TorchScript exporter writes scaled_dot_product_attention from opset 14.
    models = {"blocks": (Blocks(), torch.randn(2, 3, 8, 8), (13, 17)),
              "attention": (Attention(), torch.randn(2, 16, 8), (14, 17))}
    out = {"batch": 2, "torch": torch.__version__, "files": {}}
    for name, (m, x, ts_opsets) in models.items():
        m.train()
        for opset in ts_opsets:
            f = "%s_ts%d.onnx" % (name, opset)
            torch.onnx.export(m, (x,), os.path.join(HERE, f), dynamo=False,
                              opset_version=opset, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, input_names=["input"],
                              dynamic_axes={"input": {0: "batch"}})
            out["files"][f] = name
        for opset in DYNAMO_OPSETS:
            f = "%s_dynamo%d.onnx" % (name, opset)
            torch.onnx.export(m, (x,), os.path.join(HERE, f), dynamo=True, optimize=False,
                              opset_version=opset, external_data=False,
                              dynamic_shapes=({0: torch.export.Dim("batch")},))
            out["files"][f] = name
        out[name + "_saved_bytes"] = saved_bytes(m, x)
    with open(os.path.join(HERE, "pytorch.json"), "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
