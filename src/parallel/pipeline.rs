//! Pipeline parallelism: one stage's step, with the micro-batches it holds in flight.
//!
//! **Stages.** The repeated blocks are split over `p·V` virtual stages in order,
//! evenly (the first `B mod p·V` take one block more) or as given; what comes before
//! the first block (embeddings) belongs to the first, what follows the last (final
//! norm, LM head, loss) to the last. Under `interleaved:V` rank `r` holds virtual
//! stages `r, r+p, …` (Megatron's model chunks); otherwise one stage each.
//!
//! **A rank's step** is the one-GPU step's forward and backward steps of its stages
//! for one micro-batch (its input received from the previous stage is live from its
//! first use to its last backward read, as the received tensor is) and the optimizer
//! update of its parameters; gradients are kept across micro-batches when there are
//! several.
//!
//! **In flight.** A stage holds the saved activations of every micro-batch it has run
//! forward and not yet backward. At the peak of a rank's backward (rank `r` of `p`, `M`
//! micro-batches):
//! - `gpipe`: all `M`;
//! - `1f1b` (PipeDream-flush, Narayanan et al. 2021): `min(p − r, M)`;
//! - `interleaved:V` (Megatron's interleaved 1F1B): `2(p − r − 1) + (V − 1)p + 1` chunk
//!   micro-batches (its warm-up forwards, `get_num_warmup_microbatches`, and the one in
//!   flight), at most `M·V`; the first rank then holds `1 + (p − 1)/(pV)` times a whole
//!   micro-batch's layers, the factor of Megatron's theoretical memory.
//!
//! The rank's step replays one micro-batch; the others in flight are one storage of
//! their saved activations (one allocation per saved tensor, as autograd keeps them),
//! live from the rank's first forward to its last backward: the optimizer update
//! runs after every micro-batch is done.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::remat::modules::{repeated_blocks, ModuleTree};
use crate::train::{Schedule, StepKind, StorageId, StorageKind};

/// The pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeSchedule {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward in the steady state.
    OneFOneB,
    /// 1F1B over V model chunks per rank.
    Interleaved(u64),
}

impl PipeSchedule {
    /// `gpipe`, `1f1b` or `interleaved:V` (V ≥ 2).
    pub fn parse(text: &str) -> Result<PipeSchedule, String> {
        match text.trim() {
            "gpipe" => Ok(PipeSchedule::GPipe),
            "1f1b" => Ok(PipeSchedule::OneFOneB),
            t => match t.strip_prefix("interleaved:").map(|v| v.parse::<u64>()) {
                Some(Ok(v)) if (2..=64).contains(&v) => Ok(PipeSchedule::Interleaved(v)),
                _ => Err(format!(
                    "'{t}' is not a pipeline schedule (gpipe, 1f1b, interleaved:V with V from 2 to 64)"
                )),
            },
        }
    }

    /// Model chunks per rank.
    pub fn chunks(self) -> u64 {
        match self {
            PipeSchedule::Interleaved(v) => v,
            _ => 1,
        }
    }

    /// Chunk micro-batches rank `r` of `p` holds in flight with `m` micro-batches.
    pub fn in_flight(self, r: u64, p: u64, m: u64) -> u64 {
        match self {
            PipeSchedule::GPipe => m,
            PipeSchedule::OneFOneB => (p - r).min(m),
            PipeSchedule::Interleaved(v) => (2 * (p - r - 1) + (v - 1) * p + 1).min(m * v),
        }
    }
}

impl std::fmt::Display for PipeSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PipeSchedule::GPipe => write!(f, "gpipe"),
            PipeSchedule::OneFOneB => write!(f, "1f1b"),
            PipeSchedule::Interleaved(v) => write!(f, "interleaved:{v}"),
        }
    }
}

/// Pipeline settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Pipeline {
    /// Stages (ranks).
    pub stages: u64,
    /// Micro-batches per step.
    pub microbatches: u64,
    /// The schedule.
    pub schedule: PipeSchedule,
    /// Blocks per virtual stage, in order (`None`: even).
    pub blocks: Option<Vec<u64>>,
}

/// One stage, for reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageSummary {
    /// Rank in the pipeline (0: the first stage).
    pub stage: u64,
    /// The blocks it holds (module paths).
    pub blocks: Vec<String>,
    /// Its model chunks' blocks as ranges (`first … last`; one chunk without
    /// interleaving).
    pub chunks: Vec<String>,
    /// Whether it holds what precedes the first block (embeddings).
    pub first: bool,
    /// Whether it holds what follows the last block (head, loss).
    pub last: bool,
    /// Micro-batches in flight at its peak (chunk micro-batches under interleaving).
    pub in_flight: u64,
    /// Bytes of the saved activations of the other micro-batches in flight.
    pub in_flight_bytes: u64,
    /// Its parameter bytes.
    pub param_bytes: u64,
}

/// Blocks per virtual stage.
fn counts(blocks: usize, p: &Pipeline) -> Result<Vec<usize>, String> {
    let nv = (p.stages * p.schedule.chunks()) as usize;
    if let Some(given) = &p.blocks {
        let sum: u64 = given.iter().sum();
        if given.len() != nv || sum != blocks as u64 || given.contains(&0) {
            return Err(format!(
                "the stages must hold the model's {blocks} blocks, at least one each, over {nv} (virtual) stages; given {} adding to {sum}",
                given.len()
            ));
        }
        return Ok(given.iter().map(|&b| b as usize).collect());
    }
    if blocks < nv {
        return Err(format!(
            "{blocks} repeated blocks cannot fill {nv} pipeline (virtual) stages"
        ));
    }
    Ok((0..nv)
        .map(|j| blocks / nv + usize::from(j < blocks % nv))
        .collect())
}

/// Per step its virtual stage; per virtual stage its blocks.
type Assigned = (Vec<Option<usize>>, Vec<Vec<String>>);

/// The virtual stage of each step (`None`: the optimizer, on every rank), and the
/// blocks of each virtual stage.
fn assign(s: &Schedule, p: &Pipeline) -> Result<Assigned, String> {
    let t = ModuleTree::of_schedule(s);
    let mut blocks = repeated_blocks(&t);
    if blocks.is_empty() {
        return Err("pipeline parallelism splits the model by its repeated blocks (decoder layers); this model has none".into());
    }
    blocks.sort_by_key(|&m| t.modules[m].forward.first().copied().unwrap_or(usize::MAX));
    let mut stacks: Vec<&str> = blocks
        .iter()
        .map(|&m| t.modules[m].path.rsplit_once('.').map_or("", |(p, _)| p))
        .collect();
    stacks.dedup();
    if stacks.len() > 1 {
        return Err(format!(
            "pipeline parallelism splits one stack of repeated blocks; this model has {}: {}",
            stacks.len(),
            stacks.join(", ")
        ));
    }
    let per = counts(blocks.len(), p)?;
    let mut vs: Vec<Option<usize>> = vec![None; s.steps.len()];
    let mut names: Vec<Vec<String>> = vec![Vec::new(); per.len()];
    let mut b = 0;
    for (j, &n) in per.iter().enumerate() {
        for &m in &blocks[b..b + n] {
            names[j].push(t.modules[m].path.clone());
            for &k in t.modules[m].forward.iter().chain(&t.modules[m].backward) {
                vs[k] = Some(j);
            }
        }
        b += n;
    }
    // Steps outside the blocks: with the block before them in forward order (the
    // first stage before any), backward steps with their forward node's.
    let last = per.len() - 1;
    let mut cur = 0;
    let mut by_node = HashMap::new();
    for (i, st) in s.steps.iter().enumerate() {
        match st.kind {
            StepKind::Forward => {
                let j = *vs[i].get_or_insert(cur);
                cur = j;
                if let Some(n) = st.node {
                    by_node.insert(n, j);
                }
            }
            StepKind::Loss => vs[i] = Some(last),
            StepKind::Backward if vs[i].is_none() => {
                vs[i] = Some(
                    st.node
                        .and_then(|n| by_node.get(&n).copied())
                        .unwrap_or(last),
                );
            }
            _ => {}
        }
    }
    Ok((vs, names))
}

/// Scales the optimizer's state and temporaries by the gradients left of `before`
/// bytes (they are made per parameter gradient).
pub(super) fn scale_optimizer(s: &mut Schedule, before: u64) {
    let after = s.bytes_where(|x| x.kind == StorageKind::ParamGrad);
    if before == 0 || after == before {
        return;
    }
    let scaled = |b: u64| (b as u128 * after as u128).div_ceil(before as u128) as u64;
    for st in &mut s.storages {
        if matches!(
            st.kind,
            StorageKind::OptimizerState | StorageKind::OptimizerTemp
        ) {
            st.pieces.iter_mut().for_each(|p| *p = scaled(*p));
            st.bytes = scaled(st.bytes);
        }
    }
}

/// Each pipeline rank's step of `s`, first stage first.
pub fn stages(s: &Schedule, p: &Pipeline) -> Result<Vec<(Schedule, StageSummary)>, String> {
    let (vs, names) = assign(s, p)?;
    let (np, v) = (p.stages, p.schedule.chunks());
    let nv = names.len();
    let mut out = Vec::new();
    for r in 0..np {
        let mine = |j: usize| j as u64 % np == r;
        let mut rank = s.clone();
        let keep: Vec<bool> = vs.iter().map(|j| j.is_none_or(mine)).collect();
        let mut it = keep.iter();
        rank.steps.retain(|_| *it.next().expect("one per step"));
        let summary = StageSummary {
            stage: r,
            blocks: (0..nv)
                .filter(|&j| mine(j))
                .flat_map(|j| names[j].clone())
                .collect(),
            chunks: (0..nv)
                .filter(|&j| mine(j))
                .map(|j| match names[j].as_slice() {
                    [one] => one.clone(),
                    [a, .., b] => format!("{a} … {b}"),
                    [] => String::new(),
                })
                .collect(),
            first: mine(0),
            last: mine(nv - 1),
            in_flight: p.schedule.in_flight(r, np, p.microbatches),
            ..Default::default()
        };
        out.push(stage_step(rank, summary, p.microbatches, v));
    }
    Ok(out)
}

/// Drops what rank's steps do not touch, keeps gradients across micro-batches and
/// adds the other micro-batches in flight.
fn stage_step(
    mut s: Schedule,
    mut summary: StageSummary,
    microbatches: u64,
    chunks: u64,
) -> (Schedule, StageSummary) {
    let grads_before = s.bytes_where(|x| x.kind == StorageKind::ParamGrad);
    let mut touched: HashSet<StorageId> = HashSet::new();
    let mut fwd: HashSet<StorageId> = HashSet::new();
    let mut bwd: HashSet<StorageId> = HashSet::new();
    for st in s.steps.iter().filter(|x| x.kind != StepKind::Optimizer) {
        let all = st.reads.iter().chain(&st.writes).chain(&st.updates);
        touched.extend(all.clone());
        match st.kind {
            StepKind::Forward => fwd.extend(all),
            StepKind::Backward => bwd.extend(&st.reads),
            _ => {}
        }
    }
    for (i, st) in s.storages.iter_mut().enumerate() {
        let opt = matches!(
            st.kind,
            StorageKind::OptimizerState | StorageKind::OptimizerTemp
        );
        if !opt && !touched.contains(&i) {
            st.bytes = 0;
            st.pieces.clear();
        }
        if st.kind == StorageKind::ParamGrad && microbatches > 1 {
            st.persistent = true;
        }
    }
    scale_optimizer(&mut s, grads_before);
    // One micro-batch's saved activations: made or received in forward, read in
    // backward.
    // Made from the weights alone (autocast's weight casts): once per step, not
    // per micro-batch.
    let fixed = |k: StorageId| {
        matches!(
            s.storages[k].kind,
            StorageKind::Parameter | StorageKind::Buffer | StorageKind::Constant
        )
    };
    let mut from_weights: HashSet<StorageId> = HashSet::new();
    for st in s.steps.iter().filter(|x| x.kind == StepKind::Forward) {
        if st
            .reads
            .iter()
            .all(|&r| fixed(r) || from_weights.contains(&r))
        {
            from_weights.extend(&st.writes);
        }
    }
    let mut ids: Vec<StorageId> = fwd
        .intersection(&bwd)
        .copied()
        .filter(|&k| {
            let st = &s.storages[k];
            !st.persistent && st.bytes > 0 && !from_weights.contains(&k)
        })
        .collect();
    ids.sort_unstable();
    let saved: Vec<u64> = ids.iter().map(|&k| s.storages[k].bytes).collect();
    let extra = summary.in_flight.saturating_sub(chunks);
    if extra > 0 && !saved.is_empty() {
        let pieces: Vec<u64> = (0..extra)
            .flat_map(|_| saved.iter().map(|&b| b.div_ceil(chunks)))
            .collect();
        summary.in_flight_bytes = pieces.iter().sum();
        let name = format!("pipeline: {extra} more micro-batches in flight");
        let id = s.add_storage(name, summary.in_flight_bytes, StorageKind::Activation);
        s.storages[id].saved = true;
        s.storages[id].pieces = pieces;
        // Live from the rank's first forward to its last backward: the optimizer
        // runs after every micro-batch is done.
        let first = s.steps.iter().position(|x| x.kind == StepKind::Forward);
        let last = s.steps.iter().rposition(|x| x.kind == StepKind::Backward);
        if let (Some(a), Some(b)) = (first, last) {
            s.steps[a].writes.push(id);
            s.steps[b].reads.push(id);
        }
    }
    summary.param_bytes = s.bytes_where(|x| x.kind == StorageKind::Parameter);
    (s, summary)
}
