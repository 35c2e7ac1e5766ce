//! The `memplan` command line: the flags of every command (`cmd/`, one module each)
//! and the dispatch. The library (`memplan`) does the work and renders it.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

#[global_allocator]
static GLOBAL: memplan::Allocator = memplan::Allocator;

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
    Profile(cmd::profile::ProfileArgs),
    /// The largest batch that fits a memory budget, per strategy (mixed precision,
    /// checkpointing, gradient accumulation, data parallel, ZeRO).
    Fit(cmd::fit::FitArgs),
    /// Choose activations to recompute so one training step fits a memory budget.
    Plan(cmd::plan::PlanArgs),
    /// Run the training step (CPU, or a CUDA GPU with --device cuda) without
    /// recomputation and following a plan, and compare: measured peak against
    /// predicted, gradients bit for bit, time.
    Verify(cmd::verify::VerifyArgs),
    /// Compare planners: one row per graph, budget and solver.
    Bench(cmd::bench::BenchArgs),
    /// Write the training step's memory as one self-contained HTML page: the step
    /// by category, the peak, modules, and optionally a plan, a budget sweep and
    /// the fit table.
    Report(cmd::report::ReportArgs),
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Profile(a) => cmd::profile::run(a),
        Command::Fit(a) => cmd::fit::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Report(a) => cmd::report::run(a),
    }
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
        if std::env::var_os("MEMPLAN_BACKTRACE").is_some() {
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
        }
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
        // `| head -1`: the reader has what it wanted.
        Err(e) if e.downcast_ref::<cmd::StdoutClosed>().is_some() => ExitCode::SUCCESS,
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
            // A library error about a setting: name the flag that sets it.
            let about = e
                .chain()
                .find_map(|c| c.downcast_ref::<memplan::Error>())
                .and_then(memplan::Error::about);
            if let Some(flag) = about.map(cmd::flag_for) {
                msg = format!("{msg} ({flag})");
            }
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
