//! A training [`Schedule`] as a [`RematGraph`]: one node per step, one value per
//! storage. Persistent storages are fixed; held storages (model outputs, loss,
//! parameter gradients) are held. Only forward steps may be recomputed: backward steps
//! accumulate gradients and the loss and optimizer have effects.

use super::graph::{RNode, RValue, RematGraph};
use crate::train::{Schedule, StepKind};

/// Converts a schedule. The no-recompute plan of the result has exactly the peak
/// that [`crate::memory::simulate`] gives the schedule.
pub fn from_schedule(s: &Schedule, name: &str) -> RematGraph {
    let mut producer = vec![None; s.storages.len()];
    for (i, st) in s.steps.iter().enumerate() {
        for &w in &st.writes {
            producer[w].get_or_insert(i);
        }
    }
    let values = s
        .storages
        .iter()
        .enumerate()
        .map(|(k, st)| RValue {
            name: st.name.clone(),
            bytes: st.bytes,
            producer: if st.persistent { None } else { producer[k] },
            fixed: st.persistent || producer[k].is_none(),
            held: st.held,
        })
        .collect();
    let nodes = s
        .steps
        .iter()
        .map(|st| {
            // A step's own writes are not inputs (partial gradients and optimizer
            // temporaries are written and read within one step).
            let mut inputs: Vec<usize> = st
                .reads
                .iter()
                .chain(&st.updates)
                .copied()
                .filter(|v| !st.writes.contains(v))
                .collect();
            inputs.sort_unstable();
            inputs.dedup();
            RNode {
                name: st.name.clone(),
                cost: st.flops as f64,
                inputs,
                outputs: st.writes.clone(),
                backward: !matches!(st.kind, StepKind::Forward),
                recomputable: st.kind == StepKind::Forward,
                // A node inside a fused kernel is not an op PyTorch dispatches.
                op: if st.fused {
                    String::new()
                } else {
                    st.op.clone()
                },
            }
        })
        .collect();
    RematGraph {
        name: name.to_string(),
        nodes,
        values,
    }
}
