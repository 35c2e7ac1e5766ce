//! Phase 7: the loss of the first output (a mean, a sum, or the model's own scalar)
//! and the gradient that seeds backward.

use super::super::schedule::{Step, StepKind, StorageKind};
use super::super::Loss;
use super::Builder;
use crate::ir::DType;
use crate::ops::Fact;

impl Builder<'_, '_> {
    pub(super) fn loss(&mut self) {
        let (inf, out0) = (self.inf, self.an.flow.out0);
        let out0_s = self.tstore[out0].expect("stored");
        let loss = self.new_storage(
            "loss",
            &Fact::new(DType::F32, vec![]),
            DType::F32,
            StorageKind::Loss,
        );
        self.storages[loss].held = true;
        let n_out = inf.facts[out0].numel();
        let step = |name: &str, op: &str, kind, reads, writes| {
            Step::new(name, op, kind, reads, writes, n_out)
        };
        let op = match self.opts.loss {
            Loss::Mean => "ReduceMean",
            Loss::Sum => "ReduceSum",
            Loss::Graph => "Identity",
        };
        self.steps
            .push(step("loss", op, StepKind::Loss, vec![out0_s], vec![loss]));
        let g0_fact = match self.opts.loss {
            Loss::Mean => inf.facts[out0].clone(),
            // SumBackward expands the scalar gradient: a view, one element of storage.
            Loss::Sum => Fact::new(inf.facts[out0].dtype, vec![]),
            // `loss.backward()` seeds a scalar one.
            Loss::Graph => inf.facts[out0].clone(),
        };
        let g0 = self.new_storage(
            &format!("{}/grad", self.model.graph.tensor(out0).name),
            &g0_fact,
            self.dtype_of(out0),
            StorageKind::ActivationGrad,
        );
        self.grad[out0] = Some(g0);
        self.steps.push(step(
            "loss/grad",
            "LossGrad",
            StepKind::Backward,
            vec![loss],
            vec![g0],
        ));
    }
}
