//! FSDP2 (`torch.distributed.fsdp.fully_shard`), one rank's step.
//!
//! **Units.** `fully_shard` is applied to each repeated block (a decoder layer) and
//! then to the root; each unit's parameters are one group, gathered and freed
//! together. The root holds every parameter no block holds (embeddings, final norm,
//! LM head). `--fsdp-units A,B` names the units instead (module paths).
//!
//! **What a rank holds** (torch/distributed/fsdp/_fully_shard/, PyTorch 2.x), with
//! `P_u` the unit's parameter elements padded to a multiple of the shard degree `N`
//! on dim 0 (`FSDPParam` pads dim 0 to `ceil(d0/N)` rows per rank):
//! - the sharded parameters, `P_u/N` in the original dtype, all step long; their
//!   optimizer state and update temporaries likewise sharded;
//! - forward, `pre_forward` → `unshard`: `foreach_all_gather` allocates one flat
//!   output of `P_u` elements in `param_dtype` (the local shard is copied into its
//!   own slice of it: no separate input), then `foreach_all_gather_copy_out` copies
//!   it into per-parameter unsharded tensors (`P_u` again) and drops the flat buffer:
//!   two copies at that moment, one after. `post_forward` frees the unsharded
//!   parameters when `reshard_after_forward` (the root never reshards after
//!   forward: `_lazy_init` clears its post-forward mesh), else they stay until the
//!   unit's backward ends;
//! - backward, `pre_backward`: the unit is gathered again (when resharded) and the
//!   next unit in backward order is prefetched (`_backward_prefetch`, on by
//!   default), so two units are gathered at once;
//! - `post_backward`: the unsharded parameters are freed and `foreach_reduce` copies
//!   the unit's unsharded gradients (`P_u` in `param_dtype`, written by autograd as
//!   the unit's backward runs) into a reduce-scatter input of `P_u` elements in
//!   `reduce_dtype`, frees them, and reduce-scatters into an output of `P_u/N`
//!   elements: the sharded gradient (cast to the original dtype when `reduce_dtype`
//!   differs). The input is kept until the next unit's reduce-scatter
//!   (`comm_ctx.reduce_scatter_state`, held for stream ordering), the last one until
//!   backward ends.
//! - `CPUOffloadPolicy`: sharded parameters, gradients and optimizer state live on the
//!   host; the update runs there; the GPU holds what is gathered and reduced.
//! - HSDP (replicate × shard): the same per rank with `N` the shard degree; the
//!   sharded gradients are all-reduced across replicas in place.

use std::collections::HashMap;

use serde::Serialize;

use crate::ir::DType;
use crate::remat::modules::{repeated_blocks, ModuleTree};
use crate::train::{Schedule, Step, StepKind, StorageId, StorageKind};

/// FSDP2's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Fsdp {
    /// Shard degree: the ranks each unit's parameters are split over.
    pub shards: u64,
    /// Replicas (HSDP's replicate degree; 1: plain FSDP).
    pub replicas: u64,
    /// `reshard_after_forward`.
    pub reshard_after_forward: bool,
    /// Module paths of the units (`None`: every repeated block, and the root).
    pub units: Option<Vec<String>>,
    /// `MixedPrecisionPolicy.param_dtype` (`None`: the parameters' own dtype). The
    /// schedule is built in this precision; the sharded parameters, gradients and
    /// optimizer state are kept in `orig_dtype`.
    pub param_dtype: Option<DType>,
    /// `MixedPrecisionPolicy.reduce_dtype` (`None`: `param_dtype`).
    pub reduce_dtype: Option<DType>,
    /// The dtype of the sharded parameters (the model's; `None`: the schedule's).
    pub orig_dtype: Option<DType>,
    /// `CPUOffloadPolicy`.
    pub offload: bool,
}

impl Fsdp {
    /// The sizes of the process groups a rank communicates in: the shard group and,
    /// under HSDP, the replicate group.
    pub fn groups(&self) -> [u64; 2] {
        [self.shards, self.replicas]
    }
}

impl Default for Fsdp {
    fn default() -> Self {
        Fsdp {
            shards: 1,
            replicas: 1,
            reshard_after_forward: true,
            units: None,
            param_dtype: None,
            reduce_dtype: None,
            orig_dtype: None,
            offload: false,
        }
    }
}

/// What [`shard`] did, for reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FsdpSummary {
    /// The units, in forward order (`root` last).
    pub units: Vec<String>,
    /// Unsharded parameter bytes of the largest unit in `param_dtype`.
    pub largest_unit_bytes: u64,
    /// Sharded parameter bytes on this rank.
    pub sharded_param_bytes: u64,
    /// Bytes one step all-gathers into this rank (forward and backward).
    pub all_gather_bytes: u64,
    /// Bytes one step reduce-scatters from this rank.
    pub reduce_scatter_bytes: u64,
}

/// One FSDP unit of the schedule.
#[derive(Debug, Default)]
struct Unit {
    name: String,
    /// Parameter storages.
    params: Vec<StorageId>,
    /// Gradient storages of those parameters.
    grads: Vec<StorageId>,
    /// Its forward and backward steps (the root: none; it spans the step).
    fwd: Vec<usize>,
    bwd: Vec<usize>,
    /// Padded elements.
    numel: u64,
}

/// Elements of one rank's shard of a `shape` tensor over `n` ranks (dim 0 padded).
fn shard_numel(shape: &[usize], n: u64) -> u64 {
    match shape.split_first() {
        None => 1u64.div_ceil(n),
        Some((&d0, rest)) => {
            (d0 as u64).div_ceil(n) * rest.iter().map(|&d| d as u64).product::<u64>()
        }
    }
}

/// Whether FSDP shards the storage: a parameter, trainable or frozen (the schedule's
/// buffers, running statistics and rotary tables, stay whole).
fn sharded(s: &crate::train::Storage) -> bool {
    // A parameter another pipeline stage holds has no bytes on this rank.
    s.kind == StorageKind::Parameter && s.bytes > 0
}

/// The units of `s`: the given module paths or the repeated blocks, then the root.
fn units(s: &Schedule, given: Option<&[String]>, t: &ModuleTree) -> Result<Vec<Unit>, String> {
    let mods: Vec<usize> = match given {
        Some(paths) => paths
            .iter()
            .map(|p| {
                t.find(p).ok_or_else(|| {
                    let known: Vec<&str> = repeated_blocks(t)
                        .iter()
                        .take(3)
                        .map(|&m| t.modules[m].path.as_str())
                        .collect();
                    format!(
                        "no module '{p}' in the model (repeated blocks: {})",
                        known.join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        None => repeated_blocks(t),
    };
    let mut owner: HashMap<StorageId, usize> = HashMap::new();
    let mut out: Vec<Unit> = Vec::new();
    for (i, &m) in mods.iter().enumerate() {
        let md = &t.modules[m];
        let mut u = Unit {
            name: md.path.clone(),
            fwd: md.forward.clone(),
            bwd: md.backward.clone(),
            ..Default::default()
        };
        for &n in &md.forward {
            for &r in &s.steps[n].reads {
                if sharded(&s.storages[r]) && !owner.contains_key(&r) {
                    owner.insert(r, i);
                    u.params.push(r);
                }
            }
        }
        out.push(u);
    }
    let mut root = Unit {
        name: "root".into(),
        ..Default::default()
    };
    for (k, st) in s.storages.iter().enumerate() {
        if sharded(st) && !owner.contains_key(&k) {
            root.params.push(k);
        }
    }
    out.push(root);
    // Gradients by where they are made: a block's in its backward steps (the
    // weight gradient of a transposed matmul operand is a view of an activation
    // gradient, named after it), the rest the root's.
    let mut claimed: Vec<bool> = vec![false; s.storages.len()];
    let root_ix = out.len() - 1;
    for u in out.iter_mut().take(root_ix) {
        for &n in &u.bwd {
            let st = &s.steps[n];
            for &w in st.writes.iter().chain(&st.updates) {
                if s.storages[w].kind == StorageKind::ParamGrad && !claimed[w] {
                    claimed[w] = true;
                    u.grads.push(w);
                }
            }
        }
    }
    for (k, st) in s.storages.iter().enumerate() {
        if st.kind == StorageKind::ParamGrad && !claimed[k] {
            out[root_ix].grads.push(k);
        }
    }
    Ok(out)
}

/// Rewrites `s` into one rank's step under FSDP2 `f`.
pub fn shard(s: &mut Schedule, f: &Fsdp) -> Result<FsdpSummary, String> {
    let t = ModuleTree::of_schedule(s);
    shard_in(s, f, &t)
}

/// [`shard`] with the module tree of `s` ([`ModuleTree::of_schedule`]) given: the
/// same for every batch of one model's step, so a caller trying many may build it
/// once.
pub fn shard_in(s: &mut Schedule, f: &Fsdp, t: &ModuleTree) -> Result<FsdpSummary, String> {
    let n = f.shards.max(1);
    let mut us = units(s, f.units.as_deref(), t)?;
    for u in &mut us {
        u.numel = u
            .params
            .iter()
            .map(|&p| shard_numel(&s.storages[p].shape, n) * n)
            .sum();
    }
    let sched_dtype = us
        .iter()
        .flat_map(|u| u.params.first())
        .map(|&p| s.storages[p].dtype)
        .next()
        .unwrap_or(DType::F32);
    let param_dtype = f.param_dtype.unwrap_or(sched_dtype);
    let reduce_dtype = f.reduce_dtype.unwrap_or(param_dtype);
    let orig = f.orig_dtype.unwrap_or(sched_dtype);
    let size = |d: DType| d.bits().div_ceil(8).max(1);
    let (pb, rb, ob) = (size(param_dtype), size(reduce_dtype), size(orig));
    let mut summary = FsdpSummary {
        units: us.iter().map(|u| u.name.clone()).collect(),
        largest_unit_bytes: us.iter().map(|u| u.numel * pb).max().unwrap_or(0),
        ..Default::default()
    };
    // Sharded parameters, optimizer state and temporaries.
    let scale = |bytes: u64, from: u64| -> u64 { (bytes / from.max(1)).div_ceil(n) * ob };
    for u in &us {
        for &p in &u.params {
            let st = &mut s.storages[p];
            st.bytes = if f.offload {
                0
            } else {
                shard_numel(&st.shape, n) * ob
            };
            st.pieces.clear();
            summary.sharded_param_bytes += st.bytes;
        }
    }
    let master = us
        .iter()
        .flat_map(|u| u.grads.first())
        .next()
        .map_or(ob, |&g| size(s.storages[g].dtype));
    for st in &mut s.storages {
        if matches!(
            st.kind,
            StorageKind::OptimizerState | StorageKind::OptimizerTemp
        ) {
            st.bytes = if f.offload {
                0
            } else {
                scale(st.bytes, master)
            };
            st.pieces.clear();
        }
    }
    let plan = Rewrite::new(&us, f, [pb, rb, ob]);
    let (ag, rs) = plan.apply(s);
    summary.all_gather_bytes = ag;
    summary.reduce_scatter_bytes = rs;
    Ok(summary)
}

/// Where the collectives go, and the storages they make.
struct Rewrite<'u> {
    units: &'u [Unit],
    f: Fsdp,
    /// Bytes per element: param, reduce, original dtype.
    bytes: [u64; 3],
    /// Steps inserted before each original step.
    before: HashMap<usize, Vec<Step>>,
    /// Storages each original step reads in addition.
    reads: HashMap<usize, Vec<StorageId>>,
}

/// The original schedule's landmarks.
struct Marks {
    first_fwd: usize,
    last_fwd: usize,
    first_bwd: usize,
    last_bwd: usize,
}

impl Marks {
    fn of(s: &Schedule) -> Marks {
        let pos = |k: StepKind| s.steps.iter().position(|x| x.kind == k);
        let rpos = |k: StepKind| s.steps.iter().rposition(|x| x.kind == k);
        let first_fwd = pos(StepKind::Forward).unwrap_or(0);
        let first_bwd = pos(StepKind::Backward).unwrap_or(s.steps.len());
        Marks {
            first_fwd,
            last_fwd: rpos(StepKind::Forward).unwrap_or(first_fwd),
            first_bwd,
            last_bwd: rpos(StepKind::Backward).unwrap_or(first_bwd),
        }
    }
}

impl<'u> Rewrite<'u> {
    fn new(units: &'u [Unit], f: &Fsdp, bytes: [u64; 3]) -> Rewrite<'u> {
        Rewrite {
            units,
            f: f.clone(),
            bytes,
            before: HashMap::new(),
            reads: HashMap::new(),
        }
    }

    /// Inserts `step` before original step `at`.
    fn insert(&mut self, at: usize, step: Step) {
        self.before.entry(at).or_default().push(step);
    }

    /// Makes original steps `steps` read `v`.
    fn read_by(&mut self, v: StorageId, steps: impl IntoIterator<Item = usize>) {
        for r in steps {
            self.reads.entry(r).or_default().push(v);
        }
    }

    /// A step's name inside unit `u`'s scope (beside its first forward node), so
    /// that checkpointing the unit reruns what it does with it.
    fn scoped(&self, s: &Schedule, u: usize, what: &str) -> String {
        let unit = &self.units[u];
        match unit
            .fwd
            .first()
            .and_then(|&f| s.steps[f].name.rsplit_once('/'))
        {
            Some((scope, _)) if !scope.is_empty() => format!("{scope}/{what}"),
            _ => format!("fsdp/{}/{what}", unit.name),
        }
    }

    /// `foreach_all_gather` of unit `u` before step `at`: the flat output (and,
    /// under mixed precision, the shards cast for it, freed at once), after which
    /// `release` (the previous unit's flat output) is freed. Returns the flat output.
    fn all_gather(
        &mut self,
        s: &mut Schedule,
        u: usize,
        at: usize,
        release: Option<StorageId>,
        kind: StepKind,
    ) -> StorageId {
        let [pb, _, ob] = self.bytes;
        let n = self.f.shards.max(1);
        let unit = &self.units[u];
        let flat = s.add_storage(
            format!("fsdp {} all-gather output", unit.name),
            unit.numel * pb,
            StorageKind::Parameter,
        );
        let mut writes = vec![flat];
        if pb != ob {
            let cast = unit.numel / n * pb;
            writes.push(s.add_storage(
                format!("fsdp {} all-gather input", unit.name),
                cast,
                StorageKind::Parameter,
            ));
        }
        let name = if kind == StepKind::Forward {
            self.scoped(s, u, "FsdpAllGather")
        } else {
            format!("fsdp/{}/all-gather (backward)", self.units[u].name)
        };
        let mut step = Step::new(
            name,
            "FsdpAllGather",
            kind,
            release.into_iter().collect(),
            writes,
            0,
        );
        step.reads.push(flat);
        self.insert(at, step);
        flat
    }

    /// `foreach_all_gather_copy_out` of unit `u` before step `at`: the unsharded
    /// parameters, which `readers` read; `flat` is freed after it when `last`.
    fn copy_out(
        &mut self,
        s: &mut Schedule,
        u: usize,
        at: usize,
        flat: StorageId,
        readers: Vec<usize>,
        kind: StepKind,
    ) {
        let unit = &self.units[u];
        let params = s.add_storage(
            format!("fsdp {} unsharded parameters", unit.name),
            unit.numel * self.bytes[0],
            StorageKind::Parameter,
        );
        let name = if kind == StepKind::Forward {
            self.scoped(s, u, "FsdpCopyOut")
        } else {
            format!("fsdp/{}/copy-out (backward)", self.units[u].name)
        };
        self.insert(
            at,
            Step::new(name, "FsdpCopyOut", kind, vec![flat], vec![params], 0),
        );
        self.read_by(params, readers);
    }

    /// Inserts the collectives; returns the bytes all-gathered and reduce-scattered.
    fn apply(mut self, s: &mut Schedule) -> (u64, u64) {
        let m = Marks::of(s);
        let root = self.units.len() - 1;
        let pb = self.bytes[0];
        let mut ag = 0;
        // Forward: the root first, kept to the end of backward; then each block in
        // order, its flat output kept until the next unit's all-gather (the last
        // one's until the end of forward).
        let mut order: Vec<usize> = (0..root)
            .filter(|&u| !self.units[u].fwd.is_empty())
            .collect();
        order.sort_by_key(|&u| self.units[u].fwd[0]);
        let flat = self.all_gather(s, root, m.first_fwd, None, StepKind::Forward);
        self.copy_out(
            s,
            root,
            m.first_fwd,
            flat,
            (m.first_fwd..=m.last_bwd).collect(),
            StepKind::Forward,
        );
        ag += self.units[root].numel * pb;
        let mut prev = flat;
        for &u in &order {
            let start = self.units[u].fwd[0];
            let flat = self.all_gather(s, u, start, Some(prev), StepKind::Forward);
            let mut readers = self.units[u].fwd.clone();
            if !self.f.reshard_after_forward {
                readers.extend(&self.units[u].bwd);
            }
            self.copy_out(s, u, start, flat, readers, StepKind::Forward);
            ag += self.units[u].numel * pb;
            prev = flat;
        }
        self.read_by(prev, [m.last_fwd]);
        // Backward (resharded units): the root's pre-backward prefetches the last
        // block's flat output; each block's pre-backward copies its own out and
        // prefetches the next one's.
        let mut back: Vec<usize> = (0..root)
            .filter(|&u| !self.units[u].bwd.is_empty())
            .collect();
        back.sort_by_key(|&u| self.units[u].bwd[0]);
        if self.f.reshard_after_forward && !back.is_empty() {
            let mut flat = self.all_gather(s, back[0], m.first_bwd, None, StepKind::Backward);
            for (j, &u) in back.iter().enumerate() {
                let start = self.units[u].bwd[0];
                let readers = self.units[u].bwd.clone();
                self.copy_out(s, u, start, flat, readers, StepKind::Backward);
                ag += self.units[u].numel * pb;
                if let Some(&next) = back.get(j + 1) {
                    flat = self.all_gather(s, next, start, None, StepKind::Backward);
                }
            }
        }
        let rs = self.reduce_scatters(s, &back, m.last_bwd);
        self.splice(s);
        (ag, rs)
    }

    /// `post_backward` of each unit after its backward (the root's after all of
    /// backward): the reduce-scatter input (the previous one freed first), the
    /// unsharded gradients copied in and freed, the reduce output (the sharded
    /// gradients the optimizer reads). Returns the bytes reduce-scattered.
    fn reduce_scatters(&mut self, s: &mut Schedule, back: &[usize], last_bwd: usize) -> u64 {
        let root = self.units.len() - 1;
        let n = self.f.shards.max(1);
        let [_, rb, ob] = self.bytes;
        let mut seq: Vec<(usize, usize)> = Vec::new();
        for &u in back {
            let unit = &self.units[u];
            // After the unit's last backward step and every write of its gradients.
            let mut end = unit.bwd.last().copied().unwrap_or(last_bwd);
            for (i, st) in s.steps.iter().enumerate() {
                if st.kind == StepKind::Backward
                    && st
                        .writes
                        .iter()
                        .chain(&st.updates)
                        .any(|w| unit.grads.contains(w))
                {
                    end = end.max(i);
                }
            }
            seq.push((end, u));
        }
        seq.push((last_bwd, root));
        seq.sort_by_key(|&(at, _)| at);
        let optimizer: Vec<usize> = (0..s.steps.len())
            .filter(|&i| s.steps[i].kind == StepKind::Optimizer)
            .collect();
        let mut prev: Option<StorageId> = None;
        let mut total = 0;
        for (end, u) in seq {
            let unit = &self.units[u];
            // The previous input lives through this unit's backward.
            if let Some(p) = prev {
                self.read_by(p, [end]);
            }
            let input = s.add_storage(
                format!("fsdp {} reduce-scatter input", unit.name),
                unit.numel * rb,
                StorageKind::GradTemp,
            );
            let shard = unit.numel / n;
            let grad = s.add_storage(
                format!("fsdp {} sharded gradients", unit.name),
                if self.f.offload { 0 } else { shard * ob },
                StorageKind::ParamGrad,
            );
            let resident = unit.grads.iter().any(|&g| s.storages[g].persistent);
            s.storages[grad].held = true;
            s.storages[grad].persistent = resident;
            for &g in &unit.grads {
                let st = &mut s.storages[g];
                st.held = false;
                st.persistent = false;
            }
            let copy_in = Step::new(
                format!("fsdp/{}/reduce-scatter copy-in", unit.name),
                "FsdpReduceScatter",
                StepKind::Backward,
                unit.grads.clone(),
                vec![input],
                0,
            );
            let mut writes = vec![grad];
            if rb != ob {
                writes.push(s.add_storage(
                    format!("fsdp {} reduce output", unit.name),
                    shard * rb,
                    StorageKind::GradTemp,
                ));
            }
            let reduce = Step::new(
                format!("fsdp/{}/reduce-scatter", unit.name),
                "FsdpReduceScatter",
                StepKind::Backward,
                vec![input],
                writes,
                0,
            );
            self.insert(end + 1, copy_in);
            self.insert(end + 1, reduce);
            self.read_by(grad, optimizer.iter().copied());
            total += unit.numel * rb;
            prev = Some(input);
        }
        // The optimizer reads the sharded gradients, not the unsharded ones.
        let dropped: Vec<StorageId> = self.units.iter().flat_map(|u| u.grads.clone()).collect();
        for &o in &optimizer {
            s.steps[o].reads.retain(|r| !dropped.contains(r));
        }
        total
    }

    /// Inserts the new steps and reads into `s`.
    fn splice(self, s: &mut Schedule) {
        let Rewrite {
            mut before, reads, ..
        } = self;
        let old = std::mem::take(&mut s.steps);
        let n = old.len();
        s.steps
            .reserve(n + before.values().map(Vec::len).sum::<usize>());
        for (i, mut st) in old.into_iter().enumerate() {
            s.steps.extend(before.remove(&i).unwrap_or_default());
            if let Some(extra) = reads.get(&i) {
                for &r in extra {
                    if !st.reads.contains(&r) {
                        st.reads.push(r);
                    }
                }
            }
            s.steps.push(st);
        }
        s.steps.extend(before.remove(&n).unwrap_or_default());
    }
}
