//! `memplan verify`: runs the training step twice on the CPU, following the
//! no-recompute schedule and following a plan, and compares them: measured peak
//! against predicted peak (each run's allocator against `replay` of its plan), and
//! the planned run's gradients against the baseline's, bit for bit.
//!
//! Everything that can be refused is refused before anything runs: a plan.json
//! that does not fit the step (see [`crate::remat::planfile`]), a budget no plan
//! meets, and a run whose predicted peak exceeds the memory it may use
//! (`--max-memory`, by default the machine's available memory). The predicted need
//! is the larger of the two runs' peaks: the bytes the allocator counts, i.e. every
//! tensor the step holds, in the schedule's storages. The CPU executor also keeps the
//! initial parameters (to start both runs from the same values) and makes
//! uncounted copies for views; those are the executor's own, not the step's.

use std::collections::BTreeMap;

use serde::Serialize;

use super::train::{train_step_on, Cpu, StepBackend, StepOptions, StepResult};
use super::{random_input, Executor, Options, Tensor};
use crate::error::{Error, Result, Setting};
use crate::infer::Inferred;
use crate::ir::Model;
use crate::remat::from_schedule::from_schedule;
use crate::remat::graph::{replay, Instr, RematGraph};
use crate::remat::plan::{plan, Solver};
use crate::remat::planfile::{PlanFile, StepSource};
use crate::step::TrainingStep;
use crate::train::TrainOptions;

/// Where the planned run's plan comes from.
#[derive(Debug, Clone)]
pub enum PlanSource {
    /// A plan.json (checked against the step first).
    File(Box<PlanFile>),
    /// This plan over the step's graph (checked by replay), named `label`.
    Given {
        /// The instructions.
        plan: Vec<Instr>,
        /// What `plan_source` reports.
        label: String,
    },
    /// Plan now, under this budget.
    Budget {
        /// Budget in bytes.
        bytes: u64,
        /// Planner.
        solver: Solver,
        /// Planner time limit, seconds.
        time_limit_s: f64,
    },
}

/// Options of `verify`.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The training step.
    pub train: TrainOptions,
    /// The executor's step options (learning rate, dropout seed...).
    pub step: StepOptions,
    /// Runs of each step; the reported seconds are the fastest.
    pub runs: usize,
    /// Refuse to run when the predicted peak exceeds this many bytes.
    pub max_memory: u64,
}

/// The `verify --json` object (keys are stable).
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// The model file.
    pub model: String,
    /// Batch size given (`None`: the model's own).
    pub batch: Option<u64>,
    /// Predicted peak of the planned step (replay of the plan).
    pub predicted_peak_bytes: u64,
    /// Peak the allocator measured running the plan.
    pub measured_peak_bytes: u64,
    /// Predicted peak of the no-recompute step.
    pub baseline_predicted_peak_bytes: u64,
    /// Peak the allocator measured running the no-recompute step.
    pub baseline_measured_peak_bytes: u64,
    /// Every gradient of the planned run equals the baseline's bit for bit.
    pub gradients_identical: bool,
    /// Largest absolute difference between planned and baseline gradients.
    pub max_abs_grad_diff: f64,
    /// Wall seconds of the baseline step (fastest of `runs`).
    pub baseline_seconds: f64,
    /// Wall seconds of the planned step (fastest of `runs`).
    pub planned_seconds: f64,
    /// `planned_seconds / baseline_seconds - 1`.
    pub measured_overhead: f64,
    /// The planner's predicted overhead (recomputed cost / step cost, in the plan's
    /// cost unit: FLOPs unless the plan was made with measured costs).
    pub predicted_overhead: f64,
    /// What `predicted_overhead` counts: `flops`, or `seconds` for a plan made
    /// with measured costs (`plan --costs`).
    pub cost_unit: String,
    /// Seconds the planned run spent recomputing (executions after a step's first),
    /// over `baseline_seconds`: the overhead measured inside the run, free of the
    /// noise between two runs.
    pub measured_recompute_overhead: f64,
    /// Floating-point operations of the no-recompute step (multiply-add = 2).
    pub baseline_flops: f64,
    /// `baseline_flops / baseline_seconds / 1e9`.
    pub baseline_gflops_per_second: f64,
    /// Loss (f64 sum of the f32 output) of both runs, equal when identical.
    pub loss: f64,
    /// The planned run's loss, updated parameters and optimizer state equal the
    /// baseline's bit for bit.
    pub updated_params_identical: bool,
    /// Budget of the plan.
    pub budget_bytes: u64,
    /// Where the plan came from: `file` or the planner's method (`ilp:gap-milp`...).
    pub plan_source: String,
    /// Forward steps the plan recomputes (executions beyond the first, counted).
    pub recomputations: usize,
    /// The step (schedule node name) at which the planned run's peak was measured.
    pub measured_peak_step: String,
    /// Runs of each step.
    pub runs: usize,
    /// Where the step ran: `cpu` or `cuda` (`verify --device`).
    pub device: String,
    /// The GPU's name (`cuda`; the host emulation names itself); `null` on the CPU.
    pub device_name: Option<String>,
    /// `cuMemGetInfo`'s largest drop in free bytes during the planned run (the
    /// driver's view, in its page granularity, beside the counted peak); `null`
    /// on the CPU and the emulation.
    pub mem_get_info_peak_delta_bytes: Option<u64>,
    /// The same for the baseline run.
    pub baseline_mem_get_info_peak_delta_bytes: Option<u64>,
    /// Peak device workspace bytes over both runs, counted apart from the tensor
    /// peaks: the cuBLAS workspace, im2col columns, BatchNorm statistics, views
    /// the kernels copy; `null` on the CPU.
    pub workspace_peak_bytes: Option<u64>,
    /// Peak bytes the device launchers held beyond the step's storages over both
    /// runs (their temporaries and outputs before the step stores them), counted
    /// apart from the tensor peaks and the workspace; `null` on the CPU.
    pub launch_peak_bytes: Option<u64>,
    /// On a device: the largest relative difference of a gradient of the
    /// device baseline against the CPU executor's (per tensor
    /// `max|dev − cpu| / max|cpu|`); `null` on the CPU.
    pub cpu_max_rel_grad_diff: Option<f64>,
}

/// A model's training step, built and mapped onto the rematerialization graph.
pub struct Step<'a> {
    model: &'a Model,
    step: TrainingStep,
}

impl<'a> Step<'a> {
    /// Builds the step of `model` (inferred as `inf`) with `train` options.
    pub fn new(model: &'a Model, inf: &Inferred, train: &TrainOptions, name: &str) -> Result<Self> {
        let schedule = crate::step::schedule(model, inf, train)?;
        let graph = from_schedule(&schedule, name);
        Ok(Step {
            model,
            step: TrainingStep {
                inferred: inf.clone(),
                schedule,
                graph,
            },
        })
    }

    /// The rematerialization graph (node i = schedule step i).
    pub fn graph(&self) -> &RematGraph {
        &self.step.graph
    }

    /// Runs the step once on the CPU following `plan`.
    pub fn run(
        &self,
        plan: &[Instr],
        params: &[Option<Tensor>],
        inputs: &[Tensor],
        opts: &StepOptions,
    ) -> Result<StepResult> {
        self.run_on(&Cpu, plan, params, inputs, opts)
    }

    /// Runs the step once on backend `b` following `plan`.
    pub fn run_on<B: StepBackend>(
        &self,
        b: &B,
        plan: &[Instr],
        params: &[Option<Tensor>],
        inputs: &[Tensor],
        opts: &StepOptions,
    ) -> Result<StepResult> {
        train_step_on(b, self.model, &self.step, plan, params, inputs, opts)
    }
}

/// The machine's available memory (Linux `MemAvailable`), if known.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Seeded inputs for every graph input (integers in `[0, 10)`, valid token ids
/// for every model's vocabulary).
pub fn seeded_inputs(model: &Model, inf: &Inferred) -> Result<Vec<Tensor>> {
    model
        .graph
        .inputs
        .iter()
        .enumerate()
        .map(|(k, &t)| {
            random_input(&inf.facts[t], 100 + k as u64, 10)
                .map_err(|e| Error::Binding(format!("input '{}': {e}", model.graph.tensor(t).name)))
        })
        .collect()
}

/// Runs `runs` times; the result of the fastest run.
fn fastest<B: StepBackend>(
    b: &B,
    step: &Step,
    plan: &[Instr],
    params: &[Option<Tensor>],
    inputs: &[Tensor],
    opts: &StepOptions,
    runs: usize,
) -> Result<StepResult> {
    let mut best: Option<StepResult> = None;
    for _ in 0..runs.max(1) {
        let r = step.run_on(b, plan, params, inputs, opts)?;
        if best.as_ref().is_none_or(|x| r.seconds < x.seconds) {
            best = Some(r);
        }
    }
    Ok(best.expect("ran at least once"))
}

/// Bitwise equality and the largest absolute difference of two tensor lists.
fn compare(a: &[Tensor], b: &[Tensor]) -> (bool, f64) {
    let mut same = a.len() == b.len();
    let mut max = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.to_f64s(), y.to_f64s());
        same &= x.len() == y.len();
        for (p, q) in x.iter().zip(&y) {
            same &= p.to_bits() == q.to_bits();
            let d = (p - q).abs();
            if d > max || d.is_nan() {
                max = if d.is_nan() { f64::INFINITY } else { d };
            }
        }
    }
    (same, max)
}

/// What `verify` measured, and the baseline run's per-step seconds (for
/// `--write-costs`: node name → seconds, as `plan --costs` reads).
pub struct Verified {
    /// The report.
    pub report: VerifyReport,
    /// Node name → seconds of its execution in the fastest baseline run.
    pub costs: BTreeMap<String, f64>,
}

/// Verifies the step of `model` (inferred as `inf`, from `source`) against `plan`,
/// on the CPU.
pub fn verify(
    model: &Model,
    inf: &Inferred,
    source: &StepSource,
    plan_source: &PlanSource,
    o: &VerifyOptions,
) -> Result<Verified> {
    let step = Step::new(model, inf, &o.train, &source.model)?;
    verify_with(&Cpu, &step, source, plan_source, o, &mut |_| {})
}

/// What a device run measured besides the step's result.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Default)]
struct DeviceRun {
    mem_get_info_peak_delta_bytes: Option<u64>,
    workspace_peak_bytes: u64,
    launch_peak_bytes: u64,
}

/// [`verify`] on a CUDA [`crate::exec::cuda::Device`] (or its host emulation):
/// both runs on the device, measured peaks the device counter's; the device
/// baseline's gradients are also compared with the CPU executor's
/// (`cpu_max_rel_grad_diff`).
#[cfg(feature = "cuda")]
pub fn verify_cuda(
    model: &Model,
    inf: &Inferred,
    source: &StepSource,
    plan_source: &PlanSource,
    o: &VerifyOptions,
    dev: &crate::exec::cuda::Device,
) -> Result<Verified> {
    let b = crate::exec::cuda::step::DeviceStep::new(dev);
    let mut runs: Vec<DeviceRun> = Vec::new();
    let step = Step::new(model, inf, &o.train, &source.model)?;
    let mut v = verify_with(&b, &step, source, plan_source, o, &mut |b| {
        runs.push(DeviceRun {
            mem_get_info_peak_delta_bytes: b.mem_get_info_peak_delta_bytes(),
            workspace_peak_bytes: b.memory().workspace_peak_bytes,
            launch_peak_bytes: b.memory().launch_peak_bytes,
        })
    })?;
    // The runs: `o.runs` baseline runs, then `o.runs` planned ones.
    let n = o.runs.max(1);
    let r = &mut v.report;
    r.device = "cuda".into();
    r.device_name = Some(dev.name()?);
    r.baseline_mem_get_info_peak_delta_bytes = runs[..n]
        .iter()
        .filter_map(|d| d.mem_get_info_peak_delta_bytes)
        .max();
    r.mem_get_info_peak_delta_bytes = runs[n..]
        .iter()
        .filter_map(|d| d.mem_get_info_peak_delta_bytes)
        .max();
    r.workspace_peak_bytes = runs.iter().map(|d| d.workspace_peak_bytes).max();
    r.launch_peak_bytes = runs.iter().map(|d| d.launch_peak_bytes).max();
    Ok(v)
}

/// What the CPU executor's process holds per byte of the step's predicted peak, less
/// [`HOST_BASE`]: measured with `--budget 100%` and `0.8` on ten models, at most 4.11×
/// (ViT-B/16 at batch 2: 6.66 GiB resident for 1.61 GiB; BERT-base 3.92×, GPT-2 3.76×,
/// ResNet-18 3.6×, ResNet-50 2.9×, MobileNetV2 1.1×), so 5× leaves a fifth to spare.
const HOST_FACTOR: u64 = 5;

/// The process's own resident memory before any tensor (28 MB measured).
const HOST_BASE: u64 = 32 << 20;

/// The largest per-tensor `max|a − b| / max|b|`.
fn max_rel_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let (x, y) = (x.to_f64s(), y.to_f64s());
            let scale = y.iter().fold(0f64, |m, v| m.max(v.abs()));
            let d = x
                .iter()
                .zip(&y)
                .fold(0f64, |m, (p, q)| m.max((p - q).abs()));
            if d == 0.0 {
                0.0
            } else {
                d / scale.max(f64::MIN_POSITIVE)
            }
        })
        .fold(0f64, f64::max)
}

/// The planned run's plan, from a file, given, or planned now under a budget.
struct Planned {
    plan: Vec<Instr>,
    /// Its predicted peak.
    predicted: u64,
    budget: u64,
    /// Where it came from (`plan_source`).
    from: String,
    /// Recomputed cost over the step's, in `unit`.
    predicted_overhead: f64,
    unit: String,
}

impl Planned {
    /// The plan `plan_source` gives over `g`, the step of `source`.
    fn of(g: &RematGraph, source: &StepSource, plan_source: &PlanSource) -> Result<Planned> {
        Ok(match plan_source {
            PlanSource::File(f) => {
                let peak = f.check_against(g, source)?;
                // In the file's own costs (FLOPs, or the seconds it was planned with).
                let cost = replay(&f.graph, &f.plan)
                    .map_err(Error::Plan)?
                    .recompute_cost;
                Planned {
                    plan: f.plan.clone(),
                    predicted: peak,
                    budget: f.budget_bytes,
                    from: "file".to_string(),
                    predicted_overhead: cost / f.graph.base_cost().max(f64::MIN_POSITIVE),
                    unit: f.cost_unit.clone(),
                }
            }
            PlanSource::Given { plan, label } => {
                let r = replay(g, plan)
                    .map_err(|e| Error::Plan(format!("the plan is invalid: {e}")))?;
                Planned {
                    plan: plan.clone(),
                    predicted: r.peak_bytes,
                    budget: r.peak_bytes,
                    from: label.clone(),
                    predicted_overhead: r.recompute_cost / g.base_cost().max(f64::MIN_POSITIVE),
                    unit: "flops".to_string(),
                }
            }
            PlanSource::Budget {
                bytes,
                solver,
                time_limit_s,
            } => {
                let r = plan(g, *bytes, *solver, *time_limit_s)?;
                if !r.feasible {
                    return Err(Error::Plan(format!(
                        "no plan fits the budget of {}: the lowest peak found is {} (no recompute: {})",
                        crate::units::human_bytes(*bytes),
                        crate::units::human_bytes(r.min_feasible_bytes),
                        crate::units::human_bytes(r.baseline_peak_bytes)
                    )));
                }
                Planned {
                    plan: r.plan,
                    predicted: r.peak_bytes,
                    budget: *bytes,
                    from: r.method,
                    predicted_overhead: r.overhead,
                    unit: "flops".to_string(),
                }
            }
        })
    }
}

/// Refuses a run whose predicted `peak` needs more than `max_memory`. On the host,
/// the CPU executor's own buffers come on top of the step's tensors (float64
/// operands, both runs' gradients for the comparison): measured 3.8× the predicted
/// peak on GPT-2 (9.6 GB resident for 2.54 GB) and 3.6× on ResNet-18 at batch 8, so
/// the guard asks for [`HOST_FACTOR`]× and the process's own [`HOST_BASE`]. A device (`on_device`)
/// counts its tensors alone.
fn check_memory(on_device: bool, peak: u64, max_memory: u64) -> Result<()> {
    let (need, how) = if on_device {
        (peak, "the predicted peak".to_string())
    } else {
        let n = peak.saturating_mul(HOST_FACTOR).saturating_add(HOST_BASE);
        (
            n,
            format!(
                "{HOST_FACTOR} × the predicted peak of {} ({peak} bytes), with the CPU executor's own buffers",
                crate::units::human_bytes(peak)
            ),
        )
    };
    if need > max_memory {
        return Err(Error::setting(
            Setting::MaxMemory,
            format!(
                "the run needs about {} ({how}), more than the {} it may use",
                crate::units::human_bytes(need),
                crate::units::human_bytes(max_memory)
            ),
        ));
    }
    Ok(())
}

/// [`verify`] of `step` on backend `b`; `after_run` is called after every run.
fn verify_with<B: StepBackend>(
    b: &B,
    step: &Step,
    source: &StepSource,
    plan_source: &PlanSource,
    o: &VerifyOptions,
    after_run: &mut dyn FnMut(&B),
) -> Result<Verified> {
    let (model, inf) = (step.model, &step.step.inferred);
    // The executor runs the step the schedule was built for.
    let step_opts = StepOptions {
        optimizer: o.train.optimizer,
        loss: o.train.loss,
        ..o.step
    };
    let g = step.graph();
    let base_plan = g.no_recompute_plan();
    let base = replay(g, &base_plan).map_err(Error::Graph)?;
    let planned = Planned::of(g, source, plan_source)?;
    let peak = base.peak_bytes.max(planned.predicted);
    check_memory(b.live_bytes().is_some(), peak, o.max_memory)?;
    let params = Executor::new(
        model,
        inf,
        Options {
            seed: step_opts.seed,
            dropout: step_opts.dropout,
        },
    )?
    .params()
    .to_vec();
    let inputs = seeded_inputs(model, inf)?;
    let on_device = b.live_bytes().is_some();
    let mut run = |plan: &[Instr]| -> Result<StepResult> {
        let mut best: Option<StepResult> = None;
        for _ in 0..o.runs.max(1) {
            let r = fastest(b, step, plan, &params, &inputs, &step_opts, 1)?;
            after_run(b);
            if best.as_ref().is_none_or(|x| r.seconds < x.seconds) {
                best = Some(r);
            }
        }
        Ok(best.expect("ran at least once"))
    };
    let base_run = run(&base_plan)?;
    let p = run(&planned.plan)?;
    let b = base_run;
    let cpu_max_rel_grad_diff = if on_device {
        let c = step.run(&base_plan, &params, &inputs, &step_opts)?;
        Some(max_rel_diff(&b.grads, &c.grads))
    } else {
        None
    };
    let costs = g
        .nodes
        .iter()
        .zip(&b.step_seconds)
        .map(|(n, &s)| (n.name.clone(), s))
        .collect();
    let mut report = report(source, g, &planned, base.peak_bytes, &p, &b, o.runs);
    report.cpu_max_rel_grad_diff = cpu_max_rel_grad_diff;
    Ok(Verified { report, costs })
}

/// The report of the planned run `p` against the baseline run `b` of the step of
/// `source` (graph `g`, baseline predicted peak `base_peak`), `runs` runs each;
/// as measured on the CPU.
fn report(
    source: &StepSource,
    g: &RematGraph,
    planned: &Planned,
    base_peak: u64,
    p: &StepResult,
    b: &StepResult,
    runs: usize,
) -> VerifyReport {
    let (gradients_identical, max_abs_grad_diff) = compare(&p.grads, &b.grads);
    let (pa, pb): (Vec<Tensor>, Vec<Tensor>) = p
        .params
        .iter()
        .zip(&b.params)
        .filter_map(|(x, y)| Some((x.clone()?, y.clone()?)))
        .unzip();
    let (mut params_same, _) = compare(&pa, &pb);
    // The optimizer state after the update too.
    params_same &= match (&p.state, &b.state) {
        (Some(x), Some(y)) => compare(std::slice::from_ref(x), std::slice::from_ref(y)).0,
        (x, y) => x.is_none() && y.is_none(),
    };
    let peak_at = p
        .live_after
        .iter()
        .position(|&l| l == p.peak_bytes)
        .unwrap_or(0);
    let peak_step = match planned.plan.get(peak_at) {
        Some(Instr::Compute(i)) => g.nodes[*i].name.clone(),
        Some(Instr::Free(v)) => format!("free {}", g.values[*v].name),
        Some(Instr::Load(v)) => format!("load {}", g.values[*v].name),
        None => String::new(),
    };
    let base_flops = g.base_cost();
    VerifyReport {
        model: source.model.clone(),
        batch: source.batch,
        predicted_peak_bytes: planned.predicted,
        measured_peak_bytes: p.peak_bytes,
        baseline_predicted_peak_bytes: base_peak,
        baseline_measured_peak_bytes: b.peak_bytes,
        gradients_identical,
        max_abs_grad_diff,
        baseline_seconds: b.seconds,
        planned_seconds: p.seconds,
        measured_overhead: p.seconds / b.seconds.max(f64::MIN_POSITIVE) - 1.0,
        predicted_overhead: planned.predicted_overhead,
        cost_unit: planned.unit.clone(),
        measured_recompute_overhead: p.recompute_seconds / b.seconds.max(f64::MIN_POSITIVE),
        baseline_flops: base_flops,
        baseline_gflops_per_second: base_flops / b.seconds.max(f64::MIN_POSITIVE) / 1e9,
        loss: b.loss,
        updated_params_identical: params_same && p.loss.to_bits() == b.loss.to_bits(),
        budget_bytes: planned.budget,
        plan_source: planned.from.clone(),
        recomputations: p.executions.iter().map(|&e| e.saturating_sub(1)).sum(),
        measured_peak_step: peak_step,
        runs: runs.max(1),
        device: "cpu".into(),
        device_name: None,
        mem_get_info_peak_delta_bytes: None,
        baseline_mem_get_info_peak_delta_bytes: None,
        workspace_peak_bytes: None,
        launch_peak_bytes: None,
        cpu_max_rel_grad_diff: None,
    }
}

impl VerifyReport {
    /// The human-readable report.
    pub fn to_text(&self) -> String {
        use crate::units::human_bytes;
        let mark = |a: u64, b: u64| {
            if a == b {
                "equal".to_string()
            } else {
                format!("DIFFERENT by {} bytes", a as i128 - b as i128)
            }
        };
        let mut s = String::new();
        s.push_str(&format!(
            "model        {} (batch {})\n",
            self.model,
            self.batch.map_or("as exported".into(), |b| b.to_string())
        ));
        if let Some(name) = &self.device_name {
            s.push_str(&format!(
                "device       {} ({name}); workspace peak {}, launch bucket peak {} (apart from the tensors)",
                self.device,
                self.workspace_peak_bytes.map_or("?".into(), human_bytes),
                self.launch_peak_bytes.map_or("?".into(), human_bytes)
            ));
            if let Some(d) = self.mem_get_info_peak_delta_bytes {
                s.push_str(&format!("; cuMemGetInfo peak delta {}", human_bytes(d)));
            }
            if let Some(r) = self.cpu_max_rel_grad_diff {
                s.push_str(&format!("; gradients vs CPU: max rel diff {r:.1e}"));
            }
            s.push('\n');
        }
        s.push_str(&format!(
            "plan         {} (budget {}), {} recomputations\n",
            self.plan_source,
            human_bytes(self.budget_bytes),
            self.recomputations
        ));
        s.push_str("             predicted      measured       (bytes counted: every tensor of the step)\n");
        s.push_str(&format!(
            "baseline     {:<14} {:<14} {}\n",
            human_bytes(self.baseline_predicted_peak_bytes),
            human_bytes(self.baseline_measured_peak_bytes),
            mark(
                self.baseline_measured_peak_bytes,
                self.baseline_predicted_peak_bytes
            )
        ));
        s.push_str(&format!(
            "planned      {:<14} {:<14} {} (peak at {})\n",
            human_bytes(self.predicted_peak_bytes),
            human_bytes(self.measured_peak_bytes),
            mark(self.measured_peak_bytes, self.predicted_peak_bytes),
            self.measured_peak_step
        ));
        s.push_str(&format!(
            "gradients    {} (max |diff| {:e}); loss {:.6}\n",
            if self.gradients_identical {
                "bitwise identical"
            } else {
                "DIFFER"
            },
            self.max_abs_grad_diff,
            self.loss
        ));
        s.push_str(&format!(
            "time         baseline {:.3} s ({:.2} GFLOP/s), planned {:.3} s: {:+.1}% measured ({:+.1}% in recomputation), {:+.1}% predicted ({})\n",
            self.baseline_seconds,
            self.baseline_gflops_per_second,
            self.planned_seconds,
            self.measured_overhead * 100.0,
            self.measured_recompute_overhead * 100.0,
            self.predicted_overhead * 100.0,
            self.cost_unit
        ));
        s
    }
}
