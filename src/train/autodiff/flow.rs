//! Phases 3 and 4: which tensors require grad (forward from the trainable
//! parameters), and which get a gradient (those the loss depends on).

use super::super::{Loss, TrainOptions};
use super::params::Params;
use super::rules::Rules;
use crate::error::{Error, Result, Setting};
use crate::infer::Inferred;
use crate::ir::{Model, TensorId};

/// Where gradients flow.
pub(super) struct Flow {
    /// Per tensor: requires grad.
    pub(super) requires: Vec<bool>,
    /// Per tensor: requires grad and the loss depends on it.
    pub(super) has_grad: Vec<bool>,
    /// The output the loss is taken of (the model's first).
    pub(super) out0: TensorId,
}

impl Flow {
    pub(super) fn of(
        model: &Model,
        inf: &Inferred,
        opts: &TrainOptions,
        rules: &Rules,
        params: &Params,
    ) -> Result<Flow> {
        let requires = requires_grad(model, inf, rules, params)?;
        let out0 = loss_output(model, inf, opts)?;
        let g = &model.graph;
        let mut has_grad = vec![false; g.tensors.len()];
        has_grad[out0] = requires[out0];
        if !has_grad[out0] && !opts.params.is_all() {
            let setting = if opts.params.trainable.is_some() {
                Setting::Trainable
            } else {
                Setting::Freeze
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
            if let Ok(Some(bw)) = &rules.nodes[step].backward {
                for gr in &bw.grads {
                    if let Some(Some(t)) = node.inputs.get(gr.input) {
                        if requires[*t] {
                            has_grad[*t] = true;
                        }
                    }
                }
            }
        }
        Ok(Flow {
            requires,
            has_grad,
            out0,
        })
    }
}

/// Per tensor: requires grad, forward from the trainable parameters. A node that
/// reads such a tensor and has no backward rule is an error naming it.
fn requires_grad(
    model: &Model,
    inf: &Inferred,
    rules: &Rules,
    params: &Params,
) -> Result<Vec<bool>> {
    let g = &model.graph;
    let mut requires = params.trainable.clone();
    for (step, &ix) in g.order.iter().enumerate() {
        let node = g.node(ix);
        let any_float_req = node
            .inputs
            .iter()
            .flatten()
            .any(|&t| requires[t] && rules.carries(inf, t));
        if !any_float_req {
            continue;
        }
        match &rules.nodes[step].backward {
            Ok(None) => {}
            Ok(Some(bw)) => {
                let grad_req = bw
                    .grads
                    .iter()
                    .any(|gr| matches!(node.inputs.get(gr.input), Some(Some(t)) if requires[*t]));
                if grad_req {
                    for t in node.outputs.iter().flatten() {
                        requires[*t] = rules.carries(inf, *t);
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
    Ok(requires)
}

/// The output the loss is taken of: the first, floating point (a scalar when the
/// model computes its own loss).
fn loss_output(model: &Model, inf: &Inferred, opts: &TrainOptions) -> Result<TensorId> {
    let g = &model.graph;
    let out0 = *g
        .outputs
        .first()
        .ok_or_else(|| Error::Graph("the model has no outputs to take a loss of".into()))?;
    if !inf.facts[out0].dtype.is_float() {
        return Err(Error::Graph(format!(
            "the first output '{}' is {}, not floating point: no loss to differentiate",
            g.tensor(out0).name,
            inf.facts[out0].dtype
        )));
    }
    if opts.loss == Loss::Graph && inf.facts[out0].numel() != 1 {
        return Err(Error::Setting {
            setting: Setting::Loss,
            reason: format!(
                "the first output '{}' is {:?}, not a scalar: the model computes no loss of its own to train on",
                g.tensor(out0).name,
                inf.facts[out0].shape
            ),
        });
    }
    Ok(out0)
}
