//! The chain every planning command runs, written once: a model → its inferred
//! shapes → its training schedule → the rematerialization graph (one node per
//! schedule step, one value per storage), whose no-recompute replay is the baseline
//! peak ([`RematGraph::baseline_peak`]). `plan`, `verify`, `fit`, `bench` and the
//! rewrite reader build their steps here.

use std::path::Path;

use super::from_schedule::from_schedule;
use super::graph::RematGraph;
use crate::error::Result;
use crate::infer::{infer, Bindings, Inferred};
use crate::ir::Model;
use crate::onnx::load_model;
use crate::train::{build_schedule, Schedule, TrainOptions};

/// A model's training step, from inferred shapes to the rematerialization graph.
#[derive(Debug, Clone)]
pub struct TrainingStep {
    /// Shapes and FLOPs under the bindings.
    pub inferred: Inferred,
    /// The training step's storages and steps.
    pub schedule: Schedule,
    /// The schedule as a rematerialization problem, named as given.
    pub graph: RematGraph,
}

/// The training step of `model` under `bindings` and `opts`; `name` names the graph.
/// A model with control flow or sequences is lowered first ([`crate::lower`]): the
/// step's tensors are then the lowered model's (what [`load`] returns).
pub fn build(
    model: &Model,
    bindings: &Bindings,
    opts: &TrainOptions,
    name: &str,
) -> Result<TrainingStep> {
    let model = &*crate::lower::lower(model, bindings)?;
    let inferred = infer(model, bindings)?;
    let schedule = build_schedule(model, &inferred, opts)?;
    let graph = from_schedule(&schedule, name);
    Ok(TrainingStep {
        inferred,
        schedule,
        graph,
    })
}

/// Loads the ONNX file at `path` and builds its training step (the graph named by
/// the path); the model is returned lowered for `bindings` ([`crate::lower`]).
pub fn load(
    path: &Path,
    bindings: &Bindings,
    opts: &TrainOptions,
) -> Result<(Model, TrainingStep)> {
    let model = crate::lower::lowered(load_model(path)?, bindings)?;
    let step = build(&model, bindings, opts, &path.display().to_string())?;
    Ok((model, step))
}
