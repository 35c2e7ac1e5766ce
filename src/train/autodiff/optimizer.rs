//! Phase 9: the optimizer update: it reads every gradient and parameter, its
//! state (persistent, per parameter as torch.optim creates it) and its
//! temporaries.

use super::super::schedule::{Step, StepKind, StorageId, StorageKind};
use super::Builder;
use crate::ir::TensorId;
use crate::ops::Fact;

impl Builder<'_, '_> {
    pub(super) fn optimizer(&mut self) {
        let inf = self.inf;
        let with_grad = self.an.params.with_grad(&self.an.flow);
        let master = self.opts.precision.master();
        let opt = self.opts.optimizer;
        let numels: Vec<u64> = with_grad.iter().map(|&t| inf.facts[t].numel()).collect();
        let grad_bytes: u64 = numels
            .iter()
            .map(|&n| master.bytes_for(n).unwrap_or(u64::MAX))
            .sum();
        let mut reads: Vec<StorageId> = with_grad.iter().filter_map(|&t| self.grad[t]).collect();
        reads.extend(with_grad.iter().filter_map(|&t| self.tstore[t]));
        let mut writes = Vec::new();
        if let Some(s) = self.optimizer_state(&with_grad, &numels, grad_bytes) {
            reads.push(s);
        }
        let largest = numels.iter().copied().max().unwrap_or(0);
        let temp = opt.temp_bytes(grad_bytes, largest, master);
        if temp > 0 {
            let s = self.new_storage(
                "optimizer temporaries",
                &Fact::new(master, vec![]),
                master,
                StorageKind::OptimizerTemp,
            );
            self.storages[s].bytes = temp;
            if temp == grad_bytes {
                // A foreach temporary: one tensor per parameter.
                self.storages[s].pieces = numels
                    .iter()
                    .map(|&n| master.bytes_for(n).unwrap_or(u64::MAX))
                    .collect();
            }
            writes.push(s);
            reads.push(s);
        }
        let n_params: u64 = numels.iter().sum();
        self.steps.push(Step::new(
            "optimizer",
            opt.to_string(),
            StepKind::Optimizer,
            reads,
            writes,
            n_params.saturating_mul(opt.flops_per_element()),
        ));
    }

    /// The optimizer's state, one persistent storage in pieces per parameter as
    /// torch.optim creates it (the shared maps last); none without state or
    /// gradients.
    fn optimizer_state(
        &mut self,
        with_grad: &[TensorId],
        numels: &[u64],
        grad_bytes: u64,
    ) -> Option<StorageId> {
        let (inf, opt) = (self.inf, self.opts.optimizer);
        let master = self.opts.precision.master();
        let shared = opt.shared_state_bytes(numels);
        let state_bytes = with_grad.iter().fold(shared, |a, &t| {
            a.saturating_add(opt.state_bytes(&inf.facts[t].shape, master))
        });
        if state_bytes == 0 || grad_bytes == 0 {
            return None;
        }
        let s = self.new_storage(
            "optimizer state",
            &Fact::new(master, vec![]),
            master,
            StorageKind::OptimizerState,
        );
        let mut pieces: Vec<u64> = with_grad
            .iter()
            .flat_map(|&t| opt.state_tensors(&inf.facts[t].shape, master))
            .collect();
        if shared > 0 {
            pieces.extend([shared / 2, shared - shared / 2]);
        }
        let st = &mut self.storages[s];
        st.bytes = state_bytes;
        st.shape = Vec::new();
        st.persistent = true;
        st.pieces = pieces;
        Some(s)
    }
}
