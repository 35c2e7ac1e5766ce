"""Expected values of tests/exec_forward.rs's GatherND and GridSample cases, from
PyTorch (float32, CPU): advanced indexing for GatherND, F.grid_sample for
GridSample. Run with /work/venv/bin/python; prints Rust constants.

Inputs follow the Rust test helpers: `seq(shape, scale)` is
((i * 37 % 101) - 50) * scale over the row-major index i; grids are `grid(shape)`
below (deterministic, within [-1.2, 1.2] so that padding matters).
"""
import sys

import torch
import torch.nn.functional as F


def seq(shape, scale):
    n = 1
    for d in shape:
        n *= d
    v = [((i * 37 % 101) - 50) * scale for i in range(n)]
    return torch.tensor(v, dtype=torch.float32).reshape(shape)


def grid(shape):
    # ((i * 53 % 97) / 96 * 2.4 - 1.2): covers [-1.2, 1.2], beyond the borders.
    n = 1
    for d in shape:
        n *= d
    v = [(i * 53 % 97) / 96.0 * 2.4 - 1.2 for i in range(n)]
    return torch.tensor(v, dtype=torch.float32).reshape(shape)


def fmt(t):
    return ", ".join(f"{x:.8e}" for x in t.flatten().tolist())


def const(name, desc, t):
    print(f"// {desc}: shape {list(t.shape)}")
    print(f"pub const {name}: [f32; {t.numel()}] = [{fmt(t)}];")


def gathernd():
    # batch_dims 0: data [3, 4, 2], indices [[2, 1], [0, 3], [-1, 0], [1, -2], [2, 1]] (k = 2).
    x = seq([3, 4, 2], 0.1)
    ind = torch.tensor([[2, 1], [0, 3], [-1, 0], [1, -2], [2, 1]])
    y = x[ind[:, 0], ind[:, 1]]
    const("GATHERND_B0", "x[i0, i1] of seq([3, 4, 2], 0.1), indices [[2,1],[0,3],[-1,0],[1,-2],[2,1]]", y)
    # batch_dims 1: data [2, 3, 4], indices [2, 3, 1]: out[b, t] = data[b, ind[b, t, 0]].
    x = seq([2, 3, 4], 0.1)
    ind = torch.tensor([[[2], [0], [2]], [[1], [-1], [0]]])
    b = torch.arange(2)[:, None]
    y = x[b, ind[..., 0]]
    const("GATHERND_B1", "x[arange(2)[:, None], ind[..., 0]] of seq([2, 3, 4], 0.1), indices [[[2],[0],[2]],[[1],[-1],[0]]]", y)
    # batch_dims 1, full tuples: data [2, 3, 4], indices [2, 2, 2].
    ind = torch.tensor([[[2, 3], [0, -1]], [[1, 1], [-3, 2]]])
    y = x[b, ind[..., 0], ind[..., 1]]
    const("GATHERND_B1_FULL", "x[arange(2)[:, None], ind[..., 0], ind[..., 1]] of seq([2, 3, 4], 0.1), indices [[[2,3],[0,-1]],[[1,1],[-3,2]]]", y)


def gridsample():
    x = seq([2, 3, 4, 5], 0.1)
    g = grid([2, 3, 2, 2])
    names = []
    for mode in ["bilinear", "nearest", "bicubic"]:
        for pad in ["zeros", "border", "reflection"]:
            for ac in [False, True]:
                y = F.grid_sample(x, g, mode=mode, padding_mode=pad, align_corners=ac)
                name = f"GS_{mode.upper()}_{pad.upper()}_{int(ac)}"
                const(name, f"F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode={mode}, padding_mode={pad}, align_corners={ac})", y)
                names.append(name)
    # 3-D (5-D input): trilinear ("bilinear") and nearest.
    x = seq([1, 2, 3, 4, 5], 0.1)
    g = grid([1, 2, 3, 2, 3])
    for mode in ["bilinear", "nearest"]:
        for pad in ["zeros", "border", "reflection"]:
            for ac in [False, True]:
                y = F.grid_sample(x, g, mode=mode, padding_mode=pad, align_corners=ac)
                name = f"GS3_{mode.upper()}_{pad.upper()}_{int(ac)}"
                const(name, f"F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode={mode}, padding_mode={pad}, align_corners={ac})", y)


if __name__ == "__main__":
    print(f"// torch {torch.__version__}")
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "gathernd"):
        gathernd()
    if which in ("all", "gridsample"):
        gridsample()
