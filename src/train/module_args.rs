//! A module call holds its arguments until it returns.
//!
//! In eager PyTorch, `y = self.layer1(x)` keeps `x` alive for the whole call: the
//! caller's frame (and `Module.__call__`'s `args` tuple) references it until
//! `layer1` returns, even after the last op inside `layer1` that reads it. Where
//! backward saves the argument this changes nothing; where it does not (a frozen
//! backbone, an activation no gradient reads) the argument outlives its last reader.
//! ResNet-50 training only its `fc` peaks in `layer1`'s forward while holding the
//! stem's output, which memplan would otherwise have freed.
//!
//! A call is a maximal run of forward steps whose node names lie under one module
//! scope (the exporter's names, [`crate::ir::scope`]). Scope-less steps (the
//! exporter's constants, unnamed nodes) neither break nor start a run; a step of the
//! top level (`/Flatten`) ends every run. Its arguments are the non-persistent
//! storages its steps read that were written before the run began; the run's last
//! step reads them too, so every consumer of a [`Schedule`] (replay, the device
//! replay, the executor, the recompute planners) keeps them that long.

use super::schedule::{Step, StepKind, StorageId};
use crate::ir::scope::scopes;

/// Makes the last forward step of each module call read that call's arguments
/// (`persistent[s]`: storages live throughout, which need no holding).
pub fn hold_module_arguments(steps: &mut [Step], persistent: &[bool]) {
    let holds = module_call_arguments(steps, persistent);
    for (last, mut args) in holds {
        args.sort_unstable();
        args.dedup();
        let step = &mut steps[last];
        for s in args {
            if !step.reads.contains(&s) && !step.writes.contains(&s) {
                step.reads.push(s);
            }
        }
    }
}

/// Each module call's last forward step and its arguments (unsorted, maybe
/// repeated). A call is matched by its scope components, depth by depth (equal
/// components give equal module paths, [`crate::ir::scope::join`]).
fn module_call_arguments(steps: &[Step], persistent: &[bool]) -> Vec<(usize, Vec<StorageId>)> {
    // First forward step writing each storage.
    let mut written_at = vec![usize::MAX; persistent.len()];
    for (i, st) in steps.iter().enumerate() {
        if st.kind == StepKind::Forward {
            for &w in &st.writes {
                if written_at[w] == usize::MAX {
                    written_at[w] = i;
                }
            }
        }
    }
    let is_arg = |s: StorageId, first: usize| !persistent[s] && written_at[s] < first;
    // Open calls, outermost first: (scope component, first step, last step so far,
    // arguments).
    let mut open: Vec<(&str, usize, usize, Vec<StorageId>)> = Vec::new();
    let mut holds = Vec::new();
    for (i, st) in steps.iter().enumerate() {
        if st.kind != StepKind::Forward {
            continue;
        }
        if !st.name.starts_with('/') {
            // A scope-less step inside a call reads as part of it.
            for o in open.iter_mut() {
                o.3.extend(st.reads.iter().copied().filter(|&s| is_arg(s, o.1)));
            }
            continue;
        }
        let path = scopes(&st.name);
        // Calls this step is not inside have returned.
        let depth = open
            .iter()
            .zip(&path)
            .take_while(|(o, c)| o.0 == **c)
            .count();
        for o in open.drain(depth..).rev() {
            holds.push((o.2, o.3));
        }
        open.extend(path[depth..].iter().map(|&c| (c, i, i, Vec::new())));
        for o in open.iter_mut() {
            o.2 = i;
            o.3.extend(st.reads.iter().copied().filter(|&s| is_arg(s, o.1)));
        }
    }
    holds.extend(open.into_iter().rev().map(|o| (o.2, o.3)));
    holds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, reads: &[usize], writes: &[usize]) -> Step {
        Step::new(
            name,
            "Op",
            StepKind::Forward,
            reads.to_vec(),
            writes.to_vec(),
            0,
        )
    }

    #[test]
    fn a_call_reads_its_arguments_until_it_returns() {
        // 0: the batch; 1: the stem's output, the argument of `layer1` and of its
        // first block; 3: the first block's output, the second block's argument.
        let mut steps = vec![
            step("/stem/Conv", &[0], &[1]),
            step("/layer1/layer1.0/conv1/Conv", &[1], &[2]),
            step("/layer1/layer1.0/Relu", &[2], &[3]),
            step("Constant_5", &[], &[4]),
            step("/layer1/layer1.1/conv1/Conv", &[3, 4], &[5]),
            step("/Flatten", &[5], &[6]),
            step("/fc/Gemm", &[6], &[7]),
        ];
        let mut persistent = vec![false; 8];
        persistent[0] = true;
        hold_module_arguments(&mut steps, &persistent);
        let reads: Vec<Vec<usize>> = steps.iter().map(|s| s.reads.clone()).collect();
        assert_eq!(
            reads,
            vec![
                vec![0],
                vec![1],
                vec![2, 1],
                vec![],
                vec![3, 4, 1],
                vec![5],
                vec![6],
            ]
        );
    }
}
