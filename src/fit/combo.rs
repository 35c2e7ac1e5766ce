//! Strategies combined: a precision, a checkpointing scheme, a way over the GPUs
//! (or onto the host), and gradient accumulation; what each moves over the wires;
//! and the recommendation for a target global batch.
//!
//! Per-GPU memory: [`partition`] rewrites the step schedule's storages (data
//! parallel, ZeRO 1-3, ZeRO-Offload, ZeRO-Infinity's parameter offload). Traffic per
//! optimizer step of `k` micro-batches ([`traffic`]), with `G` the gradients' bytes
//! (the trainable parameters in the gradient dtype: ZeRO's Ψ), `Wt` the trainable
//! parameters' bytes and `W` all parameters' bytes as stored (`W = Wt = G` when
//! every parameter trains in the gradient dtype), counted as the ZeRO paper counts
//! (Rajbhandari et al. 2020, §7: an all-reduce moves 2Ψ per GPU, a reduce-scatter or
//! an all-gather Ψ; the ring's `(N−1)/N` is left out):
//!
//! | strategy | collective bytes per GPU | PCIe bytes per GPU | host bytes per GPU |
//! |---|---|---|---|
//! | data-parallel | `2G` (one all-reduce; `no_sync` on the other micro-batches) | 0 | 0 |
//! | zero-1 | `2G` (reduce-scatter at the boundary + all-gather of the updated parameters) | 0 | 0 |
//! | zero-2 | `k·G + Wt` (gradients are partitioned: reduce-scattered every micro-batch) | 0 | 0 |
//! | zero-3, fsdp2 | `k·(G + 2W)` (parameters gathered in forward and backward of every micro-batch) | 0 | 0 |
//! | fsdp2-no-reshard | `k·(G + W)` (gathered in forward, kept for backward) | 0 | 0 |
//! | zero-offload | as zero-2 (0 on one GPU) | `(k·G + Wt)/N` (gradients down, updated parameters up) | `(S + G)/N` |
//! | zero-3-offload | as zero-3 (0 on one GPU) | `k·(2W + G)/N` (parameters up in forward and backward, gradients down) | `(S + G + W)/N` |
//!
//! `S` is the optimizer state. ZeRO-Offload: Ren et al. 2021 (optimizer state and
//! gradients on the host, the update on the CPU, fp16 gradients down and parameters
//! up every step, §4.1). ZeRO-Infinity: Rajbhandari et al. 2021 (parameters offloaded
//! too, fetched for forward and backward).

use serde::Serialize;

use super::time::StepTime;
use crate::train::{Schedule, StorageKind};

/// Activation checkpointing of a combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ckpt {
    /// None.
    None,
    /// sqrt(n) equal segments.
    Sqrt,
    /// Every repeated block (`torch.utils.checkpoint`).
    EveryBlock,
    /// Every repeated block under a selective checkpoint that keeps matrix products'
    /// and attention's outputs (`--checkpoint every-block:selective`).
    EveryBlockSelective,
    /// Per repeated block, kept, selective or whole, planned for the card
    /// (`remat::blocks`; the planned row's block plans).
    Blocks,
}

/// How the step spreads over the GPUs or the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dist {
    /// One GPU.
    Single,
    /// DistributedDataParallel.
    DataParallel,
    /// ZeRO stage 1, 2 or 3.
    Zero(u8),
    /// ZeRO-Offload: optimizer state and gradients on the host (ZeRO-2 over GPUs).
    ZeroOffload,
    /// ZeRO-Infinity's CPU offload: parameters on the host too (ZeRO-3 over GPUs).
    Zero3Offload,
    /// FSDP2 (`fully_shard` per repeated block and on the root), resharding after
    /// forward or not ([`crate::parallel::fsdp`]).
    Fsdp {
        /// `reshard_after_forward`.
        reshard: bool,
    },
}

impl Dist {
    /// Name in reports (`None` for one GPU).
    pub fn name(self) -> Option<String> {
        match self {
            Dist::Single => None,
            Dist::DataParallel => Some("data-parallel".into()),
            Dist::Zero(k) => Some(format!("zero-{k}")),
            Dist::ZeroOffload => Some("zero-offload".into()),
            Dist::Zero3Offload => Some("zero-3-offload".into()),
            Dist::Fsdp { reshard: true } => Some("fsdp2".into()),
            Dist::Fsdp { reshard: false } => Some("fsdp2-no-reshard".into()),
        }
    }
}

/// Strategies combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Combo {
    /// Autocast mixed precision.
    pub mixed: bool,
    /// Checkpointing.
    pub ckpt: Ckpt,
    /// Over the GPUs.
    pub dist: Dist,
    /// Gradient accumulation (gradients stay allocated between micro-batches).
    pub accumulate: bool,
    /// Tensor and pipeline parallelism within each data-parallel replica.
    pub mp: Mp,
}

/// Tensor and pipeline degrees of a combination ([`crate::parallel`]): the GPUs
/// of one model replica are `tp·pp`, the data-parallel ranks the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mp {
    /// Tensor-parallel ranks (with sequence parallelism).
    pub tp: u64,
    /// Pipeline stages (1F1B, the micro-batches the accumulation steps).
    pub pp: u64,
}

impl Mp {
    /// One GPU per replica.
    pub const NONE: Mp = Mp { tp: 1, pp: 1 };

    /// GPUs per replica.
    pub fn ranks(self) -> u64 {
        self.tp * self.pp
    }

    /// The layout of one replica with `microbatches` micro-batches per step.
    pub fn layout(self, microbatches: u64) -> crate::parallel::Layout {
        crate::parallel::Layout {
            degrees: crate::parallel::Degrees {
                tp: self.tp,
                sequence_parallel: self.tp > 1,
                ..Default::default()
            },
            pipeline: (self.pp > 1).then(|| crate::parallel::Pipeline {
                stages: self.pp,
                microbatches: microbatches.max(self.pp),
                schedule: crate::parallel::PipeSchedule::OneFOneB,
                blocks: None,
            }),
        }
    }
}

impl Combo {
    /// The step as asked.
    pub const PLAIN: Combo = Combo {
        mixed: false,
        ckpt: Ckpt::None,
        dist: Dist::Single,
        accumulate: false,
        mp: Mp::NONE,
    };

    /// The strategies' names, in a fixed order.
    pub fn names(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.mixed {
            v.push("mixed-precision".to_string());
        }
        match self.ckpt {
            Ckpt::None => {}
            Ckpt::Sqrt => v.push("checkpointing-sqrt".into()),
            Ckpt::EveryBlock => v.push("checkpoint-every-block".into()),
            Ckpt::EveryBlockSelective => v.push("checkpoint-every-block-selective".into()),
            Ckpt::Blocks => v.push("checkpoint-blocks-planned".into()),
        }
        if self.mp.tp > 1 {
            v.push(format!("tp-{}", self.mp.tp));
        }
        if self.mp.pp > 1 {
            v.push(format!("pp-{}", self.mp.pp));
        }
        v.extend(self.dist.name());
        if self.accumulate {
            v.push("grad-accumulation".into());
        }
        v
    }

    /// The row name: the names joined by `+` (`as-exported` for none).
    pub fn name(&self) -> String {
        let v = self.names();
        if v.is_empty() {
            "as-exported".into()
        } else {
            v.join("+")
        }
    }

    /// GPUs the batch spreads over: the data-parallel ranks.
    pub fn gpus(&self, gpus: u64) -> u64 {
        match self.dist {
            Dist::Single => 1,
            _ => (gpus / self.mp.ranks()).max(1),
        }
    }
}

/// A persistent buffer of `bytes` added to the schedule.
fn add_buffer(s: &mut Schedule, name: &str, bytes: u64) {
    let b = s.add_storage(name.into(), bytes, StorageKind::Buffer);
    s.storages[b].persistent = true;
}

/// Per-GPU storages under data parallel, ZeRO and offload. ZeRO (Rajbhandari et al.
/// 2020): stage 1 partitions optimizer state, stage 2 also gradients, stage 3 also
/// parameters (each GPU then gathers one parameter tensor at a time; the largest is
/// counted whole). Data parallel keeps a full replica plus DDP's gradient buckets
/// (one more copy of the gradients, PyTorch's default without
/// `gradient_as_bucket_view`). Offload: optimizer state, its temporaries (the update
/// runs on the CPU) and gradients leave the GPU, which keeps one gradient being
/// copied out (the largest counted); `zero-3-offload` moves parameters too and
/// gathers one at a time, as ZeRO-3. Parameters that stay are kept in the schedule's
/// dtype (DeepSpeed under fp16 keeps fp16 parameters on the GPU and fp32 masters on
/// the host; memplan's mixed precision keeps fp32 masters on the GPU).
pub fn partition(s: &mut Schedule, dist: Dist, gpus: u64) {
    partition_in(s, dist, gpus, None);
}

/// [`partition`] with the module tree of `s` given (FSDP's units come from it; `None`:
/// built here).
pub fn partition_in(
    s: &mut Schedule,
    dist: Dist,
    gpus: u64,
    tree: Option<&crate::remat::modules::ModuleTree>,
) {
    let n = gpus.max(1);
    let largest = |s: &Schedule, k: StorageKind| {
        s.storages
            .iter()
            .filter(|x| x.kind == k)
            .map(|x| x.bytes)
            .max()
            .unwrap_or(0)
    };
    let (pmax, gmax) = (
        largest(s, StorageKind::Parameter),
        largest(s, StorageKind::ParamGrad),
    );
    match dist {
        Dist::Single => {}
        Dist::DataParallel => {
            // Buckets are allocated at construction and live through the step.
            let grads = s.bytes_where(|x| x.kind == StorageKind::ParamGrad);
            add_buffer(s, "ddp gradient buckets", grads);
        }
        Dist::Zero(stage) => {
            for x in &mut s.storages {
                let part = match x.kind {
                    StorageKind::OptimizerState | StorageKind::OptimizerTemp => stage >= 1,
                    StorageKind::ParamGrad => stage >= 2,
                    StorageKind::Parameter => stage >= 3,
                    _ => false,
                };
                if part {
                    x.bytes = x.bytes.div_ceil(n);
                }
            }
            if stage >= 3 && pmax > 0 {
                add_buffer(s, "zero-3 gathered parameter", pmax);
            }
        }
        Dist::ZeroOffload | Dist::Zero3Offload => {
            let params = dist == Dist::Zero3Offload;
            for x in &mut s.storages {
                if matches!(
                    x.kind,
                    StorageKind::OptimizerState
                        | StorageKind::OptimizerTemp
                        | StorageKind::ParamGrad
                ) || (params && x.kind == StorageKind::Parameter)
                {
                    x.bytes = 0;
                }
            }
            if gmax > 0 {
                add_buffer(s, "offload gradient staging", gmax);
            }
            if params && pmax > 0 {
                add_buffer(s, "zero-3 gathered parameter", pmax);
            }
        }
        Dist::Fsdp { reshard } => {
            let f = crate::parallel::Fsdp {
                shards: n,
                reshard_after_forward: reshard,
                ..Default::default()
            };
            // Only named units can be missing; these are the model's own blocks.
            let _ = match tree {
                Some(t) => crate::parallel::fsdp::shard_in(s, &f, t),
                None => crate::parallel::shard(s, &f),
            };
        }
    }
}

/// Bytes a combination moves per optimizer step and keeps on the host, per GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    /// Collective communication between GPUs (ZeRO's count, see the module doc).
    pub communication_bytes: u64,
    /// Host-device copies.
    pub pcie_bytes: u64,
    /// Host memory.
    pub host_bytes: u64,
}

/// `G`, `W` and `Wt` of the module documentation: the gradients', all parameters'
/// and the trainable parameters' bytes in `s`, unpartitioned.
pub fn state_bytes(s: &Schedule) -> (u64, u64, u64) {
    let g = s.bytes_where(|x| x.kind == StorageKind::ParamGrad);
    let w = s.bytes_where(|x| x.kind == StorageKind::Parameter);
    let wt: u64 = s
        .trainable
        .iter()
        .filter_map(|&t| s.storages.get(*s.tensor_storage.get(t)?))
        .map(|x| x.bytes)
        .sum();
    (g, w, wt)
}

/// [`Traffic`] of `dist` over `gpus` GPUs with `steps` micro-batches per optimizer
/// step, from the unpartitioned schedule `s`.
pub fn traffic(s: &Schedule, dist: Dist, gpus: u64, steps: u64) -> Traffic {
    let n = gpus.max(1);
    let k = steps.max(1);
    let (g, w, wt) = state_bytes(s);
    let st = s.bytes_where(|x| x.kind == StorageKind::OptimizerState);
    let multi = n > 1;
    let zero2 = k.saturating_mul(g).saturating_add(wt);
    let zero3 = k.saturating_mul(g.saturating_add(w.saturating_mul(2)));
    match dist {
        Dist::Single => Traffic::default(),
        Dist::DataParallel | Dist::Zero(1) => Traffic {
            communication_bytes: 2 * g,
            ..Default::default()
        },
        Dist::Zero(2) => Traffic {
            communication_bytes: zero2,
            ..Default::default()
        },
        Dist::Zero(_) | Dist::Fsdp { reshard: true } => Traffic {
            communication_bytes: zero3,
            ..Default::default()
        },
        // Gathered once per micro-batch, kept for backward.
        Dist::Fsdp { reshard: false } => Traffic {
            communication_bytes: k.saturating_mul(g.saturating_add(w)),
            ..Default::default()
        },
        Dist::ZeroOffload => Traffic {
            communication_bytes: if multi { zero2 } else { 0 },
            pcie_bytes: zero2.div_ceil(n),
            host_bytes: (st + g).div_ceil(n),
        },
        Dist::Zero3Offload => Traffic {
            communication_bytes: if multi { zero3 } else { 0 },
            pcie_bytes: k
                .saturating_mul(w.saturating_mul(2).saturating_add(g))
                .div_ceil(n),
            host_bytes: (st + g + w).div_ceil(n),
        },
    }
}

/// One way to reach the target global batch.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The strategies.
    pub combo: Combo,
    /// Per-GPU micro-batch.
    pub micro_batch: u64,
    /// Micro-batches per optimizer step.
    pub steps: u64,
    /// GPUs.
    pub gpus: u64,
    /// Peak per GPU at `micro_batch`.
    pub peak_bytes: u64,
    /// Extra compute.
    pub overhead: f64,
    /// Traffic per optimizer step.
    pub traffic: Traffic,
    /// Estimated time of an optimizer step (with a card: [`super::time`]).
    pub time: Option<StepTime>,
}

impl Candidate {
    /// Samples per optimizer step.
    pub fn global_batch(&self) -> u64 {
        self.micro_batch * self.steps * self.gpus
    }

    /// The order of preference: least estimated step time (where both have one, to
    /// the microsecond), then least extra compute, least communication, least PCIe
    /// traffic, fewest accumulation steps, fewest strategies, lowest peak.
    pub fn cmp_pref(&self, o: &Candidate) -> std::cmp::Ordering {
        // Overheads are ratios of FLOPs: equal within rounding.
        let ov = |x: f64| (x * 1e9).round() as i64;
        let us = |t: Option<StepTime>| t.map(|t| (t.total_s * 1e6).round() as i64);
        let time = match (us(self.time), us(o.time)) {
            (Some(a), Some(b)) => a.cmp(&b),
            _ => std::cmp::Ordering::Equal,
        };
        time.then(ov(self.overhead).cmp(&ov(o.overhead)))
            .then(
                self.traffic
                    .communication_bytes
                    .cmp(&o.traffic.communication_bytes),
            )
            .then(self.traffic.pcie_bytes.cmp(&o.traffic.pcie_bytes))
            .then(self.steps.cmp(&o.steps))
            .then(self.combo.names().len().cmp(&o.combo.names().len()))
            .then(self.peak_bytes.cmp(&o.peak_bytes))
    }

    /// Why `self` comes before `o` (the first count that differs).
    pub fn why_over(&self, o: &Candidate) -> String {
        let (a, b) = (self.combo.name(), o.combo.name());
        let hb = crate::units::human_bytes;
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let ov = |x: f64| (x * 1e9).round() as i64;
        let us = |t: &StepTime| (t.total_s * 1e6).round() as i64;
        if let (Some(x), Some(y)) = (&self.time, &o.time) {
            if us(x) != us(y) {
                let hs = super::time::human_seconds;
                return format!(
                    "{a} wins over {b}: a shorter estimated step ({} vs {}: compute {} vs {}, exposed communication {} vs {}, recompute {} vs {})",
                    hs(x.total_s),
                    hs(y.total_s),
                    hs(x.compute_s),
                    hs(y.compute_s),
                    hs(x.exposed_communication_s + x.pcie_s),
                    hs(y.exposed_communication_s + y.pcie_s),
                    hs(x.recompute_s),
                    hs(y.recompute_s)
                );
            }
        }
        if ov(self.overhead) != ov(o.overhead) {
            format!(
                "{a} wins over {b}: less extra compute ({} vs {})",
                pct(self.overhead),
                pct(o.overhead)
            )
        } else if self.traffic.communication_bytes != o.traffic.communication_bytes {
            format!(
                "{a} wins over {b}: the same extra compute ({}), less communication per step ({} vs {})",
                pct(self.overhead),
                hb(self.traffic.communication_bytes),
                hb(o.traffic.communication_bytes)
            )
        } else if self.traffic.pcie_bytes != o.traffic.pcie_bytes {
            format!(
                "{a} wins over {b}: the same extra compute and communication, less PCIe traffic per step ({} vs {})",
                hb(self.traffic.pcie_bytes),
                hb(o.traffic.pcie_bytes)
            )
        } else if self.steps != o.steps {
            format!(
                "{a} wins over {b}: the same extra compute and traffic, fewer accumulation steps ({} vs {})",
                self.steps, o.steps
            )
        } else if self.combo.names().len() != o.combo.names().len() {
            format!(
                "{a} wins over {b}: the same extra compute, traffic and steps, with fewer strategies"
            )
        } else if self.peak_bytes != o.peak_bytes {
            let (p, q) = if hb(self.peak_bytes) == hb(o.peak_bytes) {
                (
                    format!("{} bytes", self.peak_bytes),
                    format!("{} bytes", o.peak_bytes),
                )
            } else {
                (hb(self.peak_bytes), hb(o.peak_bytes))
            };
            format!(
                "{a} wins over {b}: the same extra compute, traffic and steps, a lower peak ({p} vs {q})"
            )
        } else {
            format!(
                "{a} ties with {b} on extra compute, traffic, steps and peak ({}); the simpler one (listed first) is chosen",
                hb(self.peak_bytes)
            )
        }
    }
}

/// `fit`'s answer for `--target-batch`: the preferred combination.
#[derive(Debug, Clone, Serialize)]
pub struct Recommendation {
    /// The strategies combined.
    pub strategies: Vec<String>,
    /// Per-GPU micro-batch.
    pub micro_batch: u64,
    /// Micro-batches per optimizer step.
    pub accumulation_steps: u64,
    /// Samples per optimizer step over all GPUs (at least the target).
    pub global_batch: u64,
    /// Peak bytes per GPU at `micro_batch`.
    pub peak_bytes: u64,
    /// Extra compute as a fraction of the step's FLOPs.
    pub overhead: f64,
    /// Host memory per GPU (offload).
    pub host_bytes: u64,
    /// Collective communication per GPU per optimizer step.
    pub communication_bytes: u64,
    /// Host-device copies per GPU per optimizer step (offload).
    pub pcie_bytes: u64,
    /// Why it wins over the next combination.
    pub why: String,
    /// Estimated time of one optimizer step and its parts (with a card).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_time: Option<StepTime>,
    /// The link the communication time assumes (with a card, over several GPUs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interconnect: Option<super::time::Interconnect>,
}

impl Recommendation {
    /// From the winner and the runner-up.
    pub fn new(c: &Candidate, next: Option<&Candidate>) -> Recommendation {
        Recommendation {
            strategies: match c.combo.names() {
                v if v.is_empty() => vec![c.combo.name()],
                v => v,
            },
            micro_batch: c.micro_batch,
            accumulation_steps: c.steps,
            global_batch: c.global_batch(),
            peak_bytes: c.peak_bytes,
            overhead: c.overhead,
            host_bytes: c.traffic.host_bytes,
            communication_bytes: c.traffic.communication_bytes,
            pcie_bytes: c.traffic.pcie_bytes,
            step_time: c.time,
            interconnect: None,
            why: match next {
                Some(n) => c.why_over(n),
                None => format!("{} is the only combination that reaches it", c.combo.name()),
            },
        }
    }
}

/// The ways over the GPUs a combination takes: on more than one GPU DDP, ZeRO 1
/// to 3 and the two offloads; on one, that GPU alone and the offloads.
pub fn dists(gpus: u64) -> Vec<Dist> {
    if gpus > 1 {
        vec![
            Dist::DataParallel,
            Dist::Zero(1),
            Dist::Zero(2),
            Dist::Zero(3),
            Dist::Fsdp { reshard: true },
            Dist::Fsdp { reshard: false },
            Dist::ZeroOffload,
            Dist::Zero3Offload,
        ]
    } else {
        vec![Dist::Single, Dist::ZeroOffload, Dist::Zero3Offload]
    }
}

/// The combinations `fit` tries for a target batch: both precisions, each
/// checkpointing scheme, and every way over the GPUs (on more than one GPU all of
/// them are used; on one, the offloads), each with gradient accumulation when the
/// micro-batch alone falls short.
pub fn combos(gpus: u64) -> Vec<Combo> {
    let dists = dists(gpus);
    let mut v = Vec::new();
    for mixed in [false, true] {
        for ckpt in [
            Ckpt::None,
            Ckpt::Sqrt,
            Ckpt::EveryBlock,
            Ckpt::EveryBlockSelective,
        ] {
            for &dist in &dists {
                v.push(Combo {
                    mixed,
                    ckpt,
                    dist,
                    accumulate: false,
                    mp: Mp::NONE,
                });
            }
        }
    }
    v.extend(model_parallel(gpus));
    v
}

/// The tensor- and pipeline-parallel combinations on `gpus` GPUs: tensor
/// parallelism (with sequence parallelism) over 2 and over up to 8, 2 and 4
/// pipeline stages, and 2 × 2; ZeRO-1 over the data-parallel ranks that remain;
/// 2-way tensor parallelism also with every block checkpointed, and with FSDP2 over
/// the data-parallel ranks.
fn model_parallel(gpus: u64) -> Vec<Combo> {
    let layouts = [
        Mp { tp: 2, pp: 1 },
        Mp {
            tp: gpus.min(8),
            pp: 1,
        },
        Mp { tp: 1, pp: 2 },
        Mp { tp: 1, pp: 4 },
        Mp { tp: 2, pp: 2 },
    ];
    let mut v: Vec<Combo> = Vec::new();
    for mp in layouts {
        if gpus < 2 || mp.ranks() > gpus || gpus % mp.ranks() != 0 {
            continue;
        }
        let dist = if gpus / mp.ranks() > 1 {
            Dist::Zero(1)
        } else {
            Dist::Single
        };
        let ckpts: &[Ckpt] = if mp.pp > 1 || mp.tp > 2 {
            &[Ckpt::None]
        } else {
            &[Ckpt::None, Ckpt::EveryBlock]
        };
        for &ckpt in ckpts {
            let c = Combo {
                mixed: false,
                ckpt,
                dist,
                accumulate: mp.pp > 1,
                mp,
            };
            if !v.contains(&c) {
                v.push(c);
            }
        }
        // 2-D: FSDP2 over the data-parallel ranks of 2-way tensor parallelism
        // (torchtitan's layout).
        if mp == (Mp { tp: 2, pp: 1 }) && dist != Dist::Single {
            v.push(Combo {
                mixed: false,
                ckpt: Ckpt::None,
                dist: Dist::Fsdp { reshard: true },
                accumulate: false,
                mp,
            });
        }
    }
    v
}
