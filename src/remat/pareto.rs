//! `memplan plan --pareto`: the memory/recompute trade-off of one graph, as a sweep
//! of budgets from the no-recompute peak down to the lowest peak memplan reaches.
//!
//! Every point is planned from scratch by the chosen solver (with its own time
//! limit) and replayed. A plan that fits a lower budget also fits every higher one,
//! so when a lower budget's plan is cheaper than the one the solver returned for a
//! higher budget (heuristics and time-limited solvers are not monotone), the higher
//! point takes it, and says so in `plan_from_budget_bytes`; likewise a lower bound
//! proven for a higher budget holds for every lower one. The curve is therefore
//! monotone: as the budget decreases the overhead and its bound never decrease.
//! The sweep stops at the first budget the solver cannot meet, which is reported
//! (infeasible) as the last point.

use serde::Serialize;

use super::costs::CostUnit;
use super::graph::{Instr, RematGraph};
use super::plan::{plan, Solver};
use crate::error::{Error, Result};
use crate::units::human_bytes;

/// Default number of budgets in a sweep.
pub const DEFAULT_POINTS: usize = 11;

/// One budget of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct ParetoPoint {
    /// The budget.
    pub budget_bytes: u64,
    /// The budget over the no-recompute peak.
    pub budget_fraction: f64,
    /// Whether a plan within the budget was found.
    pub feasible: bool,
    /// Peak of the plan (replayed).
    pub peak_bytes: u64,
    /// Recompute cost over the step's cost.
    pub overhead: f64,
    /// A proven lower bound on `overhead` at this budget (0 when only trivial).
    pub lower_bound_overhead: f64,
    /// Recompute cost, in the graph's cost unit.
    pub recompute_cost: f64,
    /// Values recomputed at least once.
    pub recomputed: usize,
    /// Solver wall time for this budget.
    pub solve_seconds: f64,
    /// Set when the plan is the one found for this lower budget (it was cheaper).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan_from_budget_bytes: Option<u64>,
    /// The plan.
    #[serde(skip)]
    pub plan: Vec<Instr>,
}

/// A sweep.
#[derive(Debug, Clone, Serialize)]
pub struct ParetoCurve {
    /// Solver used at every point.
    pub solver: Solver,
    /// Peak without recomputation (the first budget).
    pub baseline_peak_bytes: u64,
    /// Lowest peak memplan reaches (the last budget, unless a lower end was given).
    pub min_feasible_bytes: u64,
    /// No plan goes below this.
    pub op_local_bound_bytes: u64,
    /// Cost of the step without recomputation.
    pub baseline_cost: f64,
    /// Points by decreasing budget.
    pub points: Vec<ParetoPoint>,
}

fn point(r: &super::plan::PlanReport, baseline: u64) -> ParetoPoint {
    ParetoPoint {
        budget_bytes: r.budget_bytes,
        budget_fraction: r.budget_bytes as f64 / baseline.max(1) as f64,
        feasible: r.feasible,
        peak_bytes: r.peak_bytes,
        overhead: r.overhead,
        lower_bound_overhead: r.lower_bound_overhead,
        recompute_cost: r.recompute_flops,
        recomputed: r.recomputed.len(),
        solve_seconds: r.solve_seconds,
        plan_from_budget_bytes: None,
        plan: r.plan.clone(),
    }
}

/// The budgets of a sweep: `points` (at least 2) evenly spaced from `baseline` down
/// to `lowest`, both included, without repeats.
pub fn budgets(baseline: u64, lowest: u64, points: usize) -> Vec<u64> {
    let lowest = lowest.min(baseline);
    let n = points.max(2);
    let span = (baseline - lowest) as f64;
    let mut out: Vec<u64> = Vec::with_capacity(n);
    for k in 0..n {
        let b = if k == n - 1 {
            lowest
        } else {
            baseline - (span * k as f64 / (n - 1) as f64).round() as u64
        };
        if out.last() != Some(&b) {
            out.push(b);
        }
    }
    out
}

/// Sweeps `points` budgets from the no-recompute peak down to `lowest` (default: the
/// lowest peak the planner reaches, `min_feasible_bytes` of a plan for the op-local
/// bound, the hardest budget there is), planning each with `solver` under
/// `time_limit_s` seconds.
pub fn pareto(
    g: &RematGraph,
    solver: Solver,
    time_limit_s: f64,
    points: usize,
    lowest: Option<u64>,
) -> Result<ParetoCurve> {
    let baseline = g.baseline_peak().map_err(Error::Graph)?;
    let first = plan(g, baseline, solver, time_limit_s)?;
    let mut min_feasible = first.min_feasible_bytes;
    let low = match lowest {
        Some(b) => b,
        None => {
            let hardest = plan(g, g.op_local_bound(), solver, time_limit_s)?;
            min_feasible = min_feasible.min(hardest.min_feasible_bytes);
            min_feasible
        }
    };
    let mut pts = vec![point(&first, baseline)];
    if first.feasible {
        for &b in budgets(baseline, low, points).iter().skip(1) {
            let r = plan(g, b, solver, time_limit_s)?;
            min_feasible = min_feasible.min(r.min_feasible_bytes);
            pts.push(point(&r, baseline));
            if !r.feasible {
                break;
            }
        }
    }
    // A cheaper plan found for a lower budget serves every higher one.
    for i in (1..pts.len()).rev() {
        let (hi, lo) = pts.split_at_mut(i);
        let (a, b) = (&mut hi[i - 1], &lo[0]);
        if a.feasible && b.feasible && b.overhead < a.overhead {
            a.peak_bytes = b.peak_bytes;
            a.overhead = b.overhead;
            a.recompute_cost = b.recompute_cost;
            a.recomputed = b.recomputed;
            a.plan = b.plan.clone();
            a.plan_from_budget_bytes = Some(b.plan_from_budget_bytes.unwrap_or(b.budget_bytes));
        }
    }
    // A bound proven for a budget holds for every lower one.
    for i in 1..pts.len() {
        let prev = pts[i - 1].lower_bound_overhead;
        let p = &mut pts[i];
        p.lower_bound_overhead = p.lower_bound_overhead.max(prev);
    }
    // Those bounds hold for schedules that first run nodes in the graph's order; a
    // chain plan ([`super::chain`]) need not, so no point's bound exceeds its plan.
    for p in pts.iter_mut().filter(|p| p.feasible) {
        p.lower_bound_overhead = p.lower_bound_overhead.min(p.overhead);
    }
    Ok(ParetoCurve {
        solver,
        baseline_peak_bytes: baseline,
        min_feasible_bytes: min_feasible,
        op_local_bound_bytes: first.op_local_bound_bytes,
        baseline_cost: first.baseline_flops,
        points: pts,
    })
}

impl ParetoCurve {
    /// The human table (one row per budget).
    pub fn to_text(&self, unit: CostUnit) -> String {
        let mut s = format!(
            "solver       {}\npeaks        {} without recompute; {} lowest reachable; op-local bound {}\nstep cost    {} without recompute ({unit})\n\n",
            format!("{:?}", self.solver).to_lowercase(),
            human_bytes(self.baseline_peak_bytes),
            human_bytes(self.min_feasible_bytes),
            human_bytes(self.op_local_bound_bytes),
            fmt_cost(self.baseline_cost, unit),
        );
        s.push_str(&format!(
            "  {:>12} {:>8} {:>12} {:>9} {:>9} {:>9} {:>10} {:>8}\n",
            "budget", "of peak", "peak", "overhead", "bound", "feasible", "recomputed", "seconds"
        ));
        for p in &self.points {
            s.push_str(&format!(
                "  {:>12} {:>7.1}% {:>12} {:>8.2}% {:>8.2}% {:>9} {:>10} {:>8.3}{}\n",
                human_bytes(p.budget_bytes),
                p.budget_fraction * 100.0,
                human_bytes(p.peak_bytes),
                p.overhead * 100.0,
                p.lower_bound_overhead * 100.0,
                if p.feasible { "yes" } else { "NO" },
                p.recomputed,
                p.solve_seconds,
                match p.plan_from_budget_bytes {
                    Some(b) => format!("  (plan of {})", human_bytes(b)),
                    None => String::new(),
                }
            ));
        }
        s
    }
}

/// A cost in its unit, for people.
pub fn fmt_cost(c: f64, unit: CostUnit) -> String {
    match unit {
        CostUnit::Flops => format!("{:.2} GFLOP", c / 1e9),
        CostUnit::Seconds | CostUnit::Roofline => format!("{c:.6} s"),
        CostUnit::Benchmark => format!("{c:.4} units"),
    }
}
