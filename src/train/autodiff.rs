//! Autodiff: turns the forward graph into the schedule of one training step:
//! forward, loss, backward in reverse order, optimizer update.
//!
//! Each op's backward rule (`Op::backward`, beside the op) says which inputs get
//! gradients and which forward tensors each gradient reads: the tensors PyTorch's
//! autograd saves on CUDA. Memory is tracked per *storage*, as PyTorch allocates it:
//! view ops (transpose, slice, select, unsqueeze, expand, identity dropout, a reshape
//! that can be a view...) alias their input's storage and cost nothing. Every tensor's
//! strides are followed (`ops::layout`; element-wise results laid out like their
//! inputs), so a reshape copies exactly where PyTorch's would, and an op whose PyTorch
//! kernel copies a strided operand before saving it (`torch.matmul`'s reshape for
//! `bmm`) writes a [`StorageKind::Copy`] that backward reads in the operand's place
//! ([`ops::Op::saved_copies`]). A gradient flowing back through a view op is a view of
//! the incoming gradient.
//!
//! Recognised fusions (PyTorch runs these as one kernel; memplan models what that
//! kernel saves): the exact GELU exporters write as `x · (erf(x/√2) + 1) · 0.5`
//! (`F.gelu` saves only `x`), `F.gelu(approximate="tanh")` written out (saves only
//! `x`), SiLU written as `x · sigmoid(x)` (`F.silu` saves only `x`), and the
//! exporter's decomposition of `scaled_dot_product_attention` (flash attention
//! saves q, k, v, the output and a logsumexp), LayerNorm decomposed into
//! ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div (`native_layer_norm` saves the input
//! and the per-row mean and rstd), and the `torch.rsqrt` of LLaMA-style RMSNorm
//! written as Pow/ReduceMean/Add/Sqrt/Reciprocal (rsqrt saves its result, not the
//! square root), and QAT's fake quantization, QuantizeLinear → [Clip →]
//! DequantizeLinear (one float → float kernel saving a bool mask; its integer values
//! are views of its input, and its rules are [`super::fusion::FakeQuant::rule`]).
//! GPT-2's hand-written tanh GELU
//! (`NewGELUActivation`, with `torch.pow`) and eager attention are left as written,
//! since PyTorch runs them op by op.

use super::fusion::{cast_backs, fake_quant_roles, fused_patterns, per_node, FakeQuantRole};
use super::policy::Origins;
use super::schedule::{Schedule, Step, StepKind, Storage, StorageId, StorageKind};
use super::{Loss, TrainOptions};
use crate::error::{Error, Result};
use crate::infer::Inferred;
use crate::ir::{parameter_name, DType, Model, TensorId, TensorKind};
use crate::ops::{self, layout, registry, Backward, Cx, Fact, Saved};
use petgraph::stable_graph::NodeIndex;
use std::collections::{HashMap, HashSet};

/// Per-node facts the builder needs.
struct NodeRule<'a> {
    backward: std::result::Result<Option<Backward>, ops::RuleError>,
    storage: ops::Storage,
    /// The op and its rule context (the backward's scratch is asked once the wanted
    /// gradients are known).
    op: &'static dyn ops::Op,
    cx: Cx<'a>,
}

struct Builder<'a> {
    inf: &'a Inferred,
    opts: &'a TrainOptions,
    storages: Vec<Storage>,
    steps: Vec<Step>,
}

impl Builder<'_> {
    fn new_storage(
        &mut self,
        name: &str,
        fact: &Fact,
        dtype: DType,
        kind: StorageKind,
    ) -> StorageId {
        let bytes = dtype.bytes_for(fact.numel()).unwrap_or(u64::MAX);
        self.storages.push(Storage {
            name: name.to_string(),
            bytes,
            dtype,
            shape: fact.shape.clone(),
            kind,
            persistent: false,
            held: false,
            saved: false,
            pieces: Vec::new(),
        });
        self.storages.len() - 1
    }

    /// Element type of a forward float tensor under the precision policy.
    fn dtype_of(&self, t: TensorId, float_dtypes: &[Option<DType>]) -> DType {
        float_dtypes[t].unwrap_or(self.inf.facts[t].dtype)
    }
}

/// Builds the training-step schedule for inferred shapes and options.
pub fn build_schedule(model: &Model, inf: &Inferred, opts: &TrainOptions) -> Result<Schedule> {
    let g = &model.graph;
    let reg = registry();
    let opset = model.opset();
    let n_t = g.tensors.len();
    let is_float = |t: TensorId| inf.facts[t].dtype.is_float();

    let fused = fused_patterns(model, inf);
    let fusions = per_node(&fused);
    // Casts back to a norm's input type (`.to(input_dtype)`), under autocast.
    let cast_back = if opts.precision.is_amp() {
        cast_backs(model, &fused)
    } else {
        HashMap::new()
    };
    // Fake quantization: each node's role, and the pattern's integer values, which
    // carry the gradient through (as views of the float input).
    let fq = fake_quant_roles(&fused);
    let mut fq_carries = vec![false; n_t];
    for (&n, &(_, role)) in &fq {
        if matches!(role, FakeQuantRole::Quantize | FakeQuantRole::Clip) {
            for &t in g.node(n).outputs.iter().flatten() {
                fq_carries[t] = true;
            }
        }
    }
    let carries = |t: TensorId| is_float(t) || fq_carries[t];

    // 1. Rules per node, in execution order.
    let mut rules = Vec::with_capacity(g.order.len());
    for &ix in &g.order {
        let node = g.node(ix);
        let op = reg
            .get(&node.domain, &node.op_type)
            .expect("inferred model");
        let cx = Cx {
            node,
            inputs: node
                .inputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            opset,
        };
        let outs: Vec<Fact> = node
            .outputs
            .iter()
            .map(|t| match t {
                Some(t) => inf.facts[*t].clone(),
                None => Fact::new(DType::F32, vec![]),
            })
            .collect();
        let fq_rule = fq.get(&ix).and_then(|&(k, role)| {
            let p = &fused[k];
            p.fake_quant.as_ref()?.rule(role, p.extras.first()?)
        });
        rules.push(NodeRule {
            backward: match fq_rule {
                Some(bw) => Ok(Some(bw)),
                None => op.backward(&cx, &outs),
            },
            storage: op.storage(&cx),
            op,
            cx,
        });
    }

    // 2. Parameters: floating initializers read at a differentiable slot, but for
    // those the exporter declares buffers.
    let mut is_param = vec![false; n_t];
    for (step, &ix) in g.order.iter().enumerate() {
        if let Ok(Some(bw)) = &rules[step].backward {
            for gr in &bw.grads {
                if let Some(Some(t)) = g.node(ix).inputs.get(gr.input) {
                    if g.tensor(*t).kind == TensorKind::Parameter && !g.tensor(*t).buffer {
                        is_param[*t] = true;
                    }
                }
            }
        }
    }
    // Of those, the ones that train (the rest are frozen: `requires_grad_(False)`).
    let params: Vec<TensorId> = (0..n_t).filter(|&t| is_param[t]).collect();
    let names: Vec<String> = params.iter().map(|&t| parameter_name(g, t)).collect();
    let mut trainable = vec![false; n_t];
    for (&t, trains) in params.iter().zip(opts.params.resolve(&names)?) {
        trainable[t] = trains;
    }
    // How frozen parameters are stored (`quant`): float types change their dtype,
    // quantized ones their bytes, and each use dequantizes them.
    let frozen_dtype = opts.params.frozen_dtype;
    if let Some(wd) = frozen_dtype {
        if params.iter().all(|&t| trainable[t]) {
            return Err(Error::setting(
                crate::error::Setting::WeightDtype,
                format!(
                    "{wd} applies to frozen parameters only, and all {} parameters train{}",
                    params.len(),
                    if wd.is_quantized() {
                        " (quantized weights do not train: QLoRA trains adapters beside them)"
                    } else {
                        ""
                    }
                ),
            ));
        }
    }
    let frozen_quantized: Vec<bool> = (0..n_t)
        .map(|t| is_param[t] && !trainable[t] && frozen_dtype.is_some_and(|d| d.is_quantized()))
        .collect();
    let super::quant::Quantized {
        quantized,
        linear_rhs,
        weight_of_view,
    } = super::quant::Quantized::of(model, inf, &frozen_quantized);
    if let Some(wd) = frozen_dtype.filter(|d| d.is_quantized()) {
        if !quantized.contains(&true) {
            let frozen = params.iter().filter(|&&t| !trainable[t]).count();
            return Err(Error::setting(
                crate::error::Setting::WeightDtype,
                format!(
                    "{wd} quantizes frozen Linear weights (2-D, read by MatMul or Gemm), and none of the {frozen} frozen parameters is one"
                ),
            ));
        }
    }

    let origins = Origins::of(model, inf);

    // 3. requires_grad, forward.
    let mut requires = trainable.clone();
    for (step, &ix) in g.order.iter().enumerate() {
        let node = g.node(ix);
        let any_float_req = node
            .inputs
            .iter()
            .flatten()
            .any(|&t| requires[t] && carries(t));
        if !any_float_req {
            continue;
        }
        match &rules[step].backward {
            Ok(None) => {}
            Ok(Some(bw)) => {
                let grad_req = bw
                    .grads
                    .iter()
                    .any(|gr| matches!(node.inputs.get(gr.input), Some(Some(t)) if requires[*t]));
                if grad_req {
                    for t in node.outputs.iter().flatten() {
                        requires[*t] = carries(*t);
                    }
                }
            }
            Err(why) => {
                return Err(Error::node(
                    &node.name,
                    &node.op_type,
                    format!("no backward rule: {why}"),
                ))
            }
        }
    }

    // 4. Which tensors get a gradient (requires grad and the loss depends on them).
    let out0 = *g
        .outputs
        .first()
        .ok_or_else(|| Error::Graph("the model has no outputs to take a loss of".into()))?;
    if !is_float(out0) {
        return Err(Error::Graph(format!(
            "the first output '{}' is {}, not floating point: no loss to differentiate",
            g.tensor(out0).name,
            inf.facts[out0].dtype
        )));
    }
    if opts.loss == Loss::Graph && inf.facts[out0].numel() != 1 {
        return Err(Error::Setting {
            setting: crate::error::Setting::Loss,
            reason: format!(
                "the first output '{}' is {:?}, not a scalar: the model computes no loss of its own to train on",
                g.tensor(out0).name,
                inf.facts[out0].shape
            ),
        });
    }
    let mut has_grad = vec![false; n_t];
    has_grad[out0] = requires[out0];
    if !has_grad[out0] && !opts.params.is_all() {
        let setting = if opts.params.trainable.is_some() {
            crate::error::Setting::Trainable
        } else {
            crate::error::Setting::Freeze
        };
        return Err(Error::setting(
            setting,
            format!(
                "the first output '{}' depends on no parameter left to train",
                g.tensor(out0).name
            ),
        ));
    }
    if !has_grad[out0] {
        return Err(Error::Graph(format!(
            "the first output '{}' does not depend on any trainable parameter",
            g.tensor(out0).name
        )));
    }
    for (step, &ix) in g.order.iter().enumerate().rev() {
        let node = g.node(ix);
        if !node.outputs.iter().flatten().any(|&t| has_grad[t]) {
            continue;
        }
        if let Ok(Some(bw)) = &rules[step].backward {
            for gr in &bw.grads {
                if let Some(Some(t)) = node.inputs.get(gr.input) {
                    if requires[*t] {
                        has_grad[*t] = true;
                    }
                }
            }
        }
    }

    // 5. Precision: the float type of every forward tensor.
    let prec = opts.precision;
    let as_written = super::policy::exported_in_bf16(model, prec);
    let mut float_dtype: Vec<Option<DType>> = vec![None; n_t];
    for (t, info) in g.tensors.iter().enumerate() {
        if is_float(t) {
            float_dtype[t] = Some(match info.kind {
                TensorKind::Parameter if is_param[t] && !trainable[t] => frozen_dtype
                    .and_then(|d| d.float())
                    .unwrap_or(prec.master()),
                TensorKind::Parameter => prec.master(),
                _ if prec == super::Precision::Bf16 && !as_written => DType::BF16,
                _ => inf.facts[t].dtype,
            });
        }
    }
    // Under AMP, which inputs of each node are cast (to half for Half ops, to fp32 for
    // Full ops).
    let mut b = Builder {
        inf,
        opts,
        storages: Vec::new(),
        steps: Vec::new(),
    };
    let mut tstore: Vec<Option<StorageId>> = vec![None; n_t];
    // Strides of each forward tensor in its storage (`ops::layout`); `None`: a view
    // memplan does not follow (a reshape of it copies).
    let mut strides: Vec<Option<Vec<usize>>> = inf
        .facts
        .iter()
        .map(|f| Some(layout::contiguous(&f.shape)))
        .collect();
    // Persistent storages.
    for (t, info) in g.tensors.iter().enumerate() {
        let kind = match info.kind {
            TensorKind::Parameter if is_param[t] => StorageKind::Parameter,
            TensorKind::Parameter => StorageKind::Buffer,
            TensorKind::Constant if info.producer.is_none() => StorageKind::Constant,
            TensorKind::Input => StorageKind::Input,
            _ => continue,
        };
        let dt = b.dtype_of(t, &float_dtype);
        let s = b.new_storage(&info.name, &inf.facts[t], dt, kind);
        b.storages[s].persistent = true;
        if let (true, Some(wd)) = (quantized[t], frozen_dtype) {
            let f = &inf.facts[t];
            let rhs = linear_rhs[t].unwrap_or(false);
            b.storages[s].bytes = wd.bytes(f.numel(), super::quant::output_rows(&f.shape, rhs));
        }
        tstore[t] = Some(s);
    }
    // Autocast weight cache: one half copy per parameter, made at its first use. A
    // trainable parameter read through a view (the TorchScript exporter's
    // `Transpose(W)` before each `MatMul` of a Linear) is the same cache entry as
    // every other read through the same view: PyTorch casts `W` itself, once, and
    // each use views the copy (ALBERT's shared layer: one copy for all its layers).
    // Keyed by the parameter's storage and the view's shape and strides, so that a
    // different view of one weight (a square `W` read as itself and transposed)
    // gets its own copy (PyTorch would view the one copy: memplan counts more).
    let trainable_storage: HashSet<StorageId> = (0..n_t)
        .filter(|&t| trainable[t])
        .filter_map(|t| tstore[t])
        .collect();
    type CastKey = (StorageId, Vec<usize>, Option<Vec<usize>>);
    let mut weight_cast: HashMap<CastKey, StorageId> = HashMap::new();

    // 6. Forward steps.
    // Per node: the storage each input slot is read from (after casts), for backward.
    let mut read_as: Vec<Vec<Option<StorageId>>> = Vec::with_capacity(g.order.len());
    let mut extras_of: Vec<Vec<StorageId>> = Vec::with_capacity(g.order.len());
    for (step, &ix) in g.order.iter().enumerate() {
        let node = g.node(ix);
        let mut writes = Vec::new();
        let mut reads = Vec::new();
        let mut slots = Vec::with_capacity(node.inputs.len());
        // Casts under AMP.
        let class = reg
            .get(&node.domain, &node.op_type)
            .expect("inferred model")
            .autocast(&node.op_type);
        let target = prec.input_dtype(class);
        for t in &node.inputs {
            let Some(t) = *t else {
                slots.push(None);
                continue;
            };
            let src = tstore[t].expect("inputs are stored before use");
            let cur = b.dtype_of(t, &float_dtype);
            let views_it = node
                .outputs
                .first()
                .copied()
                .flatten()
                .is_some_and(|o| weight_of_view[o] == Some(t));
            if quantized[t] && !views_it {
                // Dequantized to the compute dtype for this op only; the op (and its
                // backward) keeps the quantized weight.
                let dt = target.unwrap_or(cur);
                let c = b.new_storage(
                    &format!("{}@dequant", g.tensor(t).name),
                    &inf.facts[t],
                    dt,
                    StorageKind::Cast,
                );
                reads.extend([src, c]);
                writes.push(c);
                slots.push(Some(src));
                continue;
            }
            let s = match target {
                Some(want) if is_float(t) && cur != want => {
                    // Autocast caches the cast of a leaf that requires grad
                    // (`cached_cast` in autocast_mode.cpp): a trainable parameter,
                    // or a view of one. A frozen one is cast again at every use.
                    let key: Option<CastKey> = trainable_storage
                        .contains(&src)
                        .then(|| (src, inf.facts[t].shape.clone(), strides[t].clone()));
                    if let Some(&c) = key.as_ref().and_then(|k| weight_cast.get(k)) {
                        c
                    } else {
                        let c = b.new_storage(
                            &format!("{}@{}", g.tensor(t).name, want),
                            &inf.facts[t],
                            want,
                            StorageKind::Cast,
                        );
                        reads.push(src);
                        writes.push(c);
                        if let Some(k) = key {
                            weight_cast.insert(k, c);
                        }
                        c
                    }
                }
                _ => src,
            };
            reads.push(s);
            slots.push(Some(s));
        }
        // `softmax(x, dtype=float32)` on a half `x` converts `x` inside the op, which
        // [`crate::infer::lower`] writes `Softmax(Cast(x))`: `x` lives through the softmax.
        if let Some(s) =
            super::policy::upcast_softmax_source(model, inf, node).and_then(|x| tstore[x])
        {
            reads.push(s);
        }
        // Operands PyTorch's kernel copies to contiguous memory before saving them
        // (torch.matmul's reshape of a strided operand): the copy is written here and
        // read in the input's place, by this step and by backward.
        let op = reg
            .get(&node.domain, &node.op_type)
            .expect("inferred model");
        let cx = Cx {
            node,
            inputs: node
                .inputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            opset,
        };
        // Each input's strides as this node reads it (an autocast copy is contiguous).
        let in_strides: Vec<Option<Vec<usize>>> = node
            .inputs
            .iter()
            .zip(&slots)
            .map(|(t, s)| match (*t, *s) {
                (Some(t), Some(s)) if tstore[t] == Some(s) => strides[t].clone(),
                (Some(t), Some(_)) => Some(layout::contiguous(&inf.facts[t].shape)),
                _ => None,
            })
            .collect();
        let own: Vec<Option<&[usize]>> = in_strides.iter().map(|s| s.as_deref()).collect();
        if !fusions.contains_key(&ix) {
            let req: Vec<bool> = node
                .inputs
                .iter()
                .map(|t| t.is_some_and(|t| requires[t]))
                .collect();
            for (k, shape) in op.saved_copies(&cx, &own, &req) {
                let (Some(t), Some(src)) = (node.inputs[k], slots[k]) else {
                    continue;
                };
                // An autocast copy is contiguous, so what remains is a broadcast
                // operand's expansion, which the kernel makes of the half copy
                // (Falcon's shared key under AMP: the expanded half copy is saved).
                if tstore[t] != Some(src) && b.storages[src].kind != StorageKind::Cast {
                    continue;
                }
                let dt = b.storages[src].dtype;
                let c = b.new_storage(
                    &format!("{}@copy", g.tensor(t).name),
                    &Fact::new(dt, shape),
                    dt,
                    StorageKind::Copy,
                );
                writes.push(c);
                reads.push(c);
                slots[k] = Some(c);
            }
        }
        // Output dtypes: the widest of the float inputs autocast's type rules
        // count ([`Origins::promoting`]).
        let floats: Vec<(usize, TensorId)> = node
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(k, t)| {
                t.filter(|&t| slots[k].is_some() && is_float(t))
                    .map(|t| (k, t))
            })
            .collect();
        let widest = origins
            .promoting(model, inf, node, floats)
            .into_iter()
            .filter_map(|k| slots[k].map(|s| b.storages[s].dtype))
            .max_by_key(|d| d.bits());
        // A fake quantization's output is of its float input's type (read through
        // the integer view).
        let widest = match fq.get(&ix) {
            Some((_, FakeQuantRole::Dequantize)) => slots
                .first()
                .copied()
                .flatten()
                .map(|s| b.storages[s].dtype),
            _ => widest,
        };
        let back = cast_back.get(&ix).map(|&x0| b.dtype_of(x0, &float_dtype));
        for t in node.outputs.iter().flatten() {
            if is_float(*t) {
                float_dtype[*t] = Some(back.unwrap_or_else(|| match as_written {
                    true => inf.facts[*t].dtype,
                    false => prec.output_dtype(class, widest, inf.facts[*t].dtype),
                }));
            }
        }
        // Output storages.
        let rule = &rules[step];
        let in0 = node.inputs.first().copied().flatten();
        // A fake quantization's integer values (and its qparam casts) are views of
        // their input, whatever the dtypes: no 8-bit tensor exists in PyTorch.
        let fq_alias = fq.get(&ix).is_some_and(|&(k, role)| {
            fused[k]
                .fake_quant
                .as_ref()
                .is_some_and(|f| f.aliases(role, &node.op_type))
        });
        for (k, t) in node.outputs.iter().enumerate() {
            let Some(t) = *t else { continue };
            let view_of = |b: &Builder| {
                in0.filter(|&i| {
                    slots[0].is_some() && b.dtype_of(i, &float_dtype) == b.dtype_of(t, &float_dtype)
                })
            };
            let alias = match (rule.storage, view_of(&b)) {
                _ if fq_alias && k == 0 && slots.first().copied().flatten().is_some() => {
                    Some((slots[0].expect("read"), in_strides[0].clone()))
                }
                (ops::Storage::New, _) | (_, None) => None,
                (kind, Some(i)) => {
                    let st = strides[i]
                        .as_ref()
                        .and_then(|st| op.view_strides(&cx, k, &inf.facts[t], st));
                    match (kind, st) {
                        // A reshape that is no view copies.
                        (ops::Storage::Reshape, None) => None,
                        (_, st) => Some((slots[0].expect("read"), st)),
                    }
                }
            };
            let kind = if node.op_type == "Constant" {
                StorageKind::Constant
            } else {
                StorageKind::Activation
            };
            let s = match alias {
                Some((s, st)) if kind == StorageKind::Activation => {
                    strides[t] = st;
                    s
                }
                _ => {
                    let dt = b.dtype_of(t, &float_dtype);
                    let s = b.new_storage(&g.tensor(t).name, &inf.facts[t], dt, kind);
                    // The output as the step writes it: under autocast, in its half type.
                    let out = if dt == inf.facts[t].dtype {
                        std::borrow::Cow::Borrowed(&inf.facts[t])
                    } else {
                        std::borrow::Cow::Owned(Fact::new(dt, inf.facts[t].shape.clone()))
                    };
                    strides[t] = Some(op.out_strides(&cx, k, &out, &own));
                    if kind == StorageKind::Constant {
                        b.storages[s].persistent = true;
                        // A fake quantization's constant (a Python scalar scale or
                        // zero point, the Clip's bound): a number on the host in
                        // PyTorch, no tensor.
                        if matches!(fq.get(&ix), Some((_, FakeQuantRole::QParam))) {
                            b.storages[s].bytes = 0;
                        }
                    } else {
                        writes.push(s);
                    }
                    s
                }
            };
            if g.outputs.contains(&t) {
                b.storages[s].held = true;
            }
            let layout = fusions.get(&ix).and_then(|f| match &f.out_layout_f32 {
                _ if f.follows_contiguous_query(&strides, inf) => None,
                Some(l) if b.storages[s].dtype == DType::F32 => Some(l),
                _ => f.out_layout.as_ref(),
            });
            if let Some(l) = layout {
                if k == 0 && l.len() == inf.facts[t].rank() {
                    strides[t] = Some(layout::permuted(&inf.facts[t].shape, l));
                }
            }
            tstore[t] = Some(s);
        }
        // Extras, when this node's backward will run.
        let mut extras = Vec::new();
        if let Ok(Some(bw)) = &rule.backward {
            if node.outputs.iter().flatten().any(|&t| has_grad[t]) {
                let made = match fusions.get(&ix) {
                    Some(f) => &f.extras,
                    None => &bw.extras,
                };
                for (k, f) in made.iter().enumerate() {
                    let s = b.new_storage(
                        &format!("{}/saved{k}", node.name),
                        f,
                        f.dtype,
                        StorageKind::Extra,
                    );
                    writes.push(s);
                    extras.push(s);
                }
            }
        }
        b.steps.push(Step {
            name: node.name.to_string(),
            op: node.op_type.to_string(),
            kind: StepKind::Forward,
            node: Some(ix),
            reads,
            writes,
            updates: Vec::new(),
            grad_inputs: Vec::new(),
            slots: slots.clone(),
            fused: fusions.contains_key(&ix),
            flops: inf.flops[step],
        });
        read_as.push(slots);
        extras_of.push(extras);
    }

    // A module call holds its arguments until it returns.
    let persistent: Vec<bool> = b.storages.iter().map(|s| s.persistent).collect();
    super::module_args::hold_module_arguments(&mut b.steps, &persistent);

    // 7. Loss.
    let out0_s = tstore[out0].expect("stored");
    let loss = b.new_storage(
        "loss",
        &Fact::new(DType::F32, vec![]),
        DType::F32,
        StorageKind::Loss,
    );
    b.storages[loss].held = true;
    let n_out = inf.facts[out0].numel();
    b.steps.push(Step {
        name: "loss".into(),
        op: match b.opts.loss {
            Loss::Mean => "ReduceMean",
            Loss::Sum => "ReduceSum",
            Loss::Graph => "Identity",
        }
        .into(),
        kind: StepKind::Loss,
        node: None,
        reads: vec![out0_s],
        writes: vec![loss],
        updates: Vec::new(),
        grad_inputs: Vec::new(),
        slots: Vec::new(),
        fused: false,
        flops: n_out,
    });
    let mut grad: Vec<Option<StorageId>> = vec![None; n_t];
    let g0_fact = match b.opts.loss {
        Loss::Mean => inf.facts[out0].clone(),
        // SumBackward expands the scalar gradient: a view, one element of storage.
        Loss::Sum => Fact::new(inf.facts[out0].dtype, vec![]),
        // `loss.backward()` seeds a scalar one.
        Loss::Graph => inf.facts[out0].clone(),
    };
    let g0_dtype = b.dtype_of(out0, &float_dtype);
    let g0 = b.new_storage(
        &format!("{}/grad", g.tensor(out0).name),
        &g0_fact,
        g0_dtype,
        StorageKind::ActivationGrad,
    );
    grad[out0] = Some(g0);
    b.steps.push(Step {
        name: "loss/grad".into(),
        op: "LossGrad".into(),
        kind: StepKind::Backward,
        node: None,
        reads: vec![loss],
        writes: vec![g0],
        updates: Vec::new(),
        grad_inputs: Vec::new(),
        slots: Vec::new(),
        fused: false,
        flops: n_out,
    });

    // 8. Backward, in reverse order.
    // The storage a backward rule's saved tensor refers to, for the node at `step`.
    let saved_storage = |step: usize, sv: Saved| -> Option<StorageId> {
        match sv {
            Saved::Input(i) => read_as[step].get(i).copied().flatten(),
            Saved::Output(i) => g
                .node(g.order[step])
                .outputs
                .get(i)
                .copied()
                .flatten()
                .and_then(|o| tstore[o]),
            Saved::Extra(i) => extras_of[step].get(i).copied(),
        }
    };
    // A fused kernel on autocast's float32 list reads its input as the float32
    // copy that one of its nodes made of it (or of a view of it), when one did.
    let step_of: HashMap<NodeIndex, usize> =
        g.order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut fp32_reads: HashMap<(NodeIndex, TensorId), StorageId> = HashMap::new();
    for p in fused.iter().filter(|p| p.kind.saves_float32_copy()) {
        for &x in &p.reads {
            let Some(base) = tstore[x] else { continue };
            let copy = p.nodes.iter().find_map(|n| {
                let node = g.node(*n);
                node.inputs
                    .iter()
                    .zip(&read_as[step_of[n]])
                    .find_map(|(t, s)| match (t, s) {
                        (Some(t), Some(s))
                            if tstore[*t] == Some(base)
                                && b.storages[*s].kind == StorageKind::Cast
                                && b.storages[*s].dtype == DType::F32 =>
                        {
                            Some(*s)
                        }
                        _ => None,
                    })
            });
            if let Some(c) = copy {
                fp32_reads.insert((p.last(), x), c);
            }
        }
    }
    let grads_resident = b.opts.grads_resident;
    // Parameters whose gradient so far is one contribution that autograd cannot add
    // into in place (see below).
    let mut view_grad = vec![false; n_t];
    for (step, &ix) in g.order.iter().enumerate().rev() {
        let node = g.node(ix);
        let out_grads: Vec<StorageId> = node
            .outputs
            .iter()
            .flatten()
            .filter(|&&t| has_grad[t])
            .filter_map(|&t| grad[t])
            .collect();
        if out_grads.is_empty() {
            continue;
        }
        let Ok(Some(bw)) = &rules[step].backward else {
            continue;
        };
        let mut reads = out_grads.clone();
        let mut writes = Vec::new();
        let mut updates = Vec::new();
        let is_view = matches!(
            rules[step].storage,
            ops::Storage::View | ops::Storage::StridedView | ops::Storage::Reshape
        ) || matches!(
            fq.get(&ix),
            Some((_, FakeQuantRole::Clip | FakeQuantRole::Dequantize))
        );
        let fusion = fusions.get(&ix);
        let mut grad_inputs = Vec::new();
        for gr in &bw.grads {
            let Some(Some(t)) = node.inputs.get(gr.input) else {
                continue;
            };
            let t = *t;
            if !has_grad[t] {
                continue;
            }
            if !grad_inputs.contains(&gr.input) {
                grad_inputs.push(gr.input);
            }
            // Saved tensors this gradient reads (a fused pattern reads what the fused
            // kernel saves instead).
            let needs: Vec<Saved> = match fusion {
                Some(f) => (0..f.extras.len()).map(Saved::Extra).collect(),
                None => gr.needs.clone(),
            };
            for sv in needs {
                let s = saved_storage(step, sv);
                if let Some(s) = s {
                    if !reads.contains(&s) {
                        reads.push(s);
                    }
                }
            }
            for &x in fusion.map(|f| f.reads.as_slice()).unwrap_or(&[]) {
                let s = fp32_reads
                    .get(&(ix, x))
                    .copied()
                    .unwrap_or_else(|| tstore[x].expect("stored"));
                if !reads.contains(&s) {
                    reads.push(s);
                }
            }
            // The gradient: a view of the incoming one through view ops, else new.
            //
            // Parameters, as autograd does it (torch/csrc/autograd/input_buffer.cpp,
            // accumulate_grad.h): each use of a parameter gives one contribution;
            // the engine sums them in the input buffer of the parameter's
            // AccumulateGrad, which then steals the sum as `.grad` (no copy: the
            // step ends with one gradient per parameter). A contribution that is a
            // view (a parameter read through a transpose or reshape: `TBackward0`,
            // `ViewBackward0` of the incoming gradient, or a Gemm's transposed
            // operand) costs nothing and cannot be added into in place
            // (`can_accumulate_inplace` wants the last reference to a dense
            // tensor), so the next contribution is added out of place: for a
            // moment the view, the new contribution and their sum are all live
            // (tied input/output embeddings: three weight-sized tensors at the
            // embedding's backward). The sum is a fresh tensor, so any later
            // contribution is added into it in place. Measured on PyTorch 2.15 CPU
            // (tools/census, docs/CENSUS.md). With resident gradients (gradient
            // accumulation) every contribution is added into `.grad` in place.
            let param = g.tensor(t).kind == TensorKind::Parameter;
            let view_op = node.op_type == "Transpose"
                || matches!(
                    rules[step].storage,
                    ops::Storage::View | ops::Storage::Reshape
                );
            let param_view = param && view_op && !grads_resident && out_grads.len() == 1 && {
                let og = &b.storages[out_grads[0]];
                og.kind == StorageKind::ActivationGrad
                    && !og.persistent
                    && og.dtype == prec.master()
                    && Some(og.bytes) == prec.master().bytes_for(inf.facts[t].numel())
            };
            match grad[t] {
                None if is_view && !param && out_grads.len() == 1 => grad[t] = Some(out_grads[0]),
                None if param_view => {
                    let og = out_grads[0];
                    b.storages[og].kind = StorageKind::ParamGrad;
                    b.storages[og].held = true;
                    grad[t] = Some(og);
                    view_grad[t] = true;
                }
                Some(existing) if param && view_grad[t] && !grads_resident => {
                    // Out of place: partial + sum written, the view freed after it.
                    let dt = b.storages[existing].dtype;
                    let tmp = b.new_storage(
                        &format!("{}/grad+", g.tensor(t).name),
                        &inf.facts[t],
                        dt,
                        StorageKind::GradTemp,
                    );
                    let sum = b.new_storage(
                        &format!("{}/grad", g.tensor(t).name),
                        &inf.facts[t],
                        dt,
                        StorageKind::ParamGrad,
                    );
                    b.storages[sum].held = true;
                    b.storages[existing].held = false;
                    b.storages[existing].kind = StorageKind::GradTemp;
                    writes.push(tmp);
                    writes.push(sum);
                    reads.push(tmp);
                    if !reads.contains(&existing) {
                        reads.push(existing);
                    }
                    grad[t] = Some(sum);
                    view_grad[t] = false;
                }
                None => {
                    let kind = if param {
                        StorageKind::ParamGrad
                    } else {
                        StorageKind::ActivationGrad
                    };
                    let dt = if param {
                        prec.master()
                    } else {
                        b.dtype_of(t, &float_dtype)
                    };
                    let name = format!("{}/grad", g.tensor(t).name);
                    let s = b.new_storage(&name, &inf.facts[t], dt, kind);
                    if param {
                        b.storages[s].held = true;
                        b.storages[s].persistent = grads_resident;
                        // Gemm's transposed operand: PyTorch's addmm reads `W.t()`, and
                        // the weight's gradient is `TBackward0`'s view of mm's.
                        let trans = match gr.input {
                            0 => "transA",
                            1 => "transB",
                            _ => "",
                        };
                        view_grad[t] = node.op_type == "Gemm" && node.attrs.int_or(trans, 0) != 0;
                    }
                    if !b.storages[s].persistent {
                        writes.push(s);
                    }
                    grad[t] = Some(s);
                }
                Some(existing) => {
                    // Accumulate: the partial gradient is a temporary added in place.
                    let dt = b.storages[existing].dtype;
                    let tmp = b.new_storage(
                        &format!("{}/grad+", g.tensor(t).name),
                        &inf.facts[t],
                        dt,
                        StorageKind::GradTemp,
                    );
                    writes.push(tmp);
                    reads.push(tmp);
                    updates.push(existing);
                }
            }
        }
        for &s in &reads {
            let k = b.storages[s].kind;
            if !matches!(
                k,
                StorageKind::ActivationGrad | StorageKind::GradTemp | StorageKind::ParamGrad
            ) {
                b.storages[s].saved = true;
            }
        }
        // What the derivative formulas hold beyond the gradients (a fused pattern's
        // kernel and a fake quantization's rule have their own).
        if fusion.is_none() && !fq.contains_key(&ix) {
            let rule = &rules[step];
            let elems = rule.op.backward_scratch(&rule.cx, &grad_inputs);
            if elems > 0 {
                let dt = b.storages[out_grads[0]].dtype;
                let s = b.new_storage(
                    &format!("{}/grad scratch", node.name),
                    &Fact::new(dt, vec![elems as usize]),
                    dt,
                    StorageKind::GradTemp,
                );
                writes.push(s);
                reads.push(s);
            }
        }
        // A quantized frozen weight that this backward reads is dequantized again,
        // to the incoming gradient's dtype, for the input gradient
        // (`MatMul4Bit.backward`): a temporary of this step.
        for &t in node.inputs.iter().flatten() {
            if quantized[t] && tstore[t].is_some_and(|s| reads.contains(&s)) {
                let dt = b.storages[out_grads[0]].dtype;
                let c = b.new_storage(
                    &format!("{}@dequant/grad", g.tensor(t).name),
                    &inf.facts[t],
                    dt,
                    StorageKind::Cast,
                );
                writes.push(c);
                reads.push(c);
            }
        }
        let flops = required_share(bw, &node.inputs, &grad_inputs);
        b.steps.push(Step {
            name: format!("{}/grad", node.name),
            op: format!("{}Grad", node.op_type),
            kind: StepKind::Backward,
            node: Some(ix),
            reads,
            writes,
            updates,
            grad_inputs,
            slots: Vec::new(),
            fused: false,
            flops,
        });
    }

    // 8b. Branches that require grad but that the loss does not depend on (e.g. BERT's
    // pooler when the loss is on the hidden states): autograd decides what to save at
    // forward time, from requires_grad alone, so those ops save their tensors anyway,
    // and the graph keeps them for as long as an output it hangs from is held.
    let mut reaches_held = vec![false; n_t];
    for &t in g.outputs.iter().skip(1) {
        reaches_held[t] = requires[t] && !has_grad[t];
    }
    for (step, &ix) in g.order.iter().enumerate().rev() {
        let node = g.node(ix);
        if !node.outputs.iter().flatten().any(|&t| reaches_held[t]) {
            continue;
        }
        let Ok(Some(bw)) = &rules[step].backward else {
            continue;
        };
        for gr in &bw.grads {
            let Some(Some(t)) = node.inputs.get(gr.input) else {
                continue;
            };
            if !requires[*t] {
                continue;
            }
            if !has_grad[*t] {
                reaches_held[*t] = true;
            }
            for sv in &gr.needs {
                let s = saved_storage(step, *sv);
                if let Some(s) = s {
                    let st = &mut b.storages[s];
                    if !matches!(
                        st.kind,
                        StorageKind::Parameter | StorageKind::Buffer | StorageKind::Constant
                    ) {
                        st.saved = true;
                        st.held = true;
                    }
                }
            }
        }
    }

    // 9. Optimizer.
    let with_grad: Vec<TensorId> = (0..n_t).filter(|&t| trainable[t] && has_grad[t]).collect();
    let trainable_ids: Vec<TensorId> = (0..n_t).filter(|&t| trainable[t]).collect();
    let master = prec.master();
    let grad_bytes: u64 = with_grad
        .iter()
        .map(|&t| master.bytes_for(inf.facts[t].numel()).unwrap_or(u64::MAX))
        .sum();
    let mut reads: Vec<StorageId> = with_grad.iter().filter_map(|&t| grad[t]).collect();
    reads.extend(with_grad.iter().filter_map(|&t| tstore[t]));
    let mut writes = Vec::new();
    let opt = b.opts.optimizer;
    let numels: Vec<u64> = with_grad.iter().map(|&t| inf.facts[t].numel()).collect();
    let state_bytes = with_grad
        .iter()
        .fold(opt.shared_state_bytes(&numels), |a, &t| {
            a.saturating_add(opt.state_bytes(&inf.facts[t].shape, master))
        });
    if state_bytes > 0 && grad_bytes > 0 {
        let s = b.new_storage(
            "optimizer state",
            &Fact::new(master, vec![]),
            master,
            StorageKind::OptimizerState,
        );
        b.storages[s].bytes = state_bytes;
        b.storages[s].shape = Vec::new();
        b.storages[s].persistent = true;
        // Per parameter, as torch.optim creates its state; the shared maps last.
        let mut pieces: Vec<u64> = with_grad
            .iter()
            .flat_map(|&t| opt.state_tensors(&inf.facts[t].shape, master))
            .collect();
        let shared = opt.shared_state_bytes(&numels);
        if shared > 0 {
            pieces.extend([shared / 2, shared - shared / 2]);
        }
        b.storages[s].pieces = pieces;
        reads.push(s);
    }
    let largest = numels.iter().copied().max().unwrap_or(0);
    let temp = opt.temp_bytes(grad_bytes, largest, master);
    if temp > 0 {
        let s = b.new_storage(
            "optimizer temporaries",
            &Fact::new(master, vec![]),
            master,
            StorageKind::OptimizerTemp,
        );
        b.storages[s].bytes = temp;
        if temp == grad_bytes {
            // A foreach temporary: one tensor per parameter.
            b.storages[s].pieces = with_grad
                .iter()
                .map(|&t| master.bytes_for(inf.facts[t].numel()).unwrap_or(u64::MAX))
                .collect();
        }
        writes.push(s);
        reads.push(s);
    }
    let n_params: u64 = numels.iter().sum();
    let per_elem = opt.flops_per_element();
    b.steps.push(Step {
        name: "optimizer".into(),
        op: b.opts.optimizer.to_string(),
        kind: StepKind::Optimizer,
        node: None,
        reads,
        writes,
        updates: Vec::new(),
        grad_inputs: Vec::new(),
        slots: Vec::new(),
        fused: false,
        flops: n_params.saturating_mul(per_elem),
    });

    let tensor_storage = tstore
        .into_iter()
        .map(|s| s.unwrap_or(usize::MAX))
        .collect();
    let mut fused_copies: Vec<(NodeIndex, TensorId, StorageId)> =
        fp32_reads.iter().map(|(&(n, t), &c)| (n, t, c)).collect();
    fused_copies.sort_unstable();
    Ok(Schedule {
        storages: b.storages,
        steps: b.steps,
        tensor_storage,
        trainable: trainable_ids,
        with_grad,
        fused,
        fused_copies,
    })
}

/// The backward FLOPs of the gradients that are required: an op's rule counts all of
/// them ([`Backward::flops`]); a frozen layer computes only its input's gradient (a
/// frozen matmul: half its backward), the first layer only its weight's. Estimated
/// as the share of the required gradients among the present inputs' gradients that
/// read a saved tensor (a bias's gradient, a reduction of the incoming one, counts
/// as free; a convolution's rule gives its bias the weight's needs, so a frozen
/// convolution with a bias is counted at a third, where its input gradient is half).
fn required_share(bw: &Backward, inputs: &[Option<TensorId>], required: &[usize]) -> u64 {
    let costly: Vec<usize> = bw
        .grads
        .iter()
        .filter(|g| !g.needs.is_empty() && matches!(inputs.get(g.input), Some(Some(_))))
        .map(|g| g.input)
        .collect();
    if costly.is_empty() {
        return bw.flops;
    }
    let needed = costly.iter().filter(|i| required.contains(i)).count() as u64;
    (bw.flops as u128 * needed.max(1) as u128 / costly.len() as u128) as u64
}
