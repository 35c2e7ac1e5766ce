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
//! target batch, `fit` lists the combinations and recommends the one with the least
//! extra compute that reaches it, ties broken by communication.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use serde::Serialize;

mod blocks;
pub mod combo;
mod fit_device;
mod planned;
mod replica;
pub mod time;
pub use combo::{partition, traffic, Ckpt, Combo, Dist, Recommendation, Traffic};
pub use planned::{
    plan_step, plan_step_under, planned_max_batch, searched, AffineStep, PlannedFit,
    CONFIRM_ROUNDS, LOWEST_PEAK_TIME_LIMIT_S,
};

use crate::error::{Error, Result, Setting};
use crate::infer::{Bindings, MAX_BATCH};
use crate::ir::Model;
use crate::memory::device::{self, AllocatorReport, DeviceModel, DeviceSummary};
use crate::memory::simulate;
use crate::remat::checkpoint_sqrt;
use crate::remat::modules::ModuleTree;
use crate::remat::plan::Solver;
use crate::train::{Precision, Schedule, TrainOptions};

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

/// A replica rank's step: model parallelism, mixed precision, accumulation, batch.
type RankKey = (combo::Mp, bool, bool, u64);

/// Schedules of the step by precision, gradient residency and batch, built once
/// each and shared by every combination; and each combination's largest batch.
pub struct Steps<'a> {
    pub(super) model: &'a Model,
    o: &'a FitOptions,
    built: RefCell<HashMap<(bool, bool, u64), Rc<Schedule>>>,
    solved: RefCell<HashMap<Combo, (u64, u64, f64)>>,
    /// Allocator replays by combination, batch and capacity.
    replayed: RefCell<HashMap<(Combo, u64, u64), Option<AllocatorReport>>>,
    /// The steps realised last (a few: a batch's peak and its replays come
    /// together), newest last.
    realised: RefCell<Vec<(StepKey, Rc<RealisedStep>)>>,
    /// The worst rank's schedule by model parallelism, precision, accumulation and
    /// batch (shared by the ways over the data-parallel ranks).
    ranked: RefCell<HashMap<RankKey, Rc<Schedule>>>,
    /// Module trees by what shapes the steps (not the batch), and step count.
    trees: RefCell<HashMap<TreeKey, Rc<ModuleTree>>>,
}

/// What a module tree depends on: precision, accumulation, model parallelism, the
/// way over the GPUs (FSDP adds steps) and a hash of the steps' names.
type TreeKey = (bool, bool, combo::Mp, Dist, u64);

/// A combination at a batch.
type StepKey = (Combo, u64);
/// A realised step and its recompute FLOP fraction.
type RealisedStep = (Realised, f64);

/// Micro-batch splits [`Steps::split_fitting`] tries.
const MICRO_TRIES: usize = 16;

/// Steps [`Steps::realise`] keeps.
const REALISED_KEPT: usize = 4;

impl<'a> Steps<'a> {
    /// For `model` under `o`.
    pub fn new(model: &'a Model, o: &'a FitOptions) -> Steps<'a> {
        Steps {
            model,
            o,
            built: Default::default(),
            solved: Default::default(),
            replayed: Default::default(),
            realised: Default::default(),
            ranked: Default::default(),
            trees: Default::default(),
        }
    }

    /// The step schedule (before checkpointing and partitioning) of `c`'s precision
    /// and gradient residency at `batch`.
    pub fn schedule(&self, c: Combo, batch: u64) -> Result<Rc<Schedule>> {
        let key = (c.mixed, c.accumulate, batch);
        if let Some(s) = self.built.borrow().get(&key) {
            return Ok(s.clone());
        }
        let o = self.o;
        let b = Bindings {
            batch: Some(batch),
            dims: o.dims.clone(),
            routing: o.routing,
        };
        let mut topts = o.train.clone();
        if c.mixed {
            topts.precision = match o.train.precision {
                Precision::AmpBf16 | Precision::Bf16 => Precision::AmpBf16,
                _ => Precision::AmpFp16,
            };
        }
        topts.grads_resident = c.accumulate;
        let s = Rc::new(crate::step::schedule_of(self.model, &b, &topts)?);
        self.built.borrow_mut().insert(key, s.clone());
        Ok(s)
    }

    /// Per-GPU bytes at every step of combination `c` at `batch`, and the recompute
    /// FLOP fraction.
    pub fn peak_at(&self, c: Combo, batch: u64) -> Result<(Vec<u64>, f64)> {
        let r = self.realised(c, batch)?;
        Ok((
            match &r.0 {
                Realised::Schedule(s) => timeline(s),
                Realised::Plan { g, plan, .. } => crate::remat::modules::timeline(g, plan),
            },
            r.1,
        ))
    }

    /// Combination `c`'s step at `batch` replayed through the caching allocator on
    /// `d` (`Ok(None)`: it does not fit the device).
    pub fn device_at(
        &self,
        c: Combo,
        batch: u64,
        d: &DeviceModel,
    ) -> Result<Option<AllocatorReport>> {
        let d = &self.on_ranks(c, d);
        let key = (c, batch, d.capacity);
        if let Some(r) = self.replayed.borrow().get(&key) {
            return Ok(*r);
        }
        let r = match &self.realised(c, batch)?.0 {
            Realised::Schedule(s) => device::replay_schedule(s, d),
            Realised::Plan { g, plan, values } => {
                crate::remat::graph::replay_on_device(g, plan, values, d)
            }
        }
        .ok();
        self.replayed.borrow_mut().insert(key, r);
        Ok(r)
    }

    /// `d` on a rank of `c`: over several GPUs, NCCL's communicator for the group
    /// of all of them is held outside the allocator
    /// ([`device::nccl_communicator_bytes`]).
    fn on_ranks(&self, c: Combo, d: &DeviceModel) -> DeviceModel {
        let n = c.gpus(self.o.gpus);
        d.clone().on_groups(&[n])
    }

    /// Whether `c` fits at `batch` on the device (always, without one: the batch
    /// is then at most the live-bytes answer).
    fn fits_at(&self, c: Combo, batch: u64) -> Result<bool> {
        match &self.o.device {
            Some(d) => Ok(self.device_at(c, batch, d)?.is_some()),
            None => Ok(true),
        }
    }

    /// [`split_batch`] with micro-batches that fit the device: fitting is not
    /// monotone in the batch (docs/ALLOCATOR.md), so a micro-batch below `max_batch`
    /// is replayed too, and the split is redone below one that does not fit (at most
    /// [`MICRO_TRIES`] times; `None` when none of those fits).
    fn split_fitting(
        &self,
        c: Combo,
        target: u64,
        max_batch: u64,
        gpus: u64,
    ) -> Result<Option<(u64, u64)>> {
        let mut most = max_batch;
        for _ in 0..MICRO_TRIES {
            if most == 0 {
                break;
            }
            let (micro, k) = split_batch(target, most, gpus);
            if self.fits_at(c, micro)? {
                return Ok(Some((micro, k)));
            }
            most = micro - 1;
        }
        Ok(None)
    }

    /// A row's device figures at its batch (nothing without a device or a batch).
    fn set_device(&self, row: &mut StrategyFit, c: Combo) -> Result<()> {
        if let (Some(d), true) = (&self.o.device, row.max_batch > 0) {
            let r = self.device_at(c, row.max_batch, d)?;
            set_device_figures(row, &self.on_ranks(c, d), r);
        }
        Ok(())
    }

    /// [`Steps::realise`], kept for the next few calls.
    fn realised(&self, c: Combo, batch: u64) -> Result<Rc<RealisedStep>> {
        let key = (c, batch);
        if let Some((_, r)) = self.realised.borrow().iter().find(|(k, _)| *k == key) {
            return Ok(r.clone());
        }
        let r = Rc::new(self.realise(c, batch)?);
        let mut kept = self.realised.borrow_mut();
        if kept.len() == REALISED_KEPT {
            kept.remove(0);
        }
        kept.push((key, r.clone()));
        Ok(r)
    }

    /// The step of `c` at `batch` on one GPU: a schedule, or a plan over its graph;
    /// and the recompute FLOP fraction.
    fn realise(&self, c: Combo, batch: u64) -> Result<RealisedStep> {
        let base = self.replica_rank(c, self.schedule(c, batch)?, batch)?;
        let gpus = c.gpus(self.o.gpus);
        // The shared schedule as the combination's distribution leaves it on one GPU
        // (copied only when something is partitioned or added).
        let partitioned = || -> Rc<Schedule> {
            if c.dist == Dist::Single {
                return base.clone();
            }
            let mut s = (*base).clone();
            if matches!(c.dist, Dist::Fsdp { .. }) {
                let t = self.tree(
                    Combo {
                        dist: Dist::Single,
                        ..c
                    },
                    &base,
                );
                combo::partition_in(&mut s, c.dist, gpus, Some(&t));
            } else {
                partition(&mut s, c.dist, gpus);
            }
            Rc::new(s)
        };
        match c.ckpt {
            Ckpt::EveryBlock | Ckpt::EveryBlockSelective => {
                // The module set does not depend on the batch, so the plan's
                // instructions are the same at every batch and their live bytes are
                // affine in it.
                let s = partitioned();
                let g = crate::remat::from_schedule::from_schedule(&s, "fit");
                let t = self.tree(c, &s);
                let selective = c.ckpt == Ckpt::EveryBlockSelective;
                let p = crate::remat::modules::every_block_with(&g, &t, selective)
                    .map_err(Error::Graph)?;
                let cost = g.base_cost().max(1.0);
                let ov = p.recompute_cost / cost;
                Ok((
                    Realised::Plan {
                        g,
                        plan: p.plan,
                        values: device::StepValues::of(&s),
                    },
                    ov,
                ))
            }
            Ckpt::Blocks => blocks::realise(self.o, &partitioned()),
            Ckpt::Sqrt => {
                let flops = base.flops().max(1);
                let r = checkpoint_sqrt(&base, 0);
                let mut s = r.schedule;
                partition(&mut s, c.dist, gpus);
                Ok((
                    Realised::Schedule(Rc::new(s)),
                    r.recompute_flops as f64 / flops as f64,
                ))
            }
            Ckpt::None => Ok((Realised::Schedule(partitioned()), 0.0)),
        }
    }

    /// `c`'s largest per-GPU batch within the budget, its peak and overhead
    /// ([`max_batch`]), solved once. On a device, the combinations that differ from
    /// `c` only in how the GPUs share the state are solved with it, and each takes
    /// the largest of their answers that fits it ([`fit_device::family`],
    /// [`fit_device::settle`]).
    pub fn max_batch(&self, c: Combo) -> Result<(u64, u64, f64)> {
        if let Some(&r) = self.solved.borrow().get(&c) {
            return Ok(r);
        }
        let family = fit_device::family(self.o, c);
        let mut found = family
            .iter()
            .map(|&f| max_batch(self, f))
            .collect::<Result<Vec<_>>>()?;
        // Answers only rise, each at most to a sibling's: a few rounds settle them.
        for _ in 0..family.len() {
            let batches: Vec<u64> = found.iter().map(|a| a.0).collect();
            let mut moved = false;
            for (f, a) in family.iter().zip(found.iter_mut()) {
                let r = fit_device::settle(self, *f, *a, batches.iter().copied())?;
                moved |= r.0 != a.0;
                *a = r;
            }
            if !moved {
                break;
            }
        }
        let mut solved = self.solved.borrow_mut();
        for (&f, &r) in family.iter().zip(&found) {
            solved.insert(f, r);
        }
        Ok(solved.get(&c).copied().unwrap_or(found[0]))
    }

    /// [`traffic`] of `c` with `steps` micro-batches per optimizer step (under
    /// model parallelism, a rank's share of the replica's).
    pub fn traffic(&self, c: Combo, steps: u64) -> Result<Traffic> {
        let s = self.schedule(c, 1)?;
        let t = traffic(&s, c.dist, c.gpus(self.o.gpus), steps);
        let r = c.mp.ranks();
        Ok(Traffic {
            communication_bytes: t.communication_bytes.div_ceil(r),
            pcie_bytes: t.pcie_bytes.div_ceil(r),
            host_bytes: t.host_bytes.div_ceil(r),
        })
    }
}

/// Sets a row's reserved and device bytes from a replay at its batch.
fn set_device_figures(row: &mut StrategyFit, d: &DeviceModel, r: Option<AllocatorReport>) {
    if let Some(r) = r {
        row.reserved_bytes = Some(r.reserved_bytes);
        row.device_bytes = Some(d.device_bytes(&r));
    }
}

/// A combination's step on one GPU.
enum Realised {
    /// A schedule, run without recomputation.
    Schedule(Rc<Schedule>),
    /// A plan over a schedule's graph, and the schedule's values.
    Plan {
        g: crate::remat::graph::RematGraph,
        plan: Vec<crate::remat::graph::Instr>,
        values: device::StepValues,
    },
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

/// Total bytes at every step of a schedule.
fn timeline(s: &Schedule) -> Vec<u64> {
    simulate(s).timeline.iter().map(|b| b.total()).collect()
}

/// The largest batch that fits: its live tensor bytes within the budget and, on a
/// device, its allocations within what the allocator may reserve (0 if batch 1
/// does not fit); the peak and overhead there.
fn max_batch(steps: &Steps, c: Combo) -> Result<(u64, u64, f64)> {
    let o = steps.o;
    let (b, peak, ov) = live_max_batch(steps, c)?;
    match &o.device {
        Some(d) if b > 0 => {
            let at = |b: u64| steps.fits_at(c, b);
            let inf = fit_device::unlimited(d);
            let reserved = |b| -> Result<u64> {
                Ok(steps
                    .device_at(c, b, &inf)?
                    .map_or(u64::MAX, |r| r.reserved_bytes))
            };
            // Reserving no more than the capacity without a limit, the step fits
            // with one; above it, releasing the cache may still save it.
            let rb = reserved(b)?;
            if rb <= d.capacity || at(b)? {
                return Ok((b, peak, ov));
            }
            let guess = fit_device::guess(b, reserved(1)?, rb, d.capacity);
            let best = fit_device::largest_fitting(b, guess, at)?;
            let (t, ov) = steps.peak_at(c, best.max(1))?;
            Ok((best, t.into_iter().max().unwrap_or(0), ov))
        }
        _ => Ok((b, peak, ov)),
    }
}

/// The largest batch whose live tensor bytes stay within the budget (0 if batch 1's
/// do not), its peak and overhead.
fn live_max_batch(steps: &Steps, c: Combo) -> Result<(u64, u64, f64)> {
    let o = steps.o;
    let memory = o.budget();
    let (t1, ov) = steps.peak_at(c, 1)?;
    let peak1 = t1.iter().copied().max().unwrap_or(0);
    if peak1 > memory {
        return Ok((0, peak1, ov));
    }
    let (t2, _) = steps.peak_at(c, 2)?;
    let fits = |b: u64| -> Result<(bool, u64, f64)> {
        let (t, ov) = steps.peak_at(c, b)?;
        let p = t.iter().copied().max().unwrap_or(0);
        Ok((p <= memory, p, ov))
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
        if let Some(more) = (memory - a.min(memory)).checked_div(c) {
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
    let strategies = strategies(o);
    let moe_routing = routing_at_batch_1(model, o)?;
    let steps = Steps::new(model, o);
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

/// Every combination towards the target global batch `target`: the rows of those
/// that combine two or more strategies, the recommendation, or why none reaches it.
fn combine(
    steps: &Steps,
    o: &FitOptions,
    target: u64,
) -> Result<(Vec<StrategyFit>, Option<Recommendation>, Option<String>)> {
    let mut rows = Vec::new();
    let mut reach = Vec::new();
    // The largest global batch reached without accumulation, and the lowest batch-1
    // peak with it (what blocks accumulation when nothing reaches the target).
    let mut best_plain: (u64, String) = (0, String::new());
    let mut acc_block: Option<(u64, String)> = None;
    // Under a half-precision step, mixed precision repeats what was asked.
    let half = o.train.precision.half().is_some();
    for c0 in combo::combos(o.gpus)
        .into_iter()
        .filter(|c| !(half && c.mixed))
    {
        // Tensor and pipeline parallelism pay in time (all-reduces, the bubble), not
        // in FLOPs or data-parallel traffic: offered where the step is timed (a
        // card is given). Tensor parallelism needs Linear roles, pipelines enough
        // repeated blocks.
        if c0.mp != combo::Mp::NONE && (o.cluster.is_none() || !steps.takes(c0.mp)?) {
            continue;
        }
        let n = c0.gpus(o.gpus);
        let (mb0, peak0, ov0) = steps.max_batch(c0)?;
        let (c, mb, peak, ov, k, micro) =
            if mb0 * n >= target && steps.fits_at(c0, target.div_ceil(n))? {
                let micro = target.div_ceil(n);
                (c0, mb0, peak0, ov0, 1, micro)
            } else {
                if mb0 * n > best_plain.0 {
                    best_plain = (mb0 * n, c0.name());
                }
                let c = Combo {
                    accumulate: true,
                    ..c0
                };
                let (mb, peak, ov) = steps.max_batch(c)?;
                if mb == 0 {
                    if acc_block.as_ref().is_none_or(|(p, _)| peak < *p) {
                        acc_block = Some((peak, c.name()));
                    }
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
                note: if mb == 0 {
                    "does not fit batch 1".into()
                } else if k == 0 {
                    "no micro-batch split for the target fits the device".into()
                } else {
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
                },
                planner: None,
                lower_bound_overhead: None,
                recomputed_tensors: None,
                combines: Some(c.names()),
                communication_bytes: None,
                pcie_bytes: None,
                host_bytes: None,
                pcie_seconds: None,
                reserved_bytes: None,
                device_bytes: None,
                step_seconds: time.map(|t| t.total_s),
                same_as: None,
            };
            steps.set_device(&mut row, c)?;
            if c.dist != Dist::Single {
                set_traffic(&mut row, Some(tr));
            }
            rows.push(row);
        }
        if mb > 0 && k > 0 {
            // Its peak at the micro-batch it would run (the schedule at that batch is
            // shared by every combination of the same precision and accumulation).
            let at_micro = steps.peak_at(c, micro)?.0.into_iter().max().unwrap_or(0);
            reach.push(combo::Candidate {
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
