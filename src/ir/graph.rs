//! The graph: op nodes in a petgraph `StableGraph`, values in a tensor table.
//!
//! petgraph iterates a node's edges in reverse insertion order, so an op's input
//! positions are never read from edges: each [`Node`] keeps its ordered
//! `inputs` and `outputs` (tensor ids), and each [`Edge`] records the slot it feeds.

use std::collections::BTreeMap;
use std::hash::BuildHasher;

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
    /// Tensor id by ONNX name ([`Graph::tensor_id`]).
    pub by_name: NameIndex,
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

/// Tensor ids by ONNX name. The keys are the tensor table's own names: the index
/// holds ids only, so each name is stored once (a second copy per tensor took a
/// reference count at load and gave it back when the graph was dropped).
#[derive(Clone, Default)]
pub struct NameIndex(hashbrown::HashTable<TensorId>);

fn name_hash(name: &str) -> u64 {
    NameHash::default().hash_one(name)
}

impl NameIndex {
    /// An empty index with room for `n` tensors.
    pub fn with_capacity(n: usize) -> NameIndex {
        NameIndex(hashbrown::HashTable::with_capacity(n))
    }

    /// Every tensor of `tensors` by its name (the last one where names repeat).
    pub fn of(tensors: &[TensorInfo]) -> NameIndex {
        let mut index = NameIndex::with_capacity(tensors.len());
        for id in 0..tensors.len() {
            index.insert(tensors, id);
        }
        index
    }

    /// The id of the tensor of `tensors` named `name`.
    pub fn get(&self, tensors: &[TensorInfo], name: &str) -> Option<TensorId> {
        self.0
            .find(name_hash(name), |&t| &*tensors[t].name == name)
            .copied()
    }

    /// Indexes `tensors[id]` by its name, in place of any tensor of that name.
    pub fn insert(&mut self, tensors: &[TensorInfo], id: TensorId) {
        let name: &str = &tensors[id].name;
        match self.0.entry(
            name_hash(name),
            |&t| &*tensors[t].name == name,
            |&t| name_hash(&tensors[t].name),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = id,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(id);
            }
        }
    }

    /// The ids indexed, in no particular order.
    pub fn ids(&self) -> impl Iterator<Item = TensorId> + '_ {
        self.0.iter().copied()
    }
}

impl std::fmt::Debug for NameIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<_> = self.ids().collect();
        ids.sort_unstable();
        f.debug_set().entries(ids).finish()
    }
}

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
    /// Nodes into which the exporter's optimizer folded a BatchNorm: the dynamo
    /// exporter's `FuseBatchNormInto*` rewrite rules, named in each node's
    /// `pkg.onnxscript.rewriter.rule_name` metadata. A training step of such a file
    /// has no BatchNorm there (the training step's `inference_export` says so).
    pub folded_batch_norms: usize,
    /// Float initializers the exporter's optimizer computed from several values
    /// (`pkg.onnxscript.optimizer.folded_from` in their `value_info` metadata names
    /// more than one: a rotary embedding's cos/sin tables folded from its
    /// `inv_freq` buffer), which memplan cannot tell from parameters and trains.
    pub folded_constants: usize,
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

    /// The id of the tensor named `name`.
    pub fn tensor_id(&self, name: &str) -> Option<TensorId> {
        self.by_name.get(&self.tensors, name)
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
