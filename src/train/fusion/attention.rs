//! The exporter's decomposition of `scaled_dot_product_attention`, found as one fused
//! pattern, and the memory layout PyTorch's kernels write its output in.

use petgraph::stable_graph::NodeIndex;

use super::{consumers, FusedKind, FusedPattern};
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::ops::Fact;

/// Physical dim order of `scaled_dot_product_attention`'s `[B, H, S, D]` output in
/// float32 on a GPU: `[B, S, H, D]`. PyTorch's CUDA SDPA runs float32 through the
/// memory-efficient kernel (flash attention takes half precision only, and no
/// mask), which allocates its output as `[B, S, H, D]` whatever the query's layout
/// (`_efficient_attention_forward`, aten/src/ATen/native/transformers/cuda/
/// attention.cu); flash attention and the CPU kernel write the query's layout
/// ([`FusedPattern::out_layout`]); so did cuDNN's kernel, which PyTorch 2.11 ran
/// under autocast on an H200 (tools/gpu-sdpa-layout.py). Where the model's following
/// transpose does not restore `[B, S, H, D]` (`nn.MultiheadAttention`'s `permute(2, 0, 1, 3)`), the
/// reshape after it copies, and `out_proj` saves the copy beside the output the
/// kernel saves: one tensor a layer more than on the CPU (vit_b_16 on an H200,
/// models/training_reference_cuda_h200.json).
pub const SDPA_F32_LAYOUT: [usize; 4] = [0, 2, 1, 3];

/// Finds attention written out by the TorchScript exporter's decomposition of
/// `scaled_dot_product_attention`: `MatMul(Mul(q, √s), Mul(kᵀ, √s))` → [Add mask] →
/// Softmax → [Dropout] → `MatMul(·, v)`. PyTorch runs it as one fused kernel
/// (flash attention) that saves q, k, v, the output and the per-row logsumexp
/// (float32, `[batch, heads, queries]`), and writes its output in the query's layout
/// (half precision; in float32 `[B, S, H, D]`, [`SDPA_F32_LAYOUT`]). Eager attention
/// (HF BERT/GPT-2: `q @ kᵀ` then a division) does not match and is differentiated op
/// by op, as PyTorch does.
pub(super) fn find_sdpa(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let g = &model.graph;
    let mut out = Vec::new();
    let is_const = |t: TensorId| inf.facts[t].value.is_some() || g.tensor(t).init.is_some();
    let producer = |t: TensorId| g.tensor(t).producer;
    let out0 = |n: NodeIndex| g.node(n).outputs.first().copied().flatten();
    for &sm in &g.order {
        if g.node(sm).op_type != "Softmax" {
            continue;
        }
        let mut pattern = vec![sm];
        let Some(mut src) = g
            .node(sm)
            .inputs
            .first()
            .copied()
            .flatten()
            .and_then(producer)
        else {
            continue;
        };
        let masked = g.node(src).op_type == "Add";
        if masked {
            pattern.push(src);
            let next = g
                .node(src)
                .inputs
                .iter()
                .flatten()
                .find_map(|&t| producer(t).filter(|&p| g.node(p).op_type == "MatMul"));
            let Some(p) = next else { continue };
            src = p;
        }
        if g.node(src).op_type != "MatMul" {
            continue;
        }
        let m1 = src;
        // Both operands scaled by a constant: the exporter's SDPA signature.
        let scaled: Option<Vec<TensorId>> = g
            .node(m1)
            .inputs
            .iter()
            .map(|t| {
                let p = producer((*t)?)?;
                let n = g.node(p);
                if n.op_type != "Mul" {
                    return None;
                }
                let ins: Vec<TensorId> = n.inputs.iter().flatten().copied().collect();
                let var: Vec<TensorId> = ins.iter().copied().filter(|&t| !is_const(t)).collect();
                (ins.len() == 2 && var.len() == 1).then(|| {
                    pattern.push(p);
                    var[0]
                })
            })
            .collect();
        let Some(qk) = scaled else { continue };
        let Some(mut probs) = out0(sm) else { continue };
        let mut uses = consumers(model, probs);
        if let [d] = uses.as_slice() {
            if g.node(*d).op_type == "Dropout" {
                pattern.push(*d);
                let Some(p) = out0(*d) else { continue };
                probs = p;
                uses = consumers(model, probs);
            }
        }
        let [m2] = uses.as_slice() else { continue };
        let m2n = g.node(*m2);
        if m2n.op_type != "MatMul" || m2n.inputs.first() != Some(&Some(probs)) {
            continue;
        }
        let (Some(v), Some(o)) = (m2n.inputs.get(1).copied().flatten(), out0(*m2)) else {
            continue;
        };
        let shape = &inf.facts[o].shape;
        if shape.len() != 4 {
            continue;
        }
        pattern.push(m1);
        pattern.push(*m2);
        let lse = Fact::new(DType::F32, shape[..3].to_vec());
        // Flash attention writes its output in its query's memory layout, which is
        // the layout the model's following transpose (back to tokens × features)
        // restores: that transpose and reshape are then views, as in PyTorch. With a
        // mask, flash attention does not apply and the memory-efficient kernel runs in
        // every precision ([`SDPA_F32_LAYOUT`]).
        let out_layout = if masked {
            Some(SDPA_F32_LAYOUT.to_vec())
        } else {
            match consumers(model, o).as_slice() {
                [t] if g.node(*t).op_type == "Transpose" => g
                    .node(*t)
                    .attrs
                    .ints("perm")
                    .filter(|p| p.len() == 4)
                    .map(|p| p.iter().map(|&d| d as usize).collect()),
                _ => None,
            }
        };
        out.push(FusedPattern {
            kind: FusedKind::Sdpa,
            nodes: pattern,
            reads: vec![qk[0], qk[1], v, o],
            extras: vec![lse],
            out_layout,
            fake_quant: None,
        });
    }
    out
}
