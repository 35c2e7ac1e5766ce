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
//! Fused patterns ([`crate::train::FusedPattern`]: exact GELU, SiLU, SDPA) run op by op
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
//! Optimizers (PyTorch's formulas, one step from zero state): SGD, momentum, Adam,
//! AdamW with [`StepOptions`]' hyperparameters. The state storage (persistent) holds
//! one f32 vector per state over all parameters; foreach Adam's temporary (the
//! denominators of every parameter at once) is the optimizer step's OptimizerTemp
//! write. Resident gradients (`grads_resident`: persistent `.grad`, zero before the
//! step) receive each parameter's first gradient.
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
//! Supported: fp32, amp-fp16, amp-bf16, bf16; `Loss::Mean` or `Loss::Sum`; SGD,
//! momentum, Adam, AdamW; gradients resident or not; the fused exact GELU, SiLU and SDPA
//! (under every policy). Not run: a fused pattern whose input is an activation the
//! fused kernel does not save and that has no folded value (refused, named).

use std::collections::{HashMap, HashSet};

use petgraph::stable_graph::NodeIndex;

use crate::error::{Error, Result};
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::numeric::{rng, Tensor};
use crate::ops::{registry, BackwardCx, KernelCx, Saved};
use crate::remat::graph::{Op as PlanOp, RematGraph};
use crate::train::{
    FusedKind, FusedPattern, Loss, Optimizer, Schedule, StepKind, StorageId, StorageKind,
};

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
    pub fn alloc(&mut self, s: StorageId) -> std::result::Result<(), String> {
        if self.live[s] {
            return Err(format!("storage {s} allocated twice"));
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

/// What the training step needs of the machine it runs on: values of type `T`,
/// the kernels, and the few pieces of step glue (casts, gradient accumulation,
/// the optimizer). [`train_step_on`] follows the plan, the schedule's storages
/// and its checks once for every backend; [`Cpu`] is the CPU executor, and
/// `exec::cuda::step::DeviceStep` (feature `cuda`) a CUDA device.
pub trait StepBackend {
    /// A value (tensor) held by the step.
    type T;
    /// Element type of `t`.
    fn dtype(t: &Self::T) -> DType;
    /// Shape of `t`.
    fn shape(t: &Self::T) -> &[usize];
    /// Element count of `t`.
    fn numel(t: &Self::T) -> usize {
        Self::shape(t).iter().product()
    }
    /// Refuses, in one line naming it, what this backend cannot run of the step
    /// (checked before anything runs).
    fn check(&self, _s: &Schedule, _opts: &StepOptions) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Called once before the step's first allocation.
    fn begin(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Called after every plan instruction.
    fn after_instruction(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// A host value held by the step (counted where the backend counts).
    fn put(&self, t: Tensor) -> std::result::Result<Self::T, String>;
    /// A host value the step uses transiently, in no schedule storage (a folded
    /// shape argument): not counted as a tensor of the step.
    fn put_apart(&self, t: Tensor) -> std::result::Result<Self::T, String> {
        self.put(t)
    }
    /// The host copy of `t`.
    fn get(&self, t: &Self::T) -> std::result::Result<Tensor, String>;
    /// `t` converted to `dt`.
    fn cast(&self, t: &Self::T, dt: DType) -> std::result::Result<Self::T, String>;
    /// A copy of `t` in memory of its own, allocated for `alloc` elements' shape
    /// (a [`StorageKind::Copy`] storage: larger than `t` where PyTorch copies an
    /// expanded operand), holding `t`'s values under `t`'s shape.
    fn copy(&self, t: &Self::T, alloc: &[usize]) -> std::result::Result<Self::T, String>;
    /// `t`'s elements under `shape` (a view: no allocation where the backend
    /// can alias).
    fn reshaped(&self, t: &Self::T, shape: Vec<usize>) -> std::result::Result<Self::T, String>;
    /// Another handle on `t` (same shape).
    fn dup(&self, t: &Self::T) -> std::result::Result<Self::T, String> {
        self.reshaped(t, Self::shape(t).to_vec())
    }
    /// Whether whole-tensor views (reshape-like ops, the identity) are made by
    /// aliasing their source instead of running their kernel.
    fn aliases_views(&self) -> bool {
        false
    }
    /// A kernel's output held in no storage of its own (a view the kernel
    /// copied): the backend stops counting it as a tensor of the step.
    fn set_apart(&self, t: Self::T) -> Self::T {
        t
    }
    /// A kernel's output the step stores in its own schedule storage (written
    /// by the step): counted from now on. A backend may count what its kernels
    /// allocate apart until then (their temporaries, outputs in flight).
    fn hold(&self, t: Self::T) -> Self::T {
        t
    }
    /// The f64 sum of `t`'s elements.
    fn sum_f64(&self, t: &Self::T) -> std::result::Result<f64, String>;
    /// Runs the forward kernel of `node` on `ins`.
    fn forward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        ins: Vec<Option<&Self::T>>,
        opts: &StepOptions,
        extras: bool,
    ) -> std::result::Result<Vec<Self::T>, String>;
    /// Runs the backward kernel of `node`: one gradient per input slot (`None`
    /// where not wanted).
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        saved: Vec<(Saved, &Self::T)>,
        grads: Vec<Option<&Self::T>>,
        wanted: Vec<usize>,
        opts: &StepOptions,
    ) -> std::result::Result<Vec<Option<Self::T>>, String>;
    /// `acc += d` (f32 addition, rounded to `acc`'s type).
    fn accumulate(&self, acc: &mut Self::T, d: &Self::T) -> std::result::Result<(), String>;
    /// The optimizer update in place (see [`StepOptions`]); the foreach Adam
    /// temporary, `None` for the others.
    fn optimizer(
        &self,
        s: &Schedule,
        gval: &[Option<Self::T>],
        params: &mut [Option<Self::T>],
        state: Option<&mut Self::T>,
        opts: &StepOptions,
    ) -> std::result::Result<Option<Self::T>, String>;
    /// `log Σ exp` along the last axis (f32, accumulated in f64), as a host value:
    /// the step keeps it on the host (transient, not a tensor of the step) until the
    /// SDPA's last forward step puts it into its Extra storage.
    fn logsumexp_last(&self, x: &Self::T) -> std::result::Result<Tensor, String>;
    /// Live bytes of the step's tensors as the backend counts them (`None`:
    /// the schedule's [`Allocator`] is the count).
    fn live_bytes(&self) -> Option<u64> {
        None
    }
    /// Peak of [`StepBackend::live_bytes`] since [`StepBackend::begin`].
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
}

/// The CPU executor: host [`Tensor`]s, the CPU kernels of src/ops; half-precision
/// values computed in f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl StepBackend for Cpu {
    type T = Tensor;
    fn dtype(t: &Tensor) -> DType {
        t.dtype()
    }
    fn shape(t: &Tensor) -> &[usize] {
        &t.shape
    }
    fn put(&self, t: Tensor) -> std::result::Result<Tensor, String> {
        Ok(t)
    }
    fn get(&self, t: &Tensor) -> std::result::Result<Tensor, String> {
        Ok(t.clone())
    }
    fn cast(&self, t: &Tensor, dt: DType) -> std::result::Result<Tensor, String> {
        t.cast(dt)
    }
    /// Memory is the schedule's here: the value alone.
    fn copy(&self, t: &Tensor, _alloc: &[usize]) -> std::result::Result<Tensor, String> {
        Ok(t.clone())
    }
    fn reshaped(&self, t: &Tensor, shape: Vec<usize>) -> std::result::Result<Tensor, String> {
        t.reshaped(shape)
    }
    fn sum_f64(&self, t: &Tensor) -> std::result::Result<f64, String> {
        Ok(t.to_f64s().iter().sum())
    }
    fn forward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        ins: Vec<Option<&Tensor>>,
        opts: &StepOptions,
        extras: bool,
    ) -> std::result::Result<Vec<Tensor>, String> {
        run_kernel(model, inf, node, ins, opts, extras)
    }
    fn backward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        saved: Vec<(Saved, &Tensor)>,
        grads: Vec<Option<&Tensor>>,
        wanted: Vec<usize>,
        opts: &StepOptions,
    ) -> std::result::Result<Vec<Option<Tensor>>, String> {
        let (op, cx) = rule_cx(model, inf, node)?;
        // Half-precision values are computed in f32.
        let widen = |v: &Tensor| -> std::result::Result<Option<Tensor>, String> {
            if v.dtype().is_float() && v.dtype() != DType::F32 {
                v.cast(DType::F32).map(Some)
            } else {
                Ok(None)
            }
        };
        let wide_saved: Vec<Option<Tensor>> = saved
            .iter()
            .map(|(_, v)| widen(v))
            .collect::<std::result::Result<_, _>>()?;
        let saved: Vec<(Saved, &Tensor)> = saved
            .iter()
            .zip(&wide_saved)
            .map(|(&(sv, v), w)| (sv, w.as_ref().unwrap_or(v)))
            .collect();
        let wide_grads: Vec<Option<Tensor>> = grads
            .iter()
            .map(|g| match g {
                Some(g) => widen(g),
                None => Ok(None),
            })
            .collect::<std::result::Result<_, _>>()?;
        let grads: Vec<Option<&Tensor>> = grads
            .iter()
            .zip(&wide_grads)
            .map(|(g, w)| w.as_ref().or(*g))
            .collect();
        let bcx = BackwardCx {
            node,
            inputs: cx.inputs.clone(),
            outputs: node
                .outputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            opset: model.opset(),
            saved,
            grads,
            wanted,
            dropout: opts.dropout,
        };
        op.backward_cpu(&bcx)
    }
    fn accumulate(&self, acc: &mut Tensor, d: &Tensor) -> std::result::Result<(), String> {
        let dt = acc.dtype();
        if let crate::numeric::Elems::F32(a) = &mut acc.elems {
            for (a, b) in a.iter_mut().zip(d.as_f32()?) {
                *a += b;
            }
        } else {
            let sum: Vec<f32> = acc
                .to_f32()?
                .iter()
                .zip(d.to_f32()?.iter())
                .map(|(a, b)| a + b)
                .collect();
            *acc = Tensor::from_f32(dt, acc.shape.clone(), sum)?;
        }
        Ok(())
    }
    fn optimizer(
        &self,
        s: &Schedule,
        gval: &[Option<Tensor>],
        params: &mut [Option<Tensor>],
        state: Option<&mut Tensor>,
        opts: &StepOptions,
    ) -> std::result::Result<Option<Tensor>, String> {
        optimizer_step(s, gval, params, state, opts)
    }
    fn logsumexp_last(&self, x: &Tensor) -> std::result::Result<Tensor, String> {
        logsumexp_last(x)
    }
}

/// Runs one training step of `model` on the CPU following `plan` over `g` (made
/// from `s` by [`crate::remat::from_schedule::from_schedule`]), from parameters
/// `params` (as [`crate::exec::Executor::params`]) on `inputs` (one per graph input).
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    g: &RematGraph,
    plan: &[PlanOp],
    params: &[Option<Tensor>],
    inputs: &[Tensor],
    opts: &StepOptions,
) -> Result<StepResult> {
    train_step_on(&Cpu, model, inf, s, g, plan, params, inputs, opts)
}

/// [`train_step`] on backend `b`: the same plan, storages and checks; the
/// measured peak is the backend's count where it has one
/// ([`StepBackend::peak_bytes`]), else the schedule [`Allocator`]'s.
#[allow(clippy::too_many_arguments)]
pub fn train_step_on<B: StepBackend>(
    b: &B,
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    g: &RematGraph,
    plan: &[PlanOp],
    params_in: &[Option<Tensor>],
    inputs: &[Tensor],
    opts: &StepOptions,
) -> Result<StepResult> {
    let gr = &model.graph;
    let n_t = gr.tensors.len();
    if g.nodes.len() != s.steps.len() || g.values.len() != s.storages.len() {
        return Err(Error::Graph(
            "the plan's graph is not this schedule's".into(),
        ));
    }
    // The whole plan is checked before anything runs (every read live, every step
    // computed, only forward steps recomputed).
    crate::remat::graph::replay(g, plan)
        .map_err(|e| Error::Graph(format!("the plan is invalid: {e}")))?;
    if inputs.len() != gr.inputs.len() {
        return Err(Error::Binding(format!(
            "the model has {} inputs, {} were given",
            gr.inputs.len(),
            inputs.len()
        )));
    }
    b.check(s, opts).map_err(Error::Plan)?;
    b.begin().map_err(Error::Graph)?;
    let mut alloc = Allocator::new(s.storages.iter().map(|st| st.bytes).collect());
    // Values: forward tensors by tensor id; gradients by tensor id; extras and the
    // loss by storage id. Each lives in one storage.
    let none = |n: usize| -> Vec<Option<B::T>> { (0..n).map(|_| None).collect() };
    let mut fwd: Vec<Option<B::T>> = none(n_t);
    let mut gval: Vec<Option<B::T>> = none(n_t);
    let mut gstore: Vec<Option<StorageId>> = vec![None; n_t];
    let mut sval: Vec<Option<B::T>> = none(s.storages.len());
    // Parameters and the batch in their storage's type (pure bf16: bf16).
    let mut params: Vec<Option<B::T>> = none(n_t);
    for (t, p) in params_in.iter().enumerate().take(n_t) {
        if let Some(v) = p {
            params[t] = Some(
                b.put(stored(s, t, v.clone()).map_err(Error::Graph)?)
                    .map_err(Error::Graph)?,
            );
        }
    }
    for (v, val) in g.values.iter().enumerate() {
        if val.fixed {
            alloc.alloc(v).map_err(Error::Graph)?;
        }
    }
    // The optimizer: the schedule's must be the options'; its state starts at zero.
    let opt_step = s
        .steps
        .iter()
        .find(|st| st.kind == StepKind::Optimizer)
        .ok_or_else(|| Error::Graph("the schedule has no optimizer step".into()))?;
    if opt_step.op != opts.optimizer.to_string() {
        return Err(Error::Graph(format!(
            "the schedule's optimizer is {}, the options say {}",
            opt_step.op, opts.optimizer
        )));
    }
    let n_params: usize = s
        .with_grad
        .iter()
        .map(|&t| inf.facts[t].numel() as usize)
        .sum();
    let state_st = s
        .storages
        .iter()
        .position(|st| st.kind == StorageKind::OptimizerState);
    if let Some(st) = state_st {
        let n = opts.optimizer.states() as usize * n_params;
        let dt = s.storages[st].dtype;
        let z = Tensor::from_f32(dt, vec![n], vec![0.0; n]).map_err(Error::Graph)?;
        if dt.bytes_for(n as u64) != Some(s.storages[st].bytes) {
            return Err(Error::Graph(format!(
                "the optimizer state is {} bytes for {n} {dt} elements",
                s.storages[st].bytes
            )));
        }
        sval[st] = Some(b.put(z).map_err(Error::Graph)?);
    }
    for (&t, x) in gr.inputs.iter().zip(inputs) {
        let f = &inf.facts[t];
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
        fwd[t] = Some(
            b.put(stored(s, t, x.clone()).map_err(Error::Graph)?)
                .map_err(Error::Graph)?,
        );
    }
    // Storage -> forward tensors held in it.
    let mut in_storage: Vec<Vec<TensorId>> = vec![Vec::new(); s.storages.len()];
    for (t, &st) in s.tensor_storage.iter().enumerate() {
        if st != usize::MAX {
            in_storage[st].push(t);
        }
    }
    let out0 = gr.outputs[0];
    let step_of: std::collections::HashMap<_, usize> = s
        .steps
        .iter()
        .enumerate()
        .filter(|(_, st)| st.kind == StepKind::Forward)
        .filter_map(|(i, st)| st.node.map(|n| (n, i)))
        .collect();
    // A backend that counts its own memory holds every fixed storage from the
    // start, as the schedule does: a constant a node computes (folded by
    // inference) is put now, and that node's step keeps it.
    let mut preloaded = vec![false; n_t];
    if b.live_bytes().is_some() {
        for (v, val) in g.values.iter().enumerate() {
            let ts = &in_storage[v];
            if !val.fixed
                || sval[v].is_some()
                || ts.iter().any(|&t| params[t].is_some() || fwd[t].is_some())
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
            let Some(folded) = folded_value(inf, t).map_err(Error::Graph)? else {
                continue;
            };
            let folded = stored(s, t, folded).map_err(Error::Graph)?;
            if folded.dtype().bytes_for(folded.numel() as u64) != Some(s.storages[v].bytes) {
                continue;
            }
            fwd[t] = Some(b.put(folded).map_err(Error::Graph)?);
            preloaded[t] = true;
        }
    }
    // Fused patterns: each node's pattern; the SDPA logsumexp, computed from the
    // scores when the pattern's Softmax runs and written as the Extra of its last
    // node's forward step (both one kernel on the GPU); the recomputed inner values
    // while the pattern's backward steps run, and how many of them are left.
    let pattern_of: HashMap<NodeIndex, usize> = s
        .fused
        .iter()
        .enumerate()
        .flat_map(|(k, p)| p.nodes.iter().map(move |&n| (n, k)))
        .collect();
    let mut lse: Vec<Option<Tensor>> = (0..s.fused.len()).map(|_| None).collect();
    let mut recomputed: Vec<Option<Recomputed<B::T>>> = (0..s.fused.len()).map(|_| None).collect();
    let mut bw_left = vec![0usize; s.fused.len()];
    for st in &s.steps {
        if let Some(&k) = st.node.and_then(|n| pattern_of.get(&n)) {
            if st.kind == StepKind::Backward {
                bw_left[k] += 1;
            }
        }
    }
    let mut executions = vec![0usize; s.steps.len()];
    let mut live_after = Vec::with_capacity(plan.len());
    let mut loss_f64 = 0.0;
    let mut step_seconds = vec![0.0; s.steps.len()];
    let mut recompute_seconds = 0.0;
    let t_start = std::time::Instant::now();

    for (k, op) in plan.iter().enumerate() {
        match *op {
            PlanOp::Free(v) => {
                if v >= s.storages.len() {
                    return Err(Error::Graph(format!("plan step {k}: no storage {v}")));
                }
                if g.values[v].fixed {
                    return Err(Error::Graph(format!(
                        "plan step {k}: '{}' is fixed",
                        g.values[v].name
                    )));
                }
                alloc.free(v);
                sval[v] = None;
                for &t in &in_storage[v] {
                    fwd[t] = None;
                }
                for t in 0..n_t {
                    if gstore[t] == Some(v) {
                        gstore[t] = None;
                        gval[t] = None;
                    }
                }
            }
            PlanOp::Compute(i) => {
                let t0 = std::time::Instant::now();
                let step = s
                    .steps
                    .get(i)
                    .ok_or_else(|| Error::Graph(format!("plan step {k}: no step {i}")))?;
                let err = |r: String| Error::Graph(format!("step '{}': {r}", step.name));
                for &r in step.reads.iter().chain(&step.updates) {
                    if !step.writes.contains(&r) && !alloc.is_live(r) {
                        return Err(err(format!(
                            "reads '{}', which is not live",
                            s.storages[r].name
                        )));
                    }
                }
                for &w in &step.writes {
                    if !alloc.is_live(w) {
                        alloc.alloc(w).map_err(&err)?;
                    }
                }
                executions[i] += 1;
                let check_bytes = |st: StorageId, t: &B::T| -> Result<()> {
                    let want = s.storages[st].bytes;
                    let have = B::dtype(t)
                        .bytes_for(B::numel(t) as u64)
                        .unwrap_or(u64::MAX);
                    if want != have {
                        return Err(err(format!(
                            "writes {have} bytes into '{}' of {want}",
                            s.storages[st].name
                        )));
                    }
                    Ok(())
                };
                match step.kind {
                    StepKind::Forward => {
                        let ix = step.node.expect("forward steps have a node");
                        let node = gr.node(ix);
                        let extras: Vec<StorageId> = step
                            .writes
                            .iter()
                            .copied()
                            .filter(|&w| s.storages[w].kind == StorageKind::Extra)
                            .collect();
                        for t in node.inputs.iter().flatten() {
                            ensure_value(
                                b, model, inf, s, &step_of, &alloc, &params, &mut fwd, opts, *t, 0,
                            )
                            .map_err(&err)?;
                        }
                        // Autocast copies this step makes (a cached weight copy made
                        // earlier is read as it is).
                        for (slot, t) in node.inputs.iter().enumerate() {
                            let (Some(t), Some(&Some(c))) = (*t, step.slots.get(slot)) else {
                                continue;
                            };
                            let kind = s.storages[c].kind;
                            if !matches!(kind, StorageKind::Cast | StorageKind::Copy) {
                                continue;
                            }
                            if step.writes.contains(&c) {
                                let v = params[t]
                                    .as_ref()
                                    .or(fwd[t].as_ref())
                                    .ok_or_else(|| err(format!("input {slot} has no value")))?;
                                if kind == StorageKind::Copy {
                                    // Held as its source; an expanded copy is accounted
                                    // at its expanded size by the schedule.
                                    let v = b.copy(v, &s.storages[c].shape).map_err(&err)?;
                                    if s.storages[c].shape.as_slice() == B::shape(&v) {
                                        check_bytes(c, &v)?;
                                    }
                                    sval[c] = Some(b.hold(v));
                                    continue;
                                }
                                let v = b.cast(v, s.storages[c].dtype).map_err(&err)?;
                                check_bytes(c, &v)?;
                                sval[c] = Some(v);
                            } else if sval[c].is_none() {
                                return Err(err(format!(
                                    "the cast '{}' has no value",
                                    s.storages[c].name
                                )));
                            }
                        }
                        let ins: Vec<Option<&B::T>> = node
                            .inputs
                            .iter()
                            .enumerate()
                            .map(|(slot, t)| {
                                let t = (*t)?;
                                match step.slots.get(slot) {
                                    Some(&Some(c)) if is_copy(s.storages[c].kind) => {
                                        sval[c].as_ref()
                                    }
                                    _ => params[t].as_ref().or(fwd[t].as_ref()),
                                }
                            })
                            .collect();
                        if let Some(slot) = node
                            .inputs
                            .iter()
                            .zip(&ins)
                            .position(|(t, v)| t.is_some() && v.is_none())
                        {
                            return Err(err(format!("input {slot} has no value")));
                        }
                        let pattern = pattern_of.get(&ix).copied();
                        if let Some(k) = pattern {
                            if s.fused[k].kind == FusedKind::Sdpa && node.op_type == "Softmax" {
                                // From the scores as the Softmax reads them (an autocast
                                // f32 copy under AMP).
                                let x =
                                    ins[0].ok_or_else(|| err("the scores have no value".into()))?;
                                lse[k] = Some(b.logsumexp_last(x).map_err(&err)?);
                            }
                        }
                        // A whole-tensor view (reshape-like, the identity) is its
                        // source under the inferred shape where the backend aliases.
                        let alias = if b.aliases_views() && extras.is_empty() && pattern.is_none() {
                            whole_view(model, inf, s, node).map_err(&err)?
                        } else {
                            None
                        };
                        let all_preloaded = node.outputs.iter().flatten().all(|&t| preloaded[t])
                            && node.outputs.iter().flatten().next().is_some()
                            && extras.is_empty();
                        if all_preloaded {
                            // A constant put before the first instruction.
                        } else if let Some(o) = alias {
                            let src = ins[0].ok_or_else(|| err("no input 0".into()))?;
                            let v = b.reshaped(src, inf.facts[o].shape.clone()).map_err(&err)?;
                            fwd[o] = Some(v);
                        } else {
                            let mut outs = b
                                .forward(
                                    model,
                                    inf,
                                    node,
                                    ins,
                                    opts,
                                    !extras.is_empty() && pattern.is_none(),
                                )
                                .map_err(&err)?;
                            if let Some(k) = pattern {
                                let p = &s.fused[k];
                                if ix == p.last() && !extras.is_empty() {
                                    let l = lse[k].as_ref().ok_or_else(|| {
                                        err("the attention's logsumexp was not computed".into())
                                    })?;
                                    outs.push(b.put(l.clone()).map_err(&err)?);
                                }
                            }
                            let n_out = node.outputs.len();
                            if outs.len() != n_out + extras.len() {
                                return Err(err(format!(
                                    "the kernel gave {} tensors for {} outputs and {} extras",
                                    outs.len(),
                                    n_out,
                                    extras.len()
                                )));
                            }
                            let mut outs = outs.into_iter();
                            for t in &node.outputs {
                                let v = outs.next().expect("counted");
                                let Some(t) = *t else { continue };
                                let f = &inf.facts[t];
                                if B::dtype(&v) != f.dtype || B::shape(&v) != f.shape.as_slice() {
                                    return Err(err(format!(
                                        "output '{}' is {} {:?}, inference says {} {:?}",
                                        gr.tensor(t).name,
                                        B::dtype(&v),
                                        B::shape(&v),
                                        f.dtype,
                                        f.shape
                                    )));
                                }
                                let mut v = store(b, s, t, v).map_err(&err)?;
                                let st = s.tensor_storage[t];
                                if step.writes.contains(&st) {
                                    check_bytes(st, &v)?;
                                    v = b.hold(v);
                                } else if !alloc.is_live(st) {
                                    return Err(err(format!(
                                        "view '{}' of a storage that is not live",
                                        gr.tensor(t).name
                                    )));
                                } else {
                                    v = b.set_apart(v);
                                }
                                fwd[t] = Some(v);
                            }
                            for (&st, v) in extras.iter().zip(outs) {
                                check_bytes(st, &v)?;
                                sval[st] = Some(b.hold(v));
                            }
                        }
                    }
                    StepKind::Loss => {
                        let y = fwd[out0]
                            .as_ref()
                            .ok_or_else(|| err("no model output".into()))?;
                        let sum: f64 = b.sum_f64(y).map_err(&err)?;
                        loss_f64 = match opts.loss {
                            Loss::Mean => sum / B::numel(y).max(1) as f64,
                            Loss::Sum => sum,
                        };
                        sval[step.writes[0]] = Some(
                            b.put(Tensor::f32(vec![], vec![loss_f64 as f32]))
                                .map_err(&err)?,
                        );
                    }
                    StepKind::Backward if step.node.is_none() => {
                        // The loss's backward: d loss / d output.
                        let f = &inf.facts[out0];
                        let g0 = match opts.loss {
                            Loss::Mean => Tensor::f32(
                                f.shape.clone(),
                                vec![1.0 / f.numel().max(1) as f32; f.numel() as usize],
                            ),
                            Loss::Sum => Tensor::f32(vec![], vec![1.0]),
                        };
                        let st = step.writes[0];
                        let dt = s.storages[st].dtype;
                        let g0 = g0.cast(dt).map_err(&err)?;
                        if dt.bytes_for(g0.numel() as u64) != Some(s.storages[st].bytes) {
                            return Err(err(format!(
                                "writes {} bytes into '{}' of {}",
                                dt.bytes_for(g0.numel() as u64).unwrap_or(u64::MAX),
                                s.storages[st].name,
                                s.storages[st].bytes
                            )));
                        }
                        gval[out0] = Some(
                            b.put(match opts.loss {
                                Loss::Mean => g0,
                                Loss::Sum => Tensor::from_f32(
                                    dt,
                                    f.shape.clone(),
                                    vec![1.0; f.numel() as usize],
                                )
                                .map_err(&err)?,
                            })
                            .map_err(&err)?,
                        );
                        gstore[out0] = Some(st);
                    }
                    StepKind::Backward => {
                        let ix = step.node.expect("backward of a node");
                        let node = gr.node(ix);
                        let pattern = pattern_of.get(&ix).copied();
                        if let Some(k) = pattern.filter(|&k| recomputed[k].is_none()) {
                            let p = &s.fused[k];
                            if ix != p.last() {
                                return Err(err(format!(
                                    "the first backward step of a fused {:?} pattern is not its \
                                     last node's",
                                    p.kind
                                )));
                            }
                            for &t in &p.reads {
                                ensure_value(
                                    b, model, inf, s, &step_of, &alloc, &params, &mut fwd, opts, t,
                                    0,
                                )
                                .map_err(&err)?;
                            }
                            recomputed[k] = Some(
                                recompute_pattern(
                                    b, model, inf, s, p, &step_of, &params, &fwd, &sval, opts,
                                )
                                .map_err(&err)?,
                            );
                        }
                        for t in node.inputs.iter().chain(&node.outputs).flatten() {
                            let st = s.tensor_storage[*t];
                            if st != usize::MAX && step.reads.contains(&st) {
                                ensure_value(
                                    b, model, inf, s, &step_of, &alloc, &params, &mut fwd, opts,
                                    *t, 0,
                                )
                                .map_err(&err)?;
                            }
                        }
                        let partials = backward_step(
                            b,
                            model,
                            inf,
                            s,
                            i,
                            &params,
                            &fwd,
                            &sval,
                            pattern.and_then(|k| recomputed[k].as_ref()),
                            &mut gval,
                            &mut gstore,
                            opts,
                        )
                        .map_err(&err)?;
                        // A partial gradient lives in its storage until freed.
                        for (w, d) in partials {
                            sval[w] = Some(d);
                        }
                        if let Some(k) = pattern {
                            bw_left[k] -= 1;
                            if bw_left[k] == 0 {
                                recomputed[k] = None;
                            }
                        }
                    }
                    StepKind::Optimizer => {
                        let temp = b
                            .optimizer(
                                s,
                                &gval,
                                &mut params,
                                state_st.and_then(|st| sval[st].as_mut()),
                                opts,
                            )
                            .map_err(&err)?;
                        let temps: Vec<StorageId> = step
                            .writes
                            .iter()
                            .copied()
                            .filter(|&w| s.storages[w].kind == StorageKind::OptimizerTemp)
                            .collect();
                        match (temps.as_slice(), temp) {
                            ([], None) => {}
                            ([w], Some(t)) => {
                                check_bytes(*w, &t)?;
                                sval[*w] = Some(t);
                            }
                            _ => {
                                return Err(err(
                                    "the update's temporaries are not the schedule's".into()
                                ))
                            }
                        }
                    }
                }
                let dt = t0.elapsed().as_secs_f64();
                if executions[i] == 1 {
                    step_seconds[i] = dt;
                } else {
                    recompute_seconds += dt;
                }
            }
        }
        live_after.push(b.live_bytes().unwrap_or(alloc.current));
        b.after_instruction().map_err(Error::Graph)?;
    }
    if let Some(i) = executions.iter().position(|&e| e == 0) {
        return Err(Error::Graph(format!(
            "step '{}' never runs",
            s.steps[i].name
        )));
    }
    let grads = s
        .with_grad
        .iter()
        .map(|&t| {
            let v = gval[t]
                .as_ref()
                .ok_or_else(|| Error::Graph(format!("no gradient for '{}'", gr.tensor(t).name)))?;
            b.get(v).map_err(Error::Graph)
        })
        .collect::<Result<Vec<_>>>()?;
    let output = fwd[out0]
        .as_ref()
        .or(params[out0].as_ref())
        .ok_or_else(|| Error::Graph("the model output was freed".into()))?;
    let output = b.get(output).map_err(Error::Graph)?;
    let seconds = t_start.elapsed().as_secs_f64();
    let params = params
        .iter()
        .map(|p| p.as_ref().map(|p| b.get(p)).transpose())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(Error::Graph)?;
    let state = state_st
        .and_then(|st| sval[st].as_ref())
        .map(|v| b.get(v))
        .transpose()
        .map_err(Error::Graph)?;
    Ok(StepResult {
        loss: loss_f64,
        output,
        grads,
        params,
        peak_bytes: b.peak_bytes().unwrap_or(alloc.peak),
        live_after,
        executions,
        step_seconds,
        recompute_seconds,
        seconds,
        state,
    })
}

/// The optimizer update (PyTorch's formulas, step 1, state from `state`), in
/// place on `params` and `state`. Gives the foreach Adam temporary
/// (`sqrt(exp_avg_sq) / sqrt(1 − β2ᵗ) + ε` of every parameter at once, which the
/// schedule counts as one OptimizerTemp storage), `None` for the others.
pub(crate) fn optimizer_step(
    s: &Schedule,
    gval: &[Option<Tensor>],
    params: &mut [Option<Tensor>],
    state_out: Option<&mut Tensor>,
    opts: &StepOptions,
) -> std::result::Result<Option<Tensor>, String> {
    let state = state_out.as_deref();
    let opt = opts.optimizer;
    let lr = opts.lr;
    let wd64 = opts.weight_decay.unwrap_or(match opt {
        Optimizer::Adamw => 1e-2,
        _ => 0.0,
    });
    let wd = wd64 as f32;
    let mu = opts.momentum as f32;
    let n: usize = s
        .with_grad
        .iter()
        .map(|&t| gval[t].as_ref().map_or(0, Tensor::numel))
        .sum();
    // Half-precision (bf16) parameters and states are updated in f32 and rounded
    // back, one tensor at a time.
    let state_dtype = state.as_ref().map(|t| t.dtype());
    let mut state_f32: Option<Vec<f32>> = match &state {
        Some(t) => Some(t.to_f32()?.into_owned()),
        None => None,
    };
    let mut state_vec = state_f32.as_mut();
    let state = &mut state_vec;
    if state.as_ref().map_or(0, |v| v.len()) != opt.states() as usize * n {
        return Err("the optimizer state does not match the parameters".into());
    }
    // Step 1: Adam's coefficients, in f64 then f32.
    let t = 1i32;
    let (b1, b2) = opts.betas;
    let bc1 = 1.0 - b1.powi(t);
    let bc2_sqrt = ((1.0 - b2.powi(t)).sqrt()) as f32;
    let step_size = (lr as f64 / bc1) as f32;
    let decay = (1.0 - lr as f64 * wd64) as f32;
    let (one_b1, one_b2, b2f, eps) = (
        (1.0 - b1) as f32,
        (1.0 - b2) as f32,
        b2 as f32,
        opts.eps as f32,
    );
    let mut denom_all = Vec::new();
    let mut off = 0;
    for &t in &s.with_grad {
        let g = gval[t]
            .as_ref()
            .ok_or("a parameter has no gradient")?
            .to_f32()?;
        let g: &[f32] = &g;
        let p = params[t].as_mut().ok_or("a parameter has no value")?;
        let mut p32 = p.to_f32()?.into_owned();
        let ps = &mut p32;
        if ps.len() != g.len() {
            return Err("a gradient does not match its parameter".into());
        }
        let k = g.len();
        match opt {
            Optimizer::Sgd => {
                for (p, &g) in ps.iter_mut().zip(g) {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    *p -= lr * g;
                }
            }
            Optimizer::Momentum => {
                let buf = &mut state.as_mut().expect("checked")[off..off + k];
                for ((p, &g), b) in ps.iter_mut().zip(g).zip(buf) {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    // `buf = μ·buf + g` (PyTorch's first step sets `buf = g`: the
                    // same from zero state).
                    *b = mu * *b + g;
                    *p -= lr * *b;
                }
            }
            Optimizer::Adam | Optimizer::Adamw => {
                let st = state.as_mut().expect("checked");
                let (m_all, v_all) = st.split_at_mut(n);
                let m = &mut m_all[off..off + k];
                let v = &mut v_all[off..off + k];
                for (((p, &g), m), v) in ps.iter_mut().zip(g).zip(m).zip(v) {
                    let g = if opt == Optimizer::Adamw {
                        *p *= decay;
                        g
                    } else if wd != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    };
                    *m += (g - *m) * one_b1;
                    *v = *v * b2f + one_b2 * g * g;
                    let d = v.sqrt() / bc2_sqrt + eps;
                    denom_all.push(d);
                    *p -= step_size * *m / d;
                }
            }
        }
        *p = Tensor::from_f32(p.dtype(), p.shape.clone(), p32)?;
        off += k;
    }
    if let (Some(t), Some(v), Some(dt)) = (state_out, state_f32, state_dtype) {
        *t = Tensor::from_f32(dt, t.shape.clone(), v)?;
    }
    let master = s
        .with_grad
        .first()
        .and_then(|&t| params[t].as_ref())
        .map_or(DType::F32, Tensor::dtype);
    Ok(match opt {
        Optimizer::Adam | Optimizer::Adamw => Some(Tensor::from_f32(master, vec![n], denom_all)?),
        _ => None,
    })
}

/// `v`, the value of forward tensor `t`, in its storage's element type (a float
/// tensor under a half-precision policy; every other value as it is).
fn stored(s: &Schedule, t: TensorId, v: Tensor) -> std::result::Result<Tensor, String> {
    let st = s.tensor_storage.get(t).copied().unwrap_or(usize::MAX);
    if st == usize::MAX || !v.dtype().is_float() {
        return Ok(v);
    }
    let dt = s.storages[st].dtype;
    if dt.is_float() && dt != v.dtype() {
        v.cast(dt)
    } else {
        Ok(v)
    }
}

/// [`stored`] for a backend value.
fn store<B: StepBackend>(
    b: &B,
    s: &Schedule,
    t: TensorId,
    v: B::T,
) -> std::result::Result<B::T, String> {
    let st = s.tensor_storage.get(t).copied().unwrap_or(usize::MAX);
    if st == usize::MAX || !B::dtype(&v).is_float() {
        return Ok(v);
    }
    let dt = s.storages[st].dtype;
    if dt.is_float() && dt != B::dtype(&v) {
        b.cast(&v, dt)
    } else {
        Ok(v)
    }
}

/// When `node`'s forward is a whole-tensor view: its only output (output 0),
/// held in input 0's storage, an op that keeps every element in place (reshape,
/// flatten, squeeze, unsqueeze, identity...) with as many elements and the same
/// type: that output.
fn whole_view(
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    node: &crate::ir::Node,
) -> std::result::Result<Option<TensorId>, String> {
    let (Some(Some(src)), Some(&Some(o))) = (node.inputs.first(), node.outputs.first()) else {
        return Ok(None);
    };
    if node.outputs.iter().skip(1).any(Option::is_some) {
        return Ok(None);
    }
    let st = s.tensor_storage[o];
    if st == usize::MAX || st != s.tensor_storage[*src] {
        return Ok(None);
    }
    let (op, cx) = rule_cx(model, inf, node)?;
    let keeps_order = matches!(
        op.storage(&cx),
        crate::ops::Storage::View | crate::ops::Storage::Reshape
    );
    let (a, b) = (&inf.facts[*src], &inf.facts[o]);
    Ok((keeps_order && a.numel() == b.numel() && a.dtype == b.dtype).then_some(o))
}

/// A node's op rules and the context they take (input facts from inference).
fn rule_cx<'a>(
    model: &'a Model,
    inf: &'a Inferred,
    node: &'a crate::ir::Node,
) -> std::result::Result<(&'static dyn crate::ops::Op, crate::ops::Cx<'a>), String> {
    let op = registry()
        .get(&node.domain, &node.op_type)
        .ok_or("unsupported op")?;
    let cx = crate::ops::Cx {
        node,
        inputs: node
            .inputs
            .iter()
            .map(|t| t.map(|t| &inf.facts[t]))
            .collect(),
        opset: model.opset(),
    };
    Ok((op, cx))
}

/// Runs the forward kernel of `node` on the values at hand.
#[allow(clippy::too_many_arguments)]
fn forward_kernel<B: StepBackend>(
    b: &B,
    model: &Model,
    inf: &Inferred,
    node: &crate::ir::Node,
    params: &[Option<B::T>],
    fwd: &[Option<B::T>],
    opts: &StepOptions,
    extras: bool,
) -> std::result::Result<Vec<B::T>, String> {
    let mut ins = Vec::with_capacity(node.inputs.len());
    for (slot, t) in node.inputs.iter().enumerate() {
        match t {
            None => ins.push(None),
            Some(t) => {
                let v = params[*t].as_ref().or(fwd[*t].as_ref());
                if v.is_none() {
                    return Err(format!("input {slot} has no value"));
                }
                ins.push(v);
            }
        }
    }
    b.forward(model, inf, node, ins, opts, extras)
}

/// Runs the forward kernel of `node` on the given input values.
fn run_kernel(
    model: &Model,
    inf: &Inferred,
    node: &crate::ir::Node,
    ins: Vec<Option<&Tensor>>,
    opts: &StepOptions,
    extras: bool,
) -> std::result::Result<Vec<Tensor>, String> {
    let op = registry()
        .get(&node.domain, &node.op_type)
        .ok_or("unsupported op")?;
    // Half-precision values are computed in f32.
    let wide: Vec<Option<Tensor>> = ins
        .iter()
        .map(|v| {
            v.filter(|v| v.dtype().is_float() && v.dtype() != DType::F32)
                .map(|v| v.cast(DType::F32))
                .transpose()
        })
        .collect::<std::result::Result<_, _>>()?;
    let ins = ins
        .iter()
        .zip(&wide)
        .map(|(v, w)| w.as_ref().or(*v))
        .collect();
    let cx = KernelCx {
        node,
        inputs: ins,
        outputs: node
            .outputs
            .iter()
            .map(|t| t.map(|t| &inf.facts[t]))
            .collect(),
        opset: model.opset(),
        seed: rng::name_seed(opts.seed, &node.name),
        dropout: opts.dropout,
        extras,
    };
    op.forward_cpu(&cx)
}

/// The value inference folded for tensor `t`, as a tensor of its type.
fn folded_value(inf: &Inferred, t: TensorId) -> std::result::Result<Option<Tensor>, String> {
    let f = &inf.facts[t];
    let Some(val) = &f.value else {
        return Ok(None);
    };
    Ok(Some(match &val.data {
        crate::ir::value::Data::Float(v) => Tensor::from_f32(
            f.dtype,
            f.shape.clone(),
            v.iter().map(|&x| x as f32).collect(),
        )?,
        crate::ir::value::Data::Int(v) => Tensor::from_i64(f.dtype, f.shape.clone(), v.clone())?,
    }))
}

/// The inner values of a fused pattern, recomputed at its first backward step: what
/// the fused backward kernel makes on the fly from what its forward saved. They are
/// transient, not counted (on the GPU they live inside the fused kernel), and are
/// dropped after the pattern's last backward step.
struct Recomputed<T> {
    /// Every input and output of the pattern's nodes.
    vals: HashMap<TensorId, T>,
    /// Each node's own extras (Dropout's mask, regenerated from its seed).
    extras: HashMap<NodeIndex, Vec<T>>,
    /// SDPA: the logsumexp of the recomputed scores (a host value).
    lse: Option<Tensor>,
}

/// Recomputes pattern `p`'s forward values from what its backward step reads (its
/// [`FusedPattern::reads`], which must hold values) and from fixed storages
/// (parameters, constants, the batch). A pattern input that is an activation the
/// fused kernel does not save (an attention mask computed in the graph) stands in
/// with its folded constant value; without one the step is refused, naming it.
/// SDPA: the recomputed output and logsumexp must equal the saved ones bitwise
/// (the saved logsumexp is the fused forward's Extra).
#[allow(clippy::too_many_arguments)]
fn recompute_pattern<B: StepBackend>(
    b: &B,
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    p: &FusedPattern,
    step_of: &HashMap<NodeIndex, usize>,
    params: &[Option<B::T>],
    fwd: &[Option<B::T>],
    sval: &[Option<B::T>],
    opts: &StepOptions,
) -> std::result::Result<Recomputed<B::T>, String> {
    let gr = &model.graph;
    let inside: HashSet<TensorId> = p
        .nodes
        .iter()
        .flat_map(|&n| gr.node(n).outputs.iter().flatten().copied())
        .collect();
    let mut r = Recomputed {
        vals: HashMap::new(),
        extras: HashMap::new(),
        lse: None,
    };
    for &n in &p.nodes {
        let node = gr.node(n);
        for &t in node.inputs.iter().flatten() {
            if inside.contains(&t) || r.vals.contains_key(&t) {
                continue;
            }
            let st = s.tensor_storage[t];
            let fixed = st != usize::MAX
                && matches!(
                    s.storages[st].kind,
                    StorageKind::Parameter
                        | StorageKind::Buffer
                        | StorageKind::Constant
                        | StorageKind::Input
                );
            let v = if p.reads.contains(&t) || fixed || params[t].is_some() {
                let v = params[t]
                    .as_ref()
                    .or(fwd[t].as_ref())
                    .ok_or_else(|| format!("'{}' has no value", gr.tensor(t).name))?;
                b.dup(v)?
            } else if let Some(val) = &inf.facts[t].value {
                let f = &inf.facts[t];
                let v = match &val.data {
                    crate::ir::value::Data::Float(v) => Tensor::from_f32(
                        f.dtype,
                        f.shape.clone(),
                        v.iter().map(|&x| x as f32).collect(),
                    )?,
                    crate::ir::value::Data::Int(v) => {
                        Tensor::from_i64(f.dtype, f.shape.clone(), v.clone())?
                    }
                };
                b.put_apart(stored(s, t, v)?)?
            } else {
                return Err(format!(
                    "'{}', an input of the fused {:?} pattern at '{}', is an activation the \
                     fused kernel does not save and has no constant value: the pattern's \
                     backward cannot recompute its inner values",
                    gr.tensor(t).name,
                    p.kind,
                    node.name
                ));
            };
            r.vals.insert(t, v);
        }
        // Inputs read through autocast copies are copied again.
        let fstep = step_of
            .get(&n)
            .map(|&i| &s.steps[i])
            .ok_or("a pattern node without a forward step")?;
        let mut casts: Vec<Option<B::T>> = Vec::with_capacity(node.inputs.len());
        for (slot, t) in node.inputs.iter().enumerate() {
            casts.push(match (*t, fstep.slots.get(slot)) {
                (Some(t), Some(&Some(c))) if s.storages[c].kind == StorageKind::Cast => {
                    Some(b.cast(&r.vals[&t], s.storages[c].dtype)?)
                }
                (Some(t), Some(&Some(c))) if s.storages[c].kind == StorageKind::Copy => {
                    Some(b.copy(&r.vals[&t], &s.storages[c].shape)?)
                }
                _ => None,
            });
        }
        let ins: Vec<Option<&B::T>> = node
            .inputs
            .iter()
            .zip(&casts)
            .map(|(t, c)| c.as_ref().or(t.map(|t| &r.vals[&t])))
            .collect();
        if p.kind == FusedKind::Sdpa && node.op_type == "Softmax" {
            r.lse = Some(b.logsumexp_last(ins[0].ok_or("no Softmax input")?)?);
        }
        let mut outs = b.forward(model, inf, node, ins, opts, node.op_type == "Dropout")?;
        let ex = outs.split_off(node.outputs.len().min(outs.len()));
        for (o, v) in node.outputs.iter().zip(outs) {
            if let Some(o) = *o {
                r.vals.insert(o, store(b, s, o, v)?);
            }
        }
        r.extras.insert(n, ex);
    }
    if p.kind == FusedKind::Sdpa {
        let last = gr.node(p.last());
        let o = last.outputs[0].ok_or("the attention output is omitted")?;
        let same_host = |a: &Tensor, b: &Tensor| {
            a.shape == b.shape
                && a.dtype() == b.dtype()
                && match (a.to_f32(), b.to_f32()) {
                    (Ok(x), Ok(y)) => x
                        .iter()
                        .zip(y.iter())
                        .all(|(u, v)| u.to_bits() == v.to_bits()),
                    _ => false,
                }
        };
        let same = |a: &B::T, c: &B::T| match (b.get(a), b.get(c)) {
            (Ok(a), Ok(c)) => same_host(&a, &c),
            _ => false,
        };
        if !fwd[o].as_ref().is_some_and(|v| same(v, &r.vals[&o])) {
            return Err("the recomputed attention output differs from the saved one".into());
        }
        let lse = r.lse.take().ok_or("no Softmax in the attention")?;
        let saved = s
            .steps
            .iter()
            .find(|st| st.kind == StepKind::Forward && st.node == Some(p.last()))
            .and_then(|st| {
                st.writes
                    .iter()
                    .find(|&&w| s.storages[w].kind == StorageKind::Extra)
            })
            .and_then(|&e| sval[e].as_ref())
            .ok_or("the saved logsumexp is not live")?;
        if !b.get(saved).is_ok_and(|v| same_host(&v, &lse)) {
            return Err("the recomputed logsumexp differs from the saved one".into());
        }
    }
    Ok(r)
}

/// `log Σ exp` along the last axis (the logsumexp flash attention saves per query
/// row), accumulated in f64, as f32.
pub(crate) fn logsumexp_last(x: &Tensor) -> std::result::Result<Tensor, String> {
    let xs = x.to_f32()?;
    let (&n, rows) = x.shape.split_last().ok_or("a scalar has no last axis")?;
    let v = xs
        .chunks(n.max(1))
        .map(|r| {
            let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                return m;
            }
            let sum: f64 = r.iter().map(|&v| ((v - m) as f64).exp()).sum();
            (m as f64 + sum.ln()) as f32
        })
        .collect();
    Ok(Tensor::f32(rows.to_vec(), v))
}

/// Makes the value of forward tensor `t` available when its storage is live but the
/// value was dropped: a view (its storage is its source's) whose storage was freed
/// and recomputed. The view's kernel runs again, allocating nothing, as a view costs
/// nothing on the GPU; any other missing value is an error.
#[allow(clippy::too_many_arguments)]
fn ensure_value<B: StepBackend>(
    b: &B,
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    step_of: &std::collections::HashMap<petgraph::stable_graph::NodeIndex, usize>,
    alloc: &Allocator,
    params: &[Option<B::T>],
    fwd: &mut [Option<B::T>],
    opts: &StepOptions,
    t: TensorId,
    depth: usize,
) -> std::result::Result<(), String> {
    if params[t].is_some() || fwd[t].is_some() {
        return Ok(());
    }
    let gr = &model.graph;
    let name = &gr.tensor(t).name;
    let st = s.tensor_storage[t];
    if st == usize::MAX || !alloc.is_live(st) {
        return Err(format!("'{name}' is read but its storage is not live"));
    }
    let p = gr
        .tensor(t)
        .producer
        .ok_or_else(|| format!("'{name}' has no value"))?;
    let step = &s.steps[step_of[&p]];
    // A view: its step does not write its storage (it may write others, e.g. the
    // unused mask of an identity Dropout).
    if step.writes.contains(&st) || depth > gr.order.len() {
        return Err(format!("'{name}' was lost though its storage is live"));
    }
    let node = gr.node(p);
    let src = node.inputs.first().copied().flatten();
    // A view that keeps every element in place (reshape, flatten, squeeze,
    // unsqueeze, identity, an identity Dropout's output) is its source reshaped to
    // the inferred shape: its other inputs (shape tensors, perhaps freed since) are
    // not needed.
    if let (Some(src), Some(&Some(o0))) = (src, node.outputs.first()) {
        let (op, cx) = rule_cx(model, inf, node)?;
        let keeps_order = matches!(
            op.storage(&cx),
            crate::ops::Storage::View | crate::ops::Storage::Reshape
        );
        if o0 == t && keeps_order && inf.facts[src].numel() == inf.facts[t].numel() {
            ensure_value(
                b,
                model,
                inf,
                s,
                step_of,
                alloc,
                params,
                fwd,
                opts,
                src,
                depth + 1,
            )?;
            let v = b.reshaped(
                params[src].as_ref().or(fwd[src].as_ref()).expect("ensured"),
                inf.facts[t].shape.clone(),
            )?;
            fwd[t] = Some(v);
            return Ok(());
        }
    }
    // Other views (transpose, expand, slice...) run their kernel again. Their
    // non-data inputs are shape arguments, host-side integers in PyTorch: where such
    // a tensor's storage was freed, its folded value stands in for the run.
    let mut borrowed = Vec::new();
    for (slot, i) in node.inputs.iter().enumerate() {
        let Some(i) = *i else { continue };
        let folded = inf.facts[i]
            .value
            .as_ref()
            .filter(|_| slot > 0 && !inf.facts[i].dtype.is_float());
        match folded {
            Some(val) if params[i].is_none() && fwd[i].is_none() => {
                let f = &inf.facts[i];
                fwd[i] = Some(b.put_apart(Tensor::from_i64(
                    f.dtype,
                    f.shape.clone(),
                    val.to_ints(),
                )?)?);
                borrowed.push(i);
            }
            _ => ensure_value(
                b,
                model,
                inf,
                s,
                step_of,
                alloc,
                params,
                fwd,
                opts,
                i,
                depth + 1,
            )?,
        }
    }
    let outs = forward_kernel(b, model, inf, node, params, fwd, opts, false);
    for i in borrowed {
        fwd[i] = None;
    }
    let outs = outs?;
    // Only the views: outputs the step writes have their own storage, made (and
    // counted) only by the step itself.
    for (o, v) in node.outputs.iter().zip(outs) {
        if let Some(o) = *o {
            if !step.writes.contains(&s.tensor_storage[o]) {
                fwd[o] = Some(b.set_apart(store(b, s, o, v)?));
            }
        }
    }
    Ok(())
}

/// Runs backward step `i` (of a forward node): the op's backward kernel, given only
/// the saved tensors its rule lists, then each wanted gradient stored as the schedule
/// says (a new storage, a view of the incoming gradient, or a partial added into the
/// existing gradient).
#[allow(clippy::too_many_arguments)]
fn backward_step<B: StepBackend>(
    b: &B,
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    i: usize,
    params: &[Option<B::T>],
    fwd: &[Option<B::T>],
    sval: &[Option<B::T>],
    rec: Option<&Recomputed<B::T>>,
    gval: &mut [Option<B::T>],
    gstore: &mut [Option<StorageId>],
    opts: &StepOptions,
) -> std::result::Result<Vec<(StorageId, B::T)>, String> {
    let gr = &model.graph;
    let step = &s.steps[i];
    let ix = step.node.expect("backward of a node");
    let node = gr.node(ix);
    let (op, cx) = rule_cx(model, inf, node)?;
    let outs: Vec<crate::ops::Fact> = node
        .outputs
        .iter()
        .map(|t| match t {
            Some(t) => inf.facts[*t].clone(),
            None => crate::ops::Fact::new(DType::F32, vec![]),
        })
        .collect();
    let bw = op.backward(&cx, &outs)?.ok_or("no backward rule")?;
    // The forward step of this node: its extras, in order.
    let fstep = s
        .steps
        .iter()
        .find(|st| st.kind == StepKind::Forward && st.node == Some(ix))
        .ok_or("no forward step")?;
    let extras: Vec<StorageId> = fstep
        .writes
        .iter()
        .copied()
        .filter(|&w| s.storages[w].kind == StorageKind::Extra)
        .collect();
    let wanted = step.grad_inputs.clone();
    let mut needs: Vec<Saved> = Vec::new();
    for g in bw.grads.iter().filter(|g| wanted.contains(&g.input)) {
        for &sv in &g.needs {
            if !needs.contains(&sv) {
                needs.push(sv);
            }
        }
    }
    // A fused pattern's node reads its pattern's recomputed values instead.
    let value = |t: TensorId| match rec {
        Some(r) => r.vals.get(&t),
        None => params[t].as_ref().or(fwd[t].as_ref()),
    };
    let mut saved = Vec::with_capacity(needs.len());
    for &sv in &needs {
        let v = match sv {
            // An input read through an autocast copy: the copy.
            Saved::Input(k) if rec.is_none() => match fstep.slots.get(k) {
                Some(&Some(c)) if is_copy(s.storages[c].kind) => sval[c].as_ref(),
                _ => node.inputs.get(k).copied().flatten().and_then(value),
            },
            Saved::Input(k) => node.inputs.get(k).copied().flatten().and_then(value),
            Saved::Output(k) => node.outputs.get(k).copied().flatten().and_then(value),
            Saved::Extra(k) => match rec {
                Some(r) => r.extras.get(&ix).and_then(|e| e.get(k)),
                None => extras.get(k).and_then(|&e| sval[e].as_ref()),
            },
        };
        saved.push((sv, v.ok_or_else(|| format!("saved {sv:?} is not live"))?));
    }
    let incoming: Vec<Option<StorageId>> = node
        .outputs
        .iter()
        .map(|t| t.and_then(|t| gstore[t]))
        .collect();
    // A whole-tensor view's gradient is the incoming gradient under the input's
    // shape where the backend aliases (its storage is the incoming one).
    if b.aliases_views() && rec.is_none() && wanted == [0] {
        let t = node.inputs[0].ok_or("wanted gradient of an omitted input")?;
        let own = format!("{}/grad", gr.tensor(t).name);
        let writes_own = step.writes.iter().any(|&w| s.storages[w].name == own);
        let o = node.outputs.first().copied().flatten();
        if let (Some(o), Some(Some(st)), None, false) = (o, incoming.first(), gstore[t], writes_own)
        {
            if whole_view(model, inf, s, node)? == Some(o) && !s.storages[*st].persistent {
                let g = gval[o].as_ref().ok_or("no incoming gradient")?;
                let d = b.reshaped(g, inf.facts[t].shape.clone())?;
                gstore[t] = Some(*st);
                gval[t] = Some(d);
                return Ok(Vec::new());
            }
        }
    }
    let grads: Vec<Option<&B::T>> = node
        .outputs
        .iter()
        .map(|t| t.and_then(|t| gval[t].as_ref()))
        .collect();
    let mut dx = b.backward(model, inf, node, saved, grads, wanted.clone(), opts)?;
    let mut partials = Vec::new();
    for &slot in &wanted {
        let t = node.inputs[slot].ok_or("wanted gradient of an omitted input")?;
        let d = dx
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or_else(|| format!("no gradient for input {slot}"))?;
        let name = &gr.tensor(t).name;
        let bytes_of = |st: StorageId, d: &B::T| -> std::result::Result<(), String> {
            let have = B::dtype(d)
                .bytes_for(B::numel(d) as u64)
                .unwrap_or(u64::MAX);
            if have != s.storages[st].bytes {
                return Err(format!(
                    "gradient of '{name}' is {have} bytes, '{}' has {}",
                    s.storages[st].name, s.storages[st].bytes
                ));
            }
            Ok(())
        };
        match gstore[t] {
            None => {
                let own = format!("{name}/grad");
                // Resident gradients (persistent `.grad`, zero before the step) are
                // not written by the step: the first gradient goes into them.
                let resident = || {
                    s.storages.iter().position(|st| {
                        st.kind == StorageKind::ParamGrad && st.persistent && st.name == own
                    })
                };
                let st = match step
                    .writes
                    .iter()
                    .copied()
                    .find(|&w| s.storages[w].name == own)
                    .or_else(resident)
                {
                    Some(w) => w,
                    // A view of the incoming gradient.
                    None => incoming
                        .iter()
                        .flatten()
                        .copied()
                        .next()
                        .ok_or("a view gradient without an incoming one")?,
                };
                // In the storage's type (the cast back of autocast's backward).
                let mut d = cast_to(b, d, s.storages[st].dtype)?;
                if step.writes.contains(&st) || s.storages[st].persistent {
                    bytes_of(st, &d)?;
                    d = b.hold(d);
                } else {
                    // A view the kernel copied.
                    d = b.set_apart(d);
                }
                gstore[t] = Some(st);
                gval[t] = Some(d);
            }
            Some(existing) => {
                let tmp = format!("{name}/grad+");
                let w = step
                    .writes
                    .iter()
                    .find(|&&w| s.storages[w].name == tmp)
                    .ok_or_else(|| format!("accumulating into '{name}' without a partial"))?;
                // Out of place (the gradient so far is a view autograd cannot add
                // into): a new sum in the step's own `.grad` storage; the old one
                // is freed by the plan after this step.
                let own = format!("{name}/grad");
                // (Not a first gradient this step wrote for another slot of the same
                // node, `Mul(x, x)`: that one is updated in place.)
                let sum = step
                    .writes
                    .iter()
                    .copied()
                    .find(|&w| s.storages[w].name == own)
                    .filter(|&w| w != existing && !step.updates.contains(&existing));
                if let Some(sum) = sum {
                    let dt = s.storages[sum].dtype;
                    let d = b.hold(cast_to(b, d, dt)?);
                    bytes_of(*w, &d)?;
                    let old = gval[t].as_ref().ok_or("accumulated gradient lost")?;
                    let mut total = b.get(old)?;
                    Cpu.accumulate(&mut total, &b.get(&d)?)?;
                    let total = b.hold(b.put(total)?);
                    bytes_of(sum, &total)?;
                    gstore[t] = Some(sum);
                    gval[t] = Some(total);
                    partials.push((*w, d));
                    continue;
                }
                if !step.updates.contains(&existing) {
                    return Err(format!("'{name}' accumulated but not updated"));
                }
                let acc = gval[t].as_mut().ok_or("accumulated gradient lost")?;
                let dt = s.storages[existing].dtype;
                // The partial, in the gradient's type, added in f32 and rounded back.
                let d = b.hold(cast_to(b, d, dt)?);
                bytes_of(*w, &d)?;
                b.accumulate(acc, &d)?;
                partials.push((*w, d));
            }
        }
    }
    Ok(partials)
}

/// `v` in `dt` (itself when it is already).
/// A storage an input slot is read through: an autocast copy or a contiguous copy.
fn is_copy(kind: StorageKind) -> bool {
    matches!(kind, StorageKind::Cast | StorageKind::Copy)
}

fn cast_to<B: StepBackend>(b: &B, v: B::T, dt: DType) -> std::result::Result<B::T, String> {
    if B::dtype(&v) == dt {
        Ok(v)
    } else {
        b.cast(&v, dt)
    }
}
