//! Resize against PyTorch's F.interpolate (and onnxruntime for ONNX-only forms).
//!
//! Expected values made by /work/venv/bin/python with torch 2 / onnxruntime (the
//! script's lines, kept with each constant in resize_ref.rs): input `seq(shape, 0.1)`,
//! each call exported with the TorchScript exporter at opset 17 (the attributes it
//! wrote are the ones used below) and run with onnxruntime, which agreed with
//! PyTorch to the difference printed. The last two are ONNX forms PyTorch does not
//! export, computed by onnxruntime and checked against the ONNX reference
//! implementation. tf_crop_and_resize (no PyTorch op) against the ONNX reference
//! implementation: tests/data/ops/reference_crop_and_resize.py.

use super::*;

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

/// tf_crop_and_resize (linear, linear with extrapolation, nearest with rows and
/// columns outside the input, cubic onto one row) against the ONNX reference
/// implementation (tests/data/ops/reference_crop_and_resize.py, onnx 1.23.2;
/// onnxruntime 1.32 agrees on the linear and cubic cases and differs on nearest
/// positions outside the input, which it rounds before the range check).
#[test]
fn resize_tf_crop_and_resize_matches_the_onnx_reference() {
    use resize_ref::*;
    #[allow(clippy::type_complexity)]
    let cases: Vec<(
        &str,
        &str,
        &[usize],
        [f32; 8],
        [i64; 4],
        Option<f32>,
        &[f32],
    )> = vec![
        (
            "linear",
            "linear",
            &[1, 1, 4, 5],
            [0.0, 0.0, 0.2, 0.1, 1.0, 1.0, 0.9, 0.7],
            [1, 1, 3, 4],
            None,
            &CROP_LINEAR,
        ),
        (
            "linear, extrapolated",
            "linear",
            &[1, 2, 4, 4],
            [0.0, 0.0, 0.4, 0.6, 1.0, 1.0, 1.2, 1.7],
            [1, 2, 3, 3],
            Some(2.5),
            &CROP_LINEAR_EXTRAPOLATE,
        ),
        (
            "nearest, outside",
            "nearest",
            &[1, 1, 4, 5],
            [0.0, 0.0, -0.2, 0.3, 1.0, 1.0, 0.8, 1.1],
            [1, 1, 4, 3],
            None,
            &CROP_NEAREST,
        ),
        (
            "cubic, one row",
            "cubic",
            &[1, 1, 5, 4],
            [0.0, 0.0, 0.3, 0.1, 1.0, 1.0, 0.5, 0.8],
            [1, 1, 1, 5],
            None,
            &CROP_CUBIC_ONE_ROW,
        ),
    ];
    for (what, mode, shape, roi, sizes, fill, want) in cases {
        let mut attrs = resize_attrs(mode, "tf_crop_and_resize", "round_prefer_floor");
        if let Some(f) = fill {
            attrs.push(("extrapolation_value", Attr::Float(f)));
        }
        let y = run_op_consts(
            "Resize",
            &attrs,
            &[
                seq(shape, 0.1),
                Tensor::f32(vec![8], roi.to_vec()),
                Tensor::f32(vec![0], vec![]),
                Tensor::i64(vec![4], sizes.to_vec()),
            ],
            1,
            true,
            &[1, 2],
        )
        .remove(0);
        let want_shape: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
        assert_eq!(y.shape, want_shape, "{what}");
        assert_close(y.as_f32().unwrap(), want, 2e-6, what);
    }
}
