//! The exporter's decomposition of `scaled_dot_product_attention`, found as one fused
//! pattern, and the memory layout PyTorch's kernels write its output in.

use petgraph::stable_graph::NodeIndex;

use super::{consumers, FusedKind, FusedPattern, Fusion};
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::ops::Fact;

pub use crate::ops::attention::SDPA_F32_LAYOUT;

/// Finds attention written out by the TorchScript exporter's decomposition of
/// `scaled_dot_product_attention`: `MatMul(Mul(q, √s), Mul(kᵀ, √s))` → [Add mask] →
/// Softmax → [Dropout] → `MatMul(·, v)`. PyTorch runs it as one fused kernel
/// (flash attention) that saves q, k, v, the output and the per-row logsumexp
/// (float32, `[batch, heads, queries]`), and writes its output in the query's layout
/// (half precision; in float32 `[B, S, H, D]`, [`SDPA_F32_LAYOUT`]), and the additive
/// mask where there is one. Both exporters write a boolean mask as `Where(mask, 0,
/// -inf)` added to the scores and, below opset 23, zero fully masked rows after the
/// Softmax (`Where(IsNaN(p), 0, p)`): that guard is part of the pattern. Eager attention
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
        let mut masked = g.node(src).op_type == "Add";
        let mut mask = None;
        if masked {
            pattern.push(src);
            let next = g
                .node(src)
                .inputs
                .iter()
                .flatten()
                .find_map(|&t| producer(t).filter(|&p| g.node(p).op_type == "MatMul"));
            let Some(p) = next else { continue };
            // The additive mask: what PyTorch's kernel saves beside q, k and v
            // (`attn_mask` on the CPU, `attn_bias` in the memory-efficient kernel),
            // unless it is a constant.
            let scores = g.node(p).outputs.first().copied().flatten();
            mask = g
                .node(src)
                .inputs
                .iter()
                .flatten()
                .copied()
                .find(|&t| Some(t) != scores && !is_const(t));
            // `is_causal=True`, which the exporter writes as a mask it builds: the
            // kernel takes the flag, saves no mask, and flash attention applies.
            if mask.is_some_and(|t| causal_mask(model, t)) {
                mask = None;
                masked = false;
            }
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
            .enumerate()
            .map(|(slot, t)| {
                let p = producer((*t)?)?;
                let n = g.node(p);
                if n.op_type != "Mul" {
                    return None;
                }
                let ins: Vec<TensorId> = n.inputs.iter().flatten().copied().collect();
                let var: Vec<TensorId> = ins.iter().copied().filter(|&t| !is_const(t)).collect();
                (ins.len() == 2 && var.len() == 1).then(|| {
                    pattern.push(p);
                    // The kernel saves the key itself, not the exporter's transpose of it.
                    let k = match key_transposed(model, inf, var[0]).filter(|_| slot == 1) {
                        Some((k, nodes)) => {
                            pattern.extend(nodes);
                            k
                        }
                        None => var[0],
                    };
                    match gqa_expanded(model, inf, k).filter(|_| slot == 1) {
                        Some((k, nodes)) => {
                            pattern.extend(nodes);
                            k
                        }
                        None => k,
                    }
                })
            })
            .collect();
        let Some(qk) = scaled else { continue };
        let Some(mut probs) = out0(sm) else { continue };
        let mut uses = consumers(model, probs);
        // `Where(IsNaN(p), 0, p)`: the exporters' zeroing of fully masked rows after a
        // boolean mask (opsets 14 to 22), part of the kernel in PyTorch.
        if let Some((isnan, zeroed)) = nan_guard(model, inf, probs, &uses) {
            pattern.push(isnan);
            pattern.push(zeroed);
            let Some(p) = out0(zeroed) else { continue };
            probs = p;
            uses = consumers(model, probs);
        }
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
        let (Some(mut v), Some(o)) = (m2n.inputs.get(1).copied().flatten(), out0(*m2)) else {
            continue;
        };
        if let Some((x, nodes)) = gqa_expanded(model, inf, v) {
            pattern.extend(nodes);
            v = x;
        }
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
            reads: [qk[0], qk[1], v, o].into_iter().chain(mask).collect(),
            extras: vec![lse],
            out_layout,
            fake_quant: None,
        });
    }
    out
}

/// Whether `t` is the dynamo exporter's spelling of `is_causal=True` (onnxscript's
/// `aten_scaled_dot_product_attention`): `Where(Equal(Trilu(Expand(1, [L, S]),
/// upper=0), 0), -inf, 0)`, a mask made from shapes alone inside the attention call.
/// A mask the model builds and passes (Hugging Face's sliding window) is no Trilu's.
fn causal_mask(model: &Model, t: TensorId) -> bool {
    let g = &model.graph;
    let op_of = |t: TensorId, op: &str| {
        g.tensor(t)
            .producer
            .filter(|&p| g.node(p).op_type == op)
            .map(|p| g.node(p))
    };
    let Some(cond) = op_of(t, "Where").and_then(|w| w.inputs.first().copied().flatten()) else {
        return false;
    };
    op_of(cond, "Equal").is_some_and(|eq| {
        eq.inputs
            .iter()
            .flatten()
            .any(|&x| op_of(x, "Trilu").is_some_and(|tr| tr.attrs.int("upper").unwrap_or(1) == 0))
    })
}

/// The exporters' guard after a Softmax over boolean-masked scores: `IsNaN(p)` and
/// `Where(IsNaN(p), 0, p)` the only readers of `p`, the IsNaN read only by the Where.
/// Returns (IsNaN, Where).
fn nan_guard(
    model: &Model,
    inf: &Inferred,
    p: TensorId,
    uses: &[NodeIndex],
) -> Option<(NodeIndex, NodeIndex)> {
    let g = &model.graph;
    let (isnan, zeroed) = match uses {
        [a, b] if g.node(*a).op_type == "IsNaN" && g.node(*b).op_type == "Where" => (*a, *b),
        [a, b] if g.node(*b).op_type == "IsNaN" && g.node(*a).op_type == "Where" => (*b, *a),
        _ => return None,
    };
    let flag = g.node(isnan).outputs.first().copied().flatten()?;
    let zero = inf.facts[g.node(zeroed).inputs.get(1).copied().flatten()?]
        .value
        .as_ref()
        .filter(|v| v.data.len() == 1 && v.data.float(0) == 0.0);
    let wired = g.node(zeroed).inputs.first() == Some(&Some(flag))
        && g.node(zeroed).inputs.get(2) == Some(&Some(p))
        && consumers(model, flag) == [zeroed]
        && !g.outputs.contains(&p)
        && !g.outputs.contains(&flag);
    (wired && zero.is_some()).then_some((isnan, zeroed))
}

/// The dynamo exporter's `kᵀ` for a key of rank 4 (or more):
/// `Reshape(Transpose(Reshape(k, [-1, S, D]), [0, 2, 1]), [.., D, S])`, each inner
/// value read only by the next node. Returns `k` and the three nodes. (The flattening
/// reshape copies when `k` is a strided view, as the heads split from one projection
/// are; PyTorch's kernel reads `k` as it is.)
/// `enable_gqa=True` as the dynamo exporter writes it inside the attention call:
/// `Reshape(Expand(Unsqueeze(x, 2)))` from `[B, Hkv, S, D]` to `[B, Hkv·g, S, D]`.
/// PyTorch's kernel reads the grouped key or value itself and saves it, not a copy
/// repeated per head (Hugging Face passes the flag where there is no mask:
/// Phi-3-style fused qkv, seq 2048, saved a 4 MiB copy per layer and operand). The
/// expanded tensor is `x` and the three nodes are the kernel's.
fn gqa_expanded(model: &Model, inf: &Inferred, t: TensorId) -> Option<(TensorId, [NodeIndex; 3])> {
    let (reshape, expanded) = written_by(model, t, "Reshape")?;
    let (expand, unsq_t) = written_by(model, expanded, "Expand")?;
    let (unsq, x) = written_by(model, unsq_t, "Unsqueeze")?;
    let (xs, ts) = (&inf.facts[x].shape, &inf.facts[t].shape);
    let grouped = xs.len() == 4
        && ts.len() == 4
        && xs[0] == ts[0]
        && xs[2..] == ts[2..]
        && xs[1] > 0
        && ts[1] > xs[1]
        && ts[1] % xs[1] == 0
        && inf.facts[unsq_t].shape.len() == 5
        && inf.facts[unsq_t].shape[2] == 1;
    (grouped && only_reader(model, unsq_t, expand) && only_reader(model, expanded, reshape))
        .then_some((x, [unsq, expand, reshape]))
}

fn key_transposed(
    model: &Model,
    inf: &Inferred,
    t: TensorId,
) -> Option<(TensorId, [NodeIndex; 3])> {
    let (back, flat_t) = written_by(model, t, "Reshape")?;
    let (tr, flat) = written_by(model, flat_t, "Transpose")?;
    let (fwd, k) = written_by(model, flat, "Reshape")?;
    let perm = model.graph.node(tr).attrs.ints("perm")?;
    let (ks, ts) = (&inf.facts[k].shape, &inf.facts[t].shape);
    let n = ks.len();
    let swapped = n >= 2
        && ts.len() == n
        && ts[..n - 2] == ks[..n - 2]
        && ts[n - 2] == ks[n - 1]
        && ts[n - 1] == ks[n - 2];
    let rows: usize = ks[..n.saturating_sub(2)].iter().product();
    let ok = perm == [0, 2, 1]
        && swapped
        && inf.facts[flat].shape == [rows, ks[n - 2], ks[n - 1]]
        && only_reader(model, flat, tr)
        && only_reader(model, flat_t, back);
    ok.then_some((k, [fwd, tr, back]))
}

/// The `op` node that writes `t`, and that node's first input.
fn written_by(model: &Model, t: TensorId, op: &str) -> Option<(NodeIndex, TensorId)> {
    let g = &model.graph;
    let n = g.tensor(t).producer.filter(|&n| g.node(n).op_type == op)?;
    Some((n, g.node(n).inputs.first().copied().flatten()?))
}

/// Whether node `n` is the only reader of `t`, and `t` no graph output.
fn only_reader(model: &Model, t: TensorId, n: NodeIndex) -> bool {
    consumers(model, t) == [n] && !model.graph.outputs.contains(&t)
}

impl Fusion {
    /// Whether this flash attention's query (the tensor its output's layout follows)
    /// is contiguous as shaped: PyTorch computes it so after RoPE over a non-dense
    /// slice of a fused qkv projection (Phi-3), and the output then follows it.
    pub(in crate::train) fn follows_contiguous_query(
        &self,
        strides: &[Option<Vec<usize>>],
        inf: &Inferred,
    ) -> bool {
        self.layout_of.is_some_and(|q| {
            strides[q]
                .as_ref()
                .is_some_and(|st| crate::ops::layout::is_contiguous(&inf.facts[q].shape, st))
        })
    }
}
