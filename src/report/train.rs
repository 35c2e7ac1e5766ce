//! The `training` object of `profile --train` and its text rendering.

use std::fmt::Write as _;

use serde::Serialize;

use super::{human_bytes, human_flops};
use crate::memory::device::{AllocatorReport, DeviceModel, DeviceSummary};
use crate::memory::simulate::CATEGORIES;
use crate::memory::{Breakdown, Replay};
use crate::train::{Schedule, StepKind, StorageKind, TrainOptions};

/// One timeline entry: bytes by category live during a step.
#[derive(Debug, Clone, Serialize)]
pub struct TimelinePoint {
    /// Step name.
    pub node: String,
    /// Phase.
    pub phase: StepKind,
    /// Bytes by category.
    #[serde(flatten)]
    pub bytes: Breakdown,
    /// Their sum.
    pub total: u64,
}

/// `training` in the profile JSON (keys are stable).
#[derive(Debug, Clone, Serialize)]
pub struct TrainingReport {
    /// Optimizer.
    pub optimizer: String,
    /// Precision policy.
    pub precision: String,
    /// Loss.
    pub loss: String,
    /// Peak bytes of the step.
    pub peak_bytes: u64,
    /// Step at the peak.
    pub peak_node: String,
    /// Its phase.
    pub peak_phase: StepKind,
    /// Parameters' bytes (trainable and frozen).
    pub params_bytes: u64,
    /// Bytes of the parameters that train (the rest are frozen: `--freeze`,
    /// `--trainable`).
    pub trainable_params_bytes: u64,
    /// Number of parameter tensors that train.
    pub trainable_params: usize,
    /// Number of frozen parameter tensors (no gradient, no optimizer state).
    pub frozen_params: usize,
    /// Non-trainable floating initializers and constants.
    pub buffers_bytes: u64,
    /// Parameter gradients' bytes.
    pub grads_bytes: u64,
    /// Optimizer state bytes.
    pub optimizer_bytes: u64,
    /// Distinct non-parameter tensors backward reads (model inputs included).
    pub saved_activation_bytes: u64,
    /// FLOPs of forward + backward + update.
    pub flops_per_step: u64,
    /// Forward FLOPs alone.
    pub flops_forward: u64,
    /// Bytes by category at the peak.
    pub breakdown: Breakdown,
    /// Bytes by category during each step.
    pub timeline: Vec<TimelinePoint>,
    /// The step under a module checkpointing preset (`profile --train --checkpoint`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointReport>,
    /// The step's allocations replayed through PyTorch's CUDA caching allocator
    /// (`memory::device`): allocated and reserved peaks as `torch.cuda` reports them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<AllocatorReport>,
    /// What the GPU holds, as nvidia-smi shows it for the process: the allocator's
    /// reserved bytes (cuBLAS workspaces included: PyTorch allocates them through
    /// it) plus the CUDA context.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_bytes: Option<u64>,
    /// What `device_bytes` assumes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceSummary>,
    /// What the file shows of an export for inference, which this step then
    /// misstates (`train::inference_export`), one line each; empty for a
    /// training-mode export.
    pub warnings: Vec<String>,
    /// Under FSDP2 (`--fsdp`): the units and what one rank shards, gathers and
    /// reduces; every other figure is then one rank's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsdp: Option<crate::parallel::FsdpSummary>,
    /// Under tensor, pipeline, context or expert parallelism: the layout and every
    /// pipeline stage; every other figure is then the worst rank's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel: Option<super::parallel::ParallelReport>,
}

/// The training step with modules checkpointed (`training.checkpoint` in the JSON).
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointReport {
    /// The preset (`every-block`, `every-block:selective`).
    pub preset: String,
    /// The checkpointed modules, in execution order.
    pub modules: Vec<String>,
    /// Those of them checkpointed selectively (their matrix products' and attention's
    /// outputs kept).
    pub selective_modules: Vec<String>,
    /// Peak bytes of the step under it (replayed).
    pub peak_bytes: u64,
    /// Non-fixed, non-held bytes live when forward ends, under it.
    pub saved_bytes_at_forward_end: u64,
    /// The same without checkpointing.
    pub baseline_saved_bytes_at_forward_end: u64,
    /// FLOPs recomputed.
    pub recompute_flops: f64,
    /// `recompute_flops` over the step's FLOPs without recomputation.
    pub overhead: f64,
}

impl CheckpointReport {
    /// The step of `s` checkpointed as `preset` says.
    pub fn of(
        s: &Schedule,
        preset: crate::remat::module_plan::Preset,
    ) -> crate::error::Result<CheckpointReport> {
        use crate::remat::modules::{saved_at_forward_end, ModuleTree};
        let g = crate::remat::from_schedule::from_schedule(s, "step");
        let p = preset
            .plan_in(&g, &ModuleTree::build(&g))
            .map_err(crate::error::Error::Graph)?;
        let base = g.base_cost();
        Ok(CheckpointReport {
            preset: preset.to_string(),
            selective_modules: p.selective,
            modules: p.modules,
            peak_bytes: p.peak_bytes,
            saved_bytes_at_forward_end: p.saved_bytes,
            baseline_saved_bytes_at_forward_end: saved_at_forward_end(&g, &g.no_recompute_plan()),
            recompute_flops: p.recompute_cost,
            overhead: if base > 0.0 {
                p.recompute_cost / base
            } else {
                0.0
            },
        })
    }

    fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "  checkpoint {}: {} modules{}",
            self.preset,
            self.modules.len(),
            if self.modules.is_empty() {
                " (no repeated blocks found)".to_string()
            } else {
                format!(" ({})", self.modules.join(", "))
            }
        );
        let _ = writeln!(
            s,
            "    peak {}, saved at forward end {} (without: {}), recompute {} ({:.2}% extra)",
            human_bytes(self.peak_bytes),
            human_bytes(self.saved_bytes_at_forward_end),
            human_bytes(self.baseline_saved_bytes_at_forward_end),
            human_flops(self.recompute_flops as u64),
            self.overhead * 100.0
        );
        s
    }
}

impl TrainingReport {
    /// Assembles the report from a schedule and its replay.
    pub fn new(opts: &TrainOptions, s: &Schedule, r: &Replay) -> TrainingReport {
        let by = |k: StorageKind| s.bytes_where(|st| st.kind == k);
        // The model's parameters (not FSDP's gathered copies, which hold no tensor).
        let of_tensor: std::collections::HashSet<usize> =
            s.tensor_storage.iter().copied().collect();
        let model_params = || {
            s.storages
                .iter()
                .enumerate()
                .filter(|&(k, st)| st.kind == StorageKind::Parameter && of_tensor.contains(&k))
                .map(|(_, st)| st)
        };
        let peak = &s.steps[r.peak_step];
        let flops_forward = s
            .steps
            .iter()
            .filter(|st| st.kind == StepKind::Forward)
            .fold(0u64, |a, st| a.saturating_add(st.flops));
        TrainingReport {
            optimizer: opts.optimizer.to_string(),
            precision: opts.precision.to_string(),
            loss: format!("{:?}", opts.loss).to_lowercase(),
            peak_bytes: r.peak().total(),
            peak_node: peak.name.clone(),
            peak_phase: peak.kind,
            params_bytes: model_params().map(|st| st.bytes).sum(),
            trainable_params_bytes: s
                .trainable
                .iter()
                .filter_map(|&t| s.storages.get(s.tensor_storage[t]))
                .map(|st| st.bytes)
                .sum(),
            trainable_params: s.trainable.len(),
            frozen_params: model_params().count().saturating_sub(s.trainable.len()),
            buffers_bytes: by(StorageKind::Buffer) + by(StorageKind::Constant),
            grads_bytes: by(StorageKind::ParamGrad),
            optimizer_bytes: by(StorageKind::OptimizerState),
            saved_activation_bytes: s.saved_activation_bytes(),
            flops_per_step: s.flops(),
            flops_forward,
            breakdown: r.peak(),
            timeline: s
                .steps
                .iter()
                .zip(&r.timeline)
                .map(|(st, b)| TimelinePoint {
                    node: st.name.clone(),
                    phase: st.kind,
                    bytes: *b,
                    total: b.total(),
                })
                .collect(),
            checkpoint: None,
            warnings: Vec::new(),
            fsdp: None,
            parallel: None,
            allocator: None,
            device_bytes: None,
            device: None,
        }
    }

    /// Adds the step replayed through the caching allocator on `d`.
    pub fn set_device(&mut self, d: &DeviceModel, a: AllocatorReport) {
        self.allocator = Some(a);
        self.device_bytes = Some(d.device_bytes(&a));
        self.device = Some(d.summary());
    }

    /// Text: the breakdown at the peak and a chart of the timeline.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\ntraining step ({} optimizer, {}, loss = {} of the first output)",
            self.optimizer, self.precision, self.loss
        );
        let _ = writeln!(
            s,
            "  peak {} during '{}' ({:?})",
            human_bytes(self.peak_bytes),
            self.peak_node,
            self.peak_phase
        );
        if let Some(f) = &self.fsdp {
            let _ = writeln!(
                s,
                "  one FSDP2 rank: {} units ({}{}), sharded parameters {}, largest unit gathered {}; per step {} all-gathered, {} reduce-scattered",
                f.units.len(),
                f.units.iter().take(2).cloned().collect::<Vec<_>>().join(", "),
                if f.units.len() > 2 { ", ..., root" } else { "" },
                human_bytes(f.sharded_param_bytes),
                human_bytes(f.largest_unit_bytes),
                human_bytes(f.all_gather_bytes),
                human_bytes(f.reduce_scatter_bytes)
            );
        }
        if let Some(p) = &self.parallel {
            s.push_str(&p.to_text());
        }
        if self.frozen_params > 0 {
            let _ = writeln!(
                s,
                "  trains {} parameter tensors ({}); {} frozen ({})",
                self.trainable_params,
                human_bytes(self.trainable_params_bytes),
                self.frozen_params,
                human_bytes(
                    self.params_bytes
                        .saturating_sub(self.trainable_params_bytes)
                )
            );
        }
        for c in CATEGORIES {
            let (name, v) = (c.label(), self.breakdown.get(c));
            let pct = if self.peak_bytes > 0 {
                v as f64 * 100.0 / self.peak_bytes as f64
            } else {
                0.0
            };
            let _ = writeln!(s, "    {name:<18} {:>12}  {pct:5.1}%", human_bytes(v));
        }
        let _ = writeln!(
            s,
            "  saved for backward {} (distinct non-parameter tensors backward reads)",
            human_bytes(self.saved_activation_bytes)
        );
        let _ = writeln!(
            s,
            "  compute {} per step ({} forward)",
            human_flops(self.flops_per_step),
            human_flops(self.flops_forward)
        );
        if let (Some(a), Some(d), Some(total)) = (&self.allocator, &self.device, self.device_bytes)
        {
            let _ = writeln!(
                s,
                "  on the GPU (PyTorch's caching allocator{}, simulated): allocated peak {}, reserved {} in {} segments ({} more than allocated)",
                if d.expandable_segments { ", expandable segments" } else { "" },
                human_bytes(a.allocated_peak_bytes),
                human_bytes(a.reserved_bytes),
                a.segments,
                human_bytes(a.fragmentation_bytes)
            );
            let _ =
                writeln!(
                s,
                "  nvidia-smi would show about {} for this process: reserved + CUDA context {}{}{}",
                human_bytes(total),
                human_bytes(d.context_bytes),
                d.gpu.as_ref().map(|g| format!(" ({g})")).unwrap_or_default(),
                d.nccl_bytes
                    .map(|n| format!(" + NCCL {}", human_bytes(n)))
                    .unwrap_or_default()
            );
        }
        if let Some(c) = &self.checkpoint {
            s.push_str(&c.to_text());
        }
        s.push_str(&self.chart(64, 8));
        s
    }

    /// A compact chart: total bytes over the steps, `rows` high, `cols` wide, with a
    /// phase ruler (f forward, b backward, o optimizer) underneath.
    pub fn chart(&self, cols: usize, rows: usize) -> String {
        let n = self.timeline.len();
        if n == 0 {
            return String::new();
        }
        let cols = cols.min(n);
        let buckets: Vec<(u64, StepKind)> = (0..cols)
            .map(|c| {
                let (a, z) = (c * n / cols, ((c + 1) * n / cols).max(c * n / cols + 1));
                let slice = &self.timeline[a..z];
                let max = slice.iter().map(|p| p.total).max().unwrap_or(0);
                (max, slice[slice.len() / 2].phase)
            })
            .collect();
        let top = buckets.iter().map(|b| b.0).max().unwrap_or(1).max(1);
        let mut s = String::from("\n  memory over the step:\n");
        for r in (0..rows).rev() {
            let label = if r == rows - 1 {
                human_bytes(top)
            } else if r == 0 {
                "0".to_string()
            } else {
                String::new()
            };
            let _ = write!(s, "  {label:>11} |");
            for &(v, _) in &buckets {
                let h = v as f64 / top as f64 * rows as f64;
                s.push(if h >= r as f64 + 1.0 {
                    '#'
                } else if h > r as f64 + 0.5 {
                    '+'
                } else {
                    ' '
                });
            }
            s.push('\n');
        }
        let ruler: String = buckets
            .iter()
            .map(|&(_, k)| match k {
                StepKind::Forward => 'f',
                StepKind::Loss => 'l',
                StepKind::Backward => 'b',
                StepKind::Optimizer => 'o',
            })
            .collect();
        let _ = writeln!(s, "  {:>11} +{}", "", "-".repeat(cols));
        let _ = writeln!(s, "  {:>11}  {ruler}", "phase");
        s
    }
}
