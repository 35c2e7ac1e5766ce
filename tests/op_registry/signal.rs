//! Registry rows: the signal ops (DFT, STFT, the window generators,
//! MelWeightMatrix). A length-n transform is `5·n·log2(n)` FLOPs, rounded
//! (a length-8 one 120).

use super::*;

pub(super) fn rows(r: &mut Rng, v: &mut Vec<Row>) {
    let c = Case::new("DFT", vec![r.t(&[2, 8, 1]), int_scalar(8), int_scalar(1)]).opset(20);
    v.push(row(c, &[&[2, 8, 2]], 240));
    let c = Case::new("DFT", vec![r.t(&[2, 8, 2])])
        .attr("onesided", Attr::Int(1))
        .opset(17);
    v.push(row(c, &[&[2, 5, 2]], 240));
    let c = Case::new("STFT", vec![r.t(&[1, 16, 1]), int_scalar(4), r.t(&[8])]).opset(17);
    v.push(row(c, &[&[1, 3, 5, 2]], 3 * (120 + 8)));
    for op in ["HannWindow", "HammingWindow", "BlackmanWindow"] {
        let c = Case::new(op, vec![int_scalar(10)]).opset(17);
        v.push(row(c, &[&[10]], 30));
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
    v.push(row(c, &[&[9, 8]], 9 * 8 * 3));

    // The other forms, drawn from their own stream (the rows above keep theirs).
    let mut r = Rng(0x5167);
    // irfft: half spectra of 5 bins to 8 real values (opset 17's axis
    // attribute), and to 9 (dft_length 9, axis input: 5·9·log2 9 = 143).
    let c = Case::new("DFT", vec![r.t(&[2, 5, 2])])
        .attr("onesided", Attr::Int(1))
        .attr("inverse", Attr::Int(1))
        .opset(17);
    v.push(row(c, &[&[2, 8, 1]], 240));
    let c = Case::new("DFT", vec![r.t(&[2, 5, 2]), int_scalar(9), int_scalar(1)])
        .attr("onesided", Attr::Int(1))
        .attr("inverse", Attr::Int(1))
        .opset(20);
    v.push(row(c, &[&[2, 9, 1]], 2 * 143));
    // An inverse transform truncated to 6 of 12 on a middle axis: 3 signals of
    // 5·6·log2 6 = 78.
    let c = Case::new(
        "DFT",
        vec![r.t(&[1, 12, 3, 2]), int_scalar(6), int_scalar(1)],
    )
    .attr("inverse", Attr::Int(1))
    .opset(20);
    v.push(row(c, &[&[1, 6, 3, 2]], 3 * 78));
    // A complex signal without window or frame_length: one frame of the whole
    // signal (the ONNX reference), two-sided.
    let c = Case::new("STFT", vec![r.t(&[1, 8, 2]), int_scalar(3)])
        .attr("onesided", Attr::Int(0))
        .opset(17);
    v.push(row(c, &[&[1, 1, 8, 2]], 120 + 8));
    // Det of two 3×3 matrices: 2·(⌈2·27/3⌉ + 3).
    let c = Case::new("Det", vec![r.t(&[2, 3, 3])]).opset(11);
    v.push(row(c, &[&[2]], 2 * (18 + 3)));
}
