//! The commands, one module each: their flags (clap) and what they run; the
//! library does the work and `memplan::report` renders it. Shared here: the training
//! flags, `--dim` and size flags, and the value parser of the library's named
//! choices.

pub mod bench;
pub mod fit;
pub mod plan;
pub mod profile;
pub mod report;
pub mod verify;

use anyhow::{bail, Context};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use memplan::choice::Choice;
use memplan::ir::Model;
use memplan::memory::allocator::{AllocConf, AllocatorKind, OutOfMemory};
use memplan::memory::device::{DeviceModel, Gpu};
use memplan::train::inference_export::InferenceExport;
use memplan::train::{Loss, Optimizer, ParamSelection, Precision, TrainOptions, WeightDtype};

/// Prints to standard error, one line each, what `m` shows of an export for
/// inference, which a training step of it misstates ([`InferenceExport`]).
pub fn warn_inference_export(path: &str, m: &Model) -> Vec<String> {
    let warnings = InferenceExport::of(m).warnings();
    for w in &warnings {
        eprintln!("warning: {path}: {w}");
    }
    warnings
}

/// Prints to standard error, in one line, where the file's parameters are written in
/// a half type the precision policy does not train them in (a bf16 export profiled
/// under fp32), and returns it.
pub fn warn_precision(path: &str, m: &Model, precision: Precision) -> Option<String> {
    let half = memplan::train::policy::file_half_type(m)?;
    if half == memplan::ir::DType::BF16 && precision == Precision::Bf16 {
        return None;
    }
    let w = format!(
        "the model's parameters are {half} in the file (exported in {half}), but the step is \
         counted under --precision {}, which retypes every tensor and loses the model's own \
         float32 upcasts; a bf16 export trains as written under --precision bf16",
        precision.name()
    );
    eprintln!("warning: {path}: {w}");
    Some(w)
}

/// Writes a command's result to standard output. A reader that closed the pipe
/// (`| head -1`) is [`StdoutClosed`], which ends the command quietly, as `cat` does; any
/// other failure (a full disk) is an error naming standard output.
pub fn out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::anyhow!("cannot write to standard output: {e}")),
    }
}

/// Standard output's reader went away: the command stops, quietly and successfully.
#[derive(Debug)]
pub struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "standard output was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// A value parser for one of the library's named choices: its names, each with its
/// description in `--help`.
pub fn choice<T: Choice + Clone>() -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(
        T::ALL
            .iter()
            .map(|c| PossibleValue::new(c.name()).help(c.about())),
    )
    .map(|s| T::parse(&s).expect("one of the possible values"))
}

/// Options of the training step.
#[derive(clap::Args, Clone)]
pub struct TrainArgs {
    /// Optimizer (state per parameter: sgd none, momentum and lion one, adam/adamw
    /// two, adam8bit two bytes plus block absmax, adafactor row and column factors).
    #[arg(long, value_parser = choice::<Optimizer>(), default_value = "adam")]
    pub optimizer: Optimizer,
    /// Precision policy.
    #[arg(long, value_parser = choice::<Precision>(), default_value = "fp32")]
    pub precision: Precision,
    /// Loss over the first output.
    #[arg(long, value_parser = choice::<Loss>(), default_value = "mean")]
    pub loss: Loss,
    /// Freeze the parameters whose PyTorch names match this regular expression
    /// (searched anywhere in the name, as `re.search`): no gradient, no optimizer
    /// state (`requires_grad_(False)`).
    #[arg(long, value_name = "REGEX")]
    pub freeze: Option<String>,
    /// Train only the parameters whose names match this regular expression (e.g.
    /// `lora_`); the rest are frozen. With --freeze too, both rules apply.
    #[arg(long, value_name = "REGEX")]
    pub trainable: Option<String>,
    /// How the frozen parameters are stored: fp32, fp16, bf16, or quantized as
    /// bitsandbytes does (int8: LLM.int8(); nf4: QLoRA) for their Linear weights.
    /// Needs --freeze or --trainable.
    #[arg(long, value_parser = choice::<WeightDtype>())]
    pub weight_dtype: Option<WeightDtype>,
}

impl TrainArgs {
    /// The library's options.
    pub fn options(&self) -> anyhow::Result<TrainOptions> {
        let mut params = ParamSelection::new(self.freeze.as_deref(), self.trainable.as_deref())
            .map_err(|e| {
                let flag = e.about().map(flag_for).unwrap_or_default();
                anyhow::anyhow!("{flag}: {e}")
            })?;
        if let Some(wd) = self.weight_dtype {
            if params.is_all() {
                bail!(
                    "--weight-dtype {wd} applies to frozen parameters: give --freeze or --trainable{}",
                    if wd.is_quantized() {
                        " (quantized weights do not train)"
                    } else {
                        ""
                    }
                );
            }
            params.frozen_dtype = Some(wd);
        }
        Ok(TrainOptions {
            optimizer: self.optimizer,
            precision: self.precision,
            loss: self.loss,
            grads_resident: false,
            params,
        })
    }
}

/// Options of the device a training step is replayed for (PyTorch's caching
/// allocator, the CUDA context).
#[derive(clap::Args, Clone)]
pub struct DeviceArgs {
    /// PyTorch's CUDA caching allocator as set up: `default`, or `expandable`
    /// (`expandable_segments:True`).
    #[arg(long, value_parser = choice::<AllocatorKind>())]
    pub allocator: Option<AllocatorKind>,
    /// Allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax, e.g.
    /// `max_split_size_mb:128,roundup_power2_divisions:4`.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// The GPU (sets the CUDA context and cuBLAS workspace figures; in fit, the
    /// memory when --memory is not given).
    #[arg(long, value_name = "NAME", value_parser = gpu_arg)]
    pub gpu: Option<Gpu>,
    /// The CUDA context's size as measured on your machine (default: the published
    /// figure for the GPU's generation).
    #[arg(long, value_name = "SIZE", value_parser = |t: &str| size_arg("--cuda-context", t))]
    pub cuda_context: Option<u64>,
    /// Over several GPUs: the memory NCCL holds outside PyTorch's allocator per
    /// process group, as measured on your cluster (default: 544 MB for a group of
    /// two ranks, 688 MB for more, NVIDIA/nccl issue 964; it grows with
    /// NCCL_BUFFSIZE and the channel count).
    #[arg(long, value_name = "SIZE", value_parser = |t: &str| size_arg("--nccl-memory", t))]
    pub nccl_memory: Option<u64>,
}

/// `--gpu`'s value parser.
fn gpu_arg(text: &str) -> Result<Gpu, String> {
    Gpu::named(text.trim())
}

impl DeviceArgs {
    /// Whether any device flag was given.
    pub fn given(&self) -> bool {
        self.allocator.is_some()
            || self.alloc_conf.is_some()
            || self.gpu.is_some()
            || self.cuda_context.is_some()
            || self.nccl_memory.is_some()
    }

    /// The library's device model (unlimited memory).
    pub fn model(&self) -> anyhow::Result<DeviceModel> {
        let conf = match &self.alloc_conf {
            Some(t) => AllocConf::parse(t).map_err(|e| anyhow::anyhow!("--alloc-conf: {e}"))?,
            None => AllocConf::default(),
        };
        let conf = match self.allocator {
            Some(k) => conf
                .with_kind(k)
                .map_err(|e| anyhow::anyhow!("--allocator {k}: {e}"))?,
            None => conf,
        };
        let mut d = DeviceModel::new(conf, self.gpu, self.cuda_context);
        d.nccl_per_group = self.nccl_memory;
        Ok(d)
    }

    /// The device model with `memory` bytes, `headroom` kept free (`fit`, and
    /// `report --memory`); an error when nothing is left for the allocator.
    pub fn with_memory(&self, memory: u64, headroom: u64) -> anyhow::Result<DeviceModel> {
        let d = self.model()?.with_memory(memory, headroom);
        if d.capacity == 0 {
            bail!(
                "--memory {} leaves nothing for tensors after --headroom {} and the CUDA context {}",
                memplan::units::human_bytes(memory),
                memplan::units::human_bytes(headroom),
                memplan::units::human_bytes(d.context_bytes)
            );
        }
        Ok(d)
    }
}

/// The error of a replay without a memory limit that still failed (a request
/// beyond what can be counted).
pub fn replay_failed(path: &str, e: OutOfMemory) -> anyhow::Error {
    anyhow::anyhow!(
        "{path}: the allocator replay failed on {} bytes with unlimited memory",
        e.requested
    )
}

/// `--dim NAME=VALUE` flags.
pub fn parse_dims(dims: &[String]) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
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

/// The flag that sets a library [`Setting`](memplan::error::Setting), for error hints.
pub fn flag_for(s: &memplan::error::Setting) -> String {
    use memplan::error::Setting;
    match s {
        Setting::Batch => "--batch".into(),
        Setting::Dim(d) => format!("--dim {d}=..."),
        Setting::Memory => "--memory".into(),
        Setting::MaxMemory => "--max-memory".into(),
        Setting::Loss => "--loss".into(),
        Setting::Freeze => "--freeze".into(),
        Setting::Trainable => "--trainable".into(),
        Setting::WeightDtype => "--weight-dtype".into(),
        Setting::MoeRouting => "--moe-routing".into(),
    }
}

/// A size flag's value (`units::parse_size`), its errors naming the flag.
pub fn size_arg(flag: &str, text: &str) -> Result<u64, String> {
    memplan::units::parse_size(text).map_err(|e| format!("{flag} {e}"))
}

/// Refuses an output flag naming one of the command's inputs (the model, a plan or
/// costs file): memplan never overwrites what it reads.
pub fn refuse_overwriting_inputs(
    outputs: &[(&str, Option<&std::path::Path>)],
    inputs: &[Option<&std::path::Path>],
) -> anyhow::Result<()> {
    let inputs: Vec<&std::path::Path> = inputs.iter().flatten().copied().collect();
    for (flag, out) in outputs {
        if let Some(input) = out.and_then(|o| memplan::files::same_file(o, &inputs)) {
            bail!(
                "{flag} {} is an input of this command: memplan does not overwrite what it reads",
                input.display()
            );
        }
    }
    Ok(())
}

/// `--time-limit`'s value parser: seconds, above 0 and at most a day (`inf`, `NaN`
/// and `1e308` are refused; they cannot be a `Duration`).
pub fn time_limit_arg(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86400.0 => Ok(v),
        _ => Err(format!(
            "'{text}' is not a number of seconds above 0 and at most 86400"
        )),
    }
}

/// `--moe-routing`'s value parser.
pub fn routing_arg(text: &str) -> Result<memplan::moe::Routing, String> {
    memplan::moe::Routing::parse(text)
}

/// `--memory`'s value parser.
pub fn memory_arg(text: &str) -> Result<u64, String> {
    size_arg("--memory", text)
}

/// `--budget`: a size, or below 1 a fraction of `baseline`.
pub fn parse_budget(text: &str, baseline: u64) -> anyhow::Result<u64> {
    let t = text.trim();
    if let Ok(f) = t.parse::<f64>() {
        if f > 0.0 && f < 1.0 {
            return Ok(((baseline as f64 * f) as u64).max(1));
        }
    }
    if let Some(p) = t.strip_suffix('%') {
        return match p.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 100.0 => Ok(((baseline as f64 * (f / 100.0)) as u64).max(1)),
            _ => anyhow::bail!("--budget '{t}': a percentage must be above 0 and at most 100 (of the no-recompute peak)"),
        };
    }
    size_arg("--budget", t).map_err(|e| anyhow::anyhow!(e))
}

/// FSDP2's flags (`fully_shard` per repeated block and on the root).
#[derive(clap::Args, Clone, Default)]
pub struct FsdpArgs {
    /// Shard with FSDP2 over N ranks (the shard degree): the figures are one rank's.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub fsdp: Option<u64>,
    /// HSDP: replicas of the N-way shards (replicate × shard; default 1).
    #[arg(long, value_name = "R", requires = "fsdp", value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub fsdp_replicas: Option<u64>,
    /// `reshard_after_forward` (default true): free each unit's gathered parameters
    /// after its forward and gather them again in backward.
    #[arg(long, value_name = "BOOL", requires = "fsdp")]
    pub reshard_after_forward: Option<bool>,
    /// The units `fully_shard` is applied to, as module paths (default: every
    /// repeated block; the root is always one).
    #[arg(long, value_name = "A,B", value_delimiter = ',', requires = "fsdp")]
    pub fsdp_units: Vec<String>,
    /// `MixedPrecisionPolicy.param_dtype`: fp32, fp16 or bf16 (default: the
    /// parameters' own). The step then computes in it; the sharded parameters,
    /// gradients and optimizer state stay in the step's precision.
    #[arg(long, value_name = "DTYPE", requires = "fsdp", value_parser = dtype_arg)]
    pub param_dtype: Option<memplan::ir::DType>,
    /// `MixedPrecisionPolicy.reduce_dtype` (default: param dtype).
    #[arg(long, value_name = "DTYPE", requires = "fsdp", value_parser = dtype_arg)]
    pub reduce_dtype: Option<memplan::ir::DType>,
    /// `CPUOffloadPolicy`: sharded parameters, gradients and optimizer state on the
    /// host, the update there.
    #[arg(long, requires = "fsdp")]
    pub fsdp_offload: bool,
}

/// `fp32`, `fp16` or `bf16`.
fn dtype_arg(text: &str) -> Result<memplan::ir::DType, String> {
    use memplan::ir::DType;
    match text.trim().to_ascii_lowercase().as_str() {
        "fp32" | "float32" => Ok(DType::F32),
        "fp16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(format!("'{text}': expected fp32, fp16 or bf16")),
    }
}

impl FsdpArgs {
    /// The process groups a rank communicates in (none without --fsdp).
    pub fn groups(&self) -> Vec<u64> {
        self.settings()
            .map(|f| f.groups().to_vec())
            .unwrap_or_default()
    }

    /// The library's settings (`None` without --fsdp).
    pub fn settings(&self) -> Option<memplan::parallel::Fsdp> {
        let shards = self.fsdp?;
        Some(memplan::parallel::Fsdp {
            shards,
            replicas: self.fsdp_replicas.unwrap_or(1),
            reshard_after_forward: self.reshard_after_forward.unwrap_or(true),
            units: (!self.fsdp_units.is_empty()).then(|| self.fsdp_units.clone()),
            param_dtype: self.param_dtype,
            reduce_dtype: self.reduce_dtype,
            orig_dtype: None,
            offload: self.fsdp_offload,
        })
    }
}

/// Tensor, pipeline, context and expert parallelism's flags.
#[derive(clap::Args, Clone, Default)]
pub struct ParallelArgs {
    /// Tensor parallelism over N ranks: Linear layers split by role (column: q/k/v,
    /// gate/up; row: o, down; embeddings and LM head by vocabulary).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: Option<u64>,
    /// With --tp: sequence parallelism (activations between the parallel regions split
    /// along the sequence too).
    #[arg(long, requires = "tp")]
    pub sequence_parallel: bool,
    /// Pipeline parallelism over N stages, split by repeated blocks; the batch is one
    /// micro-batch.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub pp: Option<u64>,
    /// With --pp: micro-batches per step (default: the stages).
    #[arg(long, value_name = "M", requires = "pp", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub microbatches: Option<u64>,
    /// With --pp: gpipe, 1f1b (default) or interleaved:V (V model chunks per rank).
    #[arg(long, value_name = "SCHEDULE", requires = "pp", value_parser = memplan::parallel::PipeSchedule::parse)]
    pub pp_schedule: Option<memplan::parallel::PipeSchedule>,
    /// With --pp: blocks per (virtual) stage, in order (default: even, the first
    /// stages one more when they do not divide).
    #[arg(long, value_name = "A,B", value_delimiter = ',', requires = "pp")]
    pub pp_stages: Vec<u64>,
    /// Context parallelism over N ranks: the sequence split, attention as a ring.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub cp: Option<u64>,
    /// Expert parallelism over N ranks: each holds 1/N of every MoE layer's experts.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub ep: Option<u64>,
}

impl ParallelArgs {
    /// The library's layout (checked against the routing assumption).
    pub fn layout(
        &self,
        routing: Option<memplan::moe::Routing>,
    ) -> anyhow::Result<memplan::parallel::Layout> {
        use memplan::parallel::{Degrees, Layout, PipeSchedule, Pipeline};
        let ep = self.ep.unwrap_or(1);
        if ep > 1 && routing == Some(memplan::moe::Routing::Worst) {
            anyhow::bail!("--ep with --moe-routing worst: the rank holding the busiest expert is not modelled; use balanced or capacity=F");
        }
        let stages = self.pp.unwrap_or(1);
        Ok(Layout {
            degrees: Degrees {
                tp: self.tp.unwrap_or(1),
                sequence_parallel: self.sequence_parallel,
                cp: self.cp.unwrap_or(1),
                ep,
            },
            pipeline: (stages > 1).then(|| Pipeline {
                stages,
                microbatches: self.microbatches.unwrap_or(stages),
                schedule: self.pp_schedule.unwrap_or(PipeSchedule::OneFOneB),
                blocks: (!self.pp_stages.is_empty()).then(|| self.pp_stages.clone()),
            }),
        })
    }

    /// The process groups a rank communicates in.
    pub fn groups(&self) -> Vec<u64> {
        [self.tp, self.pp, self.cp, self.ep]
            .into_iter()
            .flatten()
            .filter(|&n| n > 1)
            .collect()
    }
}
