//! Control flow and sequences, lowered to plain ops once shapes are known.
//!
//! memplan plans one training step of a fixed graph, so what ONNX expresses with
//! subgraphs or sequences must become plain tensors first. [`lower`] walks the
//! graph in execution order, inferring as it goes (the walk knows every shape and
//! every folded value up to the node it lowers), and rewrites:
//!
//! - `If` whose condition is known before the run (a constant, or folded from
//!   shapes): the branch taken is inlined; its outputs feed the If's outputs.
//! - `Loop` with a static trip count (`M` constant, or a condition that folds on
//!   every iteration): unrolled, iteration by iteration; scan outputs are stacked
//!   along a new axis 0 (Unsqueeze + Concat), as ONNX Runtime does.
//! - `Scan` (opset 9 on): unrolled over the scan axis; each iteration reads a
//!   Gather of its slice, scan outputs are stacked along their axes.
//! - Sequences whose lengths are static: a sequence becomes the list of tensors it
//!   holds. `SplitToSequence` becomes one Slice (and Squeeze, `keepdims=0`) per
//!   element, `SequenceConstruct`/`Insert`/`Erase`/`Empty` edit the list,
//!   `SequenceAt` an Identity of the element, `SequenceLength` a constant and
//!   `ConcatFromSequence` a Concat (Unsqueeze first with `new_axis=1`).
//!
//! - Optionals: `Optional` wraps a tensor or nothing, `OptionalHasElement` becomes
//!   a constant, `OptionalGetElement` an Identity of the tensor.
//! - Slice assignments: a `ScatterND` whose indices are a box's coordinate grid
//!   becomes a `SliceScatter` (domain `ai.memplan.lowered`) and the grid's nodes go
//!   ([`scatter`]); so do integer tensors read only by `Shape` (their shapes are
//!   known). A model with a `ScatterND` is walked for this; when nothing changes
//!   it is returned as it was.
//!
//! What does not fold is refused in one line naming the node: a condition or trip
//! count that depends on input values, a sequence position that does, a sequence
//! read by any other op. A graph input or output that is a sequence is refused at
//! load ([`crate::error::Error::UnsupportedType`]).
//!
//! Inlined nodes are named `<node>/<branch or iteration>/<name>`; subgraph
//! initializers become constants, once per subgraph (not once per iteration).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use petgraph::stable_graph::NodeIndex;
use prost::Message;

use crate::error::{Error, Result};
use crate::infer::{check_supported, infer_node, initial_facts, Bindings};
use crate::ir::{
    Attr, Attrs, DType, Data, Edge, Model, Node, Payload, TensorData, TensorId, TensorInfo,
    TensorKind,
};
use crate::numeric::RuleError;
use crate::onnx::load::{attrs_of, tensor_data};
use crate::onnx::proto::GraphProto;
use crate::ops::{shape::literal_fact, Fact};

mod scatter;
mod sequence;

/// The op types [`lower`] rewrites (default domain).
pub const LOWERED: &[&str] = &[
    "If",
    "Loop",
    "Scan",
    "SequenceAt",
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceErase",
    "SequenceInsert",
    "SequenceLength",
    "SplitToSequence",
    "ConcatFromSequence",
    "Optional",
    "OptionalHasElement",
    "OptionalGetElement",
];

/// Most iterations one Loop or Scan is unrolled to.
pub const MAX_ITERATIONS: usize = 10_000;

/// Most nodes lowering may add to a graph (unrolled loops and scans, inlined
/// branches): about a gigabyte of graph. A 4.4 KB model whose Loop unrolled to 2
/// million nodes took 26 s and 5.9 GB before this bound.
pub const MAX_ADDED_NODES: usize = 300_000;

/// Whether `lower` rewrites this node.
pub fn is_lowered(n: &Node) -> bool {
    n.domain.is_empty() && LOWERED.contains(&n.op_type.as_str())
}

/// Whether the model holds anything [`lower`] may rewrite: control flow, sequences,
/// a `ScatterND` (a slice assignment when its indices are a box's grid), or a
/// convolution bias the dynamo exporter made of zeros in a shape Conv does not take
/// ([`zero_bias_shape`]).
pub fn needs_lowering(model: &Model) -> bool {
    let g = &model.graph;
    g.order.iter().any(|&ix| {
        let n = g.node(ix);
        is_lowered(n)
            || scatter::may_be_slice(model, n)
            || may_be_zero_bias(model, n)
            || upcast_of_softmax(model, ix).is_some()
    })
}

/// `softmax(x, dim, dtype=torch.float32)` (Hugging Face's eager attention on a half
/// `x`), which the dynamo exporter writes as `Cast(Softmax(x), to=FLOAT)`: PyTorch
/// converts `x` to float32 first, then computes and saves the softmax in float32
/// (SoftmaxBackward0 keeps the float32 result). [`lower`] swaps the two nodes where
/// `x` is half, so that the graph computes as PyTorch does: `Softmax(Cast(x))`. The
/// Cast node of `Softmax ix` when it is that Softmax's only reader.
fn upcast_of_softmax(model: &Model, ix: NodeIndex) -> Option<NodeIndex> {
    let g = &model.graph;
    let n = g.node(ix);
    if !(n.domain.is_empty() && n.op_type == "Softmax") {
        return None;
    }
    let out = n.outputs.first().copied().flatten()?;
    if g.outputs.contains(&out) {
        return None;
    }
    let mut readers = g
        .nodes
        .edges_directed(ix, petgraph::Direction::Outgoing)
        .map(|e| petgraph::visit::EdgeRef::target(&e));
    let c = readers.next()?;
    if readers.any(|r| r != c) {
        return None;
    }
    let cast = g.node(c);
    let to_float = cast.domain.is_empty()
        && cast.op_type == "Cast"
        && cast.attrs.int("to") == Some(1) // ONNX FLOAT
        && cast.inputs.first() == Some(&Some(out));
    to_float.then_some(c)
}

/// A Conv or ConvTranspose whose bias an `Expand` writes to a shape a `Concat`
/// builds: how the dynamo exporter writes a missing conv3d bias
/// (onnxscript's `aten_conv3d`: zeros expanded to `[M, 2]`, which the ONNX Conv
/// spec, a 1-D `[M]` bias, does not allow). [`lower`] drops such a bias when it
/// folds to zeros: PyTorch's convolution has none.
fn may_be_zero_bias(model: &Model, n: &Node) -> bool {
    let g = &model.graph;
    let writer = |t: Option<&Option<TensorId>>, op: &str| {
        t.copied()
            .flatten()
            .and_then(|t| g.tensor(t).producer)
            .map(|p| g.node(p))
            .filter(|w| w.domain.is_empty() && w.op_type == op)
    };
    n.domain.is_empty()
        && matches!(n.op_type.as_str(), "Conv" | "ConvTranspose")
        && writer(n.inputs.get(2), "Expand")
            .is_some_and(|e| writer(e.inputs.get(1), "Concat").is_some())
}

/// For [`may_be_zero_bias`]: the bias is all zeros and not the 1-D bias Conv takes.
fn zero_bias_shape(bias: &Fact) -> bool {
    bias.rank() != 1
        && bias
            .value
            .as_ref()
            .is_some_and(|v| (0..v.data.len()).all(|i| v.data.float(i) == 0.0))
}

/// The model with control flow and sequences lowered for these bindings; the model
/// itself when it has none (no copy, no inference).
pub fn lower<'m>(model: &'m Model, b: &Bindings) -> Result<Cow<'m, Model>> {
    if !needs_lowering(model) {
        return Ok(Cow::Borrowed(model));
    }
    check_supported(model)?;
    let (facts, _, _) = initial_facts(model, b)?;
    let mut m = model.clone();
    let order = std::mem::take(&mut m.graph.order);
    let mut l = Lowering {
        m,
        facts,
        seqs: HashMap::new(),
        optionals: HashMap::new(),
        order: Vec::with_capacity(order.len()),
        removed: Vec::new(),
        scopes: Vec::new(),
        consts: HashMap::new(),
        decoded: HashMap::new(),
        grids: Vec::new(),
        shaped: Vec::new(),
        changed: false,
        routing: b.routing.unwrap_or_default(),
        initial_nodes: 0,
    };
    l.initial_nodes = l.m.graph.nodes.node_count();
    for ix in order {
        l.process(ix)?;
    }
    if let Some(&t) =
        l.m.graph
            .outputs
            .iter()
            .find(|t| l.seqs.contains_key(t) || l.optionals.contains_key(t))
    {
        return Err(Error::UnsupportedType {
            role: "output",
            tensor: l.m.graph.tensor(t).name.to_string(),
            kind: if l.seqs.contains_key(&t) {
                "sequence"
            } else {
                "optional"
            },
        });
    }
    if l.removed.is_empty() && !l.changed {
        // Scatters that are no slice assignment, and nothing else: unchanged.
        return Ok(Cow::Borrowed(model));
    }
    Ok(Cow::Owned(l.finish()))
}

/// [`lower`] by value: the model itself when it has nothing to lower.
pub fn lowered(model: Model, b: &Bindings) -> Result<Model> {
    if needs_lowering(&model) {
        Ok(lower(&model, b)?.into_owned())
    } else {
        Ok(model)
    }
}

struct Lowering {
    m: Model,
    /// The routing assumption that sizes experts' token selections.
    routing: crate::moe::Routing,
    /// Nodes before lowering ([`MAX_ADDED_NODES`] bounds what it adds).
    initial_nodes: usize,
    /// One fact per tensor, as inference gives them (sequences have none).
    facts: Vec<Option<Fact>>,
    /// The tensors each sequence-valued tensor holds.
    seqs: HashMap<TensorId, Vec<TensorId>>,
    /// What each optional-valued tensor holds (`None`: empty).
    optionals: HashMap<TensorId, Option<TensorId>>,
    /// The new execution order.
    order: Vec<NodeIndex>,
    /// Nodes replaced by what they lower to.
    removed: Vec<NodeIndex>,
    /// Name scopes of the subgraphs being inlined, innermost last.
    scopes: Vec<HashMap<String, TensorId>>,
    /// Subgraph initializers already made constants: (subgraph, name).
    consts: HashMap<(usize, String), TensorId>,
    /// Subgraphs decoded, by the address of their encoding.
    decoded: HashMap<usize, Arc<GraphProto>>,
    /// The index grids of the scatters made slice assignments ([`scatter`]), and
    /// the zero biases dropped ([`may_be_zero_bias`]): their nodes go once nothing
    /// else reads them.
    grids: Vec<TensorId>,
    /// What the `Shape` nodes near those scatters read: tensors that may be needed
    /// for their shapes alone.
    shaped: Vec<TensorId>,
    /// A node was changed in place (a zero bias dropped).
    changed: bool,
}

/// Where a node's failure is reported.
fn fail(n: &Node, reason: impl Into<String>) -> Error {
    Error::node(&n.name, &n.op_type, reason)
}

/// A node whose lowering depends on input values.
fn value_dependent(n: &Node, reason: &str) -> Error {
    Error::rule(
        &n.name,
        &n.op_type,
        RuleError::ValueDependent(reason.to_string()),
    )
}

impl Lowering {
    fn node(&self, ix: NodeIndex) -> &Node {
        &self.m.graph.nodes[ix]
    }

    fn name(&self, t: TensorId) -> &str {
        &self.m.graph.tensors[t].name
    }

    fn fact(&self, t: TensorId) -> Option<&Fact> {
        self.facts[t].as_ref()
    }

    /// Infers a plain node or lowers one [`LOWERED`] node (recursively: what it
    /// lowers to is processed before this returns).
    fn process(&mut self, ix: NodeIndex) -> Result<()> {
        if self.m.graph.nodes.node_count() > self.initial_nodes + MAX_ADDED_NODES {
            return Err(Error::Graph(format!(
                "lowering control flow adds more than {MAX_ADDED_NODES} nodes, the most memplan unrolls"
            )));
        }
        let node = self.node(ix).clone();
        if is_lowered(&node) {
            self.removed.push(ix);
            return match node.op_type.as_str() {
                "If" => self.lower_if(&node),
                "Loop" => self.lower_loop(&node),
                "Scan" => self.lower_scan(&node),
                "Optional" | "OptionalHasElement" | "OptionalGetElement" => {
                    self.lower_optional(&node)
                }
                _ => self.lower_sequence(&node),
            };
        }
        if let Some(t) = node
            .inputs
            .iter()
            .flatten()
            .find(|t| self.seqs.contains_key(t))
        {
            if node.op_type == "Identity" && node.domain.is_empty() {
                self.removed.push(ix);
                return self.link(*t, node.outputs.first().copied().flatten(), &node.name);
            }
            return Err(fail(
                &node,
                format!(
                    "reads the sequence '{}': memplan lowers sequences only through the \
                     Sequence ops, If, Loop and Scan",
                    self.name(*t)
                ),
            ));
        }
        if scatter::may_be_slice(&self.m, &node) && self.lower_box_scatter(ix, &node)? {
            return Ok(());
        }
        if let Some(cast) = upcast_of_softmax(&self.m, ix) {
            let x = node.inputs.first().copied().flatten();
            let half = x
                .and_then(|x| self.facts[x].as_ref())
                .is_some_and(|f| matches!(f.dtype, DType::F16 | DType::BF16));
            if half {
                let g = &mut self.m.graph;
                let cast_attrs = std::mem::take(&mut g.nodes[cast].attrs);
                g.nodes[cast].op_type = "Softmax".into();
                g.nodes[cast].attrs = std::mem::replace(&mut g.nodes[ix].attrs, cast_attrs);
                g.nodes[ix].op_type = "Cast".into();
                self.changed = true;
            }
        }
        if may_be_zero_bias(&self.m, &node) {
            let bias = node.inputs[2].expect("a bias");
            if self.facts[bias].as_ref().is_some_and(zero_bias_shape) {
                self.m.graph.nodes[ix].inputs[2] = None;
                self.grids.push(bias);
                self.changed = true;
            }
        }
        infer_node(&self.m, ix, &mut self.facts, self.routing)?;
        self.order.push(ix);
        Ok(())
    }

    // ---- building --------------------------------------------------------------

    fn fresh_name(&self, base: &str) -> String {
        if self.m.graph.tensor_id(base).is_none() {
            return base.to_string();
        }
        (1..)
            .map(|k| format!("{base}#{k}"))
            .find(|n| self.m.graph.tensor_id(n).is_none())
            .expect("a free name")
    }

    fn add_tensor(&mut self, base: &str, kind: TensorKind, init: Option<TensorData>) -> TensorId {
        let name = self.fresh_name(base);
        let id = self.m.graph.tensors.len();
        self.facts.push(init.as_ref().map(literal_fact));
        self.m.graph.tensors.push(TensorInfo {
            name: name.into(),
            kind,
            declared_dtype: init.as_ref().map(|d| d.dtype),
            declared_shape: None,
            producer: None,
            init: init.map(Box::new),
            buffer: false,
        });
        self.m.graph.by_name.insert(&self.m.graph.tensors, id);
        id
    }

    /// A constant int64 (or bool) tensor.
    fn constant(&mut self, base: &str, dtype: DType, dims: Vec<usize>, v: Vec<i64>) -> TensorId {
        let data = TensorData {
            dtype,
            dims,
            payload: Payload::Typed(Data::Int(v)),
        };
        self.add_tensor(base, TensorKind::Constant, Some(data))
    }

    /// Adds a node writing `outputs` (their producer becomes it) and processes it.
    fn add_node(
        &mut self,
        name: &str,
        op_type: &str,
        inputs: Vec<Option<TensorId>>,
        outputs: Vec<Option<TensorId>>,
        attrs: Attrs,
    ) -> Result<NodeIndex> {
        self.insert_node(Node {
            name: name.into(),
            op_type: op_type.into(),
            domain: crate::ir::Name::new(),
            inputs: inputs.into(),
            outputs: outputs.into(),
            attrs,
        })
    }

    /// Adds `node` (its outputs' producer becomes it) and processes it.
    fn insert_node(&mut self, node: Node) -> Result<NodeIndex> {
        let outputs: Vec<TensorId> = node.outputs.iter().flatten().copied().collect();
        let ix = self.m.graph.nodes.add_node(node);
        for t in outputs {
            self.m.graph.tensors[t].producer = Some(ix);
        }
        self.process(ix)?;
        Ok(ix)
    }

    /// A new activation written by a new node `op_type` of `inputs`.
    fn op(
        &mut self,
        name: &str,
        op_type: &str,
        inputs: Vec<TensorId>,
        attrs: Vec<(&str, Attr)>,
    ) -> Result<TensorId> {
        let out = self.add_tensor(name, TensorKind::Activation, None);
        let attrs = attrs.into_iter().collect::<Attrs>();
        let inputs = inputs.into_iter().map(Some).collect();
        self.add_node(name, op_type, inputs, vec![Some(out)], attrs)?;
        Ok(out)
    }

    /// `x` with a new axis of size 1 at `axis` (an input from opset 13, before it
    /// an attribute).
    fn unsqueeze(&mut self, name: &str, x: TensorId, axis: i64) -> Result<TensorId> {
        if self.m.opset() >= 13 {
            let axes = self.constant(&format!("{name}/axes"), DType::I64, vec![1], vec![axis]);
            self.op(name, "Unsqueeze", vec![x, axes], vec![])
        } else {
            self.op(
                name,
                "Unsqueeze",
                vec![x],
                vec![("axes", Attr::Ints(vec![axis]))],
            )
        }
    }

    /// `parts` stacked along a new axis `axis`.
    fn stack(&mut self, name: &str, parts: &[TensorId], axis: i64, out: TensorId) -> Result<()> {
        let mut ups = Vec::with_capacity(parts.len());
        for (i, &p) in parts.iter().enumerate() {
            ups.push(self.unsqueeze(&format!("{name}/unsqueeze{i}"), p, axis)?);
        }
        let attrs = Attrs::from([("axis", Attr::Int(axis))]);
        self.add_node(
            name,
            "Concat",
            ups.into_iter().map(Some).collect(),
            vec![Some(out)],
            attrs,
        )?;
        Ok(())
    }

    /// Makes `to` hold what `from` holds: the same list for a sequence, an Identity
    /// for a tensor.
    fn link(&mut self, from: TensorId, to: Option<TensorId>, name: &str) -> Result<()> {
        let Some(to) = to else { return Ok(()) };
        if let Some(list) = self.seqs.get(&from).cloned() {
            self.seqs.insert(to, list);
            return Ok(());
        }
        if let Some(&held) = self.optionals.get(&from) {
            self.optionals.insert(to, held);
            return Ok(());
        }
        self.add_node(
            &format!("{name}/{}", self.name(to)),
            "Identity",
            vec![Some(from)],
            vec![Some(to)],
            Attrs::default(),
        )?;
        Ok(())
    }

    /// The constant integers a tensor holds, if they are known before the run.
    fn ints_of(&self, t: TensorId) -> Option<Vec<i64>> {
        self.fact(t)?.value.as_ref().map(|v| v.to_ints())
    }

    // ---- subgraphs -------------------------------------------------------------

    /// The subgraph attribute `name` of `n`, decoded once.
    fn subgraph(&mut self, n: &Node, name: &str) -> Result<Arc<GraphProto>> {
        let bytes = n
            .attrs
            .graph(name)
            .ok_or_else(|| fail(n, format!("has no {name} subgraph")))?;
        let key = bytes.as_ptr() as usize;
        if let Some(g) = self.decoded.get(&key) {
            return Ok(g.clone());
        }
        let g = Arc::new(
            GraphProto::decode(bytes.clone())
                .map_err(|e| fail(n, format!("its {name} subgraph does not decode ({e})")))?,
        );
        self.decoded.insert(key, g.clone());
        Ok(g)
    }

    fn resolve(&self, name: &str) -> Option<TensorId> {
        self.scopes
            .iter()
            .rev()
            .find_map(|s| s.get(name).copied())
            .or_else(|| self.m.graph.tensor_id(name))
    }

    /// Inlines `body` with its inputs bound to `bound`; returns its outputs.
    fn inline(
        &mut self,
        owner: &Node,
        prefix: &str,
        body: &Arc<GraphProto>,
        bound: &[TensorId],
    ) -> Result<Vec<TensorId>> {
        if body.input.len() != bound.len() {
            return Err(fail(
                owner,
                format!(
                    "its subgraph '{}' takes {} inputs, the node gives it {}",
                    body.name(),
                    body.input.len(),
                    bound.len()
                ),
            ));
        }
        if !body.sparse_initializer.is_empty() {
            return Err(fail(owner, "its subgraph has sparse initializers"));
        }
        let mut scope: HashMap<String, TensorId> = HashMap::new();
        for (vi, &t) in body.input.iter().zip(bound) {
            scope.insert(vi.name().to_string(), t);
        }
        let key = Arc::as_ptr(body) as usize;
        for init in &body.initializer {
            let name = init.name().to_string();
            let t = match self.consts.get(&(key, name.clone())) {
                Some(&t) => t,
                None => {
                    let data = tensor_data(init)
                        .map_err(|e| fail(owner, format!("subgraph initializer '{name}': {e}")))?;
                    let t = self.add_tensor(
                        &format!("{}/{name}", owner.name),
                        TensorKind::Constant,
                        Some(data),
                    );
                    self.consts.insert((key, name.clone()), t);
                    t
                }
            };
            scope.insert(name, t);
        }
        self.scopes.push(scope);
        let result = self.inline_nodes(prefix, body);
        let scope = self.scopes.pop().expect("pushed above");
        result?;
        body.output
            .iter()
            .map(|vi| {
                let name = vi.name();
                scope
                    .get(name)
                    .copied()
                    .or_else(|| self.resolve(name))
                    .ok_or_else(|| {
                        fail(
                            owner,
                            format!("its subgraph's output '{name}' is not computed"),
                        )
                    })
            })
            .collect()
    }

    fn inline_nodes(&mut self, prefix: &str, body: &GraphProto) -> Result<()> {
        for (i, n) in body.node.iter().enumerate() {
            let op_type = n.op_type().to_string();
            let name = match n.name() {
                "" => format!("{prefix}{op_type}_{i}"),
                s => format!("{prefix}{s}"),
            };
            let domain = match n.domain() {
                "ai.onnx" => "",
                d => d,
            }
            .to_string();
            let attrs = attrs_of(n, &name)?;
            let mut inputs = Vec::with_capacity(n.input.len());
            for inp in &n.input {
                if inp.is_empty() {
                    inputs.push(None);
                    continue;
                }
                let t = self.resolve(inp).ok_or_else(|| {
                    Error::node(&name, &op_type, format!("reads undefined tensor '{inp}'"))
                })?;
                inputs.push(Some(t));
            }
            let mut outputs = Vec::with_capacity(n.output.len());
            for o in &n.output {
                if o.is_empty() {
                    outputs.push(None);
                    continue;
                }
                let kind = if op_type == "Constant" && domain.is_empty() {
                    TensorKind::Constant
                } else {
                    TensorKind::Activation
                };
                let t = self.add_tensor(&format!("{prefix}{o}"), kind, None);
                self.scopes
                    .last_mut()
                    .expect("inside a scope")
                    .insert(o.clone(), t);
                outputs.push(Some(t));
            }
            self.insert_node(Node {
                name: name.into(),
                op_type: op_type.into(),
                domain: domain.into(),
                inputs: inputs.into(),
                outputs: outputs.into(),
                attrs,
            })?;
        }
        Ok(())
    }

    // ---- control flow ----------------------------------------------------------

    fn lower_if(&mut self, n: &Node) -> Result<()> {
        let cond = n.inputs.first().copied().flatten();
        let value = cond.and_then(|c| self.ints_of(c));
        let Some(v) = value.filter(|v| v.len() == 1) else {
            return Err(value_dependent(
                n,
                "its condition depends on input values: memplan plans one fixed graph and \
                 folds only an If whose condition is known before the run",
            ));
        };
        let branch = if v[0] != 0 {
            "then_branch"
        } else {
            "else_branch"
        };
        let body = self.subgraph(n, branch)?;
        let outs = self.inline(n, &format!("{}/{branch}/", n.name), &body, &[])?;
        if outs.len() != n.outputs.len() {
            return Err(fail(
                n,
                format!(
                    "its {branch} has {} outputs for the node's {}",
                    outs.len(),
                    n.outputs.len()
                ),
            ));
        }
        for (o, &to) in outs.into_iter().zip(&n.outputs) {
            self.link(o, to, &n.name)?;
        }
        Ok(())
    }

    fn lower_loop(&mut self, n: &Node) -> Result<()> {
        let body = self.subgraph(n, "body")?;
        let carried: Vec<TensorId> = n
            .inputs
            .iter()
            .skip(2)
            .map(|t| t.ok_or(()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| fail(n, "a loop-carried input is empty"))?;
        let nv = carried.len();
        if body.input.len() != nv + 2 || body.output.len() < nv + 1 {
            return Err(fail(
                n,
                format!(
                    "its body takes {} inputs and gives {} outputs for {nv} loop-carried values",
                    body.input.len(),
                    body.output.len()
                ),
            ));
        }
        let k = body.output.len() - 1 - nv;
        let trip = match n.inputs.first().copied().flatten() {
            None => None,
            Some(m) => match self.ints_of(m).filter(|v| v.len() == 1) {
                Some(v) => Some(v[0].max(0) as u64),
                None => {
                    return Err(value_dependent(
                        n,
                        "its trip count depends on input values: memplan unrolls only a Loop \
                         whose trip count is known before the run",
                    ))
                }
            },
        };
        let not_static = || {
            value_dependent(
                n,
                "its condition depends on input values: memplan unrolls only a Loop whose \
                 iterations are known before the run",
            )
        };
        let mut cond = match n.inputs.get(1).copied().flatten() {
            Some(c) => c,
            None => self.constant(&format!("{}/cond", n.name), DType::Bool, vec![], vec![1]),
        };
        let mut values = carried;
        let mut scans: Vec<Vec<TensorId>> = vec![Vec::new(); k];
        let mut it = 0u64;
        loop {
            let go = self
                .ints_of(cond)
                .filter(|v| v.len() == 1)
                .ok_or_else(not_static)?;
            if go[0] == 0 || trip.is_some_and(|m| it >= m) {
                break;
            }
            if it as usize >= MAX_ITERATIONS {
                return Err(fail(
                    n,
                    format!("runs more than {MAX_ITERATIONS} iterations, the most memplan unrolls"),
                ));
            }
            let iter_t = self.constant(
                &format!("{}/{it}/iter", n.name),
                DType::I64,
                vec![],
                vec![it as i64],
            );
            let mut bound = vec![iter_t, cond];
            bound.extend(&values);
            let outs = self.inline(n, &format!("{}/{it}/", n.name), &body, &bound)?;
            cond = outs[0];
            values = outs[1..1 + nv].to_vec();
            for (j, s) in scans.iter_mut().enumerate() {
                s.push(outs[1 + nv + j]);
            }
            it += 1;
        }
        for (i, &v) in values.iter().enumerate() {
            self.link(v, n.outputs.get(i).copied().flatten(), &n.name)?;
        }
        for (j, parts) in scans.iter().enumerate() {
            let Some(out) = n.outputs.get(nv + j).copied().flatten() else {
                continue;
            };
            if parts.is_empty() {
                return Err(fail(
                    n,
                    "runs no iteration, so the shape of its scan outputs is unknown",
                ));
            }
            self.stack(&format!("{}/scan{j}", n.name), parts, 0, out)?;
        }
        Ok(())
    }

    fn lower_scan(&mut self, n: &Node) -> Result<()> {
        let body = self.subgraph(n, "body")?;
        // Opset 8: a first input sequence_lens, every other input batch-major (the
        // scan axis is 1), one `directions` list.
        let v8 = self.m.opset() < 9;
        let inputs: Vec<TensorId> = n.inputs[usize::from(v8)..]
            .iter()
            .map(|t| t.ok_or_else(|| fail(n, "has an empty input")))
            .collect::<Result<_>>()?;
        let m = n.attrs.int("num_scan_inputs").unwrap_or(0);
        if m < 1 || m as usize > inputs.len() {
            return Err(fail(n, format!("num_scan_inputs {m} is out of range")));
        }
        let m = m as usize;
        let ns = inputs.len() - m;
        if body.input.len() != inputs.len() || body.output.len() < ns {
            return Err(fail(
                n,
                "its body's inputs and outputs do not match the node's",
            ));
        }
        let k = body.output.len() - ns;
        let list = |name: &str, len: usize| -> Result<Vec<i64>> {
            let v = n
                .attrs
                .ints(name)
                .map(<[i64]>::to_vec)
                .unwrap_or(vec![0; len]);
            if v.len() != len {
                return Err(fail(
                    n,
                    format!("'{name}' has {} entries for {len}", v.len()),
                ));
            }
            Ok(v)
        };
        let xs = inputs[ns..].to_vec();
        if v8 {
            let dirs = list("directions", m)?;
            return self.lower_scan8(n, &body, &inputs[..ns], &xs, &dirs, k);
        }
        let (in_axes, in_dirs) = (
            list("scan_input_axes", m)?,
            list("scan_input_directions", m)?,
        );
        let (out_axes, out_dirs) = (
            list("scan_output_axes", k)?,
            list("scan_output_directions", k)?,
        );
        let mut axes = Vec::with_capacity(m);
        for (j, &x) in xs.iter().enumerate() {
            let r = self.fact(x).map_or(0, Fact::rank) as i64;
            let a = in_axes[j];
            if !(-r..r).contains(&a) {
                return Err(fail(
                    n,
                    format!("scan_input_axes {a} is out of range for rank {r}"),
                ));
            }
            axes.push(a.rem_euclid(r) as usize);
        }
        let (states, scans) = self.unroll_scan(
            n,
            &body,
            &n.name,
            inputs[..ns].to_vec(),
            &xs,
            &axes,
            &in_dirs,
            k,
        )?;
        for (i, &s) in states.iter().enumerate() {
            self.link(s, n.outputs.get(i).copied().flatten(), &n.name)?;
        }
        for (j, mut parts) in scans.into_iter().enumerate() {
            let Some(out) = n.outputs.get(ns + j).copied().flatten() else {
                continue;
            };
            if out_dirs[j] != 0 {
                parts.reverse();
            }
            let r = self.fact(parts[0]).map_or(0, Fact::rank) as i64 + 1;
            let a = out_axes[j];
            if !(-r..r).contains(&a) {
                return Err(fail(
                    n,
                    format!("scan_output_axes {a} is out of range for rank {r}"),
                ));
            }
            self.stack(&format!("{}/scan{j}", n.name), &parts, a.rem_euclid(r), out)?;
        }
        Ok(())
    }

    /// Opset-8 Scan: the body runs per batch row (axis 0) over axis 1; states and
    /// scan outputs are stacked back over the rows. Every row must have the full
    /// length (`sequence_lens` absent or constant and equal to it).
    fn lower_scan8(
        &mut self,
        n: &Node,
        body: &Arc<GraphProto>,
        states: &[TensorId],
        xs: &[TensorId],
        dirs: &[i64],
        k: usize,
    ) -> Result<()> {
        let shape = |t: TensorId| self.fact(t).map(|f| f.shape.clone()).unwrap_or_default();
        let x0 = shape(xs[0]);
        if x0.len() < 2 {
            return Err(fail(n, "its scan inputs need a batch and a sequence axis"));
        }
        let (batch, len) = (x0[0], x0[1]);
        if let Some(sl) = n.inputs.first().copied().flatten() {
            let lens = self
                .ints_of(sl)
                .ok_or_else(|| value_dependent(n, "its sequence_lens depend on input values"))?;
            if lens.iter().any(|&l| l != len as i64) {
                return Err(fail(
                    n,
                    format!("sequence_lens {lens:?} shorter than the sequence axis ({len}) are not supported"),
                ));
            }
        }
        let mut row_states: Vec<Vec<TensorId>> = vec![Vec::new(); states.len()];
        let mut row_scans: Vec<Vec<TensorId>> = vec![Vec::new(); k];
        for b in 0..batch {
            let prefix = format!("{}/row{b}", n.name);
            let idx = self.constant(
                &format!("{prefix}/index"),
                DType::I64,
                vec![],
                vec![b as i64],
            );
            let row = |l: &mut Self, t: TensorId, what: &str| {
                l.op(
                    &format!("{prefix}/{what}"),
                    "Gather",
                    vec![t, idx],
                    vec![("axis", Attr::Int(0))],
                )
            };
            let mut st = Vec::with_capacity(states.len());
            for (i, &s) in states.iter().enumerate() {
                st.push(row(self, s, &format!("state{i}"))?);
            }
            let mut xr = Vec::with_capacity(xs.len());
            for (j, &x) in xs.iter().enumerate() {
                xr.push(row(self, x, &format!("input{j}"))?);
            }
            let axes = vec![0; xs.len()];
            let (fin, scans) = self.unroll_scan(n, body, &prefix, st, &xr, &axes, dirs, k)?;
            for (i, f) in fin.into_iter().enumerate() {
                row_states[i].push(f);
            }
            for (j, parts) in scans.into_iter().enumerate() {
                let t = self.add_tensor(&format!("{prefix}/scan{j}"), TensorKind::Activation, None);
                self.stack(&format!("{prefix}/scan{j}"), &parts, 0, t)?;
                row_scans[j].push(t);
            }
        }
        for (i, rows) in row_states.iter().chain(&row_scans).enumerate() {
            let Some(out) = n.outputs.get(i).copied().flatten() else {
                continue;
            };
            self.stack(&format!("{}/out{i}", n.name), rows, 0, out)?;
        }
        Ok(())
    }

    /// Runs `body` over the scan axis: `states` carried, each iteration reading one
    /// Gather of each of `xs` along `axes` (reversed where `dirs` is 1). Returns the
    /// final states and, per scan output, its value at each iteration.
    #[allow(clippy::too_many_arguments)]
    fn unroll_scan(
        &mut self,
        n: &Node,
        body: &Arc<GraphProto>,
        prefix: &str,
        mut states: Vec<TensorId>,
        xs: &[TensorId],
        axes: &[usize],
        dirs: &[i64],
        k: usize,
    ) -> Result<(Vec<TensorId>, Vec<Vec<TensorId>>)> {
        let mut len = None;
        for (&x, &a) in xs.iter().zip(axes) {
            let d = self
                .fact(x)
                .ok_or_else(|| fail(n, "a scan input has no shape"))?
                .shape[a];
            if len.is_some_and(|l| l != d) {
                return Err(fail(
                    n,
                    "its scan inputs differ in length along their scan axes",
                ));
            }
            len = Some(d);
        }
        let len = len.unwrap_or(0);
        if len == 0 {
            return Err(fail(
                n,
                "its scan axis is empty, so the shape of its outputs is unknown",
            ));
        }
        if len > MAX_ITERATIONS {
            return Err(fail(
                n,
                format!("runs {len} iterations, more than the {MAX_ITERATIONS} memplan unrolls"),
            ));
        }
        let ns = states.len();
        let mut scans: Vec<Vec<TensorId>> = vec![Vec::new(); k];
        for t in 0..len {
            let mut bound = states.clone();
            for (j, &x) in xs.iter().enumerate() {
                let i = if dirs[j] == 0 { t } else { len - 1 - t };
                let idx = self.constant(
                    &format!("{prefix}/{t}/index{j}"),
                    DType::I64,
                    vec![],
                    vec![i as i64],
                );
                let slice = self.op(
                    &format!("{prefix}/{t}/slice{j}"),
                    "Gather",
                    vec![x, idx],
                    vec![("axis", Attr::Int(axes[j] as i64))],
                )?;
                bound.push(slice);
            }
            let outs = self.inline(n, &format!("{prefix}/{t}/"), body, &bound)?;
            states = outs[..ns].to_vec();
            for (j, s) in scans.iter_mut().enumerate() {
                s.push(outs[ns + j]);
            }
        }
        Ok((states, scans))
    }

    // ---- the result --------------------------------------------------------------

    /// Drops the nodes that built the replaced scatters' grids: back from each grid,
    /// every node whose outputs nothing (left) reads and that is no graph output. An
    /// integer tensor read only by `Shape` nodes is no longer needed either (its
    /// shape is known: each such `Shape` becomes a `Constant` of it): the exporter
    /// adds a grid's pieces together (an int64 tensor the size of the box) only to
    /// take the broadcast shape of the update. Only the `Shape` nodes found near the
    /// replaced scatters are considered (`shape_seeds`), so that a model's other
    /// shape computations stay as they are.
    fn drop_grids(&mut self) {
        let g = &self.m.graph;
        let mut readers: HashMap<TensorId, Vec<NodeIndex>> = HashMap::new();
        for &ix in &self.order {
            for &t in g.nodes[ix].inputs.iter().flatten() {
                readers.entry(t).or_default().push(ix);
            }
        }
        let outputs: HashSet<TensorId> = g.outputs.iter().copied().collect();
        let gone: HashSet<NodeIndex> = self.removed.iter().copied().collect();
        let mut dropped = HashSet::new();
        let mut shaped = Vec::new();
        let mut work = std::mem::take(&mut self.grids);
        // What the Shape nodes near the scatters read may be needed for its shape alone.
        work.append(&mut self.shaped);
        while let Some(t) = work.pop() {
            let Some(p) = g.tensors[t].producer else {
                continue;
            };
            if gone.contains(&p) || dropped.contains(&p) {
                continue;
            }
            let live = |t: &TensorId| readers.get(t).is_some_and(|r| !r.is_empty());
            let n = &g.nodes[p];
            if n.outputs.iter().flatten().any(|o| outputs.contains(o)) {
                continue;
            }
            // Outputs read only by Shape nodes whose values are known: those
            // become constants.
            let only_shaped = n.outputs.iter().flatten().all(|o| {
                self.facts[*o].as_ref().is_some_and(|f| f.dtype.is_int())
                    && readers.get(o).into_iter().flatten().all(|&r| {
                        let rn = &g.nodes[r];
                        rn.op_type == "Shape"
                            && rn.domain.is_empty()
                            && matches!(rn.outputs.first(), Some(Some(s))
                                    if self.facts[*s].as_ref().is_some_and(|f| f.value.is_some()))
                    })
            });
            if n.outputs.iter().flatten().any(live) && !only_shaped {
                continue;
            }
            for o in n.outputs.iter().flatten() {
                shaped.extend(readers.remove(o).unwrap_or_default());
            }
            dropped.insert(p);
            for &i in n.inputs.iter().flatten() {
                if let Some(r) = readers.get_mut(&i) {
                    if let Some(k) = r.iter().position(|&x| x == p) {
                        r.swap_remove(k);
                    }
                }
                work.push(i);
            }
        }
        for ix in shaped {
            let out = self.m.graph.nodes[ix].outputs.first().copied().flatten();
            let Some(v) = out.and_then(|o| self.facts[o].as_ref()?.value.clone()) else {
                continue;
            };
            let data = TensorData {
                dtype: DType::I64,
                dims: v.shape.clone(),
                payload: Payload::Typed(Data::Int(v.to_ints())),
            };
            let n = &mut self.m.graph.nodes[ix];
            n.op_type = "Constant".into();
            n.inputs = Default::default();
            n.attrs = Attrs::from([("value", Attr::Tensor(Box::new(data)))]);
        }
        self.order.retain(|ix| !dropped.contains(ix));
        self.removed.extend(dropped);
    }

    /// Drops the lowered nodes and the sequence tensors, renumbers the tensors and
    /// rebuilds the edges.
    fn finish(mut self) -> Model {
        self.drop_grids();
        for &ix in &self.removed {
            self.m.graph.nodes.remove_node(ix);
        }
        let g = &mut self.m.graph;
        // A tensor is dead when its writer was lowered and nothing writes it now
        // (a sequence), or a lowered node's input nobody else reads... keep those.
        let dead: Vec<bool> = g
            .tensors
            .iter()
            .map(|t| t.producer.is_some_and(|p| !g.nodes.contains_node(p)))
            .collect();
        let mut new_id = vec![usize::MAX; g.tensors.len()];
        let mut tensors = Vec::with_capacity(g.tensors.len());
        for (t, info) in std::mem::take(&mut g.tensors).into_iter().enumerate() {
            if !dead[t] {
                new_id[t] = tensors.len();
                tensors.push(info);
            }
        }
        g.tensors = tensors;
        g.by_name = crate::ir::NameIndex::of(&g.tensors);
        let map = |t: &mut TensorId| *t = new_id[*t];
        g.inputs.iter_mut().for_each(map);
        g.outputs.iter_mut().for_each(map);
        for ix in self.order.iter().copied() {
            let node = &mut g.nodes[ix];
            for t in node
                .inputs
                .iter_mut()
                .chain(node.outputs.iter_mut())
                .flatten()
            {
                debug_assert!(!dead[*t], "a live node reads a lowered sequence");
                *t = new_id[*t];
            }
        }
        g.nodes.clear_edges();
        for &ix in &self.order {
            let inputs = g.nodes[ix].inputs.clone();
            for (slot, t) in inputs.into_iter().enumerate() {
                let Some(t) = t else { continue };
                if let Some(p) = g.tensors[t].producer {
                    g.nodes.add_edge(p, ix, Edge { tensor: t, slot });
                }
            }
        }
        g.order = self.order;
        g.model_order_is_topological = false;
        self.m
    }
}
