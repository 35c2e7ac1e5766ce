//! Plans for tight budgets by searching the *reverse* pebble game: the `chain`
//! candidate of the default planner ([`super::portfolio`]).
//!
//! Look at any schedule at the moment a set `S` of values is resident together,
//! say the end, where every unread output is. One of them was computed last, by node
//! `p`; just before that, `S` without `p`'s outputs and with `p`'s inputs was
//! resident, and since no member of that set was computed in between, it was
//! resident together when its own last member was computed. So a schedule is a
//! *chain* of sets, each obtained from the one after it by taking a node's outputs
//! out and putting its inputs in, down to the empty set; the step that computes `p`
//! holds the earlier set and `p`'s outputs. Read forwards, a chain is a plan: run
//! the nodes in the reverse of the order they were taken, freeing each value after
//! its last read ([`super::dtr::tighten`]). Conversely every plan gives a chain, so
//! searching chains whose every step fits the budget is complete; a node taken
//! several times is recomputed, nested to any depth.
//!
//! The search is depth-first from the unread outputs, trying first the node latest
//! in the graph's order (that alone retraces the no-recompute plan backwards), then
//! the others, each only if its step fits; sets already explored are not explored
//! again (a 128-bit hash of the set). It stops at the first chain that fits, at
//! the deadline or after [`MAX_STATES`] sets.
//!
//! When it explores every set reachable within the budget and none leads to the
//! empty set, that is a proof that no schedule fits, where the graph has one
//! unread value (every schedule computes it, and the chain from that moment starts
//! at it) and every node one output (a step holds exactly what the chain counts):
//! [`exhaustion_proves`]. (Sets are told apart by a 128-bit hash; two sets with one
//! hash would wrongly be taken as explored, at odds of about 2^-80 at the state
//! limit.) On resnet50's benchmark graph that settles the lowest
//! peak: a chain at 4,110,417,920 bytes (1.111x the op-local bound), none at one
//! byte less (about 18 s). Such proofs are reported as `proven_floor_bytes`
//! beside the static floor.
//!
//! Why this method: the forward simulation ([`super::dtr`]) decides evictions
//! greedily and, on the random layered graphs below 75 % of their peak, rebuilds
//! shared ancestors once per path and does not end; backwards, the set that must be
//! resident is known exactly at every step, and a step that would not fit is simply
//! not taken. It planned random layered n250 at 70 % in 430 steps, where every
//! forward rule had failed. Its plans recompute much (overhead 1.7 there); they are
//! a candidate for budgets nothing else meets, after [`super::dtr::unrecompute`]
//! has taken back what the budget affords. It applies where every node may run
//! again and nothing is held to the end (the benchmark graphs; training steps have
//! gradients and an optimizer that run once).

use std::collections::HashSet;
use std::time::Instant;

use super::dtr::{tighten, unrecompute};
use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};

/// Sets explored before the search gives up (the hash set takes about 30 bytes a
/// set, 0.6 GB at the limit, beside the path's copies of its sets).
pub const MAX_STATES: usize = 20_000_000;

/// The longest chain followed (each step holds a copy of its set and its
/// candidates, about 2 KB at 1000 nodes): a deeper search stops, unanswered.
pub const MAX_DEPTH: usize = 200_000;

/// Whether the search applies to `g`: every node may run again, no value is held,
/// and every node writes something.
pub fn applies(g: &RematGraph) -> bool {
    g.nodes
        .iter()
        .all(|n| n.recomputable && !n.outputs.is_empty())
        && g.values.iter().all(|v| !v.held)
}

/// Whether an exhausted search proves a budget impossible: besides [`applies`],
/// one value is unread, and has a writer (every schedule computes it, and the
/// chain from that moment is one the search explores), and every output of every
/// node is written by that node alone, is not fixed and is not also its input (so
/// a step holds at least what the chain counts).
pub fn exhaustion_proves(g: &RematGraph) -> bool {
    let unread = unread(g);
    // A value another node writes too would not be found by its producer.
    let mut writers = vec![0usize; g.values.len()];
    let outputs_sole = g.nodes.iter().enumerate().all(|(p, n)| {
        n.outputs.iter().all(|&o| {
            writers[o] += 1;
            g.values[o].producer == Some(p) && !g.values[o].fixed && !n.inputs.contains(&o)
        })
    });
    let one_writer_each = g
        .values
        .iter()
        .zip(&writers)
        .all(|(val, &w)| w == usize::from(val.producer.is_some()));
    applies(g)
        && outputs_sole
        && one_writer_each
        && unread.len() == 1
        && g.values[unread[0]].producer.is_some()
}

/// The values no node reads and that are not fixed: what a schedule leaves at its end.
fn unread(g: &RematGraph) -> Vec<ValueId> {
    let readers = g.readers();
    (0..g.values.len())
        .filter(|&v| readers[v].is_empty() && !g.values[v].fixed)
        .collect()
}

/// What one search at a budget established.
pub enum Probe {
    /// A plan within the budget (tightened, and with the re-runs the budget can
    /// afford to skip taken back).
    Plan(Vec<Instr>),
    /// No schedule runs within the budget ([`exhaustion_proves`]).
    Impossible,
    /// Neither, by the deadline or the set limit (or the search does not apply).
    Unknown,
}

/// Searches for a plan within `budget` until `deadline`.
pub fn plan_within(g: &RematGraph, budget: u64, deadline: Instant) -> Probe {
    if !applies(g) {
        return Probe::Unknown;
    }
    let order = match search(g, budget, deadline, MAX_STATES) {
        Outcome::Found(order) => order,
        Outcome::Exhausted if exhaustion_proves(g) => return Probe::Impossible,
        _ => return Probe::Unknown,
    };
    let plan: Vec<Instr> = order.into_iter().map(Instr::Compute).collect();
    let plan = tighten(g, &plan);
    match replay(g, &plan) {
        Ok(r) if r.peak_bytes <= budget => Probe::Plan(unrecompute(g, &plan, budget)),
        _ => Probe::Unknown,
    }
}

/// The lowest-peak plan the search finds with a peak in `lo..=hi` bytes. The first
/// probe asks for `lo` itself (a floor that is reached is the answer), on a
/// sixteenth of the time; then bisection, the next seven probes on an equal share
/// of the time left, the later ones on half of what is left each: a plan
/// found lowers `hi` to its replayed peak, an exhausted search proves the middle
/// budget impossible. Stops when the interval is empty (the lowest peak is then
/// known, and proven if every probe below it was) or the deadline passes. Also
/// returns the lowest peak proven possible from below: one more than the highest
/// budget proven impossible, 0 if none was.
pub fn lowest_plan(
    g: &RematGraph,
    mut lo: u64,
    mut hi: u64,
    deadline: Instant,
) -> (Option<Vec<Instr>>, u64) {
    let mut best = None;
    let mut proven = 0;
    if !applies(g) {
        return (best, proven);
    }
    for k in 0u32.. {
        let now = Instant::now();
        if lo > hi || now >= deadline {
            break;
        }
        let first = k == 0;
        let at = if first { lo } else { lo + (hi - lo) / 2 };
        let share = if first {
            16
        } else {
            9u32.saturating_sub(k).max(2)
        };
        let end = now + deadline.saturating_duration_since(now) / share;
        match plan_within(g, at, end) {
            Probe::Plan(p) => {
                let peak = replay(g, &p).map_or(at, |r| r.peak_bytes);
                best = Some(p);
                match peak.checked_sub(1) {
                    Some(h) => hi = h,
                    None => break,
                }
            }
            Probe::Impossible => {
                proven = at + 1;
                lo = at + 1;
            }
            Probe::Unknown => lo = at + 1,
        }
    }
    (best, proven)
}

/// One set of the chain: which values are in it, their bytes, and its hash.
#[derive(Clone)]
struct Set {
    bits: Vec<u64>,
    bytes: u64,
    hash: u128,
}

impl Set {
    fn has(&self, v: usize) -> bool {
        self.bits[v / 64] >> (v % 64) & 1 == 1
    }
    fn flip(&mut self, v: usize, bytes: u64, key: u128) {
        self.bits[v / 64] ^= 1 << (v % 64);
        self.hash ^= key;
        if self.has(v) {
            self.bytes += bytes;
        } else {
            self.bytes -= bytes;
        }
    }
    fn members(&self) -> impl Iterator<Item = usize> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, &word)| {
            let mut m = word;
            std::iter::from_fn(move || {
                (m != 0).then(|| {
                    let b = m.trailing_zeros() as usize;
                    m &= m - 1;
                    w * 64 + b
                })
            })
        })
    }
}

/// How a search ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A chain that fits: its nodes in the order a plan runs them.
    Found(Vec<NodeId>),
    /// Every set reachable within the budget was explored and none led to the
    /// empty set: where [`exhaustion_proves`] holds, no schedule runs within the
    /// budget.
    Exhausted,
    /// The deadline or the set limit came first.
    Stopped,
}

/// Searches for a chain within `budget`, exploring at most `max_states` sets.
pub fn search(g: &RematGraph, budget: u64, deadline: Instant, max_states: usize) -> Outcome {
    let nv = g.values.len();
    let fixed = g.fixed_bytes();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        // splitmix64: the hash keys only need to be fixed and well mixed.
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let keys: Vec<u128> = (0..nv)
        .map(|_| (next() as u128) << 64 | next() as u128)
        .collect();
    let bytes = |v: usize| g.values[v].bytes;
    let mut start = Set {
        bits: vec![0; nv.div_ceil(64)],
        bytes: 0,
        hash: 0,
    };
    for v in unread(g) {
        if g.values[v].producer.is_some() {
            start.flip(v, bytes(v), keys[v]);
        }
    }
    // Taking node `p` out of set `s`: the earlier set, if the step fits.
    let take = |s: &Set, p: NodeId| -> Option<Set> {
        let n = &g.nodes[p];
        let mut t = s.clone();
        for &o in &n.outputs {
            if t.has(o) {
                t.flip(o, bytes(o), keys[o]);
            }
        }
        for &u in &n.inputs {
            if !g.values[u].fixed && !t.has(u) {
                t.flip(u, bytes(u), keys[u]);
            }
        }
        let out: u64 = n.outputs.iter().map(|&o| bytes(o)).sum();
        (fixed + t.bytes + out <= budget).then_some(t)
    };
    // Candidate nodes of a set, latest in the graph's order first.
    let candidates = |s: &Set| -> Vec<NodeId> {
        let mut c: Vec<NodeId> = s.members().filter_map(|v| g.values[v].producer).collect();
        c.sort_unstable_by(|a, b| b.cmp(a));
        c.dedup();
        c
    };
    if start.bits.iter().all(|&w| w == 0) {
        return Outcome::Found(Vec::new());
    }
    let mut seen: HashSet<u128> = HashSet::new();
    seen.insert(start.hash);
    let first = candidates(&start);
    let mut stack: Vec<(Set, Vec<NodeId>, usize)> = vec![(start, first, 0)];
    let mut taken: Vec<NodeId> = Vec::new();
    while let Some((s, cands, k)) = stack.last_mut() {
        let Some(&p) = cands.get(*k) else {
            stack.pop();
            taken.pop();
            continue;
        };
        *k += 1;
        let Some(t) = take(s, p) else { continue };
        if !seen.insert(t.hash) {
            continue;
        }
        taken.push(p);
        if t.bits.iter().all(|&w| w == 0) {
            taken.reverse();
            return Outcome::Found(taken);
        }
        if seen.len() > max_states || stack.len() >= MAX_DEPTH || Instant::now() >= deadline {
            return Outcome::Stopped;
        }
        let c = candidates(&t);
        stack.push((t, c, 0));
    }
    Outcome::Exhausted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remat::graph::{RNode, RValue};
    use std::time::Duration;

    /// A chain a -> b -> c -> d where d also reads a (a, c, d 1 unit, b 2): without
    /// recomputation a stays resident (peak 4 when c runs); recomputing a before d
    /// gets 3, what d itself needs.
    fn skip_chain() -> RematGraph {
        let names = ["a", "b", "c", "d"];
        let inputs: [&[usize]; 4] = [&[], &[0], &[1], &[2, 0]];
        RematGraph {
            name: "skip".into(),
            values: names
                .iter()
                .enumerate()
                .map(|(i, n)| RValue {
                    name: n.to_string(),
                    bytes: if i == 1 { 2 } else { 1 },
                    producer: Some(i),
                    fixed: false,
                    held: false,
                })
                .collect(),
            nodes: names
                .iter()
                .enumerate()
                .map(|(i, n)| RNode {
                    name: n.to_string(),
                    cost: 1.0,
                    inputs: inputs[i].to_vec(),
                    outputs: vec![i],
                    backward: false,
                    recomputable: true,
                    op: String::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn finds_the_recomputation_a_tight_budget_needs() {
        let g = skip_chain();
        let end = Instant::now() + Duration::from_secs(5);
        assert_eq!(replay(&g, &g.no_recompute_plan()).unwrap().peak_bytes, 4);
        let Probe::Plan(plan) = plan_within(&g, 3, end) else {
            panic!("a is recomputed before d")
        };
        let r = replay(&g, &plan).unwrap();
        assert_eq!(r.peak_bytes, 3);
        assert_eq!(r.recompute_cost, 1.0);
        // Below what d needs (a, c and d itself) no chain exists, and one unread
        // value makes that a proof.
        assert!(exhaustion_proves(&g));
        assert!(matches!(plan_within(&g, 2, end), Probe::Impossible));
        assert_eq!(search(&g, 2, end, MAX_STATES), Outcome::Exhausted);
    }
}
