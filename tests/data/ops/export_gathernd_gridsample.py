"""Tiny models for GatherND and GridSample (gathernd.onnx and gridsample.onnx next to
this script are its output, committed; tests/verify.rs runs them): the TorchScript
exporter, training mode, opset 17. Boolean-mask indexing
`x[mask]` is what that exporter writes as NonZero -> Transpose -> GatherND (tensor
indices `x[i0, i1]` become Gather ops); F.grid_sample becomes GridSample-16.

    python tests/data/ops/export_gathernd_gridsample.py tests/data/ops
    cargo run -- profile OUTDIR/gathernd.onnx --batch 2 --train
    cargo run -- profile OUTDIR/gridsample.onnx --batch 2 --train
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class MaskIndex(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)  # [B, 4, 8, 8]
        mask = torch.arange(64).reshape(8, 8) % 3 == 0
        z = y.permute(2, 3, 0, 1)[mask]  # [K, B, 4]
        return z.sum(dim=0)


class Sample(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.off = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        g = torch.tanh(self.off(x)).permute(0, 2, 3, 1)
        return F.grid_sample(y, g, align_corners=False)


out = sys.argv[1] if len(sys.argv) > 1 else "."
for name, m in [("gathernd", MaskIndex()), ("gridsample", Sample())]:
    m.train()
    torch.onnx.export(
        m,
        (torch.randn(2, 3, 8, 8),),
        f"{out}/{name}.onnx",
        dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING,
        opset_version=17,
        do_constant_folding=False,
        input_names=["x"],
        dynamic_axes={"x": {0: "batch"}},
    )
