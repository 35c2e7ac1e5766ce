//! The training step of one rank when the model is spread over several GPUs.
//!
//! Each layout rewrites the one-GPU [`crate::train::Schedule`] into the schedule of a
//! rank, so the same replay (live tensors, the caching allocator) gives the rank's
//! peak:
//! - [`fsdp`]: FSDP2 (`fully_shard`) by units, HSDP included;
//! - [`split`]: tensor (and sequence), context and expert parallelism: what a rank
//!   holds of each tensor;
//! - [`pipeline`]: pipeline stages and the micro-batches each holds in flight.

pub mod fsdp;
pub mod pipeline;
pub mod split;

pub use fsdp::{shard, Fsdp, FsdpSummary};
pub use pipeline::{PipeSchedule, Pipeline, StageSummary};
pub use split::{Degrees, SplitSummary};

use crate::train::Schedule;

/// Model parallelism: tensor, context, expert and pipeline.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Layout {
    /// Tensor (with sequence), context and expert degrees.
    pub degrees: Degrees,
    /// Pipeline stages (`None`: one).
    pub pipeline: Option<Pipeline>,
}

impl Layout {
    /// Whether it splits anything.
    pub fn is_split(&self) -> bool {
        let d = &self.degrees;
        d.tp > 1 || d.cp > 1 || d.ep > 1 || self.pipeline.as_ref().is_some_and(|p| p.stages > 1)
    }

    /// GPUs one model replica spans: tp·cp·pp (expert parallelism reuses them).
    pub fn model_gpus(&self) -> u64 {
        let d = &self.degrees;
        d.tp * d.cp * self.pipeline.as_ref().map_or(1, |p| p.stages)
    }
}

/// One rank's step under a [`Layout`].
#[derive(Debug, Clone)]
pub struct RankStep {
    /// Its schedule.
    pub schedule: Schedule,
    /// What the tensor, context and expert split did.
    pub split: SplitSummary,
    /// Its pipeline stage (`None` without pipeline parallelism).
    pub stage: Option<StageSummary>,
}

/// The steps of the ranks that differ under `l`: one per pipeline stage (the
/// tensor-, context- and expert-parallel ranks of a stage hold the same bytes).
/// `names` are the forward tensors' names by id.
pub fn ranks(mut s: Schedule, names: &[String], l: &Layout) -> Result<Vec<RankStep>, String> {
    let split = split::split(&mut s, names, &l.degrees)?;
    match &l.pipeline {
        Some(p) if p.stages > 1 => Ok(pipeline::stages(&s, p)?
            .into_iter()
            .map(|(schedule, stage)| RankStep {
                schedule,
                split: SplitSummary {
                    param_bytes: stage.param_bytes,
                    ..split.clone()
                },
                stage: Some(stage),
            })
            .collect()),
        _ => Ok(vec![RankStep {
            schedule: s,
            split,
            stage: None,
        }]),
    }
}
