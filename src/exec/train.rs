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
//! Supported: fp32, `Loss::Mean` or `Loss::Sum`, SGD, gradients not resident. Not
//! yet: the fused patterns of [`crate::train::autodiff`] (exact GELU, SDPA), whose
//! schedule steps read what the fused kernel saves and so need fused backward
//! kernels; the half-precision policies; Adam and momentum.

use crate::error::{Error, Result};
use crate::exec::{rng, Tensor};
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::ops::{registry, BackwardCx, KernelCx, Saved};
use crate::remat::graph::{Op as PlanOp, RematGraph};
use crate::train::{Loss, Schedule, StepKind, StorageId, StorageKind};

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
    /// SGD learning rate.
    pub lr: f32,
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
}

/// Runs one training step of `model` following `plan` over `g` (made from `s` by
/// [`crate::remat::from_schedule::from_schedule`]), from parameters `params` (as
/// [`crate::exec::Executor::params`]) on `inputs` (one per graph input).
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
    for st in &s.storages {
        if st.kind == StorageKind::Cast || (st.dtype.is_float() && st.dtype != DType::F32) {
            return Err(Error::Graph(format!(
                "storage '{}' is {}: only the fp32 policy runs",
                st.name, st.dtype
            )));
        }
        if matches!(
            st.kind,
            StorageKind::OptimizerState | StorageKind::OptimizerTemp
        ) || (st.kind == StorageKind::ParamGrad && st.persistent)
        {
            return Err(Error::Graph(
                "only SGD without resident gradients runs".into(),
            ));
        }
    }
    let mut alloc = Allocator::new(s.storages.iter().map(|st| st.bytes).collect());
    // Values: forward tensors by tensor id; gradients by tensor id; extras and the
    // loss by storage id. Each lives in one storage.
    let mut fwd: Vec<Option<Tensor>> = vec![None; n_t];
    let mut gval: Vec<Option<Tensor>> = vec![None; n_t];
    let mut gstore: Vec<Option<StorageId>> = vec![None; n_t];
    let mut sval: Vec<Option<Tensor>> = vec![None; s.storages.len()];
    let mut params: Vec<Option<Tensor>> = params.to_vec();
    params.resize(n_t, None);
    for (v, val) in g.values.iter().enumerate() {
        if val.fixed {
            alloc.alloc(v).map_err(Error::Graph)?;
        }
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
        fwd[t] = Some(x.clone());
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
                let check_bytes = |st: StorageId, t: &Tensor| -> Result<()> {
                    let want = s.storages[st].bytes;
                    let have = t.dtype().bytes_for(t.numel() as u64).unwrap_or(u64::MAX);
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
                                model, inf, s, &step_of, &alloc, &params, &mut fwd, opts, *t, 0,
                            )
                            .map_err(&err)?;
                        }
                        let outs = forward_kernel(
                            model,
                            inf,
                            node,
                            &params,
                            &fwd,
                            opts,
                            !extras.is_empty(),
                        )
                        .map_err(&err)?;
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
                            if v.dtype() != f.dtype || v.shape != f.shape {
                                return Err(err(format!(
                                    "output '{}' is {} {:?}, inference says {} {:?}",
                                    gr.tensor(t).name,
                                    v.dtype(),
                                    v.shape,
                                    f.dtype,
                                    f.shape
                                )));
                            }
                            let st = s.tensor_storage[t];
                            if step.writes.contains(&st) {
                                check_bytes(st, &v)?;
                            } else if !alloc.is_live(st) {
                                return Err(err(format!(
                                    "view '{}' of a storage that is not live",
                                    gr.tensor(t).name
                                )));
                            }
                            fwd[t] = Some(v);
                        }
                        for (&st, v) in extras.iter().zip(outs) {
                            check_bytes(st, &v)?;
                            sval[st] = Some(v);
                        }
                    }
                    StepKind::Loss => {
                        let y = fwd[out0]
                            .as_ref()
                            .ok_or_else(|| err("no model output".into()))?;
                        let sum: f64 = y.to_f64s().iter().sum();
                        loss_f64 = match opts.loss {
                            Loss::Mean => sum / y.numel().max(1) as f64,
                            Loss::Sum => sum,
                        };
                        sval[step.writes[0]] = Some(Tensor::f32(vec![], vec![loss_f64 as f32]));
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
                        check_bytes(st, &g0)?;
                        gval[out0] = Some(match opts.loss {
                            Loss::Mean => g0,
                            Loss::Sum => {
                                Tensor::f32(f.shape.clone(), vec![1.0; f.numel() as usize])
                            }
                        });
                        gstore[out0] = Some(st);
                    }
                    StepKind::Backward => {
                        let node = gr.node(step.node.expect("backward of a node"));
                        for t in node.inputs.iter().chain(&node.outputs).flatten() {
                            let st = s.tensor_storage[*t];
                            if st != usize::MAX && step.reads.contains(&st) {
                                ensure_value(
                                    model, inf, s, &step_of, &alloc, &params, &mut fwd, opts, *t, 0,
                                )
                                .map_err(&err)?;
                            }
                        }
                        backward_step(
                            model,
                            inf,
                            s,
                            i,
                            &params,
                            &fwd,
                            &sval,
                            &mut gval,
                            &mut gstore,
                            opts,
                        )
                        .map_err(&err)?;
                    }
                    StepKind::Optimizer => {
                        for &t in &s.with_grad {
                            let gt = gval[t]
                                .as_ref()
                                .ok_or_else(|| err("a parameter has no gradient".into()))?;
                            let p = params[t]
                                .as_mut()
                                .ok_or_else(|| err("a parameter has no value".into()))?;
                            let gs = gt.as_f32().map_err(&err)?;
                            let crate::exec::Elems::F32(ps) = &mut p.elems else {
                                return Err(err("parameter not f32".into()));
                            };
                            for (p, g) in ps.iter_mut().zip(gs) {
                                *p -= opts.lr * g;
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
        live_after.push(alloc.current);
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
            gval[t]
                .clone()
                .ok_or_else(|| Error::Graph(format!("no gradient for '{}'", gr.tensor(t).name)))
        })
        .collect::<Result<Vec<_>>>()?;
    let output = fwd[out0]
        .clone()
        .or_else(|| params[out0].clone())
        .ok_or_else(|| Error::Graph("the model output was freed".into()))?;
    Ok(StepResult {
        loss: loss_f64,
        output,
        grads,
        params,
        peak_bytes: alloc.peak,
        live_after,
        executions,
        step_seconds,
        recompute_seconds,
        seconds: t_start.elapsed().as_secs_f64(),
    })
}

/// Runs the forward kernel of `node` on the values at hand.
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

fn forward_kernel(
    model: &Model,
    inf: &Inferred,
    node: &crate::ir::Node,
    params: &[Option<Tensor>],
    fwd: &[Option<Tensor>],
    opts: &StepOptions,
    extras: bool,
) -> std::result::Result<Vec<Tensor>, String> {
    let op = registry()
        .get(&node.domain, &node.op_type)
        .ok_or("unsupported op")?;
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

/// Makes the value of forward tensor `t` available when its storage is live but the
/// value was dropped: a view (its storage is its source's) whose storage was freed
/// and recomputed. The view's kernel runs again, allocating nothing, as a view costs
/// nothing on the GPU; any other missing value is an error.
#[allow(clippy::too_many_arguments)]
fn ensure_value(
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    step_of: &std::collections::HashMap<petgraph::stable_graph::NodeIndex, usize>,
    alloc: &Allocator,
    params: &[Option<Tensor>],
    fwd: &mut [Option<Tensor>],
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
    if !step.writes.is_empty() || depth > gr.order.len() {
        return Err(format!("'{name}' was lost though its storage is live"));
    }
    let node = gr.node(p);
    let src = node.inputs.first().copied().flatten();
    // A one-output view that keeps every element in place (reshape, flatten,
    // squeeze, unsqueeze, identity) is its source reshaped to the inferred shape:
    // its other inputs (shape tensors, perhaps freed since) are not needed.
    if let (Some(src), [Some(_)]) = (src, node.outputs.as_slice()) {
        let (op, cx) = rule_cx(model, inf, node)?;
        let keeps_order = matches!(
            op.storage(&cx),
            crate::ops::Storage::View | crate::ops::Storage::Reshape
        );
        if keeps_order && inf.facts[src].numel() == inf.facts[t].numel() {
            ensure_value(
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
            let v = params[src]
                .as_ref()
                .or(fwd[src].as_ref())
                .expect("ensured")
                .reshaped(inf.facts[t].shape.clone())?;
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
                fwd[i] = Some(Tensor::from_i64(f.dtype, f.shape.clone(), val.to_ints())?);
                borrowed.push(i);
            }
            _ => ensure_value(
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
    let outs = forward_kernel(model, inf, node, params, fwd, opts, false);
    for i in borrowed {
        fwd[i] = None;
    }
    let outs = outs?;
    for (o, v) in node.outputs.iter().zip(outs) {
        if let Some(o) = *o {
            fwd[o] = Some(v);
        }
    }
    Ok(())
}

/// Runs backward step `i` (of a forward node): the op's backward kernel, given only
/// the saved tensors its rule lists, then each wanted gradient stored as the schedule
/// says (a new storage, a view of the incoming gradient, or a partial added into the
/// existing gradient).
#[allow(clippy::too_many_arguments)]
fn backward_step(
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    i: usize,
    params: &[Option<Tensor>],
    fwd: &[Option<Tensor>],
    sval: &[Option<Tensor>],
    gval: &mut [Option<Tensor>],
    gstore: &mut [Option<StorageId>],
    opts: &StepOptions,
) -> std::result::Result<(), String> {
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
    let mut saved = Vec::with_capacity(needs.len());
    for &sv in &needs {
        let v = match sv {
            Saved::Input(k) => node
                .inputs
                .get(k)
                .copied()
                .flatten()
                .and_then(|t| params[t].as_ref().or(fwd[t].as_ref())),
            Saved::Output(k) => node
                .outputs
                .get(k)
                .copied()
                .flatten()
                .and_then(|t| fwd[t].as_ref()),
            Saved::Extra(k) => extras.get(k).and_then(|&e| sval[e].as_ref()),
        };
        saved.push((sv, v.ok_or_else(|| format!("saved {sv:?} is not live"))?));
    }
    let incoming: Vec<Option<StorageId>> = node
        .outputs
        .iter()
        .map(|t| t.and_then(|t| gstore[t]))
        .collect();
    let grads: Vec<Option<&Tensor>> = node
        .outputs
        .iter()
        .map(|t| t.and_then(|t| gval[t].as_ref()))
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
        wanted: wanted.clone(),
        dropout: opts.dropout,
    };
    let mut dx = op.backward_cpu(&bcx)?;
    for &slot in &wanted {
        let t = node.inputs[slot].ok_or("wanted gradient of an omitted input")?;
        let d = dx
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or_else(|| format!("no gradient for input {slot}"))?;
        let name = &gr.tensor(t).name;
        let bytes_of = |st: StorageId, d: &Tensor| -> std::result::Result<(), String> {
            let have = d.dtype().bytes_for(d.numel() as u64).unwrap_or(u64::MAX);
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
                let st = match step.writes.iter().find(|&&w| s.storages[w].name == own) {
                    Some(&w) => {
                        bytes_of(w, &d)?;
                        w
                    }
                    // A view of the incoming gradient.
                    None => incoming
                        .iter()
                        .flatten()
                        .copied()
                        .next()
                        .ok_or("a view gradient without an incoming one")?,
                };
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
                bytes_of(*w, &d)?;
                if !step.updates.contains(&existing) {
                    return Err(format!("'{name}' accumulated but not updated"));
                }
                let acc = gval[t].as_mut().ok_or("accumulated gradient lost")?;
                let crate::exec::Elems::F32(a) = &mut acc.elems else {
                    return Err("gradient not f32".into());
                };
                for (a, b) in a.iter_mut().zip(d.as_f32()?) {
                    *a += b;
                }
            }
        }
    }
    Ok(())
}
