//! Inference memory: every activation lives from the step of its producer to the
//! step of its last consumer (graph outputs to the end; graph inputs from step 0);
//! a tensor nobody reads lives only during its producer's step. Parameters
//! (floating-point initializers) and constants (other initializers and `Constant`
//! node outputs) are resident for the whole pass. No buffer reuse or in-place
//! execution is assumed: inputs and outputs of a step are live together.

use crate::infer::Inferred;
use crate::ir::{Graph, TensorId, TensorKind};

/// A tensor live at the peak.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LiveTensor {
    /// Tensor name.
    pub name: String,
    /// Bytes.
    pub bytes: u64,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: String,
    /// The node that produced it (`None` for graph inputs).
    pub producer: Option<String>,
}

/// The memory profile of one inference pass.
#[derive(Debug, Clone)]
pub struct InferenceProfile {
    /// Elements in parameters (floating-point initializers).
    pub params_count: u64,
    /// Bytes of parameters.
    pub params_bytes: u64,
    /// Bytes of constants (non-floating initializers, `Constant` outputs).
    pub constants_bytes: u64,
    /// Largest sum of live activation bytes (graph inputs and node outputs) at any step.
    pub activation_peak_bytes: u64,
    /// Step (index into the execution order) where the peak is reached.
    pub peak_step: Option<usize>,
    /// Node name at the peak.
    pub peak_node: Option<String>,
    /// Live activation bytes after each step.
    pub timeline: Vec<u64>,
    /// Activations live at the peak, largest first.
    pub live_at_peak: Vec<LiveTensor>,
}

impl InferenceProfile {
    /// Parameters + constants + activations at the peak.
    pub fn peak_bytes(&self) -> u64 {
        self.params_bytes + self.constants_bytes + self.activation_peak_bytes
    }
}

/// `[start, end]` steps during which each activation is live; `None` for
/// parameters and constants.
pub fn lifetimes(g: &Graph) -> Vec<Option<(usize, usize)>> {
    let last_use = g.last_use_step();
    let mut step_of = vec![usize::MAX; petgraph::visit::NodeIndexable::node_bound(&g.nodes)];
    for (s, &ix) in g.order.iter().enumerate() {
        step_of[ix.index()] = s;
    }
    let mut is_output = vec![false; g.tensors.len()];
    for &t in &g.outputs {
        is_output[t] = true;
    }
    let last = g.order.len().saturating_sub(1);
    (0..g.tensors.len())
        .map(|t| {
            let info = g.tensor(t);
            let start = match info.kind {
                TensorKind::Parameter | TensorKind::Constant => return None,
                TensorKind::Input => 0,
                TensorKind::Activation | TensorKind::Output => {
                    let s = step_of[info.producer?.index()];
                    assert!(s != usize::MAX, "a producer outside the execution order");
                    s
                }
            };
            let end = if is_output[t] {
                last
            } else {
                last_use[t].unwrap_or(start).max(start)
            };
            Some((start, end))
        })
        .collect()
}

/// Profiles one inference pass in the graph's execution order.
pub fn profile_inference(g: &Graph, inf: &Inferred) -> InferenceProfile {
    let mut params_count = 0u64;
    let mut params_bytes = 0u64;
    let mut constants_bytes = 0u64;
    for (t, info) in g.tensors.iter().enumerate() {
        match info.kind {
            TensorKind::Parameter => {
                params_count += inf.facts[t].numel();
                params_bytes += inf.bytes(t);
            }
            TensorKind::Constant => constants_bytes += inf.bytes(t),
            _ => {}
        }
    }
    let life = lifetimes(g);
    let steps = g.order.len().max(1);
    let mut delta = vec![0i128; steps + 1];
    for (t, l) in life.iter().enumerate() {
        if let Some((s, e)) = *l {
            let b = inf.bytes(t) as i128;
            delta[s] += b;
            delta[e + 1] -= b;
        }
    }
    let mut timeline = Vec::with_capacity(steps);
    let mut live = 0i128;
    for d in &delta[..steps] {
        live += d;
        timeline.push(live as u64);
    }
    let (peak_step, activation_peak_bytes) = timeline.iter().enumerate().fold(
        (0, 0),
        |best, (s, &b)| if b > best.1 { (s, b) } else { best },
    );
    let mut live_at_peak: Vec<(TensorId, u64)> = life
        .iter()
        .enumerate()
        .filter_map(|(t, l)| {
            l.filter(|&(s, e)| s <= peak_step && peak_step <= e)
                .map(|_| (t, inf.bytes(t)))
        })
        .collect();
    live_at_peak.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let live_at_peak = live_at_peak
        .into_iter()
        .map(|(t, bytes)| {
            let f = &inf.facts[t];
            LiveTensor {
                name: g.tensor(t).name.to_string(),
                bytes,
                shape: f.shape.clone(),
                dtype: f.dtype.name().to_string(),
                producer: g.tensor(t).producer.map(|p| g.node(p).name.to_string()),
            }
        })
        .collect();
    let has_nodes = !g.order.is_empty();
    InferenceProfile {
        params_count,
        params_bytes,
        constants_bytes,
        activation_peak_bytes,
        peak_step: has_nodes.then_some(peak_step),
        peak_node: has_nodes.then(|| g.node(g.order[peak_step]).name.to_string()),
        timeline: if has_nodes { timeline } else { Vec::new() },
        live_at_peak,
    }
}
