//! `memplan fit`.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{memory_arg, parse_dims, TrainArgs};
use memplan::fit::{fit, FitOptions};
use memplan::onnx::load_model;
use memplan::report::fit::fit_text;

/// `fit`'s flags.
#[derive(clap::Args)]
pub struct FitArgs {
    /// The ONNX file.
    model: PathBuf,
    /// Memory per GPU, e.g. `16GiB`, `80GB`, `24G` (GiB).
    #[arg(long, value_parser = memory_arg)]
    memory: u64,
    /// GPUs for data parallel and ZeRO.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=65536))]
    gpus: u64,
    /// Samples per optimizer step wanted over all GPUs: sizes gradient accumulation,
    /// lists combined strategies and recommends one.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 40))]
    target_batch: Option<u64>,
    /// Binds another named dimension, e.g. `--dim seq=128` (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE")]
    dims: Vec<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Time limit of the ILP planner for planned checkpointing, seconds (each
    /// lowest-peak plan `fit` makes gets at most 0.5 s of it).
    #[arg(long, default_value_t = 10.0)]
    time_limit: f64,
    #[command(flatten)]
    training: TrainArgs,
}

/// Runs `fit`.
pub fn run(a: FitArgs) -> anyhow::Result<()> {
    let FitArgs {
        model,
        memory,
        gpus,
        target_batch,
        dims,
        json,
        time_limit,
        training,
    } = a;
    if !(time_limit > 0.0 && time_limit <= 86400.0) {
        bail!("--time-limit must be between 0 and 86400 seconds");
    }
    let path = model.display().to_string();
    let m = load_model(&model).with_context(|| path.clone())?;
    let opts = FitOptions {
        memory,
        train: training.options()?,
        gpus,
        target_batch,
        dims: parse_dims(&dims)?,
        plan_time_limit_s: time_limit,
    };
    let r = fit(&m, &path, &opts).with_context(|| path.clone())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", fit_text(&r));
    }
    Ok(())
}
