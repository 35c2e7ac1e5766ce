//! A whole model's forward on a [`Device`], node by node in execution order, as
//! [`crate::exec::Executor::forward`] runs it on the CPU (same parameters, same
//! Dropout seeds, values freed after their last reader): the end-to-end check of
//! the launchers before the training step drives them over a schedule.

use super::ops::{forward as node_forward, DevKernelCx, Path};
use super::{CudaError, Device, DeviceTensor, Result};
use crate::exec::{Executor, Options};
use crate::infer::Inferred;
use crate::ir::Model;
use crate::numeric::{rng, Tensor};

/// What a device forward gives back.
pub struct ForwardRun {
    /// The graph outputs, downloaded.
    pub outputs: Vec<Tensor>,
    /// Nodes that ran on the host (op types, in order).
    pub host_nodes: Vec<String>,
}

/// Runs `model` forward on `dev` with the parameters of a CPU [`Executor`] built
/// with the same `opts` (so both runs see identical weights and Dropout masks).
pub fn forward(
    dev: &Device,
    model: &Model,
    inferred: &Inferred,
    opts: Options,
    inputs: &[Tensor],
) -> Result<ForwardRun> {
    let g = &model.graph;
    let facts = &inferred.facts;
    let exec =
        Executor::new(model, inferred, opts).map_err(|e| CudaError::Kernel(e.to_string()))?;
    if inputs.len() != g.inputs.len() {
        return Err(CudaError::Kernel(format!(
            "the model has {} inputs, {} were given",
            g.inputs.len(),
            inputs.len()
        )));
    }
    let mut params: Vec<Option<DeviceTensor>> = Vec::with_capacity(g.tensors.len());
    for p in exec.params() {
        params.push(p.as_ref().map(|t| dev.upload(t)).transpose()?);
    }
    let mut values: Vec<Option<DeviceTensor>> = (0..g.tensors.len()).map(|_| None).collect();
    for (&t, x) in g.inputs.iter().zip(inputs) {
        values[t] = Some(dev.upload(x)?);
    }
    let mut last: Vec<Option<usize>> = g.uses_by_step().iter().map(|u| u.last().copied()).collect();
    for &t in &g.outputs {
        last[t] = Some(usize::MAX);
    }
    let opset = model.opset();
    let mut host_nodes = Vec::new();
    for (step, &ix) in g.order.iter().enumerate() {
        let node = g.node(ix);
        let err = |e: CudaError| {
            CudaError::Kernel(format!("node '{}' ({}): {e}", node.name, node.op_type))
        };
        let (outs, path) = {
            let cx = DevKernelCx {
                node,
                inputs: node
                    .inputs
                    .iter()
                    .map(|t| t.and_then(|t| params[t].as_ref().or(values[t].as_ref())))
                    .collect(),
                input_facts: node.inputs.iter().map(|t| t.map(|t| &facts[t])).collect(),
                outputs: node.outputs.iter().map(|t| t.map(|t| &facts[t])).collect(),
                opset,
                seed: rng::name_seed(opts.seed, &node.name),
                dropout: opts.dropout,
                extras: false,
            };
            node_forward(dev, &cx).map_err(err)?
        };
        if path == Path::Host {
            host_nodes.push(node.op_type.to_string());
        }
        for (slot, (t, v)) in node.outputs.iter().zip(outs).enumerate() {
            let Some(t) = *t else { continue };
            let f = &facts[t];
            if v.dtype() != f.dtype || v.shape != f.shape {
                return Err(err(CudaError::Kernel(format!(
                    "output {slot} is {} {:?}, inference says {} {:?}",
                    v.dtype(),
                    v.shape,
                    f.dtype,
                    f.shape
                ))));
            }
            if last[t].is_some() {
                values[t] = Some(v);
            }
        }
        for t in node.inputs.iter().flatten() {
            if last[*t] == Some(step) {
                values[*t] = None;
            }
        }
    }
    let outputs = g
        .outputs
        .iter()
        .map(|&t| {
            let v = values[t].as_ref().or(params[t].as_ref()).ok_or_else(|| {
                CudaError::Kernel(format!(
                    "graph output '{}' was not computed",
                    g.tensor(t).name
                ))
            })?;
            dev.download(v)
        })
        .collect::<Result<_>>()?;
    Ok(ForwardRun {
        outputs,
        host_nodes,
    })
}
