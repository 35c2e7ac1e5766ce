//! `memplan verify`.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{choice, parse_budget, parse_dims, size_arg, TrainArgs};
use memplan::infer::Bindings;
use memplan::onnx::load_model;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::plan::Solver;

/// `verify`'s flags.
#[derive(clap::Args)]
pub struct VerifyArgs {
    /// The ONNX file.
    model: PathBuf,
    /// Batch size.
    #[arg(long)]
    batch: Option<u64>,
    /// Binds another named dimension (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE")]
    dims: Vec<String>,
    /// Mixture-of-experts models: how many tokens each expert receives, which the
    /// data decides: `balanced` (the default: T·k/E each), `capacity=F` (each at F
    /// times that, at most every token) or `worst` (one expert takes every token).
    /// Stated in the output.
    #[arg(long, value_name = "ROUTING", value_parser = super::routing_arg)]
    moe_routing: Option<memplan::moe::Routing>,
    /// A plan written by `memplan plan -o` for this model, batch and options.
    #[arg(long, value_name = "plan.json", conflicts_with = "budget")]
    plan: Option<PathBuf>,
    /// Plan now under this budget: a size (`8GiB`), a percentage of the no-recompute
    /// peak (`50%`) or, below 1, a fraction of it (`0.5`).
    #[arg(long, required_unless_present = "plan")]
    budget: Option<String>,
    /// Planner (with --budget).
    #[arg(long, value_parser = choice::<Solver>(), default_value = "ilp")]
    solver: Solver,
    /// Planner time limit in seconds (with --budget).
    #[arg(long, default_value_t = 10.0, value_parser = super::time_limit_arg)]
    time_limit: f64,
    /// Refuse to run when the predicted peak exceeds this (default: the machine's
    /// available memory).
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
    /// Runs of each step; times are the fastest run.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Write the baseline run's measured seconds per node (what `plan --costs`
    /// reads).
    #[arg(long, value_name = "costs.json")]
    write_costs: Option<PathBuf>,
    /// Learning rate of the update (every optimizer).
    #[arg(long, default_value_t = 0.01)]
    lr: f32,
    /// Where both runs execute: the CPU executor, or CUDA device 0 (a memplan
    /// built with `--features cuda`; docs/CUDA.md).
    #[arg(long, value_enum, default_value_t = ExecDevice::Cpu)]
    device: ExecDevice,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    training: TrainArgs,
}

/// `verify --device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ExecDevice {
    /// The CPU executor.
    Cpu,
    /// CUDA device 0.
    Cuda,
}

/// Runs `verify`.
pub fn run(a: VerifyArgs) -> anyhow::Result<()> {
    super::refuse_overwriting_inputs(
        &[("--write-costs", a.write_costs.as_deref())],
        &[Some(a.model.as_path()), a.plan.as_deref()],
    )?;
    let (json, training) = (a.json, a.training);
    use memplan::exec::verify::{available_memory, verify, PlanSource, VerifyOptions};
    use memplan::remat::planfile::{PlanFile, StepSource};
    if a.runs == 0 || a.runs > 1000 {
        bail!("--runs must be between 1 and 1000");
    }
    if !(a.lr.is_finite() && a.lr >= 0.0) {
        bail!("--lr must be a finite number >= 0");
    }
    // The device first: without one, nothing else is read.
    #[cfg(not(feature = "cuda"))]
    if a.device == ExecDevice::Cuda {
        bail!(
            "--device cuda needs memplan built with the CUDA backend: cargo build --release --features cuda"
        );
    }
    #[cfg(feature = "cuda")]
    let dev = match a.device {
        ExecDevice::Cuda => {
            Some(memplan::exec::cuda::Device::new(0).map_err(|e| anyhow::anyhow!("{e}"))?)
        }
        ExecDevice::Cpu => None,
    };
    let max_memory = match &a.max_memory {
        Some(m) => size_arg("--max-memory", m).map_err(|e| anyhow::anyhow!(e))?,
        None => {
            #[cfg(feature = "cuda")]
            if let Some(d) = &dev {
                d.mem_get_info().map_or(u64::MAX, |(free, _)| free as u64)
            } else {
                available_memory().unwrap_or(u64::MAX)
            }
            #[cfg(not(feature = "cuda"))]
            available_memory().unwrap_or(u64::MAX)
        }
    };
    // The plan file is read (format, version) before the model is loaded.
    let file = a.plan.as_ref().map(|p| PlanFile::read(p)).transpose()?;
    if let (Some(f), Some(p)) = (&file, &a.plan) {
        if f.infeasible() {
            eprintln!(
                "warning: {}: the plan misses its budget (predicted peak {} B, budget {} B): it runs as the lowest peak found",
                p.display(),
                f.predicted_peak_bytes,
                f.budget_bytes
            );
        }
    }
    let path = a.model.display().to_string();
    let dims = parse_dims(&a.dims)?;
    let m = load_model(&a.model).with_context(|| path.clone())?;
    super::warn_inference_export(&path, &m);
    let bindings = Bindings {
        batch: a.batch,
        dims: dims.clone(),
        routing: a.moe_routing,
    };
    let memplan::step::Inference {
        model: m,
        inferred: inf,
    } = memplan::step::inference(&m, &bindings).with_context(|| path.clone())?;
    let opts = training.options()?;
    if !opts.optimizer.executable() {
        bail!(
            "verify runs sgd, momentum, adam and adamw; --optimizer {} is predicted (profile, plan, fit), not run",
            opts.optimizer
        );
    }
    if let Some(wd) = opts.params.frozen_dtype {
        bail!("verify runs frozen parameters in the training precision; --weight-dtype {wd} is predicted (profile, plan, fit), not run");
    }
    let source = StepSource::new(&a.model, a.batch, &dims, &opts);
    let plan_source = match (file, &a.budget) {
        (Some(f), _) => PlanSource::File(Box::new(f)),
        (None, Some(b)) => {
            // The budget's fraction is of the no-recompute peak.
            let sched = memplan::step::schedule(&m, &inf, &opts).with_context(|| path.clone())?;
            let baseline = from_schedule(&sched, &path)
                .baseline_peak()
                .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            PlanSource::Budget {
                bytes: parse_budget(b, baseline)?,
                solver: a.solver,
                time_limit_s: a.time_limit,
            }
        }
        (None, None) => bail!("give --plan FILE or --budget B"),
    };
    let step = memplan::exec::train::StepOptions {
        lr: a.lr,
        loss: opts.loss,
        ..Default::default()
    };
    let vo = VerifyOptions {
        train: opts,
        step,
        runs: a.runs,
        max_memory,
    };
    #[cfg(feature = "cuda")]
    let v = match &dev {
        Some(d) => memplan::exec::verify::verify_cuda(&m, &inf, &source, &plan_source, &vo, d),
        None => verify(&m, &inf, &source, &plan_source, &vo),
    };
    #[cfg(not(feature = "cuda"))]
    let v = verify(&m, &inf, &source, &plan_source, &vo);
    let v = v.with_context(|| path.clone())?;
    if let Some(out) = &a.write_costs {
        memplan::files::write_atomic(out, &serde_json::to_vec_pretty(&v.costs)?)?;
    }
    if json {
        super::out(&(serde_json::to_string_pretty(&v.report)? + "\n"))?;
    } else {
        super::out(&v.report.to_text())?;
    }
    let r = &v.report;
    if r.measured_peak_bytes != r.predicted_peak_bytes
        || r.baseline_measured_peak_bytes != r.baseline_predicted_peak_bytes
        || !r.gradients_identical
    {
        bail!("verification failed: measured and predicted differ (see the report)");
    }
    Ok(())
}
