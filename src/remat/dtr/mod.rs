//! Multiple and nested recomputation by simulation: the `dtr` candidates of the
//! default planner ([`super::portfolio`]).
//!
//! The gap MILP recomputes a value at most once per gap between uses and only just
//! before a use, from values that are live then. Tight budgets need more: a value
//! recomputed several times, from values that were themselves dropped and must be
//! recomputed first (nested). Rather than a larger formulation, this module plans
//! such schedules greedily, in the manner of Dynamic Tensor Rematerialization
//! (Kirisame et al., ICLR 2021), but offline, where the whole future is known:
//!
//! - Nodes run first in the graph's order (the order every bound of
//!   [`super::bounds`] assumes). Before node `t` runs, its inputs are made resident:
//!   a missing input's writer is run again, after (recursively) making *its* inputs
//!   resident. Inputs already resident are pinned first; missing ones are made
//!   resident in Sethi–Ullman order (the one needing the most transient memory
//!   first), each pinned once resident, so a recursion never evicts what its caller
//!   is holding. Rules that pin *lazily* ([`Heuristic::lazy`]) take the resident
//!   inputs in that order too, pinning each at its turn: one that is cheap to
//!   rebuild may then be evicted while a sibling that needs more memory is rebuilt,
//!   and rebuilt after it. That is how a node's inputs are best made resident from
//!   nothing; it costs more recomputation and reaches lower peaks (random layered
//!   n250, runs aimed at 80 %: 80.0 % with the cost and the memory rules pinning
//!   lazily, 98.3 % and 93.8 % with the same rules pinning first).
//! - Before any node allocates its outputs, values are evicted (freed) while the
//!   memory would exceed the budget: the resident, unpinned value with the smallest
//!   score `c / (bytes · dist^a · stale^b)`, where `c` is the cost of running its
//!   writer again plus the writers of that writer's evicted inputs (DTR's evicted
//!   neighbourhood, one level), `dist` how many nodes ahead its next use in the
//!   schedule is (Belady's rule; DTR has no future to look at and uses staleness
//!   alone), and `stale` the time since it was last used. Values nothing in the
//!   schedule reads again go first; missing inputs of a node being prepared that
//!   became resident on the way (a shared ancestor, a skip connection) go last, so
//!   that they are not recomputed once per path (exponential in depth). Fixed and
//!   held values, and the outputs of nodes that cannot run twice, are never
//!   evicted.
//! - When nothing can be evicted the node runs over budget: the plan's peak, as
//!   [`replay`] measures it, says so. Run at the memory floor this gives the lowest
//!   peak the simulation reaches.
//! - The plan is then *tightened*: every value is freed right after its last read
//!   before it is freed, written again or the plan ends. That lowers the peak and
//!   never the cost; it is why the simulation is also run at budgets a little above
//!   the one asked. A plan within the budget then goes through [`unrecompute`],
//!   which keeps resident the outputs of any re-run the budget can afford to skip.
//! - Runs that aim at a plan within the budget are *strict*: they stop at the first
//!   overflow (and after 30 runs per node), so a thrashing run costs little. When
//!   none fits, a keep set is learnt: the inputs the overflowing node was missing
//!   are never evicted in the next run, until one fits or nothing new is blamed.
//!
//! Why this method: it handles any DAG, any number of recomputations and any
//! nesting at `O(plan · resident)` time (milliseconds at 1000 nodes), needs no
//! solver, and every plan it makes is an ordinary [`Instr`] list checked by
//! [`replay`]. Its plans are not optimal, which is why it is one candidate among
//! the gap MILP and Checkmate's MILP; the cheapest replayed plan wins. The
//! heuristic parameters are a small grid ([`HEURISTICS`]), then random ones
//! ([`RANDOM_RUNS`]), then a local search from the best of those (per-value score
//! factors mutated a few at a time, a change kept when the run is no worse, until
//! [`STALL`] tries bring no gain), within the share of the time limit the
//! portfolio gives it.
//! Where it fails (random layered graphs at 70 % and below, whose nodes read up to
//! 44 values across 20 layers) recomputing a dropped input needs a deep recursion
//! with its siblings held, and the greedy eviction does not foresee it; below
//! about 75 % on n1000 every rule's run rebuilds shared ancestors once per path
//! and does not end (exponential in depth). When no run fits, the runs for the
//! lowest peak aim a little under the lowest peak found so far, lower while that
//! brings it down, rather than at the floor alone, where large graphs thrash.

// Node and value indices address several per-node tables at once.
#![allow(clippy::needless_range_loop)]

use std::time::Instant;

use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};

mod rules;
pub use rules::{Heuristic, Weight, HEURISTICS, LAZY_COST, LAZY_MEMORY};
use rules::{LAZY, PEAK_RULES};

/// Facts about the graph that every run shares.
pub struct Prepared {
    readers: Vec<Vec<NodeId>>,
    /// Per value: transient memory to make it resident from nothing (Sethi–Ullman
    /// estimate), minus its own bytes: the order key for missing inputs.
    su_key: Vec<u64>,
    /// Per value: that transient memory itself.
    need: Vec<u64>,
    /// Per value: may be evicted (not fixed or held; its writer can run again).
    evictable: Vec<bool>,
    /// Per value: may be freed once nothing in the schedule reads it again.
    freeable_dead: Vec<bool>,
    /// Per node: its inputs, deduplicated.
    inputs: Vec<Vec<ValueId>>,
    /// Tie-break added to every recompute cost (sources may cost 0).
    eps: f64,
}

impl Prepared {
    /// Precomputes the tables for `g`.
    pub fn new(g: &RematGraph) -> Prepared {
        let readers = g.readers();
        let inputs: Vec<Vec<ValueId>> = g
            .nodes
            .iter()
            .map(|n| {
                let mut v = n.inputs.clone();
                v.sort_unstable();
                v.dedup();
                v
            })
            .collect();
        let evictable: Vec<bool> = g
            .values
            .iter()
            .map(|v| !v.fixed && !v.held && v.producer.is_some_and(|p| g.nodes[p].recomputable))
            .collect();
        // A value whose writer cannot run again may be freed when dead only if no
        // reader that may be recomputed later needs it.
        let freeable_dead: Vec<bool> = (0..g.values.len())
            .map(|v| {
                let val = &g.values[v];
                !val.fixed
                    && !val.held
                    && (evictable[v] || readers[v].iter().all(|&r| !g.nodes[r].recomputable))
            })
            .collect();
        // Memory to materialise each value from nothing (all evictable values gone).
        let mut need = vec![0u64; g.values.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            let mut ins: Vec<(u64, u64)> = inputs[i]
                .iter()
                .map(|&u| {
                    let b = g.values[u].bytes;
                    if evictable[u] {
                        (need[u].max(b), b)
                    } else {
                        (0, 0)
                    }
                })
                .collect();
            ins.sort_by_key(|a| std::cmp::Reverse(a.0 - a.1));
            let (mut held, mut peak) = (0u64, 0u64);
            for &(nd, b) in &ins {
                peak = peak.max(held + nd);
                held += b;
            }
            let out: u64 = n.outputs.iter().map(|&o| g.values[o].bytes).sum();
            peak = peak.max(held + out);
            for &o in &n.outputs {
                need[o] = peak;
            }
        }
        let su_key = (0..g.values.len())
            .map(|v| need[v].saturating_sub(g.values[v].bytes))
            .collect();
        let mean = g.base_cost() / g.nodes.len().max(1) as f64;
        Prepared {
            readers,
            su_key,
            need,
            evictable,
            freeable_dead,
            inputs,
            eps: (mean * 1e-6).max(f64::MIN_POSITIVE),
        }
    }
}

impl Prepared {
    /// The memory that making `v` resident from nothing needs (every evictable
    /// value gone, its writer's inputs rebuilt one after another in Sethi–Ullman
    /// order, each kept until the writer runs), its own bytes included; inputs
    /// that cannot be evicted (fixed or held values, outputs of nodes that cannot
    /// run again) are not counted. Where every value is evictable and none is
    /// fixed (the benchmark graphs), the largest over the values is therefore a
    /// peak that some schedule stays within (each node in turn computed from
    /// nothing): an upper bound on the lowest peak, reached by a schedule that may
    /// be exponentially long.
    pub fn need_from_nothing(&self, v: ValueId) -> u64 {
        self.need[v]
    }

    /// A peak that some schedule of `g` (the graph these tables were made for) stays
    /// within, known without planning: each node in turn computed from nothing, its
    /// inputs rebuilt as [`Self::need_from_nothing`] says, and everything neither
    /// fixed nor held freed after it; fixed values and the held values written so far
    /// stay resident. Only where every value is fixed, held or evictable (the
    /// benchmark graphs; `None` elsewhere). The schedule may be exponentially long
    /// (a shared ancestor is rebuilt once per path to it): it proves a budget
    /// feasible, and is no plan.
    pub fn from_nothing_peak(&self, g: &RematGraph) -> Option<u64> {
        let mut kept = 0u64;
        for (v, val) in g.values.iter().enumerate() {
            if val.fixed || val.held {
                kept = kept.saturating_add(val.bytes);
            } else if !self.evictable[v] {
                return None;
            }
        }
        let most = self.need.iter().copied().max().unwrap_or(0);
        Some(kept.saturating_add(most))
    }
}

/// Deepest nesting of recomputations a run may reach (a run that needs more
/// fails): keeps the recursion well within a test thread's 2 MiB stack.
pub const MAX_DEPTH: usize = 1500;

/// `x^e`, without `powf` for the exponents of [`HEURISTICS`] that need none.
fn pow(x: f64, e: f64) -> f64 {
    if e == 0.0 {
        1.0
    } else if e == 1.0 {
        x
    } else if e == 2.0 {
        x * x
    } else {
        x.powf(e)
    }
}

/// Simulation state of one run.
struct Sim<'a> {
    g: &'a RematGraph,
    pr: &'a Prepared,
    h: Heuristic,
    /// Per-value factors on the score (empty: none), for the randomised runs.
    noise: &'a [f64],
    /// Values never evicted (kept from their write to their last use).
    protect: &'a [bool],
    /// Stop at the first overflow (the budget cannot be kept), blaming the
    /// inputs the current node was missing.
    strict: bool,
    /// Inputs of the current node of the schedule that were not resident.
    missing_now: Vec<ValueId>,
    /// Set on a strict run's overflow.
    blame: Option<Vec<ValueId>>,
    budget: u64,
    live: Vec<bool>,
    pins: Vec<u32>,
    /// Inputs of the nodes being prepared that are not pinned yet (the missing
    /// ones; with lazy pinning the resident ones waiting their turn too): when one
    /// is resident, or becomes resident on the way (a shared ancestor), it is
    /// evicted last, so that a skip connection is not recomputed twice per level
    /// (exponential in depth).
    wanted: Vec<u32>,
    last_use: Vec<u64>,
    /// Live, non-fixed values, and each one's position in it.
    resident: Vec<ValueId>,
    pos: Vec<usize>,
    clock: u64,
    cur: u64,
    step: NodeId,
    plan: Vec<Instr>,
    computes: usize,
    cap: usize,
    deadline: Option<Instant>,
    /// Nesting of [`Sim::run`] (bounded by [`MAX_DEPTH`]).
    depth: usize,
}

impl Sim<'_> {
    fn alloc(&mut self, v: ValueId) {
        if self.live[v] {
            return;
        }
        self.live[v] = true;
        self.cur += self.g.values[v].bytes;
        self.pos[v] = self.resident.len();
        self.resident.push(v);
    }

    fn free(&mut self, v: ValueId) {
        if !self.live[v] || self.g.values[v].fixed {
            return;
        }
        self.live[v] = false;
        self.cur -= self.g.values[v].bytes;
        let p = self.pos[v];
        self.resident.swap_remove(p);
        if let Some(&w) = self.resident.get(p) {
            self.pos[w] = p;
        }
        self.pos[v] = usize::MAX;
        self.plan.push(Instr::Free(v));
    }

    /// Next reader of `v` in the schedule at or after node `t`.
    fn next_use(&self, v: ValueId, t: NodeId) -> Option<NodeId> {
        let rs = &self.pr.readers[v];
        rs.get(rs.partition_point(|&r| r < t)).copied()
    }

    fn score(&self, v: ValueId) -> f64 {
        let g = self.g;
        let bytes = g.values[v].bytes.max(1) as f64;
        let stale = (self.clock - self.last_use[v]) as f64 + 1.0;
        let Some(next) = self.next_use(v, self.step) else {
            // Nothing reads it again: first out, the largest and stalest first.
            return -bytes * stale;
        };
        let p = g.values[v]
            .producer
            .expect("evictable values have a writer");
        let mut c = self.pr.eps;
        if self.h.weight == Weight::Memory {
            c = self.pr.need[v] as f64;
        } else if self.h.weight == Weight::Cost {
            c += g.nodes[p].cost;
            for &u in &self.pr.inputs[p] {
                if !self.live[u] {
                    if let Some(q) = g.values[u].producer {
                        c += g.nodes[q].cost;
                    }
                }
            }
        }
        let dist = (next - self.step) as f64 + 1.0;
        let f = self.noise.get(v).copied().unwrap_or(1.0);
        f * c / (bytes * pow(dist, self.h.dist_exp) * pow(stale, self.h.stale_exp))
    }

    /// Evicts until `need` more bytes fit (or nothing more can go).
    fn make_room(&mut self, need: u64) {
        while self.cur + need > self.budget {
            let mut best: Option<(bool, f64, ValueId)> = None;
            for &v in &self.resident {
                if self.pins[v] > 0
                    || !self.pr.evictable[v]
                    || self.protect.get(v).copied().unwrap_or(false)
                {
                    continue;
                }
                let key = (self.wanted[v] > 0, self.score(v));
                if best.is_none_or(|(w, b, _)| key < (w, b)) {
                    best = Some((key.0, key.1, v));
                }
            }
            match best {
                Some((_, _, v)) => self.free(v),
                None => {
                    if self.strict {
                        self.blame = Some(self.missing_now.clone());
                    }
                    return;
                }
            }
        }
    }

    fn late(&self) -> bool {
        self.blame.is_some()
            || self.computes > self.cap
            || (self.computes % 256 == 0 && self.deadline.is_some_and(|d| Instant::now() >= d))
    }

    /// Makes `v` resident; false when it cannot be (or the run is out of time).
    fn materialize(&mut self, v: ValueId) -> bool {
        if self.live[v] {
            self.last_use[v] = self.clock;
            return true;
        }
        let g = self.g;
        match g.values[v].producer {
            Some(p) if g.nodes[p].recomputable => self.run(p),
            _ => false,
        }
    }

    /// Runs node `p` (first run or again), making its inputs resident first.
    fn run(&mut self, p: NodeId) -> bool {
        if self.late() || self.depth >= MAX_DEPTH {
            return false;
        }
        self.depth += 1;
        let ok = self.run_inner(p);
        self.depth -= 1;
        ok
    }

    fn run_inner(&mut self, p: NodeId) -> bool {
        let (g, pr) = (self.g, self.pr);
        let ins = &pr.inputs[p];
        let mut pinned: Vec<ValueId> = Vec::with_capacity(ins.len());
        let lazy = self.h.lazy;
        if !lazy {
            for &u in ins {
                if self.live[u] {
                    self.pins[u] += 1;
                    pinned.push(u);
                }
            }
        }
        // The inputs still to pin, in turn: the missing ones, or with lazy pinning
        // every one (a resident one is pinned at its turn, or rebuilt then if it was
        // evicted meanwhile).
        let mut order: Vec<ValueId> = ins
            .iter()
            .copied()
            .filter(|&u| lazy || !self.live[u])
            .collect();
        order.sort_by_key(|&u| std::cmp::Reverse(pr.su_key[u]));
        for &u in &order {
            self.wanted[u] += 1;
        }
        let mut ok = true;
        for (k, &u) in order.iter().enumerate() {
            self.wanted[u] -= 1;
            if !self.materialize(u) {
                for &w in &order[k + 1..] {
                    self.wanted[w] -= 1;
                }
                ok = false;
                break;
            }
            self.pins[u] += 1;
            pinned.push(u);
        }
        if ok {
            let need: u64 = g.nodes[p]
                .outputs
                .iter()
                .filter(|&&o| !self.live[o])
                .map(|&o| g.values[o].bytes)
                .sum();
            self.make_room(need);
            self.plan.push(Instr::Compute(p));
            self.computes += 1;
            self.clock += 1;
            for &o in &g.nodes[p].outputs {
                self.alloc(o);
                self.last_use[o] = self.clock;
            }
            for &u in ins {
                self.last_use[u] = self.clock;
            }
        }
        for u in pinned {
            self.pins[u] -= 1;
        }
        ok
    }
}

/// Plans `g` by simulation with rule `h` under `budget` bytes; the plan is
/// tightened ([`tighten`]). `None` when the run exceeds `cap` node runs or the
/// deadline. The plan may exceed the budget where nothing could be evicted.
pub fn simulate(
    g: &RematGraph,
    pr: &Prepared,
    h: Heuristic,
    budget: u64,
    cap: usize,
    deadline: Option<Instant>,
) -> Option<Vec<Instr>> {
    simulate_noisy(g, pr, h, &[], false, budget, cap, deadline)
}

/// [`simulate`] with each value's score multiplied by `noise[v]` (empty: 1).
#[allow(clippy::too_many_arguments)]
fn simulate_noisy(
    g: &RematGraph,
    pr: &Prepared,
    h: Heuristic,
    noise: &[f64],
    strict: bool,
    budget: u64,
    cap: usize,
    deadline: Option<Instant>,
) -> Option<Vec<Instr>> {
    simulate_with(g, pr, h, noise, &[], strict, budget, cap, deadline).ok()
}

/// Why a run gave no plan.
struct Fail {
    /// A strict run overflowed, and these inputs of the node then running were
    /// missing; `None`: out of node runs or time, or a value could not be made
    /// resident.
    blame: Option<Vec<ValueId>>,
    /// The node of the schedule that was being run (how far the run got).
    step: NodeId,
}

/// One run.
#[allow(clippy::too_many_arguments)]
fn simulate_with(
    g: &RematGraph,
    pr: &Prepared,
    h: Heuristic,
    noise: &[f64],
    protect: &[bool],
    strict: bool,
    budget: u64,
    cap: usize,
    deadline: Option<Instant>,
) -> Result<Vec<Instr>, Fail> {
    let nv = g.values.len();
    let mut s = Sim {
        g,
        pr,
        h,
        noise,
        protect,
        strict,
        missing_now: Vec::new(),
        blame: None,
        budget,
        live: vec![false; nv],
        pins: vec![0; nv],
        wanted: vec![0; nv],
        last_use: vec![0; nv],
        resident: Vec::new(),
        pos: vec![usize::MAX; nv],
        clock: 0,
        cur: 0,
        step: 0,
        plan: Vec::with_capacity(g.nodes.len() * 3),
        computes: 0,
        cap,
        deadline,
        depth: 0,
    };
    for (v, val) in g.values.iter().enumerate() {
        if val.fixed {
            s.live[v] = true;
            s.cur += val.bytes;
        }
    }
    let mut dead: Vec<ValueId> = Vec::new();
    for t in 0..g.nodes.len() {
        s.step = t;
        let mark = s.plan.len();
        s.missing_now.clear();
        s.missing_now
            .extend(pr.inputs[t].iter().copied().filter(|&u| !s.live[u]));
        if !s.run(t) {
            return Err(Fail {
                blame: s.blame.take(),
                step: t,
            });
        }
        s.step = t + 1;
        // Values nothing in the schedule reads after t: freed now when eager (or
        // when they may not be evicted), else left first in line for eviction.
        dead.clear();
        for op in &s.plan[mark..] {
            if let Instr::Compute(p) = *op {
                dead.extend(pr.inputs[p].iter().chain(&g.nodes[p].outputs));
            }
        }
        dead.sort_unstable();
        dead.dedup();
        for &v in &dead {
            if s.live[v]
                && pr.freeable_dead[v]
                && (h.eager || !pr.evictable[v])
                && s.next_use(v, t + 1).is_none()
            {
                s.free(v);
            }
        }
    }
    Ok(tighten(g, &s.plan))
}

/// The same computes, with every value freed right after its last read before it
/// is written again or the plan ends (right after it is written if never read);
/// fixed and held values are never freed. The peak can only fall, the cost is
/// unchanged.
pub fn tighten(g: &RematGraph, plan: &[Instr]) -> Vec<Instr> {
    let mut needed = vec![false; g.values.len()];
    // Frees to insert after each compute, built backwards.
    let mut after: Vec<Vec<ValueId>> = Vec::new();
    let computes: Vec<NodeId> = plan
        .iter()
        .filter_map(|op| match *op {
            Instr::Compute(p) => Some(p),
            Instr::Free(_) | Instr::Load(_) => None,
        })
        .collect();
    let keep = |v: ValueId| g.values[v].fixed || g.values[v].held;
    for &p in computes.iter().rev() {
        let node = &g.nodes[p];
        let mut fr = Vec::new();
        for &o in &node.outputs {
            if !needed[o] && !keep(o) && !fr.contains(&o) {
                fr.push(o);
            }
            needed[o] = false;
        }
        for &u in &node.inputs {
            if !needed[u] && !keep(u) && !fr.contains(&u) {
                fr.push(u);
            }
            needed[u] = true;
        }
        after.push(fr);
    }
    after.reverse();
    let mut out = Vec::with_capacity(plan.len());
    for (k, &p) in computes.iter().enumerate() {
        out.push(Instr::Compute(p));
        out.extend(after[k].iter().map(|&v| Instr::Free(v)));
    }
    out
}

/// Undoes recomputations the budget does not need: a node run again whose outputs
/// could instead stay resident since they were freed (the memory over that stretch
/// plus their bytes within `budget`) is not run again, and its outputs are not
/// freed; the most expensive first. The result is tightened. Every removal keeps
/// the plan valid (the outputs are resident wherever the removed run made them
/// so) and the peak within `budget` if it was.
pub fn unrecompute(g: &RematGraph, plan: &[Instr], budget: u64) -> Vec<Instr> {
    let n = plan.len();
    // Memory right after each instruction, as replay counts it.
    let mut mem = vec![0u64; n];
    let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    let mut cur = g.fixed_bytes();
    let mut prev = vec![usize::MAX; n];
    let mut last_run = vec![usize::MAX; g.nodes.len()];
    // Per value, its frees in plan order.
    let mut frees: Vec<Vec<usize>> = vec![Vec::new(); g.values.len()];
    for (k, op) in plan.iter().enumerate() {
        match *op {
            Instr::Compute(p) => {
                prev[k] = last_run[p];
                last_run[p] = k;
                for &o in &g.nodes[p].outputs {
                    if !live[o] {
                        live[o] = true;
                        cur += g.values[o].bytes;
                    }
                }
            }
            Instr::Free(v) => {
                if live[v] {
                    live[v] = false;
                    cur -= g.values[v].bytes;
                }
                frees[v].push(k);
            }
            Instr::Load(v) => {
                if !live[v] {
                    live[v] = true;
                    cur += g.values[v].bytes;
                }
            }
        }
        mem[k] = cur;
    }
    let mut runs: Vec<usize> = (0..n).filter(|&k| prev[k] != usize::MAX).collect();
    let cost = |k: usize| match plan[k] {
        Instr::Compute(p) => g.nodes[p].cost,
        Instr::Free(_) | Instr::Load(_) => 0.0,
    };
    runs.sort_by(|&a, &b| cost(b).total_cmp(&cost(a)).then(a.cmp(&b)));
    let mut removed = vec![false; n];
    let mut stretch: Vec<(usize, u64)> = Vec::new();
    for k in runs {
        let Instr::Compute(p) = plan[k] else { continue };
        // The latest run of p before k that is still in the plan.
        let mut j = prev[k];
        while j != usize::MAX && removed[j] {
            j = prev[j];
        }
        if j == usize::MAX {
            continue;
        }
        stretch.clear();
        for &o in &g.nodes[p].outputs {
            let fs = &frees[o];
            let a = fs.partition_point(|&f| f <= j);
            let b = fs.partition_point(|&f| f < k);
            // Its first free still in the plan between the two runs.
            if let Some(&f) = fs[a..b].iter().find(|&&f| !removed[f]) {
                stretch.push((f, g.values[o].bytes));
            }
        }
        let fits = stretch.iter().all(|&(f, _)| {
            (f..k).all(|x| {
                let extra: u64 = stretch
                    .iter()
                    .filter(|&&(f2, _)| f2 <= x)
                    .map(|&(_, b)| b)
                    .sum();
                mem[x] + extra <= budget
            })
        });
        if !fits {
            continue;
        }
        removed[k] = true;
        for &(f, b) in &stretch {
            removed[f] = true;
            for m in &mut mem[f..k] {
                *m += b;
            }
        }
    }
    let kept: Vec<Instr> = (0..n).filter(|&k| !removed[k]).map(|k| plan[k]).collect();
    tighten(g, &kept)
}

/// What [`plans`] found.
pub struct DtrPlans {
    /// The cheapest plan within the budget, if any.
    pub cheapest: Option<Vec<Instr>>,
    /// The plan with the lowest peak.
    pub lowest: Option<Vec<Instr>>,
}

/// Strict runs that learn which values to keep, at most, per rule.
pub const PROTECT_ROUNDS: usize = 200;

/// Random runs after the grid, at most.
pub const RANDOM_RUNS: usize = 200;

/// A small deterministic generator (splitmix64), so that runs repeat.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Runs every rule of [`HEURISTICS`] at `budget` and at a few budgets above it
/// (tightening can bring those plans under it); when nothing fits, learns a keep
/// set, then runs that may exceed the budget (for the lowest peak); then up to
/// [`RANDOM_RUNS`] runs with random exponents, budgets and per-value score noise,
/// until `deadline`. Plans within the budget go through [`unrecompute`]. Returns
/// the cheapest plan within `budget` and the lowest-peak plan, both replayed.
pub fn plans(g: &RematGraph, budget: u64, deadline: Instant) -> DtrPlans {
    plans_for(g, budget, false, deadline)
}

/// [`plans`]; with `peak_only`, only the runs for the lowest peak (when the caller
/// knows no plan meets its own budget and asks at the floor for the report).
pub fn plans_for(g: &RematGraph, budget: u64, peak_only: bool, deadline: Instant) -> DtrPlans {
    let pr = Prepared::new(g);
    // Runs for a plan within the budget stop past 30 runs per node (a thrashing
    // run is no use); runs for the lowest peak may go much further.
    let cap = 30 * g.nodes.len() + 1000;
    let long_cap = 200 * g.nodes.len() + 200_000;
    let mut best = Best::default();
    let scaled = |s: f64| (budget as f64 * s) as u64;
    // The phases that look for a plan within the budget stop at this.
    let search_end = if peak_only { Instant::now() } else { deadline };
    // The rules that failed least often on the benchmark graphs first.
    for k in [0, 8, 4, 9, 3, 1, 2, 5, 6, 7, 10, 11] {
        let h = HEURISTICS[k];
        if Instant::now() >= search_end {
            break;
        }
        // Strict: a run that overflows the budget stops there (its plan would not
        // fit), which keeps hopeless runs from thrashing.
        if let Some(p) = simulate_noisy(g, &pr, h, &[], true, budget, cap, Some(deadline)) {
            best.consider(g, budget, p);
        }
    }
    // Above the budget only the cost rules, and only once something fitted (a run
    // that overflowed at the budget overflows above it too).
    if best.cheapest.is_some() {
        for s in [1.04, 1.12] {
            for h in HEURISTICS.iter().filter(|h| h.weight == Weight::Cost) {
                if Instant::now() >= search_end {
                    break;
                }
                let b = scaled(s);
                if let Some(p) = simulate_noisy(g, &pr, *h, &[], true, b, cap, Some(deadline)) {
                    best.consider(g, budget, p);
                }
            }
        }
    }
    // Nothing fitted: learn which values to keep. Each strict run stops at the
    // first node whose missing inputs cannot be made resident within the budget;
    // those inputs are kept from then on (checkpoints), and the run repeats.
    if best.cheapest.is_none() {
        for h in [HEURISTICS[0], HEURISTICS[8]] {
            let mut protect = vec![false; g.values.len()];
            for _ in 0..PROTECT_ROUNDS {
                if Instant::now() >= search_end {
                    break;
                }
                match simulate_with(g, &pr, h, &[], &protect, true, budget, cap, Some(deadline)) {
                    Ok(p) => {
                        best.consider(g, budget, p);
                        break;
                    }
                    Err(Fail {
                        blame: Some(blame), ..
                    }) if blame.iter().any(|&v| !protect[v]) => {
                        for v in blame {
                            protect[v] = true;
                        }
                    }
                    Err(_) => break,
                }
            }
        }
    }
    // Still nothing within the budget: runs that go over where they must, for the
    // lowest peak (before the random runs, which may not leave them time).
    if best.cheapest.is_none() {
        // Aiming a little above the budget overflows less deep on some graphs.
        // These runs get at most half of the time left: where they thrash, the
        // runs below need it.
        let now = Instant::now();
        let half = now + deadline.saturating_duration_since(now) / 2;
        'floor: for s in [1.2, 1.0, 1.1] {
            for k in PEAK_RULES {
                if !peak_run(g, &pr, &mut best, budget, k, scaled(s), long_cap, half) {
                    break 'floor;
                }
            }
        }
        // Runs aimed at the floor thrash (each node rebuilt from nothing) and stop
        // at the cap on large graphs; aim instead a little under the lowest peak
        // found, lower while that still brings it down. Where the runs so far
        // stopped at the cap or stayed high, first find a peak from nearer the top
        // (fractions of the no-recompute peak; the floor may be far below anything
        // reachable).
        let base = replay(g, &g.no_recompute_plan()).map_or(0, |r| r.peak_bytes);
        'seed: for f in [0.8, 0.9, 1.0] {
            let aim = (base as f64 * f) as u64;
            let low = best.lowest.as_ref().map_or(u64::MAX, |l| l.0);
            if aim <= budget || aim >= low {
                continue;
            }
            match lazy_runs(g, &pr, &mut best, budget, aim, long_cap, deadline) {
                None => break 'seed,
                Some(true) => break,
                Some(false) => {}
            }
        }
        let mut last = u64::MAX;
        'ladder: while let Some(low) = best.lowest.as_ref().map(|l| l.0) {
            if low >= last {
                break;
            }
            last = low;
            for f in [0.97, 0.93, 0.88] {
                let aim = (low as f64 * f) as u64;
                if aim <= budget {
                    break;
                }
                if lazy_runs(g, &pr, &mut best, budget, aim, long_cap, deadline).is_none() {
                    break 'ladder;
                }
            }
        }
        // The lazy rules aimed at the floor too (where they do not thrash).
        'lazy: for s in [1.2, 1.0, 1.1] {
            for k in LAZY {
                if !peak_run(g, &pr, &mut best, budget, k, scaled(s), long_cap, deadline) {
                    break 'lazy;
                }
            }
        }
    }
    let mut rng = Rng(0x5EED ^ g.nodes.len() as u64);
    // The parameters of the best run so far, where the search starts from: the
    // cheapest plan within the budget, or else the run that got furthest.
    let mut seed: Option<(Fitness, Params)> = None;
    for _ in 0..RANDOM_RUNS {
        if Instant::now() >= search_end {
            break;
        }
        let h = Heuristic {
            weight: match rng.unit() {
                x if x < 0.7 => Weight::Cost,
                x if x < 0.85 => Weight::Memory,
                _ => Weight::Size,
            },
            dist_exp: 2.5 * rng.unit(),
            stale_exp: if rng.unit() < 0.5 { 0.0 } else { rng.unit() },
            eager: rng.unit() < 0.3,
            lazy: false,
        };
        let sigma = 0.5 * rng.unit();
        // Log-uniform in [-sigma, sigma].
        let noise = (0..g.values.len())
            .map(|_| (sigma * (2.0 * rng.unit() - 1.0)).exp())
            .collect();
        let scale = if best.cheapest.is_some() {
            1.0 + 0.15 * rng.unit()
        } else {
            1.0
        };
        let p = Params { h, noise, scale };
        let f = p.run(g, &pr, &mut best, budget, cap, deadline);
        if seed.as_ref().is_none_or(|s| f > s.0) {
            seed = Some((f, p));
        }
    }
    if let Some((f, p)) = seed {
        local_search(g, &pr, &mut best, budget, cap, (f, p), &mut rng, search_end);
    }
    DtrPlans {
        cheapest: best.cheapest.map(|c| c.2),
        lowest: best.lowest.map(|c| c.2),
    }
}

/// One run of rule `HEURISTICS[k]` for the lowest peak, aimed at `aim` bytes (it
/// goes over where it must); its plan, if any, goes to `best`. False, with nothing
/// run, once `until` has passed.
#[allow(clippy::too_many_arguments)]
fn peak_run(
    g: &RematGraph,
    pr: &Prepared,
    best: &mut Best,
    budget: u64,
    k: usize,
    aim: u64,
    cap: usize,
    until: Instant,
) -> bool {
    if Instant::now() >= until {
        return false;
    }
    if let Some(p) = simulate_noisy(g, pr, HEURISTICS[k], &[], false, aim, cap, Some(until)) {
        best.consider(g, budget, p);
    }
    true
}

/// [`peak_run`]s of the [`LAZY`] rules aimed at `aim`, each only where the one
/// before did not lower the lowest peak (a rule that thrashes takes the time to
/// its cap): whether one did, `None` once `until` has passed.
#[allow(clippy::too_many_arguments)]
fn lazy_runs(
    g: &RematGraph,
    pr: &Prepared,
    best: &mut Best,
    budget: u64,
    aim: u64,
    cap: usize,
    until: Instant,
) -> Option<bool> {
    let low = |b: &Best| b.lowest.as_ref().map_or(u64::MAX, |l| l.0);
    let before = low(best);
    for k in LAZY {
        if !peak_run(g, pr, best, budget, k, aim, cap, until) {
            return None;
        }
        if low(best) < before {
            return Some(true);
        }
    }
    Some(false)
}

/// The parameters of one randomised run.
#[derive(Clone)]
struct Params {
    h: Heuristic,
    /// Per-value factors on the score.
    noise: Vec<f64>,
    /// The run aims at the budget times this (tightening can bring the plan under).
    scale: f64,
}

/// How good a run was, ordered: a plan within the budget beats none, a cheaper
/// plan a dearer one, and a run that got further before overflowing one that
/// stopped sooner.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
enum Fitness {
    /// Stopped at this node of the schedule.
    Stopped(usize),
    /// Within the budget, at minus this cost (so that cheaper is greater).
    Fits(f64),
}

impl Params {
    /// One strict run; its plan, if any, goes to `best`.
    fn run(
        &self,
        g: &RematGraph,
        pr: &Prepared,
        best: &mut Best,
        budget: u64,
        cap: usize,
        deadline: Instant,
    ) -> Fitness {
        let b = (budget as f64 * self.scale) as u64;
        match simulate_with(
            g,
            pr,
            self.h,
            &self.noise,
            &[],
            true,
            b,
            cap,
            Some(deadline),
        ) {
            Ok(p) => match best.consider(g, budget, p) {
                Some(cost) => Fitness::Fits(-cost),
                // Within the aim but not the budget: as far as a run can get.
                None => Fitness::Stopped(g.nodes.len()),
            },
            Err(f) => Fitness::Stopped(f.step),
        }
    }
}

/// Mutations tried without improvement before the local search stops.
pub const STALL: usize = 1000;

/// A (1+1) local search over the randomised runs' parameters, from the best run of
/// the random phase: each step multiplies the score factors of a few values by a
/// random factor (the values whose order of eviction decides the plan are not
/// known in advance, so they are drawn at random), sometimes changes the distance
/// exponent or the budget aimed at, and keeps the change when the run is at least
/// as good ([`Fitness`]). It stops at `end` or after [`STALL`] steps without
/// improvement. The random phase samples parameters afresh each time; this phase
/// refines the best of them, which is what brings random layered graphs near
/// their optimum (the few decisive evictions are found one at a time).
#[allow(clippy::too_many_arguments)]
fn local_search(
    g: &RematGraph,
    pr: &Prepared,
    best: &mut Best,
    budget: u64,
    cap: usize,
    start: (Fitness, Params),
    rng: &mut Rng,
    end: Instant,
) {
    let cands: Vec<ValueId> = (0..g.values.len()).filter(|&v| pr.evictable[v]).collect();
    if cands.is_empty() {
        return;
    }
    let (mut cur_f, mut cur) = start;
    let mut stall = 0;
    while stall < STALL && Instant::now() < end {
        let mut p = cur.clone();
        let k = 1 + (rng.next() % 4) as usize;
        for _ in 0..k {
            let v = cands[(rng.next() % cands.len() as u64) as usize];
            p.noise[v] *= (1.5 * (2.0 * rng.unit() - 1.0)).exp();
        }
        if rng.unit() < 0.1 {
            p.h.dist_exp = (p.h.dist_exp + 0.6 * (rng.unit() - 0.5)).clamp(0.0, 3.0);
        }
        if matches!(cur_f, Fitness::Fits(_)) && rng.unit() < 0.1 {
            p.scale = (p.scale + 0.06 * (rng.unit() - 0.5)).clamp(1.0, 1.2);
        }
        let f = p.run(g, pr, best, budget, cap, end);
        if f > cur_f {
            stall = 0;
        } else {
            stall += 1;
        }
        if f >= cur_f {
            (cur_f, cur) = (f, p);
        }
    }
}

/// The best plans so far: (cost, peak, plan) within the budget, (peak, cost, plan)
/// overall.
#[derive(Default)]
struct Best {
    cheapest: Option<(f64, u64, Vec<Instr>)>,
    lowest: Option<(u64, f64, Vec<Instr>)>,
}

impl Best {
    /// Takes `p` into account; its cost (after [`unrecompute`]) when it fits.
    fn consider(&mut self, g: &RematGraph, budget: u64, p: Vec<Instr>) -> Option<f64> {
        let Ok(r) = replay(g, &p) else { return None };
        // Within the budget: drop the recomputations it does not need.
        let (p, r) = if r.peak_bytes <= budget && r.recompute_cost > 0.0 {
            let q = unrecompute(g, &p, budget);
            match replay(g, &q) {
                Ok(rq) if rq.peak_bytes <= budget && rq.recompute_cost <= r.recompute_cost => {
                    (q, rq)
                }
                _ => (p, r),
            }
        } else {
            (p, r)
        };
        if r.peak_bytes <= budget
            && self
                .cheapest
                .as_ref()
                .is_none_or(|c| (r.recompute_cost, r.peak_bytes) < (c.0, c.1))
        {
            self.cheapest = Some((r.recompute_cost, r.peak_bytes, p.clone()));
        }
        if self
            .lowest
            .as_ref()
            .is_none_or(|c| (r.peak_bytes, r.recompute_cost) < (c.0, c.1))
        {
            self.lowest = Some((r.peak_bytes, r.recompute_cost, p));
        }
        (r.peak_bytes <= budget).then_some(r.recompute_cost)
    }
}
