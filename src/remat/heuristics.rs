//! Plans from a set of dropped activations, and the baselines that choose the set:
//! `sqrt` (Chen et al. 2016: keep only tensors crossing √n equal forward segments)
//! and `greedy` (drop the activations that are cheapest to recompute per byte, as
//! PyTorch's activation-memory-budget knapsack ranks them, until the peak fits).

use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};

/// Whether the graph distinguishes forward from backward nodes. Graphs without
/// phases (the random layered benchmarks) drop a value between any two distant uses.
pub(super) fn has_phases(g: &RematGraph) -> bool {
    g.nodes.iter().any(|n| n.backward)
}

/// Values that may be dropped and recomputed later: written by a recomputable node,
/// neither fixed nor held, and read by some backward node (or, in graphs without
/// phases, read again at least two steps after they are written or last read).
pub fn candidates(g: &RematGraph) -> Vec<ValueId> {
    let readers = g.readers();
    let phases = has_phases(g);
    (0..g.values.len())
        .filter(|&v| {
            let val = &g.values[v];
            let Some(p) = val.producer else { return false };
            let later = if phases {
                readers[v].iter().any(|&r| g.nodes[r].backward)
            } else {
                let mut prev = p;
                readers[v].iter().any(|&r| {
                    let gap = r > prev + 1;
                    prev = r;
                    gap
                })
            };
            !val.fixed && !val.held && val.bytes > 0 && g.nodes[p].recomputable && later
        })
        .collect()
}

/// The plan that computes nodes in order, frees every value after its last reader,
/// and frees each dropped value after its last forward reader, recomputing it (and
/// whatever it needs) just before its next reader.
pub fn plan_with_drops(g: &RematGraph, dropped: &[bool]) -> Vec<Instr> {
    let n = g.nodes.len();
    let readers = g.readers();
    let phases = has_phases(g);
    let first_bw = g.nodes.iter().position(|x| x.backward).unwrap_or(n);
    let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    let kept_for_reruns = kept_for_reruns(g, dropped, &readers);
    let mut plan = Vec::with_capacity(n * 2);
    // The values each step touches, one buffer for all steps.
    let mut touched: Vec<ValueId> = Vec::new();
    // Next reader of v strictly after position i.
    let next_reader = |v: ValueId, i: NodeId| -> Option<NodeId> {
        let rs = &readers[v];
        let k = rs.partition_point(|&r| r <= i);
        rs.get(k).copied()
    };
    for i in 0..n {
        let node = &g.nodes[i];
        let before = plan.len();
        for &u in &node.inputs {
            ensure(g, u, &mut live, &mut plan);
        }
        plan.push(Instr::Compute(i));
        for &o in &node.outputs {
            live[o] = true;
        }
        // Free: values touched now (inputs, outputs, and anything recomputed) that have
        // no later reader, or that are dropped and have no later forward reader.
        touched.clear();
        touched.extend(node.inputs.iter().chain(&node.outputs));
        for op in &plan[before..] {
            if let Instr::Compute(p) = *op {
                touched.extend(g.nodes[p].inputs.iter().chain(&g.nodes[p].outputs));
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &v in &touched {
            let val = &g.values[v];
            if !live[v] || val.fixed || val.held {
                continue;
            }
            let next = next_reader(v, i);
            let release = match next {
                None => kept_for_reruns[v].is_none_or(|k| k <= i),
                Some(r) if phases => dropped[v] && i < first_bw && r >= first_bw,
                Some(r) => dropped[v] && r > i + 1,
            };
            if release {
                live[v] = false;
                plan.push(Instr::Free(v));
            }
        }
    }
    plan
}

/// For each value whose writer cannot run again, the last node before which a
/// recompute may read it: it stays live until then (`None` where no recompute reads
/// it). A dropped value is recomputed before its readers, and with it whatever freed
/// values its writer reads, back to live ones. In a training step every forward node
/// can run again and this is all `None`; a graph some of whose forward nodes may not
/// (a plan for a PyTorch file that reruns only some ops) needs it.
fn kept_for_reruns(
    g: &RematGraph,
    dropped: &[bool],
    readers: &[Vec<NodeId>],
) -> Vec<Option<NodeId>> {
    let mut kept: Vec<Option<NodeId>> = vec![None; g.values.len()];
    if g.nodes.iter().all(|n| n.backward || n.recomputable) {
        return kept;
    }
    let mut need: Vec<Option<NodeId>> = vec![None; g.values.len()];
    // Latest writer first: a value's need is final before its inputs get theirs.
    for p in (0..g.nodes.len()).rev() {
        let node = &g.nodes[p];
        if !node.recomputable {
            continue;
        }
        let own = |w: ValueId| readers[w].last().copied().filter(|_| dropped[w]);
        let Some(last) = node
            .outputs
            .iter()
            .filter_map(|&w| own(w).max(need[w]))
            .max()
        else {
            continue;
        };
        for &u in &node.inputs {
            let val = &g.values[u];
            let Some(q) = val.producer.filter(|_| !val.fixed) else {
                continue;
            };
            let slot = if g.nodes[q].recomputable {
                &mut need[u]
            } else {
                &mut kept[u]
            };
            *slot = (*slot).max(Some(last));
        }
    }
    kept
}

/// Makes value `v` live by computing its writer after (recursively) its writer's
/// inputs, appending the computes to `plan`. Fixed values are always live.
pub(super) fn ensure(g: &RematGraph, v: ValueId, live: &mut [bool], plan: &mut Vec<Instr>) {
    // Depth first with a stack of its own (value, next input to ensure): a chain of
    // 200,000 nodes overflowed the thread's stack when this recursed.
    let mut stack: Vec<(ValueId, usize)> = vec![(v, 0)];
    while let Some(&(x, next)) = stack.last() {
        let Some(p) = g.values[x].producer.filter(|_| !live[x]) else {
            stack.pop();
            continue;
        };
        if let Some(&u) = g.nodes[p].inputs.get(next) {
            stack.last_mut().expect("not empty").1 += 1;
            // A DAG is never deeper than its nodes; the bound guards a cycle.
            if !live[u] && stack.len() <= g.nodes.len() {
                stack.push((u, 0));
            }
            continue;
        }
        stack.pop();
        plan.push(Instr::Compute(p));
        for &o in &g.nodes[p].outputs {
            live[o] = true;
        }
    }
}

/// Drops everything `sqrt` would: all candidates except tensors that cross one of
/// ⌈√n⌉ equal segments of the forward nodes.
pub fn sqrt_drops(g: &RematGraph) -> Vec<bool> {
    let fwd: Vec<NodeId> = (0..g.nodes.len())
        .filter(|&i| !g.nodes[i].backward)
        .collect();
    let n = fwd.len().max(1);
    let k = ((n as f64).sqrt().ceil() as usize).max(1);
    let mut seg = vec![usize::MAX; g.nodes.len()];
    for (p, &i) in fwd.iter().enumerate() {
        seg[i] = p * k / n;
    }
    let mut crosses = vec![false; g.values.len()];
    for &i in &fwd {
        for &u in &g.nodes[i].inputs {
            if let Some(p) = g.values[u].producer {
                if seg[p] != usize::MAX && seg[p] < seg[i] {
                    crosses[u] = true;
                }
            }
        }
    }
    let mut dropped = vec![false; g.values.len()];
    for v in candidates(g) {
        dropped[v] = !crosses[v];
    }
    dropped
}

/// Candidates ranked by recompute cost per byte (cheapest first).
pub fn greedy_order(g: &RematGraph) -> Vec<ValueId> {
    let mut c = candidates(g);
    let score = |v: ValueId| {
        let p = g.values[v].producer.expect("candidate");
        g.nodes[p].cost / g.values[v].bytes.max(1) as f64
    };
    c.sort_by(|&a, &b| score(a).total_cmp(&score(b)).then(a.cmp(&b)));
    c
}

/// Greedy: walk the candidates cheapest-per-byte first, dropping each one that does
/// not raise the plan's peak, until the peak fits the budget; then undo the drops
/// (most expensive first) that are not needed to stay within it. Every step is
/// checked by replaying the plan. Returns the plan and whether it fits; when the budget
/// is out of reach, the lowest-peak plan found.
pub fn greedy(g: &RematGraph, budget: u64) -> (Vec<Instr>, bool) {
    greedy_until(g, budget, None)
}

/// [`greedy`], its walks stopped at `deadline` (`--time-limit`): the plan it has then.
pub fn greedy_until(
    g: &RematGraph,
    budget: u64,
    deadline: Option<std::time::Instant>,
) -> (Vec<Instr>, bool) {
    let d = greedy_drops_until(g, budget, deadline);
    let plan = plan_with_drops(g, &d);
    let fits = replay(g, &plan).is_ok_and(|r| r.peak_bytes <= budget);
    (plan, fits)
}

/// The values [`greedy`] drops.
pub fn greedy_drops(g: &RematGraph, budget: u64) -> Vec<bool> {
    greedy_drops_until(g, budget, None)
}

/// [`greedy_drops`], stopping its walks at `deadline` (what it has by then).
pub fn greedy_drops_until(
    g: &RematGraph,
    budget: u64,
    deadline: Option<std::time::Instant>,
) -> Vec<bool> {
    let late = || deadline.is_some_and(|d| std::time::Instant::now() >= d);
    let order = greedy_order(g);
    let peak = |d: &[bool]| {
        replay(g, &plan_with_drops(g, d))
            .map(|r| r.peak_bytes)
            .unwrap_or(u64::MAX)
    };
    let mut d = vec![false; g.values.len()];
    let mut cur = peak(&d);
    let mut taken = Vec::new();
    for &v in &order {
        if cur <= budget || late() {
            break;
        }
        d[v] = true;
        let p = peak(&d);
        if p <= cur {
            cur = p;
            taken.push(v);
        } else {
            d[v] = false;
        }
    }
    if cur <= budget {
        for &v in taken.iter().rev() {
            if late() {
                break;
            }
            d[v] = false;
            if peak(&d) > budget {
                d[v] = true;
            }
        }
    }
    d
}
