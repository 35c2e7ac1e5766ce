//! `memplan bench`: one table of plans per graph, budget and solver.

use serde::Serialize;

use super::graph::RematGraph;
use super::plan::{plan, Solver};
use crate::error::{Error, Result};

/// One row.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// Graph name (file stem).
    pub graph: String,
    /// Nodes in the graph.
    pub nodes: usize,
    /// Budget as a fraction of the no-recompute peak.
    pub budget: f64,
    /// Solver.
    pub solver: Solver,
    /// Plan fits.
    pub feasible: bool,
    /// Plan peak over the no-recompute peak.
    pub peak_fraction: f64,
    /// Total cost over the no-recompute cost (1.0 = no recomputation), the unit the
    /// published anchors use.
    pub overhead: f64,
    /// Lower bound on `overhead` (1.0 when only trivial).
    pub lower_bound: f64,
    /// Solver wall time.
    pub solve_seconds: f64,
    /// Which candidate produced the plan (`PlanReport::method`).
    pub method: String,
    /// The op-local bound with held memory (`op_local_bound_bytes`) over the
    /// no-recompute peak: budgets below it are infeasible.
    pub floor_fraction: f64,
    /// A floor the chain search proved for this budget (`proven_floor_bytes`: one
    /// more than a budget it showed impossible) over the no-recompute peak; `null`
    /// where none was proven.
    pub proven_floor_fraction: Option<f64>,
    /// A peak that some schedule is known to stay within without planning (each
    /// node computed from nothing, `dtr::Prepared::from_nothing_peak`), over the
    /// no-recompute peak; `null` where the graph has values that allow no such
    /// schedule. A budget at or above it is feasible even where no plan is found.
    pub from_nothing_fraction: Option<f64>,
    /// [`status`]: `planned`, `infeasible`, `feasible` (no plan found, but one
    /// exists: the budget is at or above `from_nothing_fraction`), `open` or
    /// `no plan`.
    pub status: &'static str,
}

/// A benchmark point's certificate: `planned` (a plan within the budget),
/// `infeasible` (the budget is below the memory floor: no plan exists), and
/// otherwise, for the solvers that bound the optimum (`ilp`, `checkmate`),
/// `feasible` (no plan found, but a schedule within the budget is known to exist,
/// exponentially long: `from_nothing`, the peak of computing each node from nothing)
/// or `open` (neither known); for the baselines, which claim nothing about the
/// point, `no plan`.
pub fn status(
    planned: bool,
    budget: u64,
    floor: u64,
    from_nothing: Option<u64>,
    solver: Solver,
) -> &'static str {
    if planned {
        "planned"
    } else if budget < floor {
        "infeasible"
    } else if !matches!(solver, Solver::Ilp | Solver::Checkmate) {
        "no plan"
    } else if from_nothing.is_some_and(|p| p <= budget) {
        "feasible"
    } else {
        "open"
    }
}

/// Plans every graph at every budget with every solver.
pub fn run_bench(
    graphs: &[RematGraph],
    budgets: &[f64],
    solvers: &[Solver],
    time_limit_s: f64,
) -> Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    for g in graphs {
        let base = g.baseline_peak().map_err(Error::Graph)?;
        let from_nothing = super::dtr::Prepared::new(g).from_nothing_peak(g);
        for &b in budgets {
            let budget = (base as f64 * b) as u64;
            for &s in solvers {
                let r = plan(g, budget, s, time_limit_s)?;
                let floor = r.op_local_bound_bytes.max(r.proven_floor_bytes);
                let status = status(r.feasible, budget, floor, from_nothing, s);
                rows.push(BenchRow {
                    graph: g.name.clone(),
                    nodes: g.nodes.len(),
                    budget: b,
                    solver: s,
                    feasible: r.feasible,
                    peak_fraction: r.peak_bytes as f64 / base.max(1) as f64,
                    overhead: 1.0 + r.overhead,
                    lower_bound: 1.0 + r.lower_bound_overhead,
                    solve_seconds: r.solve_seconds,
                    method: r.method.clone(),
                    floor_fraction: r.op_local_bound_bytes as f64 / base.max(1) as f64,
                    proven_floor_fraction: (r.proven_floor_bytes > 0)
                        .then(|| r.proven_floor_bytes as f64 / base.max(1) as f64),
                    from_nothing_fraction: from_nothing.map(|p| p as f64 / base.max(1) as f64),
                    status,
                });
            }
        }
    }
    Ok(rows)
}
