#!/usr/bin/env python3
"""The copies torch.matmul and torch.einsum save (strided_matmul.onnx and
strided_matmul.json next to this script are its output, committed; tests/training.rs
and tests/verify.rs read them). Dev-time tool:

    /work/venv/bin/python tests/data/ops/export_strided.py

TorchScript exporter, training mode, opset 17, dynamic batch, no constant folding;
weights from torch.manual_seed(0). One block holding every case memplan models:
  * Swin-style attention: q, k, v selected from one permuted qkv tensor, q scaled, so
    `q @ k^T` copies k^T and `attn @ v` copies v (their batch dims cannot merge);
  * a broadcast matmul whose right operand is expanded over heads (`[B,H,N,D] @
    [B,1,D,N]`): copied at the expanded size;
  * a Linear-style fold of a transposed input against a weight that requires grad
    (`[B,C,N] @ W^T`): the folded input is a copy;
  * einsum "bhid,bhjd->bhi": `j` only in the right operand is summed out first, so the
    right operand saved is the [BH, D, 1] sum; the left is a copy of permuted q.
strided_matmul.json holds PyTorch's saved bytes (saved_tensors_hooks, distinct
storages, parameters excluded) of one forward+loss (mean of the output) per batch.
"""
import json
import os

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
N, C, H, D = 6, 16, 4, 4


class Strided(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv = nn.Linear(C, 3 * C)
        s.kv = nn.Linear(C, 2 * D)
        s.w = nn.Parameter(torch.randn(5, N) * 0.1)

    def forward(s, x):  # x [B, N, C]
        B = x.shape[0]
        qkv = s.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * D ** -0.5
        a = (q @ k.transpose(-2, -1)).softmax(-1)
        o = (a @ v).transpose(1, 2).reshape(B, N, C)
        kk = s.kv(o).reshape(B, N, 2, 1, D).permute(2, 0, 3, 4, 1)[0]  # [B, 1, D, N]
        b2 = torch.matmul(q, kk)  # [B, H, N, N]
        lin = o.transpose(1, 2) @ s.w.t()  # [B, C, 5]
        e = torch.einsum("bhid,bhjd->bhi", q, k)  # [B, H, N]
        return o.sum(-1) + b2.sum((1, 3)) + lin.sum((1, 2))[:, None] + e.sum(1)


def saved_bytes(model, x):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).mean()
    return sum(seen.values())


def main():
    torch.manual_seed(0)
    m = Strided().train()
    x = torch.randn(2, N, C)
    path = os.path.join(HERE, "strided_matmul.onnx")
    torch.onnx.export(m, (x,), path, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      opset_version=17, do_constant_folding=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    ref = {"_about": "PyTorch %s saved bytes (distinct storages, parameters excluded) of "
                     "forward + mean loss, per batch: tests/data/ops/export_strided.py" % torch.__version__}
    for b in (1, 3):
        ref["batch_%d" % b] = saved_bytes(m, torch.randn(b, N, C))
    with open(os.path.join(HERE, "strided_matmul.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(ref)


if __name__ == "__main__":
    main()
