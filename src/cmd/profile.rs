//! `memplan profile`.

use std::path::PathBuf;

use anyhow::Context;

use super::{choice, parse_dims, DeviceArgs, FsdpArgs, ParallelArgs, TrainArgs};
use memplan::infer::Bindings;
use memplan::memory::device::replay_schedule;
use memplan::memory::{profile_inference, simulate};
use memplan::onnx::load_model;
use memplan::remat::module_plan::Preset;
use memplan::report::train::{CheckpointReport, TrainingReport};
use memplan::report::ProfileReport;

/// `profile`'s flags.
#[derive(clap::Args)]
pub struct ProfileArgs {
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
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also list every tensor and every node (FLOPs, live bytes).
    #[arg(long)]
    detail: bool,
    /// Also profile one training step (forward, loss, backward, optimizer update).
    #[arg(long)]
    train: bool,
    /// With --train: also report the step under a module checkpointing preset
    /// (peak, bytes saved at forward end, recompute overhead).
    #[arg(long, value_parser = choice::<Preset>(), requires = "train")]
    checkpoint: Option<Preset>,
    #[command(flatten)]
    training: TrainArgs,
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    fsdp: FsdpArgs,
    #[command(flatten)]
    parallel: ParallelArgs,
}

/// Runs `profile`.
pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    let ProfileArgs {
        model,
        moe_routing,
        batch,
        dims,
        json,
        detail,
        train,
        checkpoint,
        training,
        device,
        fsdp,
        parallel,
    } = a;
    if fsdp.fsdp.is_some() && !train {
        anyhow::bail!("--fsdp shards the training step: give --train");
    }
    let layout = parallel.layout(moe_routing)?;
    if layout.is_split() && !train {
        anyhow::bail!("--tp, --pp, --cp and --ep split the training step: give --train");
    }

    if device.given() && !train {
        anyhow::bail!("--allocator, --alloc-conf, --gpu and --cuda-context describe the training step's device: give --train");
    }
    if !train
        && (training.freeze.is_some()
            || training.trainable.is_some()
            || training.weight_dtype.is_some())
    {
        anyhow::bail!(
            "--freeze, --trainable and --weight-dtype describe the training step: give --train"
        );
    }
    let bindings = Bindings {
        batch,
        dims: parse_dims(&dims)?,
        routing: moe_routing,
    };
    let path = model.display().to_string();
    let loaded = load_model(&model).with_context(|| path.clone())?;
    let memplan::step::Inference {
        model: m,
        inferred: inf,
    } = memplan::step::inference(&loaded, &bindings).with_context(|| path.clone())?;
    let prof = profile_inference(&m.graph, &inf);
    let mut report = ProfileReport::new(&path, &m, &inf, &prof, detail);
    if train {
        let opts = training.options()?;
        let d = device
            .model()?
            .on_groups(&[fsdp.groups(), parallel.groups()].concat());
        let (sched, mut t) = if layout.is_split() {
            layout_report(&m, &inf, &opts, (&layout, fsdp.settings().as_ref()), &d)
                .with_context(|| path.clone())?
        } else {
            let (sched, sharded) = match fsdp.settings() {
                Some(f) => {
                    let (s, summary) = memplan::step::sharded_schedule(&m, &inf, &opts, &f)
                        .with_context(|| path.clone())?;
                    (s, Some(summary))
                }
                None => (
                    memplan::step::schedule(&m, &inf, &opts).with_context(|| path.clone())?,
                    None,
                ),
            };
            let replay = simulate(&sched);
            let mut t = TrainingReport::new(&opts, &sched, &replay);
            t.fsdp = sharded;
            let a = replay_schedule(&sched, &d).map_err(|e| super::replay_failed(&path, e))?;
            t.set_device(&d, a);
            (sched, t)
        };
        t.warnings = super::warn_inference_export(&path, &m);
        t.warnings
            .extend(super::warn_precision(&path, &m, opts.precision));
        if let Some(p) = checkpoint {
            t.checkpoint = Some(CheckpointReport::of(&sched, p).with_context(|| path.clone())?);
        }
        report.training = Some(t);
    }
    if json {
        super::out(&(serde_json::to_string_pretty(&report)? + "\n"))?;
    } else {
        super::out(&report.to_text())?;
    }
    // The process ends here: its memory goes back to the OS at once, so do not free
    // every node, tensor and name one by one first.
    std::mem::forget((report, prof, inf, m));
    std::mem::forget(loaded);
    Ok(())
}

/// The worst rank's training report under model-parallel `layout`, with every
/// pipeline stage's figures, and its schedule.
fn layout_report(
    m: &memplan::ir::Model,
    inf: &memplan::infer::Inferred,
    opts: &memplan::train::TrainOptions,
    (layout, fsdp): (&memplan::parallel::Layout, Option<&memplan::parallel::Fsdp>),
    d: &memplan::memory::device::DeviceModel,
) -> anyhow::Result<(memplan::train::Schedule, TrainingReport)> {
    use memplan::report::parallel::{ParallelReport, RankRow};
    let (ranks, sharded): (Vec<_>, Vec<_>) =
        memplan::step::rank_schedules(m, inf, opts, layout, fsdp)?
            .into_iter()
            .unzip();
    let mut rows = Vec::new();
    let mut allocs = Vec::new();
    for (r, f) in ranks.iter().zip(&sharded) {
        let a = replay_schedule(&r.schedule, d)
            .map_err(|e| super::replay_failed(&format!("stage {}", rows.len()), e))?;
        rows.push(RankRow {
            stage: r.stage.clone(),
            peak_bytes: simulate(&r.schedule).peak().total(),
            reserved_bytes: a.reserved_bytes,
            // Under FSDP the rank's shard (the gathered units are transients).
            param_bytes: f
                .as_ref()
                .map_or(r.split.param_bytes, |f| f.sharded_param_bytes),
        });
        allocs.push(a);
    }
    let report = ParallelReport::new(layout, rows, &ranks[0].split);
    let w = report.worst_rank;
    let sched = ranks[w].schedule.clone();
    let mut t = TrainingReport::new(opts, &sched, &simulate(&sched));
    t.set_device(d, allocs[w]);
    t.parallel = Some(report);
    t.fsdp = sharded[w].clone();
    Ok((sched, t))
}
