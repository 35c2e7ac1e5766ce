//! Phase 6: the forward steps. Per node: its inputs as it reads them (dequantized,
//! autocast, or copied contiguous the way PyTorch's kernel saves them), its
//! outputs' types and storages (a view aliases its input's storage), and the extra
//! tensors its backward will read.

use super::super::fusion::FakeQuantRole;
use super::super::policy::upcast_softmax_source;
use super::super::schedule::{Step, StepKind, StorageId, StorageKind};
use super::rules::NodeRule;
use super::{Builder, CastKey};
use crate::ir::{DType, Node, TensorId};
use crate::ops::{self, layout, Autocast, Fact};
use petgraph::stable_graph::NodeIndex;
use std::borrow::Cow;

/// What a step reads and writes, and the storage each input slot is read from.
#[derive(Default)]
struct Io {
    reads: Vec<StorageId>,
    writes: Vec<StorageId>,
    slots: Vec<Option<StorageId>>,
}

/// The node a forward step runs, and its inputs' strides as it reads them (an
/// autocast copy is contiguous).
struct At<'n, 'a> {
    ix: NodeIndex,
    node: &'n Node,
    rule: &'n NodeRule<'a>,
    in_strides: Vec<Option<Vec<usize>>>,
}

impl At<'_, '_> {
    fn own(&self) -> Vec<Option<&[usize]>> {
        self.in_strides.iter().map(|s| s.as_deref()).collect()
    }
}

impl Builder<'_, '_> {
    /// The forward steps, in execution order; then a module call holds its
    /// arguments until it returns.
    pub(super) fn forward(&mut self) {
        let model = self.model;
        for (step, &ix) in model.graph.order.iter().enumerate() {
            self.forward_step(step, ix);
        }
        let persistent: Vec<bool> = self.storages.iter().map(|s| s.persistent).collect();
        super::super::module_args::hold_module_arguments(&mut self.steps, &persistent);
    }

    fn forward_step(&mut self, step: usize, ix: NodeIndex) {
        let (model, an) = (self.model, self.an);
        let node = model.graph.node(ix);
        let rule = &an.rules.nodes[step];
        let class = rule.op.autocast(&node.op_type);
        let mut io = self.read_inputs(node, self.opts.precision.input_dtype(class));
        // `softmax(x, dtype=float32)` on a half `x` converts `x` inside the op, which
        // lowering writes `Softmax(Cast(x))`: `x` lives through the softmax.
        if let Some(s) = upcast_softmax_source(model, self.inf, node).and_then(|x| self.tstore[x]) {
            io.reads.push(s);
        }
        let in_strides = node
            .inputs
            .iter()
            .zip(&io.slots)
            .map(|(t, s)| match (*t, *s) {
                (Some(t), Some(s)) if self.tstore[t] == Some(s) => self.strides[t].clone(),
                (Some(t), Some(_)) => Some(layout::contiguous(&self.inf.facts[t].shape)),
                _ => None,
            })
            .collect();
        let at = At {
            ix,
            node,
            rule,
            in_strides,
        };
        if !an.rules.fusions.contains_key(&ix) {
            self.saved_copies(&at, &mut io);
        }
        self.type_outputs(&at, class, &io.slots);
        self.output_storages(&at, &mut io);
        let extras = self.extras(&at, &mut io);
        let slots = io.slots.clone();
        self.steps.push(Step {
            node: Some(ix),
            slots,
            fused: an.rules.fusions.contains_key(&ix),
            ..Step::new(
                node.name.as_str(),
                node.op_type.as_str(),
                StepKind::Forward,
                io.reads,
                io.writes,
                self.inf.flops[step],
            )
        });
        self.read_as.push(io.slots);
        self.extras_of.push(extras);
    }

    /// The node's inputs as it reads them: a quantized frozen weight dequantized
    /// for this op only (the op and its backward keep the quantized weight), a
    /// float input autocast to `target`.
    fn read_inputs(&mut self, node: &Node, target: Option<DType>) -> Io {
        let (g, q) = (&self.model.graph, &self.an.params.quant);
        let mut io = Io::default();
        for t in &node.inputs {
            let Some(t) = *t else {
                io.slots.push(None);
                continue;
            };
            let src = self.tstore[t].expect("inputs are stored before use");
            let cur = self.dtype_of(t);
            let views_it = node
                .outputs
                .first()
                .copied()
                .flatten()
                .is_some_and(|o| q.weight_of_view[o] == Some(t));
            if q.quantized[t] && !views_it {
                let dt = target.unwrap_or(cur);
                let c = self.new_storage(
                    &format!("{}@dequant", g.tensor(t).name),
                    &self.inf.facts[t],
                    dt,
                    StorageKind::Cast,
                );
                io.reads.extend([src, c]);
                io.writes.push(c);
                io.slots.push(Some(src));
                continue;
            }
            let s = match target {
                Some(want) if self.is_float(t) && cur != want => {
                    self.autocast_copy(t, src, want, &mut io)
                }
                _ => src,
            };
            io.reads.push(s);
            io.slots.push(Some(s));
        }
        io
    }

    /// The autocast copy of `t` (stored in `src`) in `want`. Autocast caches the
    /// cast of a leaf that requires grad (`cached_cast` in autocast_mode.cpp): a
    /// trainable parameter, or a view of one. A frozen one is cast again at every
    /// use.
    fn autocast_copy(
        &mut self,
        t: TensorId,
        src: StorageId,
        want: DType,
        io: &mut Io,
    ) -> StorageId {
        let key: Option<CastKey> = self.trainable_storage.contains(&src).then(|| {
            (
                src,
                self.inf.facts[t].shape.clone(),
                self.strides[t].clone(),
            )
        });
        if let Some(&c) = key.as_ref().and_then(|k| self.weight_cast.get(k)) {
            return c;
        }
        let c = self.new_storage(
            &format!("{}@{}", self.model.graph.tensor(t).name, want),
            &self.inf.facts[t],
            want,
            StorageKind::Cast,
        );
        io.reads.push(src);
        io.writes.push(c);
        if let Some(k) = key {
            self.weight_cast.insert(k, c);
        }
        c
    }

    /// Operands PyTorch's kernel copies to contiguous memory before saving them
    /// (torch.matmul's reshape of a strided operand): the copy is written here and
    /// read in the input's place, by this step and by backward.
    fn saved_copies(&mut self, at: &At, io: &mut Io) {
        let node = at.node;
        let req: Vec<bool> = node
            .inputs
            .iter()
            .map(|t| t.is_some_and(|t| self.an.flow.requires[t]))
            .collect();
        for (k, shape) in at.rule.op.saved_copies(&at.rule.cx, &at.own(), &req) {
            let (Some(t), Some(src)) = (node.inputs[k], io.slots[k]) else {
                continue;
            };
            // An autocast copy is contiguous, so what remains is a broadcast
            // operand's expansion, which the kernel makes of the half copy
            // (Falcon's shared key under AMP: the expanded half copy is saved).
            if self.tstore[t] != Some(src) && self.storages[src].kind != StorageKind::Cast {
                continue;
            }
            let dt = self.storages[src].dtype;
            let c = self.new_storage(
                &format!("{}@copy", self.model.graph.tensor(t).name),
                &Fact::new(dt, shape),
                dt,
                StorageKind::Copy,
            );
            io.writes.push(c);
            io.reads.push(c);
            io.slots[k] = Some(c);
        }
    }

    /// Output dtypes: the widest of the float inputs autocast's type rules count
    /// ([`super::super::policy::Origins::promoting`]); a fake quantization's output
    /// is of its float input's type (read through the integer view); a cast back to
    /// a norm's input type takes that type.
    fn type_outputs(&mut self, at: &At, class: Autocast, slots: &[Option<StorageId>]) {
        let (inf, node) = (self.inf, at.node);
        let floats: Vec<(usize, TensorId)> = node
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(k, t)| {
                t.filter(|&t| slots[k].is_some() && self.is_float(t))
                    .map(|t| (k, t))
            })
            .collect();
        let widest = self
            .an
            .origins
            .promoting(self.model, inf, node, floats)
            .into_iter()
            .filter_map(|k| slots[k].map(|s| self.storages[s].dtype))
            .max_by_key(|d| d.bits());
        let widest = match self.fq_role(at.ix) {
            Some(FakeQuantRole::Dequantize) => slots
                .first()
                .copied()
                .flatten()
                .map(|s| self.storages[s].dtype),
            _ => widest,
        };
        let back = self
            .an
            .rules
            .cast_back
            .get(&at.ix)
            .map(|&x0| self.dtype_of(x0));
        let prec = self.opts.precision;
        for &t in node.outputs.iter().flatten() {
            if self.is_float(t) {
                self.float_dtype[t] = Some(back.unwrap_or_else(|| match self.an.as_written {
                    true => inf.facts[t].dtype,
                    false => prec.output_dtype(class, widest, inf.facts[t].dtype),
                }));
            }
        }
    }

    /// Each output's storage: a view of its input's (a view op, a reshape that can
    /// be a view, a fake quantization's integer values) or a new one; its strides.
    fn output_storages(&mut self, at: &At, io: &mut Io) {
        let (g, an) = (&self.model.graph, self.an);
        let node = at.node;
        // A fake quantization's integer values (and its qparam casts) are views of
        // their input, whatever the dtypes: no 8-bit tensor exists in PyTorch.
        let fq_alias = an.rules.fq.get(&at.ix).is_some_and(|&(k, role)| {
            an.rules.fused[k]
                .fake_quant
                .as_ref()
                .is_some_and(|f| f.aliases(role, &node.op_type))
        });
        for (k, t) in node.outputs.iter().enumerate() {
            let Some(t) = *t else { continue };
            let alias = match self.view_source(at, k, t, &io.slots) {
                _ if fq_alias && k == 0 && io.slots.first().copied().flatten().is_some() => {
                    Some((io.slots[0].expect("read"), at.in_strides[0].clone()))
                }
                alias => alias,
            };
            let kind = if node.op_type == "Constant" {
                StorageKind::Constant
            } else {
                StorageKind::Activation
            };
            let s = match alias {
                Some((s, st)) if kind == StorageKind::Activation => {
                    self.strides[t] = st;
                    s
                }
                _ => self.new_output(at, k, t, kind, io),
            };
            if g.outputs.contains(&t) {
                self.storages[s].held = true;
            }
            let facts = &self.inf.facts;
            let layout = an
                .rules
                .fusions
                .get(&at.ix)
                .and_then(|f| match &f.out_layout_f32 {
                    _ if f.follows_contiguous_query(&self.strides, self.inf) => None,
                    Some(l) if self.storages[s].dtype == DType::F32 => Some(l),
                    _ => f.out_layout.as_ref(),
                });
            if let Some(l) = layout {
                if k == 0 && l.len() == facts[t].rank() {
                    self.strides[t] = Some(layout::permuted(&facts[t].shape, l));
                }
            }
            self.tstore[t] = Some(s);
        }
    }

    /// The storage output `k` (tensor `t`) views, with its strides there: the
    /// first input's, where the op's storage rule makes a view of it and the types
    /// agree (a reshape that cannot be a view copies).
    fn view_source(
        &self,
        at: &At,
        k: usize,
        t: TensorId,
        slots: &[Option<StorageId>],
    ) -> Option<(StorageId, Option<Vec<usize>>)> {
        let in0 = at.node.inputs.first().copied().flatten();
        let view_of = in0.filter(|&i| slots[0].is_some() && self.dtype_of(i) == self.dtype_of(t));
        match (at.rule.storage, view_of) {
            (ops::Storage::New, _) | (_, None) => None,
            (kind, Some(i)) => {
                let st = self.strides[i].as_ref().and_then(|st| {
                    at.rule
                        .op
                        .view_strides(&at.rule.cx, k, &self.inf.facts[t], st)
                });
                match (kind, st) {
                    // A reshape that is no view copies.
                    (ops::Storage::Reshape, None) => None,
                    (_, st) => Some((slots[0].expect("read"), st)),
                }
            }
        }
    }

    /// A new storage for output `k` (tensor `t`), written by the step unless a
    /// constant; its strides as the step writes it (under autocast, in its half
    /// type).
    fn new_output(
        &mut self,
        at: &At,
        k: usize,
        t: TensorId,
        kind: StorageKind,
        io: &mut Io,
    ) -> StorageId {
        let inf = self.inf;
        let dt = self.dtype_of(t);
        let s = self.new_storage(&self.model.graph.tensor(t).name, &inf.facts[t], dt, kind);
        let out = if dt == inf.facts[t].dtype {
            Cow::Borrowed(&inf.facts[t])
        } else {
            Cow::Owned(Fact::new(dt, inf.facts[t].shape.clone()))
        };
        self.strides[t] = Some(at.rule.op.out_strides(&at.rule.cx, k, &out, &at.own()));
        if kind == StorageKind::Constant {
            self.storages[s].persistent = true;
            // A fake quantization's constant (a Python scalar scale or zero point,
            // the Clip's bound): a number on the host in PyTorch, no tensor.
            if self.fq_role(at.ix) == Some(FakeQuantRole::QParam) {
                self.storages[s].bytes = 0;
            }
        } else {
            io.writes.push(s);
        }
        s
    }

    /// The extra tensors the node's backward reads (a fused kernel's own), made
    /// when its backward will run.
    fn extras(&mut self, at: &At, io: &mut Io) -> Vec<StorageId> {
        let (node, an) = (at.node, self.an);
        let mut extras = Vec::new();
        let Ok(Some(bw)) = &at.rule.backward else {
            return extras;
        };
        if !node.outputs.iter().flatten().any(|&t| an.flow.has_grad[t]) {
            return extras;
        }
        let made = match an.rules.fusions.get(&at.ix) {
            Some(f) => &f.extras,
            None => &bw.extras,
        };
        for (k, f) in made.iter().enumerate() {
            let s = self.new_storage(
                &format!("{}/saved{k}", node.name),
                f,
                f.dtype,
                StorageKind::Extra,
            );
            io.writes.push(s);
            extras.push(s);
        }
        extras
    }
}
