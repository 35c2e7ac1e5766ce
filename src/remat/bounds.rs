//! Lower bounds of the default planner ([`super::portfolio`]): the memory floor (what
//! must be live when each node first runs) and the per-node fractional knapsack that
//! bounds the recompute cost of any plan running nodes first in graph order.

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
/// inputs and outputs.
pub fn memory_floor(g: &RematGraph) -> u64 {
    stage_needs(g).into_iter().max().unwrap_or(0)
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
    if needs.iter().any(|&x| x > budget) {
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
