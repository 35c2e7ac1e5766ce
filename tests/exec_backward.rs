//! The CPU executor's backward kernels (`Op::backward_cpu`) against finite
//! differences, op by op, over seeded random shapes and attributes.
//!
//! For one op case: random inputs `x`, random output gradients `g`, and for every
//! differentiable input `i` a random direction `v` (uniform in [-1, 1]). The
//! kernel's gradient must give the directional derivative of
//! `L(x) = Σ_o ⟨g_o, y_o(x)⟩`: `⟨dx_i, v⟩` against the central difference
//! `(L(x + εv) − L(x − εv)) / 2ε`, ε = 1e-2, with `L` accumulated in f64 from the f32
//! forward kernel (run with `extras`, as a training step runs it: BatchNorm in
//! training mode, Dropout with its seeded mask). Tolerance:
//! `|fd − an| ≤ 2e-3 · Σ_k |dx_k·v_k| + 1e-5 · (1 + Σ_o |g_o|·|y_o|)`: a relative
//! error on the size of the terms, plus the f32 rounding of `L` divided by 2ε
//! (about 6e-8 · Σ|g·y| / 0.02); the O(ε²) truncation is well inside it.
//! Inputs are kept away from kinks (ReLU at 0, clip bounds, max-pool ties) by more
//! than the step.
//!
//! Every gradient is computed with only the saved tensors its backward rule lists
//! for it (`BackwardCx::saved` refuses anything else), alone and together with the
//! op's other gradients (the two must agree bitwise), so a kernel that reads more
//! than its rule saves fails here.
#![allow(clippy::needless_range_loop)]

mod common;

use common::opcase::*;
use memplan::exec::Tensor;
use memplan::ir::{Attr, Attrs, DType, Node};
use memplan::ops::{registry, BackwardCx, Fact, RuleError, Saved};

#[test]
fn unary_ops() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(seed);
        let rank = r.u(1, 4);
        let shape = r.shape(rank, 1, 5);
        for op in [
            "Relu",
            "Tanh",
            "Erf",
            "Sigmoid",
            "Exp",
            "Abs",
            "Neg",
            "Identity",
            "Sin",
            "Cos",
            "Atan",
            "LeakyRelu",
            "Softplus",
            "Softsign",
            "Elu",
            "Selu",
            "Celu",
            "Mish",
        ] {
            let x = r.away_from_zero(&shape);
            check(&Case::new(op, vec![x]), &mut r, &mut st);
        }
        for op in ["Sqrt", "Log", "Reciprocal"] {
            let x = r.range(&shape, 0.5, 2.0);
            check(&Case::new(op, vec![x]), &mut r, &mut st);
        }
        let x = r.range(&shape, -1.0, 1.0);
        check(&Case::new("Tan", vec![x]), &mut r, &mut st);
        // Piecewise constant: a zero gradient, inputs away from the steps.
        for op in ["Floor", "Ceil", "Round", "Sign"] {
            let x = r.range(&shape, 0.1, 0.4);
            check(&Case::new(op, vec![x]), &mut r, &mut st);
        }
        for approx in ["none", "tanh"] {
            let x = r.t(&shape);
            let c = Case::new("Gelu", vec![x]).attr("approximate", Attr::String(approx.into()));
            check(&c, &mut r, &mut st);
        }
        let x = r.away_from_zero(&shape);
        let c = Case::new("LeakyRelu", vec![x]).attr("alpha", Attr::Float(0.2));
        check(&c, &mut r, &mut st);
        // HardSigmoid/HardSwish kinks at ±2.5 and ±3: stay inside.
        for op in ["HardSigmoid", "HardSwish"] {
            let x = r.range(&shape, -2.0, 2.0);
            check(&Case::new(op, vec![x]), &mut r, &mut st);
        }
        // Cast float to float passes the gradient through.
        let x = r.t(&shape);
        let c = Case::new("Cast", vec![x]).attr("to", Attr::Int(1));
        check(&c, &mut r, &mut st);
    }
    report("unary", &st);
}

#[test]
fn binary_ops_with_broadcasting() {
    let mut st = Stats::default();
    for seed in 0..SEEDS * 2 {
        let mut r = Rng(100 + seed);
        let rank = r.u(1, 4);
        let out = r.shape(rank, 1, 4);
        let (sa, sb) = if r.coin() {
            (out.clone(), broadcast_operand(&mut r, &out))
        } else {
            (broadcast_operand(&mut r, &out), out.clone())
        };
        for op in ["Add", "Sub", "Mul"] {
            let (a, b) = (r.t(&sa), r.t(&sb));
            check(&Case::new(op, vec![a, b]), &mut r, &mut st);
        }
        let (a, b) = (r.t(&sa), r.away_from_zero(&sb));
        check(&Case::new("Div", vec![a, b]), &mut r, &mut st);
        let (a, b) = (r.range(&sa, 0.8, 2.0), r.range(&sb, -2.0, 3.0));
        check(&Case::new("Pow", vec![a, b]), &mut r, &mut st);
        // GPT-2's x³ and ViT's x²: a constant exponent.
        for e in [2.0, 3.0] {
            let a = r.away_from_zero(&sa);
            let c = Case::new("Pow", vec![a, scalar(e)]).consts(&[1]);
            check(&c, &mut r, &mut st);
        }
        let (a, b) = (r.away_from_zero(&sa), r.t(&sb));
        check(&Case::new("PRelu", vec![a, b]), &mut r, &mut st);
        // Variadic over three inputs.
        let sc = broadcast_operand(&mut r, &out);
        for op in ["Sum", "Mean", "Max", "Min"] {
            let ins = if matches!(op, "Max" | "Min") {
                // Distinct across the three: values 0.05 apart, offsets 0.033 and
                // 0.066 past them, all further apart than the ±0.01 steps move them.
                let a = r.distinct(&sa);
                let shift = |t: Tensor, d: f32| {
                    let v = t.as_f32().unwrap().iter().map(|x| x + d).collect();
                    Tensor::f32(t.shape.clone(), v)
                };
                let b = shift(r.distinct(&sb), 0.033);
                let c = shift(r.distinct(&sc), 0.066);
                vec![a, b, c]
            } else {
                vec![r.t(&sa), r.t(&sb), r.t(&sc)]
            };
            check(&Case::new(op, ins), &mut r, &mut st);
        }
        // Where: condition, x and y all broadcast.
        let scond = broadcast_operand(&mut r, &out);
        let n: usize = scond.iter().product();
        let cond = Tensor::bool(scond.clone(), (0..n).map(|_| r.coin()).collect());
        let c = Case::new("Where", vec![cond, r.t(&sa), r.t(&sb)]);
        check(&c, &mut r, &mut st);
    }
    report("binary", &st);
}

#[test]
fn clip_and_dropout() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(200 + seed);
        let rank = r.u(1, 4);
        let shape = r.shape(rank, 1, 6);
        // Values 0.1 away from the bounds ±0.5.
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| {
                let m = r.f(0.0, 0.3);
                [-0.9 + m, -0.4 + m, 0.6 + m][r.u(0, 2)]
            })
            .collect();
        let x = Tensor::f32(shape.clone(), v);
        let c = Case::new("Clip", vec![x, scalar(-0.5), scalar(0.5)]).consts(&[1, 2]);
        check(&c, &mut r, &mut st);
        // MobileNet's ReLU6 with only a max: min omitted is not expressible with
        // positional inputs here, so both bounds, the upper one at 6.
        let x = r.range(&shape, 0.1, 5.0);
        let c = Case::new("Clip", vec![x, scalar(0.0), scalar(6.0)]).consts(&[1, 2]);
        check(&c, &mut r, &mut st);
        // Training dropout (mask saved as an extra), with the mask output declared
        // or not; inference dropout (identity, nothing saved).
        for (n_out, training) in [(1, true), (2, true), (1, false)] {
            let x = r.t(&shape);
            let t = Tensor::bool(vec![], vec![training]);
            let c = Case::new("Dropout", vec![x, scalar(0.3), t])
                .consts(&[1])
                .outs(n_out, 1);
            check(&c, &mut r, &mut st);
        }
    }
    report("clip/dropout", &st);
}

#[test]
fn matmul_and_gemm() {
    let mut st = Stats::default();
    for seed in 0..SEEDS * 2 {
        let mut r = Rng(300 + seed);
        let (m, k, n) = (r.u(1, 5), r.u(1, 5), r.u(1, 5));
        // Batched and broadcast: [b1, 1, m, k] × [b2, k, n], and 1-D operands.
        let (b1, b2) = (r.u(1, 3), r.u(1, 3));
        let shapes: Vec<(Vec<usize>, Vec<usize>)> = vec![
            (vec![m, k], vec![k, n]),
            (vec![b1, 1, m, k], vec![b2, k, n]),
            (vec![b2, m, k], vec![k, n]),
            (vec![k], vec![b1, k, n]),
            (vec![b1, m, k], vec![k]),
            (vec![k], vec![k]),
        ];
        for (sa, sb) in shapes {
            let c = Case::new("MatMul", vec![r.t(&sa), r.t(&sb)]);
            check(&c, &mut r, &mut st);
        }
        for (ta, tb) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
            let sa = if ta == 1 { vec![k, m] } else { vec![m, k] };
            let sb = if tb == 1 { vec![n, k] } else { vec![k, n] };
            let sc = [vec![n], vec![1, n], vec![m, 1], vec![m, n], vec![]][r.u(0, 4)].clone();
            let mut ins = vec![r.t(&sa), r.t(&sb)];
            if r.u(0, 3) > 0 {
                ins.push(r.t(&sc));
            }
            let mut c = Case::new("Gemm", ins)
                .attr("transA", Attr::Int(ta))
                .attr("transB", Attr::Int(tb));
            if r.coin() {
                c = c
                    .attr("alpha", Attr::Float(r.f(0.5, 2.0)))
                    .attr("beta", Attr::Float(r.f(0.5, 2.0)));
            }
            check(&c, &mut r, &mut st);
        }
    }
    report("matmul/gemm", &st);
}

#[test]
fn conv_groups_strides_pads_dilations() {
    let mut st = Stats::default();
    for seed in 0..SEEDS * 2 {
        let mut r = Rng(400 + seed);
        let n = r.u(1, 2);
        // group: 1, 2, or depthwise.
        let kind = r.u(0, 3);
        let (c, m, group) = match kind {
            0 => (r.u(1, 3), r.u(1, 3), 1),
            1 => (2 * r.u(1, 2), 2 * r.u(1, 2), 2),
            2 => {
                let c = r.u(2, 4);
                (c, c, c)
            }
            _ => (r.u(2, 4), r.u(1, 3), 1),
        };
        let one_d = seed % 4 == 3;
        let k: Vec<usize> = if kind == 3 {
            vec![1; if one_d { 1 } else { 2 }]
        } else if one_d {
            vec![r.u(1, 3)]
        } else {
            vec![r.u(1, 3), r.u(1, 3)]
        };
        let nd = k.len();
        let strides: Vec<i64> = (0..nd)
            .map(|_| if kind == 3 { 1 } else { r.u(1, 2) as i64 })
            .collect();
        let dil: Vec<i64> = (0..nd)
            .map(|_| if kind == 3 { 1 } else { r.u(1, 2) as i64 })
            .collect();
        let pads: Vec<i64> = (0..2 * nd)
            .map(|_| if kind == 3 { 0 } else { r.u(0, 2) as i64 })
            .collect();
        let spatial: Vec<usize> = (0..nd).map(|_| r.u(4, 7)).collect();
        let mut xs = vec![n, c];
        xs.extend(&spatial);
        let mut ws = vec![m, c / group];
        ws.extend(&k);
        let mut ins = vec![r.t(&xs), r.t(&ws)];
        if r.coin() {
            ins.push(r.t(&[m]));
        }
        let cs = Case::new("Conv", ins)
            .attr("group", Attr::Int(group as i64))
            .attr("strides", ints(&strides))
            .attr("dilations", ints(&dil))
            .attr("pads", ints(&pads));
        check(&cs, &mut r, &mut st);
    }
    // SAME_UPPER, the 7×7 stride-2 stem.
    let mut r = Rng(499);
    let c = Case::new("Conv", vec![r.t(&[1, 2, 9, 9]), r.t(&[3, 2, 3, 3])])
        .attr("auto_pad", Attr::String("SAME_UPPER".into()))
        .attr("strides", ints(&[2, 2]));
    check(&c, &mut r, &mut st);
    let c = Case::new(
        "Conv",
        vec![r.t(&[1, 3, 12, 12]), r.t(&[4, 3, 7, 7]), r.t(&[4])],
    )
    .attr("strides", ints(&[2, 2]))
    .attr("pads", ints(&[3, 3, 3, 3]));
    check(&c, &mut r, &mut st);
    report("conv", &st);
}

#[test]
fn pooling() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(500 + seed);
        let shape = vec![r.u(1, 2), r.u(1, 3), r.u(4, 7), r.u(4, 7)];
        let k = [r.u(1, 3) as i64, r.u(2, 3) as i64];
        let s = [r.u(1, 2) as i64, r.u(1, 2) as i64];
        // Pads below the kernel size: no window lies wholly in the padding.
        let p = [
            0,
            r.u(0, 1).min(k[1] as usize - 1) as i64,
            r.u(0, 1).min(k[0] as usize - 1) as i64,
            0,
        ];
        let c = Case::new("MaxPool", vec![r.distinct(&shape)])
            .attr("kernel_shape", ints(&k))
            .attr("strides", ints(&s))
            .attr("pads", ints(&p));
        check(&c, &mut r, &mut st);
        // With the indices output declared too.
        let c = Case::new("MaxPool", vec![r.distinct(&shape)])
            .attr("kernel_shape", ints(&[3, 3]))
            .attr("strides", ints(&[2, 2]))
            .attr("pads", ints(&[1, 1, 1, 1]))
            .outs(2, 1);
        check(&c, &mut r, &mut st);
        for inc in [0, 1] {
            let c = Case::new("AveragePool", vec![r.t(&shape)])
                .attr("kernel_shape", ints(&k))
                .attr("strides", ints(&s))
                .attr("pads", ints(&p))
                .attr("count_include_pad", Attr::Int(inc));
            check(&c, &mut r, &mut st);
        }
        check(
            &Case::new("GlobalAveragePool", vec![r.t(&shape)]),
            &mut r,
            &mut st,
        );
    }
    report("pooling", &st);
}

#[test]
fn normalizations_and_softmax() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(600 + seed);
        // BatchNorm (training mode under extras), 2-D to 4-D inputs.
        let rank = r.u(2, 4);
        // At least 6 values per channel (BN is far from linear on fewer).
        let mut shape = r.shape(rank, 2, 4);
        shape[0] = if rank == 2 { r.u(6, 8) } else { r.u(2, 3) };
        let c = shape[1];
        let ins = vec![
            r.t(&shape),
            r.range(&[c], 0.5, 1.5),
            r.t(&[c]),
            r.t(&[c]),
            r.range(&[c], 0.5, 1.5),
        ];
        check(&Case::new("BatchNormalization", ins), &mut r, &mut st);
        // With the running statistics outputs declared (no gradient flows into them).
        let ins = vec![
            r.t(&shape),
            r.range(&[c], 0.5, 1.5),
            r.t(&[c]),
            r.t(&[c]),
            r.range(&[c], 0.5, 1.5),
        ];
        let bn = Case::new("BatchNormalization", ins)
            .attr("training_mode", Attr::Int(1))
            .outs(3, 1);
        check(&bn, &mut r, &mut st);
        // LayerNorm over the last axes, scale (and bias) over a suffix of them.
        let rank = r.u(2, 4);
        let shape = r.shape(rank, 2, 5);
        let ax = r.u(1, rank - 1);
        let norm = &shape[ax..];
        let sshape = norm[r.u(0, norm.len() - 1)..].to_vec();
        let mut ins = vec![r.t(&shape), r.range(&sshape, 0.5, 1.5)];
        if r.coin() {
            ins.push(r.t(norm));
        }
        let ln = Case::new("LayerNormalization", ins).attr("axis", Attr::Int(ax as i64));
        check(&ln, &mut r, &mut st);
        // Softmax and LogSoftmax along any axis; the pre-13 flattening too.
        for op in ["Softmax", "LogSoftmax"] {
            let a = r.u(0, rank - 1) as i64;
            let c = Case::new(op, vec![r.range(&shape, -2.0, 2.0)]).attr("axis", Attr::Int(a));
            check(&c, &mut r, &mut st);
            let c = Case::new(op, vec![r.range(&shape, -2.0, 2.0)])
                .attr("axis", Attr::Int(a))
                .opset(11);
            check(&c, &mut r, &mut st);
        }
    }
    report("norm/softmax", &st);
}

#[test]
fn reductions() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(700 + seed);
        let rank = r.u(1, 4);
        let shape = r.shape(rank, 1, 4);
        let mut axes: Vec<i64> = (0..rank as i64).filter(|_| r.coin()).collect();
        if axes.is_empty() {
            axes.push(-1);
        }
        let keep = r.u(0, 1) as i64;
        // ReduceSum takes axes as an input from opset 13, the others from 18.
        let c = Case::new("ReduceSum", vec![r.t(&shape), i64s(&axes)])
            .attr("keepdims", Attr::Int(keep));
        check(&c, &mut r, &mut st);
        for op in [
            "ReduceMean",
            "ReduceSumSquare",
            "ReduceL2",
            "ReduceLogSumExp",
        ] {
            let c = Case::new(op, vec![r.t(&shape)])
                .attr("axes", ints(&axes))
                .attr("keepdims", Attr::Int(keep));
            check(&c, &mut r, &mut st);
        }
        for op in ["ReduceL1", "ReduceProd"] {
            let c = Case::new(op, vec![r.away_from_zero(&shape)])
                .attr("axes", ints(&axes))
                .attr("keepdims", Attr::Int(keep));
            check(&c, &mut r, &mut st);
        }
        let c =
            Case::new("ReduceLogSum", vec![r.range(&shape, 0.5, 2.0)]).attr("axes", ints(&axes));
        check(&c, &mut r, &mut st);
        for op in ["ReduceMax", "ReduceMin"] {
            let c = Case::new(op, vec![r.distinct(&shape)]).attr("axes", ints(&axes));
            check(&c, &mut r, &mut st);
        }
        // All axes (none given).
        check(&Case::new("ReduceMean", vec![r.t(&shape)]), &mut r, &mut st);
        let a = r.u(0, rank - 1) as i64;
        for (excl, rev) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
            let c = Case::new("CumSum", vec![r.t(&shape), Tensor::i64(vec![], vec![a])])
                .attr("exclusive", Attr::Int(excl))
                .attr("reverse", Attr::Int(rev));
            check(&c, &mut r, &mut st);
        }
    }
    report("reductions", &st);
}

#[test]
fn shape_and_data_movement() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(800 + seed);
        let rank = r.u(2, 4);
        let shape = r.shape(rank, 1, 4);
        let n: usize = shape.iter().product();
        let x = || r_t(&shape, seed);
        check(
            &Case::new("Reshape", vec![x(), i64s(&[n as i64])]),
            &mut r,
            &mut st,
        );
        check(
            &Case::new("Flatten", vec![x()]).attr("axis", Attr::Int(r.u(0, rank) as i64)),
            &mut r,
            &mut st,
        );
        let mut with1 = shape.clone();
        with1.insert(1, 1);
        check(
            &Case::new("Squeeze", vec![r.t(&with1), i64s(&[1])]),
            &mut r,
            &mut st,
        );
        check(
            &Case::new("Unsqueeze", vec![x(), i64s(&[0, -1])]),
            &mut r,
            &mut st,
        );
        check(&Case::new("Identity", vec![x()]), &mut r, &mut st);
        // A random permutation.
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        for i in (1..rank).rev() {
            let j = r.u(0, i);
            perm.swap(i, j);
        }
        check(
            &Case::new("Transpose", vec![x()]).attr("perm", ints(&perm)),
            &mut r,
            &mut st,
        );
        // Slice with steps (negative too) on two axes.
        let a = r.u(0, rank - 1);
        let d = shape[a] as i64;
        let (starts, ends, steps) = if r.coin() {
            (vec![0, 1], vec![d, 100], vec![2, 1])
        } else {
            (vec![-1, 0], vec![-100, -1], vec![-1, 1])
        };
        let b = (a + 1) % rank;
        let c = Case::new(
            "Slice",
            vec![
                x(),
                i64s(&starts),
                i64s(&ends),
                i64s(&[a as i64, b as i64]),
                i64s(&steps),
            ],
        );
        check(&c, &mut r, &mut st);
        // Concat of three along an axis; Split into three (one without gradient).
        let a = r.u(0, rank - 1);
        let parts: Vec<Tensor> = (0..3)
            .map(|_| {
                let mut s = shape.clone();
                s[a] = r.u(1, 3);
                r.t(&s)
            })
            .collect();
        check(
            &Case::new("Concat", parts).attr("axis", Attr::Int(a as i64)),
            &mut r,
            &mut st,
        );
        let mut s = shape.clone();
        s[a] = 6;
        let c = Case::new("Split", vec![r.t(&s), i64s(&[1, 2, 3])])
            .attr("axis", Attr::Int(a as i64))
            .outs(3, 2);
        check(&c, &mut r, &mut st);
        // Gather rows (repeated and negative indices) and a scalar select.
        let a = r.u(0, rank - 1);
        let d = shape[a] as i64;
        let idx = Tensor::i64(vec![2, 2], vec![0, d - 1, -1, 0]);
        check(
            &Case::new("Gather", vec![x(), idx]).attr("axis", Attr::Int(a as i64)),
            &mut r,
            &mut st,
        );
        let sel = Tensor::i64(vec![], vec![d - 1]);
        check(
            &Case::new("Gather", vec![x(), sel]).attr("axis", Attr::Int(a as i64)),
            &mut r,
            &mut st,
        );
        // GatherElements with indices shaped like the input.
        let ind: Vec<i64> = (0..n).map(|_| r.u(0, shape[a] - 1) as i64).collect();
        let c = Case::new("GatherElements", vec![x(), Tensor::i64(shape.clone(), ind)])
            .attr("axis", Attr::Int(a as i64));
        check(&c, &mut r, &mut st);
        // Expand and Tile.
        let src = broadcast_operand(&mut r, &shape);
        let target: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        check(
            &Case::new("Expand", vec![r.t(&src), i64s(&target)]),
            &mut r,
            &mut st,
        );
        let reps: Vec<i64> = (0..rank).map(|_| r.u(1, 2) as i64).collect();
        check(&Case::new("Tile", vec![x(), i64s(&reps)]), &mut r, &mut st);
        // Pad: constant, edge, reflect.
        let big: Vec<usize> = shape.iter().map(|&d| d.max(3)).collect();
        for mode in ["constant", "edge", "reflect"] {
            let pads: Vec<i64> = (0..2 * rank).map(|_| r.u(0, 2) as i64).collect();
            let c = Case::new("Pad", vec![r.t(&big), i64s(&pads)])
                .attr("mode", Attr::String(mode.into()));
            check(&c, &mut r, &mut st);
        }
        let c = Case::new(
            "Trilu",
            vec![x(), Tensor::i64(vec![], vec![r.u(0, 2) as i64 - 1])],
        )
        .attr("upper", Attr::Int(r.u(0, 1) as i64));
        check(&c, &mut r, &mut st);
    }
    report("shape ops", &st);
}

/// Fresh uniform values for `shape` (a new stream per call).
fn r_t(shape: &[usize], seed: u64) -> Tensor {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let k = CALLS.fetch_add(1, Ordering::Relaxed);
    Rng(seed.wrapping_mul(1_000_003).wrapping_add(k)).t(shape)
}

#[test]
fn kernels_refuse_unsaved_tensors() {
    // Mul's gradient of input 0 reads input 1 only: handing it just input 0 (what
    // the other gradient saves) is refused, and so is reading anything for Add.
    let a = Tensor::f32(vec![2], vec![1.0, 2.0]);
    let b = Tensor::f32(vec![2], vec![3.0, 4.0]);
    let g = Tensor::f32(vec![2], vec![1.0, 1.0]);
    let node = Node {
        name: "m".into(),
        op_type: "Mul".into(),
        domain: Default::default(),
        inputs: vec![Some(0), Some(1)].into(),
        outputs: vec![Some(2)].into(),
        attrs: Attrs::default(),
    };
    let f = Fact::new(DType::F32, vec![2]);
    let mk = |saved: Vec<(Saved, &Tensor)>| -> Result<Vec<Option<Tensor>>, RuleError> {
        let cx = BackwardCx {
            node: &node,
            inputs: smallvec::smallvec![Some(&f), Some(&f)],
            outputs: vec![Some(&f)],
            opset: 17,
            saved,
            grads: vec![Some(&g)],
            wanted: vec![0],
            dropout: true,
        };
        registry().get("", "Mul").unwrap().backward_cpu(&cx)
    };
    let err = mk(vec![(Saved::Input(0), &a)]).unwrap_err();
    assert!(matches!(err, RuleError::NotSaved(_)), "{err}");
    let ok = mk(vec![(Saved::Input(1), &b)]).unwrap();
    assert_eq!(ok[0].as_ref().unwrap().as_f32().unwrap(), &[3.0, 4.0]);
    assert!(ok[1].is_none());
    // A rule that saves too little is reported, not papered over.
    let lp = Node {
        op_type: "LpPool".into(),
        ..node.clone()
    };
    let x = Fact::new(DType::F32, vec![1, 1, 2, 2]);
    let y = Fact::new(DType::F32, vec![1, 1, 1, 1]);
    let gy = Tensor::f32(vec![1, 1, 1, 1], vec![1.0]);
    let cx = BackwardCx {
        node: &lp,
        inputs: smallvec::smallvec![Some(&x)],
        outputs: vec![Some(&y)],
        opset: 17,
        saved: vec![],
        grads: vec![Some(&gy)],
        wanted: vec![0],
        dropout: true,
    };
    let err = registry()
        .get("", "LpPool")
        .unwrap()
        .backward_cpu(&cx)
        .unwrap_err();
    assert!(err.to_string().contains("does not save"), "{err}");
}

/// Resize: every mode and coordinate transform, scales and sizes (roi and the
/// unused one empty, as exporters write them), down- and upsampling, 1-D to 3-D.
#[test]
fn resize_modes() {
    let mut st = Stats::default();
    let s = |v: &str| Attr::String(v.into());
    let empty = || Tensor::f32(vec![0], vec![]);
    let coords = [
        "half_pixel",
        "pytorch_half_pixel",
        "align_corners",
        "asymmetric",
        "half_pixel_symmetric",
    ];
    for seed in 0..SEEDS {
        let mut r = Rng(1900 + seed);
        for mode in ["nearest", "linear", "cubic"] {
            for (ci, coord) in coords.iter().enumerate() {
                // 2-D, sizes (one axis up, one down).
                let shape = vec![r.u(1, 2), r.u(1, 2), r.u(2, 5), r.u(3, 6)];
                let sizes = [
                    shape[0] as i64,
                    shape[1] as i64,
                    r.u(1, 9) as i64,
                    r.u(2, 9) as i64,
                ];
                let nearest = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"][ci % 4];
                let c = Case::new("Resize", vec![r.t(&shape), empty(), empty(), i64s(&sizes)])
                    .attr("mode", s(mode))
                    .attr("coordinate_transformation_mode", s(coord))
                    .attr("nearest_mode", s(nearest))
                    .attr("exclude_outside", Attr::Int((seed % 2) as i64))
                    .consts(&[1, 2])
                    .opset(19);
                check(&c, &mut r, &mut st);
                // Scales on the last axis only (roi omitted by an empty tensor).
                let shape = vec![r.u(1, 2), r.u(2, 4), r.u(2, 5)];
                let sc = Tensor::f32(vec![3], vec![1.0, 1.0, [0.6, 1.5, 2.0, 3.0][r.u(0, 3)]]);
                let c = Case::new("Resize", vec![r.t(&shape), empty(), sc])
                    .attr("mode", s(mode))
                    .attr("coordinate_transformation_mode", s(coord))
                    .consts(&[1, 2])
                    .opset(19);
                check(&c, &mut r, &mut st);
            }
        }
        // Trilinear, as F.interpolate(mode="trilinear") exports it.
        let shape = vec![1, r.u(1, 2), r.u(2, 3), r.u(2, 3), r.u(2, 4)];
        let sizes = [
            1,
            shape[1] as i64,
            r.u(2, 5) as i64,
            r.u(3, 5) as i64,
            r.u(2, 6) as i64,
        ];
        let c = Case::new("Resize", vec![r.t(&shape), empty(), empty(), i64s(&sizes)])
            .attr("mode", s("linear"))
            .attr("coordinate_transformation_mode", s("half_pixel"))
            .consts(&[1, 2]);
        check(&c, &mut r, &mut st);
        // Opset 10: Resize(X, scales), nearest upsampling.
        let c = Case::new(
            "Resize",
            vec![r.t(&[1, 2, 3]), Tensor::f32(vec![3], vec![1.0, 2.0, 2.0])],
        )
        .consts(&[1])
        .opset(10);
        check(&c, &mut r, &mut st);
        // Opset 18 axes with keep_aspect_ratio_policy.
        let c = Case::new(
            "Resize",
            vec![r.t(&[2, 3, 4, 5]), empty(), empty(), i64s(&[7, 7])],
        )
        .attr("mode", s("linear"))
        .attr("axes", ints(&[2, 3]))
        .attr("keep_aspect_ratio_policy", s("not_larger"))
        .consts(&[1, 2])
        .opset(18);
        check(&c, &mut r, &mut st);
    }
    report("resize", &st);
}

/// Einsum: every operand's gradient, for batched matmuls, attention scores,
/// ellipsis broadcasting (the broadcast operand's gradient summed back), diagonals
/// (scattered back), full and partial sums, implicit outputs, three operands.
#[test]
fn einsum_forms() {
    let mut st = Stats::default();
    let forms: &[(&str, &[&[usize]])] = &[
        ("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]),
        (
            "b h q d, b h k d -> b h q k",
            &[&[2, 2, 3, 4], &[2, 2, 5, 4]],
        ),
        ("...ij,...jk->...ik", &[&[2, 1, 3, 4], &[3, 4, 2]]),
        ("ii->i", &[&[4, 4]]),
        ("ij->", &[&[3, 5]]),
        ("ab,bc,cd->ad", &[&[2, 3], &[3, 4], &[4, 2]]),
        ("ij,jk", &[&[2, 3], &[3, 2]]),
        ("...ii->...i", &[&[2, 3, 3]]),
        ("bhid,ij->bhid", &[&[1, 2, 3, 2], &[3, 3]]),
        ("...ij->ij", &[&[2, 3, 2]]),
        ("ij,k->k", &[&[3, 4], &[5]]),
        ("iij,jk->ik", &[&[3, 3, 2], &[2, 4]]),
        ("bn,bn->b", &[&[3, 4], &[3, 4]]),
        ("i,j->ij", &[&[3], &[4]]),
    ];
    for seed in 0..SEEDS {
        let mut r = Rng(2100 + seed);
        for (eq, shapes) in forms {
            let ins: Vec<Tensor> = shapes.iter().map(|s| r.t(s)).collect();
            let c = Case::new("Einsum", ins).attr("equation", Attr::String(eq.to_string()));
            check(&c, &mut r, &mut st);
        }
    }
    report("einsum", &st);
}

/// GatherND: the data gradient (scatter-add of the output gradient, repeated tuples
/// adding), batch_dims 0..2, element and slice tuples, negative indices, int64 and
/// int32 indices, reading only the saved indices.
#[test]
fn gathernd_forms() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(2300 + seed);
        for b in 0..3usize {
            let rank = b + r.u(1, 3);
            let shape = r.shape(rank, 1, 4);
            let k = r.u(1, rank - b);
            let t = r.u(1, 5);
            // Indices [shape[..b], t, k], each component in [-d, d).
            let mut ishape = shape[..b].to_vec();
            ishape.extend([t, k]);
            let tuples: usize = ishape[..b + 1].iter().product();
            let mut ind = Vec::with_capacity(tuples * k);
            for _ in 0..tuples {
                for j in 0..k {
                    let d = shape[b + j] as i64;
                    ind.push(r.u(0, 2 * d as usize - 1) as i64 - d);
                }
            }
            let mut it = Tensor::i64(ishape, ind);
            if r.coin() {
                it = it.cast(DType::I32).unwrap();
            }
            let c = Case::new("GatherND", vec![r.t(&shape), it])
                .attr("batch_dims", Attr::Int(b as i64))
                .opset(if b == 0 && r.coin() { 11 } else { 13 });
            check(&c, &mut r, &mut st);
        }
        // Repeated tuples add.
        let it = Tensor::i64(vec![4, 1], vec![1, 1, -2, 0]);
        check(
            &Case::new("GatherND", vec![r.t(&[3, 2]), it]),
            &mut r,
            &mut st,
        );
    }
    report("gathernd", &st);
}

/// A grid for `x_shape` ([N, C, D1..Dr]) with `outs` points per batch element,
/// whose source coordinates `k + f` sit inside cells (fraction f in [0.15, 0.4]
/// or [0.6, 0.85]: away from the integers where the taps change and from the
/// half-integers where nearest rounds and reflection (align_corners=0) folds), k
/// from -2 to size (outside the input, so every padding mode matters). The
/// largest step ε·size/2 stays well inside those margins.
fn cell_grid(r: &mut Rng, x_shape: &[usize], outs: &[usize], align: bool) -> Tensor {
    let rank = x_shape.len() - 2;
    let mut shape = vec![x_shape[0]];
    shape.extend(outs);
    shape.push(rank);
    let pts: usize = shape[..rank + 1].iter().product();
    let mut v = Vec::with_capacity(pts * rank);
    for _ in 0..pts {
        for d in 0..rank {
            let size = x_shape[2 + rank - 1 - d] as f32;
            let k = r.u(0, size as usize + 2) as f32 - 2.0;
            let f = if r.coin() {
                r.f(0.15, 0.4)
            } else {
                r.f(0.6, 0.85)
            };
            let u = k + f;
            let g = if align {
                if size > 1.0 {
                    u * 2.0 / (size - 1.0) - 1.0
                } else {
                    f - 0.5
                }
            } else {
                (2.0 * u + 1.0) / size - 1.0
            };
            v.push(g);
        }
    }
    Tensor::f32(shape, v)
}

/// GridSample: input and grid gradients, every mode × padding × align_corners in
/// 2-D (opset 16), and linear and nearest in 3-D (opset 20), grid points inside
/// cells ([`cell_grid`]) so the sampled function is smooth at the step.
#[test]
fn gridsample_modes() {
    let mut st = Stats::default();
    let s = |v: &str| Attr::String(v.into());
    for seed in 0..SEEDS {
        let mut r = Rng(2500 + seed);
        for mode in ["bilinear", "nearest", "bicubic"] {
            for pad in ["zeros", "border", "reflection"] {
                for align in [false, true] {
                    let xs = vec![r.u(1, 2), r.u(1, 3), r.u(1, 4), r.u(2, 5)];
                    let outs = [r.u(1, 3), r.u(1, 4)];
                    let g = cell_grid(&mut r, &xs, &outs, align);
                    let c = Case::new("GridSample", vec![r.t(&xs), g])
                        .attr("mode", s(mode))
                        .attr("padding_mode", s(pad))
                        .attr("align_corners", Attr::Int(align as i64))
                        .opset(16);
                    check(&c, &mut r, &mut st);
                }
            }
        }
        for mode in ["linear", "nearest"] {
            for pad in ["zeros", "border", "reflection"] {
                let align = r.coin();
                let xs = vec![1, r.u(1, 2), r.u(2, 3), r.u(1, 3), r.u(2, 4)];
                let outs = [r.u(1, 2), r.u(1, 3), r.u(1, 3)];
                let g = cell_grid(&mut r, &xs, &outs, align);
                let c = Case::new("GridSample", vec![r.t(&xs), g])
                    .attr("mode", s(mode))
                    .attr("padding_mode", s(pad))
                    .attr("align_corners", Attr::Int(align as i64))
                    .opset(20);
                check(&c, &mut r, &mut st);
            }
        }
    }
    report("gridsample", &st);
}

/// Offsets `k + f`, `k` an integer in [-3, 2] and `f` in ±[0.15, 0.85]: sample
/// positions (integers plus offsets) reach past the image and stay off the
/// bilinear kinks by more than the step.
fn cell_offsets(r: &mut Rng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|_| r.u(0, 5) as f32 - 3.0 + r.f(0.15, 0.85))
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

/// DeformConv (groups, offset groups, strides, asymmetric pads, dilations,
/// bias and mask present or not) and RoiAlign avg (both coordinate modes and
/// opsets, fixed and adaptive sampling, spatial scales, rois partly outside):
/// every gradient, each from only what its rule saves.
#[test]
fn deform_conv_and_roi_align() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(2700 + seed);
        for extra in 0..3 {
            let (g, og) = (r.u(1, 2), r.u(1, 2));
            let c = g * og * r.u(1, 2);
            let (n, m) = (r.u(1, 2), g * r.u(1, 2));
            let (kh, kw) = (r.u(1, 3), r.u(1, 3));
            let dil = [r.u(1, 2), r.u(1, 2)];
            let (sh, sw) = (dil[0] * (kh - 1) + 1, dil[1] * (kw - 1) + 1);
            let (h, w) = (r.u(sh, sh + 3), r.u(sw, sw + 3));
            let st_ = [r.u(1, 2), r.u(1, 2)];
            let pads: Vec<i64> = (0..4).map(|_| r.u(0, 1) as i64).collect();
            let out = |i: usize, k: usize, x: usize| {
                (x + pads[i] as usize + pads[i + 2] as usize).saturating_sub(dil[i] * (k - 1) + 1)
                    / st_[i]
                    + 1
            };
            let (oh, ow) = (out(0, kh, h), out(1, kw, w));
            let mut ins = vec![
                r.t(&[n, c, h, w]),
                r.t(&[m, c / g, kh, kw]),
                cell_offsets(&mut r, &[n, og * 2 * kh * kw, oh, ow]),
            ];
            if extra > 0 {
                ins.push(r.t(&[m]));
            }
            if extra > 1 {
                ins.push(r.range(&[n, og * kh * kw, oh, ow], 0.0, 1.0));
            }
            let c = Case::new("DeformConv", ins)
                .attr("group", Attr::Int(g as i64))
                .attr("offset_group", Attr::Int(og as i64))
                .attr("strides", ints(&[st_[0] as i64, st_[1] as i64]))
                .attr("pads", Attr::Ints(pads.clone()))
                .attr("dilations", ints(&[dil[0] as i64, dil[1] as i64]))
                .opset(19);
            check(&c, &mut r, &mut st);
        }
        for (opset, mode) in [
            (10, None),
            (16, Some("half_pixel")),
            (16, Some("output_half_pixel")),
        ] {
            let (n, c, h, w) = (r.u(1, 2), r.u(1, 3), r.u(2, 6), r.u(2, 6));
            let k = r.u(1, 4);
            let scale = [1.0, 0.5, 0.75][r.u(0, 2)];
            let mut rois = Vec::new();
            for _ in 0..k {
                let (x1, y1) = (r.f(-2.0, w as f32), r.f(-2.0, h as f32));
                rois.extend([x1, y1, x1 + r.f(0.2, 6.0), y1 + r.f(0.2, 6.0)]);
            }
            let idx: Vec<i64> = (0..k).map(|_| r.u(0, n - 1) as i64).collect();
            let mut c = Case::new(
                "RoiAlign",
                vec![
                    r.t(&[n, c, h, w]),
                    Tensor::f32(vec![k, 4], rois),
                    Tensor::i64(vec![k], idx),
                ],
            )
            .attr("output_height", Attr::Int(r.u(1, 3) as i64))
            .attr("output_width", Attr::Int(r.u(1, 3) as i64))
            .attr("sampling_ratio", Attr::Int(r.u(0, 3) as i64))
            .attr("spatial_scale", Attr::Float(scale))
            .opset(opset);
            if let Some(m) = mode {
                c = c.attr("coordinate_transformation_mode", Attr::String(m.into()));
            }
            check(&c, &mut r, &mut st);
        }
    }
    report("deform_conv and roi_align", &st);
}

/// PRelu before opset 7 (old PyTorch exports): a 1-D slope of the channel count
/// applies along axis 1. The forward against the definition, the gradients
/// against finite differences.
#[test]
fn prelu_channel_slope_before_opset_7() {
    let mut st = Stats::default();
    let mut r = Rng(2700);
    let x = r.away_from_zero(&[2, 3, 4]);
    let slope = Tensor::f32(vec![3], vec![0.1, 0.5, -0.3]);
    let c = Case::new("PRelu", vec![x.clone(), slope.clone()]).opset(6);
    let node = c.node();
    let facts = c.facts();
    let rule = registry().get("", "PRelu").unwrap();
    let cx = memplan::ops::Cx {
        node: &node,
        inputs: facts.iter().map(Some).collect(),
        opset: 6,
    };
    let outs = rule.infer(&cx).unwrap();
    assert_eq!(outs[0].shape, vec![2, 3, 4]);
    let kcx = memplan::ops::KernelCx {
        node: &node,
        inputs: vec![Some(&x), Some(&slope)],
        outputs: vec![Some(&outs[0])],
        opset: 6,
        seed: 0,
        dropout: false,
        extras: false,
    };
    let y = rule.forward_cpu(&kcx).unwrap();
    let (xs, ys, sl) = (
        x.as_f32().unwrap(),
        y[0].as_f32().unwrap(),
        [0.1, 0.5, -0.3],
    );
    for (i, (&xv, &yv)) in xs.iter().zip(ys).enumerate() {
        let s = sl[(i / 4) % 3];
        assert_eq!(yv, if xv < 0.0 { xv * s } else { xv }, "element {i}");
    }
    check(&c, &mut r, &mut st);
    report("prelu (opset 6)", &st);
}

/// CumProd: every `exclusive` × `reverse`, with zeros in the input (where the
/// gradient cannot divide by the input, as PyTorch's cumprod_backward does not).
#[test]
fn cumprod_with_zeros() {
    let mut st = Stats::default();
    let mut r = Rng(2800);
    for (excl, rev) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let mut x = r.away_from_zero(&[2, 5, 3]);
        if let memplan::exec::Tensor {
            elems: memplan::numeric::Elems::F32(v),
            ..
        } = &mut x
        {
            v[4] = 0.0;
            v[20] = 0.0;
            v[23] = 0.0;
        }
        let c = Case::new("CumProd", vec![x, Tensor::i64(vec![], vec![1])])
            .attr("exclusive", Attr::Int(excl))
            .attr("reverse", Attr::Int(rev));
        check(&c, &mut r, &mut st);
    }
    report("cumprod", &st);
}

/// `SliceScatter` (what lowering writes for a box-shaped ScatterND): its gradients
/// against finite differences, with nothing saved, and its forward equal to the
/// ScatterND it replaces (indices: the box's whole grid) bit for bit.
#[test]
fn slice_scatter_is_the_scatter_of_its_box() {
    let mut st = Stats::default();
    for seed in 0..SEEDS {
        let mut r = Rng(seed);
        let rank = r.u(1, 4);
        let data = r.shape(rank, 1, 5);
        let k = r.u(1, rank);
        let mut starts = Vec::new();
        let mut upd = data.clone();
        for a in 0..k {
            let n = r.u(1, data[a]);
            starts.push(r.u(0, data[a] - n) as i64);
            upd[a] = n;
        }
        for red in ["none", "add"] {
            let (x, u) = (r.t(&data), r.t(&upd));
            let c = Case::new("SliceScatter", vec![x.clone(), u.clone()])
                .domain(memplan::ops::LOWERED_DOMAIN)
                .attr("starts", Attr::Ints(starts.clone()))
                .attr("reduction", Attr::String(red.into()));
            let out = c.infer().unwrap();
            assert!(c
                .backward_rule(&out)
                .unwrap()
                .unwrap()
                .grads
                .iter()
                .all(|g| g.needs.is_empty()));
            check(&c, &mut r, &mut st);
            // The grid: every coordinate of the box, k to a row.
            let boxn: usize = upd[..k].iter().product();
            let mut grid = Vec::with_capacity(boxn * k);
            for i in 0..boxn {
                let mut rest = i;
                let mut coord = vec![0i64; k];
                for a in (0..k).rev() {
                    coord[a] = starts[a] + (rest % upd[a]) as i64;
                    rest /= upd[a];
                }
                grid.extend(coord);
            }
            let mut gshape = upd[..k].to_vec();
            gshape.push(k);
            let s = Case::new("ScatterND", vec![x, Tensor::i64(gshape, grid), u])
                .attr("reduction", Attr::String(red.into()));
            let (sn, so) = (s.node(), s.infer().unwrap());
            let want = forward(&s, &sn, &so, &s.inputs);
            let got = forward(&c, &c.node(), &out, &c.inputs);
            assert_eq!(
                got[0].to_f32().unwrap(),
                want[0].to_f32().unwrap(),
                "{data:?} {starts:?} {upd:?}"
            );
        }
    }
    assert!(st.checks > 0);
}
