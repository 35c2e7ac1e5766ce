//! Block plans in `fit` ([`Ckpt::Blocks`]): per repeated block, keep, checkpoint
//! selectively or checkpoint whole, chosen by the dynamic program of
//! [`crate::remat::blocks`] for the card: the plan is tested by replaying its
//! allocations through the caching allocator (with `--gpu`) as well as on live
//! bytes, and repaired until it fits. The planned row takes it where it beats the op
//! plan; on graphs above [`OP_PLAN_MAX_NODES`] nodes it is the planned row's search.
//! [`take_the_better_preset`] gives the planned row the best of the op plan, the
//! block plan and the presets.

use super::{fit_device, Ckpt, Combo, FitOptions, Realised, Steps, Strategy, StrategyFit};
use crate::error::{Error, Result};
use crate::infer::MAX_BATCH;
use crate::memory::device::StepValues;
use crate::remat::blocks::{plan_blocks, BlockPlan, Choice, Link};
use crate::remat::graph::{replay_on_device, Instr, RematGraph};
use crate::remat::modules::{evaluate, ModulePlan, ModuleTree};
use crate::train::Schedule;

/// Above this many nodes in the step's graph (a Llama-3-8B step has 8,731; GPT-2's
/// 3,079), the planned row plans by blocks alone: the op-level planners take tens of
/// seconds there, and their thousands of small re-runs fragment the allocator.
pub const OP_PLAN_MAX_NODES: usize = crate::remat::portfolio::LARGE_NODES;

/// Batches past the presets' answer the block plan is tried at.
const CLIMB: u64 = 4;

/// The block-planned combination.
pub(super) const BLOCKS: Combo = Combo {
    ckpt: Ckpt::Blocks,
    ..Combo::PLAIN
};

/// The block plan of schedule `s` (one GPU's, as the combination leaves it) under
/// `o`'s budget and card; `None` as the plan when the graph has fewer than two
/// repeated blocks (the step is then run as it is).
pub(super) fn plan(
    o: &FitOptions,
    s: &Schedule,
) -> Result<(RematGraph, Option<BlockPlan>, StepValues)> {
    let g = crate::remat::from_schedule::from_schedule(s, "fit");
    let t = ModuleTree::build(&g);
    let values = StepValues::of(s);
    let budget = o.budget();
    let over = |plan: &[Instr], p: &ModulePlan| -> Option<u64> {
        let live = p.peak_bytes.saturating_sub(budget);
        let dev = match &o.device {
            Some(d) if replay_on_device(&g, plan, &values, d).is_err() => {
                let inf = fit_device::unlimited(d);
                replay_on_device(&g, plan, &values, &inf)
                    .map_or(u64::MAX / 4, |r| {
                        r.reserved_bytes.saturating_sub(d.capacity)
                    })
                    .max(1)
            }
            _ => 0,
        };
        Some(live.max(dev)).filter(|&e| e > 0)
    };
    let p = plan_blocks(&g, &t, budget, true, link(o), &over).map_err(Error::Graph)?;
    Ok((g, p, values))
}

/// The card's host link, where `fit` has a card: blocks may then be offloaded.
fn link(o: &FitOptions) -> Option<Link> {
    let g = o.device.as_ref()?.gpu?;
    Some(Link {
        bytes_per_s: g.pcie_bytes_per_s(),
        flops_per_s: g.flops_per_s(),
    })
}

/// [`Steps::realise`] of [`Ckpt::Blocks`] on schedule `s`: the plan and its recompute
/// FLOP fraction.
pub(super) fn realise(o: &FitOptions, s: &Schedule) -> Result<(Realised, f64)> {
    let (g, p, values) = plan(o, s)?;
    let mp = match p {
        Some(p) => p.plan,
        None => evaluate(&g, &ModuleTree::build(&g), &[]).map_err(Error::Graph)?,
    };
    let ov = mp.recompute_cost / g.base_cost().max(1.0);
    Ok((
        Realised::Plan {
            g,
            plan: mp.plan,
            values,
        },
        ov,
    ))
}

/// What the block plan at a batch chose, for the row's note.
fn describe(p: &BlockPlan) -> String {
    let count = |c: Choice| p.choices.iter().filter(|&&x| x == c).count();
    let (keep, sel, full) = (
        count(Choice::Keep),
        count(Choice::Selective),
        count(Choice::Full),
    );
    let mut parts = Vec::new();
    let off = count(Choice::Offload);
    for (n, what) in [
        (keep, "kept"),
        (sel, "selective"),
        (full, "whole"),
        (off, "offloaded"),
    ] {
        if n > 0 {
            parts.push(format!("{n} {what}"));
        }
    }
    format!(
        "block plan over {} blocks ({})",
        p.choices.len(),
        parts.join(", ")
    )
}

/// The block plans' row: the largest batch at which the block plan fits (the
/// presets' answers first, which its portfolio holds, then the next batches), its
/// peak and overhead, named by what it chose there. `None` when the model has fewer
/// than two repeated blocks.
pub(super) fn row(steps: &Steps) -> Result<Option<StrategyFit>> {
    let o = steps.o;
    let at_1 = steps.schedule(Combo::PLAIN, 1)?;
    if plan(o, &at_1)?.1.is_none() {
        return Ok(None);
    }
    let fits = |b: u64| -> Result<bool> {
        let (t, _) = steps.peak_at(BLOCKS, b)?;
        Ok(t.into_iter().max().unwrap_or(0) <= o.budget() && steps.fits_at(BLOCKS, b)?)
    };
    let every = steps.max_batch(Combo {
        ckpt: Ckpt::EveryBlock,
        ..Combo::PLAIN
    })?;
    let selective = steps.max_batch(Combo {
        ckpt: Ckpt::EveryBlockSelective,
        ..Combo::PLAIN
    })?;
    let mut b = every.0.max(selective.0);
    while b > 0 && !fits(b)? {
        b -= 1;
    }
    if b > 0 {
        let top = (b + CLIMB).min(MAX_BATCH);
        while b < top && fits(b + 1)? {
            b += 1;
        }
    }
    let (t, ov) = steps.peak_at(BLOCKS, b.max(1))?;
    let (_, chosen, _) = plan(o, &*steps.schedule(Combo::PLAIN, b.max(1))?)?;
    let name = chosen.as_ref().map(describe).unwrap_or_default();
    let offloaded = chosen.as_ref().filter(|p| !p.plan.offloaded.is_empty());
    let mut row = StrategyFit {
        name,
        max_batch: b,
        peak_bytes: t.into_iter().max().unwrap_or(0),
        overhead: ov,
        global_batch: Some(b),
        host_bytes: offloaded.map(|p| p.plan.host_bytes),
        pcie_bytes: offloaded.map(|p| p.plan.pcie_bytes),
        pcie_seconds: offloaded.and_then(|p| {
            let l = link(o)?;
            Some(p.plan.pcie_bytes as f64 / l.bytes_per_s)
        }),
        ..StrategyFit::default()
    };
    steps.set_device(&mut row, BLOCKS)?;
    Ok(Some(row))
}

/// The step graph's node count at batch 1 (one node per schedule step; the same at
/// every batch).
pub(super) fn nodes(steps: &Steps) -> Result<usize> {
    Ok(steps.schedule(Combo::PLAIN, 1)?.steps.len())
}

/// The schemes the planned row must never lose to, on the device where one is given:
/// their plans are in the planner's portfolio.
const PLANNED_PORTFOLIO: [Strategy; 3] = [
    Strategy::Checkpointing,
    Strategy::CheckpointEveryBlock,
    Strategy::CheckpointEveryBlockSelective,
];

/// The planned row takes the figures of a scheme of [`PLANNED_PORTFOLIO`], or of the
/// block plan (`blocks`), that reaches a larger batch, or the same batch for less
/// recomputation: the op planner optimises live bytes, and replayed through the
/// caching allocator its thousands of small re-runs can fragment what block-sized
/// checkpoints keep compact (issue 50: a Llama-3-8B-shaped bf16 export reached batch
/// 2 planned, 4 with every block). `op_skipped`: the graph's node count where the
/// op-level search did not run (the row is the block plan's already).
pub(super) fn take_the_better_preset(
    rows: &mut [StrategyFit],
    block_row: Option<StrategyFit>,
    op_skipped: Option<usize>,
) {
    let planned = Strategy::PlannedCheckpointing.name();
    let Some(p) = rows.iter().position(|r| r.name == planned) else {
        return;
    };
    // (how the note names it, its row)
    let mut cands: Vec<(String, StrategyFit)> =
        block_row.map(|b| (b.name.clone(), b)).into_iter().collect();
    cands.extend(PLANNED_PORTFOLIO.iter().filter_map(|st| {
        let r = rows.iter().find(|r| r.name == st.name())?;
        Some((format!("{}'s plan", r.name), r.clone()))
    }));
    let op = match op_skipped {
        Some(n) => format!(
            "the op-level search skipped ({n} nodes, above {})",
            OP_PLAN_MAX_NODES
        ),
        None => {
            let a = &rows[p];
            if a.max_batch == 0 {
                "the op plan fit no batch".to_string()
            } else {
                format!(
                    "the op plan fit batch {} at +{:.1}%",
                    a.max_batch,
                    a.overhead * 100.0
                )
            }
        }
    };
    // Skipped, the row holds the block plan's figures, which need their note.
    let mut first = op_skipped.is_some();
    for (label, b) in cands {
        let a = &rows[p];
        let better = b.max_batch > a.max_batch
            || (b.max_batch == a.max_batch && b.max_batch > 0 && b.overhead < a.overhead)
            || (op_skipped.is_some()
                && b.max_batch == 0
                && a.max_batch == 0
                && b.peak_bytes < a.peak_bytes);
        if !(better || first) {
            continue;
        }
        first = false;
        let row = &mut rows[p];
        row.max_batch = b.max_batch;
        row.peak_bytes = b.peak_bytes;
        row.overhead = b.overhead;
        row.global_batch = b.global_batch;
        row.reserved_bytes = b.reserved_bytes;
        row.device_bytes = b.device_bytes;
        row.host_bytes = b.host_bytes;
        row.pcie_bytes = b.pcie_bytes;
        row.pcie_seconds = b.pcie_seconds;
        row.planner = None;
        row.lower_bound_overhead = None;
        row.recomputed_tensors = None;
        row.note = if b.max_batch == 0 {
            format!(
                "memplan's planner: nothing fits batch 1; the lowest peak is that of {label}, {op}"
            )
        } else {
            format!(
                "memplan's planner: {label}, which fits batch {} at +{:.1}% FLOPs, {op}",
                b.max_batch,
                b.overhead * 100.0
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::take_the_better_preset;
    use crate::fit::{Strategy, StrategyFit};
    use crate::remat::plan::Solver;

    /// The planned row takes every-block's figures where every-block reaches a larger
    /// batch (the device's verdict in issue 50), and the selective preset's where it
    /// reaches the same batch for less recomputation; never a worse one's.
    #[test]
    fn the_planned_row_never_loses_to_a_preset() {
        let row = |st: Strategy, max_batch, overhead| StrategyFit {
            name: st.name(),
            max_batch,
            peak_bytes: max_batch * 10,
            overhead,
            global_batch: Some(max_batch),
            accumulation_steps: None,
            note: String::new(),
            planner: Some(Solver::Ilp),
            lower_bound_overhead: Some(0.01),
            recomputed_tensors: Some(5),
            combines: None,
            communication_bytes: None,
            pcie_bytes: None,
            host_bytes: None,
            pcie_seconds: None,
            reserved_bytes: None,
            device_bytes: None,
            ..Default::default()
        };
        let mut rows = vec![
            row(Strategy::Checkpointing, 3, 0.33),
            row(Strategy::PlannedCheckpointing, 2, 0.278),
            row(Strategy::CheckpointEveryBlock, 4, 0.234),
            row(Strategy::CheckpointEveryBlockSelective, 1, 0.01),
        ];
        take_the_better_preset(&mut rows, None, None);
        let p = &rows[1];
        assert_eq!((p.max_batch, p.peak_bytes, p.overhead), (4, 40, 0.234));
        assert!(p.planner.is_none() && p.note.contains("checkpoint-every-block's plan"));
        // The same batch for less recomputation wins too; a smaller batch never does.
        let mut rows = vec![
            row(Strategy::PlannedCheckpointing, 4, 0.05),
            row(Strategy::CheckpointEveryBlock, 4, 0.2),
            row(Strategy::CheckpointEveryBlockSelective, 4, 0.004),
        ];
        take_the_better_preset(&mut rows, None, None);
        assert_eq!((rows[0].max_batch, rows[0].overhead), (4, 0.004));
        let mut rows = vec![
            row(Strategy::PlannedCheckpointing, 5, 0.3),
            row(Strategy::CheckpointEveryBlock, 4, 0.2),
        ];
        take_the_better_preset(&mut rows, None, None);
        assert_eq!((rows[0].max_batch, rows[0].planner), (5, Some(Solver::Ilp)));
        // Skipped, the op-level row takes the block plan's figures and says so; a
        // preset still wins where better.
        let mut rows = vec![
            row(Strategy::PlannedCheckpointing, 4, 0.05),
            row(Strategy::CheckpointEveryBlock, 4, 0.2),
        ];
        let mut b = row(Strategy::CheckpointEveryBlock, 4, 0.05);
        b.name = "block plan over 32 blocks (29 selective, 3 whole)".into();
        take_the_better_preset(&mut rows, Some(b.clone()), Some(8731));
        assert_eq!((rows[0].max_batch, rows[0].overhead), (4, 0.05));
        assert!(rows[0]
            .note
            .contains("block plan over 32 blocks (29 selective, 3 whole), which fits batch 4"));
        assert!(rows[0].note.contains("op-level search skipped (8731 nodes"));
        let mut rows = vec![
            row(Strategy::PlannedCheckpointing, 1, 0.5),
            row(Strategy::CheckpointEveryBlock, 4, 0.2),
        ];
        take_the_better_preset(&mut rows, Some(b), None);
        assert_eq!((rows[0].max_batch, rows[0].overhead), (4, 0.05));
        assert!(
            rows[0].note.contains("the op plan fit batch 1 at +50.0%"),
            "{}",
            rows[0].note
        );
    }
}
