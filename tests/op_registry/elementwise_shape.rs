//! Registry rows: element-wise ops, reductions, sources, shape and
//! selection ops, Resize and GridSample.

use super::*;

#[allow(clippy::too_many_lines)] // Long by design: a table of ops.
pub(super) fn rows(r: &mut Rng, v: &mut Vec<Row>) {
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
}
