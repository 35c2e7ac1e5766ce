//! The gap MILP of the default planner ([`super::portfolio`]): a value's gaps between
//! uses are the decisions, each freeing it after one use and recomputing it (with its
//! closure) before the next; one memory row per stretch of nodes where the spanning
//! gaps are constant; checked by replay, tightened, repaired and pruned.
//!
//! A gap is dropped one of several ways (at most one of them): recomputed just
//! before its end with the closure of what is dead then; *early*, before a node
//! that reads one of the closure's inputs for the last time, and held from there;
//! or with *held inputs*: the writer's inputs that are dead at the gap's end (and
//! smaller together than the value) are kept resident from their last use to it,
//! so that the writer alone runs again (or with those of its dead inputs whose own
//! inputs are live then, or whose own dead inputs are smaller still and are held in
//! their place: three variants, see [`Rerun`]). Held inputs are what Checkmate's optimum does
//! on the random layered graphs: keep a 370-byte input for twenty nodes to rebuild
//! a 3 340-byte value from it, instead of keeping the value or rebuilding its
//! inputs' ancestors. The held bytes enter the memory rows of their stretch as a
//! cost of dropping the gap, so the model stays linear.

// Node indices address several per-node tables at once.
#![allow(clippy::needless_range_loop)]

use std::time::{Duration, Instant};

use good_lp::{coin_cbc, variable, Expression, ProblemVariables, SolverModel, Variable};

use super::bounds::baseline_memory;
use super::checkmate::run_cbc;
use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};
use super::heuristics::{ensure, has_phases};

/// Closures larger than this are not offered as gaps.
pub(super) const MAX_CLOSURE: usize = 64;

/// Early recompute points tried per gap.
const EARLY_POINTS: usize = 4;

/// A droppable stretch of a value's life.
#[derive(Debug, Clone)]
pub(super) struct Gap {
    pub(super) v: ValueId,
    /// Freed right after this node.
    pub(super) a: NodeId,
    /// Read again by this node.
    pub(super) b: NodeId,
    /// Recomputed just before this node: `b`, or earlier for an *early* gap,
    /// before a node that reads an input of the closure for the last time (the
    /// value is then held from `r` to `b`).
    pub(super) r: NodeId,
    /// Cost of the closure.
    pub(super) cost: f64,
    /// Bytes of the closure's other outputs, live at `r` only.
    pub(super) extra: u64,
    /// Nodes of the closure.
    pub(super) nodes: Vec<NodeId>,
    /// Values kept resident past their last use, to `r`, so that the closure is
    /// the writer and few else (a *held-input* gap, see [`held_inputs`]; empty
    /// otherwise).
    pub(super) hold: Vec<ValueId>,
}

/// The gaps of a graph.
pub(super) struct Gaps {
    /// Readers of each value (ascending, distinct).
    pub(super) readers: Vec<Vec<NodeId>>,
    /// Per value, per reader index `j`: the gap that ends at `readers[v][j]`.
    pub(super) at: Vec<Vec<Option<usize>>>,
    /// The same, for the other ways to drop that gap: early gaps (recomputed
    /// before `b`) and held-input gaps.
    pub(super) early_at: Vec<Vec<Vec<usize>>>,
    /// Per node: the early and held-input gaps recomputed just before it.
    pub(super) early_before: Vec<Vec<usize>>,
    pub(super) list: Vec<Gap>,
}

impl Gaps {
    pub(super) fn new(g: &RematGraph) -> Gaps {
        let readers = g.readers();
        let n = g.nodes.len();
        // Baseline liveness just before node b: written before b, used at or after b.
        let mut last = vec![0usize; g.values.len()];
        for (v, rs) in readers.iter().enumerate() {
            last[v] = rs.last().copied().unwrap_or(0);
        }
        let live_before = |u: ValueId, b: NodeId| -> bool {
            let val = &g.values[u];
            if val.fixed {
                return true;
            }
            match val.producer {
                Some(p) => p < b && (val.held || last[u] >= b),
                None => true,
            }
        };
        let mut at: Vec<Vec<Option<usize>>> = readers.iter().map(|r| vec![None; r.len()]).collect();
        let mut early_at: Vec<Vec<Vec<usize>>> =
            readers.iter().map(|r| vec![Vec::new(); r.len()]).collect();
        let mut early_before: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut list = Vec::new();
        let mut in_closure = vec![false; n];
        // The closure of v's writer p recomputed just before node r, under baseline
        // liveness: its nodes, their cost, and the bytes of their other outputs
        // that are not live then; `None` past [`MAX_CLOSURE`] or where a node
        // cannot run again.
        let mut closure = |v: ValueId, p: NodeId, r: NodeId| {
            let mut nodes = vec![p];
            let mut stack = vec![p];
            in_closure[p] = true;
            let mut ok = true;
            while let Some(q) = stack.pop() {
                for &u in &g.nodes[q].inputs {
                    if live_before(u, r) && u != v {
                        continue;
                    }
                    let Some(w) = g.values[u].producer else {
                        continue;
                    };
                    if in_closure[w] {
                        continue;
                    }
                    if !g.nodes[w].recomputable || nodes.len() >= MAX_CLOSURE {
                        ok = false;
                        break;
                    }
                    in_closure[w] = true;
                    nodes.push(w);
                    stack.push(w);
                }
                if !ok {
                    break;
                }
            }
            for &q in &nodes {
                in_closure[q] = false;
            }
            if !ok {
                return None;
            }
            let (cost, extra) = rerun_cost(g, &nodes, v, r, &live_before);
            Some((nodes, cost, extra))
        };
        for (v, val) in g.values.iter().enumerate() {
            let Some(p) = val.producer else { continue };
            if val.fixed || val.held || val.bytes == 0 || !g.nodes[p].recomputable {
                continue;
            }
            let mut prev = p;
            for (j, &b) in readers[v].iter().enumerate() {
                if b > prev + 1 {
                    let at_b = closure(v, p, b);
                    // Early points: where a value the closure reads is read for the
                    // last time, so that recomputing before it needs less; the
                    // latest first, each kept only if cheaper than every later one.
                    let readers_of: &[NodeId] = match &at_b {
                        Some((nodes, ..)) => nodes,
                        None => std::slice::from_ref(&p),
                    };
                    let mut points: Vec<NodeId> = readers_of
                        .iter()
                        .flat_map(|&q| g.nodes[q].inputs.iter())
                        .filter(|&&u| !g.values[u].fixed && !g.values[u].held)
                        .map(|&u| last[u])
                        .filter(|&r| r > prev + 1 && r < b)
                        .collect();
                    points.sort_unstable_by(|x, y| y.cmp(x));
                    points.dedup();
                    let mut cheapest = at_b.as_ref().map_or(f64::INFINITY, |c| c.1);
                    if let Some((nodes, cost, extra)) = at_b {
                        at[v][j] = Some(list.len());
                        list.push(Gap {
                            v,
                            a: prev,
                            b,
                            r: b,
                            cost,
                            extra,
                            nodes,
                            hold: Vec::new(),
                        });
                    }
                    for r in points.into_iter().take(EARLY_POINTS) {
                        let Some((nodes, cost, extra)) = closure(v, p, r) else {
                            continue;
                        };
                        if cost >= cheapest * (1.0 - 1e-12) {
                            continue;
                        }
                        cheapest = cost;
                        early_at[v][j].push(list.len());
                        early_before[r].push(list.len());
                        list.push(Gap {
                            v,
                            a: prev,
                            b,
                            r,
                            cost,
                            extra,
                            nodes,
                            hold: Vec::new(),
                        });
                    }
                    // Held inputs: the writer's inputs that are dead at `b` kept
                    // from their last use to `b` (or rebuilt, see `Rerun`), when
                    // they are smaller than `v` and cheaper than the closures above.
                    let mut held_sets: Vec<Vec<ValueId>> = Vec::new();
                    for rerun in [Rerun::Never, Rerun::Live, Rerun::Deeper(1)] {
                        let Some(gp) = held_inputs(g, v, p, prev, b, rerun, &live_before) else {
                            continue;
                        };
                        if held_sets.contains(&gp.hold) || gp.cost >= cheapest * (1.0 - 1e-12) {
                            continue;
                        }
                        held_sets.push(gp.hold.clone());
                        early_at[v][j].push(list.len());
                        early_before[b].push(list.len());
                        list.push(gp);
                    }
                }
                prev = b;
            }
        }
        Gaps {
            readers,
            at,
            early_at,
            early_before,
            list,
        }
    }

    /// The gaps that [`plan_with_drops`] drops for a set of dropped values: in
    /// graphs with phases the one from the last forward use to the first backward
    /// one, else every gap.
    pub(super) fn gaps_of_drops(&self, g: &RematGraph, dropped: &[bool]) -> Vec<bool> {
        let phases = has_phases(g);
        let first_bw = g
            .nodes
            .iter()
            .position(|x| x.backward)
            .unwrap_or(g.nodes.len());
        self.list
            .iter()
            .map(|gp| {
                dropped[gp.v]
                    && gp.r == gp.b
                    && gp.hold.is_empty()
                    && (!phases || (gp.a < first_bw && gp.b >= first_bw))
            })
            .collect()
    }

    /// The gap of `u` that spans node `b` (starts before it, ends after it).
    pub(super) fn spanning(&self, u: ValueId, b: NodeId) -> Option<usize> {
        let rs = &self.readers[u];
        let j = rs.partition_point(|&r| r <= b);
        let k = (*self.at[u].get(j)?)?;
        (self.list[k].a < b).then_some(k)
    }

    /// Pairs `(g, h)`: dropping both gaps means `g`'s closure, at its end, reads the
    /// value of `h` while `h` has it dropped, so it is recomputed there too.
    pub(super) fn pairs(&self, g: &RematGraph) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (k, gp) in self.list.iter().enumerate() {
            let mut seen: Vec<usize> = Vec::new();
            for &q in &gp.nodes {
                for &u in &g.nodes[q].inputs {
                    if u == gp.v {
                        continue;
                    }
                    if let Some(h) = self.spanning(u, gp.r) {
                        if h != k && !seen.contains(&h) {
                            seen.push(h);
                            out.push((k, h));
                        }
                    }
                }
            }
        }
        out
    }

    /// The plan that runs nodes in order, frees each value after its last reader
    /// (a held input of a dropped held-input gap: after that gap's end), and drops
    /// the gaps that are `on`: frees the value when a node at or after the gap's
    /// start touches it, and recomputes it (and whatever it needs) just before the
    /// gap's end.
    pub(super) fn plan(&self, g: &RematGraph, on: &[bool]) -> Vec<Instr> {
        let n = g.nodes.len();
        let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
        let mut plan = Vec::with_capacity(n * 2);
        let mut touched = Vec::new();
        // Per value, the last node a dropped held-input gap keeps it resident to.
        let mut hold_to = vec![0usize; g.values.len()];
        for (k, gp) in self.list.iter().enumerate() {
            if on[k] {
                for &u in &gp.hold {
                    hold_to[u] = hold_to[u].max(gp.r);
                }
            }
        }
        let mut release_at: Vec<Vec<ValueId>> = vec![Vec::new(); n];
        for (u, &to) in hold_to.iter().enumerate() {
            if to > 0 {
                release_at[to].push(u);
            }
        }
        for i in 0..n {
            let node = &g.nodes[i];
            let before = plan.len();
            for &k in &self.early_before[i] {
                if on[k] {
                    ensure(g, self.list[k].v, &mut live, &mut plan);
                }
            }
            for &u in &node.inputs {
                ensure(g, u, &mut live, &mut plan);
            }
            if plan.len() > before + 1 {
                self.free_early(g, i, before, &mut plan, &mut live, &hold_to);
            }
            plan.push(Instr::Compute(i));
            for &o in &node.outputs {
                live[o] = true;
            }
            touched.clear();
            touched.extend(node.inputs.iter().chain(&node.outputs).copied());
            for op in &plan[before..] {
                if let Instr::Compute(p) = *op {
                    touched.extend(g.nodes[p].inputs.iter().chain(&g.nodes[p].outputs));
                }
            }
            // Held values are freed where their hold ends, whether or not the
            // recomputation there read them.
            touched.extend(release_at[i].iter().copied());
            touched.sort_unstable();
            touched.dedup();
            for &v in &touched {
                let val = &g.values[v];
                if !live[v] || val.fixed || val.held {
                    continue;
                }
                let rs = &self.readers[v];
                let j = rs.partition_point(|&r| r <= i);
                // Dropped only at its gap's start: a value recomputed inside a
                // dropped gap (for another closure) stays until its next use.
                let release = match rs.get(j) {
                    None => hold_to[v] <= i,
                    Some(_) => self.at[v][j]
                        .iter()
                        .chain(&self.early_at[v][j])
                        .any(|&k| on[k] && self.list[k].a == i),
                };
                if release {
                    live[v] = false;
                    plan.push(Instr::Free(v));
                }
            }
        }
        plan
    }
}

/// Which dead inputs a held-input gap recomputes instead of holding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rerun {
    /// None: every dead input is held.
    Never,
    /// Those whose writer runs from values live at the gap's end.
    Live,
    /// Those too, and those whose writer's dead inputs, resolved the same way up to
    /// this many levels, hold fewer bytes than they have.
    Deeper(usize),
}

/// Makes dead input `u` available at `b`: its writer rerun (its own dead inputs
/// resolved in turn) when that holds fewer bytes than `u`, else `u` held.
fn resolve(
    g: &RematGraph,
    u: ValueId,
    b: NodeId,
    rerun: Rerun,
    live_before: &impl Fn(ValueId, NodeId) -> bool,
    nodes: &mut Vec<NodeId>,
    hold: &mut Vec<ValueId>,
) {
    let (depth, live_only) = match rerun {
        Rerun::Never => (0, true),
        Rerun::Live => (1, true),
        Rerun::Deeper(d) => (d, false),
    };
    let w = g.values[u].producer.filter(|&w| g.nodes[w].recomputable);
    if let Some(w) = w.filter(|_| depth > 0) {
        let (mut n2, mut h2) = (vec![w], Vec::new());
        let inner = if live_only {
            Rerun::Never
        } else {
            Rerun::Deeper(depth - 1)
        };
        for &x in &g.nodes[w].inputs {
            if !live_before(x, b) && !h2.contains(&x) {
                resolve(g, x, b, inner, live_before, &mut n2, &mut h2);
            }
        }
        h2.sort_unstable();
        h2.dedup();
        let held: u64 = h2.iter().map(|&x| g.values[x].bytes).sum();
        if (live_only && h2.is_empty()) || (!live_only && held < g.values[u].bytes) {
            nodes.extend(n2);
            hold.extend(h2);
            return;
        }
    }
    hold.push(u);
}

/// The held-input gap of value `v` (written by `p`) from `a` to `b`: `p` runs again
/// before `b`, its inputs that are dead at `b` kept resident from their last use
/// until then, or rerun there as `rerun` says ([`resolve`]). `None` when nothing is
/// held (the ordinary gap covers it) or the held values are not smaller than `v`.
fn held_inputs(
    g: &RematGraph,
    v: ValueId,
    p: NodeId,
    a: NodeId,
    b: NodeId,
    rerun: Rerun,
    live_before: &impl Fn(ValueId, NodeId) -> bool,
) -> Option<Gap> {
    let mut nodes = vec![p];
    let mut hold: Vec<ValueId> = Vec::new();
    for &u in &g.nodes[p].inputs {
        if u == v || live_before(u, b) {
            continue;
        }
        resolve(g, u, b, rerun, live_before, &mut nodes, &mut hold);
    }
    nodes.sort_unstable();
    nodes.dedup();
    // A value whose writer runs here is rebuilt, not held (one input resolved as
    // held and another through it as rebuilt).
    hold.retain(|&u| g.values[u].producer.is_none_or(|w| !nodes.contains(&w)));
    hold.sort_unstable();
    hold.dedup();
    let held: u64 = hold.iter().map(|&u| g.values[u].bytes).sum();
    if hold.is_empty() || held >= g.values[v].bytes {
        return None;
    }
    let (cost, extra) = rerun_cost(g, &nodes, v, b, live_before);
    Some(Gap {
        v,
        a,
        b,
        r: b,
        cost,
        extra,
        nodes,
        hold,
    })
}

/// What running `nodes` again just before node `r` to rebuild `v` costs: their
/// compute, and the bytes of their outputs other than `v` that are not live then
/// (resident at `r` only).
fn rerun_cost(
    g: &RematGraph,
    nodes: &[NodeId],
    v: ValueId,
    r: NodeId,
    live_before: &impl Fn(ValueId, NodeId) -> bool,
) -> (f64, u64) {
    let cost = nodes.iter().map(|&q| g.nodes[q].cost).sum();
    let mut outs: Vec<ValueId> = nodes
        .iter()
        .flat_map(|&q| g.nodes[q].outputs.iter().copied())
        .filter(|&u| u != v && !live_before(u, r))
        .collect();
    outs.sort_unstable();
    outs.dedup();
    (cost, outs.iter().map(|&u| g.values[u].bytes).sum())
}

impl Gaps {
    /// Within the recomputations run before node `i` (`plan[from..]`), frees each
    /// value nothing needs after node `i` (not `i`'s input, no later reader) right
    /// after its last use there, instead of after node `i`.
    pub(super) fn free_early(
        &self,
        g: &RematGraph,
        i: NodeId,
        from: usize,
        plan: &mut Vec<Instr>,
        live: &mut [bool],
        hold_to: &[NodeId],
    ) {
        let seg: Vec<NodeId> = plan[from..]
            .iter()
            .filter_map(|op| match *op {
                Instr::Compute(p) => Some(p),
                Instr::Free(_) | Instr::Load(_) => None,
            })
            .collect();
        let dead = |v: ValueId| {
            let val = &g.values[v];
            !val.fixed
                && !val.held
                && hold_to[v] <= i
                && !g.nodes[i].inputs.contains(&v)
                && self.readers[v].last().is_none_or(|&r| r <= i)
        };
        // Last position in the segment that touches each dead value.
        let mut last: Vec<(ValueId, usize)> = Vec::new();
        for (k, &p) in seg.iter().enumerate() {
            for &v in g.nodes[p].inputs.iter().chain(&g.nodes[p].outputs) {
                if dead(v) {
                    match last.iter_mut().find(|(u, _)| *u == v) {
                        Some(e) => e.1 = k,
                        None => last.push((v, k)),
                    }
                }
            }
        }
        if last.is_empty() {
            return;
        }
        plan.truncate(from);
        for (k, &p) in seg.iter().enumerate() {
            plan.push(Instr::Compute(p));
            for &(v, at) in &last {
                if at == k && live[v] {
                    live[v] = false;
                    plan.push(Instr::Free(v));
                }
            }
        }
    }
}

/// Solves the gap MILP, lowering its budget by the replayed overshoot until the
/// plan fits or time runs out; returns the last solution (fitting or not).
///
/// With `min_peak`, the budget is ignored: the MILP minimises the modelled peak
/// (recompute cost breaking ties), once.
#[allow(clippy::too_many_lines)] // Long by design: the MILP's rows, written as the model states them.
pub(super) fn gap_milp(
    g: &RematGraph,
    gaps: &Gaps,
    budget: u64,
    min_peak: bool,
    deadline: Instant,
) -> Option<Vec<bool>> {
    let base = baseline_memory(g);
    let n = g.nodes.len();
    let top = base.iter().copied().max().unwrap_or(0);
    let unit = (if min_peak { top } else { budget } / 200_000).max(1) as f64;
    // Rows: one per stretch where the spanning set is constant (its highest
    // node), plus every gap end (which carries closure bytes).
    let mut boundary = vec![false; n + 1];
    let mut extra_at: Vec<Vec<usize>> = vec![Vec::new(); n];
    // Held inputs: (gap, bytes) per node where a held-input gap keeps them.
    let mut hold_at: Vec<Vec<(usize, u64)>> = vec![Vec::new(); n];
    for (k, gp) in gaps.list.iter().enumerate() {
        boundary[gp.a + 1] = true;
        boundary[gp.r] = true;
        extra_at[gp.r].push(k);
        for &u in &gp.hold {
            let from = gaps.readers[u].last().map_or(gp.r, |&l| l + 1);
            boundary[from] = true;
            boundary[gp.r + 1] = true;
            for at in &mut hold_at[from..=gp.r] {
                at.push((k, g.values[u].bytes));
            }
        }
    }
    // A pair (k, h) both dropped: h's value is recomputed at k's end and stays
    // until h's end.
    let pairs = gaps.pairs(g);
    let mut pairs_at: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, &(k, h)) in pairs.iter().enumerate() {
        let (from, to) = (gaps.list[k].r, gaps.list[h].r.max(gaps.list[k].r + 1));
        for at in &mut pairs_at[from..to] {
            at.push(i);
        }
    }
    let pair_bytes = |i: usize, t: NodeId| -> u64 {
        let (k, h) = pairs[i];
        let h = &gaps.list[h];
        g.values[h.v].bytes + if t == gaps.list[k].r { h.extra } else { 0 }
    };
    let mut rows: Vec<NodeId> = Vec::new();
    let mut seg_best: Option<NodeId> = None;
    for t in 0..n {
        if boundary[t] {
            if let Some(s) = seg_best.take() {
                rows.push(s);
            }
        }
        if !extra_at[t].is_empty() {
            rows.push(t);
        }
        if seg_best.is_none_or(|s| base[t] > base[s]) {
            seg_best = Some(t);
        }
    }
    if let Some(s) = seg_best {
        rows.push(s);
    }
    rows.sort_unstable();
    rows.dedup();
    // Spanning gaps per row, by sweeping gaps sorted by start.
    let mut by_start: Vec<usize> = (0..gaps.list.len()).collect();
    by_start.sort_by_key(|&k| gaps.list[k].a);

    // What a row holds beyond the baseline when its gaps are dropped.
    let row_extra = |t: NodeId| -> u64 {
        extra_at[t].iter().map(|&k| gaps.list[k].extra).sum::<u64>()
            + pairs_at[t].iter().map(|&i| pair_bytes(i, t)).sum::<u64>()
            + hold_at[t].iter().map(|&(_, b)| b).sum::<u64>()
    };

    let mut cut = 0u64;
    let mut last = None;
    // CBC's limit: 85 % of what is left past its grace, none under 100 ms. Wall
    // time then stays within the deadline even if CBC overruns (root LP).
    let grace = Duration::from_millis(300);
    let cbc_limit = || {
        let left = deadline.saturating_duration_since(Instant::now());
        left.checked_sub(grace)
            .map(|l| l.mul_f64(0.85))
            .filter(|&l| l >= Duration::from_millis(100))
    };
    for _ in 0..6 {
        let b_eff = budget.saturating_sub(cut);
        // With no time for CBC, building the model (a quarter of a second on
        // GPT-2's 1,700 gaps) would be wasted. Only the answer that needs no solve
        // is given then: nothing dropped, where no row is over the budget.
        if cbc_limit().is_none() {
            if !min_peak && rows.iter().all(|&t| base[t] + row_extra(t) <= b_eff) {
                return Some(vec![false; gaps.list.len()]);
            }
            break;
        }
        let mut vars = ProblemVariables::new();
        let x: Vec<Variable> = gaps
            .list
            .iter()
            .map(|_| vars.add(variable().binary()))
            .collect();
        let y: Vec<Variable> = pairs
            .iter()
            .map(|_| vars.add(variable().min(0.0).max(1.0)))
            .collect();
        let peak_var = vars.add(variable().min(0.0));
        let mut objective = Expression::default();
        if min_peak {
            objective.add_mul(1.0, peak_var);
        }
        let scale = gaps
            .list
            .iter()
            .map(|gp| gp.cost)
            .fold(0.0f64, f64::max)
            .max(f64::MIN_POSITIVE);
        let weight = if min_peak {
            1e-3 / gaps.list.len().max(1) as f64
        } else {
            1.0
        };
        for (k, gp) in gaps.list.iter().enumerate() {
            objective.add_mul(weight * gp.cost / scale, x[k]);
        }
        let mut cons = Vec::new();
        for (i, &(k, h)) in pairs.iter().enumerate() {
            cons.push((Expression::from(y[i]) - x[k] - x[h]).geq(-1.0));
        }
        // A gap is dropped at most one way.
        for (v, js) in gaps.early_at.iter().enumerate() {
            for (j, early) in js.iter().enumerate() {
                if early.len() + usize::from(gaps.at[v][j].is_some()) > 1 {
                    let mut e = Expression::default();
                    for &k in early.iter().chain(&gaps.at[v][j]) {
                        e.add_mul(1.0, x[k]);
                    }
                    cons.push(e.leq(1.0));
                }
            }
        }
        let mut active = Vec::new();
        let mut impossible = false;
        for &t in &rows {
            if !min_peak && base[t] + row_extra(t) <= b_eff {
                continue;
            }
            active.push(t);
            let mut e = Expression::default();
            let mut save_max = 0.0;
            for &k in &by_start {
                let gp = &gaps.list[k];
                if gp.a >= t {
                    break;
                }
                if gp.r > t {
                    let c = (g.values[gp.v].bytes as f64 / unit).floor();
                    if c > 0.0 {
                        e.add_mul(c, x[k]);
                        save_max += c;
                    }
                }
            }
            for &k in &extra_at[t] {
                if gaps.list[k].extra > 0 {
                    e.add_mul(-(gaps.list[k].extra as f64 / unit).ceil(), x[k]);
                }
            }
            for &i in &pairs_at[t] {
                e.add_mul(-(pair_bytes(i, t) as f64 / unit).ceil(), y[i]);
            }
            for &(k, b) in &hold_at[t] {
                e.add_mul(-(b as f64 / unit).ceil(), x[k]);
            }
            if min_peak {
                e.add_mul(1.0, peak_var);
                cons.push(e.geq((base[t] as f64 / unit).ceil()));
                continue;
            }
            let need = ((base[t] as f64 - b_eff as f64) / unit).ceil();
            if save_max < need {
                impossible = true;
                break;
            }
            cons.push(e.geq(need));
        }
        if impossible {
            return last;
        }
        if active.is_empty() {
            return Some(vec![false; gaps.list.len()]);
        }
        let mut problem = vars.minimise(objective).using(coin_cbc);
        for c in cons {
            problem.add_constraint(c);
        }
        let Some(limit) = cbc_limit() else {
            break;
        };
        let r = run_cbc(problem, limit, 50_000_000, grace);
        if r.columns.len() < gaps.list.len() || !r.objective.is_finite() {
            break;
        }
        let on: Vec<bool> = r.columns[..gaps.list.len()]
            .iter()
            .map(|&c| c > 0.5)
            .collect();
        let peak = replay(g, &gaps.plan(g, &on))
            .map(|r| r.peak_bytes)
            .unwrap_or(u64::MAX);
        if std::env::var_os("MEMPLAN_DEBUG").is_some() {
            let chosen: Vec<String> = (0..on.len())
                .filter(|&k| on[k])
                .map(|k| {
                    let gp = &gaps.list[k];
                    format!("v{}:{}-{}@{}h{:?}", gp.v, gp.a, gp.b, gp.r, gp.hold)
                })
                .collect();
            eprintln!(
                "  gap-milp cut {cut}: obj {:.4} peak {peak} {}",
                r.objective,
                chosen.join(" ")
            );
        }
        last = Some(on);
        if min_peak || peak <= budget || r.proven_infeasible {
            break;
        }
        cut += peak - budget;
    }
    last
}

/// Drops more gaps (cheapest per byte first, keeping each that lowers the peak)
/// until the plan fits, then undoes drops the budget does not need (most
/// expensive first), each step checked by replay.
pub(super) fn repair_and_prune(
    g: &RematGraph,
    gaps: &Gaps,
    mut on: Vec<bool>,
    budget: u64,
    deadline: Instant,
) -> Vec<bool> {
    let peak = |on: &[bool]| {
        replay(g, &gaps.plan(g, on))
            .map(|r| r.peak_bytes)
            .unwrap_or(u64::MAX)
    };
    on = targeted_repair(g, gaps, on, budget, deadline);
    let cur = peak(&on);
    if cur <= budget {
        let mut order: Vec<usize> = (0..gaps.list.len()).filter(|&k| on[k]).collect();
        order.sort_by(|&a, &b| gaps.list[b].cost.total_cmp(&gaps.list[a].cost));
        for k in order {
            if Instant::now() >= deadline {
                break;
            }
            on[k] = false;
            if peak(&on) > budget {
                on[k] = true;
            }
        }
    }
    on
}

/// Until the plan fits: replays it, finds the node where the peak is, and drops
/// the gap spanning that node that lowers the peak at the least cost per byte
/// (trying a few in that order). Stops when no such gap lowers the peak.
pub(super) fn targeted_repair(
    g: &RematGraph,
    gaps: &Gaps,
    mut on: Vec<bool>,
    budget: u64,
    deadline: Instant,
) -> Vec<bool> {
    const TRIES: usize = 24;
    let measure = |on: &[bool]| -> Option<(u64, NodeId)> {
        let plan = gaps.plan(g, on);
        let r = replay(g, &plan).ok()?;
        // The stage: the frontier of first computations at the peak.
        let mut frontier = 0;
        let mut stage = 0;
        for (k, op) in plan.iter().enumerate() {
            if let Instr::Compute(i) = *op {
                if i >= frontier {
                    frontier = i;
                    stage = i;
                } else {
                    stage = frontier + 1;
                }
            }
            if k == r.peak_at {
                break;
            }
        }
        Some((r.peak_bytes, stage.min(g.nodes.len().saturating_sub(1))))
    };
    let Some((mut cur, mut at)) = measure(&on) else {
        return on;
    };
    let ratio = |k: usize| gaps.list[k].cost / g.values[gaps.list[k].v].bytes.max(1) as f64;
    while cur > budget && Instant::now() < deadline {
        let mut cands: Vec<usize> = (0..gaps.list.len())
            .filter(|&k| !on[k] && gaps.list[k].a < at && at < gaps.list[k].r)
            .collect();
        cands.sort_by(|&a, &b| ratio(a).total_cmp(&ratio(b)));
        let mut moved = false;
        for &k in cands.iter().take(TRIES) {
            on[k] = true;
            match measure(&on) {
                Some((p, t)) if p < cur => {
                    cur = p;
                    at = t;
                    moved = true;
                    break;
                }
                _ => on[k] = false,
            }
        }
        if !moved {
            break;
        }
    }
    on
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::remat::graph::{RNode, RValue};

    /// `s` (dear) feeds `x`, read at node 2 and again at node 6; the peak is at
    /// nodes 3 and 4, while `big` is live; `s` is read for the last time at node 5.
    /// Recomputing `x` just before node 6 needs `s` again (cost 101); recomputing
    /// it before node 5, while `s` is still resident, costs 1.
    pub(crate) fn early_graph() -> RematGraph {
        let spec: [(&str, f64, u64, &[usize]); 7] = [
            ("s", 100.0, 1, &[]),
            ("x", 1.0, 10, &[0]),
            ("y", 1.0, 1, &[1]),
            ("big", 1.0, 50, &[2]),
            ("y2", 1.0, 1, &[3]),
            ("z", 1.0, 1, &[0, 4]),
            ("w", 1.0, 1, &[1, 5]),
        ];
        let mut g = RematGraph {
            name: "early".into(),
            nodes: Vec::new(),
            values: Vec::new(),
        };
        for (i, (name, cost, bytes, inputs)) in spec.into_iter().enumerate() {
            g.values.push(RValue {
                name: name.into(),
                bytes,
                producer: Some(i),
                fixed: false,
                held: false,
            });
            g.nodes.push(RNode {
                name: name.into(),
                cost,
                inputs: inputs.to_vec(),
                outputs: vec![i],
                backward: false,
                recomputable: true,
                op: String::new(),
            });
        }
        g
    }

    #[test]
    fn an_early_gap_recomputes_while_the_inputs_are_resident() {
        let g = early_graph();
        let gaps = Gaps::new(&g);
        let base = replay(&g, &g.no_recompute_plan()).unwrap();
        assert_eq!(base.peak_bytes, 62);
        // x's gap from node 2 to node 6: at 6 its closure needs s too; the early
        // gap recomputes x alone before node 5.
        let std = gaps.list.iter().position(|gp| gp.v == 1 && gp.r == gp.b);
        let early = gaps.list.iter().position(|gp| gp.v == 1 && gp.r < gp.b);
        let (std, early) = (std.unwrap(), early.unwrap());
        assert_eq!((gaps.list[std].a, gaps.list[std].b), (2, 6));
        assert_eq!(gaps.list[std].cost, 101.0);
        assert_eq!((gaps.list[early].r, gaps.list[early].cost), (5, 1.0));
        let mut on = vec![false; gaps.list.len()];
        on[early] = true;
        let r = replay(&g, &gaps.plan(&g, &on)).unwrap();
        assert_eq!((r.peak_bytes, r.recompute_cost), (52, 1.0));
        // The MILP picks the early gap at a budget only dropping x meets.
        let deadline = Instant::now() + Duration::from_secs(5);
        let on = gap_milp(&g, &gaps, 55, false, deadline).unwrap();
        let r = replay(&g, &gaps.plan(&g, &on)).unwrap();
        assert!(r.peak_bytes <= 55);
        assert_eq!(r.recompute_cost, 1.0);
    }
}
