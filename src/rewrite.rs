//! `memplan plan --rewrite`: the planned training step as an ONNX model, and the
//! reader that recovers the plan from it (docs/PLAN_FORMAT.md, "Rewritten ONNX").
//!
//! The writer walks the plan. Every compute becomes one node, in plan order: a forward
//! node's first computation is the model's own node; a recomputation is a copy of it
//! (`<node>/recompute<k>`) writing new tensor names (`<tensor>__r<k>`), and later
//! readers read the newest name; the loss, backward and optimizer steps are nodes of
//! the [`DOMAIN`] domain. Every free is an entry of the preceding node's
//! `memplan.frees` metadata. Memplan's own facts go in `metadata_props` (model and
//! node), which the ONNX schema checks ignore.
//!
//! The reader keeps the file's first computations of forward nodes (the model as it
//! was), derives the rematerialization graph from them with the usual pipeline (load,
//! infer, training schedule) under the batch and options the file records, and maps
//! every node and free back onto that graph.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use bytes::Bytes;
use petgraph::stable_graph::NodeIndex;
use prost::Message;

use crate::choice::Choice;
use crate::error::{Error, Result};
use crate::infer::Bindings;
use crate::ir::{Model, TensorId};
use crate::onnx::load::from_proto;
use crate::onnx::proto::{
    attribute_proto::AttributeType, AttributeProto, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, StringStringEntryProto,
};
use crate::onnx::{decode_model, map_file};
use crate::remat::from_schedule::from_schedule;
use crate::remat::graph::{replay, Instr, NodeId, RematGraph, ValueId};
use crate::remat::plan::PlanReport;
use crate::train::{Loss, Schedule, StepKind, TrainOptions};

pub use crate::onnx::{
    is_rewrite, REWRITE_DOMAIN as DOMAIN, REWRITE_DOMAIN_VERSION as DOMAIN_VERSION,
};
/// Value of the `memplan.format` model metadata.
pub const FORMAT: &str = "memplan-rewrite";
/// Value of the `memplan.version` model metadata; a reader rejects others.
pub const FORMAT_VERSION: u32 = 1;
/// Node `metadata_props` exist from IR version 10 on.
const MIN_IR_VERSION: i64 = 10;

/// Metadata keys (model-level, then node-level).
pub mod keys {
    /// `memplan-rewrite`.
    pub const FORMAT: &str = "memplan.format";
    /// Format version (`1`).
    pub const VERSION: &str = "memplan.version";
    /// The planner.
    pub const SOLVER: &str = "memplan.solver";
    /// The budget the plan was made for.
    pub const BUDGET: &str = "memplan.budget_bytes";
    /// The plan's peak, replayed by memplan.
    pub const PEAK: &str = "memplan.predicted_peak_bytes";
    /// The peak without recomputation.
    pub const BASELINE: &str = "memplan.baseline_peak_bytes";
    /// Number of compute instructions (nodes not marked implicit).
    pub const COMPUTES: &str = "memplan.computes";
    /// Name of the rematerialization graph.
    pub const GRAPH: &str = "memplan.graph";
    /// `--batch`, when given.
    pub const BATCH: &str = "memplan.batch";
    /// `--dim` bindings, a JSON object.
    pub const DIMS: &str = "memplan.dims";
    /// Optimizer of the training step.
    pub const OPTIMIZER: &str = "memplan.optimizer";
    /// Precision policy of the training step.
    pub const PRECISION: &str = "memplan.precision";
    /// Loss of the training step.
    pub const LOSS: &str = "memplan.loss";
    /// `--freeze` pattern of the training step, when given.
    pub const FREEZE: &str = "memplan.freeze";
    /// `--trainable` pattern of the training step, when given.
    pub const TRAINABLE: &str = "memplan.trainable";
    /// The original model's `ir_version`.
    pub const SOURCE_IR: &str = "memplan.source_ir_version";
    /// The original model's `producer_name`.
    pub const SOURCE_PRODUCER: &str = "memplan.source_producer_name";
    /// The original model's `producer_version`.
    pub const SOURCE_PRODUCER_VERSION: &str = "memplan.source_producer_version";
    /// Frees before the first compute (JSON array of value names), if any.
    pub const INITIAL_FREES: &str = "memplan.initial_frees";
    /// Node: the rematerialization-graph node id it executes.
    pub const NODE: &str = "memplan.node";
    /// Node: k of the k-th recomputation.
    pub const RECOMPUTE: &str = "memplan.recompute";
    /// Node: `view`, for a view re-derived for a recomputation (not a plan instruction).
    pub const IMPLICIT: &str = "memplan.implicit";
    /// Node: values released right after it (JSON array of value names).
    pub const FREES: &str = "memplan.frees";
    /// Node: values the forward kernel writes besides its ONNX outputs (JSON array).
    pub const EXTRA_OUTPUTS: &str = "memplan.extra_outputs";
    /// Node (first computation): the cost the planner used.
    pub const COST: &str = "memplan.cost";
    /// Node (first computation that reads recomputed tensors): the model's inputs.
    pub const SOURCE_INPUTS: &str = "memplan.source_inputs";
}

/// A model loaded for planning: the decoded file, its IR, and the training schedule
/// built from it (what `plan` builds the rematerialization graph from).
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The model as decoded.
    pub proto: ModelProto,
    /// Its IR (node indices are positions in `proto.graph.node`).
    pub model: Model,
    /// The training step.
    pub schedule: Schedule,
    /// Dimension bindings used.
    pub bindings: Bindings,
    /// Training options used.
    pub options: TrainOptions,
}

impl Loaded {
    /// Loads an ONNX file and builds its training schedule.
    pub fn from_file(path: &Path, bindings: &Bindings, options: &TrainOptions) -> Result<Self> {
        let proto = decode_file(path)?;
        Self::from_proto(proto, bindings, options).map_err(|e| with_path(e, path))
    }

    /// Builds the IR and training schedule of a decoded model.
    pub fn from_proto(
        proto: ModelProto,
        bindings: &Bindings,
        options: &TrainOptions,
    ) -> Result<Self> {
        let model = from_proto(proto.clone())?;
        if let Some(&ix) = model
            .graph
            .order
            .iter()
            .find(|&&ix| crate::infer::lower::is_lowered(model.graph.node(ix)))
        {
            let n = model.graph.node(ix);
            return Err(Error::Rewrite(format!(
                "node '{}' ({}) is control flow or a sequence op, which memplan lowers to \
                 other nodes; a rewritten step holds the model's own nodes and cannot hold \
                 these yet (the plan file can)",
                n.name, n.op_type
            )));
        }
        let i = crate::step::inference(&model, bindings)?;
        if let std::borrow::Cow::Owned(_) = i.model {
            return Err(Error::Rewrite(
                "memplan rewrites some of this model's nodes before planning (a ScatterND \
                 or ScatterElements that writes a slice, or a convolution's zero bias the \
                 exporter wrote in a shape Conv does not take); a rewritten step holds the \
                 model's own nodes and cannot hold these yet (the plan file can)"
                    .into(),
            ));
        }
        let schedule = crate::step::schedule(&model, &i.inferred, options)?;
        Ok(Loaded {
            proto,
            model,
            schedule,
            bindings: bindings.clone(),
            options: options.clone(),
        })
    }

    /// The rematerialization graph of the schedule (as `plan` makes it).
    pub fn graph(&self, name: &str) -> RematGraph {
        from_schedule(&self.schedule, name)
    }
}

fn decode_file(path: &Path) -> Result<ModelProto> {
    let buf = map_file(path)?;
    let not_onnx = |reason: String| Error::NotOnnx {
        path: path.to_path_buf(),
        reason,
    };
    if buf.is_empty() {
        return Err(not_onnx("file is empty".into()));
    }
    decode_model(buf).map_err(|e| not_onnx(format!("protobuf decode failed ({e})")))
}

fn with_path(e: Error, path: &Path) -> Error {
    match e {
        Error::NotOnnx { reason, .. } => Error::NotOnnx {
            path: path.to_path_buf(),
            reason,
        },
        other => other,
    }
}

/// What a rewrite holds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RewriteStats {
    /// Nodes in the graph.
    pub nodes: usize,
    /// Compute instructions (nodes that are plan instructions).
    pub computes: usize,
    /// Recomputations among them.
    pub recomputes: usize,
    /// Nodes of the [`DOMAIN`] domain (loss, backward, optimizer).
    pub custom_nodes: usize,
    /// Views re-derived for recomputations (nodes that are not plan instructions).
    pub implicit_nodes: usize,
    /// Free instructions.
    pub frees: usize,
    /// Encoded size.
    pub bytes: usize,
}

/// Writes the rewrite of `report.plan` over the graph of `model_path`'s training step
/// to `out`. `g` must be the graph `plan` made from that model (costs may differ).
pub fn write_rewrite(
    model_path: &Path,
    bindings: &Bindings,
    options: &TrainOptions,
    g: &RematGraph,
    report: &PlanReport,
    out: &Path,
) -> Result<RewriteStats> {
    let src = Loaded::from_file(model_path, bindings, options)?;
    write_loaded(&src, g, report, out)
}

/// [`write_rewrite`] for a model already loaded.
pub fn write_loaded(
    src: &Loaded,
    g: &RematGraph,
    report: &PlanReport,
    out: &Path,
) -> Result<RewriteStats> {
    let (m, mut stats) = rewrite(src, g, report)?;
    let bytes = m.encode_to_vec();
    stats.bytes = bytes.len();
    crate::files::write_atomic(out, &bytes)?;
    Ok(stats)
}

/// Builds the rewritten model of `report.plan` (which must replay on `g`).
pub fn rewrite(
    src: &Loaded,
    g: &RematGraph,
    report: &PlanReport,
) -> Result<(ModelProto, RewriteStats)> {
    check_same_graph(src, g)?;
    replay(g, &report.plan)
        .map_err(|e| Error::Rewrite(format!("the plan does not replay: {e}")))?;
    let graph = src
        .proto
        .graph
        .as_ref()
        .ok_or_else(|| Error::Rewrite("the model has no graph".into()))?;
    let mut w = Writer::new(src, g);
    let mut initial_frees = Vec::new();
    // Per emitted node: the values freed right after it.
    let mut frees: Vec<Vec<String>> = Vec::new();
    let mut last_planned: Option<usize> = None;
    for op in &report.plan {
        match *op {
            Instr::Compute(i) => {
                w.emit(i, graph);
                last_planned = Some(w.nodes.len() - 1);
            }
            Instr::Load(_) => return Err(Error::Rewrite(
                "the plan offloads activations to host memory: the rewritten ONNX step expresses recomputation only"
                    .into(),
            )),
            Instr::Free(v) => {
                let name = w.fname[v].clone();
                match last_planned {
                    Some(k) => {
                        frees.resize(w.nodes.len(), Vec::new());
                        frees[k].push(name);
                    }
                    None => initial_frees.push(name),
                }
            }
        }
        w.stats.frees += usize::from(matches!(op, Instr::Free(_)));
    }
    for (k, fr) in frees.into_iter().enumerate() {
        if !fr.is_empty() {
            w.nodes[k]
                .metadata_props
                .push(entry(keys::FREES, json_list(&fr)));
        }
    }
    let orig = &src.proto;
    let mut meta: Vec<StringStringEntryProto> = orig
        .metadata_props
        .iter()
        .filter(|e| !is_memplan_key(e))
        .cloned()
        .collect();
    let solver = serde_json::to_value(report.solver)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let mut put = |k: &str, v: String| meta.push(entry(k, v));
    put(keys::FORMAT, FORMAT.into());
    put(keys::VERSION, FORMAT_VERSION.to_string());
    put(keys::SOLVER, solver);
    put(keys::BUDGET, report.budget_bytes.to_string());
    put(keys::PEAK, report.peak_bytes.to_string());
    put(keys::BASELINE, report.baseline_peak_bytes.to_string());
    put(keys::COMPUTES, w.stats.computes.to_string());
    put(keys::GRAPH, g.name.clone());
    if let Some(b) = src.bindings.batch {
        put(keys::BATCH, b.to_string());
    }
    if !src.bindings.dims.is_empty() {
        put(
            keys::DIMS,
            serde_json::to_string(&src.bindings.dims).expect("a map of numbers"),
        );
    }
    put(keys::OPTIMIZER, enum_name(src.options.optimizer));
    put(keys::PRECISION, enum_name(src.options.precision));
    put(keys::LOSS, enum_name(src.options.loss));
    if let Some(p) = &src.options.params.freeze {
        put(keys::FREEZE, p.as_str().to_string());
    }
    if let Some(p) = &src.options.params.trainable {
        put(keys::TRAINABLE, p.as_str().to_string());
    }
    if let Some(v) = orig.ir_version {
        put(keys::SOURCE_IR, v.to_string());
    }
    if let Some(p) = &orig.producer_name {
        put(keys::SOURCE_PRODUCER, p.clone());
    }
    if let Some(p) = &orig.producer_version {
        put(keys::SOURCE_PRODUCER_VERSION, p.clone());
    }
    if !initial_frees.is_empty() {
        put(keys::INITIAL_FREES, json_list(&initial_frees));
    }
    let mut opset_import: Vec<OperatorSetIdProto> = orig
        .opset_import
        .iter()
        .filter(|o| o.domain.as_deref() != Some(DOMAIN))
        .cloned()
        .collect();
    opset_import.push(OperatorSetIdProto {
        domain: Some(DOMAIN.into()),
        version: Some(DOMAIN_VERSION),
    });
    let mut stats = std::mem::take(&mut w.stats);
    stats.nodes = w.nodes.len();
    let m = ModelProto {
        ir_version: Some(orig.ir_version.unwrap_or(0).max(MIN_IR_VERSION)),
        opset_import,
        producer_name: Some("memplan".into()),
        producer_version: Some(env!("CARGO_PKG_VERSION").into()),
        doc_string: Some(format!(
            "One training step of '{}' planned by memplan ({}); format: memplan docs/PLAN_FORMAT.md, \"Rewritten ONNX\".",
            g.name,
            meta.iter()
                .find(|e| e.key.as_deref() == Some(keys::SOLVER))
                .and_then(|e| e.value.clone())
                .unwrap_or_default()
        )),
        graph: Some(GraphProto {
            node: std::mem::take(&mut w.nodes),
            ..graph.clone()
        }),
        metadata_props: meta,
        training_info: Vec::new(),
        ..orig.clone()
    };
    Ok((m, stats))
}

/// `g` must be the graph of `src`'s schedule: same nodes, values and edges.
fn check_same_graph(src: &Loaded, g: &RematGraph) -> Result<()> {
    let g0 = src.graph(&g.name);
    let mismatch = |what: String| {
        Err(Error::Rewrite(format!(
            "the planned graph is not this model's training step ({what})"
        )))
    };
    if g0.nodes.len() != g.nodes.len() || g0.values.len() != g.values.len() {
        return mismatch(format!(
            "{} nodes and {} values, the model has {} and {}",
            g.nodes.len(),
            g.values.len(),
            g0.nodes.len(),
            g0.values.len()
        ));
    }
    for (a, b) in g0.nodes.iter().zip(&g.nodes) {
        if a.name != b.name || a.inputs != b.inputs || a.outputs != b.outputs {
            return mismatch(format!("node '{}'", b.name));
        }
    }
    for (a, b) in g0.values.iter().zip(&g.values) {
        if a.name != b.name || a.bytes != b.bytes {
            return mismatch(format!("value '{}'", b.name));
        }
    }
    Ok(())
}

/// One name per value, unique among the model's tensor names and each other: the
/// storage's name (its first tensor's ONNX name) when it is an ONNX tensor's storage,
/// else its schedule name (`<node>/saved0`, `x@float16`, `x/grad`, `loss`...), with
/// `#<value id>` (and more `#` if needed) appended when that name is taken.
/// Also returns, per value, the ONNX tensor it is the storage of.
fn value_names(model: &Model, s: &Schedule) -> (Vec<String>, Vec<Option<TensorId>>) {
    let g = &model.graph;
    let n = s.storages.len();
    let mut owner = vec![None; n];
    for (t, info) in g.tensors.iter().enumerate() {
        let v = s.tensor_storage.get(t).copied().unwrap_or(usize::MAX);
        if v < n && s.storages[v].name == info.name {
            owner[v] = Some(t);
        }
    }
    let mut taken: HashSet<String> = g.tensors.iter().map(|t| t.name.to_string()).collect();
    let names = s
        .storages
        .iter()
        .enumerate()
        .map(|(v, st)| {
            if owner[v].is_some() {
                return st.name.clone();
            }
            let mut name = st.name.clone();
            if taken.contains(&name) {
                name = format!("{name}#{v}");
                while taken.contains(&name) {
                    name.push('#');
                }
            }
            taken.insert(name.clone());
            name
        })
        .collect();
    (names, owner)
}

struct Writer<'a> {
    src: &'a Loaded,
    g: &'a RematGraph,
    /// Stable name per value (frees use it).
    fname: Vec<String>,
    owner: Vec<Option<TensorId>>,
    /// Forward step of each ONNX node.
    step_of: HashMap<NodeIndex, usize>,
    /// Current name of each ONNX tensor (None: not written yet).
    cur_t: Vec<Option<String>>,
    /// Generation of its storage when the tensor's current name was written.
    tgen: Vec<u64>,
    /// Per value: how many times it has been re-made.
    gen: Vec<u64>,
    /// Current name of each value.
    cur_v: Vec<String>,
    /// Planned computes so far, per node.
    planned: Vec<u32>,
    /// Implicit copies so far, per node.
    implicit: Vec<u32>,
    /// Tensor names defined so far (inputs, initializers, node outputs).
    defined: HashSet<String>,
    /// Every name in use (for fresh names).
    taken: HashSet<String>,
    nodes: Vec<NodeProto>,
    stats: RewriteStats,
}

impl<'a> Writer<'a> {
    fn new(src: &'a Loaded, g: &'a RematGraph) -> Self {
        let (fname, owner) = value_names(&src.model, &src.schedule);
        let mg = &src.model.graph;
        let step_of = src
            .schedule
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == StepKind::Forward)
            .filter_map(|(i, s)| s.node.map(|ix| (ix, i)))
            .collect();
        let cur_t: Vec<Option<String>> = mg
            .tensors
            .iter()
            .map(|t| t.producer.is_none().then(|| t.name.to_string()))
            .collect();
        let defined = cur_t.iter().flatten().cloned().collect();
        let mut taken: HashSet<String> = mg.tensors.iter().map(|t| t.name.to_string()).collect();
        taken.extend(fname.iter().cloned());
        Writer {
            src,
            g,
            cur_v: fname.clone(),
            fname,
            owner,
            step_of,
            tgen: vec![0; mg.tensors.len()],
            cur_t,
            gen: vec![0; src.schedule.storages.len()],
            planned: vec![0; g.nodes.len()],
            implicit: vec![0; g.nodes.len()],
            defined,
            taken,
            nodes: Vec::new(),
            stats: RewriteStats::default(),
        }
    }

    fn fresh(&mut self, base: &str, tag: &str) -> String {
        let mut name = format!("{base}__{tag}");
        while self.taken.contains(&name) {
            name.push('_');
        }
        self.taken.insert(name.clone());
        name
    }

    fn storage(&self, t: TensorId) -> Option<ValueId> {
        let s = *self.src.schedule.tensor_storage.get(t)?;
        (s < self.src.schedule.storages.len()).then_some(s)
    }

    fn emit(&mut self, i: NodeId, graph: &GraphProto) {
        self.stats.computes += 1;
        if self.planned[i] > 0 {
            self.stats.recomputes += 1;
        }
        if self.src.schedule.steps[i].kind == StepKind::Forward {
            self.forward(i, false, graph, 0);
        } else {
            self.custom(i);
        }
    }

    /// Makes ONNX tensor `t` current for a forward node about to read it: a view of a
    /// storage re-made since the view was taken is re-derived (an implicit copy of the
    /// view op, after its own inputs).
    fn ensure_fresh(&mut self, t: TensorId, graph: &GraphProto, depth: usize) {
        let s = self.storage(t);
        let persistent = s.is_some_and(|s| self.src.schedule.storages[s].persistent);
        let stale = match &self.cur_t[t] {
            None => true,
            Some(_) => match s {
                Some(s) if !persistent => self.tgen[t] != self.gen[s],
                _ => false,
            },
        };
        if !stale || depth > self.g.nodes.len() {
            return;
        }
        let Some(p) = self.src.model.graph.tensor(t).producer else {
            return;
        };
        let Some(&j) = self.step_of.get(&p) else {
            return;
        };
        // Only a node that writes no storage for `t` (a view, a Constant) is re-derived;
        // a node that makes `t`'s storage is always current (the plan replays).
        let view = s.is_some_and(|s| !self.src.schedule.steps[j].writes.contains(&s));
        if view {
            self.forward(j, true, graph, depth + 1);
        }
    }

    fn forward(&mut self, i: NodeId, implicit: bool, graph: &GraphProto, depth: usize) {
        let src = self.src;
        let step = &src.schedule.steps[i];
        let ix = step.node.expect("a forward step has a node");
        let node = src.model.graph.node(ix);
        let orig = &graph.node[ix.index()];
        let mut input = Vec::with_capacity(node.inputs.len());
        for t in &node.inputs {
            match *t {
                None => input.push(String::new()),
                Some(t) => {
                    self.ensure_fresh(t, graph, depth);
                    input.push(
                        self.cur_t[t]
                            .clone()
                            .unwrap_or_else(|| src.model.graph.tensor(t).name.to_string()),
                    );
                }
            }
        }
        let again = self.planned[i] + self.implicit[i] > 0;
        let (name, tag, recompute) = if implicit {
            self.implicit[i] += 1;
            self.stats.implicit_nodes += 1;
            let k = self.implicit[i];
            (
                format!("{}/view{k}", step.name),
                Some(format!("v{k}")),
                None,
            )
        } else {
            let k = self.planned[i];
            self.planned[i] += 1;
            if k == 0 {
                (step.name.clone(), None, None)
            } else {
                (
                    format!("{}/recompute{k}", step.name),
                    Some(format!("r{k}")),
                    Some(k),
                )
            }
        };
        if again {
            for &v in &step.writes {
                self.gen[v] += 1;
            }
        }
        let mut output = Vec::with_capacity(node.outputs.len());
        for t in &node.outputs {
            let Some(t) = *t else {
                output.push(String::new());
                continue;
            };
            let base = &src.model.graph.tensor(t).name;
            let n = match &tag {
                None => base.to_string(),
                Some(tag) => self.fresh(base, tag),
            };
            self.cur_t[t] = Some(n.clone());
            self.tgen[t] = self.storage(t).map_or(0, |s| self.gen[s]);
            self.defined.insert(n.clone());
            output.push(n);
        }
        let mut extra = Vec::new();
        for &v in &step.writes {
            match self.owner[v] {
                Some(t) if node.outputs.contains(&Some(t)) => {
                    self.cur_v[v] = self.cur_t[t].clone().expect("just written");
                }
                _ => {
                    let n = match &tag {
                        None => self.fname[v].clone(),
                        Some(tag) => {
                            let base = self.fname[v].clone();
                            self.fresh(&base, tag)
                        }
                    };
                    self.cur_v[v] = n.clone();
                    extra.push(n);
                }
            }
        }
        let mut np = orig.clone();
        np.name = Some(name);
        np.input = input;
        np.output = output;
        np.metadata_props.retain(|e| !is_memplan_key(e));
        let meta = &mut np.metadata_props;
        meta.push(entry(keys::NODE, i.to_string()));
        if let Some(k) = recompute {
            meta.push(entry(keys::RECOMPUTE, k.to_string()));
        }
        if implicit {
            meta.push(entry(keys::IMPLICIT, "view".into()));
        }
        if !extra.is_empty() {
            meta.push(entry(keys::EXTRA_OUTPUTS, json_list(&extra)));
        }
        if !implicit && recompute.is_none() {
            meta.push(entry(keys::COST, self.g.nodes[i].cost.to_string()));
            if np.input != orig.input {
                meta.push(entry(keys::SOURCE_INPUTS, json_list(&orig.input)));
            }
        }
        self.nodes.push(np);
    }

    fn custom(&mut self, i: NodeId) {
        let src = self.src;
        let step = &src.schedule.steps[i];
        let mut input = Vec::new();
        let mut implicit = Vec::new();
        let mut seen = HashSet::new();
        for &v in step.reads.iter().chain(&step.updates) {
            if step.writes.contains(&v) || !seen.insert(v) {
                continue;
            }
            let n = self.cur_v[v].clone();
            if self.defined.contains(&n) {
                input.push(n);
            } else {
                implicit.push(n);
            }
        }
        let k = self.planned[i];
        self.planned[i] += 1;
        let mut output = Vec::with_capacity(step.writes.len());
        for &v in &step.writes {
            let n = if k == 0 {
                self.fname[v].clone()
            } else {
                self.gen[v] += 1;
                let base = self.fname[v].clone();
                self.fresh(&base, &format!("r{k}"))
            };
            self.cur_v[v] = n.clone();
            self.defined.insert(n.clone());
            output.push(n);
        }
        let accumulate: Vec<String> = step
            .updates
            .iter()
            .map(|&v| self.cur_v[v].clone())
            .collect();
        let reduction = match src.options.loss {
            Loss::Mean => "mean",
            Loss::Sum => "sum",
            Loss::Graph => "graph",
        };
        let mut attribute = Vec::new();
        let op_type = match (step.kind, step.node) {
            (StepKind::Loss, _) => {
                attribute.push(attr_s("reduction", reduction));
                "Loss".to_string()
            }
            (StepKind::Backward, None) => {
                attribute.push(attr_s("reduction", reduction));
                "LossGrad".to_string()
            }
            (StepKind::Backward, Some(ix)) => {
                let fwd = src.model.graph.node(ix);
                attribute.push(attr_s("forward_node", &fwd.name));
                attribute.push(attr_s("forward_op", &fwd.op_type));
                if !fwd.domain.is_empty() {
                    attribute.push(attr_s("forward_domain", &fwd.domain));
                }
                attribute.push(AttributeProto {
                    name: Some("grad_inputs".into()),
                    r#type: Some(AttributeType::Ints as i32),
                    ints: step.grad_inputs.iter().map(|&s| s as i64).collect(),
                    ..Default::default()
                });
                format!("{}Grad", fwd.op_type)
            }
            (StepKind::Optimizer, _) => {
                attribute.push(attr_s("algorithm", &step.op));
                "Optimizer".to_string()
            }
            (StepKind::Forward, _) => unreachable!("forward steps are ONNX nodes"),
        };
        if !accumulate.is_empty() {
            attribute.push(attr_ss("accumulate", &accumulate));
        }
        if !implicit.is_empty() {
            attribute.push(attr_ss("implicit_inputs", &implicit));
        }
        let mut meta = vec![entry(keys::NODE, i.to_string())];
        if k > 0 {
            meta.push(entry(keys::RECOMPUTE, k.to_string()));
        } else {
            meta.push(entry(keys::COST, self.g.nodes[i].cost.to_string()));
        }
        self.stats.custom_nodes += 1;
        self.nodes.push(NodeProto {
            input,
            output,
            name: Some(if k == 0 {
                step.name.clone()
            } else {
                format!("{}/recompute{k}", step.name)
            }),
            op_type: Some(op_type),
            domain: Some(DOMAIN.into()),
            attribute,
            metadata_props: meta,
            ..Default::default()
        });
    }
}

fn entry(k: &str, v: String) -> StringStringEntryProto {
    StringStringEntryProto {
        key: Some(k.into()),
        value: Some(v),
    }
}

fn is_memplan_key(e: &StringStringEntryProto) -> bool {
    e.key.as_deref().is_some_and(|k| k.starts_with("memplan."))
}

fn json_list(v: &[String]) -> String {
    serde_json::to_string(v).expect("strings")
}

fn attr_s(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::String as i32),
        s: Some(Bytes::from(v.to_string())),
        ..Default::default()
    }
}

fn attr_ss(name: &str, v: &[String]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Strings as i32),
        strings: v.iter().map(|s| Bytes::from(s.clone())).collect(),
        ..Default::default()
    }
}

fn enum_name<T: Choice>(v: T) -> String {
    v.name().to_string()
}

/// A rewrite read back.
#[derive(Debug, Clone)]
pub struct ReadBack {
    /// The rematerialization graph, rebuilt from the file's forward nodes (with the
    /// costs the file records).
    pub graph: RematGraph,
    /// The plan.
    pub plan: Vec<Instr>,
    /// The planner that made it.
    pub solver: String,
    /// The budget it was made for.
    pub budget_bytes: u64,
    /// The peak memplan predicted when writing it.
    pub predicted_peak_bytes: u64,
    /// The peak without recomputation.
    pub baseline_peak_bytes: u64,
    /// Dimension bindings of the training step.
    pub bindings: Bindings,
    /// Options of the training step.
    pub options: TrainOptions,
    /// Views re-derived for recomputations (nodes that are not instructions).
    pub implicit_nodes: usize,
}

impl ReadBack {
    /// Computes that are recomputations.
    pub fn recomputes(&self) -> usize {
        let mut seen = vec![false; self.graph.nodes.len()];
        self.plan
            .iter()
            .filter(|op| match **op {
                Instr::Compute(i) => std::mem::replace(&mut seen[i], true),
                Instr::Free(_) | Instr::Load(_) => false,
            })
            .count()
    }

    /// One line: what the file holds and its replayed peak.
    pub fn summary(&self) -> String {
        use crate::units::human_bytes;
        let computes = self
            .plan
            .iter()
            .filter(|o| matches!(o, Instr::Compute(_)))
            .count();
        let replayed = match replay(&self.graph, &self.plan) {
            Ok(r) => format!("replays to {}", human_bytes(r.peak_bytes)),
            Err(e) => format!("does not replay: {e}"),
        };
        format!(
            "{computes} computes ({} recomputations) planned by {} for a {} budget, predicted peak {} (no recompute: {}); {replayed}",
            self.recomputes(),
            self.solver,
            human_bytes(self.budget_bytes),
            human_bytes(self.predicted_peak_bytes),
            human_bytes(self.baseline_peak_bytes),
        )
    }
}

/// Reads a file written by `plan --rewrite` back into its graph and plan.
pub fn read_rewrite(path: &Path) -> Result<ReadBack> {
    let m = decode_file(path)?;
    read_proto(m).map_err(|e| with_path(e, path))
}

/// [`read_rewrite`] for a decoded model.
#[allow(clippy::too_many_lines)] // Long by design: checks every field of a rewritten file, one after another.
pub fn read_proto(m: ModelProto) -> Result<ReadBack> {
    let bad = |msg: String| Error::Rewrite(msg);
    let meta: HashMap<&str, &str> = m
        .metadata_props
        .iter()
        .filter_map(|e| Some((e.key.as_deref()?, e.value.as_deref().unwrap_or(""))))
        .collect();
    match meta.get(keys::FORMAT) {
        Some(&FORMAT) => {}
        Some(other) => {
            return Err(bad(format!(
                "{} is '{other}', not '{FORMAT}'",
                keys::FORMAT
            )))
        }
        None => {
            return Err(bad(format!(
                "not written by memplan's plan rewrite (no '{}' metadata)",
                keys::FORMAT
            )))
        }
    }
    let get = |k: &str| -> Result<&str> {
        meta.get(k)
            .copied()
            .ok_or_else(|| bad(format!("missing model metadata '{k}'")))
    };
    let num = |k: &str| -> Result<u64> {
        let v = get(k)?;
        v.parse()
            .map_err(|_| bad(format!("metadata '{k}' = '{v}' is not a number")))
    };
    let version = num(keys::VERSION)?;
    if version != u64::from(FORMAT_VERSION) {
        return Err(bad(format!(
            "format version {version} is not supported (this memplan reads {FORMAT_VERSION})"
        )));
    }
    if !m
        .opset_import
        .iter()
        .any(|o| o.domain.as_deref() == Some(DOMAIN) && o.version == Some(DOMAIN_VERSION))
    {
        return Err(bad(format!(
            "no opset_import for domain {DOMAIN} version {DOMAIN_VERSION}"
        )));
    }
    fn parse_enum<T: Choice>(k: &str, v: &str) -> Result<T> {
        T::ALL
            .iter()
            .copied()
            .find(|c| c.name().eq_ignore_ascii_case(v))
            .ok_or_else(|| Error::Rewrite(format!("metadata '{k}' = '{v}' is unknown")))
    }
    let options = TrainOptions {
        optimizer: parse_enum(keys::OPTIMIZER, get(keys::OPTIMIZER)?)?,
        precision: parse_enum(keys::PRECISION, get(keys::PRECISION)?)?,
        loss: parse_enum(keys::LOSS, get(keys::LOSS)?)?,
        grads_resident: false,
        params: crate::train::ParamSelection::new(
            meta.get(keys::FREEZE).copied(),
            meta.get(keys::TRAINABLE).copied(),
        )?,
    };
    let bindings = Bindings {
        batch: meta
            .get(keys::BATCH)
            .map(|_| num(keys::BATCH))
            .transpose()?,
        dims: match meta.get(keys::DIMS) {
            Some(d) => serde_json::from_str::<BTreeMap<String, u64>>(d)
                .map_err(|e| bad(format!("metadata '{}': {e}", keys::DIMS)))?,
            None => BTreeMap::new(),
        },
        routing: None,
    };
    let solver = get(keys::SOLVER)?.to_string();
    let graph_name = get(keys::GRAPH)?.to_string();
    let budget_bytes = num(keys::BUDGET)?;
    let predicted_peak_bytes = num(keys::PEAK)?;
    let baseline_peak_bytes = num(keys::BASELINE)?;
    let computes = num(keys::COMPUTES)?;
    let list = |k: &str, v: &str, at: &str| -> Result<Vec<String>> {
        serde_json::from_str(v).map_err(|e| bad(format!("{at}: metadata '{k}': {e}")))
    };
    let initial_frees = match meta.get(keys::INITIAL_FREES) {
        Some(v) => list(keys::INITIAL_FREES, v, "model")?,
        None => Vec::new(),
    };
    let graph = m.graph.as_ref().ok_or_else(|| bad("no graph".into()))?;

    // Each node's memplan facts.
    struct Entry {
        id: NodeId,
        recompute: Option<u32>,
        implicit: bool,
        custom: bool,
        frees: Vec<String>,
        cost: Option<f64>,
    }
    let mut entries = Vec::with_capacity(graph.node.len());
    let mut first: Vec<(NodeId, NodeProto)> = Vec::new();
    for (k, n) in graph.node.iter().enumerate() {
        let at = format!("node {k} '{}'", n.name());
        let nm: HashMap<&str, &str> = n
            .metadata_props
            .iter()
            .filter_map(|e| Some((e.key.as_deref()?, e.value.as_deref().unwrap_or(""))))
            .collect();
        let id: NodeId = nm
            .get(keys::NODE)
            .ok_or_else(|| bad(format!("{at} has no '{}' metadata", keys::NODE)))?
            .parse()
            .map_err(|_| bad(format!("{at}: '{}' is not a node id", keys::NODE)))?;
        let recompute = nm
            .get(keys::RECOMPUTE)
            .map(|v| {
                v.parse::<u32>()
                    .map_err(|_| bad(format!("{at}: '{}' is not a number", keys::RECOMPUTE)))
            })
            .transpose()?;
        let implicit = nm.contains_key(keys::IMPLICIT);
        let custom = n.domain() == DOMAIN;
        let frees = match nm.get(keys::FREES) {
            Some(v) => list(keys::FREES, v, &at)?,
            None => Vec::new(),
        };
        let cost = nm
            .get(keys::COST)
            .map(|v| {
                v.parse::<f64>()
                    .map_err(|_| bad(format!("{at}: '{}' is not a number", keys::COST)))
            })
            .transpose()?;
        if !custom && !implicit && recompute.is_none() {
            let mut fwd = n.clone();
            if let Some(v) = nm.get(keys::SOURCE_INPUTS) {
                fwd.input = list(keys::SOURCE_INPUTS, v, &at)?;
            }
            fwd.metadata_props.retain(|e| !is_memplan_key(e));
            first.push((id, fwd));
        }
        entries.push(Entry {
            id,
            recompute,
            implicit,
            custom,
            frees,
            cost,
        });
    }

    // The forward model: first computations of forward nodes, in node-id order.
    first.sort_by_key(|(id, _)| *id);
    if let Some(w) = first.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("node id {} is computed first twice", w[0].0)));
    }
    let source_ir = meta
        .get(keys::SOURCE_IR)
        .and_then(|v| v.parse().ok())
        .or(m.ir_version);
    let fwd_model = ModelProto {
        ir_version: source_ir,
        opset_import: m
            .opset_import
            .iter()
            .filter(|o| o.domain.as_deref() != Some(DOMAIN))
            .cloned()
            .collect(),
        producer_name: meta.get(keys::SOURCE_PRODUCER).map(|s| s.to_string()),
        producer_version: meta
            .get(keys::SOURCE_PRODUCER_VERSION)
            .map(|s| s.to_string()),
        metadata_props: m
            .metadata_props
            .iter()
            .filter(|e| !is_memplan_key(e))
            .cloned()
            .collect(),
        graph: Some(GraphProto {
            node: first.iter().map(|(_, n)| n.clone()).collect(),
            ..graph.clone()
        }),
        ..m.clone()
    };
    let src = Loaded::from_proto(fwd_model, &bindings, &options)?;
    let mut g = src.graph(&graph_name);
    let n = g.nodes.len();
    let steps = &src.schedule.steps;
    let n_fwd = steps.iter().filter(|s| s.kind == StepKind::Forward).count();
    if first.len() != n_fwd
        || first
            .iter()
            .enumerate()
            .any(|(k, (id, _))| *id != k || steps[k].kind != StepKind::Forward)
    {
        return Err(bad(format!(
            "the forward nodes do not number 0..{n_fwd} in their model order"
        )));
    }

    // The plan.
    let (fname, _) = value_names(&src.model, &src.schedule);
    let by_name: HashMap<&str, ValueId> = fname
        .iter()
        .enumerate()
        .map(|(v, s)| (s.as_str(), v))
        .collect();
    let value = |name: &str, at: &str| -> Result<ValueId> {
        by_name.get(name).copied().ok_or_else(|| {
            bad(format!(
                "{at} frees '{name}', which is no value of the step"
            ))
        })
    };
    let mut plan = Vec::with_capacity(entries.len() * 2);
    for f in &initial_frees {
        plan.push(Instr::Free(value(f, "the model")?));
    }
    let mut count = vec![0u32; n];
    let mut implicit_nodes = 0;
    for (k, (e, np)) in entries.iter().zip(&graph.node).enumerate() {
        let at = format!("node {k} '{}'", np.name());
        if e.id >= n {
            return Err(bad(format!(
                "{at}: node id {} is out of range ({n} nodes)",
                e.id
            )));
        }
        let forward = steps[e.id].kind == StepKind::Forward;
        if e.custom == forward {
            return Err(bad(format!(
                "{at}: node id {} is a {} step, but the node is {} the {DOMAIN} domain",
                e.id,
                if forward { "forward" } else { "non-forward" },
                if e.custom { "in" } else { "not in" }
            )));
        }
        if e.implicit {
            implicit_nodes += 1;
            if !e.frees.is_empty() {
                return Err(bad(format!("{at}: an implicit node frees values")));
            }
            continue;
        }
        let want_k = count[e.id];
        if e.recompute.unwrap_or(0) != want_k {
            return Err(bad(format!(
                "{at}: computation {} of node id {}, but it is marked {}",
                want_k + 1,
                e.id,
                e.recompute
                    .map_or("a first computation".to_string(), |r| format!(
                        "recompute {r}"
                    ))
            )));
        }
        let want_name = if want_k == 0 {
            g.nodes[e.id].name.clone()
        } else {
            format!("{}/recompute{want_k}", g.nodes[e.id].name)
        };
        if np.name() != want_name {
            return Err(bad(format!(
                "{at}: node id {} should be named '{want_name}'",
                e.id
            )));
        }
        count[e.id] += 1;
        if want_k == 0 {
            if let Some(c) = e.cost {
                g.nodes[e.id].cost = c;
            }
        }
        plan.push(Instr::Compute(e.id));
        for f in &e.frees {
            plan.push(Instr::Free(value(f, &at)?));
        }
    }
    let done = count.iter().map(|&c| c as u64).sum::<u64>();
    if done != computes {
        return Err(bad(format!(
            "{done} computes, but the metadata says {computes} (truncated or edited?)"
        )));
    }
    Ok(ReadBack {
        graph: g,
        plan,
        solver,
        budget_bytes,
        predicted_peak_bytes,
        baseline_peak_bytes,
        bindings,
        options,
        implicit_nodes,
    })
}
