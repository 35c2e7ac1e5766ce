//! Phase 8: the backward steps, in reverse execution order: each reads the
//! incoming gradients and the tensors its rule saved (a fused kernel's own), and
//! writes its inputs' gradients (a view of the incoming one through view ops) or
//! adds into them. Then the branches that require grad but that the loss does not
//! depend on keep what they saved.

use super::super::fusion::FakeQuantRole;
use super::super::schedule::{Step, StepKind, StorageId, StorageKind};
use super::rules::NodeRule;
use super::{required_share, Builder};
use crate::ir::{DType, Node, TensorId, TensorKind};
use crate::ops::{self, Backward, Fact, Grad, Saved};
use petgraph::stable_graph::NodeIndex;
use std::collections::HashMap;

/// What a backward step reads, writes and adds into.
struct Io {
    reads: Vec<StorageId>,
    writes: Vec<StorageId>,
    updates: Vec<StorageId>,
}

impl Io {
    fn read(&mut self, s: StorageId) {
        if !self.reads.contains(&s) {
            self.reads.push(s);
        }
    }
}

/// The node a backward step differentiates.
struct At<'n, 'a> {
    step: usize,
    ix: NodeIndex,
    node: &'n Node,
    rule: &'n NodeRule<'a>,
    /// The gradients of its outputs.
    out_grads: Vec<StorageId>,
}

impl Builder<'_, '_> {
    pub(super) fn backward(&mut self) {
        self.fp32_reads = self.fused_float32_reads();
        let model = self.model;
        for (step, &ix) in model.graph.order.iter().enumerate().rev() {
            self.backward_step(step, ix);
        }
    }

    /// The storage a backward rule's saved tensor refers to, for the node at `step`.
    fn saved_storage(&self, step: usize, sv: Saved) -> Option<StorageId> {
        let g = &self.model.graph;
        match sv {
            Saved::Input(i) => self.read_as[step].get(i).copied().flatten(),
            Saved::Output(i) => g
                .node(g.order[step])
                .outputs
                .get(i)
                .copied()
                .flatten()
                .and_then(|o| self.tstore[o]),
            Saved::Extra(i) => self.extras_of[step].get(i).copied(),
        }
    }

    /// A fused kernel on autocast's float32 list reads its input as the float32
    /// copy that one of its nodes made of it (or of a view of it), when one did.
    fn fused_float32_reads(&self) -> HashMap<(NodeIndex, TensorId), StorageId> {
        let g = &self.model.graph;
        let step_of: HashMap<NodeIndex, usize> =
            g.order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut out = HashMap::new();
        for p in self
            .an
            .rules
            .fused
            .iter()
            .filter(|p| p.kind.saves_float32_copy())
        {
            for &x in &p.reads {
                let Some(base) = self.tstore[x] else { continue };
                let copy = p.nodes.iter().find_map(|n| {
                    g.node(*n)
                        .inputs
                        .iter()
                        .zip(&self.read_as[step_of[n]])
                        .find_map(|(t, s)| match (t, s) {
                            (Some(t), Some(s))
                                if self.tstore[*t] == Some(base)
                                    && self.storages[*s].kind == StorageKind::Cast
                                    && self.storages[*s].dtype == DType::F32 =>
                            {
                                Some(*s)
                            }
                            _ => None,
                        })
                });
                if let Some(c) = copy {
                    out.insert((p.last(), x), c);
                }
            }
        }
        out
    }

    fn backward_step(&mut self, step: usize, ix: NodeIndex) {
        let (model, an) = (self.model, self.an);
        let node = model.graph.node(ix);
        let out_grads: Vec<StorageId> = node
            .outputs
            .iter()
            .flatten()
            .filter(|&&t| an.flow.has_grad[t])
            .filter_map(|&t| self.grad[t])
            .collect();
        if out_grads.is_empty() {
            return;
        }
        let rule = &an.rules.nodes[step];
        let Ok(Some(bw)) = &rule.backward else {
            return;
        };
        let mut io = Io {
            reads: out_grads.clone(),
            writes: Vec::new(),
            updates: Vec::new(),
        };
        let at = At {
            step,
            ix,
            node,
            rule,
            out_grads,
        };
        let mut grad_inputs = Vec::new();
        for gr in &bw.grads {
            let Some(Some(t)) = node.inputs.get(gr.input) else {
                continue;
            };
            if !an.flow.has_grad[*t] {
                continue;
            }
            if !grad_inputs.contains(&gr.input) {
                grad_inputs.push(gr.input);
            }
            self.read_saved(&at, gr, &mut io);
            self.gradient(&at, gr.input, *t, &mut io);
        }
        for &s in &io.reads {
            let st = &mut self.storages[s];
            if !matches!(
                st.kind,
                StorageKind::ActivationGrad | StorageKind::GradTemp | StorageKind::ParamGrad
            ) {
                st.saved = true;
            }
        }
        self.backward_temporaries(&at, &grad_inputs, &mut io);
        let flops = required_share(bw, &node.inputs, &grad_inputs);
        self.steps.push(Step {
            node: Some(ix),
            updates: io.updates,
            grad_inputs,
            ..Step::new(
                format!("{}/grad", node.name),
                format!("{}Grad", node.op_type),
                StepKind::Backward,
                io.reads,
                io.writes,
                flops,
            )
        });
    }

    /// The saved tensors gradient `gr` reads (a fused pattern reads what the fused
    /// kernel saves instead, and its inputs, as a float32 copy where it made one).
    fn read_saved(&self, at: &At, gr: &Grad, io: &mut Io) {
        let fusion = self.an.rules.fusions.get(&at.ix);
        let needs: Vec<Saved> = match fusion {
            Some(f) => (0..f.extras.len()).map(Saved::Extra).collect(),
            None => gr.needs.clone(),
        };
        for sv in needs {
            if let Some(s) = self.saved_storage(at.step, sv) {
                io.read(s);
            }
        }
        for &x in fusion.map(|f| f.reads.as_slice()).unwrap_or(&[]) {
            let s = self
                .fp32_reads
                .get(&(at.ix, x))
                .copied()
                .unwrap_or_else(|| self.tstore[x].expect("stored"));
            io.read(s);
        }
    }

    /// The gradient of input `input` (tensor `t`): a view of the incoming one
    /// through view ops, else new, or added into the one it has.
    ///
    /// Parameters, as autograd does it (torch/csrc/autograd/input_buffer.cpp,
    /// accumulate_grad.h): each use of a parameter gives one contribution; the
    /// engine sums them in the input buffer of the parameter's AccumulateGrad,
    /// which then steals the sum as `.grad` (no copy: the step ends with one
    /// gradient per parameter). A contribution that is a view (a parameter read
    /// through a transpose or reshape: `TBackward0`, `ViewBackward0` of the
    /// incoming gradient, or a Gemm's transposed operand) costs nothing and cannot
    /// be added into in place (`can_accumulate_inplace` wants the last reference to
    /// a dense tensor), so the next contribution is added out of place: for a
    /// moment the view, the new contribution and their sum are all live (tied
    /// input/output embeddings: three weight-sized tensors at the embedding's
    /// backward). The sum is a fresh tensor, so any later contribution is added
    /// into it in place. Measured on PyTorch 2.15 CPU (tools/census,
    /// docs/CENSUS.md). With resident gradients (gradient accumulation) every
    /// contribution is added into `.grad` in place.
    fn gradient(&mut self, at: &At, input: usize, t: TensorId, io: &mut Io) {
        let (node, storage) = (at.node, at.rule.storage);
        let is_view = matches!(
            storage,
            ops::Storage::View | ops::Storage::StridedView | ops::Storage::Reshape
        ) || matches!(
            self.fq_role(at.ix),
            Some(FakeQuantRole::Clip | FakeQuantRole::Dequantize)
        );
        let resident = self.opts.grads_resident;
        let param = self.model.graph.tensor(t).kind == TensorKind::Parameter;
        let view_op = node.op_type == "Transpose"
            || matches!(storage, ops::Storage::View | ops::Storage::Reshape);
        let single = at.out_grads.len() == 1;
        let param_view = param && view_op && !resident && single && {
            let og = &self.storages[at.out_grads[0]];
            let master = self.opts.precision.master();
            og.kind == StorageKind::ActivationGrad
                && !og.persistent
                && og.dtype == master
                && Some(og.bytes) == master.bytes_for(self.inf.facts[t].numel())
        };
        match self.grad[t] {
            None if is_view && !param && single => self.grad[t] = Some(at.out_grads[0]),
            None if param_view => {
                let og = at.out_grads[0];
                self.storages[og].kind = StorageKind::ParamGrad;
                self.storages[og].held = true;
                self.grad[t] = Some(og);
                self.view_grad[t] = true;
            }
            Some(existing) if param && self.view_grad[t] && !resident => {
                self.sum_out_of_place(t, existing, io)
            }
            None => self.new_gradient(at, input, t, io),
            Some(existing) => {
                // Accumulate: the partial gradient is a temporary added in place.
                let tmp = self.grad_temp(t, existing);
                io.writes.push(tmp);
                io.reads.push(tmp);
                io.updates.push(existing);
            }
        }
    }

    /// A partial gradient of `t`, typed as its gradient `existing`.
    fn grad_temp(&mut self, t: TensorId, existing: StorageId) -> StorageId {
        let dt = self.storages[existing].dtype;
        self.new_storage(
            &format!("{}/grad+", self.model.graph.tensor(t).name),
            &self.inf.facts[t],
            dt,
            StorageKind::GradTemp,
        )
    }

    /// A parameter's second contribution after a view one: partial and sum
    /// written, the view freed after it.
    fn sum_out_of_place(&mut self, t: TensorId, existing: StorageId, io: &mut Io) {
        let dt = self.storages[existing].dtype;
        let tmp = self.grad_temp(t, existing);
        let sum = self.new_storage(
            &format!("{}/grad", self.model.graph.tensor(t).name),
            &self.inf.facts[t],
            dt,
            StorageKind::ParamGrad,
        );
        self.storages[sum].held = true;
        self.storages[existing].held = false;
        self.storages[existing].kind = StorageKind::GradTemp;
        io.writes.push(tmp);
        io.writes.push(sum);
        io.reads.push(tmp);
        io.read(existing);
        self.grad[t] = Some(sum);
        self.view_grad[t] = false;
    }

    /// The first gradient of `t`: an activation's in its type, a parameter's in the
    /// master type, held (and resident under gradient accumulation).
    fn new_gradient(&mut self, at: &At, input: usize, t: TensorId, io: &mut Io) {
        let param = self.model.graph.tensor(t).kind == TensorKind::Parameter;
        let (kind, dt) = if param {
            (StorageKind::ParamGrad, self.opts.precision.master())
        } else {
            (StorageKind::ActivationGrad, self.dtype_of(t))
        };
        let name = format!("{}/grad", self.model.graph.tensor(t).name);
        let s = self.new_storage(&name, &self.inf.facts[t], dt, kind);
        if param {
            self.storages[s].held = true;
            self.storages[s].persistent = self.opts.grads_resident;
            // Gemm's transposed operand: PyTorch's addmm reads `W.t()`, and the
            // weight's gradient is `TBackward0`'s view of mm's.
            let trans = match input {
                0 => "transA",
                1 => "transB",
                _ => "",
            };
            self.view_grad[t] = at.node.op_type == "Gemm" && at.node.attrs.int_or(trans, 0) != 0;
        }
        if !self.storages[s].persistent {
            io.writes.push(s);
        }
        self.grad[t] = Some(s);
    }

    /// What the derivative formulas hold beyond the gradients (a fused pattern's
    /// kernel and a fake quantization's rule have their own), and a quantized
    /// frozen weight this backward reads, dequantized again to the incoming
    /// gradient's dtype for the input gradient (`MatMul4Bit.backward`): temporaries
    /// of this step.
    fn backward_temporaries(&mut self, at: &At, grad_inputs: &[usize], io: &mut Io) {
        let an = self.an;
        let dt = self.storages[at.out_grads[0]].dtype;
        if !an.rules.fusions.contains_key(&at.ix) && !an.rules.fq.contains_key(&at.ix) {
            let elems = at.rule.op.backward_scratch(&at.rule.cx, grad_inputs);
            if elems > 0 {
                let s = self.new_storage(
                    &format!("{}/grad scratch", at.node.name),
                    &Fact::new(dt, vec![elems as usize]),
                    dt,
                    StorageKind::GradTemp,
                );
                io.writes.push(s);
                io.reads.push(s);
            }
        }
        for &t in at.node.inputs.iter().flatten() {
            let q = &an.params.quant;
            if q.quantized[t] && self.tstore[t].is_some_and(|s| io.reads.contains(&s)) {
                let c = self.new_storage(
                    &format!("{}@dequant/grad", self.model.graph.tensor(t).name),
                    &self.inf.facts[t],
                    dt,
                    StorageKind::Cast,
                );
                io.writes.push(c);
                io.reads.push(c);
            }
        }
    }

    /// Branches that require grad but that the loss does not depend on (e.g.
    /// BERT's pooler when the loss is on the hidden states): autograd decides what
    /// to save at forward time, from requires_grad alone, so those ops save their
    /// tensors anyway, and the graph keeps them for as long as an output it hangs
    /// from is held.
    pub(super) fn keep_what_unused_branches_save(&mut self) {
        let (g, flow) = (&self.model.graph, &self.an.flow);
        let mut reaches_held = vec![false; g.tensors.len()];
        for &t in g.outputs.iter().skip(1) {
            reaches_held[t] = flow.requires[t] && !flow.has_grad[t];
        }
        for (step, &ix) in g.order.iter().enumerate().rev() {
            let node = g.node(ix);
            if !node.outputs.iter().flatten().any(|&t| reaches_held[t]) {
                continue;
            }
            let Ok(Some(bw)) = &self.an.rules.nodes[step].backward else {
                continue;
            };
            self.keep_saved_of(step, node, bw, &mut reaches_held);
        }
    }

    fn keep_saved_of(&mut self, step: usize, node: &Node, bw: &Backward, reaches: &mut [bool]) {
        let flow = &self.an.flow;
        for gr in &bw.grads {
            let Some(Some(t)) = node.inputs.get(gr.input) else {
                continue;
            };
            if !flow.requires[*t] {
                continue;
            }
            if !flow.has_grad[*t] {
                reaches[*t] = true;
            }
            for sv in &gr.needs {
                if let Some(s) = self.saved_storage(step, *sv) {
                    let st = &mut self.storages[s];
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
}
