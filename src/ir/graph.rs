//! The graph: op nodes in a petgraph `StableGraph`, values in a tensor table.
//!
//! petgraph iterates a node's edges in reverse insertion order, so an op's input
//! positions are never read from edges: each [`Node`] keeps its ordered
//! `inputs` and `outputs` (tensor ids), and each [`Edge`] records the slot it feeds.

use std::collections::{BTreeMap, HashMap};

use petgraph::stable_graph::{NodeIndex, StableGraph};

use super::attr::Attrs;
pub use super::name::Name;
use super::tensor::{TensorId, TensorInfo, TensorKind};

/// A node's ordered inputs or outputs: inline up to `N` (no allocation for the
/// common node), on the heap beyond.
pub type Slots<const N: usize> = smallvec::SmallVec<[Option<TensorId>; N]>;

/// [`Node::inputs`].
pub type Inputs = Slots<3>;

/// [`Node::outputs`].
pub type Outputs = Slots<1>;

/// One op.
#[derive(Debug, Clone)]
pub struct Node {
    /// The node's name (generated as `<op_type>_<index>` when the model has none).
    pub name: Name,
    /// ONNX op type, e.g. `Conv`.
    pub op_type: Name,
    /// Op domain; `""` is the default ONNX domain.
    pub domain: Name,
    /// Ordered inputs; `None` where an optional input is omitted (`""` in ONNX).
    pub inputs: Inputs,
    /// Ordered outputs; `None` where an optional output is omitted.
    pub outputs: Outputs,
    /// Attributes.
    pub attrs: Attrs,
}

/// A data dependency: `tensor` flows from the source node into input `slot` of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edge {
    /// The tensor carried.
    pub tensor: TensorId,
    /// Input position at the consumer.
    pub slot: usize,
}

/// A model's main graph.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    /// Graph name.
    pub name: String,
    /// Op nodes and their data edges.
    pub nodes: StableGraph<Node, Edge>,
    /// Execution order: the model's node order when it is topological (as exporters
    /// write it), else a topological sort of the nodes.
    pub order: Vec<NodeIndex>,
    /// Whether the model's own node order was a valid topological order.
    pub model_order_is_topological: bool,
    /// Every tensor, indexed by [`TensorId`].
    pub tensors: Vec<TensorInfo>,
    /// Tensor id by ONNX name.
    pub by_name: HashMap<Name, TensorId, NameHash>,
    /// User-fed graph inputs (initializers excluded), in declaration order.
    pub inputs: Vec<TensorId>,
    /// Graph outputs, in declaration order.
    pub outputs: Vec<TensorId>,
}

/// The hash of name-keyed tables built at load ([`Graph::by_name`], the op
/// registry): rustc's FxHash (the `rustc-hash` crate), several times faster than
/// the standard library's SipHash on short strings. Names come from the model file
/// being read; resisting crafted collisions is not worth that time here.
pub type NameHash = rustc_hash::FxBuildHasher;

/// A loaded model: header facts and the graph.
#[derive(Debug, Clone)]
pub struct Model {
    /// `ir_version`.
    pub ir_version: i64,
    /// Opset version per domain (`""` is the default ONNX domain).
    pub opsets: BTreeMap<String, i64>,
    /// `producer_name` and `producer_version`, joined.
    pub producer: String,
    /// The main graph.
    pub graph: Graph,
}

impl Model {
    /// Opset of the default ONNX domain (0 if the model imports none).
    pub fn opset(&self) -> i64 {
        self.opsets.get("").copied().unwrap_or(0)
    }
}

impl Graph {
    /// The node at `ix`.
    pub fn node(&self, ix: NodeIndex) -> &Node {
        &self.nodes[ix]
    }

    /// The tensor with id `t`.
    pub fn tensor(&self, t: TensorId) -> &TensorInfo {
        &self.tensors[t]
    }

    /// Ids of the tensors of a given kind.
    pub fn tensors_of(&self, kind: TensorKind) -> impl Iterator<Item = TensorId> + '_ {
        (0..self.tensors.len()).filter(move |&t| self.tensors[t].kind == kind)
    }

    /// For each tensor, the position in [`Graph::order`] of the last node that reads
    /// it (`None`: nothing reads it); the last entry of [`Graph::uses_by_step`]'s
    /// lists, without building them.
    pub fn last_use_step(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.tensors.len()];
        for (step, &ix) in self.order.iter().enumerate() {
            for &t in self.nodes[ix].inputs.iter().flatten() {
                last[t] = Some(step);
            }
        }
        last
    }

    /// For each tensor, the positions in [`Graph::order`] of the nodes that read it.
    pub fn uses_by_step(&self) -> Vec<Vec<usize>> {
        let mut uses = vec![Vec::new(); self.tensors.len()];
        for (step, &ix) in self.order.iter().enumerate() {
            for t in self.nodes[ix].inputs.iter().flatten() {
                if uses[*t].last() != Some(&step) {
                    uses[*t].push(step);
                }
            }
        }
        uses
    }
}
