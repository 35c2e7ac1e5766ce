//! The rematerialization problem, independent of where it comes from: a DAG of
//! compute nodes in a topological order, each reading and writing values of known
//! size, plus a fixed amount of memory that is resident throughout (parameters,
//! optimizer state...). A training [`Schedule`](crate::train::Schedule) maps onto it
//! one step per node and one storage per value; the published benchmark graphs
//! (Checkmate, Moccasin) map onto it one node per value.
//!
//! A plan is a sequence of [`Instr`]s: compute a node (allocating the values it writes
//! that are not live), or free a value. [`replay`] checks a plan and measures it.

use serde::{Deserialize, Serialize};

use crate::memory::allocator::OutOfMemory;
use crate::memory::device::{replay_events, AllocatorReport, DeviceModel, Event, StepValues};

/// Index of a node.
pub type NodeId = usize;
/// Index of a value.
pub type ValueId = usize;

/// A computation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RNode {
    /// Name (the ONNX node name and phase, or the benchmark's node name).
    pub name: String,
    /// Cost of one execution (FLOPs, seconds, or the benchmark's units).
    pub cost: f64,
    /// Values read (all produced by earlier nodes, or fixed).
    pub inputs: Vec<ValueId>,
    /// Values written.
    pub outputs: Vec<ValueId>,
    /// Backward phase (for reporting and for which values count as saved).
    pub backward: bool,
    /// Can be executed again (false for the loss, optimizer and gradient accumulation,
    /// whose re-execution would change results).
    pub recomputable: bool,
    /// Op type (the ONNX `op_type` of a training step's node; empty in the benchmark
    /// graphs): what a selective checkpoint keeps ([`super::modules`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub op: String,
}

/// A value (an allocation).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RValue {
    /// Name.
    pub name: String,
    /// Bytes.
    pub bytes: u64,
    /// The node that writes it (`None` for fixed values).
    pub producer: Option<NodeId>,
    /// Resident from the start to the end (parameters, optimizer state, inputs).
    pub fixed: bool,
    /// Once computed, kept to the end (model outputs, loss, parameter gradients).
    pub held: bool,
}

/// The problem.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RematGraph {
    /// Name of the graph.
    pub name: String,
    /// Nodes in a valid execution order (the order of the no-recompute schedule).
    pub nodes: Vec<RNode>,
    /// Values.
    pub values: Vec<RValue>,
}

/// One instruction of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", content = "id", rename_all = "snake_case")]
pub enum Instr {
    /// Execute a node.
    Compute(NodeId),
    /// Release a value.
    Free(ValueId),
    /// Bring back a value offloaded to host memory (`plan --offload-modules`): a copy
    /// written from the host before a backward node that reads it, with no compute;
    /// the value must have been computed and be freed (offloaded) since.
    Load(ValueId),
}

/// What replaying a plan measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Replayed {
    /// Peak bytes (fixed values included).
    pub peak_bytes: u64,
    /// Index into the plan where the peak occurs.
    pub peak_at: usize,
    /// Total cost of every compute.
    pub cost: f64,
    /// Cost of computes beyond each node's first.
    pub recompute_cost: f64,
    /// Bytes copied back from host memory ([`Instr::Load`]), every load counted.
    #[serde(default)]
    pub loaded_bytes: u64,
}

impl RematGraph {
    /// Bytes resident throughout.
    pub fn fixed_bytes(&self) -> u64 {
        self.values
            .iter()
            .filter(|v| v.fixed)
            .map(|v| v.bytes)
            .sum()
    }

    /// Sum of every node's cost once.
    pub fn base_cost(&self) -> f64 {
        self.nodes.iter().map(|n| n.cost).sum()
    }

    /// For each value, the nodes that read it, in order.
    pub fn readers(&self) -> Vec<Vec<NodeId>> {
        let mut r = vec![Vec::new(); self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for &v in &n.inputs {
                if r[v].last() != Some(&i) {
                    r[v].push(i);
                }
            }
        }
        r
    }

    /// No schedule can run below this: the largest single node's inputs and outputs,
    /// plus the fixed values.
    pub fn op_local_bound(&self) -> u64 {
        let fixed = self.fixed_bytes();
        let local = self
            .nodes
            .iter()
            .map(|n| {
                let mut vs: Vec<ValueId> = n.inputs.iter().chain(&n.outputs).copied().collect();
                vs.sort_unstable();
                vs.dedup();
                vs.iter()
                    .filter(|&&v| !self.values[v].fixed)
                    .map(|&v| self.values[v].bytes)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        fixed + local
    }

    /// That every id the graph holds names one of its nodes or values, and that its
    /// value bytes total at most 2^62 (a graph read from a file is checked before
    /// anything indexes by those ids).
    pub fn check(&self) -> std::result::Result<(), String> {
        let (nn, nv) = (self.nodes.len(), self.values.len());
        for n in &self.nodes {
            if let Some(&v) = n.inputs.iter().chain(&n.outputs).find(|&&v| v >= nv) {
                return Err(format!("node '{}' names value {v}, of {nv}", n.name));
            }
        }
        if let Some(v) = self
            .values
            .iter()
            .find(|v| v.producer.is_some_and(|p| p >= nn))
        {
            return Err(format!(
                "value '{}' names a writer past the {nn} nodes",
                v.name
            ));
        }
        let total: u128 = self.values.iter().map(|v| v.bytes as u128).sum();
        if total > 1 << 62 {
            return Err(format!(
                "its values total {total} bytes, beyond what memplan counts"
            ));
        }
        Ok(())
    }

    /// The peak of [`RematGraph::no_recompute_plan`], replayed: the baseline every
    /// budget fraction is of.
    pub fn baseline_peak(&self) -> std::result::Result<u64, String> {
        replay(self, &self.no_recompute_plan()).map(|r| r.peak_bytes)
    }

    /// The plan that computes every node once, in order, freeing each value after
    /// its last reader (held values never).
    pub fn no_recompute_plan(&self) -> Vec<Instr> {
        let readers = self.readers();
        let mut last_use = vec![None; self.values.len()];
        for (v, rs) in readers.iter().enumerate() {
            last_use[v] = rs.last().copied();
        }
        let mut frees_after: Vec<Vec<ValueId>> = vec![Vec::new(); self.nodes.len()];
        for (v, val) in self.values.iter().enumerate() {
            if val.fixed || val.held {
                continue;
            }
            let Some(p) = val.producer else { continue };
            let at = last_use[v].unwrap_or(p).max(p);
            frees_after[at].push(v);
        }
        let mut plan = Vec::with_capacity(self.nodes.len() * 2);
        for (i, fr) in frees_after.iter().enumerate() {
            plan.push(Instr::Compute(i));
            plan.extend(fr.iter().map(|&v| Instr::Free(v)));
        }
        plan
    }
}

/// A valid plan's training loop on a device: its allocations replayed through the
/// caching allocator (`memory::device`); `values` are the step's
/// ([`StepValues::of`] its schedule).
pub fn replay_on_device(
    g: &RematGraph,
    plan: &[Instr],
    values: &StepValues,
    d: &DeviceModel,
) -> Result<AllocatorReport, OutOfMemory> {
    let mut events = Vec::with_capacity(plan.len() * 3);
    for op in plan {
        match *op {
            Instr::Compute(i) => {
                let n = &g.nodes[i];
                events.push(Event::Step {
                    backward: n.backward,
                });
                events.extend(n.inputs.iter().chain(&n.outputs).map(|&v| Event::Alloc(v)));
            }
            Instr::Free(v) => events.push(Event::Free(v)),
            Instr::Load(v) => events.push(Event::Alloc(v)),
        }
    }
    let fixed: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    replay_events(values, &fixed, &events, d)
}

/// Replays a plan: every compute must find its inputs live; returns the peak and
/// costs, or a message naming the first violation.
pub fn replay(g: &RematGraph, plan: &[Instr]) -> Result<Replayed, String> {
    g.check()?;
    let mut live = vec![false; g.values.len()];
    let mut cur = 0u64;
    for (v, val) in g.values.iter().enumerate() {
        if val.fixed {
            live[v] = true;
            cur += val.bytes;
        }
    }
    let mut computed = vec![false; g.nodes.len()];
    let (mut peak, mut peak_at) = (cur, 0);
    let (mut cost, mut recompute_cost) = (0.0, 0.0);
    let mut loaded_bytes = 0u64;
    for (k, op) in plan.iter().enumerate() {
        match *op {
            Instr::Compute(i) => {
                let n = g
                    .nodes
                    .get(i)
                    .ok_or_else(|| format!("step {k}: no node {i}"))?;
                if let Some(&v) = n.inputs.iter().find(|&&v| !live[v]) {
                    return Err(format!(
                        "step {k}: '{}' reads '{}', which is not live",
                        n.name, g.values[v].name
                    ));
                }
                if computed[i] {
                    if !n.recomputable {
                        return Err(format!("step {k}: '{}' cannot be recomputed", n.name));
                    }
                    recompute_cost += n.cost;
                }
                computed[i] = true;
                cost += n.cost;
                for &v in &n.outputs {
                    if !live[v] {
                        live[v] = true;
                        cur += g.values[v].bytes;
                    }
                }
                if cur > peak {
                    peak = cur;
                    peak_at = k;
                }
            }
            Instr::Free(v) => {
                let val = g
                    .values
                    .get(v)
                    .ok_or_else(|| format!("step {k}: no value {v}"))?;
                if val.fixed {
                    return Err(format!(
                        "step {k}: '{}' is fixed and cannot be freed",
                        val.name
                    ));
                }
                if live[v] {
                    live[v] = false;
                    cur -= val.bytes;
                }
            }
            Instr::Load(v) => {
                let val = g
                    .values
                    .get(v)
                    .ok_or_else(|| format!("step {k}: no value {v}"))?;
                if !val.producer.is_some_and(|p| computed[p]) {
                    return Err(format!(
                        "step {k}: '{}' is loaded before it is computed",
                        val.name
                    ));
                }
                loaded_bytes += val.bytes;
                // A copy of a value still live is one allocation here.
                if !live[v] {
                    live[v] = true;
                    cur += val.bytes;
                }
                if cur > peak {
                    peak = cur;
                    peak_at = k;
                }
            }
        }
    }
    if let Some(i) = computed.iter().position(|&c| !c) {
        return Err(format!("node '{}' is never computed", g.nodes[i].name));
    }
    Ok(Replayed {
        peak_bytes: peak,
        peak_at,
        cost,
        recompute_cost,
        loaded_bytes,
    })
}
