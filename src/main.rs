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
        #[arg(long, value_parser = memplan::fit::parse_memory)]
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
        #[command(flatten)]
        training: TrainArgs,
    },
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
            training,
        } => {
            let path = model.display().to_string();
            let m = load_model(&model).with_context(|| path.clone())?;
            let opts = FitOptions {
                memory,
                train: training.options(),
                gpus,
                target_batch,
                dims: parse_dims(&dims)?,
            };
            let r = fit(&m, &path, &opts).with_context(|| path.clone())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", fit_text(&r));
            }
            Ok(())
        }
    }
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
        "  {:<20} {:>9} {:>12} {:>9}  notes\n",
        "strategy", "max batch", "peak", "overhead"
    ));
    for st in &r.strategies {
        let batch = match (st.max_batch, st.global_batch) {
            (0, _) => "none".to_string(),
            (b, Some(gb)) if gb != b => format!("{b} ({gb})"),
            (b, _) => b.to_string(),
        };
        s.push_str(&format!(
            "  {:<20} {:>9} {:>12} {:>8.1}%  {}\n",
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
            let first = text.lines().next().unwrap_or("invalid arguments");
            eprintln!("{first} (see --help)");
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
