//! Registry rows: 3-D (video) windows, Conv, MaxPool, AveragePool, LpPool and
//! Col2Im over `[N, C, D, H, W]`. Last in the random stream, so the other
//! families' rows keep their inputs.

use super::*;

pub(super) fn rows(r: &mut Rng, v: &mut Vec<Row>) {
    // Conv 4 → 4 channels in 2 groups, kernel 2×3×2, strides (1, 2, 1),
    // dilations (2, 1, 1), pads begin (1, 1, 0) end (0, 1, 1) on [1, 4, 4, 5, 4]:
    // D (4 + 1 − 3)/1 + 1 = 3 (span 2·1 + 1), H (5 + 2 − 3)/2 + 1 = 3,
    // W (4 + 1 − 2)/1 + 1 = 4. 144 outputs × (2·2·12 + 1 bias).
    let c = Case::new(
        "Conv",
        vec![r.t(&[1, 4, 4, 5, 4]), r.t(&[4, 2, 2, 3, 2]), r.t(&[4])],
    )
    .attr("group", Attr::Int(2))
    .attr("strides", ints(&[1, 2, 1]))
    .attr("dilations", ints(&[2, 1, 1]))
    .attr("pads", ints(&[1, 1, 0, 0, 1, 1]));
    v.push(row(c, &[&[1, 4, 3, 3, 4]], 144 * 49));
    // MaxPool with indices, kernel 2×2×3, stride 2, pads begin (0, 1, 1) end
    // (0, 0, 1), ceil_mode on [1, 2, 4, 5, 6]: D ⌈(4 − 2)/2⌉ + 1 = 2,
    // H ⌈(6 − 2)/2⌉ + 1 = 3, W ⌈(8 − 3)/2⌉ + 1 = 4 (the last window starts at
    // 6 − 1 = 5, inside the input). 48 outputs × 12 compares.
    let c = Case::new("MaxPool", vec![r.distinct(&[1, 2, 4, 5, 6])])
        .attr("kernel_shape", ints(&[2, 2, 3]))
        .attr("strides", ints(&[2, 2, 2]))
        .attr("pads", ints(&[0, 1, 1, 0, 0, 1]))
        .attr("ceil_mode", Attr::Int(1))
        .outs(2, 1);
    v.push(row(c, &[&[1, 2, 2, 3, 4], &[1, 2, 2, 3, 4]], 48 * 12));
    // AveragePool counting the pads, kernel 3×2×2, stride 2, pads begin (1, 0, 1)
    // end (1, 0, 1), ceil_mode on [1, 2, 6, 4, 5]: D ⌈(8 − 3)/2⌉ + 1 = 4 (the last
    // window, from 6 − 1 = 5, reaches past the padding: its divisor is 2 taps
    // deep), H (4 − 2)/2 + 1 = 2, W ⌈(7 − 2)/2⌉ + 1 = 4 would start at 6 − 1 = 5,
    // past the input, so 3. 48 outputs × 12 adds.
    let c = Case::new("AveragePool", vec![r.t(&[1, 2, 6, 4, 5])])
        .attr("kernel_shape", ints(&[3, 2, 2]))
        .attr("strides", ints(&[2, 2, 2]))
        .attr("pads", ints(&[1, 0, 1, 1, 0, 1]))
        .attr("ceil_mode", Attr::Int(1))
        .attr("count_include_pad", Attr::Int(1));
    v.push(row(c, &[&[1, 2, 4, 2, 3]], 48 * 12));
    // AveragePool not counting the pads, SAME_LOWER, kernel 2×3×3, strides
    // (1, 2, 2) on [2, 1, 3, 4, 5]: (3, ⌈4/2⌉, ⌈5/2⌉) = (3, 2, 3). 36 outputs × 18.
    let c = Case::new("AveragePool", vec![r.t(&[2, 1, 3, 4, 5])])
        .attr("kernel_shape", ints(&[2, 3, 3]))
        .attr("strides", ints(&[1, 2, 2]))
        .attr("auto_pad", s("SAME_LOWER"));
    v.push(row(c, &[&[2, 1, 3, 2, 3]], 36 * 18));
    // LpPool 2×2×2, stride 1 on [1, 2, 3, 3, 3]: 2·2·2·2 = 16 outputs × 8.
    let c = Case::new("LpPool", vec![r.distinct(&[1, 2, 3, 3, 3])])
        .attr("kernel_shape", ints(&[2, 2, 2]));
    v.push(row(c, &[&[1, 2, 2, 2, 2]], 128).no_backward_kernel());
    // Col2Im of 2×2×2 blocks over a 3×3×4 image: (2, 2, 3) = 12 positions,
    // 2 channels of 8 → [1, 2, 3, 3, 4]; 192 input elements.
    let c = Case::new(
        "Col2Im",
        vec![r.t(&[1, 16, 12]), i64s(&[3, 3, 4]), i64s(&[2, 2, 2])],
    )
    .opset(18);
    v.push(row(c, &[&[1, 2, 3, 3, 4]], 192));
}
