//! `fit` on the device total: a batch fits a GPU when the step's allocations,
//! replayed through PyTorch's caching allocator ([`crate::memory::device`]), stay
//! within what the allocator may reserve there (the memory less `--headroom` and
//! the CUDA context), which is what decides "CUDA out of memory". The live tensor
//! bytes give an upper bound first (reserved memory is never less than allocated);
//! the largest batch the allocator fits is then searched below it, from a guess on
//! the line through the reserved bytes at batch 1 and at that bound.

use super::planned::report_of;
use super::{Ckpt, Combo, Dist, FitOptions, Fragmentation, PlannedFit, Steps, StrategyFit};
use crate::error::Result;
use crate::infer::{Bindings, MAX_BATCH};
use crate::ir::Model;
use crate::memory::device::{self, AllocatorReport, DeviceModel};
use crate::remat::bounds::stage_lower_bound;
use crate::remat::dtr::unrecompute;
use crate::remat::graph::{replay, replay_on_device, Instr, RematGraph};
use crate::remat::plan::{plan, Solver};

/// The largest batch below `up`, a batch that does not fit, for which `fits` holds
/// (0 if none), assuming it holds up to some batch and not above: `guess` first,
/// then down from it in doubling steps when it does not fit, then bisection.
pub(super) fn largest_fitting(
    up: u64,
    guess: u64,
    mut fits: impl FnMut(u64) -> Result<bool>,
) -> Result<u64> {
    // lo fits (0: none known), up does not.
    let (mut lo, mut up) = (0u64, up);
    if up <= 1 {
        return Ok(0);
    }
    let g = guess.clamp(1, up - 1);
    if fits(g)? {
        lo = g;
    } else {
        up = g;
        let mut step = 1;
        while up > step {
            let t = up - step;
            if fits(t)? {
                lo = t;
                break;
            }
            up = t;
            step *= 2;
        }
    }
    while up - lo > 1 {
        let mid = lo + (up - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            up = mid;
        }
    }
    Ok(lo)
}

/// Where the reserved bytes, on the line through `(1, r1)` and `(hi, rh)`, reach
/// `capacity`.
pub(super) fn guess(hi: u64, r1: u64, rh: u64, capacity: u64) -> u64 {
    if hi <= 1 || rh <= r1 || capacity <= r1 {
        return 1;
    }
    let slope = (rh - r1) as f64 / (hi - 1) as f64;
    (1.0 + (capacity - r1) as f64 / slope).floor() as u64
}

/// `plan` (which fits `d`) with as many of its re-runs taken back
/// ([`unrecompute`]) as keep its allocations within `d`: the live budget given to
/// `unrecompute` is bisected between the plan's peak and the allocator's capacity
/// (fitting is not monotone in it, so the cheapest plan that fits among those tried
/// is kept). Returns the plan and its replay (`plan` itself when no cheaper
/// take-back fits; `None` as its replay when `plan` does not fit `d` either).
fn take_back(
    g: &RematGraph,
    plan: &[Instr],
    values: &device::StepValues,
    d: &DeviceModel,
) -> (Vec<Instr>, Option<AllocatorReport>) {
    let cost = |p: &[Instr]| recompute_cost(g, p);
    let Ok(r) = replay(g, plan) else {
        return (plan.to_vec(), None);
    };
    let (mut lo, mut hi) = (r.peak_bytes, d.capacity);
    let given = replay_on_device(g, plan, values, d).ok();
    let mut best: (Vec<Instr>, Option<AllocatorReport>, f64) = (plan.to_vec(), given, cost(plan));
    for _ in 0..TAKE_BACK_PROBES {
        if hi <= lo {
            break;
        }
        let mid = lo + (hi - lo).div_ceil(2);
        let t = unrecompute(g, plan, mid);
        match replay_on_device(g, &t, values, d) {
            Ok(rt) => {
                let c = cost(&t);
                if c < best.2 {
                    best = (t, Some(rt), c);
                }
                lo = mid;
            }
            Err(_) => hi = mid - 1,
        }
    }
    (best.0, best.1)
}

/// What `plan` recomputes on `g` (infinite for a plan that does not replay).
fn recompute_cost(g: &RematGraph, plan: &[Instr]) -> f64 {
    replay(g, plan).map_or(f64::INFINITY, |r| r.recompute_cost)
}

/// Live budgets [`take_back`] tries.
const TAKE_BACK_PROBES: usize = 12;

/// The ILP's plans for `g` at live budgets up to the allocator's capacity, the
/// cheapest whose allocations fit `d` returned if it is cheaper than `plan` (which
/// fits), with its replay and method. Budgets run from `plan`'s live peak to the
/// capacity, [`REPLAN_WIDTH`] planned side by side in each of [`REPLAN_ROUNDS`]
/// rounds (each plan is a search of its own, so two cores take a round in the time
/// of one plan). The first round tries the budget that leaves the allocator the
/// room `plan` needed above its live peak (its reserved less its peak) and the one
/// halfway from there to the capacity. Later rounds split the range between the
/// highest budget whose plan fitted and the lowest above it whose plan did not
/// (at first the capacity); while none has fitted they step down from the lowest
/// that failed by what its plan reserved too much (replayed without a limit).
/// Fitting is not monotone in the budget (which holes a tensor finds changes with
/// every plan): the cheapest plan that fits among those made is kept.
fn replan(
    g: &RematGraph,
    plan: &[Instr],
    values: &device::StepValues,
    d: &DeviceModel,
    time_limit_s: f64,
) -> Result<Option<(Vec<Instr>, AllocatorReport, String)>> {
    use rayon::prelude::*;
    let cost = |p: &[Instr]| recompute_cost(g, p);
    let on = |p: &[Instr], d: &DeviceModel| replay_on_device(g, p, values, d);
    let (Ok(r), Ok(rd)) = (replay(g, plan), on(plan, d)) else {
        return Ok(None);
    };
    if d.capacity == u64::MAX {
        return Ok(None);
    }
    let floor = r.peak_bytes;
    let first = d
        .capacity
        .saturating_sub(rd.reserved_bytes.saturating_sub(r.peak_bytes))
        .max(floor)
        .min(d.capacity);
    let mut budgets = vec![first, first + (d.capacity + 1 - first) / 2];
    let mut best_cost = cost(plan);
    let mut best = None;
    let inf = unlimited(d);
    let mut tried: Vec<u64> = Vec::new();
    // The highest budget whose plan fitted; each failed budget with what its plan
    // reserved beyond the capacity.
    let mut fits: Option<u64> = None;
    let mut failed: Vec<(u64, u64)> = Vec::new();
    let close = (d.capacity / 200).max(1);
    for round in 0..REPLAN_ROUNDS {
        let last_round = round + 1 == REPLAN_ROUNDS;
        budgets.retain(|b| !tried.contains(b));
        budgets.dedup();
        if budgets.is_empty() {
            break;
        }
        tried.extend(&budgets);
        let made = budgets
            .par_iter()
            .map(|&at| -> Result<_> {
                let q = crate::remat::plan::plan(g, at, Solver::Ilp, time_limit_s)?;
                // What decides is the device: a plan over its live budget (a solve
                // cut short) that still fits is as good as any.
                let fit = on(&q.plan, d).ok();
                // How far to step down next round (not needed after the last).
                let over = match fit {
                    None if !last_round => {
                        on(&q.plan, &inf).map_or(0, |u| u.reserved_bytes.saturating_sub(d.capacity))
                    }
                    _ => 0,
                };
                Ok((at, q, fit, over))
            })
            .collect::<Result<Vec<_>>>()?;
        for (at, q, fit, over) in made {
            if std::env::var_os("MEMPLAN_DEBUG").is_some() {
                eprintln!(
                    "fit: planned again at live budget {at}: {} peak {} overhead {:.4}, {}",
                    q.method,
                    q.peak_bytes,
                    cost(&q.plan) / g.base_cost().max(f64::MIN_POSITIVE),
                    if fit.is_some() {
                        "fits"
                    } else {
                        "does not fit"
                    }
                );
            }
            match fit {
                Some(rq) => {
                    let c = cost(&q.plan);
                    if c < best_cost {
                        best_cost = c;
                        best = Some((q.plan, rq, format!("{}, planned at this batch", q.method)));
                    }
                    fits = fits.max(Some(at));
                }
                None => failed.push((at, over.max(close))),
            }
        }
        // The next round's budgets.
        budgets = match fits {
            Some(ok) => {
                let above = failed
                    .iter()
                    .map(|f| f.0)
                    .filter(|&f| f > ok)
                    .min()
                    .unwrap_or(d.capacity + 1);
                if above - ok < close {
                    break;
                }
                let step = (above - ok) / (REPLAN_WIDTH as u64 + 1);
                (1..=REPLAN_WIDTH as u64).map(|k| ok + k * step).collect()
            }
            None => {
                let &(low, over) = failed.iter().min().expect("a budget was tried");
                (1..=REPLAN_WIDTH as u64)
                    .map(|k| low.saturating_sub(over.saturating_mul(k)).max(floor))
                    .collect()
            }
        };
    }
    Ok(best)
}

/// Rounds of [`replan`].
const REPLAN_ROUNDS: usize = 2;

/// Live budgets [`replan`] plans for side by side in each round.
const REPLAN_WIDTH: usize = 2;

/// The share of `fit --time-limit` each of [`replan`]'s plans gets (1 s of the
/// default 10 s). The portfolio's simulation gets a fifth of it, and its plans
/// stop improving near there: ResNet-50 at batch 718 (16 GiB, Adam) costs
/// +38.9 % with half a second, +34.7 % with 1 s and +34.6 % with 4 s.
const REPLAN_SHARE: f64 = 0.1;

/// The strategy whose allocations fragment the default allocator most at its max
/// batch (reserved bytes over its live tensor bytes), where that excess is at least
/// [`FRAGMENTATION_HINT`] of what the allocator may reserve: what PyTorch's
/// expandable segments would mostly give back. `None` with expandable segments, on
/// live bytes alone, or below the threshold. Combinations are left out (their rows
/// repeat the single strategies').
pub fn fragmentation(rows: &[StrategyFit], d: &DeviceModel) -> Option<Fragmentation> {
    if d.conf.expandable_segments || d.capacity == u64::MAX || d.capacity == 0 {
        return None;
    }
    rows.iter()
        .filter(|r| r.combines.is_none() && r.max_batch > 0)
        .filter_map(|r| {
            let excess = r.reserved_bytes?.saturating_sub(r.peak_bytes);
            Some(Fragmentation {
                strategy: r.name.clone(),
                max_batch: r.max_batch,
                excess_bytes: excess,
                fraction_of_capacity: excess as f64 / d.capacity as f64,
            })
        })
        .filter(|f| f.fraction_of_capacity >= FRAGMENTATION_HINT)
        .max_by_key(|f| f.excess_bytes)
}

/// Reserved-over-live excess, as a share of the allocator's capacity, from which
/// `fit` points at expandable segments.
pub const FRAGMENTATION_HINT: f64 = 0.1;

/// The combinations solved together with `c` on a device: `c` with each way of
/// sharing the state over the GPUs that `fit` reports (one GPU, and with several
/// DDP and ZeRO 1 to 3; the two offloads always). Only `c` itself without a device,
/// with gradient accumulation, with model parallelism, for mixed precision under a
/// half-precision step, or, without a target batch, where only one GPU's row is
/// reported (mixed precision or checkpointing alone).
pub(super) fn family(o: &FitOptions, c: Combo) -> Vec<Combo> {
    // Under a half-precision step the target's combinations leave mixed precision out
    // (it repeats what was asked): its row is solved alone.
    let rows_only = (o.target_batch.is_none() && (c.mixed || c.ckpt != Ckpt::None))
        || (c.mixed && o.train.precision.half().is_some());
    // Model-parallel rows come with one way over their data-parallel ranks.
    let model_parallel = c.mp != super::combo::Mp::NONE;
    if o.device.is_none() || c.accumulate || rows_only || model_parallel {
        return vec![c];
    }
    let mut dists = super::combo::dists(o.gpus);
    if !dists.contains(&Dist::Single) {
        dists.push(Dist::Single);
    }
    if !dists.contains(&c.dist) {
        return vec![c];
    }
    dists.into_iter().map(|dist| Combo { dist, ..c }).collect()
}

/// `c`'s answer `(batch, peak, overhead)`, found alone by bisection, against its
/// family's: fitting is not monotone in the batch, so a bisection ends at *a* batch
/// that fits with the next one not fitting, and the family's bisections may stop at
/// different holes (ResNet-50 on 24 GiB with 8 GPUs: every-block alone 674, with DDP,
/// which holds more, 699). The largest of the others' batches that fits `c` is
/// taken instead when above `c`'s own, then the next batches while they fit (at
/// most [`SETTLE_CLIMB`] of them; within that the answer still ends at a batch whose
/// next does not fit). [`Steps::max_batch`] repeats this over the family until no
/// answer moves.
pub(super) fn settle(
    steps: &Steps,
    c: Combo,
    found: (u64, u64, f64),
    others: impl Iterator<Item = u64>,
) -> Result<(u64, u64, f64)> {
    let b = found.0;
    if b == 0 {
        return Ok(found);
    }
    let mut above: Vec<u64> = others.filter(|&o| o > b).collect();
    above.sort_unstable_by(|x, y| y.cmp(x));
    above.dedup();
    let mut best = b;
    for k in above {
        if steps.fits_at(c, k)? {
            best = k;
            break;
        }
    }
    if best == b {
        return Ok(found);
    }
    for _ in 0..SETTLE_CLIMB {
        if best >= MAX_BATCH || !steps.fits_at(c, best + 1)? {
            break;
        }
        best += 1;
    }
    let (t, ov) = steps.peak_at(c, best)?;
    Ok((best, t.into_iter().max().unwrap_or(0), ov))
}

/// Batches [`settle`] climbs past a sibling's answer at most.
const SETTLE_CLIMB: usize = 256;

/// `d` without a memory limit (to measure reserved bytes rather than fit them).
pub(super) fn unlimited(d: &DeviceModel) -> DeviceModel {
    DeviceModel {
        capacity: u64::MAX,
        ..d.clone()
    }
}

/// The planned row on the device: the plan found for the live bytes, replayed at
/// its batch and below (a plan's instructions hold at any batch), down to the
/// largest batch whose allocations fit `d`. There, the re-runs that batch affords
/// are taken back ([`take_back`]) and the ILP plans it again for live budgets up to
/// the allocator's capacity ([`replan`]); the cheapest plan that fits is reported.
/// Updates the row's batch, peak, overhead and plan; returns the allocator's
/// figures there.
pub(super) fn confirm_planned(
    model: &Model,
    o: &FitOptions,
    d: &DeviceModel,
    p: &mut PlannedFit,
) -> Result<Option<AllocatorReport>> {
    if p.max_batch == 0 {
        return Ok(None);
    }
    let found = p.report.plan.clone();
    // The plan at another batch; where the step's structure differs (batch 1 may
    // need no layout copy of a single matrix), greedy's plan for that batch.
    let at = |b: u64, d: &DeviceModel| -> Result<_> {
        let bind = Bindings {
            batch: Some(b),
            dims: o.dims.clone(),
            routing: o.routing,
        };
        let step = crate::step::build(model, &bind, &o.train, "fit")?;
        let plan = match replay(&step.graph, &found) {
            Ok(_) => found.clone(),
            Err(_) => plan(&step.graph, d.capacity, Solver::Greedy, o.plan_time_limit_s)?.plan,
        };
        let values = device::StepValues::of(&step.schedule);
        let r = replay_on_device(&step.graph, &plan, &values, d).ok();
        Ok((step.graph, plan, r, values))
    };
    let hi = p.max_batch;
    let top = at(hi, d)?;
    let (best, (graph, plan, r, values)) = if top.2.is_some() {
        (hi, top)
    } else {
        let inf = unlimited(d);
        let reserved =
            |b| -> Result<u64> { Ok(at(b, &inf)?.2.map_or(u64::MAX, |r| r.reserved_bytes)) };
        let g = guess(hi, reserved(1)?, reserved(hi)?, d.capacity);
        let best = largest_fitting(hi, g, |b| Ok(at(b, d)?.2.is_some()))?;
        // The report at the answer (at batch 1 when nothing fits: the lowest
        // reachable peak there), budgeted at what the allocator may reserve.
        (best, at(best.max(1), d)?)
    };
    p.max_batch = best;
    let (mut solver, mut method) = if plan == found {
        (p.report.solver, p.report.method.clone())
    } else {
        (
            Solver::Greedy,
            "greedy at the allocator's capacity".to_string(),
        )
    };
    let (mut plan, mut r) = (plan, r);
    if best > 0 && r.is_some() {
        // The plan was made for a larger batch: take back the re-runs this batch
        // can afford while its allocations still fit.
        let (taken, rt) = take_back(&graph, &plan, &values, d);
        if taken != plan {
            method.push_str(", re-runs taken back at this batch");
            (plan, r) = (taken, rt);
        }
        // Planned again for this batch, at live budgets between the plan's peak
        // and the allocator's capacity: a plan made for it recomputes less.
        let limit = o.plan_time_limit_s * REPLAN_SHARE;
        if let Some((q, rq, m)) = replan(&graph, &plan, &values, d, limit)? {
            (plan, r, solver, method) = (q, Some(rq), Solver::Ilp, m);
        }
    }
    p.report = report_of(&graph, &plan, solver, method, d.capacity)?;
    let base = graph.base_cost().max(f64::MIN_POSITIVE);
    p.lower_bound_overhead = stage_lower_bound(&graph, d.capacity).unwrap_or(0.0) / base;
    p.report.lower_bound_overhead = p.lower_bound_overhead;
    if best == 0 {
        return Ok(None);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_fitting_finds_the_edge_from_any_guess() {
        for k in [0u64, 1, 2, 7, 50, 99] {
            for guess in [0, 1, 3, 49, 50, 51, 98, 200] {
                let mut probes = 0;
                let got = largest_fitting(100, guess, |b| {
                    probes += 1;
                    Ok(b <= k)
                })
                .unwrap();
                assert_eq!(got, k, "k {k} guess {guess}");
                assert!(probes <= 16, "k {k} guess {guess}: {probes} probes");
            }
        }
        assert_eq!(guess(100, 10, 109, 60), 51);
        assert_eq!(guess(1, 10, 10, 60), 1);
    }

    fn row(name: &str, max_batch: u64, peak: u64, reserved: u64) -> StrategyFit {
        StrategyFit {
            name: name.into(),
            max_batch,
            peak_bytes: peak,
            overhead: 0.0,
            global_batch: None,
            accumulation_steps: None,
            note: String::new(),
            planner: None,
            lower_bound_overhead: None,
            recomputed_tensors: None,
            combines: None,
            communication_bytes: None,
            pcie_bytes: None,
            host_bytes: None,
            pcie_seconds: None,
            reserved_bytes: Some(reserved),
            device_bytes: None,
            ..Default::default()
        }
    }

    /// The largest reserved-over-live excess is named, from a tenth of the
    /// capacity on, never for combinations, rows that fit nothing, or expandable
    /// segments.
    #[test]
    fn fragmentation_names_the_worst_row_past_a_tenth() {
        use crate::memory::allocator::AllocConf;
        let d = DeviceModel::new(AllocConf::default(), None, Some(0)).with_memory(1000, 0);
        assert_eq!(d.capacity, 1000);
        let mut rows = vec![
            row("a", 10, 900, 990),
            row("b", 20, 700, 850),
            row("c", 0, 100, 900),
        ];
        let f = fragmentation(&rows, &d).unwrap();
        assert_eq!(
            (f.strategy.as_str(), f.max_batch, f.excess_bytes),
            ("b", 20, 150)
        );
        assert!((f.fraction_of_capacity - 0.15).abs() < 1e-12);
        rows[1].combines = Some(vec!["b".into(), "zero-1".into()]);
        assert!(
            fragmentation(&rows, &d).is_none(),
            "a: 90 of 1000, under a tenth"
        );
        rows[0].reserved_bytes = Some(1000);
        assert_eq!(fragmentation(&rows, &d).unwrap().strategy, "a");
        let mut e = d.clone();
        e.conf.expandable_segments = true;
        assert!(fragmentation(&rows, &e).is_none());
    }

    /// A plan made for a tight budget, on a device with room: the take-back keeps
    /// a plan that fits, costs less, and is never costlier than the plan given.
    #[test]
    fn take_back_and_replan_return_cheaper_plans_that_fit() {
        use crate::memory::allocator::AllocConf;
        use crate::memory::device::Gpu;
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/resnet18.onnx");
        let model = crate::onnx::load_model(&path).unwrap();
        let bind = Bindings {
            batch: Some(8),
            ..Default::default()
        };
        let step = crate::step::build(&model, &bind, &Default::default(), "t").unwrap();
        let g = &step.graph;
        let values = device::StepValues::of(&step.schedule);
        let base = g.baseline_peak().unwrap();
        let tight = plan(g, base / 2, Solver::Greedy, 5.0).unwrap();
        let cost = |p: &[Instr]| replay(g, p).unwrap().recompute_cost;
        assert!(cost(&tight.plan) > 0.0);
        let unlimited = DeviceModel::new(AllocConf::default(), Gpu::named("t4").ok(), Some(0));
        let reserved = replay_on_device(g, &tight.plan, &values, &unlimited)
            .unwrap()
            .reserved_bytes;
        for room in [0u64, reserved / 4, reserved] {
            let d = DeviceModel {
                capacity: reserved + room,
                ..unlimited.clone()
            };
            let (t, r) = take_back(g, &tight.plan, &values, &d);
            let r = r.expect("the plan given fits, so a plan is kept");
            assert!(r.reserved_bytes <= d.capacity);
            assert!(replay_on_device(g, &t, &values, &d).is_ok());
            assert!(cost(&t) <= cost(&tight.plan));
            if room == reserved {
                assert!(
                    cost(&t) < cost(&tight.plan),
                    "twice the room takes re-runs back"
                );
            }
            // Planned again: with room, a plan made for it recomputes less than
            // greedy's for half the peak; whatever is returned is cheaper and fits.
            let again = replan(g, &tight.plan, &values, &d, 2.0).unwrap();
            if let Some((q, rq, method)) = &again {
                assert!(cost(q) < cost(&tight.plan), "{method}");
                assert!(rq.reserved_bytes <= d.capacity);
                assert!(replay_on_device(g, q, &values, &d).is_ok());
                assert!(method.ends_with("planned at this batch"));
            }
            assert!(room == 0 || again.is_some(), "room {room}");
        }
    }
}
