//! The registry-wide test: every registered op has a row here, and every row is
//! checked the same way.
//!
//! - **Shape and FLOPs.** Inference gives the row's output shapes and FLOPs. These
//!   are worked out by hand from the op's documented cost.
//! - **Kernel.** The CPU kernel's outputs have the inferred dtypes and shapes,
//!   and the values inference folded (small integer tensors) where it did.
//!   A row marked `no_cpu_kernel` instead expects the kernel to say it has none.
//! - **Backward.** Where the backward rule gives a gradient to a float input, the
//!   kernel's gradient passes the finite-difference check of
//!   tests/exec_backward.rs (`common::opcase::check`).
//! - **Facts.** Every op states its device kernels: no family match gives
//!   `CudaKernels::UNLISTED`.
//!
//! CPU against emulated CUDA for every op with device kernels is
//! tests/cuda.rs's `every_device_op_has_a_case`. A new op fails here until it
//! has its row.

mod common;

use std::collections::BTreeSet;

use common::opcase::*;
use memplan::exec::Tensor;
use memplan::ir::{Attr, DType};
use memplan::ops::{registry, Cx, KernelCx, Launch};

/// One op application, what inference must give for it, and how its kernel runs.
struct Row {
    case: Case,
    shapes: Vec<Vec<usize>>,
    flops: u64,
    /// The CPU executor has no kernel for it (it must say so).
    no_cpu_kernel: bool,
    /// Its backward cannot run on the CPU: LpPool's and GlobalLpPool's rules save
    /// too little (tests/exec_backward.rs `kernels_refuse_unsaved_tensors`),
    /// GlobalMaxPool's kernel makes no indices yet, LpNormalization has none yet.
    no_backward_kernel: bool,
    /// A sampled output (Bernoulli): its gradient is zero by definition (as
    /// PyTorch's), and a finite difference jumps wherever a draw flips.
    sampled: bool,
}

fn row(case: Case, shapes: &[&[usize]], flops: u64) -> Row {
    Row {
        case,
        shapes: shapes.iter().map(|s| s.to_vec()).collect(),
        flops,
        no_cpu_kernel: false,
        no_backward_kernel: false,
        sampled: false,
    }
}

impl Row {
    fn no_cpu_kernel(mut self) -> Row {
        self.no_cpu_kernel = true;
        self
    }
    fn no_backward_kernel(mut self) -> Row {
        self.no_backward_kernel = true;
        self
    }
    fn sampled(mut self) -> Row {
        self.sampled = true;
        self
    }
}

fn s(v: &str) -> Attr {
    Attr::String(v.into())
}

fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

fn i64s(v: &[i64]) -> Tensor {
    Tensor::i64(vec![v.len()], v.to_vec())
}

fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v])
}

fn int_scalar(v: i64) -> Tensor {
    Tensor::i64(vec![], vec![v])
}

/// Unary rows: op, FLOPs per element, input range (kept away from kinks and
/// outside the domain's edges).
const UNARY: &[(&str, u64, f32, f32)] = &[
    ("Identity", 0, -1.0, 1.0),
    ("Relu", 1, 0.1, 1.0),
    ("Neg", 1, -1.0, 1.0),
    ("Abs", 1, 0.1, 1.0),
    ("Floor", 1, 0.1, 0.4),
    ("Ceil", 1, 0.1, 0.4),
    ("Round", 1, 0.1, 0.4),
    ("Sign", 1, 0.1, 0.4),
    ("Sqrt", 1, 0.5, 2.0),
    ("Reciprocal", 1, 0.5, 2.0),
    ("Exp", 1, -1.0, 1.0),
    ("Log", 1, 0.5, 2.0),
    ("Erf", 1, -1.0, 1.0),
    ("Sin", 1, -1.0, 1.0),
    ("Cos", 1, -1.0, 1.0),
    ("Tan", 1, -1.0, 1.0),
    ("Tanh", 1, -1.0, 1.0),
    ("Atan", 1, -1.0, 1.0),
    ("LeakyRelu", 1, 0.1, 1.0),
    ("ThresholdedRelu", 1, 1.2, 2.0),
    ("Sigmoid", 3, -1.0, 1.0),
    ("HardSigmoid", 3, -2.0, 2.0),
    ("HardSwish", 4, -2.0, 2.0),
    ("Softplus", 3, -1.0, 1.0),
    ("Softsign", 3, 0.1, 1.0),
    ("Elu", 3, -1.0, -0.1),
    ("Selu", 4, 0.1, 1.0),
    ("Celu", 4, -1.0, -0.1),
    ("Mish", 6, -1.0, 1.0),
    ("Gelu", 8, -1.0, 1.0),
    ("Asin", 1, -0.8, 0.8),
    ("Acos", 1, -0.8, 0.8),
    ("Sinh", 1, -1.0, 1.0),
    ("Cosh", 1, -1.0, 1.0),
    ("Asinh", 1, -1.0, 1.0),
    ("Acosh", 1, 1.2, 2.0),
    ("Atanh", 1, -0.8, 0.8),
    ("Swish", 4, -1.0, 1.0),
    ("Shrink", 2, 0.6, 1.0),
];

/// One row per registered op (a few ops have two, for a second form).
fn rows() -> Vec<Row> {
    let mut r = Rng(12);
    let mut v = Vec::new();
    // Element-wise: [2, 3] = 6 elements.
    for &(op, f, lo, hi) in UNARY {
        v.push(row(
            Case::new(op, vec![r.range(&[2, 3], lo, hi)]),
            &[&[2, 3]],
            f * 6,
        ));
    }
    let bools = Tensor::bool(vec![2, 3], vec![true, false, true, true, false, false]);
    v.push(row(Case::new("Not", vec![bools.clone()]), &[&[2, 3]], 6));
    let c = Case::new(
        "BitwiseNot",
        vec![Tensor::i64(vec![2, 3], vec![0, 1, -1, 5, -6, 7])],
    )
    .opset(18);
    v.push(row(c, &[&[2, 3]], 6));
    for op in ["IsNaN", "IsInf"] {
        v.push(row(Case::new(op, vec![r.t(&[2, 3])]), &[&[2, 3]], 6));
    }
    // Broadcasting [2, 3] with [3]: 6 outputs, 1 FLOP each (PRelu 2).
    for op in ["Add", "Sub", "Mul"] {
        let c = Case::new(op, vec![r.t(&[2, 3]), r.t(&[3])]);
        v.push(row(c, &[&[2, 3]], 6));
    }
    let c = Case::new("Div", vec![r.t(&[2, 3]), r.away_from_zero(&[3])]);
    v.push(row(c, &[&[2, 3]], 6));
    let c = Case::new(
        "Pow",
        vec![r.range(&[2, 3], 0.8, 2.0), r.range(&[3], -2.0, 3.0)],
    );
    v.push(row(c, &[&[2, 3]], 6));
    let c = Case::new("PRelu", vec![r.away_from_zero(&[2, 3]), r.t(&[3])]);
    v.push(row(c, &[&[2, 3]], 12));
    let (ia, ib) = (
        Tensor::i64(vec![2, 3], vec![7, -7, 9, 4, 5, 6]),
        Tensor::i64(vec![3], vec![3, -2, 4]),
    );
    for op in ["Mod", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor"] {
        let mut c = Case::new(op, vec![ia.clone(), ib.clone()]);
        if op == "BitShift" {
            c = c.attr("direction", s("LEFT"));
        }
        v.push(row(c, &[&[2, 3]], 6));
    }
    for op in ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"] {
        let c = Case::new(op, vec![r.t(&[2, 3]), r.t(&[3])]);
        v.push(row(c, &[&[2, 3]], 6));
    }
    for op in ["And", "Or", "Xor"] {
        let other = Tensor::bool(vec![3], vec![true, false, true]);
        v.push(row(
            Case::new(op, vec![bools.clone(), other]),
            &[&[2, 3]],
            6,
        ));
    }
    // Variadic over three inputs: one FLOP per output per extra input (Mean +1).
    for (op, f) in [("Sum", 12), ("Mean", 18), ("Max", 12), ("Min", 12)] {
        let a = r.distinct(&[2, 3]);
        let b = Tensor::f32(vec![3], vec![0.033, -0.133, 0.233]);
        let c = Tensor::f32(vec![2, 1], vec![0.066, -0.166]);
        v.push(row(Case::new(op, vec![a, b, c]), &[&[2, 3]], f));
    }
    let cond = Tensor::bool(vec![3], vec![true, false, true]);
    let c = Case::new("Where", vec![cond, r.t(&[2, 3]), r.t(&[2, 1])]);
    v.push(row(c, &[&[2, 3]], 6));
    let c = Case::new("Cast", vec![r.t(&[2, 3])]).attr("to", Attr::Int(1));
    v.push(row(c, &[&[2, 3]], 0));
    let like = Tensor::zeros(DType::F16, vec![1]).unwrap();
    let c = Case::new("CastLike", vec![r.t(&[2, 3]), like]);
    v.push(row(c, &[&[2, 3]], 0));
    let x = Tensor::f32(vec![2, 3], vec![-0.9, -0.3, 0.1, 0.2, 0.7, 0.35]);
    let c = Case::new("Clip", vec![x, scalar(-0.5), scalar(0.5)]).consts(&[1, 2]);
    v.push(row(c, &[&[2, 3]], 12));
    // Training dropout (the mask declared): 2 FLOPs per element.
    let train = Tensor::bool(vec![], vec![true]);
    let c = Case::new("Dropout", vec![r.t(&[2, 3]), scalar(0.3), train])
        .consts(&[1])
        .outs(2, 1);
    v.push(row(c, &[&[2, 3], &[2, 3]], 12));

    // Reductions of [2, 3, 4] over axis 1, keepdims: [2, 1, 4].
    for (op, f, lo, hi) in [
        ("ReduceMean", 1, -1.0, 1.0),
        ("ReduceProd", 1, 0.5, 1.5),
        ("ReduceL1", 2, 0.1, 1.0),
        ("ReduceL2", 2, -1.0, 1.0),
        ("ReduceSumSquare", 2, -1.0, 1.0),
        ("ReduceLogSum", 1, 0.5, 2.0),
        ("ReduceLogSumExp", 3, -1.0, 1.0),
    ] {
        let c = Case::new(op, vec![r.range(&[2, 3, 4], lo, hi)]).attr("axes", ints(&[1]));
        v.push(row(c, &[&[2, 1, 4]], f * 24));
    }
    for op in ["ReduceMax", "ReduceMin"] {
        let c = Case::new(op, vec![r.distinct(&[2, 3, 4])]).attr("axes", ints(&[1]));
        v.push(row(c, &[&[2, 1, 4]], 24));
    }
    // ReduceSum takes its axes as an input (opset 13).
    let c =
        Case::new("ReduceSum", vec![r.t(&[2, 3, 4]), i64s(&[1])]).attr("keepdims", Attr::Int(0));
    v.push(row(c, &[&[2, 4]], 24));
    for op in ["ArgMax", "ArgMin"] {
        let c = Case::new(op, vec![r.distinct(&[2, 3, 4])]).attr("axis", Attr::Int(1));
        v.push(row(c, &[&[2, 1, 4]], 24));
    }
    // TopK, K = 2 of 4 along the last axis: log2(2) + 1 = 2 compares per element.
    let c = Case::new("TopK", vec![r.distinct(&[2, 3, 4]), i64s(&[2])]).outs(2, 1);
    v.push(row(c, &[&[2, 3, 2], &[2, 3, 2]], 48).no_cpu_kernel());
    let c = Case::new("CumSum", vec![r.t(&[2, 3, 4]), int_scalar(1)]);
    v.push(row(c, &[&[2, 3, 4]], 24));
    for (excl, rev) in [(0, 0), (1, 1)] {
        let c = Case::new("CumProd", vec![r.away_from_zero(&[2, 3, 4]), int_scalar(1)])
            .attr("exclusive", Attr::Int(excl))
            .attr("reverse", Attr::Int(rev));
        v.push(row(c, &[&[2, 3, 4]], 24));
    }

    // Sources and shape computations: data movement, 0 FLOPs.
    let c = Case::new("Constant", vec![]).attr("value_floats", Attr::Floats(vec![1.0, 2.0]));
    v.push(row(c, &[&[2]], 0));
    v.push(row(Case::new("Shape", vec![r.t(&[2, 3, 4])]), &[&[3]], 0));
    v.push(row(Case::new("Size", vec![r.t(&[2, 3, 4])]), &[&[]], 0));
    let c = Case::new("ConstantOfShape", vec![i64s(&[2, 3])]);
    v.push(row(c, &[&[2, 3]], 0));
    let c = Case::new("Range", vec![int_scalar(1), int_scalar(9), int_scalar(3)]);
    v.push(row(c, &[&[3]], 0));
    let nz = Tensor::f32(vec![2, 3], vec![0.0, 1.0, 0.0, 2.0, 3.0, 0.0]);
    v.push(row(
        Case::new("NonZero", vec![nz]).consts(&[0]),
        &[&[2, 3]],
        0,
    ));
    let c = Case::new("Trilu", vec![r.t(&[3, 4]), int_scalar(0)]).attr("upper", Attr::Int(1));
    v.push(row(c, &[&[3, 4]], 0));
    v.push(row(Case::new("EyeLike", vec![r.t(&[3, 4])]), &[&[3, 4]], 0));
    let c = Case::new(
        "ScatterND",
        vec![
            r.t(&[4, 3]),
            Tensor::i64(vec![2, 1], vec![0, 2]),
            r.t(&[2, 3]),
        ],
    );
    v.push(row(c, &[&[4, 3]], 0));
    let c = Case::new(
        "ScatterND",
        vec![
            r.t(&[4, 3]),
            Tensor::i64(vec![3, 2], vec![0, 1, 3, 2, -1, 0]),
            r.t(&[3]),
        ],
    )
    .attr("reduction", s("add"))
    .opset(16);
    v.push(row(c, &[&[4, 3]], 0));
    let c = Case::new(
        "ScatterElements",
        vec![
            r.t(&[3, 3]),
            Tensor::i64(vec![1, 3], vec![1, 0, 2]),
            r.t(&[1, 3]),
        ],
    );
    v.push(row(c, &[&[3, 3]], 0));
    let c = Case::new(
        "ScatterElements",
        vec![
            r.t(&[3, 3]),
            Tensor::i64(vec![3, 2], vec![1, 0, 2, -1, 0, 0]),
            r.t(&[3, 2]),
        ],
    )
    .attr("axis", Attr::Int(1))
    .attr("reduction", s("add"))
    .opset(16);
    v.push(row(c, &[&[3, 3]], 0));
    v.push(row(
        Case::new("Reshape", vec![r.t(&[2, 3, 4]), i64s(&[6, -1])]),
        &[&[6, 4]],
        0,
    ));
    let c = Case::new("Flatten", vec![r.t(&[2, 3, 4])]).attr("axis", Attr::Int(2));
    v.push(row(c, &[&[6, 4]], 0));
    let c = Case::new("Transpose", vec![r.t(&[2, 3, 4])]).attr("perm", ints(&[2, 0, 1]));
    v.push(row(c, &[&[4, 2, 3]], 0));
    v.push(row(
        Case::new("Squeeze", vec![r.t(&[2, 1, 4]), i64s(&[1])]),
        &[&[2, 4]],
        0,
    ));
    let c = Case::new("Unsqueeze", vec![r.t(&[2, 4]), i64s(&[0, -1])]);
    v.push(row(c, &[&[1, 2, 4, 1]], 0));
    let c = Case::new("Concat", vec![r.t(&[2, 3]), r.t(&[2, 1])]).attr("axis", Attr::Int(1));
    v.push(row(c, &[&[2, 4]], 0));
    let c = Case::new("Split", vec![r.t(&[2, 6]), i64s(&[2, 4])])
        .attr("axis", Attr::Int(1))
        .outs(2, 2);
    v.push(row(c, &[&[2, 2], &[2, 4]], 0));
    let c = Case::new(
        "Slice",
        vec![
            r.t(&[4, 5]),
            i64s(&[1]),
            i64s(&[100]),
            i64s(&[1]),
            i64s(&[2]),
        ],
    );
    v.push(row(c, &[&[4, 2]], 0));
    let idx = Tensor::i64(vec![2, 2], vec![0, 2, -1, 0]);
    let c = Case::new("Gather", vec![r.t(&[3, 4]), idx]).attr("axis", Attr::Int(0));
    v.push(row(c, &[&[2, 2, 4]], 0));
    let idx = Tensor::i64(vec![2, 2], vec![0, 2, 1, 1]);
    let c = Case::new("GatherElements", vec![r.t(&[2, 3]), idx]).attr("axis", Attr::Int(1));
    v.push(row(c, &[&[2, 2]], 0));
    let idx = Tensor::i64(vec![2, 1], vec![1, -2]);
    v.push(row(
        Case::new("GatherND", vec![r.t(&[3, 2]), idx]),
        &[&[2, 2]],
        0,
    ));
    v.push(row(
        Case::new("Expand", vec![r.t(&[3, 1]), i64s(&[2, 3, 4])]),
        &[&[2, 3, 4]],
        0,
    ));
    v.push(row(
        Case::new("Tile", vec![r.t(&[2, 3]), i64s(&[2, 1])]),
        &[&[4, 3]],
        0,
    ));
    for mode in ["DCR", "CRD"] {
        let c = Case::new("DepthToSpace", vec![r.t(&[1, 8, 2, 3])])
            .attr("blocksize", Attr::Int(2))
            .attr("mode", s(mode));
        v.push(row(c, &[&[1, 2, 4, 6]], 0));
    }
    let c = Case::new("SpaceToDepth", vec![r.t(&[1, 2, 4, 6])]).attr("blocksize", Attr::Int(2));
    v.push(row(c, &[&[1, 8, 2, 3]], 0));
    let c = Case::new("Pad", vec![r.t(&[3, 3]), i64s(&[1, 0, 0, 2])]).attr("mode", s("reflect"));
    v.push(row(c, &[&[4, 5]], 0));

    // Resize [1, 1, 2, 3] to [1, 1, 4, 6] linear: 4 taps (2 per axis), a
    // multiply-add each, per output element: 24 × 8.
    let empty = || Tensor::f32(vec![0], vec![]);
    let c = Case::new(
        "Resize",
        vec![r.t(&[1, 1, 2, 3]), empty(), empty(), i64s(&[1, 1, 4, 6])],
    )
    .attr("mode", s("linear"))
    .consts(&[1, 2])
    .opset(19);
    v.push(row(c, &[&[1, 1, 4, 6]], 24 * 8));
    // GridSample bilinear: [1, 2, 3, 4] at P = 2 × 3 points, E = 12 outputs, T = 4
    // taps over r = 2 axes: coordinates 4r·P = 48, weights T·r·P = 48, 2T·E = 96.
    let grid = Tensor::f32(
        vec![1, 2, 3, 2],
        vec![
            -0.7, -0.6, 0.2, -0.1, 0.55, 0.3, -0.35, 0.45, 0.1, 0.7, 0.65, -0.55,
        ],
    );
    let c = Case::new("GridSample", vec![r.t(&[1, 2, 3, 4]), grid]).opset(16);
    v.push(row(c, &[&[1, 2, 2, 3]], 48 + 48 + 96));

    // Matrix products: 2·M·K·N (+ M·N for Gemm's C).
    let c = Case::new("MatMul", vec![r.t(&[2, 3, 4]), r.t(&[4, 5])]);
    v.push(row(c, &[&[2, 3, 5]], 2 * 2 * 3 * 4 * 5));
    let c =
        Case::new("Gemm", vec![r.t(&[3, 4]), r.t(&[5, 4]), r.t(&[5])]).attr("transB", Attr::Int(1));
    v.push(row(c, &[&[3, 5]], 2 * 3 * 4 * 5 + 15));
    let c = Case::new("Einsum", vec![r.t(&[2, 3, 4]), r.t(&[2, 4, 5])])
        .attr("equation", s("bij,bjk->bik"));
    v.push(row(c, &[&[2, 3, 5]], 2 * 2 * 3 * 4 * 5));

    // Convolutions and pools on [1, 2, 5, 5].
    // Conv 3 filters 3×3, pad 1: 75 outputs × (2·2·9 + 1 bias).
    let c = Case::new(
        "Conv",
        vec![r.t(&[1, 2, 5, 5]), r.t(&[3, 2, 3, 3]), r.t(&[3])],
    )
    .attr("pads", ints(&[1, 1, 1, 1]));
    v.push(row(c, &[&[1, 3, 5, 5]], 75 * 37));
    // ConvTranspose 2 → 3 channels, 2×2 stride 2: 50 inputs × 2·3·4, + 300 for bias.
    let c = Case::new(
        "ConvTranspose",
        vec![r.t(&[1, 2, 5, 5]), r.t(&[2, 3, 2, 2]), r.t(&[3])],
    )
    .attr("strides", ints(&[2, 2]));
    v.push(row(c, &[&[1, 3, 10, 10]], 50 * 24 + 300));
    // Two groups of 2 → 1 channels, 3×2 kernel, strides 2×3, dilations 2×1,
    // pads (1, 0, 0, 1), output_padding 1×0: H 2·2 + 1 + 2·2 + 1 − 1 = 9,
    // W 3·2 + 0 + 1 + 1 − 1 = 7. 72 inputs × 2·1·6, + 252 for bias.
    let c = Case::new(
        "ConvTranspose",
        vec![r.t(&[2, 4, 3, 3]), r.t(&[4, 1, 3, 2]), r.t(&[2])],
    )
    .attr("group", Attr::Int(2))
    .attr("strides", ints(&[2, 3]))
    .attr("dilations", ints(&[2, 1]))
    .attr("pads", ints(&[1, 0, 0, 1]))
    .attr("output_padding", ints(&[1, 0]));
    v.push(row(c, &[&[2, 2, 9, 7]], 72 * 12 + 252));
    // 1-D, stride 2, pads 1 1, no bias: 2·3 + 2 + 1 − 2 = 7; 8 inputs × 2·2·3.
    let c = Case::new("ConvTranspose", vec![r.t(&[1, 2, 4]), r.t(&[2, 2, 3])])
        .attr("strides", ints(&[2]))
        .attr("pads", ints(&[1, 1]));
    v.push(row(c, &[&[1, 2, 7]], 96));
    // output_shape 8 with SAME_UPPER: total pad 2·2 + 3 − 8 = −1, so the start
    // pad is ⌊−1/2⌋ = −1 (one more output in front); 6 inputs × 2·1·3.
    let c = Case::new("ConvTranspose", vec![r.t(&[1, 2, 3]), r.t(&[2, 1, 3])])
        .attr("strides", ints(&[2]))
        .attr("auto_pad", s("SAME_UPPER"))
        .attr("output_shape", ints(&[8]));
    v.push(row(c, &[&[1, 1, 8]], 36));
    // 3-D, 2×2×2 kernel, stride 2: 8 inputs × 2·1·8.
    let c = Case::new(
        "ConvTranspose",
        vec![r.t(&[1, 1, 2, 2, 2]), r.t(&[1, 1, 2, 2, 2])],
    )
    .attr("strides", ints(&[2, 2, 2]));
    v.push(row(c, &[&[1, 1, 4, 4, 4]], 128));
    // Pools, 2×2 stride 1: 2·4·4 = 32 outputs × 4.
    for op in ["MaxPool", "AveragePool", "LpPool"] {
        let c = Case::new(op, vec![r.distinct(&[1, 2, 5, 5])]).attr("kernel_shape", ints(&[2, 2]));
        let row = row(c, &[&[1, 2, 4, 4]], 128);
        v.push(if op == "LpPool" {
            row.no_backward_kernel()
        } else {
            row
        });
    }
    for op in ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"] {
        let row = row(
            Case::new(op, vec![r.distinct(&[1, 2, 5, 5])]),
            &[&[1, 2, 1, 1]],
            50,
        );
        // Global max pooling makes no indices on the CPU yet; GlobalLpPool's rule
        // saves too little (both refuse, as conv.rs says).
        v.push(if op == "GlobalAveragePool" {
            row
        } else {
            row.no_backward_kernel()
        });
    }

    // Normalizations of [4, 3, 2] (24 elements).
    let c = Case::new(
        "BatchNormalization",
        vec![
            r.t(&[4, 3, 2]),
            r.range(&[3], 0.5, 1.5),
            r.t(&[3]),
            r.t(&[3]),
            r.range(&[3], 0.5, 1.5),
        ],
    )
    .attr("training_mode", Attr::Int(1));
    v.push(row(c, &[&[4, 3, 2]], 24 * 8));
    let c = Case::new(
        "LayerNormalization",
        vec![r.t(&[2, 3, 4]), r.range(&[4], 0.5, 1.5), r.t(&[4])],
    )
    .attr("axis", Attr::Int(-1));
    v.push(row(c, &[&[2, 3, 4]], 24 * 8));
    let c = Case::new(
        "RMSNormalization",
        vec![r.t(&[2, 3, 4]), r.range(&[4], 0.5, 1.5)],
    )
    .attr("axis", Attr::Int(-1))
    .opset(23);
    v.push(row(c, &[&[2, 3, 4]], 24 * 5));
    // Losses over scores [N=3, C=4, d=2] (24) and targets [3, 2] (6): NLL 3 per
    // target; SoftmaxCrossEntropyLoss 5 per score more.
    let targets = Tensor::i64(vec![3, 2], vec![0, 3, 1, -1, 2, 2]);
    for (red, shape) in [("mean", &[][..]), ("sum", &[]), ("none", &[3, 2])] {
        let c = Case::new(
            "NegativeLogLikelihoodLoss",
            vec![r.t(&[3, 4, 2]), targets.clone(), r.range(&[4], 0.5, 1.5)],
        )
        .attr("reduction", s(red))
        .attr("ignore_index", Attr::Int(-1))
        .opset(13);
        v.push(row(c, &[shape], 18));
        let c = Case::new(
            "SoftmaxCrossEntropyLoss",
            vec![r.t(&[3, 4, 2]), targets.clone(), r.range(&[4], 0.5, 1.5)],
        )
        .attr("reduction", s(red))
        .attr("ignore_index", Attr::Int(-1))
        .outs(2, 2)
        .opset(13);
        v.push(row(c, &[shape, &[3, 4, 2]], 24 * 5 + 18));
    }
    let c = Case::new(
        "SoftmaxCrossEntropyLoss",
        vec![r.t(&[3, 4]), Tensor::i64(vec![3], vec![2, 0, 3])],
    )
    .opset(13);
    v.push(row(c, &[&[]], 12 * 5 + 9));
    // Quantization: shape-only (no 8-bit tensors on the CPU); int32 stands in
    // for the 8-bit operands. Quantize 3 FLOPs per element, Dequantize 2,
    // DynamicQuantize 5; the integer products 2 per multiply-add.
    let c = Case::new("QuantizeLinear", vec![r.t(&[2, 3]), scalar(0.1)]).opset(21);
    v.push(row(c, &[&[2, 3]], 18).no_cpu_kernel());
    let qi = Tensor::i64(vec![2, 3], vec![1, 2, 3, 4, 5, 6])
        .cast(DType::I32)
        .unwrap();
    let zp = Tensor::i64(vec![3], vec![0, 1, 2])
        .cast(DType::I32)
        .unwrap();
    let c = Case::new("DequantizeLinear", vec![qi.clone(), r.t(&[3]), zp.clone()])
        .attr("axis", Attr::Int(1))
        .opset(21);
    v.push(row(c, &[&[2, 3]], 12).no_cpu_kernel());
    let c = Case::new("DynamicQuantizeLinear", vec![r.t(&[2, 3])])
        .outs(3, 0)
        .opset(11);
    v.push(row(c, &[&[2, 3], &[], &[]], 30).no_cpu_kernel());
    let qb = Tensor::i64(vec![3, 4], (0..12).collect())
        .cast(DType::I32)
        .unwrap();
    let one = Tensor::i64(vec![], vec![1]).cast(DType::I32).unwrap();
    let c = Case::new(
        "QLinearMatMul",
        vec![
            qi.clone(),
            scalar(0.1),
            one.clone(),
            qb.clone(),
            scalar(0.1),
            one.clone(),
            scalar(0.2),
            one.clone(),
        ],
    )
    .opset(21);
    v.push(row(c, &[&[2, 4]], 2 * 8 * 3).no_cpu_kernel());
    let c = Case::new("MatMulInteger", vec![qi.clone(), qb]).opset(10);
    v.push(row(c, &[&[2, 4]], 2 * 8 * 3).no_cpu_kernel());
    let qx = Tensor::i64(vec![1, 2, 3, 3], (0..18).collect())
        .cast(DType::I32)
        .unwrap();
    let qw = Tensor::i64(vec![4, 2, 2, 2], (0..32).collect())
        .cast(DType::I32)
        .unwrap();
    let c = Case::new("ConvInteger", vec![qx.clone(), qw.clone()]).opset(10);
    v.push(row(c, &[&[1, 4, 2, 2]], 16 * 8 * 2).no_cpu_kernel());
    let c = Case::new(
        "QLinearConv",
        vec![
            qx,
            scalar(0.1),
            one.clone(),
            qw,
            scalar(0.1),
            one.clone(),
            scalar(0.2),
            one,
        ],
    )
    .opset(10);
    v.push(row(c, &[&[1, 4, 2, 2]], 16 * 8 * 2).no_cpu_kernel());
    let c = Case::new(
        "InstanceNormalization",
        vec![r.t(&[2, 3, 2, 3]), r.range(&[3], 0.5, 1.5), r.t(&[3])],
    );
    v.push(row(c, &[&[2, 3, 2, 3]], 36 * 8));
    // GroupNormalization, 6 channels: opset 21 scale and B per channel (3 groups
    // of 2), opset 18 per group (2 groups of 3).
    let c = Case::new(
        "GroupNormalization",
        vec![r.t(&[2, 6, 3]), r.range(&[6], 0.5, 1.5), r.t(&[6])],
    )
    .attr("num_groups", Attr::Int(3))
    .opset(21);
    v.push(row(c, &[&[2, 6, 3]], 36 * 8));
    let c = Case::new(
        "GroupNormalization",
        vec![r.t(&[2, 6, 2, 2]), r.range(&[2], 0.5, 1.5), r.t(&[2])],
    )
    .attr("num_groups", Attr::Int(2))
    .attr("epsilon", Attr::Float(1e-3))
    .opset(18);
    v.push(row(c, &[&[2, 6, 2, 2]], 48 * 8));
    for op in ["Softmax", "LogSoftmax", "Hardmax"] {
        let c = Case::new(op, vec![r.distinct(&[4, 3, 2])]).attr("axis", Attr::Int(-1));
        v.push(row(c, &[&[4, 3, 2]], 24 * 5));
    }
    let c = Case::new("LpNormalization", vec![r.away_from_zero(&[4, 3, 2])])
        .attr("axis", Attr::Int(-1));
    v.push(row(c, &[&[4, 3, 2]], 24 * 3).no_backward_kernel());

    // Signal ops (shape-only): a length-8 transform is 5·8·3 = 120 FLOPs.
    let c = Case::new("DFT", vec![r.t(&[2, 8, 1]), int_scalar(8), int_scalar(1)]).opset(20);
    v.push(row(c, &[&[2, 8, 2]], 240).no_cpu_kernel());
    let c = Case::new("DFT", vec![r.t(&[2, 8, 2])])
        .attr("onesided", Attr::Int(1))
        .opset(17);
    v.push(row(c, &[&[2, 5, 2]], 240).no_cpu_kernel());
    let c = Case::new("STFT", vec![r.t(&[1, 16, 1]), int_scalar(4), r.t(&[8])]).opset(17);
    v.push(row(c, &[&[1, 3, 5, 2]], 3 * (120 + 8)).no_cpu_kernel());
    for op in ["HannWindow", "HammingWindow", "BlackmanWindow"] {
        let c = Case::new(op, vec![int_scalar(10)]).opset(17);
        v.push(row(c, &[&[10]], 30).no_cpu_kernel());
    }
    let c = Case::new(
        "MelWeightMatrix",
        vec![
            int_scalar(8),
            int_scalar(16),
            int_scalar(8000),
            scalar(0.0),
            scalar(4000.0),
        ],
    )
    .opset(17);
    v.push(row(c, &[&[9, 8]], 9 * 8 * 3).no_cpu_kernel());
    // Attention, N = B·Hq·Sq·St scores: 2·N·D (Q·Kᵀ) + 5·N (scale, mask,
    // softmax) + 2·N·Dv (P·V), plus 3·N with a softcap.
    // 4-D: B 1, Hq = Hkv 2, Sq 3, Skv 5, D 4, Dv 3: N 30.
    let c = Case::new(
        "Attention",
        vec![r.t(&[1, 2, 3, 4]), r.t(&[1, 2, 5, 4]), r.t(&[1, 2, 5, 3])],
    )
    .opset(23);
    v.push(row(c, &[&[1, 2, 3, 3]], 30 * 8 + 30 * 5 + 30 * 6));
    // 3-D grouped-query, causal: Hq 4, Hkv 2, Sq = Skv 3, D 2, Dv 3: N 72.
    let c = Case::new(
        "Attention",
        vec![r.t(&[2, 3, 8]), r.t(&[2, 3, 4]), r.t(&[2, 3, 6])],
    )
    .attr("q_num_heads", Attr::Int(4))
    .attr("kv_num_heads", Attr::Int(2))
    .attr("is_causal", Attr::Int(1))
    .opset(23);
    v.push(row(c, &[&[2, 3, 12]], 72 * 4 + 72 * 5 + 72 * 6));
    // A float mask [2, 1, 3, 4], scale, every output (present = K, V without a
    // cache; qk_matmul_output after the softmax), all four receiving gradients:
    // B 2, H 2, Sq 3, Skv 4, D = Dv 4: N 48.
    let c = Case::new(
        "Attention",
        vec![
            r.t(&[2, 2, 3, 4]),
            r.t(&[2, 2, 4, 4]),
            r.t(&[2, 2, 4, 4]),
            r.t(&[2, 1, 3, 4]),
        ],
    )
    .attr("scale", Attr::Float(0.6))
    .attr("qk_matmul_output_mode", Attr::Int(3))
    .outs(4, 4)
    .opset(23);
    v.push(row(
        c,
        &[&[2, 2, 3, 4], &[2, 2, 4, 4], &[2, 2, 4, 4], &[2, 2, 3, 4]],
        48 * 8 + 48 * 5 + 48 * 8,
    ));
    // A cache with present outputs, grouped-query, causal (offset 2) with a bool
    // mask: Hq 4, Hkv 2, Sq 2, Skv 3, past 2 (St 5), D 4, Dv 2: N 40.
    let mask = Tensor::bool(
        vec![2, 5],
        vec![
            true, false, true, true, false, false, true, true, false, true,
        ],
    );
    let c = Case::new(
        "Attention",
        vec![
            r.t(&[1, 4, 2, 4]),
            r.t(&[1, 2, 3, 4]),
            r.t(&[1, 2, 3, 2]),
            mask,
            r.t(&[1, 2, 2, 4]),
            r.t(&[1, 2, 2, 2]),
        ],
    )
    .attr("is_causal", Attr::Int(1))
    .outs(3, 3)
    .opset(23);
    v.push(row(
        c,
        &[&[1, 4, 2, 2], &[1, 2, 5, 4], &[1, 2, 5, 2]],
        40 * 8 + 40 * 5 + 40 * 4,
    ));
    // 3-D multi-query with a cache but no present outputs (the backward saves the
    // concatenations as extras), softcap, scale, a float mask [2, 3]: Hq 3, Hkv 1,
    // Sq 2, Skv 2, past 1 (St 3), D 2, Dv 4: N 18.
    let c = Case::new(
        "Attention",
        vec![
            r.t(&[1, 2, 6]),
            r.t(&[1, 2, 2]),
            r.t(&[1, 2, 4]),
            r.t(&[2, 3]),
            r.t(&[1, 1, 1, 2]),
            r.t(&[1, 1, 1, 4]),
        ],
    )
    .attr("q_num_heads", Attr::Int(3))
    .attr("kv_num_heads", Attr::Int(1))
    .attr("softcap", Attr::Float(1.5))
    .attr("scale", Attr::Float(0.7))
    .opset(23);
    v.push(row(c, &[&[1, 2, 12]], 18 * 4 + 18 * 8 + 18 * 8));
    // qk_matmul_output before the softcap (mode 0) and with the mask (mode 2),
    // receiving gradients: B 1, H 2, Sq 2, Skv 3, D = Dv 2, softcap 2: N 12.
    for mode in [0, 2] {
        let c = Case::new(
            "Attention",
            vec![
                r.t(&[1, 2, 2, 2]),
                r.t(&[1, 2, 3, 2]),
                r.t(&[1, 2, 3, 2]),
                r.t(&[2, 3]),
            ],
        )
        .attr("softcap", Attr::Float(2.0))
        .attr("qk_matmul_output_mode", Attr::Int(mode))
        .outs(4, 4)
        .opset(23);
        v.push(row(
            c,
            &[&[1, 2, 2, 2], &[1, 2, 3, 2], &[1, 2, 3, 2], &[1, 2, 2, 3]],
            12 * 4 + 12 * 8 + 12 * 4,
        ));
    }

    // LRN: size + 5 FLOPs per element; MVN 8.
    let c = Case::new("LRN", vec![r.range(&[2, 5, 2], 0.5, 1.5)])
        .attr("size", Attr::Int(3))
        .attr("alpha", Attr::Float(0.3))
        .opset(13);
    v.push(row(c, &[&[2, 5, 2]], 20 * 8));
    let c = Case::new("LRN", vec![r.range(&[1, 4, 3], 0.5, 1.5)])
        .attr("size", Attr::Int(2))
        .attr("alpha", Attr::Float(0.5))
        .attr("bias", Attr::Float(2.0))
        .opset(13);
    v.push(row(c, &[&[1, 4, 3]], 12 * 7));
    let c = Case::new("MeanVarianceNormalization", vec![r.t(&[2, 3, 2, 2])]).opset(13);
    v.push(row(c, &[&[2, 3, 2, 2]], 24 * 8));
    // RotaryEmbedding: 3 FLOPs per rotated element.
    let pos = Tensor::i64(vec![2, 3], vec![0, 1, 2, 4, 3, 0]);
    for (il, rot) in [(0, 0), (1, 0), (0, 2), (1, 2)] {
        let half = if rot == 0 { 2 } else { rot / 2 };
        let c = Case::new(
            "RotaryEmbedding",
            vec![
                r.t(&[2, 2, 3, 4]),
                r.t(&[5, half]),
                r.t(&[5, half]),
                pos.clone(),
            ],
        )
        .attr("interleaved", Attr::Int(il))
        .attr("rotary_embedding_dim", Attr::Int(rot as i64))
        .opset(23);
        let rd = if rot == 0 { 4 } else { rot };
        v.push(row(c, &[&[2, 2, 3, 4]], 2 * 2 * 3 * rd as u64 * 3));
    }
    let c = Case::new(
        "RotaryEmbedding",
        vec![r.t(&[2, 3, 8]), r.t(&[2, 3, 2]), r.t(&[2, 3, 2])],
    )
    .attr("num_heads", Attr::Int(2))
    .opset(23);
    v.push(row(c, &[&[2, 3, 8]], 2 * 2 * 3 * 4 * 3));
    // BitCast (float32 → int32 and back), OneHot and Scatter move data: 0 FLOPs.
    let c = Case::new("BitCast", vec![r.t(&[2, 3])])
        .attr("to", Attr::Int(6))
        .opset(26);
    v.push(row(c, &[&[2, 3]], 0));
    let bits = Tensor::i64(vec![2], vec![1065353216, -1073741824])
        .cast(DType::I32)
        .unwrap();
    let c = Case::new("BitCast", vec![bits])
        .attr("to", Attr::Int(1))
        .opset(26);
    v.push(row(c, &[&[2]], 0));
    let c = Case::new(
        "OneHot",
        vec![
            i64s(&[1, -1, 7]),
            int_scalar(4),
            Tensor::f32(vec![2], vec![0.0, 3.0]),
        ],
    )
    .attr("axis", Attr::Int(0))
    .opset(11);
    v.push(row(c, &[&[4, 3]], 0));
    let c = Case::new(
        "Scatter",
        vec![
            r.t(&[3, 3]),
            Tensor::i64(vec![2, 3], vec![1, 0, 2, 0, 2, 1]),
            r.t(&[2, 3]),
        ],
    )
    .opset(9);
    v.push(row(c, &[&[3, 3]], 0));
    // Recurrent layers, seq 3, batch 2, input 4, hidden 5: per step and row
    // 2·G·5·9 + 3·G·5 + 15 FLOPs.
    for (op, g, outs) in [("RNN", 1, 2), ("GRU", 3, 2), ("LSTM", 4, 3)] {
        let c = Case::new(
            op,
            vec![r.t(&[3, 2, 4]), r.t(&[2, g * 5, 4]), r.t(&[2, g * 5, 5])],
        )
        .attr("hidden_size", Attr::Int(5))
        .attr("direction", s("bidirectional"))
        .outs(outs, outs)
        .opset(14);
        let per = (2 * g * 5 * 9 + 3 * g * 5 + 15) as u64;
        let mut shapes: Vec<&[usize]> = vec![&[3, 2, 2, 5]];
        for _ in 1..outs {
            shapes.push(&[2, 2, 5]);
        }
        v.push(row(c, &shapes, 3 * 2 * 2 * per));
    }
    let c = Case::new(
        "LSTM",
        vec![r.t(&[2, 3, 4]), r.t(&[1, 20, 4]), r.t(&[1, 20, 5])],
    )
    .attr("hidden_size", Attr::Int(5))
    .attr("layout", Attr::Int(1))
    .opset(14);
    v.push(row(c, &[&[2, 3, 1, 5]], 3 * 2 * (2 * 20 * 9 + 60 + 15)));
    // With B, sequence_lens (all full), initial states, LSTM's peepholes, both
    // layouts, GRU with and without linear_before_reset.
    for (op, g, dir, lbr, layout) in [
        ("RNN", 1, "reverse", 0, 1),
        ("GRU", 3, "forward", 1, 0),
        ("GRU", 3, "bidirectional", 1, 1),
        ("GRU", 3, "reverse", 0, 0),
        ("LSTM", 4, "reverse", 0, 0),
        ("LSTM", 4, "bidirectional", 0, 1),
    ] {
        let dirs = if dir == "bidirectional" { 2 } else { 1 };
        let (x, st): (&[usize], &[usize]) = if layout == 1 {
            (&[2, 3, 4], &[2, dirs, 5])
        } else {
            (&[3, 2, 4], &[dirs, 2, 5])
        };
        let mut ins = vec![
            r.t(x),
            r.t(&[dirs, g * 5, 4]),
            r.t(&[dirs, g * 5, 5]),
            r.t(&[dirs, 2 * g * 5]),
            i64s(&[3, 3]),
            r.t(st),
        ];
        if g == 4 {
            ins.push(r.t(st));
            ins.push(r.t(&[dirs, 15]));
        }
        let outs = if g == 4 { 3 } else { 2 };
        let mut c = Case::new(op, ins)
            .outs(outs, outs)
            .attr("hidden_size", Attr::Int(5))
            .attr("direction", s(dir))
            .attr("layout", Attr::Int(layout))
            .opset(14);
        if g == 3 {
            c = c.attr("linear_before_reset", Attr::Int(lbr));
        }
        let per = (2 * g * 5 * 9 + 3 * g * 5 + 15) as u64;
        let y: Vec<usize> = if layout == 1 {
            vec![2, 3, dirs, 5]
        } else {
            vec![3, dirs, 2, 5]
        };
        let shapes: Vec<&[usize]> = vec![&y, st, st];
        v.push(row(c, &shapes[..outs], 3 * dirs as u64 * 2 * per));
    }
    // Image ops beside convolution (DeformConv and RoiAlign shape-only): Col2Im 1 FLOP per input
    // element; DeformConv Conv's 2 per multiply-add plus 9 per sampled point;
    // RoiAlign 9 per sample (sampling_ratio² per output); MaxUnpool 0.
    let c = Case::new(
        "Col2Im",
        vec![r.t(&[1, 4, 4]), i64s(&[3, 3]), i64s(&[2, 2])],
    )
    .opset(18);
    v.push(row(c, &[&[1, 1, 3, 3]], 16));
    let c = Case::new(
        "DeformConv",
        vec![r.t(&[1, 2, 3, 3]), r.t(&[1, 2, 2, 2]), r.t(&[1, 8, 2, 2])],
    )
    .opset(19);
    v.push(row(c, &[&[1, 1, 2, 2]], 64 + 32 * 9).no_cpu_kernel());
    let c = Case::new(
        "RoiAlign",
        vec![
            r.t(&[1, 2, 4, 4]),
            Tensor::f32(vec![2, 4], vec![0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0]),
            i64s(&[0, 0]),
        ],
    )
    .attr("output_height", Attr::Int(3))
    .attr("output_width", Attr::Int(3))
    .attr("sampling_ratio", Attr::Int(2))
    .opset(16);
    v.push(row(c, &[&[2, 2, 3, 3]], 36 * 4 * 9).no_cpu_kernel());
    let c = Case::new(
        "MaxUnpool",
        vec![
            r.t(&[1, 1, 2, 2]),
            Tensor::i64(vec![1, 1, 2, 2], vec![0, 3, 9, 15]),
        ],
    )
    .attr("kernel_shape", ints(&[2, 2]))
    .attr("strides", ints(&[2, 2]))
    .opset(11);
    v.push(row(c, &[&[1, 1, 4, 4]], 0));
    let c = Case::new("AffineGrid", vec![r.t(&[2, 2, 3]), i64s(&[2, 1, 4, 5])]).opset(20);
    v.push(row(c, &[&[2, 4, 5, 2]], 80 * 6));
    let c = Case::new("AffineGrid", vec![r.t(&[1, 3, 4]), i64s(&[1, 1, 2, 3, 1])]);
    let c = c.attr("align_corners", Attr::Int(1)).opset(20);
    v.push(row(c, &[&[1, 2, 3, 1, 3]], 18 * 8));
    let tokens = Tensor::i64(vec![2, 6], vec![1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8])
        .cast(DType::I32)
        .unwrap();
    let c = Case::new("TfIdfVectorizer", vec![tokens])
        .attr("max_gram_length", Attr::Int(2))
        .attr("min_gram_length", Attr::Int(2))
        .attr("max_skip_count", Attr::Int(0))
        .attr("mode", s("TF"))
        .attr("ngram_counts", ints(&[0, 4]))
        .attr("ngram_indexes", ints(&[0, 1, 2, 3, 4, 5, 6]))
        .attr("pool_int64s", ints(&[2, 3, 5, 4, 5, 6, 7, 8, 6, 7]))
        .opset(9);
    v.push(row(c, &[&[2, 7]], 14).no_cpu_kernel());
    let c = Case::new("Det", vec![r.t(&[3, 2, 2])]).opset(11);
    v.push(row(c, &[&[3]], 3 * (6 + 2)).no_cpu_kernel());
    // Selections and reversals move data: 0 FLOPs.
    let cond = Tensor::bool(vec![3], vec![true, false, true]);
    let c = Case::new("Compress", vec![r.t(&[3, 2]), cond.clone()])
        .attr("axis", Attr::Int(0))
        .opset(11);
    v.push(row(c, &[&[2, 2]], 0));
    let c = Case::new("Compress", vec![r.t(&[3, 2]), cond]).opset(11);
    v.push(row(c, &[&[2]], 0));
    let c = Case::new("ReverseSequence", vec![r.t(&[4, 3]), i64s(&[1, 2, 3, 0])])
        .attr("batch_axis", Attr::Int(0))
        .attr("time_axis", Attr::Int(1))
        .opset(10);
    v.push(row(c, &[&[4, 3]], 0));
    let c = Case::new("CenterCropPad", vec![r.t(&[5, 4, 2]), i64s(&[3, 6])])
        .attr("axes", ints(&[0, 1]))
        .opset(18);
    v.push(row(c, &[&[3, 6, 2]], 0));
    // Upsample: Resize-10's arithmetic (nearest a gather, 0 FLOPs; linear 2·2²
    // per output element over two resized axes); scales an input from opset 9,
    // an attribute before.
    let up = Tensor::f32(vec![4], vec![1.0, 1.0, 2.0, 3.0]);
    let c = Case::new("Upsample", vec![r.t(&[1, 1, 2, 2]), up])
        .consts(&[1])
        .opset(9);
    v.push(row(c, &[&[1, 1, 4, 6]], 0));
    let c = Case::new("Upsample", vec![r.t(&[1, 1, 2, 2])])
        .attr("scales", Attr::Floats(vec![1.0, 1.0, 2.0, 2.0]))
        .attr("mode", s("linear"))
        .opset(7);
    v.push(row(c, &[&[1, 1, 4, 4]], 16 * 8));
    let c = Case::new(
        "Resize",
        vec![
            r.t(&[1, 1, 2, 2]),
            Tensor::f32(vec![8], vec![0.0, 0.0, 0.2, 0.2, 1.0, 1.0, 0.8, 0.8]),
            Tensor::f32(vec![4], vec![1.0, 1.0, 2.0, 2.0]),
        ],
    )
    .attr("coordinate_transformation_mode", s("tf_crop_and_resize"))
    .attr("mode", s("linear"))
    .consts(&[1, 2])
    .opset(13);
    v.push(row(c, &[&[1, 1, 4, 4]], 16 * 8).no_cpu_kernel());
    // Random ops: one FLOP per element drawn.
    for op in ["RandomUniform", "RandomNormal"] {
        let c = Case::new(op, vec![]).attr("shape", ints(&[2, 3]));
        v.push(row(c, &[&[2, 3]], 6));
    }
    for op in ["RandomUniformLike", "RandomNormalLike"] {
        v.push(row(Case::new(op, vec![r.t(&[2, 3])]), &[&[2, 3]], 6));
    }
    let p = r.range(&[2, 3], 0.0, 1.0);
    v.push(row(Case::new("Bernoulli", vec![p]), &[&[2, 3]], 6).sampled());
    v
}

#[test]
fn every_registered_op_has_a_row() {
    let reg = registry();
    let names: BTreeSet<&str> = reg.names().into_iter().collect();
    let rows: BTreeSet<&str> = rows().iter().map(|r| r.case.op).collect();
    let missing: Vec<_> = names.difference(&rows).collect();
    let stale: Vec<_> = rows.difference(&names).collect();
    assert!(
        missing.is_empty(),
        "registered ops without a row: {missing:?}"
    );
    assert!(stale.is_empty(), "rows for ops not registered: {stale:?}");
}

#[test]
fn shape_rules_flops_and_cpu_kernels_agree() {
    let reg = registry();
    let mut failures = Vec::new();
    for row in rows() {
        let case = &row.case;
        let rule = reg.get("", case.op).unwrap();
        let node = case.node();
        let facts = case.facts();
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Some).collect(),
            opset: case.opset,
        };
        let outs = match rule.infer(&cx) {
            Ok(o) => o,
            Err(e) => {
                failures.push(format!("{}: infer: {e}", case.op));
                continue;
            }
        };
        let shapes: Vec<Vec<usize>> = outs.iter().map(|f| f.shape.clone()).collect();
        if shapes != row.shapes {
            failures.push(format!(
                "{}: shapes {shapes:?}, row says {:?}",
                case.op, row.shapes
            ));
        }
        let flops = rule.flops(&cx, &outs);
        if flops != row.flops {
            failures.push(format!(
                "{}: {flops} FLOPs, row says {}",
                case.op, row.flops
            ));
        }
        let kcx = KernelCx {
            node: &node,
            inputs: case.inputs.iter().map(Some).collect(),
            outputs: outs.iter().map(Some).collect(),
            opset: case.opset,
            seed: 7,
            dropout: true,
            extras: false,
        };
        match (rule.forward_cpu(&kcx), row.no_cpu_kernel) {
            (Ok(ts), false) => {
                // Folded constants are what the kernel computes.
                for (k, (t, f)) in ts.iter().zip(&outs).enumerate() {
                    let Some(v) = &f.value else { continue };
                    let folded: Vec<f64> = (0..v.data.len()).map(|i| v.data.float(i)).collect();
                    if folded != t.to_f64s() {
                        failures.push(format!(
                            "{}: output {k} folds to {folded:?}, the kernel gives {:?}",
                            case.op,
                            t.to_f64s()
                        ));
                    }
                }
                for (k, (t, f)) in ts.iter().zip(&outs).enumerate() {
                    if (t.dtype(), &t.shape) != (f.dtype, &f.shape) {
                        failures.push(format!(
                            "{}: output {k} is {} {:?}, inferred {} {:?}",
                            case.op,
                            t.dtype(),
                            t.shape,
                            f.dtype,
                            f.shape
                        ));
                    }
                }
                if ts.len() < outs.len() {
                    failures.push(format!(
                        "{}: {} outputs of {}",
                        case.op,
                        ts.len(),
                        outs.len()
                    ));
                }
            }
            (Err(e), false) => failures.push(format!("{}: kernel: {e}", case.op)),
            (Ok(_), true) => failures.push(format!(
                "{}: has a CPU kernel now; drop no_cpu_kernel from its row",
                case.op
            )),
            (Err(e), true) => {
                if !e.to_string().contains("no kernel") {
                    failures.push(format!("{}: expected no kernel, got: {e}", case.op));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn differentiable_rows_pass_finite_differences() {
    let reg = registry();
    let mut st = Stats::default();
    let mut r = Rng(99);
    let mut checked = 0;
    let mut failures = Vec::new();
    for row in rows() {
        let case = &row.case;
        if row.no_cpu_kernel || row.no_backward_kernel || row.sampled {
            continue;
        }
        let rule = reg.get("", case.op).unwrap();
        let node = case.node();
        let facts = case.facts();
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Some).collect(),
            opset: case.opset,
        };
        let outs = rule.infer(&cx).unwrap();
        let Some(bw) = rule.backward(&cx, &outs).unwrap() else {
            continue;
        };
        let differentiable = bw.grads.iter().any(|g| {
            g.input < case.inputs.len()
                && case.inputs[g.input].dtype().is_float()
                && !case.consts.contains(&g.input)
        });
        if differentiable {
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                check(case, &mut r, &mut st)
            }));
            match res {
                Ok(()) => checked += 1,
                Err(e) => failures.push(format!(
                    "{}: {}",
                    case.op,
                    e.downcast_ref::<String>()
                        .map_or("panicked", |s| s.as_str())
                )),
            }
        }
    }
    report("registry", &st);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked > 60, "only {checked} rows differentiated");
}

#[test]
fn every_op_states_its_device_kernels() {
    let reg = registry();
    for name in reg.names() {
        let k = reg.get("", name).unwrap().cuda_kernels(name);
        assert!(
            k.listed,
            "{name}: its family's cuda_kernels has no arm for it"
        );
        assert_eq!(
            k.forward.is_empty(),
            k.launch == Launch::Host,
            "{name}: kernels without a launcher, or a launcher without kernels"
        );
    }
}
