//! Registry rows: matrix products, convolutions and pools, normalizations,
//! losses and quantization.

use super::*;

#[allow(clippy::too_many_lines)] // Long by design: a table of ops.
pub(super) fn rows(r: &mut Rng, v: &mut Vec<Row>) {
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
}
