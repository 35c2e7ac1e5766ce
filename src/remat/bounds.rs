//! Lower bounds of the default planner ([`super::portfolio`]): the memory floor (what
//! must be live when each node first runs, and what making its inputs resident
//! together needs) and the per-node fractional knapsack that bounds the recompute
//! cost of any plan running nodes first in graph order.

// Node indices address several per-node tables at once.
#![allow(clippy::needless_range_loop)]

use super::graph::{Instr, NodeId, RematGraph, ValueId};

/// Memory right after each node runs in the no-recompute plan.
pub(super) fn baseline_memory(g: &RematGraph) -> Vec<u64> {
    let mut mem = vec![0u64; g.nodes.len()];
    let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    let mut cur: u64 = g.fixed_bytes();
    for op in g.no_recompute_plan() {
        match op {
            Instr::Compute(i) => {
                for &o in &g.nodes[i].outputs {
                    if !live[o] {
                        live[o] = true;
                        cur += g.values[o].bytes;
                    }
                }
                mem[i] = cur;
            }
            Instr::Load(_) => unreachable!("the no-recompute plan loads nothing"),
            Instr::Free(v) => {
                if live[v] {
                    live[v] = false;
                    cur -= g.values[v].bytes;
                }
            }
        }
    }
    mem
}

/// The lowest memory any plan that runs nodes first in the graph's order can have:
/// at each node, the fixed values, the held values written so far, and the node's
/// inputs and outputs ([`stage_needs`]); and what making those inputs resident
/// needs ([`materialization_floor`]).
pub fn memory_floor(g: &RematGraph) -> u64 {
    let stage = stage_needs(g).into_iter().max().unwrap_or(0);
    stage.max(materialization_floor(g, MATERIALIZATION_DEPTH))
}

/// Levels [`memory_floor`] looks back through.
pub const MATERIALIZATION_DEPTH: usize = 2;

/// A bound on the peak of every plan, from how a node's inputs become resident
/// together. When node `t` runs, the set `R` of its inputs is resident. Of `R`,
/// some value `u` became resident last, when its writer `p` ran; at that moment
/// the rest of `R` was resident already, with `p`'s inputs and outputs. So the
/// memory then was at least the bytes of `(R \ out(p)) ∪ in(p) ∪ out(p)`, and
/// just before, `R' = (R \ out(p)) ∪ in(p)` was resident together: the same
/// argument applies to `R'`, `depth` levels deep. No plan knows which `u` is
/// last, so each level takes the minimum over `u`; the bound is the largest over
/// nodes. Fixed values are resident throughout and count at every moment.
/// Unlike the op-local bound it sees that a node with many inputs cannot have
/// them all resident unless their writers' inputs were resident too.
pub fn materialization_floor(g: &RematGraph, depth: usize) -> u64 {
    let fixed = g.fixed_bytes();
    let mut best = 0u64;
    let mut r: Vec<ValueId> = Vec::new();
    for n in &g.nodes {
        r.clear();
        r.extend(n.inputs.iter().copied().filter(|&v| !g.values[v].fixed));
        r.sort_unstable();
        r.dedup();
        best = best.max(fixed + last_resident(g, &r, depth, best.saturating_sub(fixed)));
    }
    best
}

fn bytes_of(g: &RematGraph, r: &[ValueId]) -> u64 {
    r.iter().map(|&v| g.values[v].bytes).sum()
}

/// The bound of [`materialization_floor`] for the set `r` (sorted, non-fixed);
/// `known`: a value already reached elsewhere, below which the exact answer does
/// not matter (the search stops as soon as it cannot exceed it).
fn last_resident(g: &RematGraph, r: &[ValueId], depth: usize, known: u64) -> u64 {
    let here = bytes_of(g, r);
    if depth == 0 || r.is_empty() {
        return here;
    }
    let floor = here.max(known);
    let mut m = u64::MAX;
    let mut next: Vec<ValueId> = Vec::new();
    for &u in r {
        let Some(p) = g.values[u].producer else {
            return here;
        };
        let node = &g.nodes[p];
        next.clear();
        next.extend(r.iter().copied().filter(|v| !node.outputs.contains(v)));
        next.extend(node.inputs.iter().copied().filter(|&v| !g.values[v].fixed));
        next.sort_unstable();
        next.dedup();
        let mut at_run = bytes_of(g, &next);
        for &o in &node.outputs {
            if !g.values[o].fixed && next.binary_search(&o).is_err() {
                at_run += g.values[o].bytes;
            }
        }
        let mut val = at_run;
        if val > floor {
            val = val.max(last_resident(g, &next, depth - 1, floor));
        }
        m = m.min(val);
        if m <= floor {
            break;
        }
    }
    here.max(m)
}

/// Per node: fixed + held written before it + its own inputs and outputs.
pub(super) fn stage_needs(g: &RematGraph) -> Vec<u64> {
    let fixed = g.fixed_bytes();
    let mut held = 0u64;
    let mut seen = vec![false; g.values.len()];
    let mut out = Vec::with_capacity(g.nodes.len());
    let mut mark = vec![usize::MAX; g.values.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let mut local = 0u64;
        for &v in n.inputs.iter().chain(&n.outputs) {
            let val = &g.values[v];
            if val.fixed || mark[v] == i || (val.held && seen[v]) {
                continue;
            }
            mark[v] = i;
            local += val.bytes;
        }
        out.push(fixed + held + local);
        for &v in &n.outputs {
            if g.values[v].held && !seen[v] {
                seen[v] = true;
                held += g.values[v].bytes;
            }
        }
    }
    out
}

/// The knapsack lower bound on recompute cost under `budget` (see the module
/// documentation); `None` when some node cannot run within the budget at all.
pub fn stage_lower_bound(g: &RematGraph, budget: u64) -> Option<f64> {
    let needs = stage_needs(g);
    if needs.iter().any(|&x| x > budget) || memory_floor(g) > budget {
        return None;
    }
    let readers = g.readers();
    let last: Vec<Option<NodeId>> = readers.iter().map(|r| r.last().copied()).collect();
    // Values alive across t (written before t, read after t), by writer.
    let mut best: f64 = 0.0;
    let mut items: Vec<(f64, u64)> = Vec::new();
    let mut by_writer: Vec<u64> = vec![0; g.nodes.len()];
    let mut writers: Vec<NodeId> = Vec::new();
    // Values in order of writer, to scan those written before t.
    let mut order: Vec<ValueId> = (0..g.values.len())
        .filter(|&v| {
            let val = &g.values[v];
            !val.fixed && !val.held && val.producer.is_some() && val.bytes > 0
        })
        .collect();
    order.sort_by_key(|&v| g.values[v].producer);
    for t in 0..g.nodes.len() {
        let node = &g.nodes[t];
        writers.clear();
        let mut forced = 0u64;
        for &v in &order {
            let p = g.values[v].producer.expect("filtered");
            if p >= t {
                break;
            }
            let Some(l) = last[v] else { continue };
            if l <= t || node.inputs.contains(&v) {
                continue;
            }
            if !g.nodes[p].recomputable {
                forced += g.values[v].bytes;
                continue;
            }
            if by_writer[p] == 0 {
                writers.push(p);
            }
            by_writer[p] += g.values[v].bytes;
        }
        let cap = budget.saturating_sub(needs[t] + forced);
        items.clear();
        let mut total = 0u64;
        for &p in &writers {
            items.push((g.nodes[p].cost, by_writer[p]));
            total += by_writer[p];
            by_writer[p] = 0;
        }
        if needs[t] + forced > budget {
            return None;
        }
        if total <= cap {
            continue;
        }
        let mut excess = (total - cap) as f64;
        items.sort_by(|a, b| (a.0 / a.1 as f64).total_cmp(&(b.0 / b.1 as f64)));
        let mut cost = 0.0;
        for &(c, w) in &items {
            if excess <= 0.0 {
                break;
            }
            let take = (w as f64).min(excess);
            cost += c * take / w as f64;
            excess -= take;
        }
        best = best.max(cost);
    }
    Some(best)
}
