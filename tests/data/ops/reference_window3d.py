"""Expected values of tests/window3d.rs: 3-D convolution and pooling in PyTorch
(float32, CPU): F.conv3d, F.max_pool3d, F.avg_pool3d, F.lp_pool3d, and their
gradients (autograd of sum(y * g), g = wave(y.shape, 1/32)). Run with python3 (torch 2.15); writes
tests/window3d/reference.rs.

Inputs follow the Rust helper `perm(shape, scale)`: ((i * 1000003) % n - n // 2) * scale
over the row-major index i, n the element count: distinct values 
that are exact in float32 (scale a power of two); 1000003 is a prime with no
small factors in 1000003 ± 1, so no tensor here is a linear ramp.
"""
import os

import torch
import torch.nn.functional as F


def perm(shape, scale):
    n = 1
    for d in shape:
        n *= d
    v = [((i * 1000003) % n - n // 2) * scale for i in range(n)]
    return torch.tensor(v, dtype=torch.float32).reshape(shape)


def wave(shape, scale):
    # The upstream gradients: ((i * 37) % 101 - 50) * scale, unlike any perm.
    n = 1
    for d in shape:
        n *= d
    v = [((i * 37) % 101 - 50) * scale for i in range(n)]
    return torch.tensor(v, dtype=torch.float32).reshape(shape)


OUT = []


def fmt(t):
    return ", ".join(f"{x:.8e}" for x in t.flatten().tolist())


def const(name, desc, t):
    OUT.append(f"// {desc}: shape {list(t.shape)}")
    if t.dtype == torch.int64:
        vals = ", ".join(str(x) for x in t.flatten().tolist())
        OUT.append(f"pub const {name}: [i64; {t.numel()}] = [{vals}];")
    else:
        OUT.append(f"pub const {name}: [f32; {t.numel()}] = [{fmt(t)}];")


def grads(y, ins, names, prefix, desc):
    g = wave(list(y.shape), 1 / 32)
    gs = torch.autograd.grad((y * g).sum(), ins)
    for gi, n in zip(gs, names):
        const(f"{prefix}_D{n}", f"d{n.lower()} of sum(y * wave(y, 1/32)), {desc}", gi)


def conv():
    # Groups 2, strides (2, 1, 2), dilations (1, 2, 1), ONNX pads
    # [1, 0, 2, 0, 1, 1] (begin d, h, w; end d, h, w): asymmetric, so F.pad first.
    x = perm([2, 4, 5, 6, 5], 1 / 16).requires_grad_()
    w = perm([6, 2, 3, 2, 3], 1 / 64).requires_grad_()
    b = perm([6], 1 / 8).requires_grad_()
    xp = F.pad(x, (2, 1, 0, 1, 1, 0))
    y = F.conv3d(xp, w, b, stride=(2, 1, 2), dilation=(1, 2, 1), groups=2)
    desc = "F.conv3d(F.pad(perm([2,4,5,6,5],1/16), (2,1,0,1,1,0)), perm([6,2,3,2,3],1/64), perm([6],1/8), stride=(2,1,2), dilation=(1,2,1), groups=2)"
    const("CONV3D", desc, y)
    grads(y, (x, w, b), ["X", "W", "B"], "CONV3D", desc)


def maxpool():
    # kernel (2, 3, 2), strides (2, 2, 1), pads 1, 1, 0, dilations (1, 1, 2), ceil_mode.
    x = perm([2, 3, 5, 6, 7], 1 / 16).requires_grad_()
    y, i = F.max_pool3d(x, (2, 3, 2), stride=(2, 2, 1), padding=(1, 1, 0),
                        dilation=(1, 1, 2), ceil_mode=True, return_indices=True)
    desc = "F.max_pool3d(perm([2,3,5,6,7],1/16), (2,3,2), stride=(2,2,1), padding=(1,1,0), dilation=(1,1,2), ceil_mode=True)"
    const("MAXPOOL3D", desc, y)
    # PyTorch's indices are per (image, channel); ONNX's run over the whole input.
    const("MAXPOOL3D_INDICES", "its return_indices (offsets within each [5, 6, 7] channel)", i)
    grads(y, (x,), ["X"], "MAXPOOL3D", desc)


def avgpool():
    x = perm([1, 3, 6, 6, 8], 1 / 16).requires_grad_()
    for include in (False, True):
        y = F.avg_pool3d(x, (3, 2, 3), stride=(2, 2, 2), padding=(1, 1, 1),
                         ceil_mode=True, count_include_pad=include)
        desc = f"F.avg_pool3d(perm([1,3,6,6,8],1/16), (3,2,3), stride=2, padding=1, ceil_mode=True, count_include_pad={include})"
        name = f"AVGPOOL3D_PAD{int(include)}"
        const(name, desc, y)
        grads(y, (x,), ["X"], name, desc)


def lppool():
    x = perm([1, 2, 4, 5, 6], 1 / 16)
    y = F.lp_pool3d(x, 2, (2, 3, 2), stride=(2, 1, 2))
    const("LPPOOL3D", "F.lp_pool3d(perm([1,2,4,5,6],1/16), 2, (2,3,2), stride=(2,1,2))", y)


def batchnorm():
    # Training mode over [N, C, D, H, W]: batch statistics (biased variance).
    x = perm([2, 3, 2, 3, 4], 1 / 16).requires_grad_()
    s = perm([3], 1 / 4) + 1
    b = perm([3], 1 / 8)
    y = F.batch_norm(x, None, None, s, b, training=True, eps=1e-5)
    desc = "F.batch_norm(perm([2,3,2,3,4],1/16), None, None, perm([3],1/4)+1, perm([3],1/8), training=True)"
    const("BATCHNORM5D", desc, y)
    grads(y, (x,), ["X"], "BATCHNORM5D", desc)


def main():
    torch.set_num_threads(1)
    conv()
    maxpool()
    avgpool()
    lppool()
    batchnorm()
    head = [
        "//! Reference values of tests/window3d.rs, written by",
        "//! tests/data/ops/reference_window3d.py (torch " + torch.__version__ + ", float32, CPU).",
        "#![cfg_attr(rustfmt, rustfmt_skip)]",
        "",
    ]
    path = os.path.join(os.path.dirname(__file__), "..", "..", "window3d", "reference.rs")
    with open(path, "w") as f:
        f.write("\n".join(head + OUT) + "\n")


if __name__ == "__main__":
    main()
