//! `memplan report`: the training step's memory as one self-contained HTML page (or
//! its step chart alone as SVG).

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{
    choice, memory_arg, parse_budget, parse_dims, replay_failed, size_arg, DeviceArgs, TrainArgs,
};
use memplan::fit::{fit, FitOptions};
use memplan::infer::Bindings;
use memplan::memory::device::replay_schedule;
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::remat::module_plan::{plan_modules, Chosen, Preset};
use memplan::remat::pareto::{pareto as sweep, DEFAULT_POINTS};
use memplan::remat::plan::{plan, Solver};
use memplan::remat::planfile::{PlanFile, StepSource};
use memplan::report::html::data::PlanView;
use memplan::report::html::Report;
use memplan::report::train::TrainingReport;
use memplan::units::human_bytes;

/// What `report` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    /// The whole page: charts, tables, hovering.
    Html,
    /// The step chart alone.
    Svg,
}

/// `report`'s flags.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// The ONNX file.
    model: PathBuf,
    /// Batch size: binds input dims named like "batch", else dim 0 of every input.
    #[arg(long)]
    batch: Option<u64>,
    /// Binds another named dimension, e.g. `--dim seq=128` (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE")]
    dims: Vec<String>,
    /// Mixture-of-experts models: how many tokens each expert receives, which the
    /// data decides: `balanced` (the default: T·k/E each), `capacity=F` (each at F
    /// times that, at most every token) or `worst` (one expert takes every token).
    /// Stated in the output.
    #[arg(long, value_name = "ROUTING", value_parser = super::routing_arg)]
    moe_routing: Option<memplan::moe::Routing>,
    /// Also plan recomputation under this budget and draw the step before and after:
    /// a size (`8GiB`), a percentage of the no-recompute peak (`50%`) or,
    /// below 1, a fraction of it (`0.5`).
    #[arg(long, conflicts_with = "plan")]
    budget: Option<String>,
    /// Also draw the step under this plan (written by `memplan plan -o` for this
    /// model, batch and options).
    #[arg(long, value_name = "plan.json")]
    plan: Option<PathBuf>,
    /// Also draw the step under a module checkpointing preset.
    #[arg(long, value_parser = choice::<Preset>(), conflicts_with_all = ["budget", "plan"])]
    checkpoint: Option<Preset>,
    /// Also sweep budgets and draw the budget–overhead curve.
    #[arg(long)]
    pareto: bool,
    /// Planner (--budget, --pareto).
    #[arg(long, value_parser = choice::<Solver>(), default_value = "ilp")]
    solver: Solver,
    /// Planner time limit in seconds, per plan.
    #[arg(long, default_value_t = 10.0, value_parser = super::time_limit_arg)]
    time_limit: f64,
    /// Also fit batches into this memory per GPU (as `memplan fit`) and show the table.
    #[arg(long, value_parser = memory_arg)]
    memory: Option<u64>,
    /// With --memory: memory to keep free on each GPU (as `memplan fit`).
    #[arg(long, value_parser = |t: &str| size_arg("--headroom", t), requires = "memory")]
    headroom: Option<u64>,
    /// With --memory: GPUs for data parallel and ZeRO.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=65536), requires = "memory")]
    gpus: u64,
    /// With --memory: samples per optimizer step wanted over all GPUs (shows the
    /// recommendation).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 40), requires = "memory")]
    target_batch: Option<u64>,
    /// `html`: the whole page; `svg`: the step chart alone.
    #[arg(long, value_enum, default_value_t = Format::Html)]
    format: Format,
    /// Write here (default: standard output).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    #[command(flatten)]
    training: TrainArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Runs `report`; an output file it created is removed again when it fails.
pub fn run(a: ReportArgs) -> anyhow::Result<()> {
    let output = a.output.clone();
    let existed = output.as_ref().is_some_and(|p| p.exists());
    let r = write_report(a);
    if let (Err(_), Some(p), false) = (&r, &output, existed) {
        let _ = std::fs::remove_file(p);
    }
    r
}

/// Makes the report and writes it.
fn write_report(a: ReportArgs) -> anyhow::Result<()> {
    if a.format == Format::Svg
        && (a.budget.is_some()
            || a.plan.is_some()
            || a.checkpoint.is_some()
            || a.pareto
            || a.memory.is_some())
    {
        bail!("--format svg writes the step chart alone: drop --budget, --plan, --checkpoint, --pareto and --memory, or write html");
    }
    // The output first: a path that cannot be written fails before any work. An
    // existing file keeps its content until the report is written, all at once.
    super::refuse_overwriting_inputs(
        &[("--output", a.output.as_deref())],
        &[Some(a.model.as_path()), a.plan.as_deref()],
    )?;
    if let Some(p) = &a.output {
        memplan::files::check_writable(p)?;
    }
    let file = a.plan.as_ref().map(|p| PlanFile::read(p)).transpose()?;
    let path = a.model.display().to_string();
    let dims = parse_dims(&a.dims)?;
    let opts = a.training.options()?;
    let bindings = Bindings {
        batch: a.batch,
        dims: dims.clone(),
        routing: a.moe_routing,
    };
    // Loaded once: the step lowers it for the batch, `fit` for each batch it tries.
    let model = load_model(&a.model).with_context(|| path.clone())?;
    let step =
        memplan::step::build(&model, &bindings, &opts, &path).with_context(|| path.clone())?;
    let replay = simulate(&step.schedule);
    let mut t = TrainingReport::new(&opts, &step.schedule, &replay);
    t.warnings = super::warn_inference_export(&path, &model);
    let d = a.device.model()?;
    let alloc = replay_schedule(&step.schedule, &d).map_err(|e| replay_failed(&path, e))?;
    t.set_device(&d, alloc);
    let g = &step.graph;
    let mut report = Report::new(&path, a.batch, &step.schedule, &replay, g, t);
    let baseline = g
        .baseline_peak()
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let mut lowest = None;
    let planned = match (&a.budget, &file, a.checkpoint) {
        (Some(b), _, _) => {
            let bytes = parse_budget(b, baseline)?;
            let r = plan(g, bytes, a.solver, a.time_limit).with_context(|| path.clone())?;
            let label = format!(
                "Plan for the budget {} ({:.0}% of the peak; {})",
                human_bytes(bytes),
                bytes as f64 * 100.0 / baseline.max(1) as f64,
                r.method
            );
            lowest = Some(r.min_feasible_bytes);
            Some((r.plan, label, Some(bytes), Vec::new()))
        }
        (None, Some(f), _) => {
            let source = StepSource::new(&a.model, a.batch, &dims, &opts);
            f.check_against(g, &source)
                .with_context(|| a.plan.as_ref().unwrap().display().to_string())?;
            let label = format!(
                "Plan {} (made for the budget {})",
                a.plan.as_ref().unwrap().display(),
                human_bytes(f.budget_bytes)
            );
            Some((f.plan.clone(), label, Some(f.budget_bytes), Vec::new()))
        }
        (None, None, Some(p)) => {
            let o = plan_modules(g, &Chosen::Preset(p), None, a.solver, a.time_limit)
                .with_context(|| path.clone())?;
            let label = format!("Checkpointing {p} ({})", o.report.method);
            Some((o.report.plan, label, None, o.modules))
        }
        (None, None, None) => None,
    };
    if let Some((instrs, label, budget, modules)) = planned {
        let mut v = PlanView::new(g, &instrs, label, budget, &modules)
            .map_err(|e| anyhow::anyhow!("{path}: the plan does not replay: {e}"))?;
        v.lowest_bytes = lowest;
        report.plan = Some(v);
    }
    if a.pareto {
        report.pareto = Some(
            sweep(g, a.solver, a.time_limit, DEFAULT_POINTS, None).with_context(|| path.clone())?,
        );
    }
    if let Some(memory) = a.memory {
        let dev = a.device.with_memory(memory, a.headroom.unwrap_or(0))?;
        let fo = FitOptions {
            device: Some(dev),
            memory,
            train: opts.clone(),
            gpus: a.gpus,
            target_batch: a.target_batch,
            dims: dims.clone(),
            plan_time_limit_s: a.time_limit,
            routing: a.moe_routing,
            cluster: a
                .device
                .gpu
                .and_then(|g| memplan::fit::time::Cluster::of(g, a.gpus, None).ok()),
        };
        report.fit = Some(fit(&model, &path, &fo).with_context(|| path.clone())?);
    }
    let text = match a.format {
        Format::Html => report.html(),
        Format::Svg => report.svg(),
    };
    match &a.output {
        Some(p) => memplan::files::write_atomic(p, text.as_bytes())?,
        None => super::out(&text)?,
    }
    Ok(())
}
