//! The CPU executor's forward pass.
//!
//! - The real-weight tiny models (mlp, cnn, transformer) against onnxruntime's
//!   outputs on the same inputs (tests/data/pytorch/forward_reference.json, written by
//!   tools/pytorch/forward_reference.py). Error metric, per output tensor: the max-norm
//!   relative error `max_i |got_i − want_i| / max(max_i |want_i|, 1e-6)`; it must be
//!   below 1e-4.
//! - Kernels with tricky semantics (convolution padding/stride/groups/dilation,
//!   softmax, layer norm, batch norm in inference and training mode, gather,
//!   reshape/transpose, slice) against naive references, through the op's own shape
//!   rule (so kernel and rule are checked to agree).
//! - Every shape-only model in models/ runs at batch 1 with seeded parameters and
//!   gives finite outputs of the inferred shapes.
// Naive references index by formula; single inputs are cloned into op input lists;
// reference constants are printed with 9 significant digits (f32 round trip).
#![allow(
    clippy::excessive_precision,
    clippy::needless_range_loop,
    clippy::cloned_ref_to_slice_refs,
    clippy::type_complexity
)]

mod common;

use std::time::Instant;

use memplan::exec::{random_input, Executor, Options, Tensor};
use memplan::infer::{infer, Bindings};
use memplan::ir::{Attr, Attrs, DType, Model, Node, Value};
use memplan::onnx::load_model;
use memplan::ops::{registry, Cx, Fact, KernelCx};
use serde_json::Value as Json;

/// `max_i |a_i − b_i| / max(max_i |b_i|, 1e-6)`.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "element counts differ");
    let scale = want.iter().fold(0f64, |m, &b| m.max((b as f64).abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale.max(1e-6)
}

fn tensor_from_json(v: &Json) -> Tensor {
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data = v["data"].as_array().unwrap();
    match v["dtype"].as_str().unwrap() {
        "float32" => Tensor::f32(
            shape,
            data.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        ),
        "int64" => Tensor::i64(shape, data.iter().map(|x| x.as_i64().unwrap()).collect()),
        other => panic!("unexpected dtype {other}"),
    }
}

fn batch(b: u64) -> Bindings {
    Bindings {
        batch: Some(b),
        ..Default::default()
    }
}

/// Sets `training_mode` 0 on every BatchNormalization (the reference's `bn_eval`).
fn batchnorm_eval(model: &mut Model) {
    let ids: Vec<_> = model.graph.order.clone();
    for ix in ids {
        let n = &mut model.graph.nodes[ix];
        if n.op_type == "BatchNormalization" {
            n.attrs.insert("training_mode", Attr::Int(0));
        }
    }
}

#[test]
fn real_weight_models_match_onnxruntime() {
    let text = std::fs::read_to_string(common::pytorch_data("forward_reference.json")).unwrap();
    let refs: Json = serde_json::from_str(&text).unwrap();
    let cases = refs["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut model = load_model(&common::shipped(case["model"].as_str().unwrap())).unwrap();
        let mut opts = Options::default();
        match case["change"].as_str().unwrap() {
            "none" => {}
            "batchnorm_eval" => batchnorm_eval(&mut model),
            "dropout_off" => opts.dropout = false,
            other => panic!("unknown change {other}"),
        }
        let inf = infer(&model, &batch(case["batch"].as_u64().unwrap())).unwrap();
        let g = &model.graph;
        let inputs: Vec<Tensor> = g
            .inputs
            .iter()
            .map(|&t| tensor_from_json(&case["inputs"][g.tensor(t).name.as_str()]))
            .collect();
        let exec = Executor::new(&model, &inf, opts).unwrap();
        let values = exec.forward_all(&inputs).unwrap();
        let outputs = exec.forward(&inputs).unwrap();
        let mut worst = 0f64;
        for (out_name, want) in case["outputs"].as_object().unwrap() {
            let t = g.tensor_id(out_name.as_str()).unwrap();
            let got = values[t].as_ref().unwrap();
            let want = tensor_from_json(want);
            assert_eq!(got.shape, want.shape, "{name} {out_name}");
            let e = rel_err(got.as_f32().unwrap(), want.as_f32().unwrap());
            eprintln!("{name}: {out_name}: max-norm relative error {e:.3e}");
            assert!(e < 1e-4, "{name} {out_name}: relative error {e:.3e}");
            worst = worst.max(e);
            if let Some(k) = g.outputs.iter().position(|&o| o == t) {
                assert_eq!(&outputs[k], got, "forward and forward_all agree");
            }
        }
        eprintln!("{name}: worst {worst:.3e}");
    }
}

// ---------------------------------------------------------------------------
// Single ops through their shape rule and kernel.

fn fact_of(t: &Tensor) -> Fact {
    let mut f = Fact::new(t.dtype(), t.shape.clone());
    if !t.dtype().is_float() && t.numel() <= 64 {
        f.value = Some(Box::new(Value::ints(t.shape.clone(), t.to_i64s())));
    }
    f
}

/// Runs one op: infers its outputs from the inputs, runs the kernel, and checks the
/// kernel's outputs against the inferred dtype and shape.
fn run_op(op: &str, attrs: &[(&str, Attr)], inputs: &[Tensor], n_out: usize) -> Vec<Tensor> {
    run_op_opts(op, attrs, inputs, n_out, true)
}

fn run_op_opts(
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: &[Tensor],
    n_out: usize,
    dropout: bool,
) -> Vec<Tensor> {
    run_op_consts(op, attrs, inputs, n_out, dropout, &[])
}

/// [`run_op_opts`] with the float inputs `consts` folded into their facts (as
/// constants, e.g. Resize's `scales`).
fn run_op_consts(
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: &[Tensor],
    n_out: usize,
    dropout: bool,
    consts: &[usize],
) -> Vec<Tensor> {
    run_op_full(op, attrs, inputs, n_out, dropout, consts, 17)
}

/// One output of `op` at `opset` (ops whose forms differ by opset).
fn run_op_opset(op: &str, attrs: &[(&str, Attr)], inputs: &[Tensor], opset: i64) -> Tensor {
    run_op_full(op, attrs, inputs, 1, true, &[], opset).remove(0)
}

fn run_op_full(
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: &[Tensor],
    n_out: usize,
    dropout: bool,
    consts: &[usize],
    opset: i64,
) -> Vec<Tensor> {
    let node = Node {
        name: format!("test_{op}").into(),
        op_type: op.into(),
        domain: Default::default(),
        inputs: (0..inputs.len()).map(Some).collect(),
        outputs: (0..n_out).map(|i| Some(100 + i)).collect(),
        attrs: Attrs::from_iter(attrs.iter().map(|(k, a)| (k.to_string(), a.clone()))),
    };
    let rule = registry().get("", op).unwrap();
    let facts: Vec<Fact> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut f = fact_of(t);
            if consts.contains(&i) {
                f.value = Some(Box::new(Value {
                    shape: t.shape.clone(),
                    data: memplan::ir::Data::Float(t.to_f64s()),
                }));
            }
            f
        })
        .collect();
    let cx = Cx {
        node: &node,
        inputs: facts.iter().map(Some).collect(),
        opset,
    };
    let out_facts = rule.infer(&cx).unwrap();
    let kcx = KernelCx {
        node: &node,
        inputs: inputs.iter().map(Some).collect(),
        outputs: out_facts.iter().take(n_out).map(Some).collect(),
        opset,
        seed: 42,
        dropout,
        extras: false,
    };
    let outs = rule.forward_cpu(&kcx).unwrap();
    for (o, f) in outs.iter().zip(&out_facts) {
        assert_eq!((o.dtype(), &o.shape), (f.dtype, &f.shape), "{op}");
    }
    outs
}

fn seq(shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * scale)
            .collect(),
    )
}

fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

fn assert_close(got: &[f32], want: &[f32], tol: f64, what: &str) {
    let e = rel_err(got, want);
    assert!(e < tol, "{what}: relative error {e:.3e}");
}

/// Direct convolution, the definition.
#[allow(clippy::too_many_arguments)]
fn naive_conv(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    group: usize,
    stride: [usize; 2],
    pads: [usize; 4],
    dil: [usize; 2],
) -> (Vec<usize>, Vec<f32>) {
    let (xs, ws) = (x.as_f32().unwrap(), w.as_f32().unwrap());
    let [n, c, h, wd] = x.shape[..] else { panic!() };
    let [m, cg, kh, kw] = w.shape[..] else {
        panic!()
    };
    let oh = (h + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) / stride[0] + 1;
    let ow = (wd + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) / stride[1] + 1;
    let mg = m / group;
    let mut y = vec![0f32; n * m * oh * ow];
    for i in 0..n {
        for o in 0..m {
            let g = o / mg;
            for p in 0..oh {
                for q in 0..ow {
                    let mut s = b.map_or(0.0, |b| b.as_f32().unwrap()[o] as f64);
                    for ci in 0..cg {
                        let ch = g * cg + ci;
                        for a in 0..kh {
                            for bb in 0..kw {
                                let ih = (p * stride[0] + a * dil[0]) as isize - pads[0] as isize;
                                let iw = (q * stride[1] + bb * dil[1]) as isize - pads[1] as isize;
                                if ih < 0 || iw < 0 || ih >= h as isize || iw >= wd as isize {
                                    continue;
                                }
                                let xv = xs[((i * c + ch) * h + ih as usize) * wd + iw as usize];
                                let wv = ws[((o * cg + ci) * kh + a) * kw + bb];
                                s += xv as f64 * wv as f64;
                            }
                        }
                    }
                    y[((i * m + o) * oh + p) * ow + q] = s as f32;
                }
            }
        }
    }
    (vec![n, m, oh, ow], y)
}

#[test]
fn conv_padding_stride_groups_dilation() {
    // (channels in, out, group, kernel, stride, pads [t, l, b, r], dilation)
    let cases: &[(
        usize,
        usize,
        usize,
        [usize; 2],
        [usize; 2],
        [usize; 4],
        [usize; 2],
    )] = &[
        (3, 4, 1, [3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
        (3, 5, 1, [3, 2], [2, 1], [0, 1, 2, 0], [1, 1]),
        (4, 6, 2, [3, 3], [1, 2], [1, 1, 1, 1], [2, 1]),
        (6, 6, 6, [3, 3], [2, 2], [1, 1, 1, 1], [1, 1]), // depthwise (mobilenet)
        (8, 4, 1, [1, 1], [1, 1], [0, 0, 0, 0], [1, 1]), // 1×1, no im2col
        (4, 4, 1, [7, 7], [2, 2], [3, 3, 3, 3], [1, 1]), // resnet stem shape
    ];
    for (k, &(c, m, g, ks, st, pads, dil)) in cases.iter().enumerate() {
        let x = seq(&[2, c, 9, 8], 0.01);
        let w = seq(&[m, c / g, ks[0], ks[1]], 0.02);
        let b = seq(&[m], 0.1);
        let attrs = [
            ("group", Attr::Int(g as i64)),
            ("strides", ints(&[st[0] as i64, st[1] as i64])),
            ("pads", ints(&pads.map(|p| p as i64))),
            ("dilations", ints(&[dil[0] as i64, dil[1] as i64])),
        ];
        let y = &run_op("Conv", &attrs, &[x.clone(), w.clone(), b.clone()], 1)[0];
        let (shape, want) = naive_conv(&x, &w, Some(&b), g, st, pads, dil);
        assert_eq!(y.shape, shape, "case {k}");
        assert_close(y.as_f32().unwrap(), &want, 1e-5, &format!("conv case {k}"));
    }
    // SAME_UPPER padding: output = ceil(in / stride).
    let x = seq(&[1, 2, 7, 7], 0.01);
    let w = seq(&[3, 2, 3, 3], 0.02);
    let y = &run_op(
        "Conv",
        &[
            ("auto_pad", Attr::String("SAME_UPPER".into())),
            ("strides", ints(&[2, 2])),
        ],
        &[x.clone(), w.clone()],
        1,
    )[0];
    let (shape, want) = naive_conv(&x, &w, None, 1, [2, 2], [1, 1, 1, 1], [1, 1]);
    assert_eq!(y.shape, shape);
    assert_close(y.as_f32().unwrap(), &want, 1e-5, "SAME_UPPER");
}

#[test]
fn max_and_average_pool() {
    let x = seq(&[1, 1, 4, 4], 1.0);
    let xs = x.as_f32().unwrap().to_vec();
    let outs = run_op(
        "MaxPool",
        &[
            ("kernel_shape", ints(&[3, 3])),
            ("strides", ints(&[2, 2])),
            ("pads", ints(&[1, 1, 1, 1])),
        ],
        &[x.clone()],
        2,
    );
    let (y, idx) = (&outs[0], outs[1].to_i64s());
    assert_eq!(y.shape, vec![1, 1, 2, 2]);
    for (k, (&v, &i)) in y.as_f32().unwrap().iter().zip(&idx).enumerate() {
        assert_eq!(v, xs[i as usize], "index {k} points at the max");
        let (p, q) = (k / 2, k % 2);
        let mut best = f32::NEG_INFINITY;
        for a in 0..3 {
            for b in 0..3 {
                let (ih, iw) = ((2 * p + a) as isize - 1, (2 * q + b) as isize - 1);
                if (0..4).contains(&ih) && (0..4).contains(&iw) {
                    best = best.max(xs[ih as usize * 4 + iw as usize]);
                }
            }
        }
        assert_eq!(v, best);
    }
    // Average with and without the padding counted.
    let ones = Tensor::f32(vec![1, 1, 2, 2], vec![1.0; 4]);
    let attrs = |inc: i64| {
        vec![
            ("kernel_shape", ints(&[2, 2])),
            ("pads", ints(&[1, 1, 1, 1])),
            ("count_include_pad", Attr::Int(inc)),
        ]
    };
    let y0 = &run_op("AveragePool", &attrs(0), &[ones.clone()], 1)[0];
    assert!(y0.as_f32().unwrap().iter().all(|&v| v == 1.0));
    let y1 = &run_op("AveragePool", &attrs(1), &[ones], 1)[0];
    assert_eq!(y1.as_f32().unwrap()[0], 0.25);
    assert_eq!(y1.as_f32().unwrap()[1], 0.5);
    assert_eq!(y1.as_f32().unwrap()[4], 1.0);
}

#[test]
fn softmax_rows_sum_to_one_and_match_definition() {
    let x = seq(&[2, 3, 5], 0.3);
    for (axis, n, inner) in [(-1i64, 5usize, 1usize), (1, 3, 5)] {
        let y = &run_op("Softmax", &[("axis", Attr::Int(axis))], &[x.clone()], 1)[0];
        let (xs, ys) = (x.as_f32().unwrap(), y.as_f32().unwrap());
        for o in 0..30 / (n * inner) {
            for i in 0..inner {
                let at = |k: usize| (o * n + k) * inner + i;
                let z: f64 = (0..n).map(|k| (xs[at(k)] as f64).exp()).sum();
                for k in 0..n {
                    let want = (xs[at(k)] as f64).exp() / z;
                    assert!((ys[at(k)] as f64 - want).abs() < 1e-6);
                }
            }
        }
        let ly = &run_op("LogSoftmax", &[("axis", Attr::Int(axis))], &[x.clone()], 1)[0];
        for (a, b) in ly.as_f32().unwrap().iter().zip(ys) {
            assert!((a.exp() - b).abs() < 1e-6);
        }
    }
    // Large logits do not overflow.
    let big = Tensor::f32(vec![1, 3], vec![1000.0, 1000.0, -1000.0]);
    let y = &run_op("Softmax", &[], &[big], 1)[0];
    assert_eq!(y.as_f32().unwrap(), &[0.5, 0.5, 0.0]);
}

#[test]
fn layer_norm_with_statistics() {
    let x = seq(&[2, 3, 4], 0.1);
    let scale = seq(&[4], 0.05);
    let bias = seq(&[4], 0.02);
    let outs = run_op(
        "LayerNormalization",
        &[("axis", Attr::Int(-1)), ("epsilon", Attr::Float(1e-5))],
        &[x.clone(), scale.clone(), bias.clone()],
        3,
    );
    assert_eq!(outs[1].shape, vec![2, 3, 1]);
    let (xs, ss, bs) = (
        x.as_f32().unwrap(),
        scale.as_f32().unwrap(),
        bias.as_f32().unwrap(),
    );
    for r in 0..6 {
        let row = &xs[r * 4..r * 4 + 4];
        let mu = row.iter().map(|&v| v as f64).sum::<f64>() / 4.0;
        let var = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / 4.0;
        let inv = 1.0 / (var + 1e-5).sqrt();
        assert!((outs[1].as_f32().unwrap()[r] as f64 - mu).abs() < 1e-6);
        assert!((outs[2].as_f32().unwrap()[r] as f64 - inv).abs() < 1e-4 * inv);
        for k in 0..4 {
            let want = (row[k] as f64 - mu) * inv * ss[k] as f64 + bs[k] as f64;
            assert!((outs[0].as_f32().unwrap()[r * 4 + k] as f64 - want).abs() < 1e-5);
        }
    }
}

#[test]
fn batch_norm_inference_and_training() {
    let x = seq(&[2, 3, 2, 2], 0.1);
    let scale = Tensor::f32(vec![3], vec![1.0, 2.0, 0.5]);
    let bias = Tensor::f32(vec![3], vec![0.0, 1.0, -1.0]);
    let mean = Tensor::f32(vec![3], vec![0.1, -0.2, 0.3]);
    let var = Tensor::f32(vec![3], vec![1.0, 4.0, 0.25]);
    let ins = [x.clone(), scale, bias, mean, var];
    let xs = x.as_f32().unwrap();
    let chan = |c: usize| -> Vec<f64> {
        (0..2)
            .flat_map(|n| xs[(n * 3 + c) * 4..(n * 3 + c) * 4 + 4].iter())
            .map(|&v| v as f64)
            .collect()
    };
    let (sc, bi, mu, va) = (
        [1.0, 2.0, 0.5],
        [0.0, 1.0, -1.0],
        [0.1, -0.2, 0.3],
        [1.0, 4.0, 0.25],
    );
    // Inference: running statistics.
    let y = &run_op(
        "BatchNormalization",
        &[("epsilon", Attr::Float(1e-5))],
        &ins,
        1,
    )[0];
    for n in 0..2 {
        for c in 0..3 {
            for k in 0..4 {
                let i = (n * 3 + c) * 4 + k;
                let want = (xs[i] as f64 - mu[c]) / (va[c] + 1e-5f64).sqrt() * sc[c] + bi[c];
                assert!((y.as_f32().unwrap()[i] as f64 - want).abs() < 1e-5);
            }
        }
    }
    // Training: batch statistics (biased variance) and updated running statistics.
    let outs = run_op(
        "BatchNormalization",
        &[
            ("epsilon", Attr::Float(1e-5)),
            ("momentum", Attr::Float(0.9)),
            ("training_mode", Attr::Int(1)),
        ],
        &ins,
        3,
    );
    for c in 0..3 {
        let v = chan(c);
        let m = v.iter().sum::<f64>() / 8.0;
        let s2 = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 8.0;
        for n in 0..2 {
            for k in 0..4 {
                let i = (n * 3 + c) * 4 + k;
                let want = (xs[i] as f64 - m) / (s2 + 1e-5).sqrt() * sc[c] + bi[c];
                assert!((outs[0].as_f32().unwrap()[i] as f64 - want).abs() < 1e-5);
            }
        }
        let rm = outs[1].as_f32().unwrap()[c] as f64;
        let rv = outs[2].as_f32().unwrap()[c] as f64;
        assert!((rm - (0.9 * mu[c] + 0.1 * m)).abs() < 1e-6);
        assert!((rv - (0.9 * va[c] + 0.1 * s2)).abs() < 1e-6);
    }
}

#[test]
fn gather_reshape_transpose_slice_concat() {
    let x = seq(&[3, 4], 1.0);
    let xs = x.as_f32().unwrap().to_vec();
    // Gather rows with a negative index, and columns along axis 1.
    let idx = Tensor::i64(vec![2], vec![2, -3]);
    let y = &run_op("Gather", &[], &[x.clone(), idx.clone()], 1)[0];
    assert_eq!(y.shape, vec![2, 4]);
    assert_eq!(&y.as_f32().unwrap()[..4], &xs[8..12]);
    assert_eq!(&y.as_f32().unwrap()[4..], &xs[0..4]);
    let y = &run_op("Gather", &[("axis", Attr::Int(1))], &[x.clone(), idx], 1)[0];
    assert_eq!(y.shape, vec![3, 2]);
    assert_eq!(y.as_f32().unwrap()[..2], [xs[2], xs[1]]);
    // Out of range is an error, not a panic.
    let rule = registry().get("", "Gather").unwrap();
    let bad = Tensor::i64(vec![1], vec![3]);
    let node = Node {
        name: "g".into(),
        op_type: "Gather".into(),
        domain: Default::default(),
        inputs: vec![Some(0), Some(1)].into(),
        outputs: vec![Some(2)].into(),
        attrs: Attrs::default(),
    };
    let f = Fact::new(DType::F32, vec![1, 4]);
    let kcx = KernelCx {
        node: &node,
        inputs: vec![Some(&x), Some(&bad)],
        outputs: vec![Some(&f)],
        opset: 17,
        seed: 0,
        dropout: true,
        extras: false,
    };
    assert!(rule
        .forward_cpu(&kcx)
        .unwrap_err()
        .to_string()
        .contains("out of range"));

    // Reshape with 0 and -1, then transpose back and forth.
    let y = &run_op(
        "Reshape",
        &[],
        &[x.clone(), Tensor::i64(vec![3], vec![0, 2, -1])],
        1,
    )[0];
    assert_eq!(y.shape, vec![3, 2, 2]);
    assert_eq!(y.as_f32().unwrap(), &xs[..]);
    let t = &run_op("Transpose", &[("perm", ints(&[2, 0, 1]))], &[y.clone()], 1)[0];
    assert_eq!(t.shape, vec![2, 3, 2]);
    // t[a][b][c] = y[b][c][a]
    for a in 0..2 {
        for b in 0..3 {
            for c in 0..2 {
                assert_eq!(
                    t.as_f32().unwrap()[(a * 3 + b) * 2 + c],
                    xs[(b * 2 + c) * 2 + a]
                );
            }
        }
    }
    let back = &run_op("Transpose", &[("perm", ints(&[1, 2, 0]))], &[t.clone()], 1)[0];
    assert_eq!(back, y);

    // Slice with a negative step, then Concat restores the order.
    let s = &run_op(
        "Slice",
        &[],
        &[
            x.clone(),
            Tensor::i64(vec![1], vec![-1]),
            Tensor::i64(vec![1], vec![i64::MIN]),
            Tensor::i64(vec![1], vec![1]),
            Tensor::i64(vec![1], vec![-2]),
        ],
        1,
    )[0];
    assert_eq!(s.shape, vec![3, 2]);
    assert_eq!(s.as_f32().unwrap()[..2], [xs[3], xs[1]]);
    let c = &run_op(
        "Concat",
        &[("axis", Attr::Int(1))],
        &[x.clone(), s.clone()],
        1,
    )[0];
    assert_eq!(c.shape, vec![3, 6]);
    assert_eq!(c.as_f32().unwrap()[4..6], [xs[3], xs[1]]);
}

#[test]
fn broadcasting_arithmetic_where_and_casts() {
    let a = seq(&[2, 3, 1], 0.5);
    let b = seq(&[4], 0.25);
    let y = &run_op("Add", &[], &[a.clone(), b.clone()], 1)[0];
    assert_eq!(y.shape, vec![2, 3, 4]);
    let (av, bv) = (a.as_f32().unwrap(), b.as_f32().unwrap());
    for i in 0..6 {
        for j in 0..4 {
            assert_eq!(y.as_f32().unwrap()[i * 4 + j], av[i] + bv[j]);
        }
    }
    let c = &run_op("Less", &[], &[a.clone(), b.clone()], 1)[0];
    let w = &run_op("Where", &[], &[c.clone(), a.clone(), b.clone()], 1)[0];
    for i in 0..6 {
        for j in 0..4 {
            assert_eq!(w.as_f32().unwrap()[i * 4 + j], av[i].min(bv[j]));
        }
    }
    // Integer Mod follows the divisor's sign (fmod 0), Div truncates.
    let p = Tensor::i64(vec![4], vec![7, -7, 7, -7]);
    let q = Tensor::i64(vec![4], vec![3, 3, -3, -3]);
    let m = &run_op("Mod", &[], &[p.clone(), q.clone()], 1)[0];
    assert_eq!(m.to_i64s(), vec![1, 2, -2, -1]);
    let d = &run_op("Div", &[], &[p, q], 1)[0];
    assert_eq!(d.to_i64s(), vec![2, -2, -2, 2]);
    // Pow by an integer exponent, Erf and Tanh against f64.
    let x = seq(&[7], 0.05);
    let three = Tensor::f32(vec![], vec![3.0]);
    let cube = &run_op("Pow", &[], &[x.clone(), three], 1)[0];
    for (c, v) in cube.as_f32().unwrap().iter().zip(x.as_f32().unwrap()) {
        assert!((c - v * v * v).abs() <= 1e-6 * v.abs().powi(3).max(1e-6));
    }
    let e = &run_op("Erf", &[], &[x.clone()], 1)[0];
    // erf(0.5) = 0.5204998778130465
    let half = Tensor::f32(vec![1], vec![0.5]);
    let eh = &run_op("Erf", &[], &[half], 1)[0];
    assert!((eh.as_f32().unwrap()[0] - 0.520_499_9).abs() < 1e-6);
    assert_eq!(e.shape, x.shape);
    let cast = &run_op(
        "Cast",
        &[("to", Attr::Int(7))],
        &[Tensor::f32(vec![2], vec![-1.5, 2.7])],
        1,
    )[0];
    assert_eq!(cast.to_i64s(), vec![-1, 2]);
}

#[test]
fn dropout_is_seeded_and_scaled() {
    let x = Tensor::f32(vec![1000], vec![1.0; 1000]);
    let ratio = Tensor::f32(vec![], vec![0.25]);
    let on = Tensor::bool(vec![], vec![true]);
    let ins = [x.clone(), ratio, on];
    let a = run_op("Dropout", &[], &ins, 2);
    let b = run_op("Dropout", &[], &ins, 2);
    assert_eq!(a, b, "same seed, same mask");
    let kept = a[0].as_f32().unwrap().iter().filter(|&&v| v != 0.0).count();
    assert!(
        (700..800).contains(&kept),
        "{kept} of 1000 kept at ratio 0.25"
    );
    assert!(a[0]
        .as_f32()
        .unwrap()
        .iter()
        .all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
    let off = run_op_opts("Dropout", &[], &ins, 2, false);
    assert_eq!(off[0], x, "dropout disabled is the identity");
}

// ---------------------------------------------------------------------------
// Shape-only models: seeded parameters, batch 1.

fn run_shape_only(name: &str) {
    let start = Instant::now();
    let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
    let inf = infer(&model, &batch(1)).unwrap();
    let exec = Executor::new(&model, &inf, Options::default()).unwrap();
    let g = &model.graph;
    let inputs: Vec<Tensor> = g
        .inputs
        .iter()
        .enumerate()
        .map(|(i, &t)| random_input(&inf.facts[t], 1 + i as u64, 1000).unwrap())
        .collect();
    let outs = exec.forward(&inputs).unwrap();
    for (&t, v) in g.outputs.iter().zip(&outs) {
        let f = &inf.facts[t];
        assert_eq!((v.dtype(), &v.shape), (f.dtype, &f.shape), "{name}");
        if f.dtype.is_float() {
            let xs = v.to_f32().unwrap();
            assert!(
                xs.iter().all(|x| x.is_finite()),
                "{name}: non-finite output"
            );
            assert!(xs.iter().any(|&x| x != 0.0), "{name}: all-zero output");
        }
    }
    eprintln!("{name}: batch 1 forward in {:.2?}", start.elapsed());
}

#[test]
fn shape_only_resnet18() {
    run_shape_only("resnet18");
}

#[test]
fn shape_only_resnet18_dynamo() {
    run_shape_only("resnet18_dynamo");
}

#[test]
fn shape_only_resnet50() {
    run_shape_only("resnet50");
}

#[test]
fn shape_only_mobilenet_v2() {
    run_shape_only("mobilenet_v2");
}

#[test]
fn shape_only_vit_b_16() {
    run_shape_only("vit_b_16");
}

#[test]
fn shape_only_bert_base() {
    run_shape_only("bert_base");
}

#[test]
fn shape_only_gpt2() {
    run_shape_only("gpt2");
}

#[test]
fn shape_only_gpt2_dynamo() {
    run_shape_only("gpt2_dynamo");
}

#[test]
fn seeded_parameters_are_deterministic() {
    let model = load_model(&common::shipped("resnet18.onnx")).unwrap();
    let inf = infer(&model, &batch(1)).unwrap();
    let a = Executor::new(&model, &inf, Options::default()).unwrap();
    let b = Executor::new(&model, &inf, Options::default()).unwrap();
    let c = Executor::new(
        &model,
        &inf,
        Options {
            seed: 1,
            ..Options::default()
        },
    )
    .unwrap();
    let t = model.graph.tensor_id("fc.weight").unwrap();
    let (pa, pb, pc) = (&a.params()[t], &b.params()[t], &c.params()[t]);
    assert_eq!(pa, pb);
    assert_ne!(pa, pc);
    let w = pa.as_ref().unwrap().as_f32().unwrap();
    let bound = 1.0 / (512f32).sqrt();
    assert!(w.iter().all(|&v| (-bound..bound).contains(&v)));
    let var = &a.params()[model.graph.tensor_id("bn1.running_var").unwrap()];
    assert!(var
        .as_ref()
        .unwrap()
        .as_f32()
        .unwrap()
        .iter()
        .all(|&v| (0.5..1.5).contains(&v)));
}

#[rustfmt::skip]
#[path = "exec_forward/depth_space.rs"]
mod depth_space;
#[path = "exec_forward/resize_ref.rs"]
mod resize_ref;

#[path = "exec_forward/resize.rs"]
mod resize;

/// `seq` with the pattern shifted by `off` (distinct operands).
fn seq_off(shape: &[usize], scale: f32, off: usize) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n)
            .map(|i| (((i + off) * 37 % 101) as f32 - 50.0) * scale)
            .collect(),
    )
}

/// Einsum against torch.einsum: expected values made by /work/venv/bin/python
/// with torch 2 (float32) on `seq_off(shape, 0.1, 7·j)` for operand j (the
/// script's description kept above each case). The TorchScript exporter keeps
/// torch's spaces in the equation, so one case has them.
#[test]
fn einsum_matches_torch() {
    #[rustfmt::skip]
    let cases: Vec<(&str, &[&[usize]], &[usize], &[f32])> = vec![
    // torch.einsum('bij,bjk->bik') of seq [[2, 3, 4], [2, 4, 2]] (operand j offset 7j): shape [2, 3, 2]
    ("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 2]], &[2, 3, 2], &[-2.29799995e+01, -1.18100004e+01, 8.98000050e+00, 4.86999989e+00, -1.36000013e+01, 3.16500015e+01, -2.46800022e+01, 5.29000044e+00, 2.13900013e+01, -1.13900013e+01, -2.74800014e+01, 6.26999998e+00]),
    // torch.einsum('b h q d, b h k d -> b h q k') of seq [[1, 2, 3, 4], [1, 2, 2, 4]] (operand j offset 7j): shape [1, 2, 3, 2]
    ("b h q d, b h k d -> b h q k", &[&[1, 2, 3, 4], &[1, 2, 2, 4]], &[1, 2, 3, 2], &[-2.08199997e+01, 4.60800018e+01, 2.19400005e+01, -1.26800003e+01, -1.71100006e+01, 3.29999924e+00, 1.99800014e+01, -1.66900005e+01, -7.99000025e+00, 3.29999924e+00, 1.85799999e+01, -1.71100025e+01]),
    // torch.einsum('...ij,...jk->...ik') of seq [[2, 1, 2, 3], [3, 3, 2]] (operand j offset 7j): shape [2, 3, 2, 2]
    ("...ij,...jk->...ik", &[&[2, 1, 2, 3], &[3, 3, 2]], &[2, 3, 2, 2], &[-1.21800003e+01, -2.66100006e+01, -1.81800003e+01, -2.15100002e+01, -1.99799995e+01, 1.60900002e+01, -1.99799995e+01, 1.70900002e+01, -2.77800026e+01, 2.14200001e+01, -2.17800026e+01, 1.83199997e+01, -2.41800022e+01, -1.64099998e+01, 1.72900009e+01, -1.20999956e+00, -1.99799995e+01, 1.80900002e+01, 7.29000044e+00, 8.98999977e+00, -1.57800007e+01, 1.52200012e+01, -2.71000028e+00, -1.81800003e+01]),
    // torch.einsum('ii->i') of seq [[4, 4]] (operand j offset 7j): shape [4]
    ("ii->i", &[&[4, 4]], &[4], &[-5.00000000e+00, 3.40000010e+00, 1.70000005e+00, 0.00000000e+00]),
    // torch.einsum('ij->') of seq [[3, 5]] (operand j offset 7j): shape []
    ("ij->", &[&[3, 5]], &[], &[-9.69999981e+00]),
    // torch.einsum('ab,bc,cd->ad') of seq [[2, 3], [3, 4], [4, 2]] (operand j offset 7j): shape [2, 2]
    ("ab,bc,cd->ad", &[&[2, 3], &[3, 4], &[4, 2]], &[2, 2], &[-5.11880035e+01, 2.93810005e+01, -1.04180012e+01, -1.18900013e+00]),
    // torch.einsum('ij,jk') of seq [[2, 3], [3, 2]] (operand j offset 7j): shape [2, 2]
    ("ij,jk", &[&[2, 3], &[3, 2]], &[2, 2], &[-1.21800003e+01, -2.66100006e+01, -1.81800003e+01, -2.15100002e+01]),
    // torch.einsum('...ii->...i') of seq [[2, 3, 3]] (operand j offset 7j): shape [2, 3]
    ("...ii->...i", &[&[2, 3, 3]], &[2, 3], &[-5.00000000e+00, -3.00000012e-01, 4.40000010e+00, -2.00000000e+00, 2.70000005e+00, -2.70000005e+00]),
    // torch.einsum('bhid,ij->bhid') of seq [[1, 2, 3, 2], [3, 3]] (operand j offset 7j): shape [1, 2, 3, 2]
    ("bhid,ij->bhid", &[&[1, 2, 3, 2], &[3, 3]], &[1, 2, 3, 2], &[-1.55000000e+01, -4.03000021e+00, -9.60000038e+00, 1.60000000e+01, 3.00000012e-01, -3.40000010e+00, -9.29999924e+00, 2.16999984e+00, -1.76000004e+01, 8.00000000e+00, -1.70000005e+00, 4.70000029e+00]),
    // torch.einsum('...ij->ij') of seq [[2, 3, 2]] (operand j offset 7j): shape [3, 2]
    ("...ij->ij", &[&[2, 3, 2]], &[3, 2], &[-8.00000000e+00, -6.00000083e-01, 6.80000019e+00, -6.00000000e+00, 1.40000010e+00, -1.30000019e+00]),
    ];
    for (eq, shapes, out, want) in cases {
        let ins: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(j, s)| seq_off(s, 0.1, 7 * j))
            .collect();
        let y = run_op("Einsum", &[("equation", Attr::String(eq.into()))], &ins, 1).remove(0);
        assert_eq!(y.shape, out.to_vec(), "{eq}");
        assert_close(y.as_f32().unwrap(), want, 1e-6, eq);
    }
}

/// A MaxViT-sized attention einsum (one block-attention stage at batch 2):
/// checked against a naive loop, and fast enough.
#[test]
fn einsum_maxvit_sized() {
    let (b, h, n, d) = (32, 2, 49, 32);
    let q = seq_off(&[b, h, n, d], 0.01, 0);
    let k = seq_off(&[b, h, n, d], 0.01, 5);
    let t = Instant::now();
    let y = run_op(
        "Einsum",
        &[(
            "equation",
            Attr::String("b h i d, b h j d -> b h i j".into()),
        )],
        &[q.clone(), k.clone()],
        1,
    )
    .remove(0);
    let secs = t.elapsed().as_secs_f64();
    let (qv, kv) = (q.as_f32().unwrap(), k.as_f32().unwrap());
    let mut want = vec![0f32; b * h * n * n];
    for bh in 0..b * h {
        for i in 0..n {
            for j in 0..n {
                let mut acc = 0f64;
                for x in 0..d {
                    acc += qv[(bh * n + i) * d + x] as f64 * kv[(bh * n + j) * d + x] as f64;
                }
                want[(bh * n + i) * n + j] = acc as f32;
            }
        }
    }
    assert_close(y.as_f32().unwrap(), &want, 1e-5, "maxvit attention");
    eprintln!("einsum [{b}, {h}, {n}, {d}] scores: {secs:.3}s");
    assert!(secs < 10.0, "{secs}s");
}

// ---------------------------------------------------------------------------
// GatherND and GridSample against PyTorch.
//
// Expected values made by /work/venv/bin/python with torch 2.15 (float32, CPU)
// by tests/data/ops/reference_gathernd_gridsample.py, which prints these
// constants (its description of each kept above it): GatherND as PyTorch's
// advanced indexing (`x[i0, i1]`, which the TorchScript exporter writes as
// GatherND; batch_dims 1 as `x[arange(B)[:, None], i..]`), GridSample as
// F.grid_sample. Inputs: `seq(shape, 0.1)` and `grid_seq(shape)`.
#[rustfmt::skip]
#[path = "exec_forward/gathernd_ref.rs"]
mod gathernd_ref;

#[test]
fn gathernd_matches_pytorch_indexing() {
    use gathernd_ref::*;
    let b = |v: i64| vec![("batch_dims", Attr::Int(v))];
    let ind = Tensor::i64(vec![5, 2], vec![2, 1, 0, 3, -1, 0, 1, -2, 2, 1]);
    let y = run_op("GatherND", &[], &[seq(&[3, 4, 2], 0.1), ind.clone()], 1).remove(0);
    assert_eq!(y.shape, vec![5, 2]);
    // A gather is exact; the script's seq rounds (k - 50) · 0.1 from f64, ours
    // multiplies in f32: an ulp apart.
    assert_close(y.as_f32().unwrap(), &GATHERND_B0, 1e-6, "batch_dims 0");
    // int32 indices give the same.
    let ind32 = ind.cast(DType::I32).unwrap();
    let y32 = run_op("GatherND", &b(0), &[seq(&[3, 4, 2], 0.1), ind32], 1).remove(0);
    assert_eq!(y32, y);
    let ind = Tensor::i64(vec![2, 3, 1], vec![2, 0, 2, 1, -1, 0]);
    let y = run_op("GatherND", &b(1), &[seq(&[2, 3, 4], 0.1), ind], 1).remove(0);
    assert_eq!(y.shape, vec![2, 3, 4]);
    assert_close(y.as_f32().unwrap(), &GATHERND_B1, 1e-6, "batch_dims 1");
    let ind = Tensor::i64(vec![2, 2, 2], vec![2, 3, 0, -1, 1, 1, -3, 2]);
    let y = run_op("GatherND", &b(1), &[seq(&[2, 3, 4], 0.1), ind], 1).remove(0);
    assert_eq!(y.shape, vec![2, 2]);
    assert_close(
        y.as_f32().unwrap(),
        &GATHERND_B1_FULL,
        1e-6,
        "batch_dims 1, full",
    );
    // Any dtype: int64 data, the ONNX spec's example 5 (batch_dims 1).
    let x = Tensor::i64(vec![2, 2, 2], (0..8).collect());
    let ind = Tensor::i64(vec![2, 1], vec![1, 0]);
    let y = run_op("GatherND", &b(1), &[x, ind], 1).remove(0);
    assert_eq!(y, Tensor::i64(vec![2, 2], vec![2, 3, 4, 5]));
}

/// `seq` as the reference script computes it: in f64, rounded once to f32.
fn seq_exact(shape: &[usize], scale: f64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n)
            .map(|i| (((i * 37 % 101) as f64 - 50.0) * scale) as f32)
            .collect(),
    )
}

/// The script's `grid(shape)`: `(i·53 mod 97) / 96 · 2.4 − 1.2` in f64, rounded
/// to f32; covers [-1.2, 1.2], so every padding mode matters.
fn grid_seq(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n)
            .map(|i| ((i * 53 % 97) as f64 / 96.0 * 2.4 - 1.2) as f32)
            .collect(),
    )
}

#[rustfmt::skip]
#[path = "exec_forward/gridsample_ref.rs"]
mod gridsample_ref;

/// GridSample against F.grid_sample: every mode × padding × align_corners, 2-D
/// (opset 16 names) and 3-D (opset 20, linear and nearest), inputs exactly the
/// script's (`seq_exact`, `grid_seq`).
#[test]
fn gridsample_matches_pytorch() {
    use gridsample_ref::*;
    let cases2: Vec<(&str, &str, i64, &[f32])> = vec![
        ("bilinear", "zeros", 0, &GS_BILINEAR_ZEROS_0[..]),
        ("bilinear", "zeros", 1, &GS_BILINEAR_ZEROS_1[..]),
        ("bilinear", "border", 0, &GS_BILINEAR_BORDER_0[..]),
        ("bilinear", "border", 1, &GS_BILINEAR_BORDER_1[..]),
        ("bilinear", "reflection", 0, &GS_BILINEAR_REFLECTION_0[..]),
        ("bilinear", "reflection", 1, &GS_BILINEAR_REFLECTION_1[..]),
        ("nearest", "zeros", 0, &GS_NEAREST_ZEROS_0[..]),
        ("nearest", "zeros", 1, &GS_NEAREST_ZEROS_1[..]),
        ("nearest", "border", 0, &GS_NEAREST_BORDER_0[..]),
        ("nearest", "border", 1, &GS_NEAREST_BORDER_1[..]),
        ("nearest", "reflection", 0, &GS_NEAREST_REFLECTION_0[..]),
        ("nearest", "reflection", 1, &GS_NEAREST_REFLECTION_1[..]),
        ("bicubic", "zeros", 0, &GS_BICUBIC_ZEROS_0[..]),
        ("bicubic", "zeros", 1, &GS_BICUBIC_ZEROS_1[..]),
        ("bicubic", "border", 0, &GS_BICUBIC_BORDER_0[..]),
        ("bicubic", "border", 1, &GS_BICUBIC_BORDER_1[..]),
        ("bicubic", "reflection", 0, &GS_BICUBIC_REFLECTION_0[..]),
        ("bicubic", "reflection", 1, &GS_BICUBIC_REFLECTION_1[..]),
    ];
    let cases3: Vec<(&str, &str, i64, &[f32])> = vec![
        ("bilinear", "zeros", 0, &GS3_BILINEAR_ZEROS_0[..]),
        ("bilinear", "zeros", 1, &GS3_BILINEAR_ZEROS_1[..]),
        ("bilinear", "border", 0, &GS3_BILINEAR_BORDER_0[..]),
        ("bilinear", "border", 1, &GS3_BILINEAR_BORDER_1[..]),
        ("bilinear", "reflection", 0, &GS3_BILINEAR_REFLECTION_0[..]),
        ("bilinear", "reflection", 1, &GS3_BILINEAR_REFLECTION_1[..]),
        ("nearest", "zeros", 0, &GS3_NEAREST_ZEROS_0[..]),
        ("nearest", "zeros", 1, &GS3_NEAREST_ZEROS_1[..]),
        ("nearest", "border", 0, &GS3_NEAREST_BORDER_0[..]),
        ("nearest", "border", 1, &GS3_NEAREST_BORDER_1[..]),
        ("nearest", "reflection", 0, &GS3_NEAREST_REFLECTION_0[..]),
        ("nearest", "reflection", 1, &GS3_NEAREST_REFLECTION_1[..]),
    ];
    let s = |v: &str| Attr::String(v.into());
    for (mode, pad, ac, want) in cases2 {
        let attrs = [
            ("mode", s(mode)),
            ("padding_mode", s(pad)),
            ("align_corners", Attr::Int(ac)),
        ];
        let ins = [seq_exact(&[2, 3, 4, 5], 0.1), grid_seq(&[2, 3, 2, 2])];
        let y = run_op("GridSample", &attrs, &ins, 1).remove(0);
        assert_eq!(y.shape, vec![2, 3, 3, 2]);
        let what = format!("2-D {mode} {pad} align_corners={ac}");
        assert_close(y.as_f32().unwrap(), want, 1e-6, &what);
    }
    for (mode, pad, ac, want) in cases3 {
        let mode = if mode == "bilinear" { "linear" } else { mode };
        let attrs = [
            ("mode", s(mode)),
            ("padding_mode", s(pad)),
            ("align_corners", Attr::Int(ac)),
        ];
        let ins = [seq_exact(&[1, 2, 3, 4, 5], 0.1), grid_seq(&[1, 2, 3, 2, 3])];
        let y = run_op_opset("GridSample", &attrs, &ins, 20);
        assert_eq!(y.shape, vec![1, 2, 2, 3, 2]);
        let what = format!("3-D {mode} {pad} align_corners={ac}");
        assert_close(y.as_f32().unwrap(), want, 1e-6, &what);
    }
}

/// Col2Im is `torch.nn.functional.fold` (values from torch 2.15): overlapping
/// blocks add up; strided blocks tile.
#[test]
fn col2im_is_fold() {
    let arange = Tensor::f32(vec![1, 4, 4], (0..16).map(|v| v as f32).collect());
    let y = run_op_opset(
        "Col2Im",
        &[],
        &[
            arange,
            Tensor::i64(vec![2], vec![3, 3]),
            Tensor::i64(vec![2], vec![2, 2]),
        ],
        18,
    );
    assert_eq!(y.shape, vec![1, 1, 3, 3]);
    let want = [0.0, 5.0, 5.0, 10.0, 30.0, 20.0, 10.0, 25.0, 15.0];
    assert_close(y.as_f32().unwrap(), &want, 1e-6, "fold 3x3 from 2x2 blocks");
    let x = Tensor::f32(vec![1, 4, 2], (0..8).map(|v| v as f32).collect());
    let y = run_op_opset(
        "Col2Im",
        &[("strides", ints(&[2, 2]))],
        &[
            x,
            Tensor::i64(vec![2], vec![2, 4]),
            Tensor::i64(vec![2], vec![2, 2]),
        ],
        18,
    );
    let want = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
    assert_close(y.as_f32().unwrap(), &want, 1e-6, "fold with stride 2");
}
