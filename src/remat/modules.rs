//! Module-granular checkpointing: the PyTorch module tree of a training step, and a
//! set of checkpointed modules turned into an [`Instr`] plan over the same
//! [`RematGraph`] that does what `torch.utils.checkpoint(..., use_reentrant=False)`
//! does, so `replay`, plan.json, `verify --plan` and the executor run it unchanged.
//!
//! **Tree.** A module is a scope of the exporter's node names (TorchScript:
//! `/layer3/layer3.1/conv2/Conv` lies in `layer3`, `layer3.1` and `layer3.1.conv2`,
//! the names `model.named_modules()` gives). A module called more than once appears
//! as `relu`, `relu_1`, `relu_2` under one parent: those scopes are one module, `relu`,
//! whose forward nodes are then not contiguous. Its forward nodes are the forward
//! nodes under its path (whole components) and the scope-less forward nodes between
//! them (the exporter's constants); a module whose nodes are interleaved with another
//! module's (called twice, shared) cannot be checkpointed as one call. A backward node
//! (`<node>/grad`) belongs to the modules of its forward node.
//!
//! **Checkpoint semantics** (`_checkpoint_without_reentrant_generator`): for each
//! checkpointed module M (never an ancestor of another chosen one),
//! - forward runs once, in order; a value written inside M is not kept for M's own
//!   backward: it is freed after its last reader other than M's backward nodes (so a
//!   module output read later in forward, or a value read by a backward node outside
//!   M, lives as it did);
//! - M's inputs (non-fixed values M's nodes read, written outside M) are kept until
//!   M's last backward node that reads a saved tensor (the checkpoint frame holds the
//!   arguments until its last holder is unpacked);
//! - before M's first backward node that unpacks a saved tensor (reads a forward value
//!   or a fixed one: PyTorch recomputes at the first unpack), M's forward nodes run
//!   again in order, up to the last one that writes a value M's backward nodes read
//!   (`_StopRecomputationError`: the early stop); each recomputed value is freed after
//!   its last reader from there on (recompute nodes and later backward nodes), or at
//!   once if none reads it.
//!
//! **Selective checkpoints** (`torch.utils.checkpoint.create_selective_checkpoint_contexts`
//! with a policy that saves [`SELECTIVE_SAVED_OPS`] and recomputes the rest): the
//! same, except that the outputs of M's convolutions and matrix products are kept
//! from forward, as PyTorch's cache keeps them: they are not dropped and not run
//! again; the cache holds each until the recomputation (or, past the early stop,
//! which nothing reruns, until the frame lets go of it at M's last unpack), and each
//! is then freed after its last reader. PyTorch refuses a cached output that was
//! modified in place (a `ReLU(inplace=True)` right after a convolution or a Linear
//! inside M); the exported graph does not show that, so such a module fails in
//! PyTorch rather than here. Only the cheap ops between them are rerun, which is what
//! lets a whole stage be checkpointed without rerunning its convolutions.
//!
//! One approximation: a recomputed value that is also still live (a value M writes and
//! a backward node outside M reads later) is one allocation here, where PyTorch would
//! briefly hold two copies.

use std::collections::HashMap;

use serde::Serialize;

use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};

/// One module of the tree.
#[derive(Debug, Clone, Serialize)]
pub struct Module {
    /// Dotted path as `model.named_modules()` names it (`layer3.1.conv2`).
    pub path: String,
    /// Enclosing module.
    pub parent: Option<usize>,
    /// Modules one level down.
    pub children: Vec<usize>,
    /// Depth (0 for top-level modules).
    pub depth: usize,
    /// Forward nodes in execution order (scope-less ones inside the span included).
    pub forward: Vec<NodeId>,
    /// Backward nodes of its forward nodes, in execution order.
    pub backward: Vec<NodeId>,
    /// Whether its forward nodes are one contiguous run (one call).
    pub contiguous: bool,
}

/// The module tree of a training step's graph.
#[derive(Debug, Clone, Serialize)]
pub struct ModuleTree {
    /// Modules, parents before children.
    pub modules: Vec<Module>,
    /// Forward nodes outside every module (no scope in their name, not inside a
    /// module's span).
    pub unscoped: Vec<NodeId>,
    #[serde(skip)]
    by_path: HashMap<String, usize>,
    /// Per node: the innermost module (backward nodes: their forward node's).
    #[serde(skip)]
    innermost: Vec<Option<usize>>,
}

/// The scope components of a node name ([`crate::ir::scope::scopes`]), backward
/// nodes' `/grad` suffix removed; none for a name that does not start with `/`.
fn scopes(name: &str) -> Vec<&str> {
    let name = name.strip_suffix("/grad").unwrap_or(name);
    if !name.starts_with('/') {
        return Vec::new();
    }
    crate::ir::scope::scopes(name)
}

pub use crate::ir::scope::join;

/// `relu_2` → `Some("relu")`.
fn call_suffix(scope: &str) -> Option<&str> {
    let (base, n) = scope.rsplit_once('_')?;
    (!base.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(base)
}

/// Module paths of each node's scope chain, before merging repeated calls: one
/// chain per distinct scope (the name up to its last component), and each node's.
fn scope_chains(nodes: &[(&str, bool)]) -> (Vec<Vec<String>>, Vec<usize>) {
    let mut chain_of: HashMap<&str, usize> = HashMap::new();
    let mut raw: Vec<Vec<String>> = Vec::new();
    let node_chain = nodes
        .iter()
        .map(|n| {
            let name = n.0.strip_suffix("/grad").unwrap_or(n.0);
            let key = match name.rsplit_once('/') {
                Some((k, _)) if name.starts_with('/') => k,
                _ => "",
            };
            *chain_of.entry(key).or_insert_with(|| {
                let mut out: Vec<String> = Vec::new();
                for s in scopes(name) {
                    let p = join(out.last().map_or("", |s| s.as_str()), s);
                    out.push(p);
                }
                raw.push(out);
                raw.len() - 1
            })
        })
        .collect();
    (raw, node_chain)
}

impl ModuleTree {
    /// Builds the tree from the forward nodes' names.
    pub fn build(g: &RematGraph) -> ModuleTree {
        let nodes: Vec<(&str, bool)> = g
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n.backward))
            .collect();
        Self::of_nodes(&nodes)
    }

    /// The tree of a schedule's steps (its node ids are step indices, as
    /// [`crate::remat::from_schedule::from_schedule`] numbers them).
    pub fn of_schedule(s: &crate::train::Schedule) -> ModuleTree {
        let nodes: Vec<(&str, bool)> = s
            .steps
            .iter()
            .map(|st| {
                let forward = st.kind == crate::train::StepKind::Forward;
                (st.name.as_str(), !forward)
            })
            .collect();
        Self::of_nodes(&nodes)
    }

    /// The tree of nodes given as (name, is a backward node), in order.
    fn of_nodes(nodes: &[(&str, bool)]) -> ModuleTree {
        let (raw, node_chain) = scope_chains(nodes);
        let all: std::collections::HashSet<&str> =
            raw.iter().flatten().map(|s| s.as_str()).collect();
        // `p.relu_1` is the second call of `p.relu` when `p.relu` exists.
        let canon = |path: &str| -> String {
            let (parent, last) = match path.rsplit_once('.') {
                Some((p, l)) => (Some(p), l),
                None => (None, path),
            };
            if let Some(base) = call_suffix(last) {
                let other = match parent {
                    Some(p) => format!("{p}.{base}"),
                    None => base.to_string(),
                };
                if all.contains(other.as_str()) {
                    return other;
                }
            }
            path.to_string()
        };
        let mut tree = ModuleTree {
            modules: Vec::new(),
            unscoped: Vec::new(),
            by_path: HashMap::new(),
            innermost: vec![None; nodes.len()],
        };
        let by_name: HashMap<&str, NodeId> = nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| !n.1)
            .map(|(i, n)| (n.0, i))
            .collect();
        let forward: Vec<NodeId> = (0..nodes.len()).filter(|&i| !nodes[i].1).collect();
        let mut fwd_pos = vec![usize::MAX; nodes.len()];
        for (k, &i) in forward.iter().enumerate() {
            fwd_pos[i] = k;
        }
        // Scoped forward nodes per module, in order; each chain's modules resolved
        // once.
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut resolved: Vec<Option<Vec<usize>>> = vec![None; raw.len()];
        for &i in &forward {
            if let Some(ms) = &resolved[node_chain[i]] {
                for &m in ms {
                    members[m].push(fwd_pos[i]);
                }
                tree.innermost[i] = ms.last().copied();
                continue;
            }
            let mut parent: Option<usize> = None;
            let mut ms = Vec::new();
            for p in &raw[node_chain[i]] {
                let path = canon(p);
                let m = match tree.by_path.get(&path) {
                    Some(&m) => m,
                    None => {
                        let m = tree.modules.len();
                        let depth = parent.map_or(0, |q| tree.modules[q].depth + 1);
                        tree.modules.push(Module {
                            path: path.clone(),
                            parent,
                            children: Vec::new(),
                            depth,
                            forward: Vec::new(),
                            backward: Vec::new(),
                            contiguous: true,
                        });
                        if let Some(q) = parent {
                            tree.modules[q].children.push(m);
                        }
                        tree.by_path.insert(path, m);
                        members.push(Vec::new());
                        m
                    }
                };
                members[m].push(fwd_pos[i]);
                ms.push(m);
                parent = Some(m);
            }
            tree.innermost[i] = parent;
            resolved[node_chain[i]] = Some(ms);
        }
        // Spans: every forward node between the first and the last is the module's or
        // scope-less.
        for (m, mem) in members.iter().enumerate() {
            let (lo, hi) = (mem[0], *mem.last().expect("non-empty"));
            let mut nodes = Vec::with_capacity(hi - lo + 1);
            let mut ok = true;
            for &i in &forward[lo..=hi] {
                match tree.innermost[i] {
                    Some(x) if !tree.is_within(x, m) => ok = false,
                    _ => nodes.push(i),
                }
            }
            tree.modules[m].contiguous = ok;
            tree.modules[m].forward = if ok {
                nodes
            } else {
                mem.iter().map(|&k| forward[k]).collect()
            };
        }
        // Scope-less forward nodes inside a span go to the innermost such module.
        let mut span_owner: Vec<Option<usize>> = vec![None; nodes.len()];
        for (m, md) in tree.modules.iter().enumerate() {
            if !md.contiguous {
                continue;
            }
            for &i in &md.forward {
                if tree.innermost[i].is_none()
                    && span_owner[i].is_none_or(|o| tree.modules[o].depth < md.depth)
                {
                    span_owner[i] = Some(m);
                }
            }
        }
        for &i in &forward {
            if tree.innermost[i].is_none() {
                match span_owner[i] {
                    Some(m) => tree.innermost[i] = Some(m),
                    None => tree.unscoped.push(i),
                }
            }
        }
        // Backward nodes follow their forward node.
        for (i, n) in nodes.iter().enumerate() {
            if !n.1 {
                continue;
            }
            let Some(f) = n.0.strip_suffix("/grad").and_then(|f| by_name.get(f)) else {
                continue;
            };
            tree.innermost[i] = tree.innermost[*f];
            let mut m = tree.innermost[i];
            while let Some(x) = m {
                tree.modules[x].backward.push(i);
                m = tree.modules[x].parent;
            }
        }
        tree
    }

    /// Whether module `a` is `b` or lies inside it.
    pub fn is_within(&self, a: usize, b: usize) -> bool {
        let mut x = Some(a);
        while let Some(m) = x {
            if m == b {
                return true;
            }
            x = self.modules[m].parent;
        }
        false
    }

    /// The module with this path.
    pub fn find(&self, path: &str) -> Option<usize> {
        self.by_path.get(path).copied()
    }

    /// Whether node `n` (forward or backward) lies in module `m`.
    pub fn contains(&self, m: usize, n: NodeId) -> bool {
        self.innermost[n].is_some_and(|x| self.is_within(x, m))
    }

    /// Paths of the modules that cannot be checkpointed as one call (called twice,
    /// shared).
    pub fn excluded(&self) -> Vec<String> {
        self.modules
            .iter()
            .filter(|m| !m.contiguous)
            .map(|m| m.path.clone())
            .collect()
    }

    /// Names of the forward nodes outside every module.
    pub fn unscoped_names(&self, g: &RematGraph) -> Vec<String> {
        self.unscoped
            .iter()
            .map(|&i| g.nodes[i].name.clone())
            .collect()
    }
}

/// Op types whose outputs a selective checkpoint keeps: what PyTorch dispatches as
/// `aten.convolution`, `aten.mm`, `aten.addmm` and `aten.bmm`, the ops the policy of
/// the `--pytorch` file saves (`module_plan::pytorch_module`).
pub const SELECTIVE_SAVED_OPS: [&str; 4] = ["Conv", "ConvTranspose", "MatMul", "Gemm"];

/// What checkpointing one module does, precomputed.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The module.
    pub module: usize,
    /// Selective: the outputs of its [`SELECTIVE_SAVED_OPS`] nodes are kept.
    pub selective: bool,
    /// Selective: kept outputs up to the early stop, which the cache holds until the
    /// recomputation takes them back (read at `trigger`).
    pub cached: Vec<ValueId>,
    /// Selective: kept outputs past the early stop, which the frame holds to
    /// `release`.
    pub kept: Vec<ValueId>,
    /// The backward node the recomputation runs before (`None`: nothing unpacked).
    pub trigger: Option<NodeId>,
    /// Forward nodes run again, in order (up to the early stop).
    pub recompute: Vec<NodeId>,
    /// Their cost.
    pub cost: f64,
    /// Values written inside, read by the module's backward (dropped after forward).
    pub dropped: Vec<ValueId>,
    /// The module's inputs (kept to `release`).
    pub args: Vec<ValueId>,
    /// The last backward node that unpacks a saved tensor.
    pub release: Option<NodeId>,
    /// Offloaded instead (`--offload-modules`): `dropped` go to host memory after
    /// their last forward read and each is loaded back before every backward node
    /// of the module that reads it; nothing runs again.
    pub offload: bool,
}

impl Checkpoint {
    /// The checkpoint of module `m`; `Err` when it cannot be one call.
    pub fn new(g: &RematGraph, t: &ModuleTree, m: usize) -> Result<Checkpoint, String> {
        Checkpoint::build(g, t, m, false)
    }

    /// Module `m` offloaded as saved-tensor hooks do: every value written inside it
    /// and read by its backward nodes (parameters and its inputs are not: the hooks
    /// keep those) is copied to host memory when saved, freed on the device after its
    /// last forward read, and copied back before each backward node that reads it.
    /// `Err` when it cannot be one call.
    pub fn offload(g: &RematGraph, t: &ModuleTree, m: usize) -> Result<Checkpoint, String> {
        let mut c = Checkpoint::build(g, t, m, false)?;
        let md = &t.modules[m];
        let inside: std::collections::HashSet<NodeId> = md.forward.iter().copied().collect();
        let mut dropped = Vec::new();
        for &b in &md.backward {
            for &v in &g.nodes[b].inputs {
                let val = &g.values[v];
                if !val.fixed
                    && !val.held
                    && val.producer.is_some_and(|p| inside.contains(&p))
                    && !dropped.contains(&v)
                {
                    dropped.push(v);
                }
            }
        }
        c.dropped = dropped;
        c.offload = true;
        c.recompute.clear();
        c.cost = 0.0;
        c.cached.clear();
        c.kept.clear();
        c.args.clear();
        c.trigger = None;
        c.release = None;
        Ok(c)
    }

    /// The selective checkpoint of module `m` (its convolutions' and matrix
    /// products' outputs kept); `Err` when it cannot be one call.
    pub fn selective(g: &RematGraph, t: &ModuleTree, m: usize) -> Result<Checkpoint, String> {
        Checkpoint::build(g, t, m, true)
    }

    fn build(
        g: &RematGraph,
        t: &ModuleTree,
        m: usize,
        selective: bool,
    ) -> Result<Checkpoint, String> {
        let md = &t.modules[m];
        let saves = |i: NodeId| selective && SELECTIVE_SAVED_OPS.contains(&g.nodes[i].op.as_str());
        if !md.contiguous {
            return Err(format!(
                "module '{}' runs in more than one piece (called twice or shared): it cannot be checkpointed as one call",
                md.path
            ));
        }
        let inside: std::collections::HashSet<NodeId> = md.forward.iter().copied().collect();
        let unpacks = |b: NodeId| {
            g.nodes[b].inputs.iter().any(|&v| {
                let val = &g.values[v];
                val.fixed || val.producer.is_some_and(|p| !g.nodes[p].backward)
            })
        };
        let trigger = md.backward.iter().copied().find(|&b| unpacks(b));
        let release = md.backward.iter().copied().rev().find(|&b| unpacks(b));
        let mut read_back = vec![false; g.values.len()];
        for &b in &md.backward {
            for &v in &g.nodes[b].inputs {
                read_back[v] = true;
            }
        }
        let mut dropped = Vec::new();
        let mut stop = 0;
        for (k, &i) in md.forward.iter().enumerate() {
            for &v in &g.nodes[i].outputs {
                if read_back[v] && g.values[v].producer == Some(i) {
                    stop = k + 1;
                    if !g.values[v].held && !saves(i) && !dropped.contains(&v) {
                        dropped.push(v);
                    }
                }
            }
        }
        let recompute: Vec<NodeId> = if trigger.is_some() {
            md.forward[..stop]
                .iter()
                .copied()
                .filter(|&i| !saves(i))
                .collect()
        } else {
            Vec::new()
        };
        let saved_in = |nodes: &[NodeId]| -> Vec<ValueId> {
            match trigger {
                Some(_) => nodes
                    .iter()
                    .filter(|&&i| saves(i))
                    .flat_map(|&i| g.nodes[i].outputs.iter().copied())
                    .filter(|&v| !g.values[v].fixed && !g.values[v].held)
                    .collect(),
                None => Vec::new(),
            }
        };
        let cached = saved_in(&md.forward[..stop]);
        let kept = saved_in(&md.forward[stop..]);
        let mut args = Vec::new();
        for &i in &md.forward {
            for &v in &g.nodes[i].inputs {
                let val = &g.values[v];
                if !val.fixed
                    && val.producer.is_some_and(|p| !inside.contains(&p))
                    && !args.contains(&v)
                {
                    args.push(v);
                }
            }
        }
        Ok(Checkpoint {
            module: m,
            selective,
            cached,
            kept,
            trigger,
            cost: recompute.iter().map(|&i| g.nodes[i].cost).sum(),
            recompute,
            dropped,
            args,
            release,
            offload: false,
        })
    }
}

/// A module plan and its figures.
#[derive(Debug, Clone, Serialize)]
pub struct ModulePlan {
    /// Checkpointed modules' paths (selective ones included).
    pub modules: Vec<String>,
    /// Those of them checkpointed selectively.
    pub selective: Vec<String>,
    /// Those of them offloaded to host memory instead.
    pub offloaded: Vec<String>,
    /// Host memory the offloaded values take: a copy per backward node that reads
    /// one, as saved-tensor hooks pack each saved tensor (on a Llama config the
    /// `--pytorch` file's hooks packed 1.2 % less: a tensor saved twice is copied once).
    pub host_bytes: u64,
    /// Bytes over PCIe per step: to the host and back, each copy once.
    pub pcie_bytes: u64,
    /// The plan.
    #[serde(skip)]
    pub plan: Vec<Instr>,
    /// Its replayed peak.
    pub peak_bytes: u64,
    /// Cost of the recomputed nodes.
    pub recompute_cost: f64,
    /// Non-fixed, non-held bytes live when forward ends (after the last forward node
    /// and the frees after it): what forward keeps for backward, the model inputs and
    /// parameters (fixed) and the held model outputs not counted.
    pub saved_bytes: u64,
}

/// The plan of a set of checkpoints (an antichain of contiguous modules).
pub fn plan_of(g: &RematGraph, cks: &[&Checkpoint]) -> Vec<Instr> {
    let n = g.nodes.len();
    let mut before: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    let mut release_reads: Vec<Vec<ValueId>> = vec![Vec::new(); n];
    let mut cached_reads: Vec<Vec<ValueId>> = vec![Vec::new(); n];
    // Offloaded values loaded back before each backward node that reads them.
    let mut loads: Vec<Vec<ValueId>> = vec![Vec::new(); n];
    let mut offloaded = vec![false; g.values.len()];
    for c in cks.iter().filter(|c| c.offload) {
        for &v in &c.dropped {
            offloaded[v] = true;
        }
    }
    for (b, node) in g.nodes.iter().enumerate().filter(|(_, x)| x.backward) {
        for &v in &node.inputs {
            if offloaded[v] && !loads[b].contains(&v) {
                loads[b].push(v);
            }
        }
    }
    for c in cks {
        if let Some(t) = c.trigger {
            before[t].extend(&c.recompute);
            // The cache gives its outputs back during the recomputation.
            match c.recompute.last() {
                Some(&r) => cached_reads[r].extend(&c.cached),
                None => release_reads[t].extend(&c.cached),
            }
        }
        if let Some(r) = c.release {
            release_reads[r].extend(&c.args);
            release_reads[r].extend(&c.kept);
        }
    }
    // What runs, in execution order.
    #[derive(Clone, Copy)]
    enum Step {
        /// A node: its first run, or (`true`) a recomputation.
        Run(NodeId, bool),
        /// An offloaded value loaded back.
        Load(ValueId),
    }
    let mut seq: Vec<Step> = Vec::with_capacity(n + cks.len() * 8);
    for (i, b) in before.iter().enumerate() {
        seq.extend(b.iter().map(|&r| Step::Run(r, true)));
        seq.extend(loads[i].iter().map(|&v| Step::Load(v)));
        seq.push(Step::Run(i, false));
    }
    // Backwards: each instance of a value (from its producer or a recompute to the
    // next recompute) is freed after its last read, or at once if none.
    let mut frees: Vec<Vec<ValueId>> = vec![Vec::new(); seq.len()];
    let mut read_seen = vec![false; g.values.len()];
    let skip = |v: ValueId| g.values[v].fixed || g.values[v].held;
    for (p, &step) in seq.iter().enumerate().rev() {
        let (i, re) = match step {
            Step::Run(i, re) => (i, re),
            // A load starts an instance, as a recompute does.
            Step::Load(v) => {
                if !read_seen[v] {
                    frees[p].push(v);
                }
                read_seen[v] = false;
                continue;
            }
        };
        let node = &g.nodes[i];
        for &v in &node.outputs {
            if skip(v) || !(re || g.values[v].producer == Some(i)) {
                continue;
            }
            if !read_seen[v] {
                frees[p].push(v);
            }
            read_seen[v] = false;
        }
        let extra = if re {
            &cached_reads[i][..]
        } else {
            &release_reads[i][..]
        };
        for &v in node.inputs.iter().chain(extra) {
            if !skip(v) && !read_seen[v] {
                read_seen[v] = true;
                frees[p].push(v);
            }
        }
    }
    let mut plan = Vec::with_capacity(seq.len() * 2);
    for (p, &step) in seq.iter().enumerate() {
        plan.push(match step {
            Step::Run(i, _) => Instr::Compute(i),
            Step::Load(v) => Instr::Load(v),
        });
        plan.extend(frees[p].iter().map(|&v| Instr::Free(v)));
    }
    plan
}

/// Non-fixed, non-held bytes live after the last forward node's compute and frees.
pub fn saved_at_forward_end(g: &RematGraph, plan: &[Instr]) -> u64 {
    live_at_forward_end(g, plan)
        .iter()
        .enumerate()
        .filter(|&(v, &l)| l && !g.values[v].fixed && !g.values[v].held)
        .map(|(v, _)| g.values[v].bytes)
        .sum()
}

/// Per value: live after the last forward node's compute and frees (fixed values
/// only if some node writes them).
pub fn live_at_forward_end(g: &RematGraph, plan: &[Instr]) -> Vec<bool> {
    let mut live = vec![false; g.values.len()];
    let Some(last) = (0..g.nodes.len()).rev().find(|&i| !g.nodes[i].backward) else {
        return live;
    };
    let mut seen_last = false;
    for op in plan {
        match *op {
            Instr::Compute(i) => {
                if seen_last {
                    break;
                }
                seen_last = i == last;
                for &v in &g.nodes[i].outputs {
                    live[v] = true;
                }
            }
            Instr::Free(v) => live[v] = false,
            Instr::Load(v) => live[v] = true,
        }
    }
    live
}

/// Live bytes (fixed included) right after each compute of `plan`, which must be
/// valid ([`replay`]); its maximum is the replayed peak.
pub fn timeline(g: &RematGraph, plan: &[Instr]) -> Vec<u64> {
    let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    let mut cur = g.fixed_bytes();
    let mut out = Vec::with_capacity(plan.len());
    for op in plan {
        match *op {
            Instr::Compute(i) => {
                for &v in &g.nodes[i].outputs {
                    if !live[v] {
                        live[v] = true;
                        cur += g.values[v].bytes;
                    }
                }
                out.push(cur);
            }
            Instr::Free(v) => {
                if live[v] && !g.values[v].fixed {
                    live[v] = false;
                    cur -= g.values[v].bytes;
                }
            }
            // Counted from here; the entry after its reader's compute holds it.
            Instr::Load(v) => {
                if !live[v] {
                    live[v] = true;
                    cur += g.values[v].bytes;
                }
            }
        }
    }
    out
}

/// Evaluates a set of checkpoints: plan, peak, cost, saved bytes.
pub fn evaluate(g: &RematGraph, t: &ModuleTree, cks: &[&Checkpoint]) -> Result<ModulePlan, String> {
    let plan = plan_of(g, cks);
    let r = replay(g, &plan)?;
    let paths = |keep: &dyn Fn(&Checkpoint) -> bool| -> Vec<String> {
        cks.iter()
            .filter(|c| keep(c))
            .map(|c| t.modules[c.module].path.clone())
            .collect()
    };
    Ok(ModulePlan {
        modules: paths(&|_| true),
        selective: paths(&|c| c.selective),
        offloaded: paths(&|c| c.offload),
        host_bytes: r.loaded_bytes,
        pcie_bytes: 2 * r.loaded_bytes,
        saved_bytes: saved_at_forward_end(g, &plan),
        peak_bytes: r.peak_bytes,
        recompute_cost: r.recompute_cost,
        plan,
    })
}

/// The plan that checkpoints the modules at `paths` (the library entry tests call):
/// every path must name a module that runs as one call, and no module may lie inside
/// another listed one.
pub fn module_plan_for(g: &RematGraph, paths: &[&str]) -> Result<ModulePlan, String> {
    module_plan_in(g, &ModuleTree::build(g), paths, &[])
}

/// [`module_plan_for`] over the tree `t` of `g`, with the modules at `selective`
/// checkpointed selectively beside them.
pub fn module_plan_in(
    g: &RematGraph,
    t: &ModuleTree,
    paths: &[&str],
    selective: &[&str],
) -> Result<ModulePlan, String> {
    module_plan_with(g, t, paths, selective, &[])
}

/// [`module_plan_in`] with the modules at `offload` offloaded to host memory
/// ([`Checkpoint::offload`]) beside them.
pub fn module_plan_with(
    g: &RematGraph,
    t: &ModuleTree,
    paths: &[&str],
    selective: &[&str],
    offload: &[&str],
) -> Result<ModulePlan, String> {
    #[derive(Clone, Copy, PartialEq)]
    enum How {
        Whole,
        Selective,
        Offload,
    }
    let mut cks: Vec<(Checkpoint, How)> = Vec::new();
    let listed = paths
        .iter()
        .map(|p| (p, How::Whole))
        .chain(selective.iter().map(|p| (p, How::Selective)))
        .chain(offload.iter().map(|p| (p, How::Offload)));
    for (p, how) in listed {
        let m = t
            .find(p)
            .ok_or_else(|| format!("no module '{p}' in this model's node names"))?;
        if let Some((_, was)) = cks.iter().find(|(c, _)| c.module == m) {
            let name = |h: How| match h {
                How::Whole => "whole",
                How::Selective => "selective",
                How::Offload => "offloaded",
            };
            return Err(if *was == how {
                format!("module '{p}' is listed twice")
            } else {
                format!(
                    "module '{p}' is listed both {} and {}: checkpoint it one way",
                    name(*was),
                    name(how)
                )
            });
        }
        cks.push((
            match how {
                How::Whole => Checkpoint::new(g, t, m)?,
                How::Selective => Checkpoint::selective(g, t, m)?,
                How::Offload => Checkpoint::offload(g, t, m)?,
            },
            how,
        ));
    }
    if !selective.is_empty() || !offload.is_empty() {
        cks.sort_by_key(|(c, _)| t.modules[c.module].forward.first().copied());
    }
    for (a, _) in &cks {
        for (b, _) in &cks {
            if a.module != b.module && t.is_within(a.module, b.module) {
                return Err(format!(
                    "'{}' lies inside '{}': checkpoint one or the other",
                    t.modules[a.module].path, t.modules[b.module].path
                ));
            }
        }
    }
    let refs: Vec<&Checkpoint> = cks.iter().map(|(c, _)| c).collect();
    evaluate(g, t, &refs)
}

/// Every repeated block offloaded to host memory ([`Checkpoint::offload`]).
pub fn every_block_offloaded(g: &RematGraph, t: &ModuleTree) -> Result<ModulePlan, String> {
    let cks = repeated_blocks(t)
        .into_iter()
        .map(|m| Checkpoint::offload(g, t, m))
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&Checkpoint> = cks.iter().collect();
    evaluate(g, t, &refs)
}

/// The `every-block` preset: every repeated block ([`repeated_blocks`]) checkpointed.
pub fn every_block(g: &RematGraph) -> Result<ModulePlan, String> {
    every_block_in(g, &ModuleTree::build(g))
}

/// [`every_block`] over the tree `t` of `g`.
pub fn every_block_in(g: &RematGraph, t: &ModuleTree) -> Result<ModulePlan, String> {
    every_block_with(g, t, false)
}

/// Every repeated block checkpointed, selectively (its matrix products', attention's
/// and convolutions' outputs kept: [`Checkpoint::selective`]) or whole.
pub fn every_block_with(
    g: &RematGraph,
    t: &ModuleTree,
    selective: bool,
) -> Result<ModulePlan, String> {
    let cks = repeated_blocks(t)
        .into_iter()
        .map(|m| {
            if selective {
                Checkpoint::selective(g, t, m)
            } else {
                Checkpoint::new(g, t, m)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&Checkpoint> = cks.iter().collect();
    evaluate(g, t, &refs)
}

/// The repeated blocks: under each parent, the outermost children named by
/// consecutive integer indices (`layer1.0`, `layer1.1`, ...; `transformer.h.0` ...),
/// what Hugging Face's `gradient_checkpointing_enable()` checkpoints; modules inside a
/// block are not looked into. In execution order.
pub fn repeated_blocks(t: &ModuleTree) -> Vec<usize> {
    fn index_of(path: &str) -> Option<(&str, u64)> {
        let (pre, n) = path.rsplit_once('.')?;
        n.parse().ok().map(|n| (pre, n))
    }
    fn visit(t: &ModuleTree, level: &[usize], out: &mut Vec<usize>) {
        let mut groups: HashMap<&str, Vec<u64>> = HashMap::new();
        for &c in level {
            if let Some((pre, n)) = index_of(&t.modules[c].path) {
                groups.entry(pre).or_default().push(n);
            }
        }
        for ns in groups.values_mut() {
            ns.sort_unstable();
        }
        for &c in level {
            let block = index_of(&t.modules[c].path).is_some_and(|(pre, _)| {
                let ns = &groups[pre];
                ns.len() >= 2 && ns.windows(2).all(|w| w[1] == w[0] + 1)
            });
            if block {
                if t.modules[c].contiguous {
                    out.push(c);
                }
            } else {
                visit(t, &t.modules[c].children, out);
            }
        }
    }
    let roots: Vec<usize> = (0..t.modules.len())
        .filter(|&m| t.modules[m].parent.is_none())
        .collect();
    let mut out = Vec::new();
    visit(t, &roots, &mut out);
    out.sort_by_key(|&m| t.modules[m].forward.first().copied());
    out
}
