//! Phase 5: the float type of every forward tensor under the precision policy,
//! the persistent storages (parameters, buffers, constants, inputs), and the
//! autocast weight cache.

use super::super::schedule::StorageKind;
use super::super::{Precision, TrainOptions};
use super::{Analysis, Builder};
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorKind};
use crate::ops::layout;
use std::collections::{HashMap, HashSet};

impl<'m, 'a> Builder<'m, 'a> {
    /// A builder holding the persistent storages, each forward float tensor typed
    /// as far as the inputs decide it (outputs are typed as forward reaches them).
    pub(super) fn new(
        model: &'m Model,
        inf: &'m Inferred,
        opts: &'m TrainOptions,
        an: &'a Analysis<'m>,
    ) -> Builder<'m, 'a> {
        let n_t = model.graph.tensors.len();
        let mut b = Builder {
            model,
            inf,
            opts,
            an,
            storages: Vec::new(),
            steps: Vec::new(),
            float_dtype: float_dtypes(model, inf, opts.precision, an),
            tstore: vec![None; n_t],
            strides: inf
                .facts
                .iter()
                .map(|f| Some(layout::contiguous(&f.shape)))
                .collect(),
            trainable_storage: HashSet::new(),
            weight_cast: HashMap::new(),
            read_as: Vec::with_capacity(model.graph.order.len()),
            extras_of: Vec::with_capacity(model.graph.order.len()),
            grad: vec![None; n_t],
            view_grad: vec![false; n_t],
            fp32_reads: HashMap::new(),
        };
        b.persistent_storages();
        // Autocast weight cache: one half copy per parameter, made at its first
        // use. A trainable parameter read through a view (the TorchScript
        // exporter's `Transpose(W)` before each `MatMul` of a Linear) is the same
        // cache entry as every other read through the same view: PyTorch casts `W`
        // itself, once, and each use views the copy (ALBERT's shared layer: one
        // copy for all its layers). Keyed by the parameter's storage and the view's
        // shape and strides, so that a different view of one weight (a square `W`
        // read as itself and transposed) gets its own copy (PyTorch would view the
        // one copy: memplan counts more).
        b.trainable_storage = (0..n_t)
            .filter(|&t| an.params.trainable[t])
            .filter_map(|t| b.tstore[t])
            .collect();
        b
    }

    /// Parameters, buffers, graph constants and inputs: stored for the whole step.
    fn persistent_storages(&mut self) {
        let p = &self.an.params;
        for (t, info) in self.model.graph.tensors.iter().enumerate() {
            let kind = match info.kind {
                TensorKind::Parameter if p.is_param[t] => StorageKind::Parameter,
                TensorKind::Parameter => StorageKind::Buffer,
                TensorKind::Constant if info.producer.is_none() => StorageKind::Constant,
                TensorKind::Input => StorageKind::Input,
                _ => continue,
            };
            let dt = self.dtype_of(t);
            let s = self.new_storage(&info.name, &self.inf.facts[t], dt, kind);
            self.storages[s].persistent = true;
            if let (true, Some(wd)) = (p.quant.quantized[t], p.frozen_dtype) {
                let f = &self.inf.facts[t];
                let rhs = p.quant.linear_rhs[t].unwrap_or(false);
                self.storages[s].bytes =
                    wd.bytes(f.numel(), super::super::quant::output_rows(&f.shape, rhs));
            }
            self.tstore[t] = Some(s);
        }
    }
}

/// The float type of every float tensor before forward: parameters in the master
/// type (frozen ones in theirs), the rest as exported, or bfloat16 under a bf16
/// policy on a float32 export.
fn float_dtypes(
    model: &Model,
    inf: &Inferred,
    prec: Precision,
    an: &Analysis,
) -> Vec<Option<DType>> {
    let p = &an.params;
    model
        .graph
        .tensors
        .iter()
        .enumerate()
        .map(|(t, info)| {
            inf.facts[t].dtype.is_float().then(|| match info.kind {
                TensorKind::Parameter if p.is_param[t] && !p.trainable[t] => p
                    .frozen_dtype
                    .and_then(|d| d.float())
                    .unwrap_or(prec.master()),
                TensorKind::Parameter => prec.master(),
                _ if prec == Precision::Bf16 && !an.as_written => DType::BF16,
                _ => inf.facts[t].dtype,
            })
        })
        .collect()
}
