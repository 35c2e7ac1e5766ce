//! The training step on CPU, following a plan over the schedule's [`RematGraph`]
//! (one node per [`Schedule`] step, one value per storage; see
//! [`crate::remat::from_schedule`]): forward kernels, the loss, backward kernels, and
//! an SGD update, every buffer counted by one [`Allocator`].
//!
//! Accounting follows the schedule's storages exactly:
//! - fixed storages (parameters, buffers, constants, the input batch, optimizer
//!   state) are allocated before the first instruction and stay to the end;
//! - `Compute(i)` allocates every storage step `i` writes that is not live, with the
//!   storage's bytes (the kernel's tensor must have exactly those bytes), then runs
//!   the kernel; `Free(v)` releases storage `v` and drops every value held in it;
//! - a view (an output or gradient whose schedule storage is its source's) allocates
//!   nothing: on the GPU it aliases; on the CPU the kernel returns its own copy, which
//!   lives exactly as long as the storage it aliases and is not counted.
//!
//! - a view whose storage was freed and recomputed is made again when next read,
//!   allocating nothing: a reshape-like view (the op keeps every element in place)
//!   is its source reshaped to the inferred shape; any other view runs its kernel
//!   again, shape arguments whose storage was freed standing in with their folded
//!   value (PyTorch keeps a view's sizes on the host, not in a device buffer).
//!
//! So the allocator's peak is the peak of [`crate::remat::graph::replay`] of the
//! same plan by construction *if* the executor follows the plan and every kernel
//! writes what the schedule says; both are checked at every step (a read of a
//! storage that is not live, or a written tensor of other bytes, is an error).
//!
//! [`StepResult::live_after`] gives the live bytes after every plan instruction;
//! after a `Compute` that is the step's high-water mark (its writes are allocated
//! before its kernel runs, and nothing is freed inside a step).
//!
//! Fused patterns ([`crate::train::FusedPattern`]: exact and tanh GELU, SiLU, SDPA,
//! decomposed LayerNorm, RMSNorm's rsqrt) run op by op
//! forward, each node's step writing what the schedule says; the SDPA's Softmax
//! step also computes the per-row logsumexp of its scores, which the pattern's last
//! forward step writes as its Extra (the exact bytes the schedule counts; on the GPU
//! both are one kernel). At the pattern's first backward step (its last node's), the
//! pattern's inner forward values are recomputed from what that step reads (GELU, SiLU:
//! `x`; SDPA: q, k, v, the output, the logsumexp) and fixed storages, Dropout masks
//! regenerated from their node's seed, autocast copies made again; these values are transient and not counted,
//! as they live inside the fused backward kernel, and are dropped after the
//! pattern's last backward step. Each node's backward kernel then takes its saved
//! tensors from them and stores its gradients as the schedule says, so the
//! accounting is the schedule's. SDPA: the recomputed output and logsumexp must
//! equal the saved ones bitwise. A pattern input that is an activation the fused
//! kernel does not save (an attention mask computed in the graph) stands in with its
//! folded constant value; without one the step is refused, naming it.
//!
//! Fake quantization ([`crate::train::FakeQuant`]) runs as one float → float op:
//! its QuantizeLinear's step computes the mask (its Extra) from the float input, its
//! DequantizeLinear's step the fake-quantized output from the same input (read
//! through the pair's integer views, which hold no value: the executor has no 8-bit
//! tensors), both with `ops::quantize::fake_quantize` on the host (downloaded and
//! uploaded on a device); the scale and zero point are the buffers' values, or the
//! folded values of the exporter's casts and constants, which run no kernel.
//! Backward, the DequantizeLinear's and Clip's gradients are the incoming one (a
//! view); the QuantizeLinear's is `fake_quantize_backward` of it and the mask.
//!
//! Optimizers (PyTorch's formulas, one step from zero state): SGD, momentum, Adam,
//! AdamW with [`StepOptions`]' hyperparameters. The state storage (persistent) holds
//! one f32 vector per state over all parameters; foreach Adam's temporary (the
//! denominators of every parameter at once) is the optimizer step's OptimizerTemp
//! write. Resident gradients (`grads_resident`: persistent `.grad`): each is a
//! zeroed value of its storage's type, put before the first instruction (a fixed
//! storage); the parameter's first gradient is written into it
//! ([`StepBackend::write_into`]: the value, not a sum with the zeros), later ones
//! are added in place.
//!
//! Precision policies ([`crate::train::Precision`]): every float value is held in
//! its storage's type (f16/bf16 under a half policy) and computed in f32 (kernel
//! inputs widened, outputs rounded to the storage's type). An autocast copy (a
//! [`StorageKind::Cast`] storage in [`crate::train::Step::slots`]) is made by the
//! step that writes it, from its source; a cached weight copy, made once, is read by
//! later steps as it is; a backward kernel reads the copy its forward read.
//! Gradients are rounded to their storage's type (autocast's cast back), partials
//! added in f32 and rounded. Pure bf16: parameters, the batch, optimizer state and
//! temporaries bf16 too, the update computed in f32 and rounded back.
//!
//! Supported: fp32, amp-fp16, amp-bf16, bf16; `Loss::Mean`, `Loss::Sum` or `Loss::Graph`; SGD,
//! momentum, Adam, AdamW; gradients resident or not; the fused patterns
//! (under every policy). Not run: a fused pattern whose input is an activation the
//! fused kernel does not save and that has no folded value (refused, named).

mod backend;
mod optimizer;
mod steps;

pub use backend::{Cpu, StepBackend};
pub(crate) use optimizer::optimizer_step;
pub(crate) use steps::logsumexp_last;
use steps::*;

use std::collections::{HashMap, HashSet};

use petgraph::stable_graph::NodeIndex;

use crate::error::{Error, Result};
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::numeric::{rng, Tensor};
use crate::ops::{registry, BackwardCx, KernelCx, Saved};
use crate::remat::graph::{Instr as PlanOp, RematGraph};
use crate::step::TrainingStep;
use crate::train::{
    fake_quant_roles, FakeQuantRole, FusedKind, FusedPattern, Loss, Optimizer, Schedule, StepKind,
    StorageId, StorageKind,
};

/// The storages a forward step writes for backward only (its op's extras).
fn extra_writes(s: &Schedule, step: &crate::train::Step) -> Vec<StorageId> {
    step.writes
        .iter()
        .copied()
        .filter(|&w| s.storages[w].kind == StorageKind::Extra)
        .collect()
}

/// Counts live bytes and records the peak.
#[derive(Debug, Clone, Default)]
pub struct Allocator {
    live: Vec<bool>,
    bytes: Vec<u64>,
    /// Bytes live now.
    pub current: u64,
    /// Highest `current` so far.
    pub peak: u64,
    /// Allocations made.
    pub allocations: u64,
}

impl Allocator {
    /// An allocator over storages of the given sizes, none live.
    pub fn new(bytes: Vec<u64>) -> Allocator {
        Allocator {
            live: vec![false; bytes.len()],
            bytes,
            ..Default::default()
        }
    }

    /// Allocates storage `s` (an error if it is live).
    pub fn alloc(&mut self, s: StorageId) -> Result<()> {
        if self.live[s] {
            return Err(format!("storage {s} allocated twice").into());
        }
        self.live[s] = true;
        self.current += self.bytes[s];
        self.allocations += 1;
        self.peak = self.peak.max(self.current);
        Ok(())
    }

    /// Frees storage `s` if live; returns whether it was.
    pub fn free(&mut self, s: StorageId) -> bool {
        if !self.live[s] {
            return false;
        }
        self.live[s] = false;
        self.current -= self.bytes[s];
        true
    }

    /// Whether storage `s` is live.
    pub fn is_live(&self, s: StorageId) -> bool {
        self.live[s]
    }
}

/// Options of a training step.
#[derive(Debug, Clone, Copy)]
pub struct StepOptions {
    /// Learning rate.
    pub lr: f32,
    /// The optimizer the schedule was built with.
    pub optimizer: Optimizer,
    /// Momentum's coefficient (PyTorch's SGD defaults to 0, which is plain SGD; 0.9,
    /// the usual choice, here). Dampening 0, no Nesterov (PyTorch's defaults).
    pub momentum: f64,
    /// Adam's `(β1, β2)` (PyTorch: `(0.9, 0.999)`). Hyperparameters are f64 (Python
    /// floats): the update's coefficients (`1 − β`, bias corrections, step size) are
    /// computed in f64 and rounded to f32 once, as PyTorch passes them to its kernels.
    pub betas: (f64, f64),
    /// Adam's ε (PyTorch: 1e-8).
    pub eps: f64,
    /// Weight decay; `None`: PyTorch's default for the optimizer (0, AdamW 1e-2).
    /// SGD, momentum and Adam add `wd·p` to the gradient; AdamW scales `p` by
    /// `1 − lr·wd` first.
    pub weight_decay: Option<f64>,
    /// Seed of Dropout masks (as [`crate::exec::Options::seed`]).
    pub seed: u64,
    /// Whether training-mode Dropout drops.
    pub dropout: bool,
    /// The loss the schedule was built with.
    pub loss: Loss,
}

impl Default for StepOptions {
    fn default() -> StepOptions {
        StepOptions {
            lr: 0.01,
            optimizer: Optimizer::Sgd,
            momentum: 0.9,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: None,
            seed: 0,
            dropout: true,
            loss: Loss::Mean,
        }
    }
}

/// What a training step produced and measured.
#[derive(Debug, Clone)]
pub struct StepResult {
    /// The loss, accumulated in f64.
    pub loss: f64,
    /// The first graph output.
    pub output: Tensor,
    /// Gradient of each parameter in [`Schedule::with_grad`], same order.
    pub grads: Vec<Tensor>,
    /// Parameters after the update (by tensor id; `None` for non-initializers).
    pub params: Vec<Option<Tensor>>,
    /// Peak live bytes measured by the allocator.
    pub peak_bytes: u64,
    /// Live bytes after each plan instruction.
    pub live_after: Vec<u64>,
    /// Executions of each step (more than one: recomputed).
    pub executions: Vec<usize>,
    /// Wall seconds of each step's first execution (its kernels and bookkeeping).
    pub step_seconds: Vec<f64>,
    /// Wall seconds of every execution after a step's first (the recomputation).
    pub recompute_seconds: f64,
    /// Wall seconds of the whole step.
    pub seconds: f64,
    /// The optimizer state after the update (`None` for SGD): one f32 vector over
    /// the parameters of [`Schedule::with_grad`] concatenated in order, per state
    /// (momentum: the buffer; Adam/AdamW: `exp_avg` then `exp_avg_sq`).
    pub state: Option<Tensor>,
}

/// Runs one training step of `model` on the CPU following `plan` over `step`'s
/// graph (one node per schedule step, see
/// [`crate::remat::from_schedule::from_schedule`]), from parameters `params` (as
/// [`crate::exec::Executor::params`]) on `inputs` (one per graph input).
pub fn train_step(
    model: &Model,
    step: &TrainingStep,
    plan: &[PlanOp],
    params: &[Option<Tensor>],
    inputs: &[Tensor],
    opts: &StepOptions,
) -> Result<StepResult> {
    train_step_on(&Cpu, model, step, plan, params, inputs, opts)
}

/// [`train_step`] on backend `b`: the same plan, storages and checks; the
/// measured peak is the backend's count where it has one
/// ([`StepBackend::peak_bytes`]), else the schedule [`Allocator`]'s.
pub fn train_step_on<B: StepBackend>(
    b: &B,
    model: &Model,
    step: &TrainingStep,
    plan: &[PlanOp],
    params: &[Option<Tensor>],
    inputs: &[Tensor],
    opts: &StepOptions,
) -> Result<StepResult> {
    check_plan(model, step, plan, inputs)?;
    b.check(&step.schedule, opts)?;
    b.begin()?;
    let mut run = Run::new(b, model, step, opts);
    run.setup(params, inputs)?;
    run.live_after.reserve(plan.len());
    for (k, op) in plan.iter().enumerate() {
        run.instruction(k, op)?;
    }
    run.result()
}

/// Refuses, before anything runs, a graph that is not the schedule's, an invalid
/// plan (the whole plan is checked: every read live, every step computed, only
/// forward steps recomputed) and inputs that are not one per graph input.
fn check_plan(
    model: &Model,
    step: &TrainingStep,
    plan: &[PlanOp],
    inputs: &[Tensor],
) -> Result<()> {
    let (s, g, gr) = (&step.schedule, &step.graph, &model.graph);
    if g.nodes.len() != s.steps.len() || g.values.len() != s.storages.len() {
        return Err(Error::Graph(
            "the plan's graph is not this schedule's".into(),
        ));
    }
    crate::remat::graph::replay(g, plan)
        .map_err(|e| Error::Graph(format!("the plan is invalid: {e}")))?;
    if inputs.len() != gr.inputs.len() {
        return Err(Error::Binding(format!(
            "the model has {} inputs, {} were given",
            gr.inputs.len(),
            inputs.len()
        )));
    }
    Ok(())
}

/// What every step of a run reads and none changes: the backend, the model, its
/// inferred shapes and schedule, the options, and each node's forward step.
struct Cx<'a, B: StepBackend> {
    b: &'a B,
    model: &'a Model,
    inf: &'a Inferred,
    s: &'a Schedule,
    opts: &'a StepOptions,
    /// The forward step of each node.
    step_of: HashMap<NodeIndex, usize>,
}

/// The values a run holds, each in one storage: parameters (in their storage's
/// type), forward tensors and gradients by tensor id, with the storage each
/// gradient lives in; extras, the loss, partial gradients, autocast copies and the
/// optimizer state by storage id.
struct Values<T> {
    params: Vec<Option<T>>,
    fwd: Vec<Option<T>>,
    gval: Vec<Option<T>>,
    gstore: Vec<Option<StorageId>>,
    sval: Vec<Option<T>>,
}

impl<T> Values<T> {
    /// No value for `n_t` tensors and `n_s` storages.
    fn new(n_t: usize, n_s: usize) -> Values<T> {
        let none = |n: usize| -> Vec<Option<T>> { (0..n).map(|_| None).collect() };
        Values {
            params: none(n_t),
            fwd: none(n_t),
            gval: none(n_t),
            gstore: vec![None; n_t],
            sval: none(n_s),
        }
    }

    /// Forward tensor `t`'s value: the parameter's, else the one computed.
    fn of(&self, t: TensorId) -> Option<&T> {
        self.params[t].as_ref().or(self.fwd[t].as_ref())
    }
}

/// Checks that value `t` has the bytes of storage `st`.
fn check_bytes<B: StepBackend>(s: &Schedule, st: StorageId, t: &B::T) -> Result<()> {
    let want = s.storages[st].bytes;
    let have = B::dtype(t)
        .bytes_for(B::numel(t) as u64)
        .unwrap_or(u64::MAX);
    if want != have {
        return Err(format!(
            "writes {have} bytes into '{}' of {want}",
            s.storages[st].name
        )
        .into());
    }
    Ok(())
}

/// One run of a training step: its values, the [`Allocator`] that counts their
/// storages, the fused patterns' state, and what it measures. [`Run::setup`] puts
/// what lives from the start, [`Run::instruction`] follows the plan one
/// instruction at a time, [`Run::result`] reads the result back.
struct Run<'a, B: StepBackend> {
    cx: Cx<'a, B>,
    g: &'a RematGraph,
    alloc: Allocator,
    v: Values<B::T>,
    /// Storage → the forward tensors held in it.
    in_storage: Vec<Vec<TensorId>>,
    /// Constants put before the first instruction ([`Run::preload`]).
    preloaded: Vec<bool>,
    /// Fake quantization ([`crate::train::FakeQuant`]): each node's pattern and role.
    /// Its qparam nodes run no kernel (their values are folded; a double scale or an
    /// 8-bit zero point has no tensor here), and its forward and backward are the
    /// fused float kernels of `ops::quantize`, on the host.
    fq: HashMap<NodeIndex, (usize, FakeQuantRole)>,
    /// Fused patterns (but fake quantization): each node's pattern.
    pattern_of: HashMap<NodeIndex, usize>,
    /// Each pattern's extras as its fused kernel makes them, written by its last
    /// node: SDPA's logsumexp (computed from the scores when the pattern's Softmax
    /// runs), GroupNorm's mean and rstd (from its InstanceNormalization). Kept on
    /// the host until that node puts them, when the schedule allocates them.
    pattern_extras: Vec<Option<Vec<Tensor>>>,
    /// Each pattern's recomputed inner values while its backward steps run...
    recomputed: Vec<Option<Recomputed<B::T>>>,
    /// ...and how many of them are left.
    bw_left: Vec<usize>,
    /// The optimizer state's storage (none for SGD).
    state_st: Option<StorageId>,
    /// The first graph output.
    out0: TensorId,
    executions: Vec<usize>,
    live_after: Vec<u64>,
    loss: f64,
    step_seconds: Vec<f64>,
    recompute_seconds: f64,
    t_start: std::time::Instant,
}

impl<'a, B: StepBackend> Run<'a, B> {
    /// A run of `step` with no value yet and nothing allocated.
    fn new(b: &'a B, model: &'a Model, step: &'a TrainingStep, opts: &'a StepOptions) -> Self {
        let (s, gr) = (&step.schedule, &model.graph);
        let n_t = gr.tensors.len();
        let mut in_storage: Vec<Vec<TensorId>> = vec![Vec::new(); s.storages.len()];
        for (t, &st) in s.tensor_storage.iter().enumerate() {
            if st != usize::MAX {
                in_storage[st].push(t);
            }
        }
        let step_of: HashMap<NodeIndex, usize> = s
            .steps
            .iter()
            .enumerate()
            .filter(|(_, st)| st.kind == StepKind::Forward)
            .filter_map(|(i, st)| st.node.map(|n| (n, i)))
            .collect();
        let pattern_of: HashMap<NodeIndex, usize> = s
            .fused
            .iter()
            .enumerate()
            .filter(|(_, p)| p.fake_quant.is_none())
            .flat_map(|(k, p)| p.nodes.iter().map(move |&n| (n, k)))
            .collect();
        let mut bw_left = vec![0usize; s.fused.len()];
        for st in &s.steps {
            if let Some(&k) = st.node.and_then(|n| pattern_of.get(&n)) {
                if st.kind == StepKind::Backward {
                    bw_left[k] += 1;
                }
            }
        }
        Run {
            cx: Cx {
                b,
                model,
                inf: &step.inferred,
                s,
                opts,
                step_of,
            },
            g: &step.graph,
            alloc: Allocator::new(s.storages.iter().map(|st| st.bytes).collect()),
            v: Values::new(n_t, s.storages.len()),
            in_storage,
            preloaded: vec![false; n_t],
            fq: fake_quant_roles(&s.fused),
            pattern_of,
            pattern_extras: (0..s.fused.len()).map(|_| None).collect(),
            recomputed: (0..s.fused.len()).map(|_| None).collect(),
            bw_left,
            state_st: s
                .storages
                .iter()
                .position(|st| st.kind == StorageKind::OptimizerState),
            out0: gr.outputs[0],
            executions: vec![0usize; s.steps.len()],
            live_after: Vec::new(),
            loss: 0.0,
            step_seconds: vec![0.0; s.steps.len()],
            recompute_seconds: 0.0,
            t_start: std::time::Instant::now(),
        }
    }

    /// Puts what lives from the start, every fixed storage allocated: the
    /// parameters and the batch in their storage's type (pure bf16: bf16), the
    /// optimizer state, resident gradients and, on a backend that counts its own
    /// memory, the constants nodes compute. The clock starts after.
    fn setup(&mut self, params: &[Option<Tensor>], inputs: &[Tensor]) -> Result<()> {
        let (b, s) = (self.cx.b, self.cx.s);
        for (t, p) in params.iter().enumerate().take(self.v.params.len()) {
            if let Some(v) = p {
                self.v.params[t] = Some(b.put(stored(s, t, v.clone())?)?);
            }
        }
        for (v, val) in self.g.values.iter().enumerate() {
            if val.fixed {
                self.alloc.alloc(v)?;
            }
        }
        self.optimizer_state()?;
        self.resident_grads()?;
        self.put_inputs(inputs)?;
        if b.live_bytes().is_some() {
            self.preload()?;
        }
        self.t_start = std::time::Instant::now();
        Ok(())
    }

    /// The optimizer: the schedule's must be the options' and one the executor
    /// runs; its state starts at zero.
    fn optimizer_state(&mut self) -> Result<()> {
        let (s, opts) = (self.cx.s, self.cx.opts);
        let opt_step = s
            .steps
            .iter()
            .find(|st| st.kind == StepKind::Optimizer)
            .ok_or_else(|| Error::Graph("the schedule has no optimizer step".into()))?;
        if !opts.optimizer.executable() {
            return Err(Error::Graph(format!(
                "memplan predicts the {} optimizer's memory but runs only sgd, momentum, adam and adamw",
                opts.optimizer
            )));
        }
        if opt_step.op != opts.optimizer.to_string() {
            return Err(Error::Graph(format!(
                "the schedule's optimizer is {}, the options say {}",
                opt_step.op, opts.optimizer
            )));
        }
        let n_params: usize = s
            .with_grad
            .iter()
            .map(|&t| self.cx.inf.facts[t].numel() as usize)
            .sum();
        if let Some(st) = self.state_st {
            let n = opts.optimizer.states() as usize * n_params;
            let dt = s.storages[st].dtype;
            let z = Tensor::from_f32(dt, vec![n], vec![0.0; n])?;
            if dt.bytes_for(n as u64) != Some(s.storages[st].bytes) {
                return Err(Error::Graph(format!(
                    "the optimizer state is {} bytes for {n} {dt} elements",
                    s.storages[st].bytes
                )));
            }
            self.v.sval[st] = Some(self.cx.b.put(z)?);
        }
        Ok(())
    }

    /// Resident gradients: each parameter's `.grad` zeroed before the step (a fixed
    /// storage, counted from the start); its first gradient is written into it.
    fn resident_grads(&mut self) -> Result<()> {
        for (v, st) in self.cx.s.storages.iter().enumerate() {
            if st.kind == StorageKind::ParamGrad && st.persistent {
                let n: usize = st.shape.iter().product();
                if st.dtype.bytes_for(n as u64) != Some(st.bytes) {
                    return Err(Error::Graph(format!(
                        "the resident gradient '{}' is {} bytes for {n} {} elements",
                        st.name, st.bytes, st.dtype
                    )));
                }
                let z = Tensor::from_f32(st.dtype, st.shape.clone(), vec![0.0; n])?;
                self.v.sval[v] = Some(self.cx.b.put(z)?);
            }
        }
        Ok(())
    }

    /// The batch, one tensor per graph input, of the inferred types and shapes.
    fn put_inputs(&mut self, inputs: &[Tensor]) -> Result<()> {
        let gr = &self.cx.model.graph;
        for (&t, x) in gr.inputs.iter().zip(inputs) {
            let f = &self.cx.inf.facts[t];
            if x.dtype() != f.dtype || x.shape != f.shape {
                return Err(Error::Binding(format!(
                    "input '{}' is {} {:?}, expected {} {:?}",
                    gr.tensor(t).name,
                    x.dtype(),
                    x.shape,
                    f.dtype,
                    f.shape
                )));
            }
            self.v.fwd[t] = Some(self.cx.b.put(stored(self.cx.s, t, x.clone())?)?);
        }
        Ok(())
    }

    /// A backend that counts its own memory holds every fixed storage from the
    /// start, as the schedule does: a constant a node computes (folded by
    /// inference) is put now, and that node's step keeps it. A fake
    /// quantization's qparam values are not.
    fn preload(&mut self) -> Result<()> {
        let (b, s, inf, g) = (self.cx.b, self.cx.s, self.cx.inf, self.g);
        let gr = &self.cx.model.graph;
        let mut fq_param = vec![false; gr.tensors.len()];
        for (&n, &(_, role)) in &self.fq {
            if role == FakeQuantRole::QParam {
                for &t in gr.node(n).outputs.iter().flatten() {
                    fq_param[t] = true;
                }
            }
        }
        for (v, val) in g.values.iter().enumerate() {
            let ts = &self.in_storage[v];
            if !val.fixed || self.v.sval[v].is_some() || ts.iter().any(|&t| self.v.of(t).is_some())
            {
                continue;
            }
            // The storage's source tensor (not a view of another one in it).
            let source = ts.iter().copied().find(|&t| {
                gr.tensor(t).producer.is_none_or(|p| {
                    gr.node(p)
                        .inputs
                        .iter()
                        .flatten()
                        .all(|&i| s.tensor_storage[i] != v)
                })
            });
            let Some(t) = source else { continue };
            if fq_param[t] {
                continue;
            }
            let Some(folded) = folded_value(inf, t)? else {
                continue;
            };
            let folded = stored(s, t, folded)?;
            if folded.dtype().bytes_for(folded.numel() as u64) != Some(s.storages[v].bytes) {
                continue;
            }
            self.v.fwd[t] = Some(b.put(folded)?);
            self.preloaded[t] = true;
        }
        Ok(())
    }

    /// Follows plan instruction `k`, then records the live bytes.
    fn instruction(&mut self, k: usize, op: &PlanOp) -> Result<()> {
        match *op {
            PlanOp::Load(_) => {
                return Err(Error::Graph(format!(
                    "plan step {k}: the plan offloads activations to host memory; the executor runs recomputation only (the PyTorch plan file applies offload)"
                )))
            }
            PlanOp::Free(v) => self.free(k, v)?,
            PlanOp::Compute(i) => self.compute(k, i)?,
        }
        let b = self.cx.b;
        self.live_after
            .push(b.live_bytes().unwrap_or(self.alloc.current));
        b.after_instruction()
    }

    /// Frees storage `v` (plan instruction `k`) and drops every value held in it.
    fn free(&mut self, k: usize, v: StorageId) -> Result<()> {
        if v >= self.cx.s.storages.len() {
            return Err(Error::Graph(format!("plan step {k}: no storage {v}")));
        }
        if self.g.values[v].fixed {
            return Err(Error::Graph(format!(
                "plan step {k}: '{}' is fixed",
                self.g.values[v].name
            )));
        }
        self.alloc.free(v);
        self.v.sval[v] = None;
        for &t in &self.in_storage[v] {
            self.v.fwd[t] = None;
        }
        for t in 0..self.v.gstore.len() {
            if self.v.gstore[t] == Some(v) {
                self.v.gstore[t] = None;
                self.v.gval[t] = None;
            }
        }
        Ok(())
    }

    /// Runs step `i` (plan instruction `k`): every storage it reads must be live;
    /// those it writes that are not are allocated; then its kind's work, timed.
    /// Every failure names the step.
    fn compute(&mut self, k: usize, i: usize) -> Result<()> {
        let t0 = std::time::Instant::now();
        let s = self.cx.s;
        let step = s
            .steps
            .get(i)
            .ok_or_else(|| Error::Graph(format!("plan step {k}: no step {i}")))?;
        let err = |e: Error| Error::step(&step.name, e);
        for &r in step.reads.iter().chain(&step.updates) {
            if !step.writes.contains(&r) && !self.alloc.is_live(r) {
                return Err(err(format!(
                    "reads '{}', which is not live",
                    s.storages[r].name
                )
                .into()));
            }
        }
        for &w in &step.writes {
            if !self.alloc.is_live(w) {
                self.alloc.alloc(w).map_err(&err)?;
            }
        }
        self.executions[i] += 1;
        match step.kind {
            StepKind::Forward if step.node.is_some_and(|n| self.fq.contains_key(&n)) => {
                self.fake_quant(i, step)
            }
            StepKind::Forward => self.forward(step),
            StepKind::Loss => self.loss(step),
            StepKind::Backward if step.node.is_none() => self.loss_backward(step),
            StepKind::Backward => self.backward(i, step),
            StepKind::Optimizer => self.optimizer(step),
        }
        .map_err(&err)?;
        if matches!(step.kind, StepKind::Backward) && self.cx.b.live_bytes().is_some() {
            self.grad_scratch(step).map_err(&err)?;
        }
        let dt = t0.elapsed().as_secs_f64();
        if self.executions[i] == 1 {
            self.step_seconds[i] = dt;
        } else {
            self.recompute_seconds += dt;
        }
        Ok(())
    }

    /// Forward step `i` of a fake quantization's node ([`fake_quant_forward`]).
    fn fake_quant(&mut self, i: usize, step: &crate::train::Step) -> Result<()> {
        let (k, role) = self.fq[&step.node.expect("a node")];
        let f = self.cx.s.fused[k]
            .fake_quant
            .as_ref()
            .ok_or("a fake quantization without its parts")?;
        fake_quant_forward(&self.cx, f, role, i, &self.alloc, &mut self.v)
    }

    /// A node's forward step: its inputs made available, the autocast copies it
    /// writes, then its kernel. A constant put before the first instruction runs
    /// none; a whole-tensor view (reshape-like, the identity) is its source under the
    /// inferred shape where the backend aliases.
    fn forward(&mut self, step: &crate::train::Step) -> Result<()> {
        let (b, s, model, inf) = (self.cx.b, self.cx.s, self.cx.model, self.cx.inf);
        let ix = step.node.expect("forward steps have a node");
        let node = model.graph.node(ix);
        let extras = extra_writes(s, step);
        for t in node.inputs.iter().flatten() {
            ensure_value(&self.cx, &self.alloc, &mut self.v, *t, 0)?;
        }
        self.autocast_copies(step, node)?;
        let ins = slot_values(s, step, node, &self.v)?;
        let pattern = self.pattern_of.get(&ix).copied();
        if let Some(k) = pattern {
            if s.fused[k].kind == FusedKind::Sdpa && node.op_type == "Softmax" {
                // From the scores as the Softmax reads them (an autocast f32 copy
                // under AMP).
                let x = ins[0].ok_or("the scores have no value")?;
                self.pattern_extras[k] = Some(vec![b.logsumexp_last(x)?]);
            }
        }
        let stats_here = pattern.is_some_and(|k| {
            s.fused[k].kind == FusedKind::GroupNorm && node.op_type == "InstanceNormalization"
        });
        let alias = if b.aliases_views() && extras.is_empty() && pattern.is_none() {
            whole_view(model, inf, s, node)?
        } else {
            None
        };
        let all_preloaded = node.outputs.iter().flatten().all(|&t| self.preloaded[t])
            && node.outputs.iter().flatten().next().is_some()
            && extras.is_empty();
        if all_preloaded {
            // A constant put before the first instruction.
            return Ok(());
        }
        if let Some(o) = alias {
            let src = ins[0].ok_or("no input 0")?;
            let v = b.reshaped(src, inf.facts[o].shape.clone())?;
            self.v.fwd[o] = Some(v);
            return Ok(());
        }
        let want_extras = (!extras.is_empty() && pattern.is_none()) || stats_here;
        let outs = b.forward(model, inf, node, ins, self.cx.opts, want_extras)?;
        self.forward_outputs(step, &extras, pattern, stats_here, outs)
    }

    /// The autocast and contiguous copies `step` makes of its node's inputs (a
    /// cached weight copy made earlier is read as it is).
    fn autocast_copies(&mut self, step: &crate::train::Step, node: &crate::ir::Node) -> Result<()> {
        let (b, s) = (self.cx.b, self.cx.s);
        for (slot, t) in node.inputs.iter().enumerate() {
            let (Some(t), Some(&Some(c))) = (*t, step.slots.get(slot)) else {
                continue;
            };
            let kind = s.storages[c].kind;
            if !matches!(kind, StorageKind::Cast | StorageKind::Copy) {
                continue;
            }
            if step.writes.contains(&c) {
                let v = self
                    .v
                    .of(t)
                    .ok_or_else(|| format!("input {slot} has no value"))?;
                if kind == StorageKind::Copy {
                    // Held as its source; an expanded copy is accounted at its
                    // expanded size by the schedule.
                    let v = b.copy(v, &s.storages[c].shape)?;
                    // Of an autocast copy: in its type.
                    let v = cast_to(b, v, s.storages[c].dtype)?;
                    if s.storages[c].shape.as_slice() == B::shape(&v) {
                        check_bytes::<B>(s, c, &v)?;
                    }
                    self.v.sval[c] = Some(b.hold(v));
                    continue;
                }
                let v = b.cast(v, s.storages[c].dtype)?;
                check_bytes::<B>(s, c, &v)?;
                self.v.sval[c] = Some(b.hold(v));
            } else if self.v.sval[c].is_none() {
                return Err(format!("the cast '{}' has no value", s.storages[c].name).into());
            }
        }
        Ok(())
    }

    /// Stores what a forward kernel gave: each output (in its own storage, or a
    /// view of a live one) and the extras `step` writes; a fused pattern's extras,
    /// made by its kernel, are written by its last node.
    fn forward_outputs(
        &mut self,
        step: &crate::train::Step,
        extras: &[StorageId],
        pattern: Option<usize>,
        stats_here: bool,
        mut outs: Vec<B::T>,
    ) -> Result<()> {
        let (b, s, inf) = (self.cx.b, self.cx.s, self.cx.inf);
        let gr = &self.cx.model.graph;
        let ix = step.node.expect("forward steps have a node");
        let node = gr.node(ix);
        if let Some(k) = pattern {
            if stats_here {
                let stats = outs.split_off(node.outputs.len().min(outs.len()));
                let host: Result<Vec<Tensor>> = stats.iter().map(|v| b.get(v)).collect();
                self.pattern_extras[k] = Some(host?);
            }
            let p = &s.fused[k];
            if ix == p.last() && !extras.is_empty() {
                let made = self.pattern_extras[k].take().ok_or_else(|| {
                    format!("the fused {:?} kernel's extras were not computed", p.kind)
                })?;
                for t in made {
                    outs.push(b.put(t)?);
                }
            }
        }
        let n_out = node.outputs.len();
        if outs.len() != n_out + extras.len() {
            return Err(format!(
                "the kernel gave {} tensors for {} outputs and {} extras",
                outs.len(),
                n_out,
                extras.len()
            )
            .into());
        }
        let mut outs = outs.into_iter();
        for t in &node.outputs {
            let v = outs.next().expect("counted");
            let Some(t) = *t else { continue };
            let f = &inf.facts[t];
            if B::dtype(&v) != f.dtype || B::shape(&v) != f.shape.as_slice() {
                return Err(format!(
                    "output '{}' is {} {:?}, inference says {} {:?}",
                    gr.tensor(t).name,
                    B::dtype(&v),
                    B::shape(&v),
                    f.dtype,
                    f.shape
                )
                .into());
            }
            let mut v = store(b, s, t, v)?;
            let st = s.tensor_storage[t];
            if step.writes.contains(&st) {
                check_bytes::<B>(s, st, &v)?;
                v = b.hold(v);
            } else if !self.alloc.is_live(st) {
                return Err(
                    format!("view '{}' of a storage that is not live", gr.tensor(t).name).into(),
                );
            } else {
                v = b.set_apart(v);
            }
            self.v.fwd[t] = Some(v);
        }
        for (&st, v) in extras.iter().zip(outs) {
            check_bytes::<B>(s, st, &v)?;
            self.v.sval[st] = Some(b.hold(v));
        }
        Ok(())
    }

    /// The loss step: the model output's mean or sum, accumulated in f64.
    fn loss(&mut self, step: &crate::train::Step) -> Result<()> {
        let b = self.cx.b;
        let y = self.v.fwd[self.out0].as_ref().ok_or("no model output")?;
        let sum: f64 = b.sum_f64(y)?;
        self.loss = match self.cx.opts.loss {
            Loss::Mean => sum / B::numel(y).max(1) as f64,
            // The model's own loss is a scalar: its sum is itself.
            Loss::Sum | Loss::Graph => sum,
        };
        self.v.sval[step.writes[0]] = Some(b.put(Tensor::f32(vec![], vec![self.loss as f32]))?);
        Ok(())
    }

    /// The loss's backward: d loss / d output.
    fn loss_backward(&mut self, step: &crate::train::Step) -> Result<()> {
        let (b, s, loss) = (self.cx.b, self.cx.s, self.cx.opts.loss);
        let out0 = self.out0;
        let f = &self.cx.inf.facts[out0];
        let g0 = match loss {
            Loss::Mean => Tensor::f32(
                f.shape.clone(),
                vec![1.0 / f.numel().max(1) as f32; f.numel() as usize],
            ),
            Loss::Sum | Loss::Graph => Tensor::f32(vec![], vec![1.0]),
        };
        let st = step.writes[0];
        let dt = s.storages[st].dtype;
        let g0 = g0.cast(dt)?;
        if dt.bytes_for(g0.numel() as u64) != Some(s.storages[st].bytes) {
            return Err(format!(
                "writes {} bytes into '{}' of {}",
                dt.bytes_for(g0.numel() as u64).unwrap_or(u64::MAX),
                s.storages[st].name,
                s.storages[st].bytes
            )
            .into());
        }
        self.v.gval[out0] = Some(match loss {
            Loss::Mean => b.put(g0),
            // The scalar broadcast to the output's shape (an expand view: its
            // storage is the scalar's).
            Loss::Sum | Loss::Graph => b.put_broadcast(
                Tensor::from_f32(dt, f.shape.clone(), vec![1.0; f.numel() as usize])?,
                s.storages[st].bytes,
            ),
        }?);
        self.v.gstore[out0] = Some(st);
        Ok(())
    }

    /// A node's backward step `i`: a fused pattern's inner values recomputed at its
    /// first backward step (and dropped after its last), the values the step reads
    /// made available, then [`backward_step`]; a partial gradient lives in its
    /// storage until freed.
    fn backward(&mut self, i: usize, step: &crate::train::Step) -> Result<()> {
        let s = self.cx.s;
        let ix = step.node.expect("backward of a node");
        let node = self.cx.model.graph.node(ix);
        let pattern = self.pattern_of.get(&ix).copied();
        if let Some(k) = pattern.filter(|&k| self.recomputed[k].is_none()) {
            self.recompute(k, ix)?;
        }
        for t in node.inputs.iter().chain(&node.outputs).flatten() {
            let st = s.tensor_storage[*t];
            if st != usize::MAX && step.reads.contains(&st) {
                ensure_value(&self.cx, &self.alloc, &mut self.v, *t, 0)?;
            }
        }
        let rec = pattern.and_then(|k| self.recomputed[k].as_ref());
        let partials = backward_step(&self.cx, i, &mut self.v, rec)?;
        for (w, d) in partials {
            self.v.sval[w] = Some(d);
        }
        if let Some(k) = pattern {
            self.bw_left[k] -= 1;
            if self.bw_left[k] == 0 {
                self.recomputed[k] = None;
            }
        }
        Ok(())
    }

    /// Recomputes fused pattern `k`'s inner values at its first backward step,
    /// which must be its last node's (`ix`), from what that step reads.
    fn recompute(&mut self, k: usize, ix: NodeIndex) -> Result<()> {
        let s = self.cx.s;
        let p = &s.fused[k];
        if ix != p.last() {
            return Err(format!(
                "the first backward step of a fused {:?} pattern is not its last node's",
                p.kind
            )
            .into());
        }
        let copied = |t: TensorId| s.fused_copy(p.last(), t).is_some();
        for &t in p.reads.iter().filter(|&&t| !copied(t)) {
            ensure_value(&self.cx, &self.alloc, &mut self.v, t, 0)?;
        }
        self.recomputed[k] = Some(recompute_pattern(&self.cx, p, &self.v)?);
        Ok(())
    }

    /// The optimizer step: every parameter updated in place, and the update's
    /// temporary (foreach Adam's) where the schedule writes one.
    fn optimizer(&mut self, step: &crate::train::Step) -> Result<()> {
        let (b, s, state_st) = (self.cx.b, self.cx.s, self.state_st);
        let temp = b.optimizer(
            s,
            &self.v.gval,
            &mut self.v.params,
            state_st.and_then(|st| self.v.sval[st].as_mut()),
            self.cx.opts,
        )?;
        let temps: Vec<StorageId> = step
            .writes
            .iter()
            .copied()
            .filter(|&w| s.storages[w].kind == StorageKind::OptimizerTemp)
            .collect();
        match (temps.as_slice(), temp) {
            ([], None) => {}
            ([w], Some(t)) => {
                check_bytes::<B>(s, *w, &t)?;
                self.v.sval[*w] = Some(t);
            }
            _ => return Err("the update's temporaries are not the schedule's".into()),
        }
        Ok(())
    }

    /// What a backward step's derivative formulas hold beyond its gradients
    /// (`Op::backward_scratch`, autodiff's "<node>/grad scratch"): the CPU's kernels
    /// make it inside, the schedule counts it until its free; a backend that counts
    /// its own tensors holds zeros of its size.
    fn grad_scratch(&mut self, step: &crate::train::Step) -> Result<()> {
        let (b, s) = (self.cx.b, self.cx.s);
        for &w in &step.writes {
            let st = &s.storages[w];
            if self.v.sval[w].is_none() && st.name.ends_with("/grad scratch") {
                let n = st.bytes / st.dtype.bytes_for(1).unwrap_or(1).max(1);
                let z = Tensor::zeros(st.dtype, vec![n as usize])?;
                self.v.sval[w] = Some(b.hold(b.put(z)?));
            }
        }
        Ok(())
    }

    /// What the run produced and measured, read back from the backend; every step
    /// must have run.
    fn result(self) -> Result<StepResult> {
        let (b, s) = (self.cx.b, self.cx.s);
        let gr = &self.cx.model.graph;
        if let Some(i) = self.executions.iter().position(|&e| e == 0) {
            return Err(Error::Graph(format!(
                "step '{}' never runs",
                s.steps[i].name
            )));
        }
        let grads = s
            .with_grad
            .iter()
            .map(|&t| {
                let v = self.v.gval[t].as_ref().ok_or_else(|| {
                    Error::Graph(format!("no gradient for '{}'", gr.tensor(t).name))
                })?;
                b.get(v)
            })
            .collect::<Result<Vec<_>>>()?;
        let output = self.v.fwd[self.out0]
            .as_ref()
            .or(self.v.params[self.out0].as_ref())
            .ok_or_else(|| Error::Graph("the model output was freed".into()))?;
        let output = b.get(output)?;
        let seconds = self.t_start.elapsed().as_secs_f64();
        let params = self
            .v
            .params
            .iter()
            .map(|p| p.as_ref().map(|p| b.get(p)).transpose())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let state = self
            .state_st
            .and_then(|st| self.v.sval[st].as_ref())
            .map(|v| b.get(v))
            .transpose()?;
        Ok(StepResult {
            loss: self.loss,
            output,
            grads,
            params,
            peak_bytes: b.peak_bytes().unwrap_or(self.alloc.peak),
            live_after: self.live_after,
            executions: self.executions,
            step_seconds: self.step_seconds,
            recompute_seconds: self.recompute_seconds,
            seconds,
            state,
        })
    }
}

/// The values `step` passes its node's kernel, one per input slot: the autocast or
/// contiguous copy the slot is read through, else the tensor's value; every input
/// must have one.
fn slot_values<'v, T>(
    s: &Schedule,
    step: &crate::train::Step,
    node: &crate::ir::Node,
    v: &'v Values<T>,
) -> Result<Vec<Option<&'v T>>> {
    let ins: Vec<Option<&T>> = node
        .inputs
        .iter()
        .enumerate()
        .map(|(slot, t)| {
            let t = (*t)?;
            match step.slots.get(slot) {
                Some(&Some(c)) if is_copy(s.storages[c].kind) => v.sval[c].as_ref(),
                _ => v.of(t),
            }
        })
        .collect();
    if let Some(slot) = node
        .inputs
        .iter()
        .zip(&ins)
        .position(|(t, v)| t.is_some() && v.is_none())
    {
        return Err(format!("input {slot} has no value").into());
    }
    Ok(ins)
}
