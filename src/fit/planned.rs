//! Planned checkpointing in `fit` (`checkpointing-planned`): the largest batch at
//! which memplan's recompute planner fits one training step in the budget.
//!
//! A plan is a fixed sequence of computes and frees. Replayed at another batch, the
//! memory after each instruction is a sum of value sizes, each affine in the batch
//! (the step's structure does not change with it), so a plan's peak is the largest
//! of a few thousand lines in the batch and the largest batch at which it fits is
//! solved directly ([`AffineStep::max_fit`]). The planner therefore plans a model a
//! few times, not once per batch probed:
//!
//! 1. The step is built at batches 2 and 3 (two training schedules; batch 1
//!    differs, [`AFFINE_FROM`]). When both have
//!    the same structure, each value's bytes and each node's cost is the line
//!    through the two ([`AffineStep`]): the graph at any batch is the same graph
//!    with its sizes rewritten, not a new schedule.
//! 2. Greedy's largest batch is searched on that graph (milliseconds a batch).
//! 3. The ILP planner's lowest-peak plan (planned for the op-local bound, the
//!    hardest budget there is; each within [`LOWEST_PEAK_TIME_LIMIT_S`]) at greedy's
//!    answer locates the answer: the batch at which that plan meets the budget.
//!    Then the lowest-peak plan at the answer + 1: if it fits there, the answer
//!    moves to where it meets the budget and the next batch is planned again. The
//!    lowest peak is nearly linear in the batch, so this ends in one or two plans
//!    (ResNet-50 at 16 GiB: planned at 312, fits to 677; at 678, to 680; at 681,
//!    not there).
//! 4. The answer is the largest batch at which one of these plans (greedy's
//!    included) fits, reported with the cheapest of them that fits there. It is
//!    confirmed on the schedules built at the answer and the next batch: their sizes
//!    are exactly the lines', the plan fits at the first, and no plan found fits at
//!    the second (the last lowest-peak plan was made there).
//!
//! A step whose structure changes with the batch (a Loop lowered per batch), or a
//! confirmation that fails, falls back to [`searched`]: a batch search that plans
//! each batch it probes from its own training schedule.

use std::time::Instant;

use super::FitOptions;
use crate::error::{Error, Result};
use crate::infer::{Bindings, MAX_BATCH};
use crate::ir::Model;
use crate::remat::bounds::{memory_floor, stage_lower_bound};
use crate::remat::graph::{replay, Instr, RematGraph};
use crate::remat::plan::{plan, recomputed_values, PlanReport, Solver};

/// Time limit of each lowest-peak plan `fit` makes (step 3 of the module
/// documentation), in seconds (the time limit when that is less). Within it the
/// planner's lowest-peak candidates finish on the shipped models (ResNet-50's
/// gap-min-peak MILP, GPT-2's gap greedy); on GPT-2 the rest of a longer limit went
/// to a MILP whose plan lost.
pub const LOWEST_PEAK_TIME_LIMIT_S: f64 = 0.5;

/// Most lowest-peak plans at the answer + 1 (step 3 of the module documentation)
/// before `fit` falls back to [`searched`].
pub const CONFIRM_ROUNDS: u32 = 4;

/// The first batch of the lines: at batch 1 some steps differ (a batched MatMul
/// needs no layout copy of a single matrix).
pub const AFFINE_FROM: u64 = 2;

/// The training step's rematerialization graph at `batch`.
fn step_graph(model: &Model, o: &FitOptions, batch: u64) -> Result<RematGraph> {
    let b = Bindings {
        batch: Some(batch),
        dims: o.dims.clone(),
        routing: o.routing,
    };
    Ok(crate::step::build(model, &b, &o.train, "fit")?.graph)
}

/// Plans one training step at `batch` under the budget with `solver`.
pub fn plan_step(model: &Model, o: &FitOptions, batch: u64, solver: Solver) -> Result<PlanReport> {
    plan_step_under(model, o, batch, solver, None)
}

/// [`plan_step`] under `budget` bytes instead of the card's memory (`Some(0)`: the
/// op-local bound, the hardest budget there is, for the solver's lowest-peak plan).
pub fn plan_step_under(
    model: &Model,
    o: &FitOptions,
    batch: u64,
    solver: Solver,
    budget: Option<u64>,
) -> Result<PlanReport> {
    plan_graph(&step_graph(model, o, batch)?, o, solver, budget)
}

/// [`plan_step_under`] on a graph already built.
fn plan_graph(
    g: &RematGraph,
    o: &FitOptions,
    solver: Solver,
    budget: Option<u64>,
) -> Result<PlanReport> {
    let budget = match budget {
        None => o.budget(),
        Some(0) => g.op_local_bound(),
        Some(b) => b,
    };
    plan(g, budget, solver, o.plan_time_limit_s)
}

/// A training step's rematerialization graph at any batch from `from` on: the graph
/// built at batch `from`, with each value's bytes and each node's cost on the line
/// through batches `from` and `from + 1` (the structure, every node's inputs and
/// outputs, is the same at both).
#[derive(Debug, Clone)]
pub struct AffineStep {
    graph: RematGraph,
    batch: u64,
    from: u64,
    /// Per value: bytes at batch `from`, and per further sample.
    bytes: Vec<(u64, u64)>,
    /// Per node: cost at batch `from`, and per further sample.
    cost: Vec<(f64, f64)>,
}

impl AffineStep {
    /// From the graphs at batches `from` (`g1`) and `from + 1` (`g2`); `None` when
    /// their structure differs or a value is smaller at `from + 1`.
    pub fn new(g1: RematGraph, g2: &RematGraph, from: u64) -> Option<AffineStep> {
        if g1.nodes.len() != g2.nodes.len() || g1.values.len() != g2.values.len() {
            return None;
        }
        let same_nodes = g1.nodes.iter().zip(&g2.nodes).all(|(a, b)| {
            a.inputs == b.inputs
                && a.outputs == b.outputs
                && a.backward == b.backward
                && a.recomputable == b.recomputable
        });
        let same_values = g1.values.iter().zip(&g2.values).all(|(a, b)| {
            a.producer == b.producer && a.fixed == b.fixed && a.held == b.held && a.bytes <= b.bytes
        });
        if !same_nodes || !same_values {
            return None;
        }
        let bytes = g1
            .values
            .iter()
            .zip(&g2.values)
            .map(|(a, b)| (a.bytes, b.bytes - a.bytes))
            .collect();
        let cost = g1
            .nodes
            .iter()
            .zip(&g2.nodes)
            .map(|(a, b)| (a.cost, b.cost - a.cost))
            .collect();
        Some(AffineStep {
            graph: g1,
            batch: from,
            from,
            bytes,
            cost,
        })
    }

    /// The first batch of the lines.
    pub fn from(&self) -> u64 {
        self.from
    }

    fn bytes_at(&self, v: usize, batch: u64) -> u64 {
        let (a, c) = self.bytes[v];
        a.saturating_add(c.saturating_mul(batch.saturating_sub(self.from)))
    }

    /// The graph at `batch`, at least [`AffineStep::from`] (sizes rewritten in place).
    pub fn at(&mut self, batch: u64) -> &RematGraph {
        debug_assert!(batch >= self.from);
        if self.batch != batch {
            for v in 0..self.bytes.len() {
                self.graph.values[v].bytes = self.bytes_at(v, batch);
            }
            let extra = batch.saturating_sub(self.from) as f64;
            for (n, &(a, c)) in self.graph.nodes.iter_mut().zip(&self.cost) {
                n.cost = (a + c * extra).max(0.0);
            }
            self.batch = batch;
        }
        &self.graph
    }

    /// Whether `g`, built at `batch`, has this step's structure and exactly its
    /// sizes there.
    pub fn matches(&self, g: &RematGraph, batch: u64) -> bool {
        g.values.len() == self.bytes.len()
            && g.nodes.len() == self.cost.len()
            && g.values.iter().enumerate().all(|(v, x)| {
                x.bytes == self.bytes_at(v, batch) && x.producer == self.graph.values[v].producer
            })
            && g.nodes
                .iter()
                .zip(&self.graph.nodes)
                .all(|(a, b)| a.inputs == b.inputs && a.outputs == b.outputs)
    }

    /// The largest batch (at most [`MAX_BATCH`]) at which `plan`, a valid plan of
    /// this step, replays within `memory`; 0 when it does not at
    /// [`AffineStep::from`]. Replay's memory after each compute (and before the
    /// first) is `A + C·(batch - from)` for sums `A`, `C` of the live values' line
    /// coefficients; each bounds the batch.
    pub fn max_fit(&self, plan: &[Instr], memory: u64) -> u64 {
        let g = &self.graph;
        let memory = u128::from(memory);
        let from = u128::from(self.from);
        let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
        let (mut a, mut c) = (0u128, 0u128);
        for (v, &(av, cv)) in self.bytes.iter().enumerate() {
            if live[v] {
                a += u128::from(av);
                c += u128::from(cv);
            }
        }
        let mut best = u128::from(MAX_BATCH);
        let mut bound = |a: u128, c: u128| {
            if a > memory {
                best = 0;
            } else if let Some(more) = (memory - a).checked_div(c) {
                best = best.min(from + more);
            }
        };
        bound(a, c);
        for op in plan {
            match *op {
                Instr::Compute(i) => {
                    for &o in &g.nodes[i].outputs {
                        if !live[o] {
                            live[o] = true;
                            a += u128::from(self.bytes[o].0);
                            c += u128::from(self.bytes[o].1);
                        }
                    }
                    bound(a, c);
                }
                Instr::Free(v) => {
                    if live[v] {
                        live[v] = false;
                        a -= u128::from(self.bytes[v].0);
                        c -= u128::from(self.bytes[v].1);
                    }
                }
                Instr::Load(v) => {
                    if !live[v] {
                        live[v] = true;
                        a += u128::from(self.bytes[v].0);
                        c += u128::from(self.bytes[v].1);
                    }
                    bound(a, c);
                }
            }
        }
        best as u64
    }
}

/// What planned checkpointing found.
#[derive(Debug, Clone)]
pub struct PlannedFit {
    /// Largest batch at which the planner finds a plan within the budget (0: none).
    pub max_batch: u64,
    /// The reported plan at `max_batch`, with `budget_bytes` the memory its live
    /// bytes must fit ([`FitOptions::budget`]; when nothing fits: the ILP's
    /// lowest-peak plan at batch 1).
    pub report: PlanReport,
    /// Proven lower bound on the overhead at `max_batch` (0 if none).
    pub lower_bound_overhead: f64,
    /// Largest batch at which the greedy planner alone finds a plan.
    pub greedy_max_batch: u64,
    /// Batches planned with greedy.
    pub probes: u32,
    /// Plans made with the ILP planner.
    pub ilp_solves: u32,
    /// Whether the batch was found on one step graph whose sizes are affine in the
    /// batch (planning a few times in all), rather than by the search that builds
    /// and plans each batch probed.
    pub affine: bool,
}

/// A batch search with one solver: `lo` is the largest batch known to fit (0: none
/// yet), `hi` the smallest known not to (`MAX_BATCH + 1`: none yet). `planner`
/// plans a batch under the memory (`None`) or another budget (`Some(0)`: the
/// op-local bound).
///
/// With `lowest`, a batch fits when the solver's lowest-peak plan (planned for the
/// hardest budget, the op-local bound) is within the memory; otherwise when the
/// solver finds a plan for the memory itself.
struct Search<P> {
    planner: P,
    memory: u64,
    lowest: bool,
    lo: u64,
    lo_report: Option<PlanReport>,
    hi: u64,
    batch1: Option<PlanReport>,
    /// (batch, lowest peak the solver reaches), in the order sampled.
    samples: Vec<(u64, u64)>,
    probes: u32,
}

impl<P: FnMut(u64, Option<u64>) -> Result<PlanReport>> Search<P> {
    fn new(planner: P, memory: u64, lowest: bool) -> Self {
        Search {
            planner,
            memory,
            lowest,
            lo: 0,
            lo_report: None,
            hi: MAX_BATCH + 1,
            batch1: None,
            samples: Vec::new(),
            probes: 0,
        }
    }

    /// Plans batch `b`; whether it fits.
    fn probe(&mut self, b: u64) -> Result<bool> {
        if let Some(&(_, peak)) = self
            .samples
            .iter()
            .find(|x| x.0 == b)
            .filter(|_| self.lowest)
        {
            return Ok(peak <= self.memory);
        }
        self.probes += 1;
        let budget = self.lowest.then_some(0);
        let mut r = (self.planner)(b, budget)?;
        if self.lowest {
            self.samples.push((b, r.peak_bytes));
            // The plan is judged against the memory; its bound was for another budget.
            r.budget_bytes = self.memory;
            r.feasible = r.peak_bytes <= self.memory;
            r.lower_bound_overhead = 0.0;
        }
        if r.feasible {
            if b > self.lo {
                self.lo = b;
                self.lo_report = Some(r);
            }
            Ok(true)
        } else {
            self.hi = self.hi.min(b);
            if b == 1 {
                self.batch1 = Some(r);
            }
            Ok(false)
        }
    }

    /// Samples the lowest peak the solver reaches at batch `b`.
    fn sample(&mut self, b: u64) -> Result<()> {
        if self.lowest {
            return self.probe(b).map(|_| ());
        }
        self.probes += 1;
        let r = (self.planner)(b, Some(0))?;
        self.samples.push((b, r.min_feasible_bytes));
        Ok(())
    }

    /// From a known fit (`lo >= 1`), finds the largest fitting batch: the lowest
    /// peak grows about linearly with the batch, so where the line through the last
    /// two samples meets the budget is the guess (secant steps, refined while the
    /// guess moves by more than 1%); then gallop from the guess and bisect. Ends with
    /// `lo` fitting and `lo + 1` planned and not fitting.
    fn run(&mut self) -> Result<()> {
        if self.lo >= 1 && self.hi > MAX_BATCH && self.lo < MAX_BATCH {
            let memory = self.memory;
            let base = self.lo.max(2);
            self.sample(base / 2)?;
            self.sample(base)?;
            let secant = |s: &Search<P>| -> u64 {
                let (b1, m1) = s.samples[s.samples.len() - 2];
                let (b2, m2) = s.samples[s.samples.len() - 1];
                let slope = (m2 as f64 - m1 as f64) / (b2 as f64 - b1 as f64);
                let g = if slope > 0.0 {
                    b2 as f64 + ((memory as f64 - m2 as f64) / slope).floor()
                } else {
                    2.0 * b2 as f64
                };
                let top = s.hi.saturating_sub(1).clamp(1, MAX_BATCH);
                (g.max(1.0).min(MAX_BATCH as f64) as u64).clamp((s.lo + 1).min(top), top)
            };
            let mut guess = secant(self);
            for _ in 0..3 {
                let last = self.samples[self.samples.len() - 1].0;
                if guess.abs_diff(last) * 100 <= guess || self.samples.iter().any(|x| x.0 == guess)
                {
                    break;
                }
                self.sample(guess)?;
                guess = secant(self);
            }
            self.settle(guess)?;
        }
        self.bisect()
    }

    /// Plans `guess`, then gallops from the bracket's open end (up from `lo` while
    /// nothing is known not to fit, else down from `hi`) until both ends are known.
    fn settle(&mut self, guess: u64) -> Result<()> {
        if self.lo < guess && guess < self.hi {
            self.probe(guess)?;
        }
        let mut step = 1u64;
        if self.hi > MAX_BATCH {
            while self.hi > MAX_BATCH && self.lo < MAX_BATCH {
                self.probe(self.lo.saturating_add(step).min(MAX_BATCH))?;
                step = step.saturating_mul(2);
            }
        } else {
            loop {
                let b = self.hi.saturating_sub(step);
                if b <= self.lo || self.probe(b)? {
                    break;
                }
                step = step.saturating_mul(2);
            }
        }
        Ok(())
    }

    /// Bisects until `lo + 1 == hi`.
    fn bisect(&mut self) -> Result<()> {
        while self.lo + 1 < self.hi && self.lo < MAX_BATCH {
            let mid = self.lo + (self.hi - self.lo) / 2;
            self.probe(mid)?;
        }
        Ok(())
    }
}

/// The largest batch at which the planner fits one training step in the budget;
/// `known_fit` is a batch known to fit without recomputation (the as-exported
/// answer; 0 when none). See the module documentation: on one step graph whose
/// sizes are affine in the batch when the step allows, else [`searched`].
pub fn planned_max_batch(model: &Model, o: &FitOptions, known_fit: u64) -> Result<PlannedFit> {
    let from = AFFINE_FROM;
    let g1 = step_graph(model, o, from)?;
    let g2 = step_graph(model, o, from + 1)?;
    if let Some(step) = AffineStep::new(g1, &g2, from) {
        if let Some(r) = affine(model, o, known_fit, step)? {
            return Ok(r);
        }
    }
    searched(model, o, known_fit)
}

/// A plan found, and the largest batch at which it fits.
struct Found {
    plan: Vec<Instr>,
    solver: Solver,
    method: String,
    max_fit: u64,
}

/// Greedy's largest batch (step 2 of the module documentation): greedy's lowest-peak
/// plan at `known_fit` gives the guess (where that plan meets the budget), then a
/// gallop and bisection from it, each batch planned on the step's graph (below
/// [`AffineStep::from`], on its own schedule). Returns the batch, greedy's plan
/// there, and the batches planned.
fn greedy_search(
    model: &Model,
    o: &FitOptions,
    known_fit: u64,
    step: &mut AffineStep,
) -> Result<(u64, Option<PlanReport>, u32)> {
    let from = step.from();
    let low = plan_graph(
        step.at(known_fit.clamp(from, MAX_BATCH)),
        o,
        Solver::Greedy,
        Some(0),
    )?;
    let guess = step.max_fit(&low.plan, o.budget());
    let mut s = Search::new(
        |b, budget| {
            if b < from {
                plan_step_under(model, o, b, Solver::Greedy, budget)
            } else {
                plan_graph(step.at(b), o, Solver::Greedy, budget)
            }
        },
        o.budget(),
        false,
    );
    s.probes = 1;
    s.probe(known_fit.clamp(1, MAX_BATCH))?;
    if s.lo >= 1 {
        s.settle(guess)?;
    }
    s.bisect()?;
    Ok((s.lo, s.lo_report, s.probes))
}

/// Steps 2 to 4 of the module documentation; `None` when the confirmation fails.
fn affine(
    model: &Model,
    o: &FitOptions,
    known_fit: u64,
    mut step: AffineStep,
) -> Result<Option<PlannedFit>> {
    let t0 = Instant::now();
    let memory = o.budget();
    let debug = std::env::var_os("MEMPLAN_DEBUG").is_some();
    let limited = |s: f64| FitOptions {
        plan_time_limit_s: o.plan_time_limit_s.min(s),
        ..o.clone()
    };
    let lowest = |step: &mut AffineStep, b: u64, limit: f64| -> Result<Found> {
        let r = plan_graph(step.at(b), &limited(limit), Solver::Ilp, Some(0))?;
        let max_fit = step.max_fit(&r.plan, memory);
        if debug {
            eprintln!(
                "fit: lowest-peak plan at batch {b} ({}, {:.3} s) fits up to batch {max_fit}",
                r.method,
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(Found {
            max_fit,
            plan: r.plan,
            solver: Solver::Ilp,
            method: r.method,
        })
    };
    let (greedy_lo, greedy_report, probes) = greedy_search(model, o, known_fit, &mut step)?;
    if debug {
        eprintln!(
            "fit: greedy fits up to batch {greedy_lo} ({probes} batches planned, {:.3} s)",
            t0.elapsed().as_secs_f64()
        );
    }
    let mut found: Vec<Found> = Vec::new();
    if let Some(r) = greedy_report.filter(|_| greedy_lo >= step.from()) {
        found.push(Found {
            max_fit: step.max_fit(&r.plan, memory),
            plan: r.plan,
            solver: Solver::Greedy,
            method: r.method,
        });
    }
    // The ILP's lowest-peak plan at greedy's answer locates the answer; then the
    // lowest-peak plan at the answer + 1, until it does not fit there.
    let first_at = greedy_lo.max(step.from());
    let first = lowest(&mut step, first_at, LOWEST_PEAK_TIME_LIMIT_S)?;
    let mut ilp_solves = 1;
    let mut answer = first.max_fit;
    found.push(first);
    let mut confirmed = answer < step.from() || answer >= MAX_BATCH;
    while !confirmed && ilp_solves <= CONFIRM_ROUNDS {
        let next = lowest(&mut step, answer + 1, LOWEST_PEAK_TIME_LIMIT_S)?;
        ilp_solves += 1;
        confirmed = next.max_fit <= answer;
        answer = answer.max(next.max_fit);
        found.push(next);
    }
    if !confirmed {
        return Ok(None);
    }
    let best = found.iter().map(|f| f.max_fit).max().unwrap_or(0);
    if best < step.from() {
        // Small batches, where the lines do not hold: the search.
        return Ok(None);
    }
    // The cheapest plan that fits at the answer.
    let g = step.at(best);
    let mut chosen: Option<(f64, &Found)> = None;
    for f in found.iter().filter(|f| f.max_fit >= best) {
        let cost = replay(g, &f.plan).map_err(Error::Graph)?.recompute_cost;
        if chosen.is_none_or(|(c, _)| cost < c) {
            chosen = Some((cost, f));
        }
    }
    let (_, f) = chosen.expect("a plan fits at the answer");
    // Confirm on the schedules built at the answer and the next batch.
    let at = step_graph(model, o, best)?;
    if !step.matches(&at, best) || replay(&at, &f.plan).map_err(Error::Graph)?.peak_bytes > memory {
        return Ok(None);
    }
    if best < MAX_BATCH {
        let next = step_graph(model, o, best + 1)?;
        if !step.matches(&next, best + 1) {
            return Ok(None);
        }
        for f in &found {
            if replay(&next, &f.plan).map_err(Error::Graph)?.peak_bytes <= memory {
                return Ok(None);
            }
        }
    }
    let lower =
        stage_lower_bound(&at, memory).unwrap_or(0.0) / at.base_cost().max(f64::MIN_POSITIVE);
    let mut report = report(&at, f, memory, t0)?;
    report.lower_bound_overhead = lower.min(report.overhead).max(0.0);
    Ok(Some(PlannedFit {
        max_batch: best,
        lower_bound_overhead: report.lower_bound_overhead,
        report,
        greedy_max_batch: greedy_lo,
        probes,
        ilp_solves,
        affine: true,
    }))
}

/// `f`'s plan on `g` as `plan` reports it, under `memory`.
/// The report of `plan` on `g` under `budget` (fit on the device: a plan replayed
/// at another batch).
pub(super) fn report_of(
    g: &RematGraph,
    plan: &[Instr],
    solver: Solver,
    method: String,
    budget: u64,
) -> Result<PlanReport> {
    let f = Found {
        plan: plan.to_vec(),
        solver,
        method,
        max_fit: 0,
    };
    report(g, &f, budget, Instant::now())
}

fn report(g: &RematGraph, f: &Found, memory: u64, t0: Instant) -> Result<PlanReport> {
    let r = replay(g, &f.plan).map_err(Error::Graph)?;
    let base = g.baseline_peak().map_err(Error::Graph)?;
    let base_cost = g.base_cost();
    Ok(PlanReport {
        solver: f.solver,
        feasible: r.peak_bytes <= memory,
        budget_bytes: memory,
        peak_bytes: r.peak_bytes,
        baseline_peak_bytes: base,
        min_feasible_bytes: r.peak_bytes.min(base),
        op_local_bound_bytes: g.op_local_bound().max(memory_floor(g)),
        proven_floor_bytes: 0,
        recompute_flops: r.recompute_cost,
        baseline_flops: base_cost,
        overhead: if base_cost > 0.0 {
            r.recompute_cost / base_cost
        } else {
            0.0
        },
        lower_bound_overhead: 0.0,
        solve_seconds: t0.elapsed().as_secs_f64(),
        recomputed: recomputed_values(g, &f.plan),
        schedule_len: f.plan.len(),
        method: f.method.clone(),
        plan: f.plan.clone(),
    })
}

/// The batch search on schedules built at each batch probed (steps whose structure
/// changes with the batch). Two searches, each planning a handful of batches (see
/// `Search::run`), and one more plan:
/// - greedy (milliseconds a batch), from `known_fit`, the as-exported answer, which
///   fits without recomputation: a batch fits when greedy plans it within the memory;
/// - the ILP planner, from greedy's answer (its portfolio holds greedy, so it fits
///   there too): a batch fits when the ILP's lowest-peak plan (planned for the
///   op-local bound) is within the memory;
/// - the ILP for the memory at the answer, once (`plan_time_limit_s`), for the
///   cheapest plan.
///
/// Both searches end confirmed: a plan within the memory at `max_batch`, none at
/// `max_batch + 1`. The cheapest plan within the memory at `max_batch` is reported
/// (the ILP's for the memory, its lowest-peak plan, or greedy's).
pub fn searched(model: &Model, o: &FitOptions, known_fit: u64) -> Result<PlannedFit> {
    let mut greedy = Search::new(
        |b, budget| plan_step_under(model, o, b, Solver::Greedy, budget),
        o.budget(),
        false,
    );
    greedy.probe(known_fit.clamp(1, MAX_BATCH))?;
    greedy.run()?;
    let mut ilp = Search::new(
        |b, budget| plan_step_under(model, o, b, Solver::Ilp, budget),
        o.budget(),
        true,
    );
    if greedy.lo >= 1 {
        ilp.lo = greedy.lo;
    } else {
        ilp.probe(1)?;
    }
    ilp.run()?;
    let (probes, greedy_max_batch) = (greedy.probes, greedy.lo);
    let mut ilp_solves = ilp.probes;
    if ilp.lo == 0 {
        let report = match ilp.batch1 {
            Some(r) => r,
            None => plan_step(model, o, 1, Solver::Ilp)?,
        };
        return Ok(PlannedFit {
            max_batch: 0,
            report,
            lower_bound_overhead: 0.0,
            greedy_max_batch,
            probes,
            ilp_solves,
            affine: false,
        });
    }
    ilp_solves += 1;
    let budgeted = plan_step(model, o, ilp.lo, Solver::Ilp)?;
    let lower_bound_overhead = budgeted.lower_bound_overhead;
    let mut candidates = vec![budgeted];
    candidates.extend(ilp.lo_report);
    if greedy.lo == ilp.lo {
        candidates.extend(greedy.lo_report);
    }
    let report = candidates
        .into_iter()
        .filter(|r| r.feasible)
        .min_by(|a, b| a.overhead.total_cmp(&b.overhead))
        .expect("the answer fits by construction");
    Ok(PlannedFit {
        max_batch: ilp.lo,
        report,
        lower_bound_overhead,
        greedy_max_batch,
        probes,
        ilp_solves,
        affine: false,
    })
}
