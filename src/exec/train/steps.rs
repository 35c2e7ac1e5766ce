//! One schedule step's work: a node's forward kernel and its outputs' storages, a
//! fused pattern's recomputation, a node's backward kernel from its saved tensors, and
//! the values a step needs.

#[allow(unused_imports)]
use super::*;
use crate::ops::quantize::FakeQuantParams;
use crate::train::FakeQuant;

/// `v`, the value of forward tensor `t`, in its storage's element type (a float
/// tensor under a half-precision policy; every other value as it is).
pub(super) fn stored(s: &Schedule, t: TensorId, v: Tensor) -> Result<Tensor> {
    let st = s.tensor_storage.get(t).copied().unwrap_or(usize::MAX);
    if st == usize::MAX || !v.dtype().is_float() {
        return Ok(v);
    }
    let dt = s.storages[st].dtype;
    if dt.is_float() && dt != v.dtype() {
        Ok(v.cast(dt)?)
    } else {
        Ok(v)
    }
}

/// [`stored`] for a backend value.
pub(super) fn store<B: StepBackend>(b: &B, s: &Schedule, t: TensorId, v: B::T) -> Result<B::T> {
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
pub(super) fn whole_view(
    model: &Model,
    inf: &Inferred,
    s: &Schedule,
    node: &crate::ir::Node,
) -> Result<Option<TensorId>> {
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
pub(super) fn rule_cx<'a>(
    model: &'a Model,
    inf: &'a Inferred,
    node: &'a crate::ir::Node,
) -> Result<(&'static dyn crate::ops::Op, crate::ops::Cx<'a>)> {
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
pub(super) fn forward_kernel<B: StepBackend>(
    cx: &Cx<B>,
    node: &crate::ir::Node,
    v: &Values<B::T>,
    extras: bool,
) -> Result<Vec<B::T>> {
    let mut ins = Vec::with_capacity(node.inputs.len());
    for (slot, t) in node.inputs.iter().enumerate() {
        match t {
            None => ins.push(None),
            Some(t) => {
                let x = v.of(*t);
                if x.is_none() {
                    return Err(format!("input {slot} has no value").into());
                }
                ins.push(x);
            }
        }
    }
    cx.b.forward(cx.model, cx.inf, node, ins, cx.opts, extras)
}

/// Runs the forward kernel of `node` on the given input values.
pub(super) fn run_kernel(
    model: &Model,
    inf: &Inferred,
    node: &crate::ir::Node,
    ins: Vec<Option<&Tensor>>,
    opts: &StepOptions,
    extras: bool,
) -> Result<Vec<Tensor>> {
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
    Ok(op.forward_cpu(&cx)?)
}

/// The value inference folded for tensor `t`, as a tensor of its type.
pub(super) fn folded_value(inf: &Inferred, t: TensorId) -> Result<Option<Tensor>> {
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
pub(super) struct Recomputed<T> {
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
/// fused kernel does not save stands in with its folded constant value (a constant
/// attention mask); without one the step is refused, naming it.
/// SDPA: the recomputed output and logsumexp must equal the saved ones bitwise
/// (the saved logsumexp is the fused forward's Extra).
pub(super) fn recompute_pattern<B: StepBackend>(
    cx: &Cx<B>,
    p: &FusedPattern,
    v: &Values<B::T>,
) -> Result<Recomputed<B::T>> {
    let gr = &cx.model.graph;
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
            let x = pattern_input(cx, p, v, node, t)?;
            r.vals.insert(t, x);
        }
        rerun_node(cx, p, n, &mut r)?;
    }
    check_recomputed(cx, p, v, &mut r)?;
    Ok(r)
}

/// The value of `t`, an input of pattern `p`'s node `node` made outside the
/// pattern, for its recomputation (see [`recompute_pattern`]).
fn pattern_input<B: StepBackend>(
    cx: &Cx<B>,
    p: &FusedPattern,
    v: &Values<B::T>,
    node: &crate::ir::Node,
    t: TensorId,
) -> Result<B::T> {
    let (b, s, inf) = (cx.b, cx.s, cx.inf);
    let gr = &cx.model.graph;
    let st = s.tensor_storage[t];
    let fixed = st != usize::MAX
        && matches!(
            s.storages[st].kind,
            StorageKind::Parameter
                | StorageKind::Buffer
                | StorageKind::Constant
                | StorageKind::Input
        );
    // A read the backward takes from an autocast copy (GroupNorm's float32
    // input under AMP): the value again in its own type, exactly (the copy
    // widened it).
    if let Some(c) = s.fused_copy(p.last(), t) {
        let held = v.sval[c]
            .as_ref()
            .ok_or_else(|| format!("the saved copy of '{}' is not live", gr.tensor(t).name))?;
        b.cast(held, s.storages[st].dtype)
    } else if p.reads.contains(&t) || fixed || v.params[t].is_some() {
        let x = v
            .of(t)
            .ok_or_else(|| format!("'{}' has no value", gr.tensor(t).name))?;
        b.dup(x)
    } else if let Some(val) = &inf.facts[t].value {
        let f = &inf.facts[t];
        let x = match &val.data {
            crate::ir::value::Data::Float(v) => Tensor::from_f32(
                f.dtype,
                f.shape.clone(),
                v.iter().map(|&x| x as f32).collect(),
            )?,
            crate::ir::value::Data::Int(v) => {
                Tensor::from_i64(f.dtype, f.shape.clone(), v.clone())?
            }
        };
        b.put_apart(stored(s, t, x)?)
    } else {
        Err(format!(
            "'{}', an input of the fused {:?} pattern at '{}', is an activation the \
             fused kernel does not save and has no constant value: the pattern's \
             backward cannot recompute its inner values",
            gr.tensor(t).name,
            p.kind,
            node.name
        )
        .into())
    }
}

/// Runs pattern `p`'s node `n` again on the recomputed values in `r` (inputs read
/// through autocast copies copied again), adding its outputs and extras to `r`.
fn rerun_node<B: StepBackend>(
    cx: &Cx<B>,
    p: &FusedPattern,
    n: NodeIndex,
    r: &mut Recomputed<B::T>,
) -> Result<()> {
    let (b, s) = (cx.b, cx.s);
    let node = cx.model.graph.node(n);
    // Inputs read through autocast copies are copied again.
    let fstep = cx
        .step_of
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
    // Dropout's mask (regenerated from its seed); GroupNorm's statistics, which
    // its InstanceNormalization's backward reads.
    let own_extras = node.op_type == "Dropout"
        || (p.kind == FusedKind::GroupNorm && node.op_type == "InstanceNormalization");
    let mut outs = b.forward(cx.model, cx.inf, node, ins, cx.opts, own_extras)?;
    let ex = outs.split_off(node.outputs.len().min(outs.len()));
    for (o, v) in node.outputs.iter().zip(outs) {
        if let Some(o) = *o {
            r.vals.insert(o, store(b, s, o, v)?);
        }
    }
    r.extras.insert(n, ex);
    Ok(())
}

/// Pattern `p`'s recomputed values against what its fused forward saved, bitwise:
/// SDPA's output and logsumexp, GroupNorm's statistics.
fn check_recomputed<B: StepBackend>(
    cx: &Cx<B>,
    p: &FusedPattern,
    v: &Values<B::T>,
    r: &mut Recomputed<B::T>,
) -> Result<()> {
    let (b, s) = (cx.b, cx.s);
    let gr = &cx.model.graph;
    // Bitwise equality of two values (the recomputed against the saved).
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
    // What the fused forward saved: the last node's extras.
    let saved_extras = || -> Vec<&B::T> {
        s.steps
            .iter()
            .find(|st| st.kind == StepKind::Forward && st.node == Some(p.last()))
            .map(|st| {
                st.writes
                    .iter()
                    .filter(|&&w| s.storages[w].kind == StorageKind::Extra)
                    .filter_map(|&e| v.sval[e].as_ref())
                    .collect()
            })
            .unwrap_or_default()
    };
    if p.kind == FusedKind::Sdpa {
        let last = gr.node(p.last());
        let o = last.outputs[0].ok_or("the attention output is omitted")?;
        if !v.fwd[o].as_ref().is_some_and(|x| same(x, &r.vals[&o])) {
            return Err("the recomputed attention output differs from the saved one".into());
        }
        let lse = r.lse.take().ok_or("no Softmax in the attention")?;
        let saved = saved_extras();
        let saved = saved.first().ok_or("the saved logsumexp is not live")?;
        if !b.get(saved).is_ok_and(|x| same_host(&x, &lse)) {
            return Err("the recomputed logsumexp differs from the saved one".into());
        }
    }
    if p.kind == FusedKind::GroupNorm {
        // The recomputed statistics are the saved ones.
        let norm = p
            .nodes
            .iter()
            .find(|&&n| gr.node(n).op_type == "InstanceNormalization")
            .ok_or("no InstanceNormalization in the group norm")?;
        let made = r.extras.get(norm).map_or(&[][..], Vec::as_slice);
        let saved = saved_extras();
        if saved.len() != 2 || made.len() != 2 || saved.iter().zip(made).any(|(a, c)| !same(a, c)) {
            return Err("the recomputed group norm statistics differ from the saved ones".into());
        }
    }
    Ok(())
}

/// `log Σ exp` along the last axis (the logsumexp flash attention saves per query
/// row), accumulated in f64, as f32.
pub(crate) fn logsumexp_last(x: &Tensor) -> Result<Tensor> {
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
pub(super) fn ensure_value<B: StepBackend>(
    cx: &Cx<B>,
    alloc: &Allocator,
    v: &mut Values<B::T>,
    t: TensorId,
    depth: usize,
) -> Result<()> {
    if v.params[t].is_some() || v.fwd[t].is_some() {
        return Ok(());
    }
    let (b, model, inf, s) = (cx.b, cx.model, cx.inf, cx.s);
    let gr = &model.graph;
    let name = &gr.tensor(t).name;
    let st = s.tensor_storage[t];
    if st == usize::MAX || !alloc.is_live(st) {
        return Err(format!("'{name}' is read but its storage is not live").into());
    }
    let p = gr
        .tensor(t)
        .producer
        .ok_or_else(|| format!("'{name}' has no value"))?;
    let step = &s.steps[cx.step_of[&p]];
    // A view: its step does not write its storage (it may write others, e.g. the
    // unused mask of an identity Dropout).
    if step.writes.contains(&st) || depth > gr.order.len() {
        return Err(format!("'{name}' was lost though its storage is live").into());
    }
    let node = gr.node(p);
    let src = node.inputs.first().copied().flatten();
    // A view that keeps every element in place (reshape, flatten, squeeze,
    // unsqueeze, identity, an identity Dropout's output) is its source reshaped to
    // the inferred shape: its other inputs (shape tensors, perhaps freed since) are
    // not needed.
    if let (Some(src), Some(&Some(o0))) = (src, node.outputs.first()) {
        let (op, rcx) = rule_cx(model, inf, node)?;
        let keeps_order = matches!(
            op.storage(&rcx),
            crate::ops::Storage::View | crate::ops::Storage::Reshape
        );
        if o0 == t && keeps_order && inf.facts[src].numel() == inf.facts[t].numel() {
            ensure_value(cx, alloc, v, src, depth + 1)?;
            let x = b.reshaped(v.of(src).expect("ensured"), inf.facts[t].shape.clone())?;
            v.fwd[t] = Some(x);
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
            Some(val) if v.params[i].is_none() && v.fwd[i].is_none() => {
                let f = &inf.facts[i];
                v.fwd[i] = Some(b.put_apart(Tensor::from_i64(
                    f.dtype,
                    f.shape.clone(),
                    val.to_ints(),
                )?)?);
                borrowed.push(i);
            }
            _ => ensure_value(cx, alloc, v, i, depth + 1)?,
        }
    }
    let outs = forward_kernel(cx, node, v, false);
    for i in borrowed {
        v.fwd[i] = None;
    }
    let outs = outs?;
    // Only the views: outputs the step writes have their own storage, made (and
    // counted) only by the step itself.
    for (o, x) in node.outputs.iter().zip(outs) {
        if let Some(o) = *o {
            if !step.writes.contains(&s.tensor_storage[o]) {
                v.fwd[o] = Some(b.set_apart(store(b, s, o, x)?));
            }
        }
    }
    Ok(())
}

/// A fake quantization's scale and zero point: the values the step holds (a
/// buffer's), else the folded ones (the exporter's casts and constants, which run
/// no kernel).
fn fake_quant_params<B: StepBackend>(
    cx: &Cx<B>,
    f: &FakeQuant,
    v: &Values<B::T>,
) -> Result<FakeQuantParams> {
    let (b, model, inf) = (cx.b, cx.model, cx.inf);
    let held = |t: TensorId| -> Result<Option<Tensor>> { v.of(t).map(|x| b.get(x)).transpose() };
    let folded = |t: TensorId| {
        inf.facts[t].value.as_ref().ok_or_else(|| {
            format!(
                "the fake quantization's scale or zero point '{}' has no value",
                model.graph.tensor(t).name
            )
        })
    };
    let scale: Vec<f32> = match held(f.scale)? {
        Some(v) => v.to_f64s().into_iter().map(|x| x as f32).collect(),
        None => {
            let v = folded(f.scale)?;
            (0..v.data.len()).map(|i| v.data.float(i) as f32).collect()
        }
    };
    let zero_point = match f.zero_point {
        None => vec![0; scale.len()],
        Some(z) => match held(z)? {
            Some(v) => v.to_i64s(),
            None => {
                let v = folded(z)?;
                (0..v.data.len()).map(|i| v.data.int(i)).collect()
            }
        },
    };
    Ok(FakeQuantParams {
        scale,
        zero_point,
        axis: f.axis,
        qmin: f.qmin,
        qmax: f.qmax,
    })
}

/// Forward step `i` of a fake quantization's node playing `role`
/// ([`crate::train::FakeQuant`]): the QuantizeLinear writes the mask (when its
/// backward runs), the DequantizeLinear the fake-quantized output, both computed on
/// the host from the float input `x`; the Clip and the qparam nodes do nothing (the
/// integer values are views of `x` and hold no value here).
pub(super) fn fake_quant_forward<B: StepBackend>(
    cx: &Cx<B>,
    f: &FakeQuant,
    role: FakeQuantRole,
    i: usize,
    alloc: &Allocator,
    v: &mut Values<B::T>,
) -> Result<()> {
    let (b, model, inf, s) = (cx.b, cx.model, cx.inf, cx.s);
    let step = &s.steps[i];
    let node = model
        .graph
        .node(step.node.ok_or("a forward step without a node")?);
    let extras = extra_writes(s, step);
    let makes = match role {
        FakeQuantRole::QParam | FakeQuantRole::Clip => false,
        FakeQuantRole::Quantize => !extras.is_empty(),
        FakeQuantRole::Dequantize => true,
    };
    if !makes {
        return Ok(());
    }
    ensure_value(cx, alloc, v, f.x, 0)?;
    let x = v
        .of(f.x)
        .ok_or("the fake quantization's input has no value")?;
    // Computed in f32, as every kernel (a half-precision value widened).
    let x = b.get(x)?;
    let x = if x.dtype() == DType::F32 {
        x
    } else {
        x.cast(DType::F32)?
    };
    let p = fake_quant_params(cx, f, v)?;
    let bytes_of = |st: StorageId, v: &B::T| -> Result<()> {
        let have = B::dtype(v).bytes_for(B::numel(v) as u64);
        if have != Some(s.storages[st].bytes) {
            return Err(format!(
                "writes {} bytes into '{}' of {}",
                have.unwrap_or(u64::MAX),
                s.storages[st].name,
                s.storages[st].bytes
            )
            .into());
        }
        Ok(())
    };
    if role == FakeQuantRole::Quantize {
        let [m] = extras[..] else {
            return Err(format!("{} extras for a fake quantization's mask", extras.len()).into());
        };
        let (_, mask) = crate::ops::quantize::fake_quantize(&x, &p, true)?;
        let mask = b.put(mask.ok_or("no mask")?)?;
        bytes_of(m, &mask)?;
        v.sval[m] = Some(b.hold(mask));
        return Ok(());
    }
    let y = node
        .outputs
        .first()
        .copied()
        .flatten()
        .ok_or("the fake quantization's output is omitted")?;
    let st = s.tensor_storage[y];
    if !step.writes.contains(&st) {
        return Err("the fake quantization's output is not the step's own storage".into());
    }
    let (q, _) = crate::ops::quantize::fake_quantize(&x, &p, false)?;
    let f = &inf.facts[y];
    if q.dtype() != f.dtype || q.shape != f.shape {
        return Err(format!(
            "the fake quantization gives {} {:?}, inference says {} {:?}",
            q.dtype(),
            q.shape,
            f.dtype,
            f.shape
        )
        .into());
    }
    let q = store(b, s, y, b.put_output(q)?)?;
    bytes_of(st, &q)?;
    v.fwd[y] = Some(b.hold(q));
    Ok(())
}

/// Runs backward step `i` (of a forward node): the op's backward kernel, given only
/// the saved tensors its rule lists, then each wanted gradient stored as the schedule
/// says (a new storage, a view of the incoming gradient, or a partial added into the
/// existing gradient). A fused pattern's node reads its pattern's recomputed values
/// `rec` instead.
pub(super) fn backward_step<B: StepBackend>(
    cx: &Cx<B>,
    i: usize,
    v: &mut Values<B::T>,
    rec: Option<&Recomputed<B::T>>,
) -> Result<Vec<(StorageId, B::T)>> {
    let (b, model, inf, s) = (cx.b, cx.model, cx.inf, cx.s);
    let step = &s.steps[i];
    let ix = step.node.expect("backward of a node");
    let node = model.graph.node(ix);
    let (bw, fq_role) = backward_rule(cx, ix)?;
    // The fake quantization's Clip and DequantizeLinear: the gradient of the integer
    // view is the incoming one.
    if matches!(
        fq_role,
        Some(FakeQuantRole::Clip | FakeQuantRole::Dequantize)
    ) {
        integer_view_grad(cx, node, v)?;
        return Ok(Vec::new());
    }
    let wanted = step.grad_inputs.clone();
    let mut needs: Vec<Saved> = Vec::new();
    for g in bw.grads.iter().filter(|g| wanted.contains(&g.input)) {
        for &sv in &g.needs {
            if !needs.contains(&sv) {
                needs.push(sv);
            }
        }
    }
    let saved = saved_values(cx, ix, &needs, v, rec)?;
    let incoming: Vec<Option<StorageId>> = node
        .outputs
        .iter()
        .map(|t| t.and_then(|t| v.gstore[t]))
        .collect();
    // A whole-tensor view's gradient is the incoming gradient under the input's
    // shape where the backend aliases (its storage is the incoming one).
    if b.aliases_views() && rec.is_none() && wanted == [0] {
        if let Some((t, o, st)) = view_grad(cx, step, &incoming, v)? {
            let g = v.gval[o].as_ref().ok_or("no incoming gradient")?;
            let d = b.reshaped(g, inf.facts[t].shape.clone())?;
            v.gstore[t] = Some(st);
            v.gval[t] = Some(d);
            return Ok(Vec::new());
        }
    }
    let grads: Vec<Option<&B::T>> = node
        .outputs
        .iter()
        .map(|t| t.and_then(|t| v.gval[t].as_ref()))
        .collect();
    let mut dx = if fq_role == Some(FakeQuantRole::Quantize) {
        straight_through(b, node, &grads, &saved)?
    } else {
        b.backward(model, inf, node, saved, grads, wanted.clone(), cx.opts)?
    };
    let mut partials = Vec::new();
    for &slot in &wanted {
        let t = node.inputs[slot].ok_or("wanted gradient of an omitted input")?;
        let d = dx
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or_else(|| format!("no gradient for input {slot}"))?;
        match v.gstore[t] {
            None => first_grad(cx, step, v, t, d, &incoming)?,
            Some(existing) => partials.push(add_grad(cx, step, v, t, d, existing)?),
        }
    }
    Ok(partials)
}

/// Node `ix`'s backward rule, and its role when it is a fake quantization's node
/// (its pattern's rule then).
fn backward_rule<B: StepBackend>(
    cx: &Cx<B>,
    ix: NodeIndex,
) -> Result<(crate::ops::Backward, Option<FakeQuantRole>)> {
    let node = cx.model.graph.node(ix);
    let (op, rcx) = rule_cx(cx.model, cx.inf, node)?;
    let outs: Vec<crate::ops::Fact> = node
        .outputs
        .iter()
        .map(|t| match t {
            Some(t) => cx.inf.facts[*t].clone(),
            None => crate::ops::Fact::new(DType::F32, vec![]),
        })
        .collect();
    // A fake quantization's node: its pattern's rule.
    let fq = cx.s.fused.iter().find_map(|p| {
        let f = p.fake_quant.as_ref()?;
        let role = f.role(ix)?;
        Some((f.rule(role, p.extras.first()?), role))
    });
    let bw = match fq.clone().and_then(|(bw, _)| bw) {
        Some(bw) => bw,
        None => op.backward(&rcx, &outs)?.ok_or("no backward rule")?,
    };
    Ok((bw, fq.map(|(_, role)| role)))
}

/// A fake quantization's Clip or DequantizeLinear `node`: the gradient of its
/// integer input is the incoming gradient (a view).
fn integer_view_grad<B: StepBackend>(
    cx: &Cx<B>,
    node: &crate::ir::Node,
    v: &mut Values<B::T>,
) -> Result<()> {
    let t = node.inputs.first().copied().flatten().ok_or("no input 0")?;
    let o = node
        .outputs
        .first()
        .copied()
        .flatten()
        .ok_or("no output 0")?;
    let (Some(st), Some(g)) = (v.gstore[o], v.gval[o].as_ref()) else {
        return Err("no incoming gradient".into());
    };
    if v.gstore[t].is_some() {
        return Err("a fake quantization's integer view has a gradient already".into());
    }
    let d = cx.b.reshaped(g, cx.inf.facts[t].shape.clone())?;
    v.gval[t] = Some(d);
    v.gstore[t] = Some(st);
    Ok(())
}

/// The tensors node `ix`'s backward kernel `needs`, as its forward saved them: an
/// input read through an autocast copy is the copy; a fused pattern's node reads
/// its pattern's recomputed values `rec`.
fn saved_values<'v, B: StepBackend>(
    cx: &Cx<B>,
    ix: NodeIndex,
    needs: &[Saved],
    v: &'v Values<B::T>,
    rec: Option<&'v Recomputed<B::T>>,
) -> Result<Vec<(Saved, &'v B::T)>> {
    let s = cx.s;
    let node = cx.model.graph.node(ix);
    // The forward step of this node: its extras, in order.
    let fstep = s
        .steps
        .iter()
        .find(|st| st.kind == StepKind::Forward && st.node == Some(ix))
        .ok_or("no forward step")?;
    let extras = extra_writes(s, fstep);
    let value = |t: TensorId| match rec {
        Some(r) => r.vals.get(&t),
        None => v.of(t),
    };
    let mut saved = Vec::with_capacity(needs.len());
    for &sv in needs {
        let x = match sv {
            // An input read through an autocast copy: the copy.
            Saved::Input(k) if rec.is_none() => match fstep.slots.get(k) {
                Some(&Some(c)) if is_copy(s.storages[c].kind) => v.sval[c].as_ref(),
                _ => node.inputs.get(k).copied().flatten().and_then(value),
            },
            Saved::Input(k) => node.inputs.get(k).copied().flatten().and_then(value),
            Saved::Output(k) => node.outputs.get(k).copied().flatten().and_then(value),
            Saved::Extra(k) => match rec {
                Some(r) => r.extras.get(&ix).and_then(|e| e.get(k)),
                None => extras.get(k).and_then(|&e| v.sval[e].as_ref()),
            },
        };
        saved.push((sv, x.ok_or_else(|| format!("saved {sv:?} is not live"))?));
    }
    Ok(saved)
}

/// When backward `step`'s node is a whole-tensor view whose only wanted gradient
/// (input 0's, `t`) can be the incoming gradient of its output `o` under the
/// input's shape, in its storage `st`: `(t, o, st)`. Not a parameter's with a
/// resident gradient: that one goes into its `.grad`.
fn view_grad<B: StepBackend>(
    cx: &Cx<B>,
    step: &crate::train::Step,
    incoming: &[Option<StorageId>],
    v: &Values<B::T>,
) -> Result<Option<(TensorId, TensorId, StorageId)>> {
    let s = cx.s;
    let gr = &cx.model.graph;
    let node = gr.node(step.node.expect("backward of a node"));
    let t = node.inputs[0].ok_or("wanted gradient of an omitted input")?;
    let own = format!("{}/grad", gr.tensor(t).name);
    let writes_own =
        step.writes.iter().any(|&w| s.storages[w].name == own) || resident_grad(s, &own).is_some();
    let o = node.outputs.first().copied().flatten();
    if let (Some(o), Some(Some(st)), None, false) = (o, incoming.first(), v.gstore[t], writes_own) {
        if whole_view(cx.model, cx.inf, s, node)? == Some(o) && !s.storages[*st].persistent {
            return Ok(Some((t, o, *st)));
        }
    }
    Ok(None)
}

/// A fake quantization's QuantizeLinear: the straight-through gradient, on the
/// host: the incoming gradient masked (input 0's; no other).
fn straight_through<B: StepBackend>(
    b: &B,
    node: &crate::ir::Node,
    grads: &[Option<&B::T>],
    saved: &[(Saved, &B::T)],
) -> Result<Vec<Option<B::T>>> {
    let g = grads
        .first()
        .copied()
        .flatten()
        .ok_or("no incoming gradient")?;
    let mask = saved
        .iter()
        .find(|(sv, _)| *sv == Saved::Extra(0))
        .map(|(_, m)| *m)
        .ok_or("the fake quantization's mask is not saved")?;
    let d = crate::ops::quantize::fake_quantize_backward(&b.get(g)?, &b.get(mask)?, DType::F32)?;
    let mut d = Some(b.put_output(d)?);
    Ok((0..node.inputs.len())
        .map(|k| if k == 0 { d.take() } else { None })
        .collect())
}

/// Checks that gradient `d` of `name` has the bytes of storage `st`.
fn grad_bytes<B: StepBackend>(s: &Schedule, name: &str, st: StorageId, d: &B::T) -> Result<()> {
    let have = B::dtype(d)
        .bytes_for(B::numel(d) as u64)
        .unwrap_or(u64::MAX);
    if have != s.storages[st].bytes {
        return Err(format!(
            "gradient of '{name}' is {have} bytes, '{}' has {}",
            s.storages[st].name, s.storages[st].bytes
        )
        .into());
    }
    Ok(())
}

/// Tensor `t`'s first gradient `d`, stored as backward `step` says: in its own
/// storage (written into it when resident), or a view of the `incoming` gradient.
fn first_grad<B: StepBackend>(
    cx: &Cx<B>,
    step: &crate::train::Step,
    v: &mut Values<B::T>,
    t: TensorId,
    d: B::T,
    incoming: &[Option<StorageId>],
) -> Result<()> {
    let (b, s) = (cx.b, cx.s);
    let name = &cx.model.graph.tensor(t).name;
    let own = format!("{name}/grad");
    // Resident gradients (persistent `.grad`, zero before the step) are
    // not written by the step: the first gradient goes into them.
    let st = match step
        .writes
        .iter()
        .copied()
        .find(|&w| s.storages[w].name == own)
        .or_else(|| resident_grad(s, &own))
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
    if s.storages[st].persistent {
        // Written into the resident storage, which keeps its place (the
        // step's zeroed `.grad`, allocated before the first instruction).
        grad_bytes::<B>(s, name, st, &d)?;
        let mut grad = v.sval[st]
            .take()
            .ok_or_else(|| format!("'{}' has no storage", s.storages[st].name))?;
        b.write_into(&mut grad, d)?;
        d = grad;
    } else if step.writes.contains(&st) {
        grad_bytes::<B>(s, name, st, &d)?;
        d = b.hold(d);
    } else {
        // A view the kernel copied.
        d = b.set_apart(d);
    }
    v.gstore[t] = Some(st);
    v.gval[t] = Some(d);
    Ok(())
}

/// A further gradient `d` of tensor `t`, whose gradient so far is in storage
/// `existing`: added in place, or (where that gradient is a view autograd cannot
/// add into) summed into the step's own `.grad` storage. Returns the partial and
/// its storage.
fn add_grad<B: StepBackend>(
    cx: &Cx<B>,
    step: &crate::train::Step,
    v: &mut Values<B::T>,
    t: TensorId,
    d: B::T,
    existing: StorageId,
) -> Result<(StorageId, B::T)> {
    let (b, s) = (cx.b, cx.s);
    let name = &cx.model.graph.tensor(t).name;
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
        grad_bytes::<B>(s, name, *w, &d)?;
        let old = v.gval[t].as_ref().ok_or("accumulated gradient lost")?;
        let mut total = b.get(old)?;
        Cpu.accumulate(&mut total, &b.get(&d)?)?;
        let total = b.hold(b.put(total)?);
        grad_bytes::<B>(s, name, sum, &total)?;
        v.gstore[t] = Some(sum);
        v.gval[t] = Some(total);
        return Ok((*w, d));
    }
    if !step.updates.contains(&existing) {
        return Err(format!("'{name}' accumulated but not updated").into());
    }
    let acc = v.gval[t].as_mut().ok_or("accumulated gradient lost")?;
    let dt = s.storages[existing].dtype;
    // The partial, in the gradient's type, added in f32 and rounded back.
    let d = b.hold(cast_to(b, d, dt)?);
    grad_bytes::<B>(s, name, *w, &d)?;
    b.accumulate(acc, &d)?;
    Ok((*w, d))
}

/// The resident (persistent) `.grad` storage named `own`, if the schedule keeps
/// gradients resident.
pub(super) fn resident_grad(s: &Schedule, own: &str) -> Option<StorageId> {
    s.storages
        .iter()
        .position(|st| st.kind == StorageKind::ParamGrad && st.persistent && st.name == own)
}

/// A storage an input slot is read through: an autocast copy or a contiguous copy.
pub(super) fn is_copy(kind: StorageKind) -> bool {
    matches!(kind, StorageKind::Cast | StorageKind::Copy)
}

/// `v` in `dt` (itself when it is already).
pub(super) fn cast_to<B: StepBackend>(b: &B, v: B::T, dt: DType) -> Result<B::T> {
    if B::dtype(&v) == dt {
        Ok(v)
    } else {
        b.cast(&v, dt)
    }
}
