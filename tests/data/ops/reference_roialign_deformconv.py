"""Expected values of tests/torchvision_ops.rs: torchvision.ops.roi_align and
torchvision.ops.deform_conv2d (float32, CPU), forward and backward, and the ONNX
reference evaluator's RoiAlign in mode max (torchvision has no max RoiAlign).
Run with torch 2.15 / torchvision 0.29 / onnx 1.23:

    python3 tests/data/ops/reference_roialign_deformconv.py > tests/torchvision_ops/reference.rs

Inputs follow the Rust test's helpers, each computed in float64 and rounded to
float32 once: `seq(shape, scale)` is ((i * 37 % 101) - 50) * scale over the
row-major index i, `offsets(shape, amp)` is ((i * 53 % 97) / 97 * 2 - 1) * amp
(never an integer for the amplitudes used: no sample sits on a bilinear kink),
`unit(shape)` is (i * 29 % 89) / 88 (masks in [0, 1]). Each backward is of
L = sum(gy * y) with gy = seq(y.shape, 0.05).
"""
import numpy as np
import onnx
import onnx.helper as oh
import torch
from onnx.reference import ReferenceEvaluator
from torchvision.ops import deform_conv2d, roi_align


def n_of(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def seq(shape, scale):
    v = [((i * 37 % 101) - 50) * scale for i in range(n_of(shape))]
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).reshape(shape)


def offsets(shape, amp):
    v = [((i * 53 % 97) / 97 * 2 - 1) * amp for i in range(n_of(shape))]
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).reshape(shape)


def unit(shape):
    v = [(i * 29 % 89) / 88 for i in range(n_of(shape))]
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).reshape(shape)


def fmt(t):
    return ", ".join(f"{x:.8e}" for x in t.detach().flatten().tolist())


def const(name, desc, t):
    print(f"// {desc}: shape {list(t.shape)}")
    print(f"pub const {name}: [f32; {t.numel()}] = [{fmt(t)}];")


# Rois [x1, y1, x2, y2] and their images: inside, partly before the image,
# partly beyond it, and one smaller than a pixel.
ROIS = [
    [0.5, 1.0, 4.2, 3.7],
    [2.0, 1.5, 6.5, 5.9],
    [-1.5, -0.8, 3.0, 2.5],
    [5.0, 4.0, 9.0, 8.0],
    [3.0, 2.0, 3.2, 2.1],
]
BATCH = [0, 1, 0, 1, 0]

# (name, aligned, sampling_ratio, spatial_scale, (out_h, out_w))
ROI_CASES = [
    ("ROI_A", True, 2, 1.0, (3, 2)),
    ("ROI_B", False, 0, 0.5, (2, 2)),
    ("ROI_C", True, 0, 0.75, (2, 3)),
    ("ROI_D", False, 3, 1.0, (4, 4)),
]


def roialign():
    boxes = torch.tensor([[b] + r for b, r in zip(BATCH, ROIS)], dtype=torch.float32)
    for name, aligned, sr, scale, out in ROI_CASES:
        x = seq([2, 3, 6, 7], 0.1).requires_grad_()
        y = roi_align(x, boxes, out, spatial_scale=scale, sampling_ratio=sr, aligned=aligned)
        gy = seq(list(y.shape), 0.05)
        (y * gy).sum().backward()
        desc = f"roi_align(seq([2,3,6,7],0.1), ROIS, {out}, spatial_scale={scale}, sampling_ratio={sr}, aligned={aligned})"
        const(f"{name}_Y", desc, y)
        const(f"{name}_DX", f"its x.grad for gy = seq(y.shape, 0.05)", x.grad)
    # mode max: the ONNX reference evaluator (onnxruntime's semantics).
    node = oh.make_node(
        "RoiAlign", ["X", "rois", "batch_indices"], ["Y"], mode="max",
        output_height=3, output_width=2, sampling_ratio=2, spatial_scale=1.0,
        coordinate_transformation_mode="half_pixel",
    )
    graph = oh.make_graph(
        [node], "g",
        [oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, 3, 6, 7]),
         oh.make_tensor_value_info("rois", onnx.TensorProto.FLOAT, [5, 4]),
         oh.make_tensor_value_info("batch_indices", onnx.TensorProto.INT64, [5])],
        [oh.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 16)])
    (y,) = ReferenceEvaluator(model).run(None, {
        "X": seq([2, 3, 6, 7], 0.1).numpy(),
        "rois": np.array(ROIS, dtype=np.float32),
        "batch_indices": np.array(BATCH, dtype=np.int64),
    })
    const("ROI_MAX_Y", "onnx.reference RoiAlign-16 mode=max, output 3x2, sampling_ratio 2, half_pixel, of seq([2,3,6,7],0.1), ROIS", torch.from_numpy(y))


# (name, x, w, group, offset_group, stride, pad, dilation, mask, bias, offset amplitude)
DEFORM_CASES = [
    ("DC_A", [2, 4, 5, 6], [6, 2, 3, 3], 2, 2, (1, 2), (1, 1), (1, 1), True, True, 1.5),
    ("DC_B", [1, 3, 6, 5], [2, 3, 2, 2], 1, 1, (1, 1), (0, 0), (2, 1), False, False, 2.4),
    ("DC_C", [1, 2, 4, 4], [2, 1, 2, 3], 2, 1, (2, 1), (1, 0), (1, 1), True, False, 1.5),
]


def deformconv():
    for name, xs, ws, g, og, stride, pad, dil, use_mask, use_bias, amp in DEFORM_CASES:
        kh, kw = ws[2], ws[3]
        ohh = (xs[2] + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
        oww = (xs[3] + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
        x = seq(xs, 0.1).requires_grad_()
        w = seq(ws, 0.07).requires_grad_()
        off = offsets([xs[0], og * 2 * kh * kw, ohh, oww], amp).requires_grad_()
        mask = unit([xs[0], og * kh * kw, ohh, oww]).requires_grad_() if use_mask else None
        bias = seq([ws[0]], 0.3).requires_grad_() if use_bias else None
        # torchvision's groups come from the shapes: C / W.shape[1] and offset channels / (2 kh kw).
        assert xs[1] // ws[1] == g
        y = deform_conv2d(x, off, w, bias, stride=stride, padding=pad, dilation=dil, mask=mask)
        gy = seq(list(y.shape), 0.05)
        (y * gy).sum().backward()
        desc = (f"deform_conv2d(seq({xs},0.1), offsets(amp {amp}), seq({ws},0.07), bias={use_bias}, "
                f"stride={stride}, padding={pad}, dilation={dil}, mask={use_mask}), group {g}, offset_group {og}")
        const(f"{name}_Y", desc, y)
        const(f"{name}_DX", "its input.grad for gy = seq(y.shape, 0.05)", x.grad)
        const(f"{name}_DW", "its weight.grad", w.grad)
        const(f"{name}_DOFF", "its offset.grad", off.grad)
        if use_mask:
            const(f"{name}_DMASK", "its mask.grad", mask.grad)
        if use_bias:
            const(f"{name}_DB", "its bias.grad", bias.grad)


if __name__ == "__main__":
    print("//! Reference values of tests/torchvision_ops.rs, written by")
    print("//! tests/data/ops/reference_roialign_deformconv.py (torch "
          f"{torch.__version__.split('+')[0]}, torchvision "
          f"{__import__('torchvision').__version__.split('+')[0]}, onnx {onnx.__version__}).")
    print("#![cfg_attr(rustfmt, rustfmt_skip)]")
    print()
    roialign()
    deformconv()
