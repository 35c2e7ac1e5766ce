//! `plan`'s text and JSON renderings (the JSON is `PlanReport`'s keys plus `graph`,
//! `recomputed_modules` and `cost_unit`: a public interface, keys only added).

use std::fmt::Write as _;

use crate::remat::costs::CostUnit;
use crate::remat::graph::RematGraph;
use crate::remat::pareto::fmt_cost;
use crate::remat::plan::PlanReport;
use crate::units::human_bytes;

/// `plan --json`'s object.
pub fn plan_json(
    r: &PlanReport,
    graph: &str,
    modules: &[String],
    unit: CostUnit,
) -> serde_json::Result<serde_json::Value> {
    let mut v = serde_json::to_value(r)?;
    v["graph"] = serde_json::json!(graph);
    v["recomputed_modules"] = serde_json::json!(modules);
    v["cost_unit"] = serde_json::json!(unit);
    Ok(v)
}

/// `plan`'s table.
pub fn plan_text(
    r: &PlanReport,
    g: &RematGraph,
    graph: &str,
    modules: &[String],
    unit: CostUnit,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "graph        {graph} ({} nodes, {} values)",
        g.nodes.len(),
        g.values.len()
    );
    let _ = writeln!(s, "solver       {:?}", r.solver);
    let _ = writeln!(
        s,
        "budget       {}  -> {}",
        human_bytes(r.budget_bytes),
        if r.feasible { "feasible" } else { "INFEASIBLE" }
    );
    let _ = writeln!(
        s,
        "peak         {} (no recompute: {})",
        human_bytes(r.peak_bytes),
        human_bytes(r.baseline_peak_bytes)
    );
    let _ = writeln!(
        s,
        "lowest       {} reachable; op-local bound {}",
        human_bytes(r.min_feasible_bytes),
        human_bytes(r.op_local_bound_bytes)
    );
    let _ = writeln!(
        s,
        "overhead     {:.2}% extra compute (lower bound {:.2}%)",
        r.overhead * 100.0,
        r.lower_bound_overhead * 100.0
    );
    let _ = writeln!(
        s,
        "cost         {} recomputed, {} per step without recomputation ({unit})",
        fmt_cost(r.recompute_flops, unit),
        fmt_cost(r.baseline_flops, unit)
    );
    let _ = writeln!(
        s,
        "recomputed   {} tensors; {} instructions; solved in {:.3} s",
        r.recomputed.len(),
        r.schedule_len,
        r.solve_seconds
    );
    if !modules.is_empty() {
        let _ = writeln!(s, "modules to checkpoint: {}", modules.join(", "));
    }
    s
}
