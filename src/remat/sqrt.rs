//! The sqrt(n) baseline (Chen et al. 2016): cut the forward pass into about √n
//! segments of equal length; keep only the tensors that cross a segment boundary
//! (and the inputs); during backward, re-run each segment's forward just before its
//! backward, then free it.

use crate::train::{Schedule, Step, StepKind, StorageId, StorageKind};

/// Result of a rewrite.
#[derive(Debug, Clone)]
pub struct Rewritten {
    /// The new schedule.
    pub schedule: Schedule,
    /// FLOPs of the recompute steps.
    pub recompute_flops: u64,
    /// Number of segments.
    pub segments: usize,
}

/// Rewrites `s` with `segments` (0: ⌈√n⌉) equal segments of forward steps.
pub fn checkpoint_sqrt(s: &Schedule, segments: usize) -> Rewritten {
    let fwd: Vec<usize> = (0..s.steps.len())
        .filter(|&i| s.steps[i].kind == StepKind::Forward)
        .collect();
    let n = fwd.len();
    let k = if segments == 0 {
        ((n as f64).sqrt().ceil() as usize).max(1)
    } else {
        segments.clamp(1, n.max(1))
    };
    let mut seg = vec![usize::MAX; s.steps.len()];
    for (p, &i) in fwd.iter().enumerate() {
        seg[i] = p * k / n.max(1);
    }
    // Segment that writes each storage (forward only).
    let mut written_in = vec![usize::MAX; s.storages.len()];
    for &i in &fwd {
        for &w in &s.steps[i].writes {
            written_in[w] = seg[i];
        }
    }
    // Checkpoints: written in one segment and read by a later segment's forward.
    let mut keep = vec![false; s.storages.len()];
    for &i in &fwd {
        for &r in &s.steps[i].reads {
            if written_in[r] != usize::MAX && written_in[r] < seg[i] {
                keep[r] = true;
            }
        }
    }
    // Backward steps by the segment of their forward node.
    let node_seg: std::collections::HashMap<_, usize> = fwd
        .iter()
        .filter_map(|&i| s.steps[i].node.map(|n| (n, seg[i])))
        .collect();
    let mut steps: Vec<Step> = Vec::with_capacity(s.steps.len() * 2);
    let mut recompute_flops = 0u64;
    let mut done = vec![false; k];
    for st in &s.steps {
        if st.kind == StepKind::Backward {
            if let Some(j) = st.node.and_then(|n| node_seg.get(&n).copied()) {
                if !done[j] {
                    done[j] = true;
                    for &i in fwd.iter().filter(|&&i| seg[i] == j) {
                        let f = &s.steps[i];
                        let writes: Vec<StorageId> =
                            f.writes.iter().copied().filter(|&w| !keep[w]).collect();
                        recompute_flops = recompute_flops.saturating_add(f.flops);
                        steps.push(Step {
                            node: f.node,
                            slots: f.slots.clone(),
                            fused: f.fused,
                            ..Step::new(
                                format!("{}/recompute", f.name),
                                f.op.clone(),
                                StepKind::Backward,
                                f.reads.clone(),
                                writes,
                                f.flops,
                            )
                        });
                    }
                }
            }
        }
        steps.push(st.clone());
    }
    let mut schedule = s.clone();
    schedule.steps = steps;
    // Storages only produced for backward stay "saved"; non-kept activations now live
    // twice (forward use, then recomputed for backward).
    for (id, st) in schedule.storages.iter_mut().enumerate() {
        if keep[id] && st.kind == StorageKind::Activation {
            st.saved = true;
        }
    }
    Rewritten {
        schedule,
        recompute_flops,
        segments: k,
    }
}
