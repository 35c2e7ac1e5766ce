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

use serde::Serialize;

mod planned;
pub use planned::{
    plan_step, plan_step_under, planned_max_batch, searched, AffineStep, PlannedFit,
    CONFIRM_ROUNDS, LOWEST_PEAK_TIME_LIMIT_S,
};

use crate::error::{Error, Result, Setting};
use crate::infer::{infer, Bindings, MAX_BATCH};
use crate::ir::Model;
use crate::memory::simulate;
use crate::remat::checkpoint_sqrt;
use crate::remat::plan::Solver;
use crate::train::{build_schedule, Precision, Schedule, StorageKind, TrainOptions};

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
    /// Gradient accumulation: gradients stay allocated across micro-batches.
    GradAccumulation,
    /// DistributedDataParallel: a full replica per GPU plus gradient buckets.
    DataParallel,
    /// ZeRO stage 1, 2 or 3 over the GPUs.
    Zero(u8),
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
            Strategy::GradAccumulation => "grad-accumulation".into(),
            Strategy::DataParallel => "data-parallel".into(),
            Strategy::Zero(k) => format!("zero-{k}"),
        }
    }
}

/// One row of the answer.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyFit {
    /// Strategy name.
    pub name: String,
    /// Largest per-GPU (micro-)batch that fits; 0 when even batch 1 does not.
    pub max_batch: u64,
    /// Peak bytes per GPU at `max_batch` (at batch 1 when nothing fits).
    pub peak_bytes: u64,
    /// Extra compute as a fraction of the step's FLOPs.
    pub overhead: f64,
    /// Samples per optimizer step across GPUs (data parallel, ZeRO) or micro-steps.
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
    /// One entry per strategy.
    pub strategies: Vec<StrategyFit>,
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
    /// Time limit of the ILP planner for planned checkpointing, in seconds (each
    /// lowest-peak plan gets at most [`LOWEST_PEAK_TIME_LIMIT_S`]).
    pub plan_time_limit_s: f64,
}

/// Peak bytes of one strategy at one batch, and the recompute FLOP fraction.
fn peak_at(model: &Model, o: &FitOptions, st: Strategy, batch: u64) -> Result<(Vec<u64>, f64)> {
    let b = Bindings {
        batch: Some(batch),
        dims: o.dims.clone(),
    };
    let model = &*crate::lower::lower(model, &b)?;
    let inf = infer(model, &b)?;
    let mut topts = o.train.clone();
    if st == Strategy::MixedPrecision {
        topts.precision = match o.train.precision {
            Precision::AmpBf16 | Precision::Bf16 => Precision::AmpBf16,
            _ => Precision::AmpFp16,
        };
    }
    if st == Strategy::GradAccumulation {
        topts.grads_resident = true;
    }
    let mut s = build_schedule(model, &inf, &topts)?;
    if st == Strategy::CheckpointEveryBlock {
        // The module set does not depend on the batch, so the plan's instructions are
        // the same at every batch and their live bytes are affine in it.
        let g = crate::remat::from_schedule::from_schedule(&s, "fit");
        let p = crate::remat::modules::every_block(&g).map_err(Error::Graph)?;
        let base = g.base_cost().max(1.0);
        return Ok((
            crate::remat::modules::timeline(&g, &p.plan),
            p.recompute_cost / base,
        ));
    }
    let mut overhead = 0.0;
    if st == Strategy::Checkpointing {
        let base = s.flops().max(1);
        let r = checkpoint_sqrt(&s, 0);
        overhead = r.recompute_flops as f64 / base as f64;
        s = r.schedule;
    }
    partition(&mut s, st, o.gpus);
    let replay = simulate(&s);
    Ok((
        replay.timeline.iter().map(|b| b.total()).collect(),
        overhead,
    ))
}

/// Per-GPU shares under data parallel and ZeRO (Rajbhandari et al. 2020): stage 1
/// partitions optimizer state, stage 2 also gradients, stage 3 also parameters (each
/// GPU then gathers one parameter tensor at a time; the largest is counted whole).
/// Data parallel keeps a full replica plus DDP's gradient buckets (one more copy of
/// the gradients, PyTorch's default without `gradient_as_bucket_view`).
fn partition(s: &mut Schedule, st: Strategy, gpus: u64) {
    let n = gpus.max(1);
    let stage = match st {
        Strategy::Zero(k) => k,
        Strategy::DataParallel => {
            // Buckets are allocated at construction and live through the step.
            let grads = s.bytes_where(|x| x.kind == StorageKind::ParamGrad);
            let mut bucket = s.storages[0].clone();
            bucket.name = "ddp gradient buckets".into();
            bucket.kind = StorageKind::Buffer;
            bucket.bytes = grads;
            bucket.persistent = true;
            s.storages.push(bucket);
            return;
        }
        _ => return,
    };
    let largest_param = s
        .storages
        .iter()
        .filter(|x| x.kind == StorageKind::Parameter)
        .map(|x| x.bytes)
        .max()
        .unwrap_or(0);
    for x in &mut s.storages {
        let part = match x.kind {
            StorageKind::OptimizerState | StorageKind::OptimizerTemp => stage >= 1,
            StorageKind::ParamGrad => stage >= 2,
            StorageKind::Parameter => stage >= 3,
            _ => false,
        };
        if part {
            x.bytes = x.bytes.div_ceil(n);
        }
    }
    if stage >= 3 && largest_param > 0 {
        let mut gathered = s.storages[0].clone();
        gathered.name = "zero-3 gathered parameter".into();
        gathered.kind = StorageKind::Buffer;
        gathered.bytes = largest_param;
        gathered.persistent = true;
        s.storages.push(gathered);
    }
}

/// The largest batch whose peak is within the budget (0 if batch 1 is not).
fn max_batch(model: &Model, o: &FitOptions, st: Strategy) -> Result<(u64, u64, f64)> {
    let (t1, ov) = peak_at(model, o, st, 1)?;
    let peak1 = t1.iter().copied().max().unwrap_or(0);
    if peak1 > o.memory {
        return Ok((0, peak1, ov));
    }
    let (t2, _) = peak_at(model, o, st, 2)?;
    let fits = |b: u64| -> Result<(bool, u64, f64)> {
        let (t, ov) = peak_at(model, o, st, b)?;
        let p = t.iter().copied().max().unwrap_or(0);
        Ok((p <= o.memory, p, ov))
    };
    if t1.len() != t2.len() {
        // The step itself changes with the batch (a Loop over the rows, lowered per
        // batch): no affine model; gallop, then bisect, on the peak (monotone in
        // the batch).
        let (mut lo, mut at_lo) = (1, (peak1, ov));
        let mut hi = 2;
        loop {
            let (ok, p, o2) = fits(hi)?;
            if !ok {
                break;
            }
            (lo, at_lo) = (hi, (p, o2));
            if hi >= MAX_BATCH {
                return Ok((lo, at_lo.0, at_lo.1));
            }
            hi = (hi * 2).min(MAX_BATCH);
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let (ok, p, o2) = fits(mid)?;
            if ok {
                (lo, at_lo) = (mid, (p, o2));
            } else {
                hi = mid;
            }
        }
        return Ok((lo, at_lo.0, at_lo.1));
    }
    // Solve every step's affine bytes a + c·(b-1) <= M.
    let mut best = MAX_BATCH;
    for (&a, &b2) in t1.iter().zip(&t2) {
        let c = b2.saturating_sub(a);
        if let Some(more) = (o.memory - a.min(o.memory)).checked_div(c) {
            best = best.min(1 + more);
        }
    }
    // Confirm: fits at `best`, not at `best + 1`; walk if the model is not affine.
    let mut b = best.max(1);
    let (ok, mut peak, mut ov) = fits(b)?;
    let mut ok = ok;
    let mut guard = 0;
    while !ok && b > 1 && guard < 64 {
        b -= 1;
        (ok, peak, ov) = fits(b)?;
        guard += 1;
    }
    while b < MAX_BATCH && guard < 64 {
        let next = fits(b + 1)?;
        if !next.0 {
            break;
        }
        b += 1;
        (ok, peak, ov) = next;
        guard += 1;
    }
    if !ok {
        return Ok((0, peak, ov));
    }
    Ok((b, peak, ov))
}

/// Runs every strategy.
pub fn fit(model: &Model, path: &str, o: &FitOptions) -> Result<FitReport> {
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
    let mut strategies = vec![
        Strategy::AsExported,
        Strategy::MixedPrecision,
        Strategy::Checkpointing,
        Strategy::PlannedCheckpointing,
        Strategy::CheckpointEveryBlock,
        Strategy::GradAccumulation,
    ];
    if o.gpus > 1 {
        strategies.extend([
            Strategy::DataParallel,
            Strategy::Zero(1),
            Strategy::Zero(2),
            Strategy::Zero(3),
        ]);
    }
    let mut rows = Vec::new();
    let mut batch1 = 0;
    let mut as_exported = 0;
    for st in strategies {
        let mut planned = None;
        let (mb, peak, overhead) = if st == Strategy::PlannedCheckpointing {
            let p = planned_max_batch(model, o, as_exported)?;
            let peak = if p.max_batch == 0 {
                p.report.min_feasible_bytes
            } else {
                p.report.peak_bytes
            };
            let r = (p.max_batch, peak, p.report.overhead);
            planned = Some(p);
            r
        } else {
            max_batch(model, o, st)?
        };
        if st == Strategy::AsExported {
            as_exported = mb;
            batch1 = if mb == 0 {
                peak
            } else {
                peak_at(model, o, st, 1)?.0.into_iter().max().unwrap_or(0)
            };
        }
        let (global, steps, note) = match st {
            Strategy::GradAccumulation => match (o.target_batch, mb) {
                (Some(t), m) if m > 0 => {
                    let steps = t.div_ceil(m);
                    let micro = t.div_ceil(steps);
                    (Some(micro * steps), Some(steps), format!("micro-batch {micro} × {steps} steps; gradients stay allocated between micro-batches"))
                }
                _ => (None, None, "gradients stay allocated between micro-batches; give a target batch for the steps".into()),
            },
            Strategy::DataParallel => (Some(mb * o.gpus), None, format!("per GPU: full replica + DDP gradient buckets; global batch over {} GPUs", o.gpus)),
            Strategy::Zero(k) => (Some(mb * o.gpus), None, format!("per GPU, {} partitioned over {} GPUs", match k { 1 => "optimizer state", 2 => "optimizer state and gradients", _ => "optimizer state, gradients and parameters" }, o.gpus)),
            Strategy::AsExported => (None, None, format!("{} training, {} optimizer", o.train.precision, o.train.optimizer)),
            Strategy::MixedPrecision => (None, None, "autocast: half-precision matmul/conv, fp32 master weights and states".into()),
            Strategy::Checkpointing => (None, None, "sqrt(n) equal segments, each recomputed once in backward".into()),
            Strategy::CheckpointEveryBlock => (None, None, "torch.utils.checkpoint on every repeated block (layer1.0, h.3, ...), as gradient_checkpointing_enable()".into()),
            Strategy::PlannedCheckpointing => (None, None, match &planned {
                Some(p) if p.max_batch > 0 => format!(
                    "memplan's planner: {} tensors recomputed ({} plan; overhead lower bound {:.1}%; greedy alone fits {})",
                    p.report.recomputed.len(),
                    format!("{:?}", p.report.solver).to_lowercase(),
                    p.lower_bound_overhead * 100.0,
                    p.greedy_max_batch
                ),
                _ => "memplan's planner: no plan fits batch 1; peak is the lowest reachable".into(),
            }),
        };
        rows.push(StrategyFit {
            name: st.name(),
            max_batch: mb,
            peak_bytes: peak,
            overhead,
            global_batch: global,
            accumulation_steps: steps,
            note,
            planner: planned
                .as_ref()
                .filter(|p| p.max_batch > 0)
                .map(|p| p.report.solver),
            lower_bound_overhead: planned
                .as_ref()
                .filter(|p| p.max_batch > 0)
                .map(|p| p.lower_bound_overhead),
            recomputed_tensors: planned
                .as_ref()
                .filter(|p| p.max_batch > 0)
                .map(|p| p.report.recomputed.len()),
        });
    }
    if rows.iter().all(|r| r.max_batch == 0) {
        return Err(Error::Binding(format!(
            "nothing fits in {}: batch 1 needs {} as exported ({} bytes){}",
            crate::units::human_bytes(o.memory),
            crate::units::human_bytes(batch1),
            batch1,
            rows.iter()
                .map(|r| r.peak_bytes)
                .min()
                .filter(|&m| m < batch1)
                .map(|m| format!(", {} with the best strategy", crate::units::human_bytes(m)))
                .unwrap_or_default()
        )));
    }
    Ok(FitReport {
        model: path.to_string(),
        memory_bytes: o.memory,
        optimizer: o.train.optimizer.to_string(),
        precision: o.train.precision.to_string(),
        gpus: o.gpus,
        target_batch: o.target_batch,
        batch1_bytes: batch1,
        strategies: rows,
    })
}

/// [`crate::units::parse_size`], the name `fit` has always exported.
pub use crate::units::parse_size as parse_memory;
