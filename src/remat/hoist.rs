//! Hoisting re-runs: a plan-level improvement applied to the portfolio's best plan
//! ([`super::portfolio`]).
//!
//! The simulation of [`super::dtr`] recomputes a value just before the node that
//! reads it, making the writer's inputs resident first, recursively: when those
//! inputs were freed in the meantime they are recomputed too. Often the writer
//! could have run earlier instead, while its inputs were still resident (just
//! before the last of them was freed), at the price of holding its output from
//! then on. Exact planners with recompute intervals (Moccasin) find such plans;
//! a just-in-time simulation cannot.
//!
//! [`hoist`] moves one re-run at a time to the latest earlier point of the plan
//! where all its inputs are resident and none of its outputs is, drops the re-runs
//! that then feed nothing ([`drop_dead_reruns`]), frees every value after its last
//! read ([`super::dtr::tighten`]), and keeps the change when [`replay`] measures a
//! lower recompute cost within the budget. It repeats until no move helps or time
//! runs out. Every plan it returns was replayed, so it is never worse than the
//! plan it was given.

use std::time::Instant;

use super::dtr::tighten;
use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};

/// Earlier points tried per re-run (the latest first).
const POINTS: usize = 3;

/// Improves `plan` (within `budget`) by hoisting re-runs, until `end`.
pub fn hoist(g: &RematGraph, plan: Vec<Instr>, budget: u64, end: Instant) -> Vec<Instr> {
    let Ok(r) = replay(g, &plan) else {
        return plan;
    };
    if r.peak_bytes > budget || r.recompute_cost <= 0.0 {
        return plan;
    }
    let (mut best, mut cost) = (plan, r.recompute_cost);
    'outer: loop {
        let iv = Intervals::of(g, &best);
        // Re-runs, latest first (their nested feeders come just before them).
        for k in (0..best.len()).rev() {
            let Instr::Compute(p) = best[k] else { continue };
            if iv.first[p] == k {
                continue;
            }
            for i in iv.points(g, p, k).into_iter().take(POINTS) {
                if Instant::now() >= end {
                    break 'outer;
                }
                let mut cand = Vec::with_capacity(best.len());
                cand.extend_from_slice(&best[..i]);
                cand.push(Instr::Compute(p));
                cand.extend_from_slice(&best[i..k]);
                cand.extend_from_slice(&best[k + 1..]);
                let cand = tighten(g, &drop_dead_reruns(g, &cand));
                if let Ok(rc) = replay(g, &cand) {
                    if rc.peak_bytes <= budget && rc.recompute_cost < cost * (1.0 - 1e-12) {
                        (best, cost) = (cand, rc.recompute_cost);
                        continue 'outer;
                    }
                }
            }
        }
        break;
    }
    best
}

/// Each value's live intervals in a plan, and each node's first run.
struct Intervals {
    /// Per value: `(from, to)` instruction indices, resident after `from` and up
    /// to `to` (its free, or the plan's length); fixed values have none and are
    /// always resident.
    spans: Vec<Vec<(usize, usize)>>,
    first: Vec<usize>,
}

impl Intervals {
    fn of(g: &RematGraph, plan: &[Instr]) -> Intervals {
        let mut spans: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.values.len()];
        let mut open = vec![usize::MAX; g.values.len()];
        let mut first = vec![usize::MAX; g.nodes.len()];
        for (k, op) in plan.iter().enumerate() {
            match *op {
                Instr::Compute(p) => {
                    if first[p] == usize::MAX {
                        first[p] = k;
                    }
                    for &o in &g.nodes[p].outputs {
                        if open[o] == usize::MAX && !g.values[o].fixed {
                            open[o] = k;
                        }
                    }
                }
                Instr::Free(v) => {
                    if open[v] != usize::MAX {
                        spans[v].push((open[v], k));
                        open[v] = usize::MAX;
                    }
                }
                Instr::Load(v) => {
                    if open[v] == usize::MAX {
                        open[v] = k;
                    }
                }
            }
        }
        for (v, &o) in open.iter().enumerate() {
            if o != usize::MAX {
                spans[v].push((o, plan.len()));
            }
        }
        Intervals { spans, first }
    }

    /// Resident just before instruction `i`.
    fn live_before(&self, g: &RematGraph, v: ValueId, i: usize) -> bool {
        if g.values[v].fixed {
            return true;
        }
        let s = &self.spans[v];
        let j = s.partition_point(|&(from, _)| from < i);
        j > 0 && s[j - 1].1 >= i
    }

    /// Points `i < k` (latest first) where node `p` could run instead, just before
    /// instruction `i`: every input resident, no output resident from `i` to `k`,
    /// and `i` the free of one of the inputs (the latest moment that input
    /// allows).
    fn points(&self, g: &RematGraph, p: NodeId, k: usize) -> Vec<usize> {
        let node = &g.nodes[p];
        let mut cands: Vec<usize> = node
            .inputs
            .iter()
            .filter(|&&u| !g.values[u].fixed)
            .flat_map(|&u| self.spans[u].iter().map(|&(_, to)| to))
            .filter(|&to| to < k)
            .collect();
        cands.sort_unstable_by(|a, b| b.cmp(a));
        cands.dedup();
        cands
            .into_iter()
            .filter(|&i| {
                node.inputs.iter().all(|&u| self.live_before(g, u, i))
                    && node
                        .outputs
                        .iter()
                        .all(|&o| self.spans[o].iter().all(|&(from, to)| to <= i || from >= k))
            })
            .collect()
    }
}

/// Removes re-runs (not a node's first run) none of whose outputs is read before
/// it is written again or the plan ends (held values count as read at the end).
pub fn drop_dead_reruns(g: &RematGraph, plan: &[Instr]) -> Vec<Instr> {
    let mut first = vec![usize::MAX; g.nodes.len()];
    for (k, op) in plan.iter().enumerate() {
        if let Instr::Compute(p) = *op {
            if first[p] == usize::MAX {
                first[p] = k;
            }
        }
    }
    let mut needed: Vec<bool> = g.values.iter().map(|v| v.held).collect();
    let mut keep = vec![true; plan.len()];
    for (k, op) in plan.iter().enumerate().rev() {
        let Instr::Compute(p) = *op else { continue };
        let node = &g.nodes[p];
        if first[p] != k && !node.outputs.iter().any(|&o| needed[o]) {
            keep[k] = false;
            continue;
        }
        for &o in &node.outputs {
            needed[o] = g.values[o].held;
        }
        for &u in &node.inputs {
            needed[u] = true;
        }
    }
    plan.iter()
        .zip(&keep)
        .filter(|(_, &k)| k)
        .map(|(op, _)| *op)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remat::gap_milp::tests::early_graph;
    use std::time::Duration;

    #[test]
    fn a_rerun_moves_to_where_its_inputs_are_resident() {
        let g = early_graph();
        // x freed after node 2, then s and x recomputed just before node 6.
        let jit = vec![
            Instr::Compute(0),
            Instr::Compute(1),
            Instr::Compute(2),
            Instr::Free(1),
            Instr::Compute(3),
            Instr::Compute(4),
            Instr::Compute(5),
            Instr::Free(0),
            Instr::Compute(0),
            Instr::Compute(1),
            Instr::Free(0),
            Instr::Compute(6),
        ];
        let r = replay(&g, &jit).unwrap();
        assert_eq!(r.recompute_cost, 101.0);
        let end = Instant::now() + Duration::from_secs(5);
        let h = hoist(&g, jit.clone(), r.peak_bytes, end);
        let rh = replay(&g, &h).unwrap();
        assert_eq!(rh.recompute_cost, 1.0, "{h:?}");
        assert!(rh.peak_bytes <= r.peak_bytes);
        // A plan over the budget is returned as it was.
        assert_eq!(hoist(&g, jit.clone(), r.peak_bytes - 1, end), jit);
    }

    #[test]
    fn reruns_that_feed_nothing_are_dropped() {
        let g = early_graph();
        let mut plan = g.no_recompute_plan();
        plan.push(Instr::Compute(3));
        let out = drop_dead_reruns(&g, &plan);
        assert_eq!(out.len(), plan.len() - 1);
        assert_eq!(replay(&g, &out).unwrap().recompute_cost, 0.0);
    }
}
