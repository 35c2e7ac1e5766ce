//! [`Steps`]: the step of each combination, built once and shared, and each
//! combination's largest batch. Families of combinations are solved side by side
//! on the machine's cores ([`Steps::solve`]); the caches are shared between them.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use rayon::prelude::*;

use super::{
    blocks, combo, fit_device, partition, set_device_figures, split_batch, traffic, Ckpt, Combo,
    Dist, FitOptions, StrategyFit, Traffic,
};
use crate::error::{Error, Result};
use crate::infer::{Bindings, MAX_BATCH};
use crate::ir::Model;
use crate::memory::device::{self, AllocatorReport, DeviceModel};
use crate::memory::simulate;
use crate::remat::checkpoint_sqrt;
use crate::remat::modules::ModuleTree;
use crate::train::{Precision, Schedule};

/// Locks `m` (a panic elsewhere has already failed the run).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Values built once per key, even when several threads ask for one at once (the
/// others wait for it); a failed build is not kept.
pub(super) struct Once<K, V>(Mutex<HashMap<K, Arc<Mutex<Option<V>>>>>);

impl<K, V> Default for Once<K, V> {
    fn default() -> Self {
        Once(Mutex::new(HashMap::new()))
    }
}

impl<K: Eq + Hash, V: Clone> Once<K, V> {
    /// The value of `k`, built by `f` the first time.
    pub(super) fn get(&self, k: K, f: impl FnOnce() -> Result<V>) -> Result<V> {
        let cell = lock(&self.0).entry(k).or_default().clone();
        let mut slot = lock(&cell);
        if let Some(v) = &*slot {
            return Ok(v.clone());
        }
        let v = f()?;
        *slot = Some(v.clone());
        Ok(v)
    }
}

/// A replica rank's step: model parallelism, mixed precision, accumulation, batch.
type RankKey = (combo::Mp, bool, bool, u64);

/// Schedules of the step by precision, gradient residency and batch, built once
/// each and shared by every combination; and each combination's largest batch.
pub struct Steps<'a> {
    pub(super) model: &'a Model,
    pub(super) o: &'a FitOptions,
    built: Once<(bool, bool, u64), Arc<Schedule>>,
    solved: Mutex<HashMap<Combo, (u64, u64, f64)>>,
    /// Allocator replays by combination, batch and capacity.
    replayed: Mutex<HashMap<(Combo, u64, u64), Option<AllocatorReport>>>,
    /// The steps each thread realised last (a few: a batch's peak and its replays
    /// come together), newest last.
    realised: Mutex<Vec<(ThreadId, StepKey, Arc<RealisedStep>)>>,
    /// The worst rank's schedule by model parallelism, precision, accumulation and
    /// batch (shared by the ways over the data-parallel ranks).
    pub(super) ranked: Once<RankKey, Arc<Schedule>>,
    /// Module trees by what shapes the steps (not the batch), and step count.
    pub(super) trees: Once<TreeKey, Arc<ModuleTree>>,
    /// [`Steps::peak_at`]'s answers.
    timelines: Mutex<HashMap<StepKey, (Vec<u64>, f64)>>,
    /// The sqrt(n)-checkpointed step and its recompute fraction, by what it is
    /// made from (the rank's step at a batch), shared by the ways over the GPUs.
    sqrt: Once<RankKey, (Arc<Schedule>, f64)>,
}

/// What a module tree depends on: precision, accumulation, model parallelism, the
/// way over the GPUs (FSDP adds steps) and a hash of the steps' names.
pub(super) type TreeKey = (bool, bool, combo::Mp, Dist, u64);

/// A combination at a batch.
type StepKey = (Combo, u64);
/// A realised step and its recompute FLOP fraction.
pub(super) type RealisedStep = (Realised, f64);

/// Micro-batch splits [`Steps::split_fitting`] tries.
const MICRO_TRIES: usize = 16;

/// Steps [`Steps::realise`] keeps per thread.
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
            timelines: Default::default(),
            sqrt: Default::default(),
        }
    }

    /// The step schedule (before checkpointing and partitioning) of `c`'s precision
    /// and gradient residency at `batch`.
    pub fn schedule(&self, c: Combo, batch: u64) -> Result<Arc<Schedule>> {
        let key = (c.mixed, c.accumulate, batch);
        self.built.get(key, || self.build(c, batch))
    }

    /// [`Steps::schedule`], built.
    fn build(&self, c: Combo, batch: u64) -> Result<Arc<Schedule>> {
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
        Ok(Arc::new(crate::step::schedule_of(self.model, &b, &topts)?))
    }

    /// Per-GPU bytes at every step of combination `c` at `batch`, and the recompute
    /// FLOP fraction.
    pub fn peak_at(&self, c: Combo, batch: u64) -> Result<(Vec<u64>, f64)> {
        if let Some(t) = lock(&self.timelines).get(&(c, batch)) {
            return Ok(t.clone());
        }
        let r = self.realised(c, batch)?;
        let t = (
            match &r.0 {
                Realised::Schedule(s) => timeline(s),
                Realised::Plan { g, plan, .. } => crate::remat::modules::timeline(g, plan),
            },
            r.1,
        );
        lock(&self.timelines).insert((c, batch), t.clone());
        Ok(t)
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
        if let Some(r) = lock(&self.replayed).get(&key) {
            return Ok(*r);
        }
        let r = match &self.realised(c, batch)?.0 {
            Realised::Schedule(s) => device::replay_schedule(s, d),
            Realised::Plan { g, plan, values } => {
                crate::remat::graph::replay_on_device(g, plan, values, d)
            }
        }
        .ok();
        lock(&self.replayed).insert(key, r);
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
    pub(super) fn fits_at(&self, c: Combo, batch: u64) -> Result<bool> {
        match &self.o.device {
            Some(d) => Ok(self.device_at(c, batch, d)?.is_some()),
            None => Ok(true),
        }
    }

    /// [`split_batch`] with micro-batches that fit the device: fitting is not
    /// monotone in the batch (docs/ALLOCATOR.md), so a micro-batch below `max_batch`
    /// is replayed too, and the split is redone below one that does not fit (at most
    /// [`MICRO_TRIES`] times; `None` when none of those fits).
    pub(super) fn split_fitting(
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
    pub(super) fn set_device(&self, row: &mut StrategyFit, c: Combo) -> Result<()> {
        if let (Some(d), true) = (&self.o.device, row.max_batch > 0) {
            let r = self.device_at(c, row.max_batch, d)?;
            set_device_figures(row, &self.on_ranks(c, d), r);
        }
        Ok(())
    }

    /// [`Steps::realise`], kept for the next few calls.
    fn realised(&self, c: Combo, batch: u64) -> Result<Arc<RealisedStep>> {
        let key = (c, batch);
        let me = std::thread::current().id();
        let found = lock(&self.realised)
            .iter()
            .find(|(t, k, _)| *t == me && *k == key)
            .map(|(_, _, r)| r.clone());
        if let Some(r) = found {
            return Ok(r);
        }
        let r = Arc::new(self.realise(c, batch)?);
        let mut kept = lock(&self.realised);
        if kept.iter().filter(|(t, _, _)| *t == me).count() >= REALISED_KEPT {
            let oldest = kept.iter().position(|(t, _, _)| *t == me);
            kept.remove(oldest.expect("one of this thread's"));
        }
        kept.push((me, key, r.clone()));
        Ok(r)
    }

    /// The step of `c` at `batch` on one GPU: a schedule, or a plan over its graph;
    /// and the recompute FLOP fraction.
    fn realise(&self, c: Combo, batch: u64) -> Result<RealisedStep> {
        let base = self.replica_rank(c, self.schedule(c, batch)?, batch)?;
        let gpus = c.gpus(self.o.gpus);
        // The shared schedule as the combination's distribution leaves it on one GPU
        // (copied only when something is partitioned or added).
        let partitioned = || -> Arc<Schedule> {
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
            Arc::new(s)
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
                // The same checkpointed step for every way over the GPUs.
                let key = (c.mp, c.mixed, c.accumulate, batch);
                let (sqrt, ov) = self.sqrt.get(key, || {
                    let flops = base.flops().max(1);
                    let r = checkpoint_sqrt(&base, 0);
                    let ov = r.recompute_flops as f64 / flops as f64;
                    Ok((Arc::new(r.schedule), ov))
                })?;
                let mut s = (*sqrt).clone();
                partition(&mut s, c.dist, gpus);
                Ok((Realised::Schedule(Arc::new(s)), ov))
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
        if let Some(&r) = lock(&self.solved).get(&c) {
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
        let mut solved = lock(&self.solved);
        for (&f, &r) in family.iter().zip(&found) {
            solved.insert(f, r);
        }
        Ok(solved.get(&c).copied().unwrap_or(found[0]))
    }

    /// [`Steps::max_batch`] of every combination in `cs`, their families solved side
    /// by side on the machine's cores.
    pub(super) fn solve(&self, cs: &[Combo]) -> Result<()> {
        let mut heads: Vec<Combo> = Vec::new();
        for &c in cs {
            let f = fit_device::family(self.o, c);
            if !heads.iter().any(|h| f.contains(h)) {
                heads.push(c);
            }
        }
        // Every family runs; the first failure in order is the one reported, whatever
        // the threads' timing. A thread's realised steps go with its family.
        let done: Vec<Result<()>> = heads
            .into_par_iter()
            .map(|c| {
                let r = self.max_batch(c).map(|_| ());
                self.forget_realised();
                r
            })
            .collect();
        done.into_iter().collect()
    }

    /// Drops the steps this thread realised (its family is solved).
    pub(super) fn forget_realised(&self) {
        let me = std::thread::current().id();
        lock(&self.realised).retain(|(t, _, _)| *t != me);
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

/// A combination's step on one GPU.
pub(super) enum Realised {
    /// A schedule, run without recomputation.
    Schedule(Arc<Schedule>),
    /// A plan over a schedule's graph, and the schedule's values.
    Plan {
        g: crate::remat::graph::RematGraph,
        plan: Vec<crate::remat::graph::Instr>,
        values: device::StepValues,
    },
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
