//! Phase 1: each node's backward rule and storage kind, in execution order, and the
//! fusions PyTorch runs as one kernel.

use super::super::fusion::{
    cast_backs, fake_quant_roles, fused_patterns, per_node, FakeQuantRole, FusedPattern, Fusion,
};
use super::super::TrainOptions;
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::ops::{self, registry, Backward, Cx, Fact};
use petgraph::stable_graph::NodeIndex;
use std::collections::HashMap;

/// Per-node facts the builder needs.
pub(super) struct NodeRule<'a> {
    pub(super) backward: std::result::Result<Option<Backward>, ops::RuleError>,
    pub(super) storage: ops::Storage,
    /// The op and its rule context (the backward's scratch is asked once the wanted
    /// gradients are known).
    pub(super) op: &'static dyn ops::Op,
    pub(super) cx: Cx<'a>,
}

/// The rules of every node and the model's fusions.
pub(super) struct Rules<'a> {
    /// Per forward step (execution order).
    pub(super) nodes: Vec<NodeRule<'a>>,
    /// The fused patterns recognised.
    pub(super) fused: Vec<FusedPattern>,
    /// What each fused node's kernel reads and saves.
    pub(super) fusions: HashMap<NodeIndex, Fusion>,
    /// Casts back to a norm's input type (`.to(input_dtype)`), under autocast: the
    /// tensor whose type the cast's output takes.
    pub(super) cast_back: HashMap<NodeIndex, TensorId>,
    /// Fake quantization: each node's pattern and role.
    pub(super) fq: HashMap<NodeIndex, (usize, FakeQuantRole)>,
    /// The pattern's integer values, which carry the gradient through (as views of
    /// the float input).
    pub(super) fq_carries: Vec<bool>,
}

impl<'a> Rules<'a> {
    pub(super) fn of(model: &'a Model, inf: &'a Inferred, opts: &TrainOptions) -> Rules<'a> {
        let g = &model.graph;
        let fused = fused_patterns(model, inf);
        let fusions = per_node(&fused);
        let cast_back = if opts.precision.is_amp() {
            cast_backs(model, &fused)
        } else {
            HashMap::new()
        };
        let fq = fake_quant_roles(&fused);
        let mut fq_carries = vec![false; g.tensors.len()];
        for (&n, &(_, role)) in &fq {
            if matches!(role, FakeQuantRole::Quantize | FakeQuantRole::Clip) {
                for &t in g.node(n).outputs.iter().flatten() {
                    fq_carries[t] = true;
                }
            }
        }
        let nodes = g
            .order
            .iter()
            .map(|&ix| node_rule(model, inf, ix, &fused, &fq))
            .collect();
        Rules {
            nodes,
            fused,
            fusions,
            cast_back,
            fq,
            fq_carries,
        }
    }

    /// Whether a gradient flows through `t`: a float tensor, or a fake
    /// quantization's integer values.
    pub(super) fn carries(&self, inf: &Inferred, t: TensorId) -> bool {
        inf.facts[t].dtype.is_float() || self.fq_carries[t]
    }
}

/// The rule of node `ix`: its op's backward (a fake quantization's own), storage
/// kind and context.
fn node_rule<'a>(
    model: &'a Model,
    inf: &'a Inferred,
    ix: NodeIndex,
    fused: &[FusedPattern],
    fq: &HashMap<NodeIndex, (usize, FakeQuantRole)>,
) -> NodeRule<'a> {
    let node = model.graph.node(ix);
    let op = registry()
        .get(&node.domain, &node.op_type)
        .expect("inferred model");
    let cx = Cx {
        node,
        inputs: node
            .inputs
            .iter()
            .map(|t| t.map(|t| &inf.facts[t]))
            .collect(),
        opset: model.opset(),
    };
    let outs: Vec<Fact> = node
        .outputs
        .iter()
        .map(|t| match t {
            Some(t) => inf.facts[*t].clone(),
            None => Fact::new(DType::F32, vec![]),
        })
        .collect();
    let fq_rule = fq.get(&ix).and_then(|&(k, role)| {
        let p = &fused[k];
        p.fake_quant.as_ref()?.rule(role, p.extras.first()?)
    });
    NodeRule {
        backward: match fq_rule {
            Some(bw) => Ok(Some(bw)),
            None => op.backward(&cx, &outs),
        },
        storage: op.storage(&cx),
        op,
        cx,
    }
}
