//! `plan`'s text and JSON renderings (the JSON is `PlanReport`'s keys plus `graph`,
//! `recomputed_modules`, `cost_unit` and [`Granularity`]'s keys: a public interface,
//! keys only added).

use std::fmt::Write as _;

use serde::Serialize;

use crate::memory::device::{AllocatorReport, DeviceModel, DeviceSummary};
use crate::remat::costs::CostUnit;
use crate::remat::graph::RematGraph;
use crate::remat::pareto::fmt_cost;
use crate::remat::plan::PlanReport;
use crate::units::human_bytes;

/// What a plan says about modules (`plan --granularity`, `--checkpoint`): added to
/// the JSON object as its keys.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Granularity {
    /// `op` (single ops recomputed) or `module` (modules checkpointed as PyTorch does).
    pub granularity: String,
    /// The modules to wrap in `torch.utils.checkpoint` (empty for op plans: see
    /// `recomputed_modules` there, which checkpointing does not reproduce).
    pub checkpoint_modules: Vec<String>,
    /// Module plans: those of `checkpoint_modules` checkpointed selectively (their
    /// convolutions' and matrix products' outputs kept; `--selective`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub selective_modules: Vec<String>,
    /// Module plans: those of `checkpoint_modules` offloaded to host memory instead
    /// (`--offload-modules`, `every-block:offload`): their saved activations copied
    /// to the host after forward and back before backward, nothing recomputed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub offloaded_modules: Vec<String>,
    /// Offload: host memory the offloaded activations take.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_bytes: Option<u64>,
    /// Offload: bytes over PCIe per step (to the host once, back before each backward
    /// read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pcie_bytes: Option<u64>,
    /// Offload with `--gpu`: `pcie_bytes` at the card's PCIe link rate, seconds per
    /// step (the `--pytorch` file's hooks copy on the compute stream: nothing overlaps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pcie_seconds: Option<f64>,
    /// Non-fixed, non-held bytes live when forward ends (what forward keeps for
    /// backward; inputs, parameters and model outputs not counted).
    pub saved_bytes_at_forward_end: u64,
    /// Module plans: whether no cheaper module plan fits (none fits: none has a lower
    /// peak).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proven_optimal: Option<bool>,
    /// Module search: candidate modules (checkpointable, dropping something).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module_candidates: Option<usize>,
    /// Module search: module sets replayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module_sets_evaluated: Option<usize>,
    /// Module plans: forward nodes outside every module (no scope in their names).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unscoped_nodes: Vec<String>,
    /// Module plans: modules that run in more than one piece (called twice, shared),
    /// which cannot be checkpointed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub excluded_modules: Vec<String>,
}

/// `plan --json`'s object.
pub fn plan_json(
    r: &PlanReport,
    graph: &str,
    modules: &[String],
    unit: CostUnit,
    gran: &Granularity,
) -> serde_json::Result<serde_json::Value> {
    let mut v = serde_json::to_value(r)?;
    v["graph"] = serde_json::json!(graph);
    v["recomputed_modules"] = serde_json::json!(modules);
    v["cost_unit"] = serde_json::json!(unit);
    if let serde_json::Value::Object(extra) = serde_json::to_value(gran)? {
        for (k, x) in extra {
            v[k] = x;
        }
    }
    Ok(v)
}

/// A planned step on the device (`plan` of a model): the plan and the step without
/// recomputation, replayed through PyTorch's caching allocator (docs/ALLOCATOR.md).
#[derive(Debug, Clone, Serialize)]
pub struct PlanDevice {
    /// The planned step's allocator figures (`torch.cuda` peaks, simulated).
    pub allocator: AllocatorReport,
    /// The planned step's reserved bytes plus the CUDA context: what nvidia-smi
    /// shows.
    pub device_bytes: u64,
    /// The same without recomputation.
    pub baseline_allocator: AllocatorReport,
    /// Its reserved bytes plus the context.
    pub baseline_device_bytes: u64,
    /// What the figures assume.
    pub device: DeviceSummary,
}

impl PlanDevice {
    /// From the two replays on `d`.
    pub fn new(d: &DeviceModel, planned: AllocatorReport, baseline: AllocatorReport) -> Self {
        PlanDevice {
            device_bytes: d.device_bytes(&planned),
            baseline_device_bytes: d.device_bytes(&baseline),
            allocator: planned,
            baseline_allocator: baseline,
            device: d.summary(),
        }
    }

    /// Two lines for the table.
    pub fn to_text(&self) -> String {
        format!(
            "on the GPU (caching allocator, simulated): reserved {} ({} more than allocated), {} without recomputation\nnvidia-smi would show about {} (without recomputation {}), with a CUDA context of {}\n",
            human_bytes(self.allocator.reserved_bytes),
            human_bytes(self.allocator.fragmentation_bytes),
            human_bytes(self.baseline_allocator.reserved_bytes),
            human_bytes(self.device_bytes),
            human_bytes(self.baseline_device_bytes),
            human_bytes(self.device.context_bytes)
        )
    }
}

/// `plan`'s table.
pub fn plan_text(
    r: &PlanReport,
    g: &RematGraph,
    graph: &str,
    modules: &[String],
    unit: CostUnit,
    gran: &Granularity,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "graph        {graph} ({} nodes, {} values)",
        g.nodes.len(),
        g.values.len()
    );
    if gran.granularity == "module" {
        let _ = writeln!(s, "planner      {}", r.method);
    } else {
        let _ = writeln!(s, "solver       {:?}", r.solver);
    }
    let _ = writeln!(
        s,
        "budget       {}  -> {}",
        human_bytes(r.budget_bytes),
        if r.feasible { "feasible" } else { "INFEASIBLE" }
    );
    let _ = writeln!(
        s,
        "peak         {} (no recompute: {})",
        human_bytes(r.peak_bytes),
        human_bytes(r.baseline_peak_bytes)
    );
    let _ = writeln!(
        s,
        "lowest       {} reachable; op-local bound {}",
        human_bytes(r.min_feasible_bytes),
        human_bytes(r.op_local_bound_bytes)
    );
    if r.proven_floor_bytes > r.op_local_bound_bytes {
        let _ = writeln!(
            s,
            "proven       no schedule peaks under {} (every schedule searched)",
            human_bytes(r.proven_floor_bytes)
        );
    }
    let _ = writeln!(
        s,
        "overhead     {:.2}% extra compute (lower bound {:.2}%)",
        r.overhead * 100.0,
        r.lower_bound_overhead * 100.0
    );
    let _ = writeln!(
        s,
        "cost         {} recomputed, {} per step without recomputation ({unit})",
        fmt_cost(r.recompute_flops, unit),
        fmt_cost(r.baseline_flops, unit)
    );
    let _ = writeln!(
        s,
        "recomputed   {} tensors; {} instructions; solved in {:.3} s",
        r.recomputed.len(),
        r.schedule_len,
        r.solve_seconds
    );
    let _ = writeln!(
        s,
        "saved        {} at forward end",
        human_bytes(gran.saved_bytes_at_forward_end)
    );
    if gran.granularity == "module" {
        let _ = writeln!(
            s,
            "granularity  module ({}; lower bound {:.2}%)",
            match gran.proven_optimal {
                Some(true) => "proven optimal among module plans",
                Some(false) => "heuristic, not proven optimal",
                None => "modules as given, not searched",
            },
            r.lower_bound_overhead * 100.0
        );
        let _ = writeln!(
            s,
            "checkpoint   {} modules: {}",
            gran.checkpoint_modules.len(),
            if gran.checkpoint_modules.is_empty() {
                "(none)".to_string()
            } else {
                gran.checkpoint_modules
                    .iter()
                    .map(|m| {
                        if gran.selective_modules.contains(m) {
                            format!("{m} (selective)")
                        } else if gran.offloaded_modules.contains(m) {
                            format!("{m} (offloaded)")
                        } else {
                            m.clone()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        if let (Some(h), Some(p)) = (gran.host_bytes, gran.pcie_bytes) {
            let time = gran
                .pcie_seconds
                .map(|t| format!(", {t:.3} s at the card's PCIe link rate"))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "offload      {} of activations in host memory; {} over PCIe per step{time}",
                human_bytes(h),
                human_bytes(p)
            );
        }
        if !gran.unscoped_nodes.is_empty() {
            let shown: Vec<&str> = gran
                .unscoped_nodes
                .iter()
                .take(5)
                .map(|x| x.as_str())
                .collect();
            let _ = writeln!(
                s,
                "no module    {} forward nodes have no module scope (never checkpointed): {}{}",
                gran.unscoped_nodes.len(),
                shown.join(", "),
                if gran.unscoped_nodes.len() > 5 {
                    ", ..."
                } else {
                    ""
                }
            );
        }
        if !gran.excluded_modules.is_empty() {
            let _ = writeln!(
                s,
                "excluded     {} modules run in more than one piece (called twice or shared)",
                gran.excluded_modules.len()
            );
        }
    } else if !modules.is_empty() {
        let _ = writeln!(s, "modules to checkpoint: {}", modules.join(", "));
    }
    s
}
