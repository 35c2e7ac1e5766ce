//! Optimal rematerialization: the mixed-integer program of Checkmate (Jain et al.,
//! MLSys 2020, "Checkmate: Breaking the Memory Wall with Optimal Tensor
//! Rematerialization"), solved with CBC (built from source, see `Cargo.toml`).
//!
//! The schedule has `T = n` stages; stage `t` computes node `t` (the frontier
//! advances one node per stage) and may recompute earlier nodes before it. Binary
//! variables: `R[t][i]` (node `i` computed in stage `t`), `S[t][v]` (value `v` is
//! kept from stage `t-1` into stage `t`), `FREE[t][v,k]` (value `v` is freed right
//! after its reader `k` runs in stage `t`); continuous `U[t][k]`, the memory right
//! after computing `k` in stage `t`. `R` is lower triangular with `R[t][t] = 1`;
//! `S[t][v] = 0` unless `v`'s writer comes before `t`. Constraints, as in
//! Checkmate's `ILPSolverGurobi`:
//! - a node computed in stage `t` finds each input kept or computed earlier in `t`:
//!   `R[t][k] ≤ R[t][i] + S[t][v]` for every value `v` that `i` writes and `k` reads;
//! - a value is kept into stage `t+1` only if it was kept into `t` or its writer
//!   ran in `t`: `S[t+1][v] ≤ S[t][v] + R[t][i]`;
//! - `FREE[t][v,k] = 1` exactly when `k` runs in stage `t`, `v` is not kept into
//!   `t+1` and no later reader of `v` runs in `t` (the two "hazard" inequalities);
//! - `U[t][0] = R[t][0]·m₀ + Σ_v S[t][v]·|v|`,
//!   `U[t][k+1] = U[t][k] + R[t][k+1]·m_{k+1} − Σ_{v read by k} FREE[t][v,k]·|v|`,
//!   `U[t][k] ≤ budget − fixed − held(t, k)`;
//! - objective: minimise `Σ cost[i]·R[t][i]`.
//!
//! Mapping of [`RematGraph`] onto Checkmate's one-output-per-node model: the model
//! values are the non-fixed, non-held ones; running node `i` allocates all of its
//! model values (`mᵢ` = their bytes), but each is kept (`S`) and freed (`FREE`) on
//! its own, so a forward node's output for the next layer can go while the value
//! it saves for backward stays. With one output per node this is exactly
//! Checkmate's model (`S` per node, `FREE` per edge). An output nobody reads, and
//! an output of a multi-output node that nothing reads later in the stage, is
//! freed right after it is computed (a `FREE` with the writer as reader).
//! Fixed values are a constant in every stage; a held value is a constant from
//! the first run of its writer on. Nodes that are not recomputable only run in
//! their own stage.
//!
//! Memory is counted in units of the gcd of the model values' sizes, but no finer
//! than `budget / 100000` (sizes rounded up, the budget rounded down): CBC's
//! proofs of optimality went wrong on memory rows that mix a 128-byte loss with
//! 2 GB activations (SegNet: "optimal" 1.0019 where 1.0010 exists). "Optimal",
//! "infeasible" and the bounds are statements about this model: Checkmate's
//! schedules (the given order, one frontier node per stage), sizes so rounded.
//!
//! The solution is turned into a plan (pruned of computations and checkpoints that
//! nothing uses, as Checkmate's `solve_r_opt` does) and checked with
//! [`replay`]: a returned plan always replays within the budget.

// Stage and value indices address several matrices at once.
#![allow(clippy::needless_range_loop)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use good_lp::solvers::coin_cbc::CoinCbcProblem;
use good_lp::{
    coin_cbc, variable, Constraint, Expression, ProblemVariables, SolverModel, Variable,
};

use super::graph::{replay, Instr, NodeId, RematGraph, ValueId};
use crate::error::{Error, Result};

/// How long past its limit a CBC run is waited for (see [`run_cbc`]).
pub(crate) const GRACE: Duration = Duration::from_secs(2);

/// Memory is modelled in units of at least `budget / RESOLUTION` bytes.
const RESOLUTION: u64 = 100_000;

/// Options of [`solve_checkmate`].
#[derive(Debug, Clone)]
pub struct IlpOptions {
    /// Wall-clock limit of the MILP solve (and, separately, of the LP relaxation).
    pub time_limit: Duration,
    /// Also solve the LP relaxation, for a lower bound.
    pub lp_bound: bool,
}

/// How the solve ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IlpStatus {
    /// The plan is proven optimal (for the model: see the module documentation).
    Optimal,
    /// A plan was found but not proven optimal within the time limit.
    Feasible,
    /// Proven (for the model): no plan fits the budget.
    Infeasible,
    /// Timed out without any plan (and without a proof of infeasibility).
    NoSolution,
}

/// What [`solve_checkmate`] found.
#[derive(Debug, Clone)]
pub struct IlpResult {
    /// How the solve ended.
    pub status: IlpStatus,
    /// The plan (`Optimal` and `Feasible`); it replays within the budget.
    pub plan: Option<Vec<Instr>>,
    /// Total cost of the plan (every computation, first ones included: a plan
    /// without recomputation costs [`RematGraph::base_cost`]), as replayed.
    pub objective: Option<f64>,
    /// The best proven lower bound on the optimal cost (CBC's bound, or the LP
    /// relaxation's when that is higher; never above `objective`).
    pub lower_bound: Option<f64>,
    /// Optimum of the LP relaxation, when asked for and solved within the limit.
    pub lp_lower_bound: Option<f64>,
    /// Wall-clock seconds of the whole call.
    pub seconds: f64,
    /// What CBC reported (status codes), or why CBC was not needed.
    pub solver_status: String,
    /// The memory unit of the model: value sizes are rounded up to multiples of
    /// it (0 when no model was built).
    pub unit_bytes: u64,
}

/// Solves Checkmate's MILP for `g` under `budget_bytes` (fixed values included).
///
/// Node costs must be finite and non-negative. Shortcuts that need no solver: a
/// budget at or above the peak of the no-recompute plan gives that plan (optimal:
/// every node runs once), and a budget below [`RematGraph::op_local_bound`] is
/// infeasible.
pub fn solve_checkmate(g: &RematGraph, budget_bytes: u64, o: &IlpOptions) -> Result<IlpResult> {
    let start = Instant::now();
    let mut p = Prep::new(g)?;
    let base = g.base_cost();
    let done =
        |status, plan: Option<Vec<Instr>>, objective, lower_bound, lp, why: String| IlpResult {
            status,
            plan,
            objective,
            lower_bound,
            lp_lower_bound: lp,
            seconds: start.elapsed().as_secs_f64(),
            solver_status: why,
            unit_bytes: 0,
        };

    let nr = g.no_recompute_plan();
    let nr_rep =
        replay(g, &nr).map_err(|e| Error::Graph(format!("rematerialization graph: {e}")))?;
    if nr_rep.peak_bytes <= budget_bytes {
        let lp = o.lp_bound.then_some(nr_rep.cost);
        return Ok(done(
            IlpStatus::Optimal,
            Some(nr),
            Some(nr_rep.cost),
            Some(nr_rep.cost),
            lp,
            "no solve: the no-recompute plan fits".into(),
        ));
    }
    let infeasible = |why: String| done(IlpStatus::Infeasible, None, None, None, None, why);
    if budget_bytes < g.op_local_bound() {
        return Ok(infeasible(
            "no solve: budget below the op-local bound".into(),
        ));
    }
    p.set_unit(budget_bytes);
    let unit = p.unit;
    let done = |status, plan, objective, lower_bound, lp, why| IlpResult {
        unit_bytes: unit,
        ..done(status, plan, objective, lower_bound, lp, why)
    };
    let infeasible = |why: String| done(IlpStatus::Infeasible, None, None, None, None, why);
    let Some(caps) = p.caps(budget_bytes) else {
        return Ok(infeasible(
            "no solve: fixed and held values exceed the budget".into(),
        ));
    };

    let mut lp = None;
    if o.lp_bound {
        let (problem, _) = p.build(&caps, false, 0.0);
        let r = run_cbc(
            problem,
            o.time_limit,
            p.root_iterations(o.time_limit),
            GRACE,
        );
        if r.proven_infeasible {
            return Ok(infeasible(format!(
                "LP relaxation infeasible ({})",
                r.status
            )));
        }
        if !r.proven_optimal {
            // The MILP starts from the same LP, which did not finish in time.
            let why = format!("LP relaxation unsolved: {}", r.status);
            return Ok(done(IlpStatus::NoSolution, None, None, None, None, why));
        }
        lp = Some(base + r.objective.max(0.0) * p.cost_scale);
    }

    // The MILP; retried with a tighter memory bound if CBC's tolerances let a
    // solution slip over the budget when replayed exactly.
    let mut cut = 0.0;
    let mut time_left = o.time_limit;
    let mut why = String::new();
    for attempt in 0..3 {
        let t0 = Instant::now();
        let (problem, cols) = p.build(&caps, true, cut);
        let r = run_cbc(problem, time_left, p.root_iterations(time_left), GRACE);
        time_left = time_left.saturating_sub(t0.elapsed());
        why = r.status.clone();
        if attempt > 0 {
            why = format!(
                "{why}; memory bound tightened by {} bytes",
                cut * p.unit as f64
            );
        }
        let milp_bound = r
            .bound
            .filter(|_| attempt == 0)
            .map(|b| base + b.max(0.0) * p.cost_scale);
        let best_bound = match (milp_bound, lp) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        if r.proven_infeasible {
            if attempt == 0 {
                return Ok(infeasible(why));
            }
            break;
        }
        let Some(plan) = p.plan(&cols, &r.columns) else {
            return Ok(done(IlpStatus::NoSolution, None, None, best_bound, lp, why));
        };
        let rep =
            replay(g, &plan).map_err(|e| Error::Graph(format!("ILP plan does not replay: {e}")))?;
        if rep.peak_bytes <= budget_bytes {
            let optimal = attempt == 0 && r.proven_optimal;
            let status = if optimal {
                IlpStatus::Optimal
            } else {
                IlpStatus::Feasible
            };
            let lb = if optimal {
                Some(rep.cost)
            } else {
                best_bound.map(|b| b.min(rep.cost))
            };
            return Ok(done(status, Some(plan), Some(rep.cost), lb, lp, why));
        }
        let over = (rep.peak_bytes - budget_bytes) as f64 / p.unit as f64;
        cut += over.ceil().max(1.0);
        if time_left.is_zero() {
            break;
        }
    }
    Ok(done(IlpStatus::NoSolution, None, None, lp, lp, why))
}

/// What a CBC run reported.
pub(crate) struct Cbc {
    pub(crate) proven_optimal: bool,
    pub(crate) proven_infeasible: bool,
    pub(crate) objective: f64,
    /// CBC's bound, when it is one (see [`run_cbc`]).
    pub(crate) bound: Option<f64>,
    pub(crate) columns: Vec<f64>,
    pub(crate) status: String,
}

impl Cbc {
    fn overran(status: String) -> Cbc {
        Cbc {
            proven_optimal: false,
            proven_infeasible: false,
            objective: f64::INFINITY,
            bound: None,
            columns: Vec::new(),
            status,
        }
    }
}

/// Held by the thread that runs CBC (which is not re-entrant); a solve that
/// overran its time limit keeps holding it until CBC returns.
static CBC_SLOT: Mutex<()> = Mutex::new(());

/// The least time [`run_cbc`] starts CBC with after waiting for another solve.
const MIN_SOLVE: Duration = Duration::from_millis(50);

/// Solves with CBC directly (good_lp's `solve` maps a time-out without an
/// incumbent, and some other stops, to errors or to "optimal", and drops the
/// bound), on a worker thread: CBC honours `seconds` in branch and bound but not
/// in the LP at the root, which on large graphs (ResNet-50) takes many minutes.
/// Past the limit plus a grace period the caller gets [`Cbc::overran`] and the
/// worker is left to finish alone. `max_iterations` caps the simplex iterations
/// of that root LP (CBC's `maxIt`, which branch and bound ignores), so that a
/// worker left alone stops too. The limit runs from the call: a solve that waits
/// for another thread's (`fit` plans two budgets side by side) gets what is left
/// of it once CBC is free, and none when too little is left.
pub(crate) fn run_cbc(
    mut problem: CoinCbcProblem,
    limit: Duration,
    max_iterations: u64,
    grace: Duration,
) -> Cbc {
    let end = Instant::now() + limit;
    problem.set_parameter("timeMode", "elapsed");
    problem.set_parameter("maxIt", &max_iterations.to_string());
    let (tx, rx) = mpsc::channel();
    let cancelled = Arc::new(AtomicBool::new(false));
    let cancel = Arc::clone(&cancelled);
    let worker = std::thread::Builder::new()
        .name("memplan-cbc".into())
        .spawn(move || {
            let _slot = CBC_SLOT.lock().unwrap_or_else(|e| e.into_inner());
            if cancel.load(Ordering::SeqCst) {
                return;
            }
            // A limit given under MIN_SOLVE is kept as it is.
            let left = if limit < MIN_SOLVE {
                limit
            } else {
                end.saturating_duration_since(Instant::now())
            };
            if limit >= MIN_SOLVE && left < MIN_SOLVE {
                let _ = tx.send(Cbc::overran(format!(
                    "CBC was busy with another solve until {:.3} s before this one's limit",
                    left.as_secs_f64()
                )));
                return;
            }
            problem.set_parameter("seconds", &format!("{:.3}", left.as_secs_f64()));
            let sol = problem.as_inner().solve();
            let raw = sol.raw();
            let (status, secondary) = (raw.status() as i32, raw.secondary_status() as i32);
            // Status 0 (finished) or a stop on time or gap after the root LP: a
            // bound. A stop elsewhere (iterations, in the root LP) leaves a number
            // that is not one.
            let bound = (status == 0 || secondary == 2 || secondary == 4)
                .then(|| raw.best_possible_value())
                .filter(|b| b.is_finite() && b.abs() < 1e40);
            let _ = tx.send(Cbc {
                proven_optimal: raw.is_proven_optimal(),
                proven_infeasible: raw.is_proven_infeasible(),
                objective: raw.obj_value(),
                bound,
                columns: raw.col_solution().to_vec(),
                status: format!(
                    "CBC status {status}, secondary status {secondary}, proven optimal {}, \
                     proven infeasible {}, time limit reached {}",
                    raw.is_proven_optimal(),
                    raw.is_proven_infeasible(),
                    raw.is_seconds_limit_reached()
                ),
            });
        });
    if let Err(e) = worker {
        return Cbc::overran(format!("cannot start a thread for CBC: {e}"));
    }
    let wait = limit + grace + limit / 10;
    rx.recv_timeout(wait).unwrap_or_else(|_| {
        cancelled.store(true, Ordering::SeqCst);
        Cbc::overran(format!(
            "CBC did not stop within {:.1} s (it does not time its root LP, or an earlier \
             solve that overran still holds it); left to finish in the background",
            wait.as_secs_f64()
        ))
    })
}

/// A term of the model that may be a constant.
#[derive(Debug, Clone, Copy, PartialEq)]
enum L {
    Zero,
    One,
    V(usize),
}

impl L {
    fn value(self, x: &[f64]) -> f64 {
        match self {
            L::Zero => 0.0,
            L::One => 1.0,
            L::V(c) => x[c],
        }
    }
}

/// A value of the model: non-fixed, non-held, with exactly one writer.
#[derive(Debug)]
struct MVal {
    id: ValueId,
    owner: NodeId,
    bytes: u64,
    /// Size in units of [`Prep::unit`], rounded up.
    units: f64,
    /// Nodes that read it, sorted.
    readers: Vec<NodeId>,
}

/// One place where a value may be freed: right after the node it is listed
/// under in `uses_at` runs, if none of `later` runs after it in the same stage
/// and the value is not kept.
#[derive(Debug)]
struct Use {
    val: usize,
    later: Vec<NodeId>,
}

/// The graph in Checkmate's terms.
#[derive(Debug)]
struct Prep {
    n: usize,
    /// Bytes per memory unit (see [`Prep::set_unit`]).
    unit: u64,
    /// Greatest common divisor of the model values' sizes.
    gcd: u64,
    /// Units of each node's model values.
    m: Vec<f64>,
    /// Node owns at least one model value (else its `S` and recomputation are moot).
    owns: Vec<bool>,
    vals: Vec<MVal>,
    /// Model values owned by each node.
    owned: Vec<Vec<usize>>,
    /// Model values each node reads, sorted.
    deps: Vec<Vec<usize>>,
    uses: Vec<Use>,
    uses_at: Vec<Vec<usize>>,
    /// Bytes of held values first written by each node.
    held_first: Vec<u64>,
    fixed: u64,
    recomputable: Vec<bool>,
    cost: Vec<f64>,
    /// Objective coefficients are `cost / cost_scale`.
    cost_scale: f64,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Prep {
    fn new(g: &RematGraph) -> Result<Prep> {
        let n = g.nodes.len();
        let bad =
            |why: String| Error::Graph(format!("rematerialization graph '{}': {why}", g.name));
        let mut writers: Vec<Vec<NodeId>> = vec![Vec::new(); g.values.len()];
        for (k, node) in g.nodes.iter().enumerate() {
            for &v in &node.outputs {
                let w = writers
                    .get_mut(v)
                    .ok_or_else(|| bad(format!("node {k} writes no value {v}")))?;
                if w.last() != Some(&k) {
                    w.push(k);
                }
            }
        }
        let readers = g.readers();
        let mut held_first = vec![0u64; n];
        let mut first_writer = vec![None; g.values.len()];
        let mut model_of = vec![None; g.values.len()];
        let mut vals = Vec::new();
        let mut owned = vec![Vec::new(); n];
        for (v, val) in g.values.iter().enumerate() {
            if val.fixed {
                continue;
            }
            let w = &writers[v];
            if val.held {
                if let Some(&f) = w.first() {
                    held_first[f] += val.bytes;
                    first_writer[v] = Some(f);
                }
                continue;
            }
            match w.as_slice() {
                [] => {}
                &[owner] => {
                    model_of[v] = Some(vals.len());
                    owned[owner].push(vals.len());
                    vals.push(MVal {
                        id: v,
                        owner,
                        bytes: val.bytes,
                        units: 0.0,
                        readers: readers[v].clone(),
                    });
                }
                _ => {
                    return Err(bad(format!(
                        "value '{}' is written by several nodes and is neither fixed nor held",
                        val.name
                    )))
                }
            }
        }
        let mut deps = vec![Vec::new(); n];
        for (k, node) in g.nodes.iter().enumerate() {
            for &v in &node.inputs {
                let val = g
                    .values
                    .get(v)
                    .ok_or_else(|| bad(format!("node {k} reads no value {v}")))?;
                if val.fixed {
                    continue;
                }
                let w = if val.held {
                    first_writer[v]
                } else {
                    model_of[v].map(|mv| vals[mv].owner)
                };
                match w {
                    Some(w) if w < k => {
                        if let Some(mv) = model_of[v] {
                            deps[k].push(mv);
                        }
                    }
                    _ => {
                        return Err(bad(format!(
                            "node '{}' reads '{}', which no earlier node writes",
                            node.name, val.name
                        )))
                    }
                }
            }
            deps[k].sort_unstable();
            deps[k].dedup();
        }
        let unit = vals.iter().fold(0, |a, v| gcd(a, v.bytes)).max(1);
        let mut uses = Vec::new();
        let mut uses_at = vec![Vec::new(); n];
        for (i, v) in vals.iter().enumerate() {
            if v.bytes == 0 {
                continue;
            }
            // Freeing right after the writer runs: for outputs nobody reads, and
            // for the outputs of multi-output nodes (running the node for one of
            // them need not keep the others to the end of the stage). Pointless for
            // a single output that is read, so Checkmate's model is kept there.
            if v.readers.is_empty() || owned[v.owner].len() > 1 {
                uses_at[v.owner].push(uses.len());
                uses.push(Use {
                    val: i,
                    later: v.readers.clone(),
                });
            }
            for (r, &k) in v.readers.iter().enumerate() {
                uses_at[k].push(uses.len());
                uses.push(Use {
                    val: i,
                    later: v.readers[r + 1..].to_vec(),
                });
            }
        }
        let cost: Vec<f64> = g.nodes.iter().map(|x| x.cost).collect();
        if let Some(k) = cost.iter().position(|c| !(*c >= 0.0 && c.is_finite())) {
            return Err(bad(format!(
                "node '{}' has cost {}",
                g.nodes[k].name, cost[k]
            )));
        }
        let cost_scale = cost.iter().fold(0.0f64, |a, &c| a.max(c.abs()));
        Ok(Prep {
            n,
            unit,
            gcd: unit,
            m: vec![0.0; n],
            owns: owned.iter().map(|o| !o.is_empty()).collect(),
            vals,
            owned,
            deps,
            uses,
            uses_at,
            held_first,
            fixed: g.fixed_bytes(),
            recomputable: g.nodes.iter().map(|x| x.recomputable).collect(),
            cost,
            cost_scale: if cost_scale > 0.0 { cost_scale } else { 1.0 },
        })
    }

    /// Chooses the memory unit for `budget`: the gcd of the sizes (exact), but
    /// no finer than `budget / RESOLUTION`, sizes rounded up (CBC's proofs go wrong
    /// when one memory row mixes coefficients 1e7 apart, as a 128-byte loss next
    /// to 2 GB activations does).
    fn set_unit(&mut self, budget: u64) {
        self.unit = self.gcd.max(budget / RESOLUTION).max(1);
        self.m.iter_mut().for_each(|m| *m = 0.0);
        for v in &mut self.vals {
            v.units = v.bytes.div_ceil(self.unit) as f64;
            self.m[v.owner] += v.units;
        }
    }

    /// A cap on the simplex iterations of the root LP for a `limit`: about 1.5
    /// times what fits in it. Measured with CBC's Clp on one core (Checkmate
    /// graphs, 70 to 350 nodes): about 1e8 / (n·E) iterations per second, n
    /// nodes and E edges (10 000/s for vgg_unet, 400/s for ResNet-50).
    fn root_iterations(&self, limit: Duration) -> u64 {
        let edges = (self.uses.len() + self.deps.iter().map(Vec::len).sum::<usize>()) / 2;
        let work = (self.n.max(1) * edges.max(1)) as f64;
        let per_second = 1e8 / work;
        (1.5 * limit.as_secs_f64() * per_second).clamp(5_000.0, i32::MAX as f64) as u64
    }

    /// `caps[t][k]`: units available to the model values right after node `k`
    /// runs in stage `t` (`k ≤ t`); `None` when a stage cannot fit even empty.
    fn caps(&self, budget: u64) -> Option<Vec<Vec<f64>>> {
        let mut held_before = 0u64;
        let mut caps = Vec::with_capacity(self.n);
        for t in 0..self.n {
            let avail = |extra: u64| -> Option<f64> {
                let used = self.fixed + held_before + extra;
                (used <= budget).then(|| ((budget - used) / self.unit) as f64)
            };
            let early = avail(0)?;
            let mut row = vec![early; t + 1];
            row[t] = avail(self.held_first[t])?;
            caps.push(row);
            held_before += self.held_first[t];
        }
        Some(caps)
    }

    fn r(&self, cols: &Cols, t: usize, i: usize) -> L {
        if i > t {
            L::Zero
        } else {
            cols.r[t][i]
        }
    }

    /// `S[t][v]` for model value `v`.
    fn s(&self, cols: &Cols, t: usize, v: usize) -> L {
        if t >= self.n || self.vals[v].owner >= t {
            L::Zero
        } else {
            cols.s[t][v]
        }
    }

    /// FREE[t][use]: what is freed after each node, per stage (a constant where
    /// the hazards decide it, else a binary with its two constraints in `cons`).
    fn frees(&self, b: &mut Builder, cols: &mut Cols, cons: &mut Vec<Constraint>) -> Vec<Vec<L>> {
        let n = self.n;
        let mut frees: Vec<Vec<L>> = Vec::with_capacity(n);
        for t in 0..n {
            let mut row = Vec::new();
            for k in 0..=t {
                for &u in &self.uses_at[k] {
                    let use_ = &self.uses[u];
                    let rk = self.r(cols, t, k);
                    // hazards = (1 - R[t][k]) + S[t+1][owner] + Σ later R[t][j]:
                    // `h_min` counts the certain ones, `n_var` the undecided ones.
                    let mut h = Expression::default();
                    let (mut h_min, mut n_var) = (0.0, 0.0);
                    match rk {
                        L::Zero => h_min += 1.0,
                        L::One => {}
                        L::V(_) => {
                            h += 1.0;
                            b.add(&mut h, -1.0, rk);
                            n_var += 1.0;
                        }
                    }
                    let later = use_.later.iter().take_while(|&&j| j <= t);
                    for l in std::iter::once(self.s(cols, t + 1, use_.val))
                        .chain(later.map(|&j| self.r(cols, t, j)))
                    {
                        match l {
                            L::Zero => {}
                            L::One => h_min += 1.0,
                            L::V(_) => {
                                b.add(&mut h, 1.0, l);
                                n_var += 1.0;
                            }
                        }
                    }
                    let f = if h_min >= 1.0 {
                        L::Zero // a hazard is certain: never freed here
                    } else if n_var == 0.0 {
                        L::One // no hazard possible: always freed here
                    } else {
                        let v = b.bin();
                        cols.binaries.push(v);
                        let fv = b.list[v];
                        // 1 - F ≤ h and h ≤ n_var·(1 - F)
                        let mut lo = h.clone();
                        lo += fv;
                        cons.push(lo.geq(1.0));
                        let mut hi = h;
                        hi.add_mul(n_var, fv);
                        cons.push(hi.leq(n_var));
                        L::V(v)
                    };
                    row.push(f);
                }
            }
            frees.push(row);
        }
        frees
    }

    /// Builds the model (`integral` false: the LP relaxation). `cut` units are
    /// taken off every memory bound.
    fn build(&self, caps: &[Vec<f64>], integral: bool, cut: f64) -> (CoinCbcProblem, Cols) {
        let n = self.n;
        let mut b = Builder {
            vars: ProblemVariables::new(),
            list: Vec::new(),
            integral,
        };
        let mut cols = Cols {
            r: Vec::with_capacity(n),
            s: Vec::with_capacity(n),
            binaries: Vec::new(),
        };
        let mut objective = Expression::default();
        for t in 0..n {
            let mut r = Vec::with_capacity(t + 1);
            for i in 0..t {
                if self.owns[i] && self.recomputable[i] {
                    let v = b.bin();
                    cols.binaries.push(v);
                    objective.add_mul(self.cost[i] / self.cost_scale, b.list[v]);
                    r.push(L::V(v));
                } else {
                    r.push(L::Zero);
                }
            }
            r.push(L::One);
            let s: Vec<L> = self
                .vals
                .iter()
                .map(|v| {
                    if v.owner < t {
                        let c = b.bin();
                        cols.binaries.push(c);
                        L::V(c)
                    } else {
                        L::Zero
                    }
                })
                .collect();
            cols.r.push(r);
            cols.s.push(s);
        }
        let mut cons: Vec<Constraint> = Vec::new();
        // Every input kept or computed earlier in the stage.
        for k in 0..n {
            for &v in &self.deps[k] {
                let i = self.vals[v].owner;
                for t in k..n {
                    let rk = self.r(&cols, t, k);
                    if rk == L::Zero {
                        continue;
                    }
                    let mut e = Expression::default();
                    b.add(&mut e, 1.0, rk);
                    b.add(&mut e, -1.0, self.r(&cols, t, i));
                    b.add(&mut e, -1.0, self.s(&cols, t, v));
                    cons.push(e.leq(0.0));
                }
            }
        }
        // Kept only if kept or computed in the previous stage.
        for t in 0..n.saturating_sub(1) {
            for (v, mv) in self.vals.iter().enumerate() {
                let sn = self.s(&cols, t + 1, v);
                if sn == L::Zero {
                    continue;
                }
                let mut e = Expression::default();
                b.add(&mut e, 1.0, sn);
                b.add(&mut e, -1.0, self.s(&cols, t, v));
                b.add(&mut e, -1.0, self.r(&cols, t, mv.owner));
                cons.push(e.leq(0.0));
            }
        }
        let frees = self.frees(&mut b, &mut cols, &mut cons);
        // Memory.
        // Memory rows in a unit that puts the largest value near 1000 (the caps
        // then sit in the thousands too); a pure scaling, it only helps CBC.
        let largest = self.vals.iter().fold(0.0f64, |a, v| a.max(v.units));
        let ms = (largest / 1e3).max(1.0);
        for t in 0..n {
            let mut prev: Option<Variable> = None;
            let mut f_idx = 0;
            for k in 0..=t {
                let u = b.cont((caps[t][k] - cut).max(0.0) / ms);
                let uk = b.list[u];
                let mut e = Expression::default();
                e.add_mul(1.0, uk);
                match prev {
                    None => {
                        for (v, mv) in self.vals.iter().enumerate() {
                            b.add(&mut e, -mv.units / ms, self.s(&cols, t, v));
                        }
                    }
                    Some(p) => e.add_mul(-1.0, p),
                }
                b.add(&mut e, -self.m[k] / ms, self.r(&cols, t, k));
                if k > 0 {
                    for &us in &self.uses_at[k - 1] {
                        b.add(
                            &mut e,
                            self.vals[self.uses[us].val].units / ms,
                            frees[t][f_idx],
                        );
                        f_idx += 1;
                    }
                }
                cons.push(e.eq(0.0));
                prev = Some(uk);
            }
        }
        if !integral {
            // One integer column keeps CBC on its branch-and-cut driver, which
            // honours the time limit (a model without integers goes straight to
            // Clp, without one).
            b.integral = true;
            b.bin();
        }
        let mut problem = b.vars.minimise(objective).using(coin_cbc);
        for c in cons {
            problem.add_constraint(c);
        }
        (problem, cols)
    }

    /// Turns a solution into a plan: prunes computations and checkpoints nothing
    /// uses, then frees each value after its last use in the stage unless kept.
    /// `None` if the columns are not an integral solution of the model.
    fn plan(&self, cols: &Cols, x: &[f64]) -> Option<Vec<Instr>> {
        let n = self.n;
        if x.len() < cols.binaries.len()
            || cols
                .binaries
                .iter()
                .any(|&c| (x[c] - x[c].round()).abs() > 1e-4)
        {
            return None;
        }
        let on = |l: L| l.value(x) > 0.5;
        let nv = self.vals.len();
        // Backward over stages: the least R given S[t] and the pruned S2[t+1], then
        // S2[t]: what S[t] keeps that stage t reads or hands on.
        let mut r2 = vec![Vec::new(); n];
        let mut s2: Vec<Vec<bool>> = vec![vec![false; nv]; n + 1];
        for t in (0..n).rev() {
            let mut r = vec![false; t + 1];
            r[t] = true;
            let read_in =
                |r: &[bool], v: usize| self.vals[v].readers.iter().any(|&j| j <= t && r[j]);
            for k in (0..t).rev() {
                let needed = self.owned[k]
                    .iter()
                    .any(|&v| !on(self.s(cols, t, v)) && (s2[t + 1][v] || read_in(&r, v)));
                if needed && !on(self.r(cols, t, k)) {
                    return None;
                }
                r[k] = needed;
            }
            for v in 0..nv {
                s2[t][v] = on(self.s(cols, t, v)) && (read_in(&r, v) || s2[t + 1][v]);
            }
            r2[t] = r;
        }
        let mut plan = Vec::new();
        for t in 0..n {
            let mut at_start = Vec::new();
            let mut after: Vec<Vec<ValueId>> = vec![Vec::new(); t + 1];
            for (i, owned) in self.owned.iter().enumerate().take(t + 1) {
                let computed = r2[t][i];
                for &v in owned {
                    if !(computed || s2[t][v]) || s2[t + 1][v] {
                        continue;
                    }
                    let mv = &self.vals[v];
                    let last = mv
                        .readers
                        .iter()
                        .rev()
                        .find(|&&j| j <= t && r2[t][j])
                        .copied();
                    match (last, computed) {
                        (Some(j), _) => after[j].push(mv.id),
                        (None, true) => after[i].push(mv.id),
                        (None, false) => at_start.push(mv.id),
                    }
                }
            }
            plan.extend(at_start.into_iter().map(Instr::Free));
            for (k, fr) in after.into_iter().enumerate() {
                if r2[t][k] {
                    plan.push(Instr::Compute(k));
                    plan.extend(fr.into_iter().map(Instr::Free));
                }
            }
        }
        Some(plan)
    }
}

/// Columns of `R` (lower triangular: `r[t]` has `t+1` entries) and `S` (`s[t][v]`
/// per model value, a variable when its owner comes before `t`).
struct Cols {
    r: Vec<Vec<L>>,
    s: Vec<Vec<L>>,
    /// Every binary column (for the integrality check).
    binaries: Vec<usize>,
}

/// Variables in creation order (the order of CBC's columns).
struct Builder {
    vars: ProblemVariables,
    list: Vec<Variable>,
    integral: bool,
}

impl Builder {
    fn bin(&mut self) -> usize {
        let d = if self.integral {
            variable().binary()
        } else {
            variable().min(0.0).max(1.0)
        };
        self.list.push(self.vars.add(d));
        self.list.len() - 1
    }

    fn cont(&mut self, max: f64) -> usize {
        self.list.push(self.vars.add(variable().min(0.0).max(max)));
        self.list.len() - 1
    }

    fn add(&self, e: &mut Expression, c: f64, l: L) {
        match l {
            L::Zero => {}
            L::One => *e += c,
            L::V(v) => e.add_mul(c, self.list[v]),
        }
    }
}
