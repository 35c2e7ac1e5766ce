//! RoiAlign and DeformConv's CPU kernels against torchvision's `roi_align` and
//! `deform_conv2d` (float32, CPU): forward values and every gradient, the
//! backward run with only the tensors its rule saves (`forward_backward`).
//! RoiAlign's max mode, which torchvision lacks, against the ONNX reference
//! evaluator. Reference values: tests/torchvision_ops/reference.rs, written by
//! tests/data/ops/reference_roialign_deformconv.py from the same inputs
//! (`seq`, `offsets`, `unit` below compute them exactly as the script does).
//! Finite differences of both ops: their rows in tests/op_registry.rs and
//! tests/exec_backward.rs.
#![allow(clippy::excessive_precision)]

mod common;

use common::opcase::{forward_backward, Case};
use memplan::exec::Tensor;
use memplan::ir::Attr;
use memplan::ops::{registry, Fact, KernelCx};

#[rustfmt::skip]
#[path = "torchvision_ops/reference.rs"]
mod reference;

use reference::*;

/// `f(i)` over `shape`, computed in f64 and rounded to f32 once.
fn pattern(shape: &[usize], f: impl Fn(usize) -> f64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(shape.to_vec(), (0..n).map(|i| f(i) as f32).collect())
}

/// `((i·37 mod 101) − 50) · scale`.
fn seq(shape: &[usize], scale: f64) -> Tensor {
    pattern(shape, |i| ((i * 37 % 101) as f64 - 50.0) * scale)
}

/// `((i·53 mod 97) / 97 · 2 − 1) · amp`: never an integer for the amplitudes
/// used (no sample on a bilinear kink).
fn offsets(shape: &[usize], amp: f64) -> Tensor {
    pattern(shape, |i| ((i * 53 % 97) as f64 / 97.0 * 2.0 - 1.0) * amp)
}

/// `(i·29 mod 89) / 88`, in [0, 1].
fn unit(shape: &[usize]) -> Tensor {
    pattern(shape, |i| (i * 29 % 89) as f64 / 88.0)
}

/// The case's inferred outputs and its forward kernel's result (errors as
/// text).
fn run(case: &Case) -> (Result<Vec<Fact>, String>, Result<Vec<Tensor>, String>) {
    let rule = registry().get("", case.op).unwrap();
    let node = case.node();
    let out = match case.infer() {
        Ok(o) => o,
        Err(e) => return (Err(e), Err("not run".into())),
    };
    let kcx = KernelCx {
        node: &node,
        inputs: case.inputs.iter().map(Some).collect(),
        outputs: out.iter().map(Some).collect(),
        opset: case.opset,
        seed: 7,
        dropout: true,
        extras: false,
    };
    let y = rule.forward_cpu(&kcx).map_err(|e| e.to_string());
    (Ok(out), y)
}

/// An error of one line that names `what`.
fn one_line(e: &str, what: &str) {
    assert!(e.contains(what) && !e.contains('\n'), "{e}");
}

/// `max |got − want|` within `1e-5 · max |want| + 1e-6`.
fn assert_close(got: &Tensor, want: &[f32], what: &str) {
    let got = got.to_f32().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: element count");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let err = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .fold(0f64, f64::max);
    eprintln!("{what}: max error {err:.2e} of {scale:.2e}");
    assert!(
        err <= 1e-5 * scale + 1e-6,
        "{what}: max error {err:.3e} (values up to {scale:.3e})"
    );
}

/// The script's rois `[x1, y1, x2, y2]` and their images.
const ROIS: [f32; 20] = [
    0.5, 1.0, 4.2, 3.7, 2.0, 1.5, 6.5, 5.9, -1.5, -0.8, 3.0, 2.5, 5.0, 4.0, 9.0, 8.0, 3.0, 2.0,
    3.2, 2.1,
];
const BATCH: [i64; 5] = [0, 1, 0, 1, 0];

/// RoiAlign on the script's X and rois; `aligned` is `half_pixel` at opset 16,
/// else `output_half_pixel` at opset 16 or (`opset10`) RoiAlign-10's only mode.
fn roi_case(aligned: bool, opset10: bool, sr: i64, scale: f32, out: [i64; 2]) -> Case {
    let mut c = Case::new(
        "RoiAlign",
        vec![
            seq(&[2, 3, 6, 7], 0.1),
            Tensor::f32(vec![5, 4], ROIS.to_vec()),
            Tensor::i64(vec![5], BATCH.to_vec()),
        ],
    )
    .attr("output_height", Attr::Int(out[0]))
    .attr("output_width", Attr::Int(out[1]))
    .attr("sampling_ratio", Attr::Int(sr))
    .attr("spatial_scale", Attr::Float(scale))
    .opset(if opset10 { 10 } else { 16 });
    if !aligned && !opset10 {
        c = c.attr(
            "coordinate_transformation_mode",
            Attr::String("output_half_pixel".into()),
        );
    }
    c
}

/// RoiAlign (avg) against `roi_align`: aligned and not (both spellings of
/// not), fixed and adaptive sampling, spatial scales, rois inside, partly
/// outside and smaller than a pixel; dX against `x.grad`.
#[test]
fn roi_align_matches_torchvision() {
    let cases = [
        (
            roi_case(true, false, 2, 1.0, [3, 2]),
            [3, 2],
            &ROI_A_Y[..],
            &ROI_A_DX[..],
        ),
        (
            roi_case(false, true, 0, 0.5, [2, 2]),
            [2, 2],
            &ROI_B_Y,
            &ROI_B_DX,
        ),
        (
            roi_case(true, false, 0, 0.75, [2, 3]),
            [2, 3],
            &ROI_C_Y,
            &ROI_C_DX,
        ),
        (
            roi_case(false, false, 3, 1.0, [4, 4]),
            [4, 4],
            &ROI_D_Y,
            &ROI_D_DX,
        ),
    ];
    for (k, (case, [oh, ow], y, dx)) in cases.iter().enumerate() {
        let what = format!("roi case {k} (opset {})", case.opset);
        let gy = seq(&[5, 3, *oh, *ow], 0.05);
        let (outs, grads) = forward_backward(case, &[gy], &[0]).unwrap();
        assert_close(&outs[0], y, &format!("{what}: Y"));
        assert_close(grads[0].as_ref().unwrap(), dx, &format!("{what}: dX"));
        assert!(grads[1].is_none() && grads[2].is_none(), "{what}: X only");
    }
}

/// Mode max (ONNX only) against the ONNX reference evaluator: the largest
/// weighted tap of any sample. Its gradient is refused in one line by the
/// rule (so training names the node).
#[test]
fn roi_align_max_matches_onnx_and_has_no_gradient() {
    let case = roi_case(true, false, 2, 1.0, [3, 2]).attr("mode", Attr::String("max".into()));
    let (out, y) = run(&case);
    assert_close(&y.unwrap()[0], &ROI_MAX_Y, "max");
    let e = case.backward_rule(&out.unwrap()).unwrap_err();
    one_line(&e, "'max'");
    let gy = seq(&[5, 3, 3, 2], 0.05);
    one_line(&forward_backward(&case, &[gy], &[0]).unwrap_err(), "'max'");
}

/// Malformed RoiAlign: an unknown mode or coordinate mode and a negative
/// sampling ratio (rule errors), a batch index past X (kernel error); an
/// empty image gives zeros.
#[test]
fn roi_align_refuses_bad_input() {
    for (k, v, named) in [
        ("mode", Attr::String("median".into()), "median"),
        (
            "coordinate_transformation_mode",
            Attr::String("align_corners".into()),
            "align_corners",
        ),
        ("sampling_ratio", Attr::Int(-1), "sampling_ratio"),
    ] {
        let mut case = roi_case(true, false, 2, 1.0, [2, 2]);
        case.attrs.retain(|(n, _)| *n != k);
        let (out, _) = run(&case.attr(k, v));
        one_line(&out.unwrap_err(), named);
    }
    let mut case = roi_case(true, false, 2, 1.0, [2, 2]);
    case.inputs[2] = Tensor::i64(vec![5], vec![0, 1, 2, 0, 0]);
    let (out, y) = run(&case);
    assert!(out.is_ok());
    one_line(&y.unwrap_err(), "batch index 2");
    // An empty image samples zeros (no panic).
    let mut case = roi_case(true, false, 2, 1.0, [2, 2]);
    case.inputs[0] = Tensor::f32(vec![2, 3, 0, 7], vec![]);
    let y = run(&case).1.unwrap();
    assert!(y[0].to_f32().unwrap().iter().all(|&v| v == 0.0));
}

/// One of the script's DeformConv cases: X, W, offsets, the bias (zeros where
/// the script passes none: the same output) and the optional mask,
/// torchvision's symmetric padding as ONNX `pads`; and the output shape.
#[allow(clippy::too_many_arguments)]
fn deform_case(
    x: [usize; 4],
    w: [usize; 4],
    group: i64,
    offset_group: usize,
    stride: [i64; 2],
    pad: [i64; 2],
    dilation: [i64; 2],
    mask: bool,
    bias: bool,
    amp: f64,
) -> (Case, Vec<usize>) {
    let (kh, kw) = (w[2], w[3]);
    let out = |i: usize| {
        (x[2 + i] as i64 + 2 * pad[i] - dilation[i] * ([kh, kw][i] as i64 - 1) - 1) / stride[i] + 1
    };
    let (oh, ow) = (out(0) as usize, out(1) as usize);
    let mut inputs = vec![
        seq(&x, 0.1),
        seq(&w, 0.07),
        offsets(&[x[0], offset_group * 2 * kh * kw, oh, ow], amp),
    ];
    inputs.push(if bias {
        seq(&[w[0]], 0.3)
    } else {
        Tensor::f32(vec![w[0]], vec![0.0; w[0]])
    });
    if mask {
        inputs.push(unit(&[x[0], offset_group * kh * kw, oh, ow]));
    }
    let c = Case::new("DeformConv", inputs)
        .attr("group", Attr::Int(group))
        .attr("offset_group", Attr::Int(offset_group as i64))
        .attr("strides", Attr::Ints(stride.to_vec()))
        .attr("pads", Attr::Ints(vec![pad[0], pad[1], pad[0], pad[1]]))
        .attr("dilations", Attr::Ints(dilation.to_vec()))
        .opset(19);
    (c, vec![x[0], w[0], oh, ow])
}

/// DeformConv against `deform_conv2d`: groups and offset groups, strides,
/// pads and dilations, with and without mask and bias, offsets reaching past
/// the image; forward and the gradients of X, W, the offsets, the mask and
/// the bias, each computed alone from only what the rule saves.
#[test]
fn deform_conv_matches_torchvision() {
    type Want<'a> = (
        &'a [f32],
        &'a [f32],
        &'a [f32],
        &'a [f32],
        Option<&'a [f32]>,
        Option<&'a [f32]>,
    );
    let cases: [((Case, Vec<usize>), Want); 3] = [
        (
            deform_case(
                [2, 4, 5, 6],
                [6, 2, 3, 3],
                2,
                2,
                [1, 2],
                [1, 1],
                [1, 1],
                true,
                true,
                1.5,
            ),
            (
                &DC_A_Y,
                &DC_A_DX,
                &DC_A_DW,
                &DC_A_DOFF,
                Some(&DC_A_DMASK),
                Some(&DC_A_DB),
            ),
        ),
        (
            deform_case(
                [1, 3, 6, 5],
                [2, 3, 2, 2],
                1,
                1,
                [1, 1],
                [0, 0],
                [2, 1],
                false,
                false,
                2.4,
            ),
            (&DC_B_Y, &DC_B_DX, &DC_B_DW, &DC_B_DOFF, None, None),
        ),
        (
            deform_case(
                [1, 2, 4, 4],
                [2, 1, 2, 3],
                2,
                1,
                [2, 1],
                [1, 0],
                [1, 1],
                true,
                false,
                1.5,
            ),
            (
                &DC_C_Y,
                &DC_C_DX,
                &DC_C_DW,
                &DC_C_DOFF,
                Some(&DC_C_DMASK),
                None,
            ),
        ),
    ];
    for (k, ((case, out), (y, dx, dw, doff, dmask, db))) in cases.iter().enumerate() {
        let gy = seq(out, 0.05);
        let mut want: Vec<(usize, &[f32])> = vec![(0, dx), (1, dw), (2, doff)];
        want.extend(db.map(|v| (3, v)));
        want.extend(dmask.map(|v| (4, v)));
        for &(i, expected) in &want {
            let (outs, grads) = forward_backward(case, std::slice::from_ref(&gy), &[i]).unwrap();
            assert_close(&outs[0], y, &format!("deform case {k}: Y"));
            assert_close(
                grads[i].as_ref().unwrap(),
                expected,
                &format!("deform case {k}: input {i}"),
            );
        }
        let all: Vec<usize> = want.iter().map(|w| w.0).collect();
        let (_, grads) = forward_backward(case, &[gy], &all).unwrap();
        for &(i, expected) in &want {
            assert_close(
                grads[i].as_ref().unwrap(),
                expected,
                &format!("deform case {k}: {i} with all"),
            );
        }
    }
}

/// DeformConv's kernels are 2-D: a 1-D DeformConv infers (the rule is
/// N-D) and its kernel refuses in one line; malformed masks, biases and
/// offset groups are rule errors.
#[test]
fn deform_conv_refuses_other_ranks_and_bad_shapes() {
    let c = Case::new(
        "DeformConv",
        vec![
            seq(&[1, 2, 5], 0.1),
            seq(&[2, 2, 3], 0.1),
            offsets(&[1, 3, 3], 1.5),
        ],
    )
    .opset(19);
    let (out, y) = run(&c);
    assert_eq!(out.unwrap()[0].shape, vec![1, 2, 3]);
    one_line(&y.unwrap_err(), "2-D");
    let (base, _) = small_deform();
    let bad: [(usize, Tensor, &str); 2] = [
        (3, seq(&[3], 0.1), "B is [3]"),
        (4, unit(&[1, 3, 3, 3]), "mask is [1, 3, 3, 3]"),
    ];
    let like = |inputs: Vec<Tensor>| {
        let mut c = Case::new("DeformConv", inputs).opset(19);
        c.attrs = base.attrs.clone();
        c
    };
    for (i, t, named) in bad {
        let mut c = like(base.inputs.clone());
        c.inputs[i] = t;
        one_line(&run(&c).0.unwrap_err(), named);
    }
    let mut c = like(base.inputs.clone());
    c.attrs.retain(|(n, _)| *n != "offset_group");
    let c = c.attr("offset_group", Attr::Int(3));
    one_line(&run(&c).0.unwrap_err(), "offset_group 3");
}

/// A 4-channel DeformConv with bias and mask, 2×2 kernel, unit strides and
/// dilations, no padding.
fn small_deform() -> (Case, Vec<usize>) {
    deform_case(
        [1, 4, 4, 4],
        [2, 4, 2, 2],
        1,
        1,
        [1, 1],
        [0, 0],
        [1, 1],
        true,
        true,
        1.5,
    )
}

/// What the rules save is what torchvision's autograd functions save:
/// RoIAlignFunction the rois (here rois and batch indices) and X's shape, not
/// X; DeformConv2dFunction input, weight, offset, mask and bias, for every
/// gradient. The kernels read nothing more (`forward_backward` hands them only
/// these), shown here for RoiAlign with X's data withheld.
#[test]
fn rules_save_what_torchvision_saves() {
    use memplan::ops::Saved;
    let rule_of = |case: &Case| case.backward_rule(&case.infer().unwrap()).unwrap().unwrap();
    let bw = rule_of(&roi_case(true, false, 2, 1.0, [3, 2]));
    assert_eq!(bw.grads.len(), 1);
    assert_eq!(bw.grads[0].input, 0);
    assert_eq!(bw.grads[0].needs, vec![Saved::Input(1), Saved::Input(2)]);
    assert!(bw.extras.is_empty());
    let (dc, _) = small_deform();
    let bw = rule_of(&dc);
    let all: Vec<Saved> = (0..5).map(Saved::Input).collect();
    assert_eq!(
        bw.grads.iter().map(|g| g.input).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert!(bw.grads.iter().all(|g| g.needs == all));
    // X's data withheld: RoiAlign's backward still runs (reads rois and indices).
    let mut case = roi_case(true, false, 2, 1.0, [3, 2]);
    let gy = seq(&[5, 3, 3, 2], 0.05);
    let (_, with_x) = forward_backward(&case, std::slice::from_ref(&gy), &[0]).unwrap();
    case.inputs[0] = Tensor::f32(vec![2, 3, 6, 7], vec![f32::NAN; 252]);
    let (_, without) = forward_backward(&case, &[gy], &[0]).unwrap();
    assert_eq!(with_x[0], without[0], "dX does not depend on X");
}
