//! The CPU executor's forward pass.
//!
//! - The real-weight tiny models (mlp, cnn, transformer) against onnxruntime's
//!   outputs on the same inputs (models/forward_reference.json, written by
//!   models/forward_reference.py). Error metric, per output tensor: the max-norm
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
            n.attrs.0.insert("training_mode".into(), Attr::Int(0));
        }
    }
}

#[test]
fn real_weight_models_match_onnxruntime() {
    let text = std::fs::read_to_string(common::shipped("forward_reference.json")).unwrap();
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
            let t = g.by_name[out_name.as_str()];
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
        f.value = Some(Value::ints(t.shape.clone(), t.to_i64s()));
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
        name: format!("test_{op}"),
        op_type: op.into(),
        domain: String::new(),
        inputs: (0..inputs.len()).map(Some).collect(),
        outputs: (0..n_out).map(|i| Some(100 + i)).collect(),
        attrs: Attrs(
            attrs
                .iter()
                .map(|(k, a)| (k.to_string(), a.clone()))
                .collect(),
        ),
    };
    let rule = registry().get("", op).unwrap();
    let facts: Vec<Fact> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut f = fact_of(t);
            if consts.contains(&i) {
                f.value = Some(Value {
                    shape: t.shape.clone(),
                    data: memplan::ir::Data::Float(t.to_f64s()),
                });
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
        domain: String::new(),
        inputs: vec![Some(0), Some(1)],
        outputs: vec![Some(2)],
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
    let t = model.graph.by_name["fc.weight"];
    let (pa, pb, pc) = (&a.params()[t], &b.params()[t], &c.params()[t]);
    assert_eq!(pa, pb);
    assert_ne!(pa, pc);
    let w = pa.as_ref().unwrap().as_f32().unwrap();
    let bound = 1.0 / (512f32).sqrt();
    assert!(w.iter().all(|&v| (-bound..bound).contains(&v)));
    let var = &a.params()[model.graph.by_name["bn1.running_var"]];
    assert!(var
        .as_ref()
        .unwrap()
        .as_f32()
        .unwrap()
        .iter()
        .all(|&v| (0.5..1.5).contains(&v)));
}

// ---------------------------------------------------------------------------
// Resize against PyTorch's F.interpolate (and onnxruntime for ONNX-only forms).
//
// Expected values made by /work/venv/bin/python with torch 2 / onnxruntime (the
// script's lines, kept with each constant): input `seq(shape, 0.1)`, each call
// exported with the TorchScript exporter at opset 17 (the attributes it wrote are
// the ones used below) and run with onnxruntime, which agreed with PyTorch to the
// difference printed. The last two are ONNX forms PyTorch does not export,
// computed by onnxruntime and checked against the ONNX reference implementation.
#[rustfmt::skip]
mod resize_ref {
// nearest_scale2: input [1, 2, 3, 4] {'scale_factor': 2.0, 'mode': 'nearest'}: exporter attrs {'coordinate_transformation_mode': b'asymmetric', 'cubic_coeff_a': -0.75, 'mode': b'nearest', 'nearest_mode': b'floor'}, inputs ['x', '', '/Constant_output_0']; onnxruntime max diff 0.0e+00
pub const NEAREST_SCALE2: [f32; 96] = [-5.00000000e+00, -5.00000000e+00, -1.30000007e+00, -1.30000007e+00, 2.40000010e+00, 2.40000010e+00, -4.00000000e+00, -4.00000000e+00, -5.00000000e+00, -5.00000000e+00, -1.30000007e+00, -1.30000007e+00, 2.40000010e+00, 2.40000010e+00, -4.00000000e+00, -4.00000000e+00, -3.00000012e-01, -3.00000012e-01, 3.40000010e+00, 3.40000010e+00, -3.00000000e+00, -3.00000000e+00, 6.99999988e-01, 6.99999988e-01, -3.00000012e-01, -3.00000012e-01, 3.40000010e+00, 3.40000010e+00, -3.00000000e+00, -3.00000000e+00, 6.99999988e-01, 6.99999988e-01, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00, -2.00000000e+00, 1.70000005e+00, 1.70000005e+00, -4.70000029e+00, -4.70000029e+00, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00, -2.00000000e+00, 1.70000005e+00, 1.70000005e+00, -4.70000029e+00, -4.70000029e+00, -1.00000000e+00, -1.00000000e+00, 2.70000005e+00, 2.70000005e+00, -3.70000005e+00, -3.70000005e+00, 0.00000000e+00, 0.00000000e+00, -1.00000000e+00, -1.00000000e+00, 2.70000005e+00, 2.70000005e+00, -3.70000005e+00, -3.70000005e+00, 0.00000000e+00, 0.00000000e+00, 3.70000005e+00, 3.70000005e+00, -2.70000005e+00, -2.70000005e+00, 1.00000000e+00, 1.00000000e+00, 4.70000029e+00, 4.70000029e+00, 3.70000005e+00, 3.70000005e+00, -2.70000005e+00, -2.70000005e+00, 1.00000000e+00, 1.00000000e+00, 4.70000029e+00, 4.70000029e+00, -1.70000005e+00, -1.70000005e+00, 2.00000000e+00, 2.00000000e+00, -4.40000010e+00, -4.40000010e+00, -6.99999988e-01, -6.99999988e-01, -1.70000005e+00, -1.70000005e+00, 2.00000000e+00, 2.00000000e+00, -4.40000010e+00, -4.40000010e+00, -6.99999988e-01, -6.99999988e-01];
// nearest_sizes: input [1, 1, 3, 4] {'size': (5, 7), 'mode': 'nearest'}: exporter attrs {'coordinate_transformation_mode': b'asymmetric', 'cubic_coeff_a': -0.75, 'mode': b'nearest', 'nearest_mode': b'floor'}, inputs ['x', '', '', '/Concat_output_0']; onnxruntime max diff 0.0e+00
pub const NEAREST_SIZES: [f32; 35] = [-5.00000000e+00, -5.00000000e+00, -1.30000007e+00, -1.30000007e+00, 2.40000010e+00, 2.40000010e+00, -4.00000000e+00, -5.00000000e+00, -5.00000000e+00, -1.30000007e+00, -1.30000007e+00, 2.40000010e+00, 2.40000010e+00, -4.00000000e+00, -3.00000012e-01, -3.00000012e-01, 3.40000010e+00, 3.40000010e+00, -3.00000000e+00, -3.00000000e+00, 6.99999988e-01, -3.00000012e-01, -3.00000012e-01, 3.40000010e+00, 3.40000010e+00, -3.00000000e+00, -3.00000000e+00, 6.99999988e-01, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00, -2.00000000e+00, 1.70000005e+00, 1.70000005e+00, -4.70000029e+00];
// bilinear_half_pixel: input [1, 1, 3, 4] {'size': (5, 3), 'mode': 'bilinear', 'align_corners': False}: exporter attrs {'coordinate_transformation_mode': b'half_pixel', 'cubic_coeff_a': -0.75, 'mode': b'linear', 'nearest_mode': b'floor'}, inputs ['x', '', '', '/Concat_output_0']; onnxruntime max diff 1.7e-06
pub const BILINEAR_HALF_PIXEL: [f32; 15] = [-4.38333321e+00, 5.50000012e-01, -2.93333435e+00, -2.50333309e+00, 4.10000056e-01, -1.72666693e+00, 3.16666722e-01, 2.00000048e-01, 8.33339095e-02, 2.12666726e+00, -1.00000240e-02, -2.14666796e+00, 3.33333349e+00, -1.49999946e-01, -3.63333464e+00];
// bilinear_align_corners: input [1, 1, 3, 4] {'size': (5, 7), 'mode': 'bilinear', 'align_corners': True}: exporter attrs {'coordinate_transformation_mode': b'align_corners', 'cubic_coeff_a': -0.75, 'mode': b'linear', 'nearest_mode': b'floor'}, inputs ['x', '', '', '/Concat_output_0']; onnxruntime max diff 2.4e-07
pub const BILINEAR_ALIGN_CORNERS: [f32; 35] = [-5.00000000e+00, -3.15000010e+00, -1.30000007e+00, 5.50000012e-01, 2.40000010e+00, -7.99999952e-01, -4.00000000e+00, -2.65000010e+00, -8.00000072e-01, 1.04999995e+00, 3.75000000e-01, -2.99999952e-01, -9.74999964e-01, -1.64999998e+00, -3.00000012e-01, 1.55000007e+00, 3.40000010e+00, 2.00000048e-01, -3.00000000e+00, -1.14999998e+00, 6.99999988e-01, 2.04999995e+00, 1.37500000e+00, 7.00000048e-01, 2.50000358e-02, -6.49999976e-01, -1.32500005e+00, -2.00000024e+00, 4.40000010e+00, 1.20000005e+00, -2.00000000e+00, -1.49999976e-01, 1.70000005e+00, -1.50000012e+00, -4.70000029e+00];
// bicubic: input [1, 1, 3, 4] {'size': (5, 7), 'mode': 'bicubic', 'align_corners': False}: exporter attrs {'coordinate_transformation_mode': b'half_pixel', 'cubic_coeff_a': -0.75, 'mode': b'cubic', 'nearest_mode': b'floor'}, inputs ['x', '', '', '/Concat_output_0']; onnxruntime max diff 3.8e-06
pub const BICUBIC: [f32; 35] = [-5.81830311e+00, -4.47762203e+00, -2.17859626e+00, 1.62137556e+00, 2.71243787e+00, -1.65288782e+00, -5.18238640e+00, -3.95404983e+00, -1.94808245e+00, 7.02791631e-01, 1.01888692e+00, -1.77655101e-01, -1.24811280e+00, -1.96162534e+00, -6.67101085e-01, 1.35433805e+00, 3.48392940e+00, 1.99999407e-01, -3.08392859e+00, -9.54335809e-01, 1.06710088e+00, 3.16097665e+00, 2.12752414e+00, 6.19260371e-01, -1.07574768e-01, -6.56453550e-01, -1.72691321e+00, -2.44042754e+00, 5.58238888e+00, 2.05288696e+00, -2.31243968e+00, -1.83599472e-01, 1.94523752e+00, -2.42008805e+00, -5.94958639e+00];
// trilinear: input [1, 1, 2, 3, 2] {'size': (3, 5, 3), 'mode': 'trilinear', 'align_corners': False}: exporter attrs {'coordinate_transformation_mode': b'half_pixel', 'cubic_coeff_a': -0.75, 'mode': b'linear', 'nearest_mode': b'floor'}, inputs ['x', '', '', '/Concat_output_0']; onnxruntime max diff 2.4e-07
pub const TRILINEAR: [f32; 45] = [-5.00000000e+00, -3.15000010e+00, -1.30000007e+00, -2.03999972e+00, -2.21000004e+00, -2.38000011e+00, 2.40000010e+00, -7.99999952e-01, -4.00000000e+00, 7.79999614e-01, 6.10000372e-01, 4.40001011e-01, -3.00000012e-01, 1.55000007e+00, 3.40000010e+00, -4.00000000e+00, -2.15000010e+00, -3.00000042e-01, -1.03999972e+00, -1.20999992e+00, -1.38000011e+00, 3.40000010e+00, 2.00000048e-01, -3.00000000e+00, 1.77999973e+00, 9.49999690e-02, -1.58999979e+00, 7.00000048e-01, 2.49999762e-02, -6.50000095e-01, -3.00000000e+00, -1.14999998e+00, 6.99999988e-01, -3.99996638e-02, -2.09999889e-01, -3.80000114e-01, 4.40000010e+00, 1.20000005e+00, -2.00000000e+00, 2.77999973e+00, -4.20000434e-01, -3.62000060e+00, 1.70000005e+00, -1.50000012e+00, -4.70000029e+00];
// linear_1d: input [1, 2, 5] {'size': 8, 'mode': 'linear', 'align_corners': False}: exporter attrs {'coordinate_transformation_mode': b'half_pixel', 'cubic_coeff_a': -0.75, 'mode': b'linear', 'nearest_mode': b'floor'}, inputs ['x', '', '', '/Concat_output_0']; onnxruntime max diff 2.4e-07
pub const LINEAR_1D: [f32; 16] = [-5.00000000e+00, -3.38124990e+00, -1.06875002e+00, 1.24375010e+00, 4.00000066e-01, -3.59999990e+00, -1.91875005e+00, -3.00000012e-01, 3.40000010e+00, 6.00000024e-01, -2.76874995e+00, -4.56250012e-01, 1.85625005e+00, 4.16874981e+00, 8.00000072e-01, -2.00000000e+00];
// nearest_half_pixel: input [1, 1, 3, 4] attrs {'mode': 'nearest'} sizes [1, 1, 5, 7]: onnxruntime, ONNX reference max diff 0.0e+00
pub const NEAREST_HALF_PIXEL: [f32; 35] = [-5.00000000e+00, -5.00000000e+00, -1.30000007e+00, -1.30000007e+00, 2.40000010e+00, -4.00000000e+00, -4.00000000e+00, -5.00000000e+00, -5.00000000e+00, -1.30000007e+00, -1.30000007e+00, 2.40000010e+00, -4.00000000e+00, -4.00000000e+00, -3.00000012e-01, -3.00000012e-01, 3.40000010e+00, 3.40000010e+00, -3.00000000e+00, 6.99999988e-01, 6.99999988e-01, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00, -2.00000000e+00, 1.70000005e+00, -4.70000029e+00, -4.70000029e+00, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00, -2.00000000e+00, 1.70000005e+00, -4.70000029e+00, -4.70000029e+00];
// cubic_exclude_outside: input [1, 1, 3, 4] attrs {'mode': 'cubic', 'exclude_outside': 1, 'cubic_coeff_a': -0.5} sizes [1, 1, 5, 7]: onnxruntime, ONNX reference max diff 2.4e-06
pub const CUBIC_EXCLUDE_OUTSIDE: [f32; 35] = [-5.64822865e+00, -4.40749264e+00, -1.95928431e+00, 1.25530672e+00, 2.62044048e+00, -2.02095795e+00, -4.92287731e+00, -3.89132452e+00, -2.29648662e+00, 4.11405563e-01, 8.52751672e-01, 1.77595437e-01, -1.39445031e+00, -2.30050039e+00, -5.93510389e-01, 1.06195486e+00, 3.42913985e+00, 1.99999973e-01, -3.02914000e+00, -6.61954880e-01, 9.93509114e-01, 3.18861651e+00, 2.11008978e+00, 2.42874026e-01, -7.11755306e-02, -3.08224916e-01, -1.88027167e+00, -2.78632236e+00, 5.32287931e+00, 2.42095828e+00, -2.22044015e+00, -1.76415101e-01, 1.86760998e+00, -2.77378869e+00, -5.67570782e+00];
}

fn resize_attrs(mode: &str, coord: &str, nearest: &str) -> Vec<(&'static str, Attr)> {
    vec![
        ("mode", Attr::String(mode.into())),
        ("coordinate_transformation_mode", Attr::String(coord.into())),
        ("nearest_mode", Attr::String(nearest.into())),
        ("cubic_coeff_a", Attr::Float(-0.75)),
    ]
}

/// Resize with `sizes` (roi and scales empty tensors, as exporters write them).
fn resize_sizes(attrs: &[(&str, Attr)], x: Tensor, sizes: &[i64]) -> Tensor {
    let empty = Tensor::f32(vec![0], vec![]);
    let sizes = Tensor::i64(vec![sizes.len()], sizes.to_vec());
    run_op_consts(
        "Resize",
        attrs,
        &[x, empty.clone(), empty, sizes],
        1,
        true,
        &[1, 2],
    )
    .remove(0)
}

#[test]
fn resize_matches_pytorch_interpolate() {
    use resize_ref::*;
    // F.interpolate(scale_factor=2, mode="nearest"): scales, asymmetric + floor.
    let sc = Tensor::f32(vec![4], vec![1.0, 1.0, 2.0, 2.0]);
    let empty = Tensor::f32(vec![0], vec![]);
    let y = run_op_consts(
        "Resize",
        &resize_attrs("nearest", "asymmetric", "floor"),
        &[seq(&[1, 2, 3, 4], 0.1), empty, sc],
        1,
        true,
        &[1, 2],
    )
    .remove(0);
    assert_eq!(y.shape, vec![1, 2, 6, 8]);
    assert_eq!(
        y.as_f32().unwrap(),
        &NEAREST_SCALE2[..],
        "nearest is a gather: exact"
    );
    let near = resize_attrs("nearest", "asymmetric", "floor");
    let y = resize_sizes(&near, seq(&[1, 1, 3, 4], 0.1), &[1, 1, 5, 7]);
    assert_eq!(y.as_f32().unwrap(), &NEAREST_SIZES[..]);
    // ONNX's default nearest: half_pixel + round_prefer_floor.
    let y = resize_sizes(
        &[("mode", Attr::String("nearest".into()))],
        seq(&[1, 1, 3, 4], 0.1),
        &[1, 1, 5, 7],
    );
    assert_eq!(y.as_f32().unwrap(), &NEAREST_HALF_PIXEL[..]);
    let cases: Vec<(&str, Vec<(&str, Attr)>, Vec<usize>, Vec<i64>, &[f32])> = vec![
        (
            "bilinear half_pixel",
            resize_attrs("linear", "half_pixel", "floor"),
            vec![1, 1, 3, 4],
            vec![1, 1, 5, 3],
            &BILINEAR_HALF_PIXEL,
        ),
        // pytorch_half_pixel equals half_pixel for outputs longer than 1.
        (
            "bilinear pytorch_half_pixel",
            resize_attrs("linear", "pytorch_half_pixel", "floor"),
            vec![1, 1, 3, 4],
            vec![1, 1, 5, 3],
            &BILINEAR_HALF_PIXEL,
        ),
        (
            "bilinear align_corners",
            resize_attrs("linear", "align_corners", "floor"),
            vec![1, 1, 3, 4],
            vec![1, 1, 5, 7],
            &BILINEAR_ALIGN_CORNERS,
        ),
        (
            "bicubic",
            resize_attrs("cubic", "half_pixel", "floor"),
            vec![1, 1, 3, 4],
            vec![1, 1, 5, 7],
            &BICUBIC,
        ),
        (
            "trilinear",
            resize_attrs("linear", "half_pixel", "floor"),
            vec![1, 1, 2, 3, 2],
            vec![1, 1, 3, 5, 3],
            &TRILINEAR,
        ),
        (
            "linear 1-D",
            resize_attrs("linear", "half_pixel", "floor"),
            vec![1, 2, 5],
            vec![1, 2, 8],
            &LINEAR_1D,
        ),
        (
            "cubic exclude_outside a=-0.5",
            vec![
                ("mode", Attr::String("cubic".into())),
                ("exclude_outside", Attr::Int(1)),
                ("cubic_coeff_a", Attr::Float(-0.5)),
            ],
            vec![1, 1, 3, 4],
            vec![1, 1, 5, 7],
            &CUBIC_EXCLUDE_OUTSIDE,
        ),
    ];
    for (what, attrs, shape, sizes, want) in cases {
        let y = resize_sizes(&attrs, seq(&shape, 0.1), &sizes);
        let want_shape: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
        assert_eq!(y.shape, want_shape, "{what}");
        assert_close(y.as_f32().unwrap(), want, 2e-6, what);
    }
}

#[test]
fn resize_nearest_keeps_integer_dtypes_and_half_precision() {
    let x = Tensor::i64(vec![1, 3], vec![4, 5, 6]);
    let y = resize_sizes(&resize_attrs("nearest", "asymmetric", "floor"), x, &[1, 6]);
    assert_eq!(y, Tensor::i64(vec![1, 6], vec![4, 4, 5, 5, 6, 6]));
    let xh = seq(&[1, 1, 3, 4], 0.1).cast(DType::F16).unwrap();
    let y = resize_sizes(
        &resize_attrs("cubic", "half_pixel", "floor"),
        xh,
        &[1, 1, 5, 7],
    );
    assert_eq!(y.dtype(), DType::F16);
    assert_close(
        &y.to_f32().unwrap(),
        &resize_ref::BICUBIC,
        3e-3,
        "float16 bicubic",
    );
}

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
mod gathernd_ref {
// x[i0, i1] of seq([3, 4, 2], 0.1), indices [[2,1],[0,3],[-1,0],[1,-2],[2,1]]: shape [5, 2]
pub const GATHERND_B0: [f32; 10] = [1.00000000e+00, 4.69999981e+00, -3.00000000e+00, 6.99999988e-01, 3.70000005e+00, -2.70000005e+00, -1.00000000e+00, 2.70000005e+00, 1.00000000e+00, 4.69999981e+00];
// x[arange(2)[:, None], ind[..., 0]] of seq([2, 3, 4], 0.1), indices [[[2],[0],[2]],[[1],[-1],[0]]]: shape [2, 3, 4]
pub const GATHERND_B1: [f32; 24] = [4.40000010e+00, -2.00000000e+00, 1.70000005e+00, -4.69999981e+00, -5.00000000e+00, -1.29999995e+00, 2.40000010e+00, -4.00000000e+00, 4.40000010e+00, -2.00000000e+00, 1.70000005e+00, -4.69999981e+00, 3.70000005e+00, -2.70000005e+00, 1.00000000e+00, 4.69999981e+00, -1.70000005e+00, 2.00000000e+00, -4.40000010e+00, -6.99999988e-01, -1.00000000e+00, 2.70000005e+00, -3.70000005e+00, 0.00000000e+00];
// x[arange(2)[:, None], ind[..., 0], ind[..., 1]] of seq([2, 3, 4], 0.1), indices [[[2,3],[0,-1]],[[1,1],[-3,2]]]: shape [2, 2]
pub const GATHERND_B1_FULL: [f32; 4] = [-4.69999981e+00, -4.00000000e+00, -2.70000005e+00, -3.70000005e+00];
}

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
mod gridsample_ref {
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bilinear, padding_mode=zeros, align_corners=False): shape [2, 3, 3, 2]
pub const GS_BILINEAR_ZEROS_0: [f32; 36] = [0.00000000e+00, 7.64999926e-01, 6.15624964e-01, 2.28937531e+00, 9.44999635e-01, 2.55937666e-01, 0.00000000e+00, 2.62124968e+00, 3.09499979e+00, -9.90000308e-01, -9.78749514e-01, -4.80000317e-01, 0.00000000e+00, -1.20374990e+00, -2.44250035e+00, -8.60624850e-01, 5.06249785e-01, -2.69062668e-01, -1.19999945e-01, -3.41156268e+00, -6.75000012e-01, -1.98281264e+00, -1.08000004e+00, 2.19375134e-01, -1.92749989e+00, -1.18468750e+00, 1.00000024e-01, 1.11093748e+00, 1.57500014e-01, 4.42500144e-01, 5.25000617e-02, 2.08375001e+00, 8.75000060e-01, 3.73125052e+00, 1.39500010e+00, -2.18125090e-01];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bilinear, padding_mode=zeros, align_corners=True): shape [2, 3, 3, 2]
pub const GS_BILINEAR_ZEROS_1: [f32; 36] = [1.33874989e+00, 1.35012519e+00, -2.85624295e-01, 1.14649844e+00, 1.09724987e+00, 1.36068785e+00, 1.42499971e+00, 4.63750076e+00, 1.18374979e+00, -2.26999998e+00, -1.55924976e+00, -2.53700042e+00, -7.61249840e-01, -1.65750039e+00, -5.66250384e-01, 5.25000513e-01, 1.61699975e+00, -1.22056258e+00, 3.79750401e-01, -1.76562473e-01, 1.32499981e+00, -1.08750820e-01, -2.63025022e+00, 1.33262527e+00, -3.08724999e+00, -1.48468757e+00, -1.43499970e+00, -3.43749732e-01, 3.39750111e-01, 1.96349990e+00, -3.17500204e-01, 7.73750067e-01, 1.36000013e+00, 2.95625043e+00, 3.30975032e+00, -1.11737502e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bilinear, padding_mode=border, align_corners=False): shape [2, 3, 3, 2]
pub const GS_BILINEAR_BORDER_0: [f32; 36] = [2.12500000e+00, 1.36000001e+00, 6.15624964e-01, 2.54375029e+00, 2.10000014e+00, 1.70625007e+00, 2.90000010e+00, 4.65999985e+00, 3.09499979e+00, -1.10000038e+00, -2.17499971e+00, -3.20000005e+00, -1.37500000e+00, -2.13999987e+00, -2.44250035e+00, -9.56249774e-01, 1.12500000e+00, -1.79375005e+00, -1.99999928e-01, -3.41156268e+00, -6.75000012e-01, -2.11500001e+00, -2.88000011e+00, 1.75500011e+00, -3.21250010e+00, -1.18468750e+00, 1.00000024e-01, 1.18499994e+00, 4.20000017e-01, 3.53999949e+00, 8.75000358e-02, 2.08375001e+00, 8.75000060e-01, 3.98000050e+00, 3.72000003e+00, -1.74499989e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bilinear, padding_mode=border, align_corners=True): shape [2, 3, 3, 2]
pub const GS_BILINEAR_BORDER_1: [f32; 36] = [2.23125005e+00, 1.35012519e+00, -2.85624295e-01, 1.14649844e+00, 1.14000010e+00, 1.84500015e+00, 2.37500000e+00, 4.63750076e+00, 1.18374979e+00, -2.26999998e+00, -1.62000000e+00, -3.44000030e+00, -1.26874995e+00, -1.65750039e+00, -5.66250384e-01, 5.25000513e-01, 1.67999995e+00, -1.65499997e+00, 3.79750401e-01, -1.76562473e-01, 1.32499981e+00, -1.08750820e-01, -2.92249990e+00, 1.90375018e+00, -3.08724999e+00, -1.48468757e+00, -1.43499970e+00, -3.43749732e-01, 3.77500057e-01, 2.80499959e+00, -3.17500204e-01, 7.73750067e-01, 1.36000013e+00, 2.95625043e+00, 3.67750001e+00, -1.59624982e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bilinear, padding_mode=reflection, align_corners=False): shape [2, 3, 3, 2]
pub const GS_BILINEAR_REFLECTION_0: [f32; 36] = [2.12499905e+00, 1.36000001e+00, 6.15624964e-01, 2.54375005e+00, 2.10000014e+00, 1.70625007e+00, 2.89999938e+00, 4.65999985e+00, 3.09499979e+00, -1.09999990e+00, -2.17499971e+00, -3.20000005e+00, -1.37499952e+00, -2.13999987e+00, -2.44250035e+00, -9.56250012e-01, 1.12500000e+00, -1.79375005e+00, -1.99999928e-01, -3.41156268e+00, -6.75000012e-01, -2.11500001e+00, -2.88000011e+00, 1.75500011e+00, -3.21250010e+00, -1.18468750e+00, 1.00000024e-01, 1.18499994e+00, 4.20000017e-01, 3.53999949e+00, 8.75000358e-02, 2.08375001e+00, 8.75000060e-01, 3.98000050e+00, 3.72000003e+00, -1.74499989e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bilinear, padding_mode=reflection, align_corners=True): shape [2, 3, 3, 2]
pub const GS_BILINEAR_REFLECTION_1: [f32; 36] = [-3.28750491e-01, 1.35012519e+00, -2.85624295e-01, 1.14649844e+00, 9.76499498e-01, 1.39875031e+00, 1.07749963e+00, 4.63750076e+00, 1.18374979e+00, -2.26999998e+00, -1.55624974e+00, -1.63268816e+00, 2.11250350e-01, -1.65750039e+00, -5.66250384e-01, 5.25000513e-01, 1.59224963e+00, -1.70356250e+00, 3.79750401e-01, -1.76562473e-01, 1.32499981e+00, -1.08750820e-01, -2.28250074e+00, -1.62495319e-02, -3.08724999e+00, -1.48468757e+00, -1.43499970e+00, -3.43749732e-01, 7.50044547e-03, 1.60462499e+00, -3.17500204e-01, 7.73750067e-01, 1.36000013e+00, 2.95625043e+00, 3.30750036e+00, -4.86250073e-01];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=nearest, padding_mode=zeros, align_corners=False): shape [2, 3, 3, 2]
pub const GS_NEAREST_ZEROS_0: [f32; 36] = [0.00000000e+00, 1.70000005e+00, 0.00000000e+00, 3.70000005e+00, 0.00000000e+00, 0.00000000e+00, 0.00000000e+00, 5.00000000e+00, 3.29999995e+00, -3.09999990e+00, 0.00000000e+00, 0.00000000e+00, 0.00000000e+00, -1.79999995e+00, -3.50000000e+00, 2.00000003e-01, 0.00000000e+00, 0.00000000e+00, 2.20000005e+00, -4.19999981e+00, -5.00000000e-01, -2.20000005e+00, 0.00000000e+00, 0.00000000e+00, -4.59999990e+00, -8.99999976e-01, 2.79999995e+00, 1.10000002e+00, 0.00000000e+00, 0.00000000e+00, -1.29999995e+00, 2.40000010e+00, -4.00000000e+00, 4.40000010e+00, 0.00000000e+00, 0.00000000e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=nearest, padding_mode=zeros, align_corners=True): shape [2, 3, 3, 2]
pub const GS_NEAREST_ZEROS_1: [f32; 36] = [1.70000005e+00, 1.70000005e+00, 1.70000005e+00, 3.70000005e+00, 3.70000005e+00, 2.40000010e+00, 5.00000000e+00, 5.00000000e+00, 5.00000000e+00, -3.09999990e+00, -3.09999990e+00, -4.40000010e+00, -1.79999995e+00, -1.79999995e+00, -1.79999995e+00, 2.00000003e-01, 2.00000003e-01, -1.10000002e+00, 2.20000005e+00, -4.19999981e+00, 4.19999981e+00, -2.20000005e+00, -2.20000005e+00, 1.50000000e+00, -4.59999990e+00, -8.99999976e-01, -2.59999990e+00, 1.10000002e+00, 1.10000002e+00, 4.80000019e+00, -1.29999995e+00, 2.40000010e+00, 6.99999988e-01, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=nearest, padding_mode=border, align_corners=False): shape [2, 3, 3, 2]
pub const GS_NEAREST_BORDER_0: [f32; 36] = [1.70000005e+00, 1.70000005e+00, 0.00000000e+00, 3.70000005e+00, 3.70000005e+00, 2.40000010e+00, 5.00000000e+00, 5.00000000e+00, 3.29999995e+00, -3.09999990e+00, -3.09999990e+00, -4.40000010e+00, -1.79999995e+00, -1.79999995e+00, -3.50000000e+00, 2.00000003e-01, 2.00000003e-01, -1.10000002e+00, 2.20000005e+00, -4.19999981e+00, -5.00000000e-01, -2.20000005e+00, -2.20000005e+00, 1.50000000e+00, -4.59999990e+00, -8.99999976e-01, 2.79999995e+00, 1.10000002e+00, 1.10000002e+00, 4.80000019e+00, -1.29999995e+00, 2.40000010e+00, -4.00000000e+00, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=nearest, padding_mode=border, align_corners=True): shape [2, 3, 3, 2]
pub const GS_NEAREST_BORDER_1: [f32; 36] = [1.70000005e+00, 1.70000005e+00, 1.70000005e+00, 3.70000005e+00, 3.70000005e+00, 2.40000010e+00, 5.00000000e+00, 5.00000000e+00, 5.00000000e+00, -3.09999990e+00, -3.09999990e+00, -4.40000010e+00, -1.79999995e+00, -1.79999995e+00, -1.79999995e+00, 2.00000003e-01, 2.00000003e-01, -1.10000002e+00, 2.20000005e+00, -4.19999981e+00, 4.19999981e+00, -2.20000005e+00, -2.20000005e+00, 1.50000000e+00, -4.59999990e+00, -8.99999976e-01, -2.59999990e+00, 1.10000002e+00, 1.10000002e+00, 4.80000019e+00, -1.29999995e+00, 2.40000010e+00, 6.99999988e-01, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=nearest, padding_mode=reflection, align_corners=False): shape [2, 3, 3, 2]
pub const GS_NEAREST_REFLECTION_0: [f32; 36] = [1.70000005e+00, 1.70000005e+00, 0.00000000e+00, 3.70000005e+00, 3.70000005e+00, 2.40000010e+00, 5.00000000e+00, 5.00000000e+00, 3.29999995e+00, -3.09999990e+00, -3.09999990e+00, -4.40000010e+00, -1.79999995e+00, -1.79999995e+00, -3.50000000e+00, 2.00000003e-01, 2.00000003e-01, -1.10000002e+00, 2.20000005e+00, -4.19999981e+00, -5.00000000e-01, -2.20000005e+00, -2.20000005e+00, 1.50000000e+00, -4.59999990e+00, -8.99999976e-01, 2.79999995e+00, 1.10000002e+00, 1.10000002e+00, 4.80000019e+00, -1.29999995e+00, 2.40000010e+00, -4.00000000e+00, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=nearest, padding_mode=reflection, align_corners=True): shape [2, 3, 3, 2]
pub const GS_NEAREST_REFLECTION_1: [f32; 36] = [1.70000005e+00, 1.70000005e+00, 1.70000005e+00, 3.70000005e+00, 3.70000005e+00, 2.40000010e+00, 5.00000000e+00, 5.00000000e+00, 5.00000000e+00, -3.09999990e+00, -3.09999990e+00, -4.40000010e+00, -1.79999995e+00, -1.79999995e+00, -1.79999995e+00, 2.00000003e-01, 2.00000003e-01, -1.10000002e+00, 2.20000005e+00, -4.19999981e+00, 4.19999981e+00, -2.20000005e+00, -2.20000005e+00, 1.50000000e+00, -4.59999990e+00, -8.99999976e-01, -2.59999990e+00, 1.10000002e+00, 1.10000002e+00, 4.80000019e+00, -1.29999995e+00, 2.40000010e+00, 6.99999988e-01, 4.40000010e+00, 4.40000010e+00, -2.00000000e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bicubic, padding_mode=zeros, align_corners=False): shape [2, 3, 3, 2]
pub const GS_BICUBIC_ZEROS_0: [f32; 36] = [6.10295729e-07, 1.17634964e+00, 6.14359975e-01, 3.44810987e+00, 1.71353745e+00, 3.56035739e-01, 7.66851031e-07, 3.96637607e+00, 4.22529745e+00, -1.46034050e+00, -1.53274536e+00, -5.72011232e-01, -3.08826543e-07, -1.73125112e+00, -3.24761128e+00, -1.52392912e+00, 8.12650621e-01, -2.81594813e-01, -2.46890068e-01, -3.83061981e+00, -1.03476560e+00, -2.22040081e+00, -1.85627687e+00, 2.65353978e-01, -3.21276474e+00, -1.33925641e+00, 4.76757824e-01, 1.32098210e+00, 4.28477645e-01, 4.53778446e-01, 9.02684391e-01, 2.49302888e+00, 1.33730471e+00, 4.05109167e+00, 2.03467679e+00, -2.13836759e-01];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bicubic, padding_mode=zeros, align_corners=True): shape [2, 3, 3, 2]
pub const GS_BICUBIC_ZEROS_1: [f32; 36] = [2.58564878e+00, 1.44229925e+00, -3.04905921e-01, 1.77909625e+00, 1.45582294e+00, 2.18731236e+00, 1.99220526e+00, 5.02641869e+00, 1.73847866e+00, -2.88064981e+00, -2.60880208e+00, -3.76232767e+00, -1.18909121e+00, -1.77108657e+00, -8.42953682e-01, 4.04655218e-01, 2.49999261e+00, -1.46592045e+00, 7.81416774e-01, -3.19732666e-01, 1.70199633e+00, -1.44148603e-01, -3.93493700e+00, 2.25178766e+00, -4.25210953e+00, -2.09823847e+00, -1.73302138e+00, -6.73258424e-01, 5.90510786e-01, 2.72136140e+00, 2.72266567e-01, 1.49294245e+00, 1.98623133e+00, 4.08214998e+00, 4.61390448e+00, -1.53647482e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bicubic, padding_mode=border, align_corners=False): shape [2, 3, 3, 2]
pub const GS_BICUBIC_BORDER_0: [f32; 36] = [2.55976462e+00, 1.71750140e+00, 5.30864716e-01, 3.72614455e+00, 3.10965562e+00, 2.50866771e+00, 3.21640491e+00, 6.27231884e+00, 3.59791732e+00, -1.74206293e+00, -3.23846030e+00, -3.72678542e+00, -1.29531205e+00, -2.64653826e+00, -2.65236735e+00, -1.46285284e+00, 1.73231578e+00, -2.18870759e+00, -2.25027174e-01, -3.69442344e+00, -6.42187417e-01, -2.32294893e+00, -4.18971539e+00, 1.90490687e+00, -4.84768677e+00, -1.29682207e+00, 1.32812500e-01, 1.37679851e+00, 6.71032667e-01, 3.89361811e+00, 1.23701215e+00, 2.40875840e+00, 1.38125002e+00, 4.26339054e+00, 5.08579969e+00, -1.70856154e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bicubic, padding_mode=border, align_corners=True): shape [2, 3, 3, 2]
pub const GS_BICUBIC_BORDER_1: [f32; 36] = [3.67527199e+00, 1.38682449e+00, -5.45360446e-01, 1.36262572e+00, 1.49517930e+00, 2.78628898e+00, 3.01920700e+00, 4.85179996e+00, 1.23403096e+00, -2.56088901e+00, -2.68524098e+00, -4.67976856e+00, -1.65479529e+00, -1.70644963e+00, -4.55275893e-01, 4.18669432e-01, 2.57275820e+00, -1.93655646e+00, 7.50253141e-01, 1.69920409e-03, 1.88803339e+00, 1.28420576e-01, -4.24164867e+00, 2.80548048e+00, -4.03802538e+00, -1.84692430e+00, -1.77907085e+00, -7.72547841e-01, 6.18910849e-01, 3.59348035e+00, 2.50963509e-01, 1.24021006e+00, 1.86811650e+00, 3.55566239e+00, 5.00018549e+00, -1.95928168e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bicubic, padding_mode=reflection, align_corners=False): shape [2, 3, 3, 2]
pub const GS_BICUBIC_REFLECTION_0: [f32; 36] = [2.55976582e+00, 2.09075761e+00, 5.30864716e-01, 3.77046609e+00, 3.84237742e+00, 2.74064517e+00, 3.21640444e+00, 6.86741066e+00, 3.59791732e+00, -1.75353813e+00, -3.44827080e+00, -4.35137558e+00, -1.29530883e+00, -2.94531178e+00, -2.65236735e+00, -1.48188043e+00, 1.82862687e+00, -2.20250177e+00, -4.12611037e-01, -3.69442344e+00, -6.42187417e-01, -2.33943653e+00, -5.09257174e+00, 2.42320704e+00, -5.27033329e+00, -1.29682207e+00, 1.32812500e-01, 1.38696086e+00, 1.15741956e+00, 4.26042557e+00, 1.48724127e+00, 2.40875840e+00, 1.38125002e+00, 4.27246284e+00, 5.61213255e+00, -1.98453605e+00];
// F.grid_sample(seq([2,3,4,5],0.1), grid([2,3,2,2]), mode=bicubic, padding_mode=reflection, align_corners=True): shape [2, 3, 3, 2]
pub const GS_BICUBIC_REFLECTION_1: [f32; 36] = [2.13665605e-01, 1.59611392e+00, -6.30826727e-02, 2.27908015e+00, 1.33101273e+00, 2.21258903e+00, 1.37868321e+00, 5.07371569e+00, 1.83184385e+00, -2.73605895e+00, -2.61731553e+00, -2.70981908e+00, 5.56108177e-01, -1.83245468e+00, -9.68450725e-01, 1.86965734e-01, 2.48514724e+00, -1.93535054e+00, 6.73481345e-01, -7.64673293e-01, 1.53096902e+00, -6.48454905e-01, -3.53289652e+00, 5.03803790e-01, -4.36027956e+00, -1.94765854e+00, -1.59641898e+00, -3.56326908e-01, 1.95303559e-01, 2.21993518e+00, 4.09344137e-01, 1.57340467e+00, 1.89074731e+00, 4.02722311e+00, 4.63979053e+00, -4.68866467e-01];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=bilinear, padding_mode=zeros, align_corners=False): shape [1, 2, 2, 3, 2]
pub const GS3_BILINEAR_ZEROS_0: [f32; 24] = [0.00000000e+00, 1.68375063e+00, 4.85719085e-01, -2.69636810e-01, -6.93750024e-01, 1.12921894e+00, 1.66546965e+00, -6.13031447e-01, 7.77218878e-01, 8.62523258e-01, -5.59835911e-01, 2.27906242e-01, 0.00000000e+00, 1.48375070e+00, 3.05719018e-01, -2.90418088e-01, -8.13750029e-01, 9.29218829e-01, 1.58578217e+00, -6.53031409e-01, 6.46593869e-01, 7.17523336e-01, -6.29835844e-01, 2.03531235e-01];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=bilinear, padding_mode=zeros, align_corners=True): shape [1, 2, 2, 3, 2]
pub const GS3_BILINEAR_ZEROS_1: [f32; 24] = [1.34090614e+00, -6.70935363e-02, -1.24505031e+00, -2.08379507e+00, -1.84859407e+00, 2.61000395e-01, 2.99843764e+00, -2.60341883e+00, 1.66605020e+00, 1.23517191e+00, -1.07054663e+00, 1.62599993e+00, 1.22090602e+00, -2.67093569e-01, -1.44505048e+00, -2.24054527e+00, -2.04859376e+00, 6.10003471e-02, 2.80843782e+00, -2.75841880e+00, 1.46605027e+00, 1.03517199e+00, -1.24804664e+00, 1.47599995e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=bilinear, padding_mode=border, align_corners=False): shape [1, 2, 2, 3, 2]
pub const GS3_BILINEAR_BORDER_0: [f32; 24] = [2.12500000e+00, 1.68375063e+00, 5.39687753e-01, -2.59500003e+00, -1.15625000e+00, 1.12921894e+00, 4.18000031e+00, -3.06515646e+00, 1.19000006e+00, 1.18968737e+00, -1.59953141e+00, 1.86999989e+00, 1.92499995e+00, 1.48375070e+00, 3.39687824e-01, -2.79500008e+00, -1.35624993e+00, 9.29218829e-01, 3.98000050e+00, -3.26515651e+00, 9.90000069e-01, 9.89687443e-01, -1.79953158e+00, 1.66999984e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=bilinear, padding_mode=border, align_corners=True): shape [1, 2, 2, 3, 2]
pub const GS3_BILINEAR_BORDER_1: [f32; 24] = [2.23484397e+00, -6.70935363e-02, -1.24505031e+00, -2.65875006e+00, -1.84859407e+00, 2.61000395e-01, 3.15625024e+00, -3.35925031e+00, 1.66605020e+00, 1.23517191e+00, -1.20624995e+00, 2.16800022e+00, 2.03484392e+00, -2.67093569e-01, -1.44505048e+00, -2.85875034e+00, -2.04859376e+00, 6.10003471e-02, 2.95625043e+00, -3.55924988e+00, 1.46605027e+00, 1.03517199e+00, -1.40624988e+00, 1.96800005e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=bilinear, padding_mode=reflection, align_corners=False): shape [1, 2, 2, 3, 2]
pub const GS3_BILINEAR_REFLECTION_0: [f32; 24] = [2.12499905e+00, 1.68375063e+00, 5.39687753e-01, -2.59500003e+00, -1.15625000e+00, 1.12921894e+00, 4.18000031e+00, -3.06515646e+00, 1.19000006e+00, 1.18968737e+00, -1.59953141e+00, 1.86999989e+00, 1.92499900e+00, 1.48375070e+00, 3.39687824e-01, -2.79500008e+00, -1.35624993e+00, 9.29218829e-01, 3.98000050e+00, -3.26515651e+00, 9.90000069e-01, 9.89687443e-01, -1.79953158e+00, 1.66999984e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=bilinear, padding_mode=reflection, align_corners=True): shape [1, 2, 2, 3, 2]
pub const GS3_BILINEAR_REFLECTION_1: [f32; 24] = [-2.93594211e-01, -6.70935363e-02, -1.24505031e+00, -1.84962440e+00, -1.84859407e+00, 2.61000395e-01, 2.99125004e+00, -2.01465034e+00, 1.66605020e+00, 1.23517191e+00, -1.02920282e+00, 6.18499935e-01, -4.93594348e-01, -2.67093569e-01, -1.44505048e+00, -2.04962444e+00, -2.04859376e+00, 6.10003471e-02, 2.79125047e+00, -2.21465015e+00, 1.46605027e+00, 1.03517199e+00, -1.22920287e+00, 4.18500006e-01];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=nearest, padding_mode=zeros, align_corners=False): shape [1, 2, 2, 3, 2]
pub const GS3_NEAREST_ZEROS_0: [f32; 24] = [0.00000000e+00, 2.59999990e+00, -3.09999990e+00, 0.00000000e+00, -1.10000002e+00, 0.00000000e+00, 0.00000000e+00, 0.00000000e+00, 1.70000005e+00, 4.59999990e+00, 0.00000000e+00, 0.00000000e+00, 0.00000000e+00, 2.40000010e+00, -3.29999995e+00, 0.00000000e+00, -1.29999995e+00, -2.00000003e-01, 0.00000000e+00, 0.00000000e+00, 1.50000000e+00, 4.40000010e+00, 0.00000000e+00, 0.00000000e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=nearest, padding_mode=zeros, align_corners=True): shape [1, 2, 2, 3, 2]
pub const GS3_NEAREST_ZEROS_1: [f32; 24] = [1.70000005e+00, 2.59999990e+00, -3.09999990e+00, -2.00000000e+00, -4.40000010e+00, -4.69999981e+00, 4.59999990e+00, -4.40000010e+00, 1.70000005e+00, 8.99999976e-01, 6.00000024e-01, 1.70000005e+00, 1.50000000e+00, 2.40000010e+00, -3.29999995e+00, -2.20000005e+00, -4.59999990e+00, -4.90000010e+00, 4.40000010e+00, -4.59999990e+00, 1.50000000e+00, 6.99999988e-01, 4.00000006e-01, 1.50000000e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=nearest, padding_mode=border, align_corners=False): shape [1, 2, 2, 3, 2]
pub const GS3_NEAREST_BORDER_0: [f32; 24] = [1.70000005e+00, 2.59999990e+00, -3.09999990e+00, -2.00000000e+00, -1.10000002e+00, 0.00000000e+00, 4.59999990e+00, -4.40000010e+00, 1.70000005e+00, 4.59999990e+00, -3.09999990e+00, 1.70000005e+00, 1.50000000e+00, 2.40000010e+00, -3.29999995e+00, -2.20000005e+00, -1.29999995e+00, -2.00000003e-01, 4.40000010e+00, -4.59999990e+00, 1.50000000e+00, 4.40000010e+00, -3.29999995e+00, 1.50000000e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=nearest, padding_mode=border, align_corners=True): shape [1, 2, 2, 3, 2]
pub const GS3_NEAREST_BORDER_1: [f32; 24] = [1.70000005e+00, 2.59999990e+00, -3.09999990e+00, -2.00000000e+00, -4.40000010e+00, -4.69999981e+00, 4.59999990e+00, -4.40000010e+00, 1.70000005e+00, 8.99999976e-01, 6.00000024e-01, 1.70000005e+00, 1.50000000e+00, 2.40000010e+00, -3.29999995e+00, -2.20000005e+00, -4.59999990e+00, -4.90000010e+00, 4.40000010e+00, -4.59999990e+00, 1.50000000e+00, 6.99999988e-01, 4.00000006e-01, 1.50000000e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=nearest, padding_mode=reflection, align_corners=False): shape [1, 2, 2, 3, 2]
pub const GS3_NEAREST_REFLECTION_0: [f32; 24] = [1.70000005e+00, 2.59999990e+00, -3.09999990e+00, -2.00000000e+00, -1.10000002e+00, 0.00000000e+00, 4.59999990e+00, -4.40000010e+00, 1.70000005e+00, 4.59999990e+00, -3.09999990e+00, 1.70000005e+00, 1.50000000e+00, 2.40000010e+00, -3.29999995e+00, -2.20000005e+00, -1.29999995e+00, -2.00000003e-01, 4.40000010e+00, -4.59999990e+00, 1.50000000e+00, 4.40000010e+00, -3.29999995e+00, 1.50000000e+00];
// F.grid_sample(seq([1,2,3,4,5],0.1), grid([1,2,3,2,3]), mode=nearest, padding_mode=reflection, align_corners=True): shape [1, 2, 2, 3, 2]
pub const GS3_NEAREST_REFLECTION_1: [f32; 24] = [1.70000005e+00, 2.59999990e+00, -3.09999990e+00, -2.00000000e+00, -4.40000010e+00, -4.69999981e+00, 4.59999990e+00, -4.40000010e+00, 1.70000005e+00, 8.99999976e-01, 6.00000024e-01, 1.70000005e+00, 1.50000000e+00, 2.40000010e+00, -3.29999995e+00, -2.20000005e+00, -4.59999990e+00, -4.90000010e+00, 4.40000010e+00, -4.59999990e+00, 1.50000000e+00, 6.99999988e-01, 4.00000006e-01, 1.50000000e+00];
}

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
