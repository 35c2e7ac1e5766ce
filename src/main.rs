//! The `memplan` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

use memplan::fit::{fit, FitOptions, FitReport};
use memplan::infer::{infer, Bindings};
use memplan::memory::profile_inference;
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::remat::bench::{load_graph_with, run_bench};
use memplan::remat::dag::load_dag;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::plan::{plan, recomputed_modules, Solver};
use memplan::report::train::TrainingReport;
use memplan::report::ProfileReport;
use memplan::train::{build_schedule, Loss, Optimizer, Precision, TrainOptions};

/// Predicts the memory of running and training an ONNX model.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load a model, infer every shape for a batch size, and profile inference memory.
    Profile {
        /// The ONNX file.
        model: PathBuf,
        /// Batch size: binds input dims named like "batch", else dim 0 of every input.
        #[arg(long)]
        batch: Option<u64>,
        /// Binds another named dimension, e.g. `--dim seq=128` (repeatable).
        #[arg(long = "dim", value_name = "NAME=VALUE")]
        dims: Vec<String>,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Also list every tensor and every node (FLOPs, live bytes).
        #[arg(long)]
        detail: bool,
        /// Also profile one training step (forward, loss, backward, optimizer update).
        #[arg(long)]
        train: bool,
        #[command(flatten)]
        training: TrainArgs,
    },
    /// The largest batch that fits a memory budget, per strategy (mixed precision,
    /// checkpointing, gradient accumulation, data parallel, ZeRO).
    Fit {
        /// The ONNX file.
        model: PathBuf,
        /// Memory per GPU, e.g. `16GiB`, `80GB`, `24G` (GiB).
        #[arg(long, value_parser = memory_arg)]
        memory: u64,
        /// GPUs for data parallel and ZeRO.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=65536))]
        gpus: u64,
        /// Samples per optimizer step wanted (sizes gradient accumulation).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        target_batch: Option<u64>,
        /// Binds another named dimension, e.g. `--dim seq=128` (repeatable).
        #[arg(long = "dim", value_name = "NAME=VALUE")]
        dims: Vec<String>,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Time limit of the ILP planner for planned checkpointing, seconds.
        #[arg(long, default_value_t = 10.0)]
        time_limit: f64,
        #[command(flatten)]
        training: TrainArgs,
    },
    /// Choose activations to recompute so one training step fits a memory budget.
    Plan {
        /// The ONNX file (or use --dag).
        #[arg(required_unless_present = "dag")]
        model: Option<PathBuf>,
        /// A rematerialization benchmark graph (node-link JSON) instead of a model.
        #[arg(long, conflicts_with = "model")]
        dag: Option<PathBuf>,
        /// Batch size (ONNX models).
        #[arg(long)]
        batch: Option<u64>,
        /// Binds another named dimension (repeatable).
        #[arg(long = "dim", value_name = "NAME=VALUE")]
        dims: Vec<String>,
        /// Budget: a size (`8GiB`) or, below 1, a fraction of the no-recompute peak.
        /// With --pareto: the lowest budget of the sweep (optional).
        #[arg(long, required_unless_present = "pareto")]
        budget: Option<String>,
        /// Planner.
        #[arg(long, value_enum, default_value_t = Solver::Ilp)]
        solver: Solver,
        /// Solver time limit in seconds (MILP solvers).
        #[arg(long, default_value_t = 60.0)]
        time_limit: f64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Write the whole plan (versioned JSON, docs/PLAN_FORMAT.md) to this file.
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
        /// Write the planned training step as ONNX (recomputations inserted, backward
        /// ops in domain ai.memplan; docs/PLAN_FORMAT.md). ONNX models only.
        #[arg(long, value_name = "OUT.onnx", conflicts_with = "dag")]
        rewrite: Option<PathBuf>,
        #[command(flatten)]
        extras: PlanExtras,
        #[command(flatten)]
        training: TrainArgs,
    },
    /// Run the training step (CPU, or a CUDA GPU with --device cuda) without
    /// recomputation and following a plan, and compare: measured peak against
    /// predicted, gradients bit for bit, time.
    Verify {
        #[command(flatten)]
        args: VerifyArgs,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        training: TrainArgs,
    },
    /// Compare planners: one row per graph, budget and solver.
    Bench {
        /// ONNX models (training step at --batch) and/or benchmark DAGs (.json).
        #[arg(required = true)]
        graphs: Vec<PathBuf>,
        /// Budgets as fractions of each graph's no-recompute peak.
        #[arg(long, value_delimiter = ',', default_value = "0.9,0.7,0.5")]
        budgets: Vec<f64>,
        /// Solvers to run.
        #[arg(long, value_delimiter = ',', value_enum, default_value = "sqrt,greedy")]
        solvers: Vec<Solver>,
        /// Batch size for ONNX models.
        #[arg(long, default_value_t = 8)]
        batch: u64,
        /// Time limit per MILP solve, seconds.
        #[arg(long, default_value_t = 60.0)]
        time_limit: f64,
        /// Print JSON rows.
        #[arg(long, conflicts_with = "csv")]
        json: bool,
        /// Print CSV.
        #[arg(long)]
        csv: bool,
        #[command(flatten)]
        training: TrainArgs,
    },
}

/// Measured costs and the budget sweep of `plan`.
#[derive(clap::Args)]
struct PlanExtras {
    /// Measured costs: a JSON object mapping every node name to seconds, replacing
    /// FLOPs (recompute_flops and baseline_flops are then seconds; docs/PLAN_FORMAT.md).
    #[arg(long, value_name = "FILE")]
    costs: Option<PathBuf>,
    /// Sweep budgets from the no-recompute peak down to the lowest reachable one (or
    /// to --budget) and print the curve: budget, peak, overhead, lower bound, feasible.
    #[arg(long, conflicts_with_all = ["output", "rewrite"])]
    pareto: bool,
}

/// Options of the training step.
#[derive(clap::Args, Clone, Copy)]
struct TrainArgs {
    /// Optimizer (states per parameter: sgd 0, momentum 1, adam/adamw 2).
    #[arg(long, value_enum, default_value_t = Optimizer::Adam)]
    optimizer: Optimizer,
    /// Precision policy.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    precision: Precision,
    /// Loss over the first output.
    #[arg(long, value_enum, default_value_t = Loss::Mean)]
    loss: Loss,
}

impl TrainArgs {
    fn options(self) -> TrainOptions {
        TrainOptions {
            optimizer: self.optimizer,
            precision: self.precision,
            loss: self.loss,
            grads_resident: false,
        }
    }
}

fn parse_dims(dims: &[String]) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
    let mut out = std::collections::BTreeMap::new();
    for d in dims {
        let (k, v) = d
            .split_once('=')
            .with_context(|| format!("--dim '{d}' must be NAME=VALUE"))?;
        let v: u64 = v
            .trim()
            .parse()
            .with_context(|| format!("--dim '{d}': '{v}' is not a non-negative integer"))?;
        if v == 0 || v > memplan::infer::MAX_BATCH {
            bail!(
                "--dim '{d}': value out of range (1..={})",
                memplan::infer::MAX_BATCH
            );
        }
        if out.insert(k.trim().to_string(), v).is_some() {
            bail!("--dim {k} given twice");
        }
    }
    Ok(out)
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Profile {
            model,
            batch,
            dims,
            json,
            detail,
            train,
            training,
        } => {
            let bindings = Bindings {
                batch,
                dims: parse_dims(&dims)?,
            };
            let path = model.display().to_string();
            let m = load_model(&model).with_context(|| path.clone())?;
            let inf = infer(&m, &bindings).with_context(|| path.clone())?;
            let prof = profile_inference(&m.graph, &inf);
            let mut report = ProfileReport::new(&path, &m, &inf, &prof, detail);
            if train {
                let opts = training.options();
                let sched = build_schedule(&m, &inf, &opts).with_context(|| path.clone())?;
                let replay = simulate(&sched);
                report.training = Some(TrainingReport::new(&opts, &sched, &replay));
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.to_text());
            }
            Ok(())
        }
        Command::Fit {
            model,
            memory,
            gpus,
            target_batch,
            dims,
            json,
            time_limit,
            training,
        } => {
            if !(time_limit > 0.0 && time_limit <= 86400.0) {
                bail!("--time-limit must be between 0 and 86400 seconds");
            }
            let path = model.display().to_string();
            let m = load_model(&model).with_context(|| path.clone())?;
            let opts = FitOptions {
                memory,
                train: training.options(),
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
        Command::Plan {
            model,
            dag,
            batch,
            dims,
            budget,
            solver,
            time_limit,
            json,
            output,
            rewrite,
            extras,
            training,
        } => run_plan(
            model,
            dag,
            batch,
            &dims,
            budget.as_deref(),
            solver,
            time_limit,
            json,
            output,
            rewrite,
            extras,
            training,
        ),
        Command::Verify {
            args,
            json,
            training,
        } => run_verify(args, json, training),
        Command::Bench {
            graphs,
            budgets,
            solvers,
            batch,
            time_limit,
            json,
            csv,
            training,
        } => {
            if let Some(b) = budgets.iter().find(|&&b| !(b > 0.0 && b <= 1.0)) {
                bail!("--budgets: {b} is not a fraction in (0, 1]");
            }
            let mut gs = Vec::new();
            for p in &graphs {
                gs.push(
                    load_graph_with(p, batch, &training.options())
                        .with_context(|| p.display().to_string())?,
                );
            }
            let rows = run_bench(&gs, &budgets, &solvers, time_limit)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else if csv {
                println!("graph,nodes,budget,solver,feasible,peak_fraction,overhead,lower_bound,solve_seconds,method,floor_fraction");
                for r in &rows {
                    println!(
                        "{},{},{},{:?},{},{:.4},{:.4},{:.4},{:.3},{},{:.4}",
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
                        r.floor_fraction
                    );
                }
            } else {
                println!(
                    "{:<22} {:>6} {:>6} {:<10} {:>9} {:>6} {:>9} {:>9} {:>8}",
                    "graph",
                    "nodes",
                    "budget",
                    "solver",
                    "feasible",
                    "peak",
                    "overhead",
                    "bound",
                    "seconds"
                );
                for r in &rows {
                    println!(
                        "{:<22} {:>6} {:>5.0}% {:<10} {:>9} {:>5.1}% {:>9.4} {:>9.4} {:>8.3}",
                        r.graph,
                        r.nodes,
                        r.budget * 100.0,
                        format!("{:?}", r.solver).to_lowercase(),
                        if r.feasible { "yes" } else { "no" },
                        r.peak_fraction * 100.0,
                        r.overhead,
                        r.lower_bound,
                        r.solve_seconds
                    );
                }
            }
            Ok(())
        }
    }
}

/// A size flag's value (`units::parse_size`), its errors naming the flag.
fn size_arg(flag: &str, text: &str) -> Result<u64, String> {
    memplan::units::parse_size(text).map_err(|e| format!("{flag} {e}"))
}

/// `--memory`'s value parser.
fn memory_arg(text: &str) -> Result<u64, String> {
    size_arg("--memory", text)
}

fn parse_budget(text: &str, baseline: u64) -> anyhow::Result<u64> {
    let t = text.trim();
    if let Ok(f) = t.parse::<f64>() {
        if f > 0.0 && f < 1.0 {
            return Ok((baseline as f64 * f) as u64);
        }
    }
    size_arg("--budget", t).map_err(|e| anyhow::anyhow!(e))
}

#[allow(clippy::too_many_arguments)]
fn run_plan(
    model: Option<PathBuf>,
    dag: Option<PathBuf>,
    batch: Option<u64>,
    dims: &[String],
    budget: Option<&str>,
    solver: Solver,
    time_limit: f64,
    json: bool,
    output: Option<PathBuf>,
    rewrite: Option<PathBuf>,
    extras: PlanExtras,
    training: TrainArgs,
) -> anyhow::Result<()> {
    use memplan::remat::costs::{apply_costs, load_costs, CostUnit};
    use memplan::remat::graph::replay;
    use memplan::remat::pareto::{fmt_cost, pareto, DEFAULT_POINTS};
    let unit = match (&extras.costs, &dag) {
        (Some(_), _) => CostUnit::Seconds,
        (None, Some(_)) => CostUnit::Benchmark,
        (None, None) => CostUnit::Flops,
    };
    if rewrite.is_some() && dag.is_some() {
        bail!("--rewrite writes ONNX: it needs an ONNX model, not --dag");
    }
    let model_path = model.clone();
    let (g, path) = match (model, dag) {
        (_, Some(d)) => {
            let path = d.display().to_string();
            (load_dag(&d).with_context(|| path.clone())?, path)
        }
        (Some(m), None) => {
            let path = m.display().to_string();
            let model = load_model(&m).with_context(|| path.clone())?;
            let inf = infer(
                &model,
                &Bindings {
                    batch,
                    dims: parse_dims(dims)?,
                },
            )
            .with_context(|| path.clone())?;
            let sched =
                build_schedule(&model, &inf, &training.options()).with_context(|| path.clone())?;
            (from_schedule(&sched, &path), path)
        }
        (None, None) => bail!("give a MODEL or --dag FILE"),
    };
    let mut g = g;
    if let Some(c) = &extras.costs {
        let at = || c.display().to_string();
        apply_costs(&mut g, &load_costs(c).with_context(at)?).with_context(at)?;
    }
    if !(time_limit > 0.0 && time_limit <= 86400.0) {
        bail!("--time-limit must be between 0 and 86400 seconds");
    }
    let baseline = replay(&g, &g.no_recompute_plan())
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
        .peak_bytes;
    let budget_bytes = budget.map(|b| parse_budget(b, baseline)).transpose()?;
    if extras.pareto {
        let curve = pareto(&g, solver, time_limit, DEFAULT_POINTS, budget_bytes)
            .with_context(|| path.clone())?;
        if json {
            let mut v = serde_json::to_value(&curve.points)?;
            for p in v.as_array_mut().into_iter().flatten() {
                p["cost_unit"] = serde_json::json!(unit);
            }
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            println!(
                "graph        {path} ({} nodes, {} values)",
                g.nodes.len(),
                g.values.len()
            );
            print!("{}", curve.to_text(unit));
        }
        return Ok(());
    }
    let budget_bytes = budget_bytes.context("--budget is required without --pareto")?;
    let r = plan(&g, budget_bytes, solver, time_limit).with_context(|| path.clone())?;
    let modules = recomputed_modules(&g, &r.plan);
    if let Some(out) = output {
        use memplan::remat::planfile::{PlanFile, StepSource, FORMAT, VERSION};
        let step = match &model_path {
            Some(m) => Some(StepSource::new(
                m,
                batch,
                &parse_dims(dims)?,
                &training.options(),
            )),
            None => None,
        };
        let doc = PlanFile {
            format: FORMAT.into(),
            version: VERSION,
            graph: g.clone(),
            budget_bytes: r.budget_bytes,
            predicted_peak_bytes: r.peak_bytes,
            solver: serde_json::json!(r.solver)
                .as_str()
                .unwrap_or_default()
                .to_string(),
            cost_unit: serde_json::json!(unit)
                .as_str()
                .unwrap_or_default()
                .to_string(),
            plan: r.plan.clone(),
            step,
        };
        std::fs::write(&out, doc.to_json())
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if let (Some(out), Some(m)) = (&rewrite, &model_path) {
        let bindings = Bindings {
            batch,
            dims: parse_dims(dims)?,
        };
        memplan::remat::rewrite::write_rewrite(m, &bindings, &training.options(), &g, &r, out)
            .with_context(|| format!("--rewrite {}", out.display()))?;
    }
    if json {
        let mut v = serde_json::to_value(&r)?;
        v["graph"] = serde_json::json!(path);
        v["recomputed_modules"] = serde_json::json!(modules);
        v["cost_unit"] = serde_json::json!(unit);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    use memplan::report::human_bytes;
    println!(
        "graph        {path} ({} nodes, {} values)",
        g.nodes.len(),
        g.values.len()
    );
    println!("solver       {:?}", r.solver);
    println!(
        "budget       {}  -> {}",
        human_bytes(r.budget_bytes),
        if r.feasible { "feasible" } else { "INFEASIBLE" }
    );
    println!(
        "peak         {} (no recompute: {})",
        human_bytes(r.peak_bytes),
        human_bytes(r.baseline_peak_bytes)
    );
    println!(
        "lowest       {} reachable; op-local bound {}",
        human_bytes(r.min_feasible_bytes),
        human_bytes(r.op_local_bound_bytes)
    );
    println!(
        "overhead     {:.2}% extra compute (lower bound {:.2}%)",
        r.overhead * 100.0,
        r.lower_bound_overhead * 100.0
    );
    println!(
        "cost         {} recomputed, {} per step without recomputation ({unit})",
        fmt_cost(r.recompute_flops, unit),
        fmt_cost(r.baseline_flops, unit)
    );
    println!(
        "recomputed   {} tensors; {} instructions; solved in {:.3} s",
        r.recomputed.len(),
        r.schedule_len,
        r.solve_seconds
    );
    if !modules.is_empty() {
        println!("modules to checkpoint: {}", modules.join(", "));
    }
    Ok(())
}

/// `verify`'s arguments.
#[derive(clap::Args)]
struct VerifyArgs {
    /// The ONNX file.
    model: PathBuf,
    /// Batch size.
    #[arg(long)]
    batch: Option<u64>,
    /// Binds another named dimension (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE")]
    dims: Vec<String>,
    /// A plan written by `memplan plan -o` for this model, batch and options.
    #[arg(long, value_name = "plan.json", conflicts_with = "budget")]
    plan: Option<PathBuf>,
    /// Plan now under this budget: a size (`8GiB`) or, below 1, a fraction of the
    /// no-recompute peak.
    #[arg(long, required_unless_present = "plan")]
    budget: Option<String>,
    /// Planner (with --budget).
    #[arg(long, value_enum, default_value_t = Solver::Ilp)]
    solver: Solver,
    /// Planner time limit in seconds (with --budget).
    #[arg(long, default_value_t = 10.0)]
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
}

/// `verify --device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ExecDevice {
    /// The CPU executor.
    Cpu,
    /// CUDA device 0.
    Cuda,
}

fn run_verify(a: VerifyArgs, json: bool, training: TrainArgs) -> anyhow::Result<()> {
    use memplan::exec::verify::{available_memory, verify, PlanSource, VerifyOptions};
    use memplan::remat::planfile::{PlanFile, StepSource};
    if !(a.time_limit > 0.0 && a.time_limit <= 86400.0) {
        bail!("--time-limit must be between 0 and 86400 seconds");
    }
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
    let path = a.model.display().to_string();
    let dims = parse_dims(&a.dims)?;
    let m = load_model(&a.model).with_context(|| path.clone())?;
    let inf = infer(
        &m,
        &Bindings {
            batch: a.batch,
            dims: dims.clone(),
        },
    )
    .with_context(|| path.clone())?;
    let opts = training.options();
    let source = StepSource::new(&a.model, a.batch, &dims, &opts);
    let plan_source = match (file, &a.budget) {
        (Some(f), _) => PlanSource::File(Box::new(f)),
        (None, Some(b)) => {
            // The budget's fraction is of the no-recompute peak.
            let sched = build_schedule(&m, &inf, &opts).with_context(|| path.clone())?;
            let g = from_schedule(&sched, &path);
            let baseline = memplan::remat::graph::replay(&g, &g.no_recompute_plan())
                .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
                .peak_bytes;
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
        std::fs::write(out, serde_json::to_vec_pretty(&v.costs)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&v.report)?);
    } else {
        print!("{}", v.report.to_text());
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

fn fit_text(r: &FitReport) -> String {
    use memplan::report::human_bytes;
    let mut s = format!(
        "model        {}\nbudget       {} per GPU ({} optimizer, {}, {} GPU{})\nbatch 1 needs {} as exported\n\n",
        r.model,
        human_bytes(r.memory_bytes),
        r.optimizer,
        r.precision,
        r.gpus,
        if r.gpus == 1 { "" } else { "s" },
        human_bytes(r.batch1_bytes)
    );
    s.push_str(&format!(
        "  {:<22} {:>9} {:>12} {:>9}  notes\n",
        "strategy", "max batch", "peak", "overhead"
    ));
    for st in &r.strategies {
        let batch = match (st.max_batch, st.global_batch) {
            (0, _) => "none".to_string(),
            (b, Some(gb)) if gb != b => format!("{b} ({gb})"),
            (b, _) => b.to_string(),
        };
        s.push_str(&format!(
            "  {:<22} {:>9} {:>12} {:>8.1}%  {}\n",
            st.name,
            batch,
            human_bytes(st.peak_bytes),
            st.overhead * 100.0,
            st.note
        ));
    }
    s
}

fn main() -> ExitCode {
    // A panic is a bug in memplan; still report it as one line and a failure status.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("error: internal error{at}: {msg} (please report this)");
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line, like every other error; `--help` has the rest.
            let text = e.render().to_string();
            let mut lines = text.lines();
            let mut first = lines.next().unwrap_or("invalid arguments").to_string();
            if first.ends_with(':') {
                // "the following required arguments were not provided:" lists them below.
                let named: Vec<&str> = lines
                    .take_while(|l| l.starts_with(' '))
                    .map(str::trim)
                    .collect();
                first = format!("{first} {}", named.join(", "));
            }
            eprintln!("{first} (see --help)");
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The chain, minus causes a message already ends with (an I/O error is
            // both part of "cannot read: ..." and its source).
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !msg.ends_with(&c) {
                    msg = format!("{msg}: {c}");
                }
            }
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
