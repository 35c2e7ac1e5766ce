#!/usr/bin/env python3
"""Small ONNX fixtures for the ops the model census added (dev-time tool; the .onnx
files next to it are committed, so tests need neither Python nor PyTorch).

    python tests/data/ops/export.py

TorchScript exporter, training mode, opset 17, dynamic batch, no constant folding
(the census's conventions, docs/CENSUS.md); weights from torch.manual_seed(0).
  * resize.onnx: a segmentation-style head upsampled four ways (F.interpolate
    bilinear with sizes, nearest x2, bilinear align_corners=True, bicubic x2): Resize.
  * einsum.onnx: MaxViT-style attention written with torch.einsum (spaces in the
    equation, a parameter operand, a diagonal): Einsum.
  * droppath.onnx: Linear blocks with torchvision's StochasticDepth ("row" and
    "batch") and SiLU: RandomUniformLike, Less, Cast, Div, Mul, and Sigmoid·Mul.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import StochasticDepth

HERE = os.path.dirname(os.path.abspath(__file__))


class Seg(nn.Module):
    def __init__(s):
        super().__init__()
        s.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        s.bn = nn.BatchNorm2d(8)
        s.c2 = nn.Conv2d(8, 4, 1)

    def forward(s, x):
        h = F.relu(s.bn(s.c1(x)))
        y = s.c2(h)
        a = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
        b = F.interpolate(y, scale_factor=2, mode="nearest")
        c = F.interpolate(y, size=(16, 16), mode="bilinear", align_corners=True)
        d = F.interpolate(y, scale_factor=2.0, mode="bicubic", align_corners=False)
        return a + b + c + d


class Ein(nn.Module):
    def __init__(s):
        super().__init__()
        s.q = nn.Linear(8, 8)
        s.rel = nn.Parameter(torch.randn(4, 4))

    def forward(s, x):  # x [B, H, N, D]
        q = s.q(x)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, x)
        out = torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(-1), x)
        r = torch.einsum("bhid,ij->bhid", out[..., :4], s.rel)
        return out.sum() + r.sum() + torch.einsum("...ii->...i", sim).sum()


class DropPath(nn.Module):
    def __init__(s):
        super().__init__()
        s.l1 = nn.Linear(16, 32)
        s.l2 = nn.Linear(32, 16)
        s.sd = StochasticDepth(0.2, "row")
        s.sd2 = StochasticDepth(0.1, "batch")
        s.head = nn.Linear(16, 4)

    def forward(s, x):
        h = x + s.sd(s.l2(F.silu(s.l1(x))))
        h = h + s.sd2(s.l2(F.silu(s.l1(h))))
        return s.head(h)


def main():
    torch.manual_seed(0)
    for name, m, x in [
        ("resize", Seg(), torch.randn(2, 3, 16, 16)),
        ("einsum", Ein(), torch.randn(2, 2, 4, 8)),
        ("droppath", DropPath(), torch.randn(2, 16)),
    ]:
        m.train()
        torch.onnx.export(m, (x,), os.path.join(HERE, name + ".onnx"), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, opset_version=17,
                          do_constant_folding=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
        print(name, "ok")


if __name__ == "__main__":
    main()
