//! `fit` on the device total: a batch fits a GPU when the step's allocations,
//! replayed through PyTorch's caching allocator ([`crate::memory::device`]), stay
//! within what the allocator may reserve there (the memory less `--headroom` and
//! the CUDA context), which is what decides "CUDA out of memory". The live tensor
//! bytes give an upper bound first (reserved memory is never less than allocated);
//! the largest batch the allocator fits is then searched below it, from a guess on
//! the line through the reserved bytes at batch 1 and at that bound.

use super::planned::report_of;
use super::{FitOptions, PlannedFit};
use crate::error::Result;
use crate::infer::Bindings;
use crate::ir::Model;
use crate::memory::device::{self, AllocatorReport, DeviceModel};
use crate::remat::bounds::stage_lower_bound;
use crate::remat::graph::replay;
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

/// `d` without a memory limit (to measure reserved bytes rather than fit them).
pub(super) fn unlimited(d: &DeviceModel) -> DeviceModel {
    DeviceModel {
        capacity: u64::MAX,
        ..d.clone()
    }
}

/// The planned row on the device: the plan found for the live bytes, replayed at
/// its batch and below (a plan's instructions hold at any batch), down to the
/// largest batch whose allocations fit `d`. Updates the row's batch, peak and
/// overhead; returns the allocator's figures there.
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
        };
        let step = crate::remat::step::build(model, &bind, &o.train, "fit")?;
        let plan = match replay(&step.graph, &found) {
            Ok(_) => found.clone(),
            Err(_) => plan(&step.graph, d.capacity, Solver::Greedy, o.plan_time_limit_s)?.plan,
        };
        let r = crate::remat::graph::replay_on_device(
            &step.graph,
            &plan,
            &device::StepValues::of(&step.schedule),
            d,
        )
        .ok();
        Ok((step.graph, plan, r))
    };
    let hi = p.max_batch;
    let r = at(hi, d)?.2;
    if r.is_some() {
        return Ok(r);
    }
    let inf = unlimited(d);
    let reserved = |b| -> Result<u64> { Ok(at(b, &inf)?.2.map_or(u64::MAX, |r| r.reserved_bytes)) };
    let g = guess(hi, reserved(1)?, reserved(hi)?, d.capacity);
    let best = largest_fitting(hi, g, |b| Ok(at(b, d)?.2.is_some()))?;
    p.max_batch = best;
    // The report at the answer (at batch 1 when nothing fits: the lowest reachable
    // peak there), budgeted at what the allocator may reserve.
    let (graph, plan, r) = at(best.max(1), d)?;
    let (solver, method) = if plan == found {
        (p.report.solver, p.report.method.clone())
    } else {
        (
            Solver::Greedy,
            "greedy at the allocator's capacity".to_string(),
        )
    };
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
}
