//! The default planner (`--solver ilp`): a portfolio of plans, each replayed; the
//! cheapest within the budget wins. Its parts live beside it: the gap MILP
//! ([`super::gap_milp`]), the lower bounds ([`super::bounds`]) and Checkmate's MILP
//! ([`super::checkmate`]).
//!
//!
//! Checkmate's MILP ([`super::checkmate`]) is exact but has O(n²) binaries; past a few
//! hundred nodes CBC finds nothing in minutes. This planner keeps it for small
//! graphs and scales by restricting *where* recomputation may happen:
//!
//! - **Gaps.** A value `v` is used by its writer and then by its readers, in order;
//!   between two consecutive uses `a < b` with `b > a + 1` it may be *dropped*:
//!   freed right after node `a` and recomputed just before node `b` (its writer,
//!   plus whatever of the writer's inputs is not live then, the *closure*). With
//!   gaps as the decisions, the memory right after each node is the no-recompute
//!   memory minus the bytes of the dropped gaps that span it, plus the closure's
//!   transient bytes at `b`: linear. Where the closure at `b` needs inputs that
//!   are dead by then, *early* gaps are offered beside it: the closure runs just
//!   before a node that reads one of those inputs for the last time, and the value
//!   is held from there to `b` (recompute intervals, as Moccasin has); and
//!   *held-input* gaps keep the writer's dead inputs resident from their last use
//!   to `b` instead, so that the writer alone runs again (at most one of a gap's
//!   variants is dropped). The gap MILP minimises the closures' cost
//!   under one memory row per stretch of nodes where the set of spanning gaps is
//!   constant (the highest of them), which is what keeps it small (a few thousand
//!   binaries for GPT-2's 3 000-node step).
//! - **Checked, then tightened.** The model ignores how closures interact (a
//!   closure that needs a value dropped in its own gap recomputes that too), so
//!   every solution becomes a plan that [`replay`] measures; if it overshoots, the
//!   MILP is solved again with the budget lowered by the overshoot, and a final
//!   repair drops more gaps (cheapest per byte) until the plan fits. Then drops
//!   that the budget does not need are undone, most expensive first.
//! - **Nested recomputation.** The gap model recomputes a value at most once per
//!   gap, from what is live then. [`super::dtr`] simulates the schedule under the
//!   budget instead, evicting by a cost/size/next-use score and recomputing
//!   missing inputs recursively: any number of recomputations, nested to any
//!   depth. It is what reaches budgets near the memory floor (random layered
//!   graphs, the lowest peaks of mobilenet and resnet50); below the floor it runs
//!   at the floor, for the lowest peak.
//! - **Backwards.** Where nothing fits after the simulation, [`super::chain`]
//!   searches the reverse pebble game: which set of values must be resident before
//!   the last computation, and before that one, down to nothing. It plans budgets
//!   the forward rules miss (random layered n250 and n1000 at 70 %), at a high
//!   cost, and bisects for the lowest peak when no plan fits.
//! - **Portfolio.** The greedy and √n baselines, the simulation's plans, the gap
//!   MILP's plan, and on graphs of at most [`EXACT_NODES`] nodes the full
//!   Checkmate MILP, are all replayed; the cheapest plan within the budget wins, so
//!   `ilp` never loses to a baseline and equals Checkmate wherever Checkmate
//!   finishes.
//! - **Hoisting.** The winning plan's re-runs are then moved earlier, one at a
//!   time, to where their inputs are still resident, when [`super::hoist`]'s
//!   replay finds that cheaper within the budget (source `hoisted`).
//! - **Certificates.** Below the memory floor ([`super::bounds::memory_floor`]) no
//!   plan exists; at or above it a point is planned, or left open (reported as
//!   such by `memplan bench`).
//! - **Lower bound.** For schedules that run nodes first in the graph's order (as
//!   every plan here but the chain search's, and Checkmate's, do), at the moment node `t` first runs the
//!   memory holds the fixed values, every held value written so far, `t`'s inputs
//!   and outputs, and whatever else is kept for later; each value written before `t`
//!   and read after it that is not kept costs at least one more run of its writer.
//!   The cheapest such set at each `t` is a knapsack; its fractional relaxation
//!   gives a valid bound per node, and the largest over nodes bounds the whole
//!   plan. Checkmate's LP relaxation and CBC's bound replace it when larger. A
//!   chain plan may first run nodes in another order, which this bound does not
//!   cover; the bound reported is never above the cost of the plan returned.

// Node indices address several per-node tables at once.
#![allow(clippy::needless_range_loop)]

use std::time::{Duration, Instant};

use super::bounds::{memory_floor, stage_lower_bound};
use super::chain;
use super::checkmate::{solve_checkmate, IlpOptions, GRACE};
use super::dtr;
use super::gap_milp::*;
use super::graph::{replay, Instr, RematGraph};
use super::heuristics::{greedy_drops_until, plan_with_drops, sqrt_drops};
use super::hoist::hoist;
use crate::error::Result;

/// Graphs up to this many nodes are also given to the full Checkmate MILP. Above
/// it, on the benchmark graphs (71 to 100 nodes), Checkmate never beat the gap MILP
/// within seconds, and a CBC run that overruns its limit in the root LP keeps CBC
/// (which is not re-entrant) busy for the next solves.
pub const EXACT_NODES: usize = 60;

/// Graphs above this many nodes are large (a Llama-3-8B training step has 8,731, a
/// GPT-2 step 3,079): `plan`'s default time limit is then [`LARGE_TIME_LIMIT_S`], and
/// `fit` plans their checkpointing by blocks ([`super::blocks`]).
pub const LARGE_NODES: usize = 4000;

/// `plan`'s default time limit on large graphs, in seconds (60 on the others).
pub const LARGE_TIME_LIMIT_S: f64 = 8.0;

/// What [`solve`] returns.
#[derive(Debug, Clone)]
pub struct ScaleResult {
    /// The plan: the cheapest found within the budget, else the lowest-peak one.
    pub plan: Vec<Instr>,
    /// Proven lower bound on `recompute cost / base cost` at this budget.
    pub lower_bound_overhead: f64,
    /// Which candidate won (`none`, `gap-milp`, `checkmate`, `dtr`, `greedy`,
    /// `sqrt`...).
    pub source: &'static str,
    /// The lowest peak of any candidate plan.
    pub min_peak: u64,
    /// A lower bound on any plan's peak that the chain search proved (one more than
    /// a budget it showed impossible; [`super::chain`]), 0 if none.
    pub proven_floor: u64,
}

/// A replayed candidate.
#[derive(Clone)]
pub(super) struct Cand {
    plan: Vec<Instr>,
    peak: u64,
    cost: f64,
    source: &'static str,
}

pub(super) fn measure(g: &RematGraph, plan: Vec<Instr>, source: &'static str) -> Option<Cand> {
    let r = replay(g, &plan).ok()?;
    Some(Cand {
        plan,
        peak: r.peak_bytes,
        cost: r.recompute_cost,
        source,
    })
}

/// Plans `g` under `budget` bytes within about `time_limit_s` seconds.
#[allow(clippy::too_many_lines)] // Long by design: the portfolio's candidates in the order they share the time limit.
pub fn solve(g: &RematGraph, budget: u64, time_limit_s: f64) -> Result<ScaleResult> {
    let start = Instant::now();
    let limit = Duration::from_secs_f64(time_limit_s.max(0.05));
    // Leave room for the final replays and the grace of a CBC stop.
    let deadline = start + limit.mul_f64(0.7);
    let base_cost = g.base_cost().max(f64::MIN_POSITIVE);
    let nr = g.no_recompute_plan();
    let nr_rep = replay(g, &nr).map_err(crate::error::Error::Graph)?;
    if nr_rep.peak_bytes <= budget {
        return Ok(ScaleResult {
            plan: nr,
            lower_bound_overhead: 0.0,
            source: "none",
            min_peak: nr_rep.peak_bytes,
            proven_floor: 0,
        });
    }
    let mut lower = stage_lower_bound(g, budget).unwrap_or(0.0) / base_cost;
    let gaps = Gaps::new(g);
    let mut cands: Vec<Cand> = Vec::new();
    let debug = std::env::var_os("MEMPLAN_DEBUG").is_some();
    let push = |c: Option<Cand>, cands: &mut Vec<Cand>| {
        if debug {
            eprintln!(
                "  {:>7.3} s {}",
                start.elapsed().as_secs_f64(),
                c.as_ref().map_or("-", |c| c.source)
            );
        }
        if let Some(c) = c {
            cands.push(c);
        }
    };

    // Baselines first: cheap, and the floor the optimisers must beat.
    let gd = greedy_drops_until(g, budget, Some(start + limit.mul_f64(0.35)));
    push(measure(g, plan_with_drops(g, &gd), "greedy"), &mut cands);
    push(
        measure(g, plan_with_drops(g, &sqrt_drops(g)), "sqrt"),
        &mut cands,
    );
    // The block plan ([`super::blocks`]): per repeated block, kept, selective or
    // whole; milliseconds, and the plan to beat on LLMs. Not where some forward node
    // cannot run again (a `--pytorch` op plan's graph: its file reruns single ops).
    if g.nodes.iter().all(|n| n.backward || n.recomputable) {
        if let Ok(Some(b)) = super::blocks::plan_blocks_live(g, budget, true) {
            push(measure(g, b.plan.plan, "blocks"), &mut cands);
        }
    }
    // Every ordinary and early gap (held-input gaps only add memory here).
    let all_on: Vec<bool> = gaps.list.iter().map(|gp| gp.hold.is_empty()).collect();
    push(measure(g, gaps.plan(g, &all_on), "all-gaps"), &mut cands);

    // Multiple and nested recomputation by simulation ([`super::dtr`]): cheap, and
    // the candidate that reaches budgets near the memory floor. Below the floor no
    // plan fits, and it runs at the floor for the lowest peak.
    let floor = memory_floor(g);
    let end = Instant::now() + limit.mul_f64(0.2);
    let d = dtr::plans_for(g, budget.max(floor), budget < floor, end);
    if let Some(p) = d.cheapest {
        push(measure(g, p, "dtr"), &mut cands);
    }
    if let Some(p) = d.lowest {
        push(measure(g, p, "dtr-min-peak"), &mut cands);
    }

    // Tight budgets the simulation misses: the reverse chain search ([`super::chain`]),
    // where nothing fits yet or only a plan that runs the step more than 1.5 times
    // (a budget the chain plans below may be met by a thrashing simulation).
    let fitting = cands
        .iter()
        .filter(|c| c.peak <= budget)
        .map(|c| c.cost / base_cost)
        .fold(f64::INFINITY, f64::min);
    // An exhausted search proves the budget impossible (`proven_floor`).
    let mut proven_floor = 0;
    let mut undecided = false;
    if budget >= floor && chain::applies(g) && fitting > 0.5 {
        let end = (Instant::now() + limit.mul_f64(0.25)).min(deadline);
        match chain::plan_within(g, budget, end) {
            chain::Probe::Plan(p) => push(measure(g, p, "chain"), &mut cands),
            chain::Probe::Impossible => proven_floor = budget + 1,
            chain::Probe::Unknown => undecided = true,
        }
    }

    // The gap MILP, tightened until its plan replays within the budget.
    if stage_lower_bound(g, budget).is_some() && !gaps.list.is_empty() {
        let share = if g.nodes.len() <= EXACT_NODES {
            0.3
        } else {
            0.55
        };
        let end = deadline.min(start + limit.mul_f64(share));
        if let Some(on) = gap_milp(g, &gaps, budget, false, end) {
            // Repairing and pruning may run on past the MILP's share.
            let on = repair_and_prune(g, &gaps, on, budget, deadline.max(end));
            push(measure(g, gaps.plan(g, &on), "gap-milp"), &mut cands);
        }
    }

    // Gap-level greedy from nothing dropped, aimed at the peak each time.
    if Instant::now() < deadline {
        let end = Instant::now() + deadline.saturating_duration_since(Instant::now()) / 2;
        let on = repair_and_prune(g, &gaps, vec![false; gaps.list.len()], budget, end);
        push(measure(g, gaps.plan(g, &on), "gap-greedy"), &mut cands);
    }

    // The greedy drops as gaps, pruned: never worse than greedy.
    let end = if g.nodes.len() <= EXACT_NODES {
        deadline.min(start + limit.mul_f64(0.4))
    } else {
        deadline
    };
    if Instant::now() < end {
        let on = gaps.gaps_of_drops(g, &gd);
        let on = repair_and_prune(g, &gaps, on, budget, end);
        push(measure(g, gaps.plan(g, &on), "greedy-pruned"), &mut cands);
    }

    // Exact on small graphs: Checkmate's MILP gets most of the time left (it
    // stops as soon as it proves optimality; CBC's bound is the lower bound).
    let proven = cands
        .iter()
        .filter(|c| c.peak <= budget)
        .any(|c| c.cost / base_cost <= lower + 1e-12);
    if g.nodes.len() <= EXACT_NODES && !proven && stage_lower_bound(g, budget).is_some() {
        let left = (start + limit.mul_f64(0.75)).saturating_duration_since(Instant::now());
        let r = solve_checkmate(
            g,
            budget,
            &IlpOptions {
                // Net of the wait CBC is given past its limit.
                time_limit: left.saturating_sub(GRACE).max(Duration::from_millis(500)),
                lp_bound: false,
            },
        )?;
        if let Some(lb) = r.lower_bound {
            lower = lower.max((lb - g.base_cost()) / base_cost);
        }
        if let Some(p) = r.plan {
            push(measure(g, p, "checkmate"), &mut cands);
        }
    }

    // Nothing fits: the lowest peak the gap model can reach, for the report.
    // It always gets a share of the time: a budget the lowest-peak plan meets must
    // not be reported infeasible.
    // Skipped when a plan is at the memory floor already (no plan goes lower).
    // The chain search bisects for it first, on a fifth of the time.
    if !cands.iter().any(|c| c.peak <= budget.max(floor)) && chain::applies(g) {
        let hi = cands
            .iter()
            .map(|c| c.peak)
            .min()
            .unwrap_or(nr_rep.peak_bytes);
        let end = Instant::now() + limit.mul_f64(0.2);
        // The budget itself was just searched without an answer.
        let lo = budget.max(floor).max(proven_floor) + u64::from(undecided);
        let (p, proven) = chain::lowest_plan(g, lo, hi.saturating_sub(1), end);
        proven_floor = proven_floor.max(proven);
        if let Some(p) = p {
            push(measure(g, p, "chain-min-peak"), &mut cands);
        }
    }
    if !cands.iter().any(|c| c.peak <= budget.max(floor)) && !gaps.list.is_empty() {
        let now = Instant::now();
        let end = (start + limit.mul_f64(0.97)).max(now + limit.mul_f64(0.05));
        if let Some(on) = gap_milp(g, &gaps, budget, true, end) {
            let lowest = replay(g, &gaps.plan(g, &on)).map(|r| r.peak_bytes);
            let on = match lowest {
                Ok(p) => repair_and_prune(g, &gaps, on, p.max(budget), end),
                Err(_) => on,
            };
            push(measure(g, gaps.plan(g, &on), "gap-min-peak"), &mut cands);
        }
    }
    // A plan within a budget proven impossible would mean a wrong proof: trust the
    // plan (replayed) and drop the proof.
    let contradicted = cands.iter().any(|c| c.peak < proven_floor);
    debug_assert!(!contradicted, "a plan peaks under the proven floor");
    if contradicted {
        proven_floor = 0;
    }
    let min_peak = cands
        .iter()
        .map(|c| c.peak)
        .min()
        .unwrap_or(nr_rep.peak_bytes)
        .min(nr_rep.peak_bytes);
    let best = cands
        .iter()
        .filter(|c| c.peak <= budget)
        .min_by(|a, b| a.cost.total_cmp(&b.cost).then(a.peak.cmp(&b.peak)))
        .or_else(|| {
            cands
                .iter()
                .min_by(|a, b| a.peak.cmp(&b.peak).then(a.cost.total_cmp(&b.cost)))
        })
        .cloned();
    let mut best = match best {
        Some(b) => b,
        None => Cand {
            plan: nr,
            peak: nr_rep.peak_bytes,
            cost: 0.0,
            source: "none",
        },
    };
    // Re-runs moved earlier, to where their inputs are still resident
    // ([`super::hoist`]), unless the plan is proven optimal already.
    if best.peak <= budget && best.cost / base_cost > lower + 1e-12 {
        let end = start + limit.mul_f64(0.9);
        let p = hoist(g, best.plan.clone(), budget, end);
        if let Some(c) = measure(g, p, "hoisted") {
            if c.peak <= budget && c.cost < best.cost {
                best = c;
            }
        }
    }
    if std::env::var_os("MEMPLAN_DEBUG").is_some() {
        for c in &cands {
            eprintln!(
                "  {}: peak {} cost {:.6} {}",
                c.source,
                c.peak,
                c.cost / base_cost,
                if c.peak <= budget { "fits" } else { "over" }
            );
        }
    }
    let lb = if best.peak <= budget {
        lower.min(best.cost / base_cost)
    } else {
        lower
    };
    Ok(ScaleResult {
        plan: best.plan,
        lower_bound_overhead: lb.max(0.0),
        source: best.source,
        min_peak,
        proven_floor,
    })
}
