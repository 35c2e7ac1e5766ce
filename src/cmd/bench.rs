//! `memplan bench`.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{choice, TrainArgs};
use memplan::remat::bench::run_bench;
use memplan::remat::plan::Solver;
use memplan::report::bench::{bench_csv, bench_text};
use memplan::step::load_graph_with;

/// `bench`'s flags.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// ONNX models (training step at --batch) and/or benchmark DAGs (.json).
    #[arg(required = true)]
    graphs: Vec<PathBuf>,
    /// Budgets as fractions of each graph's no-recompute peak.
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.7,0.5")]
    budgets: Vec<f64>,
    /// Solvers to run.
    #[arg(long, value_delimiter = ',', value_parser = choice::<Solver>(), default_value = "sqrt,greedy")]
    solvers: Vec<Solver>,
    /// Batch size for ONNX models.
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// Time limit per MILP solve, seconds.
    #[arg(long, default_value_t = 60.0, value_parser = super::time_limit_arg)]
    time_limit: f64,
    /// Print JSON rows.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV.
    #[arg(long)]
    csv: bool,
    #[command(flatten)]
    training: TrainArgs,
}

/// Runs `bench`.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let BenchArgs {
        graphs,
        budgets,
        solvers,
        batch,
        time_limit,
        json,
        csv,
        training,
    } = a;
    if let Some(b) = budgets.iter().find(|&&b| !(b > 0.0 && b <= 1.0)) {
        bail!("--budgets: {b} is not a fraction in (0, 1]");
    }
    let opts = training.options()?;
    let mut gs = Vec::new();
    for p in &graphs {
        gs.push(load_graph_with(p, batch, &opts).with_context(|| p.display().to_string())?);
    }
    let rows = run_bench(&gs, &budgets, &solvers, time_limit)?;
    if json {
        super::out(&(serde_json::to_string_pretty(&rows)? + "\n"))?;
    } else if csv {
        super::out(&bench_csv(&rows))?;
    } else {
        super::out(&bench_text(&rows))?;
    }
    Ok(())
}
