//! `bench`'s CSV and table (its JSON is the rows themselves).

use std::fmt::Write as _;

use crate::remat::bench::BenchRow;

/// One CSV line per row, after a header.
pub fn bench_csv(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "graph,nodes,budget,solver,feasible,peak_fraction,overhead,lower_bound,solve_seconds,method,floor_fraction,status\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{},{:?},{},{:.4},{:.4},{:.4},{:.3},{},{:.4},{}",
            r.graph,
            r.nodes,
            r.budget,
            r.solver,
            r.feasible,
            r.peak_fraction,
            r.overhead,
            r.lower_bound,
            r.solve_seconds,
            r.method,
            r.floor_fraction,
            r.status
        );
    }
    s
}

/// The comparison table.
pub fn bench_text(rows: &[BenchRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<22} {:>6} {:>6} {:<10} {:>9} {:>6} {:>9} {:>9} {:>8}  status",
        "graph", "nodes", "budget", "solver", "feasible", "peak", "overhead", "bound", "seconds"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<22} {:>6} {:>5.0}% {:<10} {:>9} {:>5.1}% {:>9.4} {:>9.4} {:>8.3}  {}",
            r.graph,
            r.nodes,
            r.budget * 100.0,
            format!("{:?}", r.solver).to_lowercase(),
            if r.feasible { "yes" } else { "no" },
            r.peak_fraction * 100.0,
            r.overhead,
            r.lower_bound,
            r.solve_seconds,
            match r.status {
                "infeasible" => format!("infeasible (floor {:.1}%)", r.floor_fraction * 100.0),
                "feasible" => format!(
                    "feasible (a schedule within {:.1}% exists, exponentially long; no plan found)",
                    r.from_nothing_fraction.unwrap_or(f64::NAN) * 100.0
                ),
                s => s.to_string(),
            }
        );
    }
    s
}
