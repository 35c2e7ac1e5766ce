//! The ranks of a model-parallel layout (`profile --train --tp/--pp/--cp/--ep`).

use std::fmt::Write;

use serde::Serialize;

use super::human_bytes;
use crate::parallel::{Layout, StageSummary};

/// One rank that differs from the others (a pipeline stage).
#[derive(Debug, Clone, Serialize)]
pub struct RankRow {
    /// Its pipeline stage (`null` without pipeline parallelism).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<StageSummary>,
    /// Live tensor bytes at its peak.
    pub peak_bytes: u64,
    /// The caching allocator's reserved peak (with `--gpu` and the defaults).
    pub reserved_bytes: u64,
    /// Parameter bytes it holds (under FSDP, its shard).
    pub param_bytes: u64,
}

/// The layout and each rank's figures (`training.parallel` in the JSON).
#[derive(Debug, Clone, Serialize)]
pub struct ParallelReport {
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Sequence parallelism.
    pub sequence_parallel: bool,
    /// Context-parallel degree.
    pub cp: u64,
    /// Expert-parallel degree.
    pub ep: u64,
    /// Pipeline stages.
    pub pp: u64,
    /// Micro-batches per step (1 without pipeline parallelism).
    pub microbatches: u64,
    /// The pipeline schedule.
    pub schedule: String,
    /// GPUs one model replica spans (tp·cp·pp).
    pub model_gpus: u64,
    /// Parameter tensors tensor parallelism splits.
    pub tp_split_params: usize,
    /// Expert parameter tensors expert parallelism splits.
    pub expert_params: usize,
    /// Bytes of keys and values a rank passes around the context-parallel ring in
    /// one forward, over the attentions (0 without context parallelism).
    pub ring_kv_bytes: u64,
    /// The rank the other figures of the report are (the highest reserved peak).
    pub worst_rank: usize,
    /// Each differing rank (pipeline stage), first first.
    pub ranks: Vec<RankRow>,
}

impl ParallelReport {
    /// The report of `l` over `ranks` (worst chosen by reserved bytes).
    pub fn new(l: &Layout, ranks: Vec<RankRow>, split: &crate::parallel::SplitSummary) -> Self {
        let worst_rank = ranks
            .iter()
            .enumerate()
            .max_by_key(|(i, r)| (r.reserved_bytes, std::cmp::Reverse(*i)))
            .map_or(0, |(i, _)| i);
        let p = l.pipeline.as_ref();
        ParallelReport {
            tp: l.degrees.tp,
            sequence_parallel: l.degrees.sequence_parallel,
            cp: l.degrees.cp,
            ep: l.degrees.ep,
            pp: p.map_or(1, |p| p.stages),
            microbatches: p.map_or(1, |p| p.microbatches),
            schedule: p.map_or("none".into(), |p| p.schedule.to_string()),
            model_gpus: l.model_gpus(),
            tp_split_params: split.tp_split_params,
            expert_params: split.expert_params,
            ring_kv_bytes: split.ring_kv_bytes,
            worst_rank,
            ranks,
        }
    }

    /// Text: the layout and one line per rank.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "  one rank of tp {}{} × cp {} × pp {} ({} GPU{} per replica), ep {}; {} parameters split by tensor parallelism, {} by expert parallelism",
            self.tp,
            if self.sequence_parallel { " (sequence parallel)" } else { "" },
            self.cp,
            self.pp,
            self.model_gpus,
            if self.model_gpus == 1 { "" } else { "s" },
            self.ep,
            self.tp_split_params,
            self.expert_params
        );
        if self.pp > 1 {
            let _ = writeln!(
                s,
                "  pipeline: {} micro-batch{}, {}; the figures below are stage {}'s (the highest reserved)",
                self.microbatches,
                if self.microbatches == 1 { "" } else { "es" },
                self.schedule,
                self.worst_rank
            );
            for r in &self.ranks {
                let Some(st) = &r.stage else { continue };
                let blocks = st.chunks.join(", ");
                let ends = match (st.first, st.last) {
                    (true, true) => " + embeddings + head",
                    (true, false) => " + embeddings",
                    (false, true) => " + head",
                    _ => "",
                };
                let _ = writeln!(
                    s,
                    "    stage {}: {} block{} ({blocks}{ends}), parameters {}, {} in flight ({} more saved), peak {}, reserved {}",
                    st.stage,
                    st.blocks.len(),
                    if st.blocks.len() == 1 { "" } else { "s" },
                    human_bytes(r.param_bytes),
                    st.in_flight,
                    human_bytes(st.in_flight_bytes),
                    human_bytes(r.peak_bytes),
                    human_bytes(r.reserved_bytes)
                );
            }
        }
        s
    }
}
