//! The training step of a model under its settings, built in one place: the model
//! lowered and inferred ([`crate::infer::inference`]: control flow and sequences
//! unrolled for the bindings) →
//! its inferred shapes → its training schedule → the rematerialization graph (one
//! node per schedule step, one value per storage), whose no-recompute replay is the
//! baseline peak ([`RematGraph::baseline_peak`]). Every command builds its step
//! here: [`inference`] for the lowered, inferred model (`profile`, `verify`),
//! [`schedule`] for the schedule of an inferred model, [`schedule_of`] for a
//! model's schedule (`fit`'s combinations), [`build`] and [`load`] for the whole step
//! (`plan`, `fit`, `bench`, `report`). tests/repo.rs checks that no other file
//! lowers a model or builds a schedule.

use std::path::Path;

use crate::error::{Error, Result};
use crate::infer::lower::lowered;
pub use crate::infer::{inference, Inference};
use crate::infer::{Bindings, Inferred};
use crate::ir::DType;
use crate::ir::Model;
use crate::onnx::load_model;
use crate::parallel::{Fsdp, FsdpSummary, Layout, RankStep};
use crate::remat::from_schedule::from_schedule;
use crate::remat::graph::RematGraph;
use crate::train::{build_schedule, Precision, Schedule, TrainOptions};

/// The training schedule of a lowered, inferred model ([`inference`]).
pub fn schedule(model: &Model, inferred: &Inferred, opts: &TrainOptions) -> Result<Schedule> {
    build_schedule(model, inferred, opts)
}

/// One rank's training schedule under FSDP2 `f` ([`crate::parallel::fsdp`]): under
/// a half-precision `param_dtype` built in that precision with the sharded state in
/// float32 (the parameters the policy casts), then sharded.
pub fn sharded_schedule(
    model: &Model,
    inferred: &Inferred,
    opts: &TrainOptions,
    f: &Fsdp,
) -> Result<(Schedule, FsdpSummary)> {
    let (o, f) = fsdp_options(opts, f);
    let mut s = schedule(model, inferred, &o)?;
    let summary = crate::parallel::shard(&mut s, &f).map_err(Error::Graph)?;
    Ok((s, summary))
}

/// The step's options and FSDP's settings under FSDP2 `f`: a half-precision policy
/// casts float32 parameters, so the step computes in the half type and the sharded
/// state stays float32.
fn fsdp_options(opts: &TrainOptions, f: &Fsdp) -> (TrainOptions, Fsdp) {
    let mut o = opts.clone();
    let mut f = f.clone();
    if let Some(DType::BF16 | DType::F16) = f.param_dtype {
        if o.precision == Precision::Fp32 {
            o.precision = Precision::Bf16;
        }
        f.orig_dtype = Some(DType::F32);
    }
    (o, f)
}

/// The training schedules of the ranks that differ under model-parallel layout `l`
/// ([`crate::parallel::ranks`]): one per pipeline stage, first stage first; each
/// sharded over the data-parallel ranks by FSDP2 `fsdp` when given (2-D and 3-D
/// layouts: FSDP over what tensor and pipeline parallelism leave a rank).
pub fn rank_schedules(
    model: &Model,
    inferred: &Inferred,
    opts: &TrainOptions,
    l: &Layout,
    fsdp: Option<&Fsdp>,
) -> Result<Vec<(RankStep, Option<FsdpSummary>)>> {
    let (o, f) = match fsdp {
        Some(f) => {
            let (o, f) = fsdp_options(opts, f);
            (o, Some(f))
        }
        None => (opts.clone(), None),
    };
    let s = schedule(model, inferred, &o)?;
    let names: Vec<String> = (0..s.tensor_storage.len())
        .map(|t| model.graph.tensor(t).name.to_string())
        .collect();
    let ranks = crate::parallel::ranks(s, &names, l).map_err(Error::Graph)?;
    ranks
        .into_iter()
        .map(|mut r| {
            let summary = match &f {
                Some(f) => Some(crate::parallel::shard(&mut r.schedule, f).map_err(Error::Graph)?),
                None => None,
            };
            Ok((r, summary))
        })
        .collect()
}

/// The training schedule of `model` under `bindings` and `opts` (lowered and
/// inferred on the way).
pub fn schedule_of(model: &Model, bindings: &Bindings, opts: &TrainOptions) -> Result<Schedule> {
    let i = inference(model, bindings)?;
    schedule(&i.model, &i.inferred, opts)
}

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
/// A model with control flow or sequences is lowered first ([`crate::infer::lower`]): the
/// step's tensors are then the lowered model's (what [`load`] returns).
pub fn build(
    model: &Model,
    bindings: &Bindings,
    opts: &TrainOptions,
    name: &str,
) -> Result<TrainingStep> {
    build_on(model, bindings, opts, None, name)
}

/// [`build`] for one rank under FSDP2 `fsdp` ([`sharded_schedule`]) when given.
pub fn build_on(
    model: &Model,
    bindings: &Bindings,
    opts: &TrainOptions,
    fsdp: Option<&Fsdp>,
    name: &str,
) -> Result<TrainingStep> {
    let Inference { model, inferred } = inference(model, bindings)?;
    let schedule = match fsdp {
        Some(f) => sharded_schedule(&model, &inferred, opts, f)?.0,
        None => schedule(&model, &inferred, opts)?,
    };
    let graph = from_schedule(&schedule, name);
    Ok(TrainingStep {
        inferred,
        schedule,
        graph,
    })
}

/// Loads the ONNX file at `path` and builds its training step (the graph named by
/// the path); the model is returned lowered for `bindings` ([`crate::infer::lower`]).
pub fn load(
    path: &Path,
    bindings: &Bindings,
    opts: &TrainOptions,
) -> Result<(Model, TrainingStep)> {
    load_on(path, bindings, opts, None)
}

/// [`load`] for one rank under FSDP2 `fsdp` when given.
pub fn load_on(
    path: &Path,
    bindings: &Bindings,
    opts: &TrainOptions,
    fsdp: Option<&Fsdp>,
) -> Result<(Model, TrainingStep)> {
    let model = lowered(load_model(path)?, bindings)?;
    let step = build_on(&model, bindings, opts, fsdp, &path.display().to_string())?;
    Ok((model, step))
}

/// Loads a model (`.onnx`, training step at `batch`) or a benchmark DAG (`.json`).
pub fn load_graph(path: &Path, batch: u64) -> Result<RematGraph> {
    load_graph_with(path, batch, &TrainOptions::default())
}

/// [`load_graph`] with the training step's options (optimizer, precision, loss).
pub fn load_graph_with(path: &Path, batch: u64, opts: &TrainOptions) -> Result<RematGraph> {
    let name = path
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    if path.extension().is_some_and(|e| e == "json") {
        let mut g = crate::remat::dag::load_dag(path)?;
        g.name = name;
        return Ok(g);
    }
    let model = load_model(path)?;
    let b = Bindings {
        batch: Some(batch),
        ..Default::default()
    };
    Ok(crate::step::build(&model, &b, opts, &name)?.graph)
}
