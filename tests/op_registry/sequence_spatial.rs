//! Registry rows: attention, local normalizations, rotary embeddings, data
//! movement, recurrent layers, image ops beside convolution, Upsample and the
//! random ops.

use super::*;

#[allow(clippy::too_many_lines)] // Long by design: a table of ops.
pub(super) fn rows(r: &mut Rng, v: &mut Vec<Row>) {
    // Attention, N = B·Hq·Sq·St scores: 2·N·D (Q·Kᵀ) + 5·N (scale, mask,
    // softmax) + 2·N·Dv (P·V), plus 3·N with a softcap.
    // 4-D: B 1, Hq = Hkv 2, Sq 3, Skv 5, D 4, Dv 3: N 30.
    let c = Case::new(
        "Attention",
        vec![r.t(&[1, 2, 3, 4]), r.t(&[1, 2, 5, 4]), r.t(&[1, 2, 5, 3])],
    )
    .opset(23);
    v.push(row(c, &[&[1, 2, 3, 3]], 30 * 8 + 30 * 5 + 30 * 6));
    // 3-D grouped-query, causal: Hq 4, Hkv 2, Sq = Skv 3, D 2, Dv 3: N 72.
    let c = Case::new(
        "Attention",
        vec![r.t(&[2, 3, 8]), r.t(&[2, 3, 4]), r.t(&[2, 3, 6])],
    )
    .attr("q_num_heads", Attr::Int(4))
    .attr("kv_num_heads", Attr::Int(2))
    .attr("is_causal", Attr::Int(1))
    .opset(23);
    v.push(row(c, &[&[2, 3, 12]], 72 * 4 + 72 * 5 + 72 * 6));
    // A float mask [2, 1, 3, 4], scale, every output (present = K, V without a
    // cache; qk_matmul_output after the softmax), all four receiving gradients:
    // B 2, H 2, Sq 3, Skv 4, D = Dv 4: N 48.
    let c = Case::new(
        "Attention",
        vec![
            r.t(&[2, 2, 3, 4]),
            r.t(&[2, 2, 4, 4]),
            r.t(&[2, 2, 4, 4]),
            r.t(&[2, 1, 3, 4]),
        ],
    )
    .attr("scale", Attr::Float(0.6))
    .attr("qk_matmul_output_mode", Attr::Int(3))
    .outs(4, 4)
    .opset(23);
    v.push(row(
        c,
        &[&[2, 2, 3, 4], &[2, 2, 4, 4], &[2, 2, 4, 4], &[2, 2, 3, 4]],
        48 * 8 + 48 * 5 + 48 * 8,
    ));
    // A cache with present outputs, grouped-query, causal (offset 2) with a bool
    // mask: Hq 4, Hkv 2, Sq 2, Skv 3, past 2 (St 5), D 4, Dv 2: N 40.
    let mask = Tensor::bool(
        vec![2, 5],
        vec![
            true, false, true, true, false, false, true, true, false, true,
        ],
    );
    let c = Case::new(
        "Attention",
        vec![
            r.t(&[1, 4, 2, 4]),
            r.t(&[1, 2, 3, 4]),
            r.t(&[1, 2, 3, 2]),
            mask,
            r.t(&[1, 2, 2, 4]),
            r.t(&[1, 2, 2, 2]),
        ],
    )
    .attr("is_causal", Attr::Int(1))
    .outs(3, 3)
    .opset(23);
    v.push(row(
        c,
        &[&[1, 4, 2, 2], &[1, 2, 5, 4], &[1, 2, 5, 2]],
        40 * 8 + 40 * 5 + 40 * 4,
    ));
    // 3-D multi-query with a cache but no present outputs (the backward saves the
    // concatenations as extras), softcap, scale, a float mask [2, 3]: Hq 3, Hkv 1,
    // Sq 2, Skv 2, past 1 (St 3), D 2, Dv 4: N 18.
    let c = Case::new(
        "Attention",
        vec![
            r.t(&[1, 2, 6]),
            r.t(&[1, 2, 2]),
            r.t(&[1, 2, 4]),
            r.t(&[2, 3]),
            r.t(&[1, 1, 1, 2]),
            r.t(&[1, 1, 1, 4]),
        ],
    )
    .attr("q_num_heads", Attr::Int(3))
    .attr("kv_num_heads", Attr::Int(1))
    .attr("softcap", Attr::Float(1.5))
    .attr("scale", Attr::Float(0.7))
    .opset(23);
    v.push(row(c, &[&[1, 2, 12]], 18 * 4 + 18 * 8 + 18 * 8));
    // qk_matmul_output before the softcap (mode 0) and with the mask (mode 2),
    // receiving gradients: B 1, H 2, Sq 2, Skv 3, D = Dv 2, softcap 2: N 12.
    for mode in [0, 2] {
        let c = Case::new(
            "Attention",
            vec![
                r.t(&[1, 2, 2, 2]),
                r.t(&[1, 2, 3, 2]),
                r.t(&[1, 2, 3, 2]),
                r.t(&[2, 3]),
            ],
        )
        .attr("softcap", Attr::Float(2.0))
        .attr("qk_matmul_output_mode", Attr::Int(mode))
        .outs(4, 4)
        .opset(23);
        v.push(row(
            c,
            &[&[1, 2, 2, 2], &[1, 2, 3, 2], &[1, 2, 3, 2], &[1, 2, 2, 3]],
            12 * 4 + 12 * 8 + 12 * 4,
        ));
    }

    // LRN: size + 5 FLOPs per element; MVN 8.
    let c = Case::new("LRN", vec![r.range(&[2, 5, 2], 0.5, 1.5)])
        .attr("size", Attr::Int(3))
        .attr("alpha", Attr::Float(0.3))
        .opset(13);
    v.push(row(c, &[&[2, 5, 2]], 20 * 8));
    let c = Case::new("LRN", vec![r.range(&[1, 4, 3], 0.5, 1.5)])
        .attr("size", Attr::Int(2))
        .attr("alpha", Attr::Float(0.5))
        .attr("bias", Attr::Float(2.0))
        .opset(13);
    v.push(row(c, &[&[1, 4, 3]], 12 * 7));
    let c = Case::new("MeanVarianceNormalization", vec![r.t(&[2, 3, 2, 2])]).opset(13);
    v.push(row(c, &[&[2, 3, 2, 2]], 24 * 8));
    // RotaryEmbedding: 3 FLOPs per rotated element.
    let pos = Tensor::i64(vec![2, 3], vec![0, 1, 2, 4, 3, 0]);
    for (il, rot) in [(0, 0), (1, 0), (0, 2), (1, 2)] {
        let half = if rot == 0 { 2 } else { rot / 2 };
        let c = Case::new(
            "RotaryEmbedding",
            vec![
                r.t(&[2, 2, 3, 4]),
                r.t(&[5, half]),
                r.t(&[5, half]),
                pos.clone(),
            ],
        )
        .attr("interleaved", Attr::Int(il))
        .attr("rotary_embedding_dim", Attr::Int(rot as i64))
        .opset(23);
        let rd = if rot == 0 { 4 } else { rot };
        v.push(row(c, &[&[2, 2, 3, 4]], 2 * 2 * 3 * rd as u64 * 3));
    }
    let c = Case::new(
        "RotaryEmbedding",
        vec![r.t(&[2, 3, 8]), r.t(&[2, 3, 2]), r.t(&[2, 3, 2])],
    )
    .attr("num_heads", Attr::Int(2))
    .opset(23);
    v.push(row(c, &[&[2, 3, 8]], 2 * 2 * 3 * 4 * 3));
    // BitCast (float32 → int32 and back), OneHot and Scatter move data: 0 FLOPs.
    let c = Case::new("BitCast", vec![r.t(&[2, 3])])
        .attr("to", Attr::Int(6))
        .opset(26);
    v.push(row(c, &[&[2, 3]], 0));
    let bits = Tensor::i64(vec![2], vec![1065353216, -1073741824])
        .cast(DType::I32)
        .unwrap();
    let c = Case::new("BitCast", vec![bits])
        .attr("to", Attr::Int(1))
        .opset(26);
    v.push(row(c, &[&[2]], 0));
    let c = Case::new(
        "OneHot",
        vec![
            i64s(&[1, -1, 7]),
            int_scalar(4),
            Tensor::f32(vec![2], vec![0.0, 3.0]),
        ],
    )
    .attr("axis", Attr::Int(0))
    .opset(11);
    v.push(row(c, &[&[4, 3]], 0));
    let c = Case::new(
        "Scatter",
        vec![
            r.t(&[3, 3]),
            Tensor::i64(vec![2, 3], vec![1, 0, 2, 0, 2, 1]),
            r.t(&[2, 3]),
        ],
    )
    .opset(9);
    v.push(row(c, &[&[3, 3]], 0));
    // Recurrent layers, seq 3, batch 2, input 4, hidden 5: per step and row
    // 2·G·5·9 + 3·G·5 + 15 FLOPs.
    for (op, g, outs) in [("RNN", 1, 2), ("GRU", 3, 2), ("LSTM", 4, 3)] {
        let c = Case::new(
            op,
            vec![r.t(&[3, 2, 4]), r.t(&[2, g * 5, 4]), r.t(&[2, g * 5, 5])],
        )
        .attr("hidden_size", Attr::Int(5))
        .attr("direction", s("bidirectional"))
        .outs(outs, outs)
        .opset(14);
        let per = (2 * g * 5 * 9 + 3 * g * 5 + 15) as u64;
        let mut shapes: Vec<&[usize]> = vec![&[3, 2, 2, 5]];
        for _ in 1..outs {
            shapes.push(&[2, 2, 5]);
        }
        v.push(row(c, &shapes, 3 * 2 * 2 * per));
    }
    let c = Case::new(
        "LSTM",
        vec![r.t(&[2, 3, 4]), r.t(&[1, 20, 4]), r.t(&[1, 20, 5])],
    )
    .attr("hidden_size", Attr::Int(5))
    .attr("layout", Attr::Int(1))
    .opset(14);
    v.push(row(c, &[&[2, 3, 1, 5]], 3 * 2 * (2 * 20 * 9 + 60 + 15)));
    // With B, sequence_lens (all full), initial states, LSTM's peepholes, both
    // layouts, GRU with and without linear_before_reset.
    for (op, g, dir, lbr, layout) in [
        ("RNN", 1, "reverse", 0, 1),
        ("GRU", 3, "forward", 1, 0),
        ("GRU", 3, "bidirectional", 1, 1),
        ("GRU", 3, "reverse", 0, 0),
        ("LSTM", 4, "reverse", 0, 0),
        ("LSTM", 4, "bidirectional", 0, 1),
    ] {
        let dirs = if dir == "bidirectional" { 2 } else { 1 };
        let (x, st): (&[usize], &[usize]) = if layout == 1 {
            (&[2, 3, 4], &[2, dirs, 5])
        } else {
            (&[3, 2, 4], &[dirs, 2, 5])
        };
        let mut ins = vec![
            r.t(x),
            r.t(&[dirs, g * 5, 4]),
            r.t(&[dirs, g * 5, 5]),
            r.t(&[dirs, 2 * g * 5]),
            i64s(&[3, 3]),
            r.t(st),
        ];
        if g == 4 {
            ins.push(r.t(st));
            ins.push(r.t(&[dirs, 15]));
        }
        let outs = if g == 4 { 3 } else { 2 };
        let mut c = Case::new(op, ins)
            .outs(outs, outs)
            .attr("hidden_size", Attr::Int(5))
            .attr("direction", s(dir))
            .attr("layout", Attr::Int(layout))
            .opset(14);
        if g == 3 {
            c = c.attr("linear_before_reset", Attr::Int(lbr));
        }
        let per = (2 * g * 5 * 9 + 3 * g * 5 + 15) as u64;
        let y: Vec<usize> = if layout == 1 {
            vec![2, 3, dirs, 5]
        } else {
            vec![3, dirs, 2, 5]
        };
        let shapes: Vec<&[usize]> = vec![&y, st, st];
        v.push(row(c, &shapes[..outs], 3 * dirs as u64 * 2 * per));
    }
    // Image ops beside convolution: Col2Im 1 FLOP per input element;
    // DeformConv Conv's 2 per multiply-add plus 9 per sampled point; RoiAlign
    // 9 per sample (sampling_ratio² per output, 4 when adaptive); MaxUnpool 0.
    // DeformConv's offsets kept off the bilinear kinks (integer sample
    // positions); RoiAlign is linear in X. Rows beyond the first of each draw
    // from their own stream (the shared one stays as it was).
    let c = Case::new(
        "Col2Im",
        vec![r.t(&[1, 4, 4]), i64s(&[3, 3]), i64s(&[2, 2])],
    )
    .opset(18);
    v.push(row(c, &[&[1, 1, 3, 3]], 16));
    let (x, w) = (r.t(&[1, 2, 3, 3]), r.t(&[1, 2, 2, 2]));
    let off = off_integers(r.t(&[1, 8, 2, 2]));
    let c = Case::new("DeformConv", vec![x, w, off]).opset(19);
    v.push(row(c, &[&[1, 1, 2, 2]], 64 + 32 * 9));
    let c = Case::new(
        "RoiAlign",
        vec![
            r.t(&[1, 2, 4, 4]),
            Tensor::f32(vec![2, 4], vec![0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0]),
            i64s(&[0, 0]),
        ],
    )
    .attr("output_height", Attr::Int(3))
    .attr("output_width", Attr::Int(3))
    .attr("sampling_ratio", Attr::Int(2))
    .opset(16);
    v.push(row(c, &[&[2, 2, 3, 3]], 36 * 4 * 9));
    let mut q = Rng(1913);
    // group 2, offset_group 2, bias and mask, strides [1, 2], pads [1, 0, 1, 1]:
    // out [2, 4, 4, 2], 64 outputs of 2·9 multiply-adds, 16·36 sampled points.
    let c = Case::new(
        "DeformConv",
        vec![
            q.t(&[2, 4, 4, 5]),
            q.t(&[4, 2, 3, 3]),
            off_integers(q.t(&[2, 36, 4, 2])),
            q.t(&[4]),
            q.range(&[2, 18, 4, 2], 0.0, 1.0),
        ],
    )
    .attr("group", Attr::Int(2))
    .attr("offset_group", Attr::Int(2))
    .attr("strides", ints(&[1, 2]))
    .attr("pads", ints(&[1, 0, 1, 1]))
    .opset(19);
    v.push(row(c, &[&[2, 4, 4, 2]], 64 * 18 * 2 + 16 * 36 * 9));
    // RoiAlign-10 (output_half_pixel), adaptive, spatial_scale 0.5, a roi past
    // the image; and mode max (forward only: no PyTorch gradient).
    let rois = Tensor::f32(vec![2, 4], vec![1.0, 1.0, 7.0, 5.0, 0.5, 2.0, 4.0, 13.0]);
    let c = Case::new("RoiAlign", vec![q.t(&[2, 3, 5, 6]), rois, i64s(&[1, 0])])
        .attr("output_height", Attr::Int(2))
        .attr("output_width", Attr::Int(3))
        .attr("spatial_scale", Attr::Float(0.5))
        .opset(10);
    v.push(row(c, &[&[2, 3, 2, 3]], 36 * 4 * 9));
    let rois = Tensor::f32(vec![1, 4], vec![0.3, 0.2, 3.1, 2.6]);
    let c = Case::new("RoiAlign", vec![q.t(&[1, 2, 4, 4]), rois, i64s(&[0])])
        .attr("output_height", Attr::Int(2))
        .attr("output_width", Attr::Int(2))
        .attr("mode", s("max"))
        .opset(16);
    v.push(row(c, &[&[1, 2, 2, 2]], 8 * 4 * 9).no_backward_kernel());
    let c = Case::new(
        "MaxUnpool",
        vec![
            r.t(&[1, 1, 2, 2]),
            Tensor::i64(vec![1, 1, 2, 2], vec![0, 3, 9, 15]),
        ],
    )
    .attr("kernel_shape", ints(&[2, 2]))
    .attr("strides", ints(&[2, 2]))
    .opset(11);
    v.push(row(c, &[&[1, 1, 4, 4]], 0));
    let c = Case::new("AffineGrid", vec![r.t(&[2, 2, 3]), i64s(&[2, 1, 4, 5])]).opset(20);
    v.push(row(c, &[&[2, 4, 5, 2]], 80 * 6));
    let c = Case::new("AffineGrid", vec![r.t(&[1, 3, 4]), i64s(&[1, 1, 2, 3, 1])]);
    let c = c.attr("align_corners", Attr::Int(1)).opset(20);
    v.push(row(c, &[&[1, 2, 3, 1, 3]], 18 * 8));
    let tokens = Tensor::i64(vec![2, 6], vec![1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8])
        .cast(DType::I32)
        .unwrap();
    let c = Case::new("TfIdfVectorizer", vec![tokens])
        .attr("max_gram_length", Attr::Int(2))
        .attr("min_gram_length", Attr::Int(2))
        .attr("max_skip_count", Attr::Int(0))
        .attr("mode", s("TF"))
        .attr("ngram_counts", ints(&[0, 4]))
        .attr("ngram_indexes", ints(&[0, 1, 2, 3, 4, 5, 6]))
        .attr("pool_int64s", ints(&[2, 3, 5, 4, 5, 6, 7, 8, 6, 7]))
        .opset(9);
    v.push(row(c, &[&[2, 7]], 14).no_cpu_kernel());
    let c = Case::new("Det", vec![r.t(&[3, 2, 2])]).opset(11);
    v.push(row(c, &[&[3]], 3 * (6 + 2)));
    // Selections and reversals move data: 0 FLOPs.
    let cond = Tensor::bool(vec![3], vec![true, false, true]);
    let c = Case::new("Compress", vec![r.t(&[3, 2]), cond.clone()])
        .attr("axis", Attr::Int(0))
        .opset(11);
    v.push(row(c, &[&[2, 2]], 0));
    let c = Case::new("Compress", vec![r.t(&[3, 2]), cond]).opset(11);
    v.push(row(c, &[&[2]], 0));
    let c = Case::new("ReverseSequence", vec![r.t(&[4, 3]), i64s(&[1, 2, 3, 0])])
        .attr("batch_axis", Attr::Int(0))
        .attr("time_axis", Attr::Int(1))
        .opset(10);
    v.push(row(c, &[&[4, 3]], 0));
    let c = Case::new("CenterCropPad", vec![r.t(&[5, 4, 2]), i64s(&[3, 6])])
        .attr("axes", ints(&[0, 1]))
        .opset(18);
    v.push(row(c, &[&[3, 6, 2]], 0));
    // Upsample: Resize-10's arithmetic (nearest a gather, 0 FLOPs; linear 2·2²
    // per output element over two resized axes); scales an input from opset 9,
    // an attribute before.
    let up = Tensor::f32(vec![4], vec![1.0, 1.0, 2.0, 3.0]);
    let c = Case::new("Upsample", vec![r.t(&[1, 1, 2, 2]), up])
        .consts(&[1])
        .opset(9);
    v.push(row(c, &[&[1, 1, 4, 6]], 0));
    let c = Case::new("Upsample", vec![r.t(&[1, 1, 2, 2])])
        .attr("scales", Attr::Floats(vec![1.0, 1.0, 2.0, 2.0]))
        .attr("mode", s("linear"))
        .opset(7);
    v.push(row(c, &[&[1, 1, 4, 4]], 16 * 8));
    let c = Case::new(
        "Resize",
        vec![
            r.t(&[1, 1, 2, 2]),
            Tensor::f32(vec![8], vec![0.0, 0.0, 0.2, 0.2, 1.0, 1.0, 0.8, 0.8]),
            Tensor::f32(vec![4], vec![1.0, 1.0, 2.0, 2.0]),
        ],
    )
    .attr("coordinate_transformation_mode", s("tf_crop_and_resize"))
    .attr("mode", s("linear"))
    .consts(&[1, 2])
    .opset(13);
    v.push(row(c, &[&[1, 1, 4, 4]], 16 * 8));
    // Antialiased linear downsampling, [1, 1, 6, 7] to [1, 1, 3, 3] (its own random
    // stream): the filter stretched by 1/scale, scale 1/2 gives 4 taps (first at
    // floor(-2) + 1 = -1 from the left pixel), 3/7 gives 6 (first at -2): 24 taps,
    // a multiply-add each, per output element.
    let mut aa = Rng(0xaa);
    let c = Case::new(
        "Resize",
        vec![
            aa.t(&[1, 1, 6, 7]),
            Tensor::f32(vec![0], vec![]),
            Tensor::f32(vec![0], vec![]),
            i64s(&[1, 1, 3, 3]),
        ],
    )
    .attr("mode", s("linear"))
    .attr("antialias", Attr::Int(1))
    .consts(&[1, 2, 3])
    .opset(18);
    v.push(row(c, &[&[1, 1, 3, 3]], 24 * 2 * 9));
    // Random ops: one FLOP per element drawn.
    for op in ["RandomUniform", "RandomNormal"] {
        let c = Case::new(op, vec![]).attr("shape", ints(&[2, 3]));
        v.push(row(c, &[&[2, 3]], 6));
    }
    for op in ["RandomUniformLike", "RandomNormalLike"] {
        v.push(row(Case::new(op, vec![r.t(&[2, 3])]), &[&[2, 3]], 6));
    }
    let p = r.range(&[2, 3], 0.0, 1.0);
    v.push(row(Case::new("Bernoulli", vec![p]), &[&[2, 3]], 6).sampled());
}

/// Offsets in [-1, 1) moved to ±[0.15, 0.85): off the integers, where a
/// sample position (an integer plus the offset) crosses a bilinear kink.
fn off_integers(t: Tensor) -> Tensor {
    let v = t
        .to_f32()
        .unwrap()
        .iter()
        .map(|&o| o.signum() * (0.15 + 0.7 * o.abs()))
        .collect();
    Tensor::f32(t.shape.clone(), v)
}
