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
use crate::ir::scope::{join, scopes};

/// Makes the last forward step of each module call read that call's arguments
/// (`persistent[s]`: storages live throughout, which need no holding).
pub fn hold_module_arguments(steps: &mut [Step], persistent: &[bool]) {
    let fwd: Vec<usize> = (0..steps.len())
        .filter(|&i| steps[i].kind == StepKind::Forward)
        .collect();
    // First forward step writing each storage.
    let mut written_at = vec![usize::MAX; persistent.len()];
    for &i in &fwd {
        for &w in &steps[i].writes {
            if written_at[w] == usize::MAX {
                written_at[w] = i;
            }
        }
    }
    // Module paths of each forward step, outermost first; `None`: scope-less.
    let paths: Vec<Option<Vec<String>>> = fwd
        .iter()
        .map(|&i| {
            let name = &steps[i].name;
            if !name.starts_with('/') {
                return None;
            }
            let mut q = String::new();
            Some(
                scopes(name)
                    .into_iter()
                    .map(|c| {
                        q = join(&q, c);
                        q.clone()
                    })
                    .collect(),
            )
        })
        .collect();
    // Open calls: (path, first step, last step so far, arguments).
    let mut open: Vec<(String, usize, usize, Vec<StorageId>)> = Vec::new();
    let mut holds: Vec<(usize, Vec<StorageId>)> = Vec::new();
    for (k, &i) in fwd.iter().enumerate() {
        let Some(path) = &paths[k] else {
            // A scope-less step inside a call reads as part of it.
            if let Some(top) = open.last() {
                let first = top.1;
                let args = args_of(&steps[i], first, &written_at, persistent);
                for o in open.iter_mut() {
                    o.3.extend(args.iter().copied().filter(|&s| written_at[s] < o.1));
                }
            }
            continue;
        };
        // Calls this step is not inside have returned.
        let depth = open
            .iter()
            .zip(path)
            .take_while(|(o, p)| &o.0 == *p)
            .count();
        for o in open.drain(depth..).rev() {
            holds.push((o.2, o.3));
        }
        for p in &path[depth..] {
            open.push((p.clone(), i, i, Vec::new()));
        }
        for o in open.iter_mut() {
            o.2 = i;
            let first = o.1;
            o.3.extend(args_of(&steps[i], first, &written_at, persistent));
        }
    }
    for o in open.into_iter().rev() {
        holds.push((o.2, o.3));
    }
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

/// Non-persistent storages `step` reads that were written before step `first`.
fn args_of(step: &Step, first: usize, written_at: &[usize], persistent: &[bool]) -> Vec<StorageId> {
    step.reads
        .iter()
        .copied()
        .filter(|&s| !persistent[s] && written_at[s] < first)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, reads: &[usize], writes: &[usize]) -> Step {
        Step {
            name: name.into(),
            op: "Op".into(),
            kind: StepKind::Forward,
            node: None,
            reads: reads.to_vec(),
            writes: writes.to_vec(),
            updates: Vec::new(),
            grad_inputs: Vec::new(),
            slots: Vec::new(),
            flops: 0,
        }
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
