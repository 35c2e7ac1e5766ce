//! 3-D (video) convolution and pooling on the CPU, against PyTorch.
//!
//! - Conv (groups, strides, dilations, asymmetric pads, bias), MaxPool (dilations,
//!   `ceil_mode`, both index orders), AveragePool (`ceil_mode`, both
//!   `count_include_pad`), LpPool and training-mode BatchNormalization on
//!   `[N, C, D, H, W]`: forward values and the gradients of `sum(y · g)` against
//!   torch 2.15's (`g` = `wave` below; tests/window3d/reference.rs, written by
//!   tests/data/ops/reference_window3d.py on the same inputs, `perm` below).
//! - A planar window is the 3-D window with a depth of 1: Conv, MaxPool and
//!   AveragePool on `[N, C, H, W]` and on `[N, C, 1, H, W]` give the same bits,
//!   forward and backward.
//! - GlobalAveragePool and GlobalMaxPool on 5-D input against naive sums.
//! - Finite differences of 3-D Conv, MaxPool and AveragePool are the registry's
//!   rows (tests/op_registry/window3d.rs).
// Reference constants are printed with 9 significant digits (f32 round trip).
#![allow(clippy::type_complexity, clippy::excessive_precision)]

mod common;

use common::opcase::{forward, forward_backward, ints, Case};
use memplan::exec::Tensor;
use memplan::ir::Attr;

#[rustfmt::skip]
#[path = "window3d/reference.rs"]
mod reference;
use reference::*;

/// `((i · 1000003) mod n − n/2) · scale` over the row-major index: distinct values,
/// exact in f32 (the script's `perm`).
fn perm(shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i * 1_000_003 % n) as f32 - (n / 2) as f32) * scale)
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

/// `((i · 37) mod 101 − 50) · scale`: the upstream gradients (the script's `wave`).
fn wave(shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * scale)
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

/// `|got − want| ≤ tol · max|want| + 1e-6` everywhere.
fn assert_close(got: &Tensor, want: &[f32], shape: &[usize], tol: f32, what: &str) {
    assert_eq!(got.shape, shape, "{what}: shape");
    let got = got.as_f32().unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (&a, &b)| m.max((a - b).abs()));
    eprintln!(
        "{what}: max |Δ| / max |want| = {:.2e}",
        worst / scale.max(1e-12)
    );
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * scale + 1e-6,
            "{what}: element {i}: {a} vs PyTorch's {b}"
        );
    }
}

/// The forward with extras (declared outputs, then the rule's extras) and the
/// backward of `sum(y₀ · g)` for every float input the rule differentiates, given
/// only the tensors the rule saves. Returns the outputs and one gradient per input.
fn run(case: &Case, g: &Tensor) -> (Vec<Tensor>, Vec<Option<Tensor>>) {
    let out_facts = case.infer().unwrap();
    let bw = case.backward_rule(&out_facts).unwrap().unwrap();
    let wanted: Vec<usize> = bw
        .grads
        .iter()
        .map(|g| g.input)
        .filter(|&i| i < case.inputs.len() && case.inputs[i].dtype().is_float())
        .collect();
    forward_backward(case, std::slice::from_ref(g), &wanted).unwrap()
}

#[test]
fn conv3d_matches_pytorch() {
    let ins = vec![
        perm(&[2, 4, 5, 6, 5], 1.0 / 16.0),
        perm(&[6, 2, 3, 2, 3], 1.0 / 64.0),
        perm(&[6], 1.0 / 8.0),
    ];
    let case = Case::new("Conv", ins)
        .attr("group", Attr::Int(2))
        .attr("strides", ints(&[2, 1, 2]))
        .attr("dilations", ints(&[1, 2, 1]))
        .attr("pads", ints(&[1, 0, 2, 0, 1, 1]));
    let out = [2, 6, 2, 5, 3];
    let (outs, grads) = run(&case, &wave(&out, 1.0 / 32.0));
    assert_close(&outs[0], &CONV3D, &out, 1e-5, "Conv3d");
    let dx = grads[0].as_ref().unwrap();
    assert_close(dx, &CONV3D_DX, &[2, 4, 5, 6, 5], 1e-5, "Conv3d dx");
    let dw = grads[1].as_ref().unwrap();
    assert_close(dw, &CONV3D_DW, &[6, 2, 3, 2, 3], 1e-5, "Conv3d dw");
    let db = grads[2].as_ref().unwrap();
    assert_close(db, &CONV3D_DB, &[6], 1e-5, "Conv3d db");
}

/// SAME_UPPER on a 3-D Conv pads as the explicit pads it stands for.
#[test]
fn conv3d_auto_pad_is_its_pads() {
    let ins = vec![
        perm(&[1, 2, 4, 5, 3], 1.0 / 16.0),
        perm(&[3, 2, 2, 3, 2], 1.0 / 64.0),
    ];
    let same = Case::new("Conv", ins.clone())
        .attr("strides", ints(&[2, 2, 1]))
        .attr("auto_pad", Attr::String("SAME_UPPER".into()));
    // Out (2, 3, 3): total pads (1·2 + 2 − 4, 2·2 + 3 − 5, 2·1 + 2 − 3) = (0, 2, 1),
    // the odd one's extra at the end.
    let explicit = Case::new("Conv", ins)
        .attr("strides", ints(&[2, 2, 1]))
        .attr("pads", ints(&[0, 1, 0, 0, 1, 1]));
    let g = wave(&[1, 3, 2, 3, 3], 1.0 / 32.0);
    let (a, da) = run(&same, &g);
    let (b, db) = run(&explicit, &g);
    assert_eq!(a[0].shape, vec![1, 3, 2, 3, 3]);
    assert_eq!(a[0], b[0]);
    assert_eq!(da, db);
}

#[test]
fn maxpool3d_matches_pytorch() {
    let shape = [2, 3, 5, 6, 7];
    let out = [2, 3, 3, 4, 5];
    let base = Case::new("MaxPool", vec![perm(&shape, 1.0 / 16.0)])
        .attr("kernel_shape", ints(&[2, 3, 2]))
        .attr("strides", ints(&[2, 2, 1]))
        .attr("pads", ints(&[1, 1, 0, 1, 1, 0]))
        .attr("dilations", ints(&[1, 1, 2]))
        .attr("ceil_mode", Attr::Int(1))
        .outs(2, 1);
    let (outs, grads) = run(&base, &wave(&out, 1.0 / 32.0));
    assert_close(&outs[0], &MAXPOOL3D, &out, 0.0, "MaxPool3d");
    assert_close(
        grads[0].as_ref().unwrap(),
        &MAXPOOL3D_DX,
        &shape,
        0.0,
        "MaxPool3d dx",
    );
    // ONNX's indices run over the whole input: PyTorch's per-channel offset plus
    // the channel's start; `storage_order` 1 reads each channel column-major.
    let vol = 5 * 6 * 7;
    let per = out[2..].iter().product::<usize>();
    let row_major: Vec<i64> = MAXPOOL3D_INDICES
        .iter()
        .enumerate()
        .map(|(k, &i)| i + (k / per * vol) as i64)
        .collect();
    assert_eq!(outs[1].to_i64s(), row_major, "MaxPool3d indices");
    // The backward's saved indices are the row-major ones.
    assert_eq!(outs[2].to_i64s(), row_major, "MaxPool3d saved indices");
    let col_major: Vec<i64> = MAXPOOL3D_INDICES
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let (z, y, x) = (i / 42, i / 7 % 6, i % 7);
            (k / per * vol) as i64 + z + y * 5 + x * 30
        })
        .collect();
    let mut col = base;
    col.attrs.push(("storage_order", Attr::Int(1)));
    let (outs, _) = run(&col, &wave(&out, 1.0 / 32.0));
    assert_eq!(outs[1].to_i64s(), col_major, "storage_order 1");
}

#[test]
fn avgpool3d_matches_pytorch() {
    let shape = [1, 3, 6, 6, 8];
    let out = [1, 3, 4, 4, 5];
    let cases: [(i64, &[f32], &[f32]); 2] = [
        (0, &AVGPOOL3D_PAD0, &AVGPOOL3D_PAD0_DX),
        (1, &AVGPOOL3D_PAD1, &AVGPOOL3D_PAD1_DX),
    ];
    for (include, want, want_dx) in cases {
        let case = Case::new("AveragePool", vec![perm(&shape, 1.0 / 16.0)])
            .attr("kernel_shape", ints(&[3, 2, 3]))
            .attr("strides", ints(&[2, 2, 2]))
            .attr("pads", ints(&[1, 1, 1, 1, 1, 1]))
            .attr("ceil_mode", Attr::Int(1))
            .attr("count_include_pad", Attr::Int(include));
        let (outs, grads) = run(&case, &wave(&out, 1.0 / 32.0));
        let what = format!("AvgPool3d count_include_pad={include}");
        assert_close(&outs[0], want, &out, 1e-6, &what);
        let dx = grads[0].as_ref().unwrap();
        assert_close(dx, want_dx, &shape, 1e-6, &format!("{what} dx"));
    }
}

#[test]
fn lppool3d_matches_pytorch() {
    let case = Case::new("LpPool", vec![perm(&[1, 2, 4, 5, 6], 1.0 / 16.0)])
        .attr("kernel_shape", ints(&[2, 3, 2]))
        .attr("strides", ints(&[2, 1, 2]))
        .attr("p", Attr::Int(2));
    let out_facts = case.infer().unwrap();
    let y = forward(&case, &case.node(), &out_facts, &case.inputs).remove(0);
    assert_close(&y, &LPPOOL3D, &[1, 2, 2, 3, 3], 1e-5, "LpPool3d");
}

#[test]
fn batchnorm_5d_matches_pytorch() {
    let s: Vec<f32> = perm(&[3], 0.25)
        .as_f32()
        .unwrap()
        .iter()
        .map(|v| v + 1.0)
        .collect();
    let ins = vec![
        perm(&[2, 3, 2, 3, 4], 1.0 / 16.0),
        Tensor::f32(vec![3], s),
        perm(&[3], 1.0 / 8.0),
        Tensor::f32(vec![3], vec![0.0; 3]),
        Tensor::f32(vec![3], vec![1.0; 3]),
    ];
    let case = Case::new("BatchNormalization", ins)
        .attr("epsilon", Attr::Float(1e-5))
        .attr("training_mode", Attr::Int(1))
        .opset(15);
    let shape = [2, 3, 2, 3, 4];
    let (outs, grads) = run(&case, &wave(&shape, 1.0 / 32.0));
    assert_close(&outs[0], &BATCHNORM5D, &shape, 1e-5, "BatchNorm 5-D");
    let dx = grads[0].as_ref().unwrap();
    assert_close(dx, &BATCHNORM5D_DX, &shape, 1e-5, "BatchNorm 5-D dx");
}

/// A 2-D window is the 3-D one with a depth of 1: the same bits, forward and
/// backward, for Conv (groups, strides, dilations, pads, bias), MaxPool and
/// AveragePool (ceil_mode, count_include_pad).
#[test]
fn planar_windows_are_3d_windows_of_depth_one() {
    let deep = |t: &Tensor| {
        let mut s = t.shape.clone();
        s.insert(2, 1);
        Tensor::f32(s, t.as_f32().unwrap().to_vec())
    };
    let x = perm(&[2, 4, 7, 6], 1.0 / 16.0);
    let w = perm(&[6, 2, 3, 2], 1.0 / 64.0);
    let b = perm(&[6], 1.0 / 8.0);
    let conv = |x: Tensor, w: Tensor, three: bool| {
        let l = |a: &[i64], lead: i64| -> Attr {
            ints(&if three {
                [&[lead], a].concat()
            } else {
                a.to_vec()
            })
        };
        let pads = if three {
            vec![0, 1, 0, 0, 2, 1]
        } else {
            vec![1, 0, 2, 1]
        };
        Case::new("Conv", vec![x, w, b.clone()])
            .attr("group", Attr::Int(2))
            .attr("strides", l(&[2, 1], 1))
            .attr("dilations", l(&[1, 2], 1))
            .attr("pads", ints(&pads))
    };
    let pool = |op: &'static str, x: Tensor, three: bool| {
        let l = |a: &[i64], lead: i64| -> Attr {
            ints(&if three {
                [&[lead], a].concat()
            } else {
                a.to_vec()
            })
        };
        let pads = if three {
            vec![0, 1, 1, 0, 1, 1]
        } else {
            vec![1, 1, 1, 1]
        };
        let c = Case::new(op, vec![x])
            .attr("kernel_shape", l(&[3, 2], 1))
            .attr("strides", l(&[2, 2], 1))
            .attr("pads", ints(&pads))
            .attr("ceil_mode", Attr::Int(1));
        match op {
            "MaxPool" => c.outs(2, 1),
            _ => c.attr("count_include_pad", Attr::Int(1)),
        }
    };
    let pairs: Vec<(Case, Case)> = vec![
        (
            conv(x.clone(), w.clone(), false),
            conv(deep(&x), deep(&w), true),
        ),
        (
            pool("MaxPool", x.clone(), false),
            pool("MaxPool", deep(&x), true),
        ),
        (
            pool("AveragePool", x.clone(), false),
            pool("AveragePool", deep(&x), true),
        ),
    ];
    for (flat, three) in pairs {
        let out = flat.infer().unwrap()[0].shape.clone();
        let g = wave(&out, 1.0 / 32.0);
        let (ya, ga) = run(&flat, &g);
        let (yb, gb) = run(&three, &deep(&g));
        assert_eq!(
            ya[0].as_f32().unwrap(),
            yb[0].as_f32().unwrap(),
            "{}",
            flat.op
        );
        // Indices are plane offsets either way (the depth axis has one plane).
        for (a, b) in ya.iter().zip(&yb).skip(1) {
            assert_eq!(a.to_i64s(), b.to_i64s(), "{} indices", flat.op);
        }
        for (a, b) in ga.iter().zip(&gb) {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(
                a.as_f32().unwrap(),
                b.as_f32().unwrap(),
                "{} gradient",
                flat.op
            );
        }
    }
}

/// GlobalAveragePool and GlobalMaxPool over `[N, C, D, H, W]`: one value per
/// (image, channel), against sums and maxima over each channel.
#[test]
fn global_pools_on_5d() {
    let shape = [2, 3, 2, 3, 4];
    let x = perm(&shape, 1.0 / 16.0);
    let xs = x.as_f32().unwrap();
    for op in ["GlobalAveragePool", "GlobalMaxPool"] {
        let case = Case::new(op, vec![x.clone()]);
        let out_facts = case.infer().unwrap();
        assert_eq!(out_facts[0].shape, vec![2, 3, 1, 1, 1]);
        let y = forward(&case, &case.node(), &out_facts, &case.inputs).remove(0);
        let want: Vec<f32> = xs
            .chunks(24)
            .map(|c| match op {
                "GlobalMaxPool" => c.iter().copied().fold(f32::MIN, f32::max),
                _ => c.iter().sum::<f32>() / 24.0,
            })
            .collect();
        assert_close(&y, &want, &[2, 3, 1, 1, 1], 1e-6, op);
    }
    // GlobalAveragePool's gradient spreads g / plane over each channel.
    let case = Case::new("GlobalAveragePool", vec![x]);
    let g = wave(&[2, 3, 1, 1, 1], 0.5);
    let (_, grads) = run(&case, &g);
    let dx = grads[0].as_ref().unwrap();
    let want: Vec<f32> = g
        .as_f32()
        .unwrap()
        .iter()
        .flat_map(|&v| std::iter::repeat_n(v / 24.0, 24))
        .collect();
    assert_close(dx, &want, &shape, 0.0, "GlobalAveragePool dx");
}
