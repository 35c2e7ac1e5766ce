//! `memplan fit`: the largest batch that fits a memory budget under each strategy.
//!
//! Every per-step byte count of the training schedule is affine in the batch size
//! (the graph's structure does not change with it), so two schedules, at batch 1 and
//! 2, give each step's bytes as `a + c·(b-1)`; the largest `b` with every step under
//! the budget is solved directly, then confirmed by building the schedule at that
//! batch and the next (the first must fit, the second must not).
//!
//! Planned checkpointing (`checkpointing-planned`) is the exception: its memory depends
//! on the plan, which changes with the batch. A fixed plan's memory is again affine
//! in the batch, so [`planned_max_batch`] plans a few batches on one step graph and
//! solves each plan's largest batch directly (see `planned`), again ending with the
//! answer fitting and the next batch not.
//!
//! Strategies combine ([`combo`]): a precision, a checkpointing scheme, a way over the
//! GPUs or onto the host, and gradient accumulation. [`Steps`] builds each schedule
//! once per precision, accumulation and batch and shares it among the combinations,
//! whose per-GPU memory stays affine in the batch and is solved as above. With a
//! target batch, `fit` lists the combinations and recommends, of those that reach
//! it, the one with the least estimated step time where a card is given ([`time`]),
//! else the least extra compute, ties broken by communication.
//!
//! The combinations are independent once their steps are built: families of them
//! are solved on the machine's cores side by side, on one cache ([`Steps`]); the
//! report is the same whatever the number of threads.

use serde::Serialize;

mod blocks;
pub mod combo;
mod fit_device;
mod planned;
mod replica;
mod steps;
pub mod time;
pub use combo::{partition, traffic, Ckpt, Combo, Dist, Recommendation, Traffic};
pub use planned::{
    plan_step, plan_step_under, planned_max_batch, searched, AffineStep, PlannedFit,
    CONFIRM_ROUNDS, LOWEST_PEAK_TIME_LIMIT_S,
};
use steps::Realised;
pub use steps::Steps;

use crate::error::{Error, Result, Setting};
use crate::infer::Bindings;
use crate::ir::Model;
use crate::memory::device::{AllocatorReport, DeviceModel, DeviceSummary};
use crate::remat::plan::Solver;
use crate::train::TrainOptions;

/// A strategy's memory transformation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// The step as asked (`--precision`, default fp32).
    AsExported,
    /// Autocast mixed precision.
    MixedPrecision,
    /// sqrt(n) activation checkpointing.
    Checkpointing,
    /// Recomputation chosen by the planner (`memplan plan`) under the budget.
    PlannedCheckpointing,
    /// Every repeated block checkpointed as `torch.utils.checkpoint` does (Hugging
    /// Face's `gradient_checkpointing_enable()`; `remat::modules::every_block`).
    CheckpointEveryBlock,
    /// Every repeated block under selective checkpointing that keeps matrix products'
    /// and attention's outputs (torchtitan's default policy).
    CheckpointEveryBlockSelective,
    /// Gradient accumulation: gradients stay allocated across micro-batches.
    GradAccumulation,
    /// DistributedDataParallel: a full replica per GPU plus gradient buckets.
    DataParallel,
    /// ZeRO stage 1, 2 or 3 over the GPUs.
    Zero(u8),
    /// ZeRO-Offload: optimizer state and gradients on the host.
    ZeroOffload,
    /// ZeRO-Infinity's CPU offload: parameters on the host too.
    Zero3Offload,
    /// FSDP2 per repeated block and the root, resharding after forward or not.
    Fsdp(bool),
}

impl Strategy {
    /// Name in reports.
    pub fn name(self) -> String {
        match self {
            Strategy::AsExported => "as-exported".into(),
            Strategy::MixedPrecision => "mixed-precision".into(),
            Strategy::Checkpointing => "checkpointing-sqrt".into(),
            Strategy::PlannedCheckpointing => "checkpointing-planned".into(),
            Strategy::CheckpointEveryBlock => "checkpoint-every-block".into(),
            Strategy::CheckpointEveryBlockSelective => "checkpoint-every-block-selective".into(),
            Strategy::GradAccumulation => "grad-accumulation".into(),
            Strategy::DataParallel => "data-parallel".into(),
            Strategy::Zero(k) => format!("zero-{k}"),
            Strategy::ZeroOffload => "zero-offload".into(),
            Strategy::Zero3Offload => "zero-3-offload".into(),
            Strategy::Fsdp(r) => Dist::Fsdp { reshard: r }.name().unwrap_or_default(),
        }
    }

    /// The strategy as a [`Combo`] (`None` for planned checkpointing, whose plan
    /// depends on the batch).
    pub fn combo(self) -> Option<Combo> {
        let p = Combo::PLAIN;
        Some(match self {
            Strategy::AsExported => p,
            Strategy::MixedPrecision => Combo { mixed: true, ..p },
            Strategy::Checkpointing => Combo {
                ckpt: Ckpt::Sqrt,
                ..p
            },
            Strategy::CheckpointEveryBlock => Combo {
                ckpt: Ckpt::EveryBlock,
                ..p
            },
            Strategy::CheckpointEveryBlockSelective => Combo {
                ckpt: Ckpt::EveryBlockSelective,
                ..p
            },
            Strategy::GradAccumulation => Combo {
                accumulate: true,
                ..p
            },
            Strategy::DataParallel => Combo {
                dist: Dist::DataParallel,
                ..p
            },
            Strategy::Zero(k) => Combo {
                dist: Dist::Zero(k),
                ..p
            },
            Strategy::ZeroOffload => Combo {
                dist: Dist::ZeroOffload,
                ..p
            },
            Strategy::Zero3Offload => Combo {
                dist: Dist::Zero3Offload,
                ..p
            },
            Strategy::Fsdp(reshard) => Combo {
                dist: Dist::Fsdp { reshard },
                ..p
            },
            Strategy::PlannedCheckpointing => return None,
        })
    }
}

/// One row of the answer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StrategyFit {
    /// Strategy name.
    pub name: String,
    /// Largest per-GPU (micro-)batch that fits; 0 when even batch 1 does not.
    pub max_batch: u64,
    /// Peak bytes per GPU at `max_batch` (at batch 1 when nothing fits).
    pub peak_bytes: u64,
    /// Extra compute as a fraction of the step's FLOPs.
    pub overhead: f64,
    /// Samples per optimizer step: the micro-batch × GPUs × accumulation steps (for
    /// gradient accumulation and combinations with a target batch, the micro-batch
    /// that reaches it; else `max_batch`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u64>,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accumulation_steps: Option<u64>,
    /// What the strategy assumes.
    pub note: String,
    /// Planned checkpointing: the solver whose plan is reported (`ilp`, or `greedy`
    /// when the ILP found nothing cheaper within its time limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planner: Option<Solver>,
    /// Planned checkpointing: a proven lower bound on `overhead` at `max_batch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lower_bound_overhead: Option<f64>,
    /// Planned checkpointing: tensors the plan recomputes at `max_batch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recomputed_tensors: Option<usize>,
    /// Combinations: the strategies combined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub combines: Option<Vec<String>>,
    /// Over GPUs or the host: collective bytes per GPU per optimizer step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub communication_bytes: Option<u64>,
    /// Offload: host-device bytes per GPU per optimizer step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pcie_bytes: Option<u64>,
    /// Offload: host memory per GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_bytes: Option<u64>,
    /// Offloaded activations (the planned row's block plan): `pcie_bytes` at the
    /// card's PCIe link rate, seconds per step, on the compute stream (nothing
    /// overlapped, as the `--pytorch` file's hooks copy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pcie_seconds: Option<f64>,
    /// On a device (`--gpu`, `--headroom`, ...): bytes PyTorch's caching allocator
    /// reserves at `max_batch` (`torch.cuda.max_memory_reserved`, simulated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    /// On a device: `reserved_bytes` plus the CUDA context, what nvidia-smi shows
    /// for the process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_bytes: Option<u64>,
    /// Combination rows that reach the target, with a card: the estimated seconds
    /// of one optimizer step ([`time`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_seconds: Option<f64>,
    /// Combination rows with the same figures as this one, dropped from the list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_as: Option<Vec<String>>,
}

/// The `fit` result.
#[derive(Debug, Clone, Serialize)]
pub struct FitReport {
    /// Model path.
    pub model: String,
    /// Budget per GPU.
    pub memory_bytes: u64,
    /// Optimizer.
    pub optimizer: String,
    /// Precision of the as-exported step.
    pub precision: String,
    /// GPUs.
    pub gpus: u64,
    /// `--target-batch`, if given.
    pub target_batch: Option<u64>,
    /// Bytes batch 1 needs as exported.
    pub batch1_bytes: u64,
    /// One entry per strategy (and, with a target batch, per combination).
    pub strategies: Vec<StrategyFit>,
    /// With a target batch: the combination with the least extra compute that reaches
    /// it (ties: least communication, PCIe traffic, accumulation steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recommendation: Option<Recommendation>,
    /// With a target batch that no combination reaches: the largest that is reached,
    /// and what blocks the rest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<String>,
    /// The device the batches were fitted on (absent: live tensor bytes against
    /// `memory_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceSummary>,
    /// On a device with the default allocator: the strategy whose reserved bytes
    /// exceed its live tensor bytes most, where that is at least a tenth of what the
    /// allocator may reserve (expandable segments would give most of it back).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragmentation: Option<Fragmentation>,
    /// A mixture-of-experts model: the routing assumption that sized its experts
    /// (`--moe-routing`; the token counts are batch 1's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_routing: Option<crate::moe::RoutingSummary>,
}

/// The allocator's fragmentation at one strategy's max batch.
#[derive(Debug, Clone, Serialize)]
pub struct Fragmentation {
    /// The strategy (row name).
    pub strategy: String,
    /// Its max batch.
    pub max_batch: u64,
    /// Reserved bytes less live tensor bytes there.
    pub excess_bytes: u64,
    /// `excess_bytes` over what the allocator may reserve.
    pub fraction_of_capacity: f64,
}

/// Fit options.
#[derive(Debug, Clone)]
pub struct FitOptions {
    /// Budget per GPU in bytes.
    pub memory: u64,
    /// Training options of the as-exported step.
    pub train: TrainOptions,
    /// GPUs for data parallel and ZeRO.
    pub gpus: u64,
    /// Samples per optimizer step wanted (gradient accumulation).
    pub target_batch: Option<u64>,
    /// Other dimension bindings.
    pub dims: std::collections::BTreeMap<String, u64>,
    /// `--moe-routing`: the token count each expert is sized by ([`crate::moe`]).
    pub routing: Option<crate::moe::Routing>,
    /// Time limit of the ILP planner for planned checkpointing, in seconds (each
    /// lowest-peak plan gets at most [`LOWEST_PEAK_TIME_LIMIT_S`]).
    pub plan_time_limit_s: f64,
    /// The device: when given, a batch fits when the step's allocations, replayed
    /// through PyTorch's caching allocator, stay within what the allocator may
    /// reserve (its `capacity`: the memory less headroom and the CUDA context);
    /// when `None`, when the live tensor bytes stay within `memory`.
    pub device: Option<DeviceModel>,
    /// The card and the links between cards: with one, the recommendation decides
    /// by estimated step time ([`time`]).
    pub cluster: Option<time::Cluster>,
}

impl FitOptions {
    /// The most live tensor bytes a step may hold: the allocator's capacity on the
    /// device, else the memory.
    pub fn budget(&self) -> u64 {
        self.device.as_ref().map_or(self.memory, |d| d.capacity)
    }
}

/// Sets a row's reserved and device bytes from a replay at its batch.
fn set_device_figures(row: &mut StrategyFit, d: &DeviceModel, r: Option<AllocatorReport>) {
    if let Some(r) = r {
        row.reserved_bytes = Some(r.reserved_bytes);
        row.device_bytes = Some(d.device_bytes(&r));
    }
}

/// Micro-batch and accumulation steps for a global batch of `target` samples over
/// `gpus` GPUs, with at most `max_micro` samples per GPU per micro-step:
/// `(micro, steps)`. Exactly `target` when some split with at most twice the fewest
/// steps gives it (a user's global batch is a hyperparameter: 64 stays 64, as
/// 2 × 32 rather than 3 × 22 = 66); otherwise the fewest steps, with micro-batches
/// as even as they go, which overshoots by less than `steps × gpus` samples.
pub fn split_batch(target: u64, max_micro: u64, gpus: u64) -> (u64, u64) {
    let gpus = gpus.max(1);
    let max_micro = max_micro.max(1);
    let fewest = target.div_ceil(max_micro.saturating_mul(gpus)).max(1);
    // Micro-batches from the largest down to the one that doubles the steps (at most
    // 2^20 tried: a huge prime target then takes the fewest steps).
    let hi = max_micro.min(target / gpus);
    let lo = target
        .div_ceil(fewest.saturating_mul(2).saturating_mul(gpus))
        .max(1);
    (lo..=hi)
        .rev()
        .take(1 << 20)
        .find(|&m| target % (m * gpus) == 0)
        .map(|m| (m, target / (m * gpus)))
        .unwrap_or((target.div_ceil(fewest * gpus), fewest))
}

/// The strategies `fit` tries, the multi-GPU ones with more than one GPU.
fn strategies(o: &FitOptions) -> Vec<Strategy> {
    let gpus = o.gpus;
    let mut strategies = vec![
        Strategy::AsExported,
        Strategy::MixedPrecision,
        Strategy::Checkpointing,
        Strategy::PlannedCheckpointing,
        Strategy::CheckpointEveryBlock,
        Strategy::CheckpointEveryBlockSelective,
        Strategy::GradAccumulation,
    ];
    if gpus > 1 {
        strategies.extend([
            Strategy::DataParallel,
            Strategy::Zero(1),
            Strategy::Zero(2),
            Strategy::Zero(3),
            Strategy::Fsdp(true),
            Strategy::Fsdp(false),
        ]);
    }
    strategies.extend([Strategy::ZeroOffload, Strategy::Zero3Offload]);
    if o.train.precision.is_amp() {
        // The step is mixed precision already: the row would repeat as-exported.
        strategies.retain(|&s| s != Strategy::MixedPrecision);
    }
    strategies
}

/// Why nothing fits: batch 1's peak as exported, and the best strategy's where lower.
fn nothing_fits(memory: u64, batch1: u64, rows: &[StrategyFit]) -> Error {
    Error::Binding(format!(
        "nothing fits in {}: batch 1 needs {} as exported ({} bytes){}",
        crate::units::human_bytes(memory),
        crate::units::human_bytes(batch1),
        batch1,
        rows.iter()
            .map(|r| r.peak_bytes)
            .min()
            .filter(|&m| m < batch1)
            .map(|m| format!(", {} with the best strategy", crate::units::human_bytes(m)))
            .unwrap_or_default()
    ))
}

/// Why `model` cannot be fitted under `o`, if it cannot: no memory, or no batch
/// dimension.
fn fittable(model: &Model, o: &FitOptions) -> Result<()> {
    if o.memory == 0 {
        return Err(Error::setting(
            Setting::Memory,
            "the device memory must be positive",
        ));
    }
    if !crate::infer::has_batch_dim(model) {
        return Err(Error::Binding(
            "the model has no batch dimension (every input's dim 0 is fixed): nothing to fit"
                .into(),
        ));
    }
    Ok(())
}

/// Runs every strategy.
pub fn fit(model: &Model, path: &str, o: &FitOptions) -> Result<FitReport> {
    fittable(model, o)?;
    let strategies = strategies(o);
    let moe_routing = routing_at_batch_1(model, o)?;
    let steps = Steps::new(model, o);
    // Every combination's largest batch, the families side by side.
    let mut solved: Vec<Combo> = strategies.iter().filter_map(|s| s.combo()).collect();
    if o.target_batch.is_some() {
        solved.extend(combined(&steps)?);
    }
    steps.solve(&solved)?;
    let mut rows = Vec::new();
    // The block plan's row; above this size the op-level search is skipped where
    // blocks can be planned.
    let block_row = blocks::row(&steps)?;
    let n = blocks::nodes(&steps)?;
    let op_skipped = (block_row.is_some() && n > blocks::OP_PLAN_MAX_NODES).then_some(n);
    let mut batch1 = 0;
    let mut as_exported = 0;
    for st in strategies {
        let mut planned = None;
        let mut planned_device = None;
        let (mb, peak, overhead) = match st.combo() {
            Some(c) => steps.max_batch(c)?,
            None if op_skipped.is_some() => {
                let b = block_row.as_ref().expect("a block row");
                (b.max_batch, b.peak_bytes, b.overhead)
            }
            None => {
                let mut p = planned_max_batch(model, o, as_exported)?;
                planned_device = match &o.device {
                    Some(d) => fit_device::confirm_planned(model, o, d, &mut p)?,
                    None => None,
                };
                let peak = if p.max_batch == 0 {
                    p.report.min_feasible_bytes
                } else {
                    p.report.peak_bytes
                };
                let r = (p.max_batch, peak, p.report.overhead);
                planned = Some(p);
                r
            }
        };
        if st == Strategy::AsExported {
            as_exported = mb;
            batch1 = if mb == 0 {
                peak
            } else {
                steps
                    .peak_at(Combo::PLAIN, 1)?
                    .0
                    .into_iter()
                    .max()
                    .unwrap_or(0)
            };
        }
        let n = st.combo().map_or(1, |c| c.gpus(o.gpus));
        let (global, acc_steps, note) = match st {
            Strategy::GradAccumulation => match (o.target_batch, mb) {
                (Some(t), m) if m > 0 => match steps.split_fitting(st.combo().expect("grad-accumulation is a combination"), t, m, 1)? {
                    Some((micro, k)) => (micro * k, Some(k), format!("micro-batch {micro} × {k} steps; gradients stay allocated between micro-batches")),
                    None => (mb, None, "gradients stay allocated between micro-batches; no micro-batch split for the target fits the device".into()),
                },
                _ => (mb, None, "gradients stay allocated between micro-batches; give a target batch for the steps".into()),
            },
            Strategy::DataParallel => (mb * n, None, format!("per GPU: full replica + DDP gradient buckets; global batch over {n} GPUs")),
            Strategy::Zero(k) => (mb * n, None, format!("per GPU, {} partitioned over {n} GPUs", match k { 1 => "optimizer state", 2 => "optimizer state and gradients", _ => "optimizer state, gradients and parameters" })),
            Strategy::ZeroOffload => (mb * n, None, format!("optimizer state and gradients on the host (CPU update), over {n} GPU{}", if n == 1 { "" } else { "s" })),
            Strategy::Fsdp(r) => (mb * n, None, format!("per GPU: FSDP2 per repeated block and the root, sharded over {n} GPUs; {}", if r { "each unit gathered in forward and again in backward (the next one prefetched)" } else { "each unit gathered in forward and kept for its backward" })),
            Strategy::Zero3Offload => (mb * n, None, format!("parameters, optimizer state and gradients on the host; one parameter gathered at a time, over {n} GPU{}", if n == 1 { "" } else { "s" })),
            Strategy::AsExported => (mb, None, format!("{} training, {} optimizer", o.train.precision, o.train.optimizer)),
            Strategy::MixedPrecision => (mb, None, "autocast: half-precision matmul/conv, fp32 master weights and states".into()),
            Strategy::Checkpointing => (mb, None, "sqrt(n) equal segments, each recomputed once in backward".into()),
            Strategy::CheckpointEveryBlock => (mb, None, "torch.utils.checkpoint on every repeated block (layer1.0, h.3, ...), as gradient_checkpointing_enable()".into()),
            Strategy::CheckpointEveryBlockSelective => (mb, None, "selective checkpoint on every repeated block: matrix products' and attention's outputs kept, the rest recomputed (torchtitan's default policy)".into()),
            Strategy::PlannedCheckpointing => (mb, None, match &planned {
                Some(p) if p.max_batch > 0 => format!(
                    "memplan's planner: {} tensors recomputed ({} plan; overhead lower bound {:.1}%; greedy alone fits {})",
                    p.report.recomputed.len(),
                    format!("{:?}", p.report.solver).to_lowercase(),
                    p.lower_bound_overhead * 100.0,
                    p.greedy_max_batch
                ),
                _ if op_skipped.is_some() => "memplan's planner: no block plan fits batch 1; peak is the lowest reachable".into(),
                _ => "memplan's planner: no plan fits batch 1; peak is the lowest reachable".into(),
            }),
        };
        let tr = match st.combo() {
            Some(c) if c.dist != Dist::Single => Some(steps.traffic(c, 1)?),
            _ => None,
        };
        let mut row = StrategyFit {
            name: st.name(),
            max_batch: mb,
            peak_bytes: peak,
            overhead,
            global_batch: Some(global),
            accumulation_steps: acc_steps,
            note,
            ..Default::default()
        };
        if let Some(p) = planned.as_ref().filter(|p| p.max_batch > 0) {
            row.planner = Some(p.report.solver);
            row.lower_bound_overhead = Some(p.lower_bound_overhead);
            row.recomputed_tensors = Some(p.report.recomputed.len());
        }
        set_traffic(&mut row, tr);
        match (st.combo(), &o.device) {
            (Some(c), _) => steps.set_device(&mut row, c)?,
            (None, _) if op_skipped.is_some() => steps.set_device(&mut row, blocks::BLOCKS)?,
            (None, Some(d)) => set_device_figures(&mut row, d, planned_device),
            (None, None) => {}
        }
        rows.push(row);
    }
    blocks::take_the_better_preset(&mut rows, block_row, op_skipped);
    let (mut recommendation, mut unreachable) = (None, None);
    if let Some(target) = o.target_batch {
        let (more, rec, unr) = combine(&steps, o, target)?;
        rows.extend(more);
        drop_duplicates(&mut rows);
        (recommendation, unreachable) = (rec, unr);
    }
    if rows.iter().all(|r| r.max_batch == 0) {
        return Err(nothing_fits(o.memory, batch1, &rows));
    }
    let fragmentation = o
        .device
        .as_ref()
        .and_then(|d| fit_device::fragmentation(&rows, d));
    Ok(FitReport {
        model: path.to_string(),
        memory_bytes: o.memory,
        optimizer: o.train.optimizer.to_string(),
        precision: o.train.precision.to_string(),
        gpus: o.gpus,
        target_batch: o.target_batch,
        batch1_bytes: batch1,
        strategies: rows,
        recommendation,
        unreachable,
        device: o.device.as_ref().map(DeviceModel::summary),
        fragmentation,
        moe_routing,
    })
}

/// The routing assumption that sizes a mixture-of-experts model's experts, as batch 1
/// infers it (an error for `--moe-routing` on a model without experts).
fn routing_at_batch_1(model: &Model, o: &FitOptions) -> Result<Option<crate::moe::RoutingSummary>> {
    let b = Bindings {
        batch: Some(1),
        dims: o.dims.clone(),
        routing: o.routing,
    };
    Ok(crate::step::inference(model, &b)?.inferred.routing)
}

/// A row's traffic fields (offload rows: PCIe and host bytes; over GPUs: collective
/// bytes).
fn set_traffic(row: &mut StrategyFit, tr: Option<Traffic>) {
    if let Some(t) = tr {
        row.communication_bytes = Some(t.communication_bytes);
        if t.host_bytes > 0 || t.pcie_bytes > 0 {
            row.pcie_bytes = Some(t.pcie_bytes);
            row.host_bytes = Some(t.host_bytes);
        }
    }
}

/// Drops every combination row whose figures (batches, peak, overhead, traffic,
/// device bytes, step time) equal an earlier row's, naming it in that row's
/// `same_as`.
fn drop_duplicates(rows: &mut Vec<StrategyFit>) {
    let key = |r: &StrategyFit| {
        format!(
            "{} {} {} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
            r.max_batch,
            r.peak_bytes,
            r.overhead.to_bits(),
            r.global_batch,
            r.accumulation_steps,
            r.communication_bytes,
            r.pcie_bytes,
            r.host_bytes,
            r.reserved_bytes,
            r.step_seconds.map(f64::to_bits)
        )
    };
    let mut kept: Vec<StrategyFit> = Vec::with_capacity(rows.len());
    for r in rows.drain(..) {
        let k = key(&r);
        match kept.iter_mut().find(|x| key(x) == k) {
            Some(first) if r.combines.is_some() => {
                first.same_as.get_or_insert_with(Vec::new).push(r.name);
            }
            _ => kept.push(r),
        }
    }
    *rows = kept;
}

/// The combinations tried towards a target batch. Under a half-precision step,
/// mixed precision repeats what was asked. Tensor and pipeline parallelism pay in
/// time (all-reduces, the bubble), not in FLOPs or data-parallel traffic: offered
/// where the step is timed (a card is given). Tensor parallelism needs Linear
/// roles, pipelines enough repeated blocks.
fn combined(steps: &Steps) -> Result<Vec<Combo>> {
    let o = steps.o;
    let half = o.train.precision.half().is_some();
    let mut cs = Vec::new();
    for c in combo::combos(o.gpus) {
        if (half && c.mixed)
            || (c.mp != combo::Mp::NONE && (o.cluster.is_none() || !steps.takes(c.mp)?))
        {
            continue;
        }
        cs.push(c);
    }
    Ok(cs)
}

/// One combination towards the target batch: the combination itself when it
/// reaches it without accumulation, else with accumulation.
struct Attempt {
    /// Without accumulation, when that does not reach the target: its name and
    /// global batch.
    short: Option<(u64, String)>,
    /// With accumulation, when that does not fit batch 1: its name and batch-1 peak.
    blocked: Option<(u64, String)>,
    /// The row of a combination of two or more strategies.
    row: Option<StrategyFit>,
    /// The way to the target, if it reaches it.
    candidate: Option<combo::Candidate>,
}

/// [`Attempt`] of `c0` towards `target`.
fn attempt(steps: &Steps, c0: Combo, target: u64) -> Result<Attempt> {
    let o = steps.o;
    let n = c0.gpus(o.gpus);
    let (mb0, peak0, ov0) = steps.max_batch(c0)?;
    let mut a = Attempt {
        short: None,
        blocked: None,
        row: None,
        candidate: None,
    };
    let (c, mb, peak, ov, k, micro) =
        if mb0 * n >= target && steps.fits_at(c0, target.div_ceil(n))? {
            (c0, mb0, peak0, ov0, 1, target.div_ceil(n))
        } else {
            a.short = Some((mb0 * n, c0.name()));
            let c = Combo {
                accumulate: true,
                ..c0
            };
            let (mb, peak, ov) = steps.max_batch(c)?;
            if mb == 0 {
                a.blocked = Some((peak, c.name()));
                (c, 0, peak, ov, 0, 0)
            } else {
                match steps.split_fitting(c, target, mb, n)? {
                    Some((micro, k)) => (c, mb, peak, ov, k, micro),
                    None => (c, mb, peak, ov, 0, 0),
                }
            }
        };
    let tr = steps.traffic(c, k.max(1))?;
    let time = match (&o.cluster, mb > 0 && k > 0) {
        (Some(cl), true) => Some(time::step_time(steps, cl, c, (n, k, micro), ov, tr)?),
        _ => None,
    };
    if c.names().len() >= 2 {
        let mut row = StrategyFit {
            name: c.name(),
            max_batch: mb,
            peak_bytes: peak,
            overhead: ov,
            global_batch: Some(if k == 0 { 0 } else { micro * k * n }),
            accumulation_steps: c.accumulate.then_some(k).filter(|&k| k > 0),
            note: combined_note(c, n, (mb, k, micro)),
            combines: Some(c.names()),
            step_seconds: time.map(|t| t.total_s),
            ..Default::default()
        };
        steps.set_device(&mut row, c)?;
        if c.dist != Dist::Single {
            set_traffic(&mut row, Some(tr));
        }
        a.row = Some(row);
    }
    if mb > 0 && k > 0 {
        // Its peak at the micro-batch it would run (the schedule at that batch is
        // shared by every combination of the same precision and accumulation).
        let at_micro = steps.peak_at(c, micro)?.0.into_iter().max().unwrap_or(0);
        a.candidate = Some(combo::Candidate {
            combo: c,
            micro_batch: micro,
            steps: k,
            gpus: n,
            peak_bytes: at_micro,
            overhead: ov,
            traffic: tr,
            time,
        });
    }
    Ok(a)
}

/// The note of combination `c`'s row over `n` GPUs (or replicas), at its largest
/// batch `mb`, `k` steps of `micro` towards the target.
fn combined_note(c: Combo, n: u64, (mb, k, micro): (u64, u64, u64)) -> String {
    if mb == 0 {
        return "does not fit batch 1".into();
    }
    if k == 0 {
        return "no micro-batch split for the target fits the device".into();
    }
    let over = if c.mp == combo::Mp::NONE {
        format!("{n} GPU{}", if n == 1 { "" } else { "s" })
    } else {
        format!(
            "{n} replica{} of {} GPUs",
            if n == 1 { "" } else { "s" },
            c.mp.ranks()
        )
    };
    if c.accumulate {
        format!("micro-batch {micro} × {k} steps × {over}")
    } else {
        format!("micro-batch {micro} × {over}")
    }
}

/// Every combination towards the target global batch `target`, each worked out on
/// its own and side by side: the rows of those that combine two or more
/// strategies, the recommendation, or why none reaches it.
fn combine(
    steps: &Steps,
    o: &FitOptions,
    target: u64,
) -> Result<(Vec<StrategyFit>, Option<Recommendation>, Option<String>)> {
    use rayon::prelude::*;
    // Each combination on its own; the first failure in order is the one reported.
    let attempts: Vec<Result<Attempt>> = combined(steps)?
        .into_par_iter()
        .map(|c0| {
            let a = attempt(steps, c0, target);
            steps.forget_realised();
            a
        })
        .collect();
    let attempts = attempts.into_iter().collect::<Result<Vec<_>>>()?;
    let mut rows = Vec::new();
    let mut reach = Vec::new();
    // The largest global batch reached without accumulation, and the lowest batch-1
    // peak with it (what blocks accumulation when nothing reaches the target).
    let mut best_plain: (u64, String) = (0, String::new());
    let mut acc_block: Option<(u64, String)> = None;
    for a in attempts {
        if let Some(s) = a.short.filter(|s| s.0 > best_plain.0) {
            best_plain = s;
        }
        if let Some(b) = a.blocked {
            if acc_block.as_ref().is_none_or(|(p, _)| b.0 < *p) {
                acc_block = Some(b);
            }
        }
        rows.extend(a.row);
        reach.extend(a.candidate);
    }
    reach.sort_by(|a, b| a.cmp_pref(b));
    if reach.is_empty() {
        let why = match acc_block {
            Some((p, name)) => format!(
                "gradient accumulation, which reaches any batch, does not fit batch 1 ({} with {name})",
                crate::units::human_bytes(p)
            ),
            None => "no combination fits batch 1".into(),
        };
        return Ok((
            rows,
            None,
            Some(format!(
                "global batch {target} is out of reach: the largest reached is {}{}; {why}",
                best_plain.0,
                if best_plain.0 > 0 {
                    format!(" ({})", best_plain.1)
                } else {
                    String::new()
                }
            )),
        ));
    }
    let mut rec = Recommendation::new(&reach[0], reach.get(1));
    if o.gpus > 1 {
        rec.interconnect = o.cluster.as_ref().map(|c| c.link.clone());
    }
    Ok((rows, Some(rec), None))
}

/// [`crate::units::parse_size`], the name `fit` has always exported.
pub use crate::units::parse_size as parse_memory;

#[cfg(test)]
mod tests {
    use super::split_batch;

    #[test]
    fn split_batch_is_exact_when_it_can_be() {
        assert_eq!(split_batch(64, 3, 1), (2, 32));
        assert_eq!(split_batch(64, 16, 1), (16, 4));
        assert_eq!(split_batch(64, 17, 1), (16, 4));
        assert_eq!(split_batch(64, 1000, 1), (64, 1));
        assert_eq!(split_batch(64, 4, 8), (4, 2));
        // 97 is prime: 97 × 1 would need 97 steps, over twice the fewest (10).
        assert_eq!(split_batch(97, 10, 1), (10, 10));
        // Nothing exact within twice the fewest steps over 3 GPUs: even split, 66.
        assert_eq!(split_batch(64, 11, 3), (11, 2));
        assert_eq!(split_batch(1 << 40, 3, 1), (2, 1 << 39));
    }
}
