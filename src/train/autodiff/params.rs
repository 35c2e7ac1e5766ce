//! Phase 2: the parameters (floating initializers read at a differentiable slot,
//! but for those the exporter declares buffers), which of them train, and how the
//! frozen ones are stored (`quant`).

use super::super::quant::{Quantized, WeightDtype};
use super::super::TrainOptions;
use super::flow::Flow;
use super::rules::Rules;
use crate::error::{Error, Result, Setting};
use crate::infer::Inferred;
use crate::ir::{parameter_name, Model, TensorId, TensorKind};

/// The model's parameters and how each is stored.
pub(super) struct Params {
    /// Per tensor: a parameter.
    pub(super) is_param: Vec<bool>,
    /// Per tensor: a parameter that trains (the rest are frozen:
    /// `requires_grad_(False)`).
    pub(super) trainable: Vec<bool>,
    /// How frozen parameters are stored: float types change their dtype, quantized
    /// ones their bytes, and each use dequantizes them.
    pub(super) frozen_dtype: Option<WeightDtype>,
    /// The frozen Linear weights stored quantized, and their views.
    pub(super) quant: Quantized,
}

impl Params {
    pub(super) fn of(
        model: &Model,
        inf: &Inferred,
        opts: &TrainOptions,
        rules: &Rules,
    ) -> Result<Params> {
        let g = &model.graph;
        let n_t = g.tensors.len();
        let mut is_param = vec![false; n_t];
        for (step, &ix) in g.order.iter().enumerate() {
            if let Ok(Some(bw)) = &rules.nodes[step].backward {
                for gr in &bw.grads {
                    if let Some(Some(t)) = g.node(ix).inputs.get(gr.input) {
                        if g.tensor(*t).kind == TensorKind::Parameter && !g.tensor(*t).buffer {
                            is_param[*t] = true;
                        }
                    }
                }
            }
        }
        let params: Vec<TensorId> = (0..n_t).filter(|&t| is_param[t]).collect();
        let names: Vec<String> = params.iter().map(|&t| parameter_name(g, t)).collect();
        let mut trainable = vec![false; n_t];
        for (&t, trains) in params.iter().zip(opts.params.resolve(&names)?) {
            trainable[t] = trains;
        }
        let frozen_dtype = opts.params.frozen_dtype;
        if let Some(wd) = frozen_dtype {
            if params.iter().all(|&t| trainable[t]) {
                return Err(Error::setting(
                    Setting::WeightDtype,
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
        let quant = Quantized::of(model, inf, &frozen_quantized);
        if let Some(wd) = frozen_dtype.filter(|d| d.is_quantized()) {
            if !quant.quantized.contains(&true) {
                let frozen = params.iter().filter(|&&t| !trainable[t]).count();
                return Err(Error::setting(
                    Setting::WeightDtype,
                    format!(
                        "{wd} quantizes frozen Linear weights (2-D, read by MatMul or Gemm), and none of the {frozen} frozen parameters is one"
                    ),
                ));
            }
        }
        Ok(Params {
            is_param,
            trainable,
            frozen_dtype,
            quant,
        })
    }

    /// The trainable parameters that get a gradient, in tensor order.
    pub(super) fn with_grad(&self, flow: &Flow) -> Vec<TensorId> {
        (0..self.trainable.len())
            .filter(|&t| self.trainable[t] && flow.has_grad[t])
            .collect()
    }
}
