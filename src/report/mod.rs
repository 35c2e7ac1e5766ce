//! Reports: the `profile` JSON object (a public interface: keys are only ever added)
//! and its human-readable rendering.

use std::fmt::Write as _;

pub mod bench;
pub mod fit;
pub mod html;
pub mod parallel;
pub mod plan;
pub mod train;

use serde::Serialize;

use crate::infer::Inferred;
use crate::ir::{Model, TensorKind};
use crate::memory::{InferenceProfile, LiveTensor};

pub use crate::units::{human_bytes, human_flops};

/// A graph input or output as reported.
#[derive(Debug, Clone, Serialize)]
pub struct IoInfo {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: String,
    /// Concrete shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub bytes: u64,
}

/// `params` in the JSON.
#[derive(Debug, Clone, Serialize)]
pub struct ParamsJson {
    /// Elements in floating-point initializers.
    pub count: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// `constants` in the JSON.
#[derive(Debug, Clone, Serialize)]
pub struct ConstantsJson {
    /// Bytes of non-floating initializers and `Constant` outputs.
    pub bytes: u64,
}

/// `flops` in the JSON.
#[derive(Debug, Clone, Serialize)]
pub struct FlopsJson {
    /// FLOPs of one forward pass (a multiply-add counts 2).
    pub forward: u64,
}

/// `inference` in the JSON.
#[derive(Debug, Clone, Serialize)]
pub struct InferenceJson {
    /// Parameters + constants + activations live at the peak.
    pub peak_bytes: u64,
    /// Activations (graph inputs and node outputs) live at the peak.
    pub activation_peak_bytes: u64,
    /// Node at which the peak is reached.
    pub peak_node: Option<String>,
    /// Its position in the execution order.
    pub peak_step: Option<usize>,
    /// The largest tensors live at the peak (at most 10), largest first.
    pub largest_live: Vec<LiveTensor>,
}

/// One row of the optional tensor table.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    /// Name.
    pub name: String,
    /// Role.
    pub kind: TensorKind,
    /// Element type.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub bytes: u64,
}

/// One row of the optional node table.
#[derive(Debug, Clone, Serialize)]
pub struct NodeRow {
    /// Node name.
    pub name: String,
    /// Op type.
    pub op: String,
    /// FLOPs.
    pub flops: u64,
    /// Live activation bytes after this step.
    pub live_bytes: u64,
}

/// The `profile` result.
#[derive(Debug, Clone, Serialize)]
pub struct ProfileReport {
    /// Model path as given.
    pub model: String,
    /// `ir_version`.
    pub ir_version: i64,
    /// Default-domain opset.
    pub opset: i64,
    /// Producer name and version.
    pub producer: String,
    /// Node count.
    pub nodes: usize,
    /// Tensor count.
    pub tensors: usize,
    /// Batch size in effect.
    pub batch: Option<u64>,
    /// The routing assumption that sized a mixture-of-experts model's experts
    /// (`--moe-routing`); absent for a model without experts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_routing: Option<crate::moe::RoutingSummary>,
    /// Graph inputs.
    pub inputs: Vec<IoInfo>,
    /// Graph outputs.
    pub outputs: Vec<IoInfo>,
    /// Parameters.
    pub params: ParamsJson,
    /// Constants.
    pub constants: ConstantsJson,
    /// FLOPs.
    pub flops: FlopsJson,
    /// Inference memory.
    pub inference: InferenceJson,
    /// The training step (only with `--train`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub training: Option<train::TrainingReport>,
    /// Every tensor (only with `--detail`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor_table: Option<Vec<TensorRow>>,
    /// Every node in execution order (only with `--detail`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_table: Option<Vec<NodeRow>>,
}

impl ProfileReport {
    /// Assembles the report.
    pub fn new(
        path: &str,
        model: &Model,
        inf: &Inferred,
        prof: &InferenceProfile,
        detail: bool,
    ) -> ProfileReport {
        let g = &model.graph;
        let io = |ts: &[usize]| {
            ts.iter()
                .map(|&t| IoInfo {
                    name: g.tensor(t).name.to_string(),
                    dtype: inf.facts[t].dtype.name().into(),
                    shape: inf.facts[t].shape.clone(),
                    bytes: inf.bytes(t),
                })
                .collect()
        };
        let tensor_table = detail.then(|| {
            g.tensors
                .iter()
                .enumerate()
                .map(|(t, info)| TensorRow {
                    name: info.name.to_string(),
                    kind: info.kind,
                    dtype: inf.facts[t].dtype.name().into(),
                    shape: inf.facts[t].shape.clone(),
                    bytes: inf.bytes(t),
                })
                .collect()
        });
        let node_table = detail.then(|| {
            g.order
                .iter()
                .enumerate()
                .map(|(s, &ix)| NodeRow {
                    name: g.node(ix).name.to_string(),
                    op: g.node(ix).op_type.to_string(),
                    flops: inf.flops[s],
                    live_bytes: prof.timeline.get(s).copied().unwrap_or(0),
                })
                .collect()
        });
        ProfileReport {
            model: path.to_string(),
            ir_version: model.ir_version,
            opset: model.opset(),
            producer: model.producer.clone(),
            nodes: g.order.len(),
            tensors: g.tensors.len(),
            batch: inf.batch,
            moe_routing: inf.routing.clone(),
            inputs: io(&g.inputs),
            outputs: io(&g.outputs),
            params: ParamsJson {
                count: prof.params_count,
                bytes: prof.params_bytes,
            },
            constants: ConstantsJson {
                bytes: prof.constants_bytes,
            },
            flops: FlopsJson {
                forward: inf.total_flops(),
            },
            inference: InferenceJson {
                peak_bytes: prof.peak_bytes(),
                activation_peak_bytes: prof.activation_peak_bytes,
                peak_node: prof.peak_node.clone(),
                peak_step: prof.peak_step,
                largest_live: prof.live_at_peak.iter().take(10).cloned().collect(),
            },
            training: None,
            tensor_table,
            node_table,
        }
    }

    /// The human-readable table.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let shape = |v: &[usize]| {
            format!(
                "[{}]",
                v.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let _ = writeln!(s, "model        {}", self.model);
        let _ = writeln!(
            s,
            "format       IR {}, opset {}{}",
            self.ir_version,
            self.opset,
            if self.producer.is_empty() {
                String::new()
            } else {
                format!(", from {}", self.producer)
            }
        );
        let _ = writeln!(
            s,
            "graph        {} nodes, {} tensors, batch {}",
            self.nodes,
            self.tensors,
            self.batch.map_or("-".to_string(), |b| b.to_string())
        );
        if let Some(r) = &self.moe_routing {
            let _ = writeln!(s, "experts      {}", r.line());
        }
        for (label, list) in [("input ", &self.inputs), ("output", &self.outputs)] {
            for io in list {
                let _ = writeln!(
                    s,
                    "{label}       {} {} {} ({})",
                    io.name,
                    io.dtype,
                    shape(&io.shape),
                    human_bytes(io.bytes)
                );
            }
        }
        let _ = writeln!(
            s,
            "parameters   {} elements, {} (floating-point initializers: weights and buffers)",
            group_digits(self.params.count),
            human_bytes(self.params.bytes)
        );
        let _ = writeln!(
            s,
            "constants    {} (integer initializers and Constant nodes)",
            human_bytes(self.constants.bytes)
        );
        let _ = writeln!(
            s,
            "forward      {} (multiply-add = 2)",
            human_flops(self.flops.forward)
        );
        let inf = &self.inference;
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "inference peak {} = parameters {} + constants {} + live activations {}",
            human_bytes(inf.peak_bytes),
            human_bytes(self.params.bytes),
            human_bytes(self.constants.bytes),
            human_bytes(inf.activation_peak_bytes)
        );
        if let (Some(node), Some(step)) = (&inf.peak_node, inf.peak_step) {
            let _ = writeln!(
                s,
                "  reached at node '{node}' (step {} of {})",
                step + 1,
                self.nodes
            );
        }
        if !inf.largest_live.is_empty() {
            let _ = writeln!(s, "  largest tensors live at the peak:");
            let _ = writeln!(s, "  {:>12}  {:<8} {:<22} name", "bytes", "dtype", "shape");
            for t in &inf.largest_live {
                let _ = writeln!(
                    s,
                    "  {:>12}  {:<8} {:<22} {}",
                    human_bytes(t.bytes),
                    t.dtype,
                    shape(&t.shape),
                    t.name
                );
            }
        }
        if let Some(t) = &self.training {
            s.push_str(&t.to_text());
        }
        if let Some(nodes) = &self.node_table {
            let _ = writeln!(
                s,
                "\n  {:>5}  {:<20} {:>14} {:>12}  node",
                "step", "op", "flops", "live"
            );
            for (i, n) in nodes.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "  {:>5}  {:<20} {:>14} {:>12}  {}",
                    i + 1,
                    n.op,
                    human_flops(n.flops),
                    human_bytes(n.live_bytes),
                    n.name
                );
            }
        }
        s
    }
}

fn group_digits(n: u64) -> String {
    let d = n.to_string();
    let mut out = String::new();
    for (i, c) in d.chars().enumerate() {
        if i > 0 && (d.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_flops(1_820_000_000), "1.82 GFLOP");
        assert_eq!(group_digits(11689512), "11,689,512");
    }
}
