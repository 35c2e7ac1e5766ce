//! `memplan fit`.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{memory_arg, parse_dims, size_arg, DeviceArgs, TrainArgs};
use memplan::fit::{fit, FitOptions};
use memplan::onnx::load_model;
use memplan::report::fit::fit_text;

/// `fit`'s flags.
#[derive(clap::Args)]
pub struct FitArgs {
    /// The ONNX file.
    model: PathBuf,
    /// Memory per GPU as CUDA reports it (`torch.cuda.mem_get_info()[1]`), e.g.
    /// `16GiB`, `80GB`, `24G` (GiB); default with --gpu: that card's.
    #[arg(long, value_parser = memory_arg, required_unless_present = "gpu")]
    memory: Option<u64>,
    /// Memory to keep free on each GPU (other processes, cuDNN workspaces, safety).
    #[arg(long, value_parser = |t: &str| size_arg("--headroom", t))]
    headroom: Option<u64>,
    /// Decide on live tensor bytes against --memory alone: no caching allocator,
    /// no CUDA context (what the figures meant before the allocator was modelled).
    #[arg(long, conflicts_with_all = ["allocator", "alloc_conf", "cuda_context", "headroom"])]
    tensors_only: bool,
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
    /// Mixture-of-experts models: how many tokens each expert receives, which the
    /// data decides: `balanced` (the default: T·k/E each), `capacity=F` (each at F
    /// times that, at most every token) or `worst` (one expert takes every token).
    /// Stated in the output.
    #[arg(long, value_name = "ROUTING", value_parser = super::routing_arg)]
    moe_routing: Option<memplan::moe::Routing>,
    /// The link between the GPUs, for the step-time estimate the recommendation
    /// decides by (with --gpu): `nvlink`, `pcie`, `infiniband`, or `BW,LATENCY`
    /// (e.g. `100G,5us`: bytes per second each way, one ring step's latency).
    /// Default: NVLink on cards that have it up to 8 GPUs, InfiniBand past 8, PCIe
    /// otherwise.
    #[arg(long, value_name = "LINK")]
    interconnect: Option<memplan::fit::time::Link>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Time limit of the ILP planner for planned checkpointing, seconds (each
    /// lowest-peak plan `fit` makes gets at most 0.5 s of it; on the device, each
    /// of the four plans made again at the batch that fits, two at a time, gets a
    /// tenth).
    #[arg(long, default_value_t = 10.0, value_parser = super::time_limit_arg)]
    time_limit: f64,
    #[command(flatten)]
    training: TrainArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Runs `fit`.
pub fn run(a: FitArgs) -> anyhow::Result<()> {
    let FitArgs {
        model,
        moe_routing,
        memory,
        gpus,
        target_batch,
        dims,
        json,
        time_limit,
        training,
        headroom,
        tensors_only,
        device,
        interconnect,
    } = a;
    let path = model.display().to_string();
    let m = load_model(&model).with_context(|| path.clone())?;
    super::warn_inference_export(&path, &m);
    let memory = match (memory, device.gpu) {
        (Some(m), _) => m,
        (None, Some(g)) => g.total_bytes(),
        (None, None) => bail!("give --memory or --gpu"),
    };
    let headroom = headroom.unwrap_or(0);
    // The flags to try where the default allocator fragments: the user's own
    // settings (spaces taken out, so that the line pastes as one shell word), with
    // expandable segments instead of theirs; `--allocator expandable` where they
    // named the allocator (`default` with expandable segments would contradict it).
    let mut settings: Vec<String> = device
        .alloc_conf
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(|kv| kv.split_whitespace().collect::<String>())
        .filter(|kv| !kv.is_empty() && kv.split(':').next() != Some("expandable_segments"))
        .collect();
    let to_try = if device.allocator.is_some() {
        let conf = if settings.is_empty() {
            String::new()
        } else {
            format!(" --alloc-conf {}", settings.join(","))
        };
        format!("--allocator expandable{conf}")
    } else {
        settings.push("expandable_segments:True".into());
        format!("--alloc-conf {}", settings.join(","))
    };
    let cluster = match device.gpu {
        Some(gpu) => Some(
            memplan::fit::time::Cluster::of(gpu, gpus, interconnect.as_ref())
                .map_err(|e| anyhow::anyhow!("--interconnect: {e}"))?,
        ),
        None if interconnect.is_some() => bail!("--interconnect needs --gpu (the card's rates)"),
        None => None,
    };
    let device = if tensors_only {
        None
    } else {
        Some(device.with_memory(memory, headroom)?)
    };
    let opts = FitOptions {
        device,
        memory,
        train: training.options()?,
        gpus,
        target_batch,
        dims: parse_dims(&dims)?,
        plan_time_limit_s: time_limit,
        routing: moe_routing,
        cluster,
    };
    super::warn_precision(&path, &m, opts.train.precision);
    let r = fit(&m, &path, &opts).with_context(|| path.clone())?;
    if json {
        super::out(&(serde_json::to_string_pretty(&r)? + "\n"))?;
    } else {
        let to_try = format!("fit again with {to_try} for the batches then");
        super::out(&fit_text(&r, Some(&to_try)))?;
    }
    Ok(())
}
