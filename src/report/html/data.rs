//! What the HTML report shows, worked out from a training step: the tensors live at
//! the peak, the module table, and a plan's curves before and after, all on the
//! original step's axis.

use serde::Serialize;

use crate::memory::simulate::{category, Category};
use crate::memory::Replay;
use crate::remat::graph::{replay, Instr, RematGraph};
use crate::remat::modules::{timeline, ModuleTree};
use crate::remat::plan::{recomputed_modules, recomputed_values};
use crate::train::Schedule;

/// One tensor live at the peak.
#[derive(Debug, Clone, Serialize)]
pub struct LiveRow {
    /// Storage name.
    pub name: String,
    /// Its category.
    pub category: Category,
    /// Element type.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub bytes: u64,
    /// The step that wrote it first (`None`: live from the start).
    pub made_by: Option<String>,
}

/// The step that first writes each storage.
fn producers(s: &Schedule) -> Vec<Option<usize>> {
    let mut p = vec![None; s.storages.len()];
    for (i, st) in s.steps.iter().enumerate() {
        for &w in &st.writes {
            p[w].get_or_insert(i);
        }
    }
    p
}

/// Whether storage `k` is live during `step`.
fn live_during(r: &Replay, k: usize, step: usize) -> bool {
    r.intervals
        .get(k)
        .is_some_and(|iv| iv.iter().any(|&(a, b)| a <= step && step <= b))
}

/// The `n` largest storages live at the replay's peak step, largest first.
pub fn largest_at_peak(s: &Schedule, r: &Replay, n: usize) -> Vec<LiveRow> {
    let prod = producers(s);
    let mut rows: Vec<LiveRow> = s
        .storages
        .iter()
        .enumerate()
        .filter(|&(k, _)| live_during(r, k, r.peak_step))
        .map(|(k, st)| LiveRow {
            name: st.name.clone(),
            category: category(st),
            dtype: st.dtype.name().to_string(),
            shape: st.shape.clone(),
            bytes: st.bytes,
            made_by: if st.persistent {
                None
            } else {
                prod[k].map(|i| s.steps[i].name.clone())
            },
        })
        .collect();
    rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    rows.truncate(n);
    rows
}

/// One module of the per-module table.
#[derive(Debug, Clone, Serialize)]
pub struct ModuleRow {
    /// Dotted path (`layer3.1`).
    pub path: String,
    /// Depth in the tree (0: top level).
    pub depth: usize,
    /// Forward steps inside it.
    pub forward_steps: usize,
    /// Bytes of tensors its forward steps write that backward reads.
    pub saved_bytes: u64,
    /// Bytes of tensors its steps (forward and backward) wrote that are live at the
    /// peak.
    pub live_at_peak_bytes: u64,
    /// `live_at_peak_bytes` as a fraction of the peak.
    pub peak_share: f64,
}

/// The modules of the step down to `max_depth`, in execution order: bytes saved for
/// backward and their share of the peak. `g` is the schedule's graph
/// ([`crate::remat::from_schedule::from_schedule`]: node `i` is step `i`).
pub fn module_rows(s: &Schedule, r: &Replay, g: &RematGraph, max_depth: usize) -> Vec<ModuleRow> {
    let tree = ModuleTree::build(g);
    let prod = producers(s);
    let peak: u64 = r.peak().total();
    // Per step: bytes it made that backward reads; bytes it made live at the peak.
    let mut saved = vec![0u64; s.steps.len()];
    let mut at_peak = vec![0u64; s.steps.len()];
    for (k, st) in s.storages.iter().enumerate() {
        if st.persistent {
            continue;
        }
        let Some(p) = prod[k] else { continue };
        if category(st) == Category::SavedActivations {
            saved[p] += st.bytes;
        }
        if live_during(r, k, r.peak_step) {
            at_peak[p] += st.bytes;
        }
    }
    let mut rows: Vec<(usize, ModuleRow)> = tree
        .modules
        .iter()
        .filter(|m| m.depth <= max_depth && !m.forward.is_empty())
        .map(|m| {
            let live: u64 = m
                .forward
                .iter()
                .chain(&m.backward)
                .map(|&i| at_peak.get(i).copied().unwrap_or(0))
                .sum();
            let row = ModuleRow {
                path: m.path.clone(),
                depth: m.depth,
                forward_steps: m.forward.len(),
                saved_bytes: m
                    .forward
                    .iter()
                    .map(|&i| saved.get(i).copied().unwrap_or(0))
                    .sum(),
                live_at_peak_bytes: live,
                peak_share: if peak > 0 {
                    live as f64 / peak as f64
                } else {
                    0.0
                },
            };
            (m.forward[0], row)
        })
        .collect();
    rows.sort_by_key(|(first, row)| (*first, row.depth));
    rows.into_iter().map(|(_, r)| r).collect()
}

/// A plan seen against the step without recomputation.
#[derive(Debug, Clone, Serialize)]
pub struct PlanView {
    /// What made it (`budget 60% (1.2 GiB), ilp`, a file name...).
    pub label: String,
    /// The budget it was made for, if any.
    pub budget_bytes: Option<u64>,
    /// Whether it fits that budget.
    pub feasible: bool,
    /// Peak without recomputation.
    pub baseline_peak_bytes: u64,
    /// Peak under the plan (replayed).
    pub peak_bytes: u64,
    /// Extra compute as a fraction of the step's cost.
    pub overhead: f64,
    /// Live bytes per original step without recomputation.
    pub before: Vec<u64>,
    /// Live bytes per original step under the plan (the most over the instructions
    /// that run at or just before that step, recomputations included).
    pub after: Vec<u64>,
    /// Original steps before which something is recomputed.
    pub recompute_at: Vec<usize>,
    /// Tensors the plan recomputes.
    pub recomputed: Vec<String>,
    /// Modules of the recomputed nodes (op plans), or the checkpointed modules.
    pub modules: Vec<String>,
    /// Whether `modules` are checkpointed whole (a module plan).
    pub checkpointed: bool,
    /// The lowest peak the planner reached for the step, when it says.
    pub lowest_bytes: Option<u64>,
}

impl PlanView {
    /// Replays `plan` (which must be valid for `g`) and the no-recompute plan.
    /// `checkpoint_modules`: the modules a module plan checkpoints (empty for an op
    /// plan: the recomputed nodes' modules are listed then).
    pub fn new(
        g: &RematGraph,
        plan: &[Instr],
        label: String,
        budget_bytes: Option<u64>,
        checkpoint_modules: &[String],
    ) -> Result<PlanView, String> {
        let base = replay(g, &g.no_recompute_plan())?;
        let r = replay(g, plan)?;
        let before = timeline(g, &g.no_recompute_plan());
        let tl = timeline(g, plan);
        let n = g.nodes.len();
        let mut after = vec![0u64; n];
        let mut seen = vec![false; n];
        let mut next = 0usize; // the first original step not yet run
        let mut recompute_at = Vec::new();
        let computes = plan.iter().filter_map(|op| match *op {
            Instr::Compute(i) => Some(i),
            Instr::Free(_) | Instr::Load(_) => None,
        });
        for (i, live) in computes.zip(tl) {
            let x = if seen[i] {
                let x = next.min(n.saturating_sub(1));
                if recompute_at.last() != Some(&x) {
                    recompute_at.push(x);
                }
                x
            } else {
                seen[i] = true;
                next = next.max(i + 1);
                i
            };
            after[x] = after[x].max(live);
        }
        let base_cost = g.base_cost().max(f64::MIN_POSITIVE);
        let checkpointed = !checkpoint_modules.is_empty();
        Ok(PlanView {
            label,
            budget_bytes,
            feasible: budget_bytes.is_none_or(|b| r.peak_bytes <= b),
            baseline_peak_bytes: base.peak_bytes,
            peak_bytes: r.peak_bytes,
            overhead: r.recompute_cost / base_cost,
            before,
            after,
            recompute_at,
            recomputed: recomputed_values(g, plan),
            modules: if checkpointed {
                checkpoint_modules.to_vec()
            } else {
                recomputed_modules(g, plan)
            },
            checkpointed,
            lowest_bytes: None,
        })
    }
}
