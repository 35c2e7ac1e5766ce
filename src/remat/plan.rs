//! Choosing a plan under a memory budget, and what is reported about it.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::graph::{replay, Instr, RematGraph};
use super::heuristics::{candidates, greedy, greedy_until, plan_with_drops, sqrt_drops};
use crate::error::{Error, Result};

/// Planner selection (`--solver`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Solver {
    /// Scalable optimisation (default): exact Checkmate MILP on small graphs, a
    /// drop-set MILP checked by replay on large ones, the best of every candidate
    /// plan, and a proven lower bound (see `remat::portfolio`).
    Ilp,
    /// Keep every activation (the no-recompute schedule).
    None,
    /// √n equal segments (Chen et al. 2016).
    Sqrt,
    /// Drop the cheapest activations per byte until the peak fits.
    Greedy,
    /// The full Checkmate MILP (small graphs; CBC built from source).
    Checkmate,
}

crate::choice::choice!(Solver {
    Ilp => "ilp", "Scalable optimisation (default): exact Checkmate MILP on small graphs, a drop-set MILP checked by replay on large ones, the best of every candidate plan, and a proven lower bound (see `remat::portfolio`)";
    None => "none", "Keep every activation (the no-recompute schedule)";
    Sqrt => "sqrt", "√n equal segments (Chen et al. 2016)";
    Greedy => "greedy", "Drop the cheapest activations per byte until the peak fits";
    Checkmate => "checkmate", "The full Checkmate MILP (small graphs; CBC built from source)";
});

/// A plan and its figures (the `plan --json` object; keys are stable).
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// Solver used.
    pub solver: Solver,
    /// Whether the plan's peak is within the budget.
    pub feasible: bool,
    /// The budget.
    pub budget_bytes: u64,
    /// Peak of the returned plan (replayed).
    pub peak_bytes: u64,
    /// Peak without recomputation.
    pub baseline_peak_bytes: u64,
    /// Lowest peak memplan found (this plan, or every droppable activation dropped).
    pub min_feasible_bytes: u64,
    /// No plan goes below: the largest over nodes of the node's inputs and outputs,
    /// plus fixed memory and the held values (gradients) written before it, or
    /// what making a node's inputs resident together needs
    /// (`remat::bounds::memory_floor`).
    pub op_local_bound_bytes: u64,
    /// One more than the budget the chain search proved impossible
    /// (`remat::chain`), 0 if none: no plan goes below it either. Unlike
    /// `op_local_bound_bytes` it depends on the budget asked and the time limit.
    pub proven_floor_bytes: u64,
    /// Cost of recomputation, in the graph's cost unit despite the name: FLOPs for
    /// ONNX models, seconds with measured costs (`--costs`, see `remat::costs`), the
    /// benchmark's units for DAGs.
    pub recompute_flops: f64,
    /// Cost of the step without recomputation (same unit).
    pub baseline_flops: f64,
    /// `recompute_flops / baseline_flops`.
    pub overhead: f64,
    /// A proven lower bound on `overhead` for this budget (0 when only the trivial
    /// bound is known).
    pub lower_bound_overhead: f64,
    /// Wall time of the solver.
    pub solve_seconds: f64,
    /// Values recomputed at least once.
    pub recomputed: Vec<String>,
    /// Instructions in the plan.
    pub schedule_len: usize,
    /// The candidate that produced the plan (for `ilp`: `ilp:gap-milp`,
    /// `ilp:checkmate`, `ilp:greedy`...).
    pub method: String,
    /// The plan itself (written by `-o`, not printed).
    #[serde(skip)]
    pub plan: Vec<Instr>,
}

/// Plans `g` under `budget` bytes.
pub fn plan(g: &RematGraph, budget: u64, solver: Solver, time_limit_s: f64) -> Result<PlanReport> {
    let t0 = Instant::now();
    let base_plan = g.no_recompute_plan();
    let base = replay(g, &base_plan).map_err(Error::Graph)?;
    let mut all = vec![false; g.values.len()];
    for v in candidates(g) {
        all[v] = true;
    }
    let lowest = replay(g, &plan_with_drops(g, &all))
        .map_err(Error::Graph)?
        .peak_bytes
        .min(base.peak_bytes);
    let mut lower_bound = 0.0;
    let mut source = format!("{solver:?}").to_lowercase();
    let mut lowest = lowest;
    let mut proven_floor = 0;
    let chosen = match solver {
        Solver::None => base_plan,
        Solver::Sqrt => plan_with_drops(g, &sqrt_drops(g)),
        Solver::Greedy => {
            if base.peak_bytes <= budget {
                base_plan
            } else {
                greedy_until(g, budget, Some(t0 + Duration::from_secs_f64(time_limit_s))).0
            }
        }
        Solver::Ilp => {
            let r = super::portfolio::solve(g, budget, time_limit_s)?;
            lower_bound = r.lower_bound_overhead;
            lowest = lowest.min(r.min_peak);
            proven_floor = r.proven_floor;
            source = format!("ilp:{}", r.source);
            r.plan
        }
        Solver::Checkmate => {
            let o = super::checkmate::IlpOptions {
                time_limit: std::time::Duration::from_secs_f64(time_limit_s),
                lp_bound: true,
            };
            let r = super::checkmate::solve_checkmate(g, budget, &o)?;
            if let Some(lb) = r.lower_bound {
                lower_bound =
                    ((lb - g.base_cost()) / g.base_cost().max(f64::MIN_POSITIVE)).max(0.0);
            }
            match r.plan {
                Some(p) => p,
                None => greedy(g, budget).0,
            }
        }
    };
    // Re-runs whose outputs nothing reads are dropped, and every value is freed after
    // its last read: a solver's plan can only get cheaper and lower by it.
    let r = replay(g, &chosen).map_err(Error::Graph)?;
    let lean = super::dtr::tighten(g, &super::hoist::drop_dead_reruns(g, &chosen));
    let (chosen, r) = match replay(g, &lean) {
        Ok(b) if b.peak_bytes <= r.peak_bytes && b.cost <= r.cost => (lean, b),
        _ => (chosen, r),
    };
    let recomputed = recomputed_values(g, &chosen);
    let base_cost = g.base_cost();
    Ok(PlanReport {
        solver,
        feasible: r.peak_bytes <= budget,
        budget_bytes: budget,
        peak_bytes: r.peak_bytes,
        baseline_peak_bytes: base.peak_bytes,
        min_feasible_bytes: lowest.min(r.peak_bytes),
        op_local_bound_bytes: g.op_local_bound().max(super::bounds::memory_floor(g)),
        proven_floor_bytes: proven_floor,
        recompute_flops: r.recompute_cost,
        baseline_flops: base_cost,
        overhead: if base_cost > 0.0 {
            r.recompute_cost / base_cost
        } else {
            0.0
        },
        lower_bound_overhead: lower_bound,
        solve_seconds: t0.elapsed().as_secs_f64(),
        recomputed,
        schedule_len: chosen.len(),
        method: source,
        plan: chosen,
    })
}

/// How many times `plan` runs each node.
pub fn run_counts(g: &RematGraph, plan: &[Instr]) -> Vec<u32> {
    let mut count = vec![0u32; g.nodes.len()];
    for op in plan {
        if let Instr::Compute(i) = op {
            count[*i] += 1;
        }
    }
    count
}

/// Names of the values a plan computes more than once (the outputs of nodes it
/// computes again), in node order.
pub fn recomputed_values(g: &RematGraph, plan: &[Instr]) -> Vec<String> {
    let count = run_counts(g, plan);
    g.nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| count[*i] > 1)
        .flat_map(|(_, n)| n.outputs.iter().map(|&v| g.values[v].name.clone()))
        .collect()
}

/// PyTorch module paths of recomputed forward nodes, from TorchScript-style node
/// names (`/layer1/layer1.0/conv1/Conv` → `layer1.0.conv1`), deduplicated in order:
/// the modules to wrap in `torch.utils.checkpoint` or to mark recompute in a
/// selective-checkpoint policy.
pub fn recomputed_modules(g: &RematGraph, plan: &[Instr]) -> Vec<String> {
    let count = run_counts(g, plan);
    let mut out: Vec<String> = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if count[i] < 2 {
            continue;
        }
        if let Some(m) = module_path(&n.name) {
            if !out.contains(&m) {
                out.push(m);
            }
        }
    }
    out
}

pub use crate::ir::module_path;
