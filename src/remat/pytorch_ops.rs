//! An op plan as a Python module a PyTorch user applies: `plan --pytorch FILE`
//! without `--granularity module`.
//!
//! `torch.utils.checkpoint` reruns whole regions: it cannot drop one BatchNorm's
//! output and keep the convolution before it, which is what an op plan does. The file
//! does it with PyTorch's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`):
//! a value the plan recomputes is packed as a recipe (its aten op and arguments) instead
//! of the tensor, freed after forward, and computed again when backward first unpacks
//! it. The values are found in eager PyTorch by the module call the exporter's scope
//! names (`/layer1/layer1.0/relu_2/Relu`: the third call of `layer1.0.relu`), the ONNX
//! op's aten kind, and its rank among that call's ops of that kind
//! ([`Rerun`]); the runtime (src/remat/pytorch_rerun.py) is written into the file.
//!
//! What the file reproduces of the plan: which forward values are dropped after forward
//! and recomputed in backward, each from its inputs. When: PyTorch recomputes a value at
//! its first backward use and frees it after its last, where the plan may run it a little
//! earlier ([`super::hoist`]) or twice.

use crate::ir::scope::{join, scopes};

use super::graph::{Instr, RematGraph};
use super::module_plan::PytorchHeader;

/// The ONNX op types the runtime finds in eager PyTorch (its `_ATEN` table); a value
/// of another op is kept by the file (and listed in `model.memplan_missing`).
pub const RUNTIME_OPS: [&str; 26] = [
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Clip",
    "Concat",
    "Conv",
    "Div",
    "Dropout",
    "Elu",
    "Erf",
    "Gather",
    "Gelu",
    "HardSigmoid",
    "HardSwish",
    "LayerNormalization",
    "LeakyRelu",
    "MaxPool",
    "Mul",
    "Neg",
    "Pow",
    "Relu",
    "Sigmoid",
    "Softmax",
    "Sqrt",
    "Sub",
    "Tanh",
];

/// Whether the runtime can find forward node `i`'s value in eager PyTorch: its op is
/// one of [`RUNTIME_OPS`], and it is not a Linear's bias (an Add of a matrix product
/// and a parameter: PyTorch adds the bias inside `addmm`, so no aten op writes the
/// sum alone).
pub fn reruns_in_pytorch(g: &RematGraph, i: usize) -> bool {
    let n = &g.nodes[i];
    if !RUNTIME_OPS.contains(&n.op.as_str()) {
        return false;
    }
    let product = |v: usize| {
        g.values[v]
            .producer
            .is_some_and(|p| matches!(g.nodes[p].op.as_str(), "MatMul" | "Gemm"))
    };
    // (The step's Add may read more than its two operands: what a fused product keeps.)
    let bias_add = n.op == "Add"
        && n.inputs.iter().any(|&v| g.values[v].fixed)
        && n.inputs.iter().any(|&v| product(v));
    !bias_add
}

/// Makes the forward nodes the runtime cannot rerun ([`reruns_in_pytorch`]) not
/// recomputable, so that an op plan made for a PyTorch file recomputes only what the
/// file reproduces and its predicted peak is what PyTorch keeps. Returns the op types
/// so kept and how many of each, most first.
pub fn keep_what_pytorch_cannot_rerun(g: &mut RematGraph) -> Vec<(String, usize)> {
    let mut kept: std::collections::BTreeMap<String, usize> = Default::default();
    for i in 0..g.nodes.len() {
        let n = &g.nodes[i];
        if n.backward || !n.recomputable || n.outputs.is_empty() || reruns_in_pytorch(g, i) {
            continue;
        }
        // A node inside a fused kernel has no op of its own (`from_schedule`).
        let op = if n.op.is_empty() {
            "fused"
        } else {
            n.op.as_str()
        };
        *kept.entry(op.to_string()).or_default() += 1;
        g.nodes[i].recomputable = false;
    }
    let mut kept: Vec<(String, usize)> = kept.into_iter().collect();
    kept.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    kept
}

/// The values of `reruns` the runtime cannot find, as a one-line note (`None` if it
/// finds them all): ops outside [`RUNTIME_OPS`], and values with no module scope.
pub fn unreachable_note(reruns: &[Rerun]) -> Option<String> {
    let mut ops: Vec<&str> = reruns
        .iter()
        .filter(|r| !RUNTIME_OPS.contains(&r.op.as_str()))
        .map(|r| r.op.as_str())
        .collect();
    let n_ops = ops.len();
    ops.sort_unstable();
    ops.dedup();
    let unscoped = reruns.iter().filter(|r| r.scope.is_empty()).count();
    if n_ops == 0 && unscoped == 0 {
        return None;
    }
    let mut parts = Vec::new();
    if n_ops > 0 {
        parts.push(format!(
            "{n_ops} are ops it does not rerun ({})",
            ops.join(", ")
        ));
    }
    if unscoped > 0 {
        parts.push(format!(
            "{unscoped} have no module scope in their node names and are looked for in the model's own forward"
        ));
    }
    Some(format!(
        "of {} values to recompute, {}; PyTorch keeps those it does not find (model.memplan_missing)",
        reruns.len(),
        parts.join(", ")
    ))
}

/// The runtime written into every op-plan file.
pub const RUNTIME: &str = include_str!("pytorch_rerun.py");

/// One forward value the plan recomputes, as the runtime finds it in eager PyTorch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rerun {
    /// The module call that computes it: the exporter's scopes joined as module paths,
    /// a repeated call's suffix kept (`layer1.0.relu_2`); empty for the model itself.
    pub scope: String,
    /// ONNX op type.
    pub op: String,
    /// Rank among the nodes of this op type and output size directly in this scope, in
    /// graph order (sizes keep shape arithmetic, which exporters fold and PyTorch may
    /// run as aten ops, out of the count).
    pub rank: usize,
    /// Bytes of the value (its first output).
    pub bytes: u64,
    /// The value's name in the ONNX graph.
    pub value: String,
    /// Whether the node's other outputs are dropped after forward too (the plan has
    /// none of them live when forward ends): BatchNorm's batch statistics, MaxPool's
    /// indices, dropout's mask (drawn again from the random state forward used).
    pub rest: bool,
    /// Whether only those other outputs are dropped, the value itself kept (a MaxPool
    /// whose output stays for the next layer while its indices are recomputed):
    /// written `"rest"` in the file.
    pub only_rest: bool,
}

impl Rerun {
    /// Its line in the file's `RECOMPUTE` list.
    pub fn python_line(&self) -> String {
        format!(
            "    ({}, {}, {}, {}, {}, {}),\n",
            serde_json::json!(self.scope),
            serde_json::json!(self.op),
            self.rank,
            self.bytes,
            serde_json::json!(self.value),
            match (self.only_rest, self.rest) {
                (true, _) => "\"rest\"",
                (false, true) => "True",
                (false, false) => "False",
            }
        )
    }
}

/// The forward nodes `plan` runs more than once whose first output (the one the aten
/// op returns first) is not live when forward ends, or whose other outputs all are
/// not ([`Rerun::only_rest`]), in graph order: the values the plan drops after forward
/// and recomputes in backward.
pub fn reruns(g: &RematGraph, plan: &[Instr]) -> Vec<Rerun> {
    let count = super::plan::run_counts(g, plan);
    let live = super::modules::live_at_forward_end(g, plan);
    let mut seen: std::collections::HashMap<(String, String, u64), usize> = Default::default();
    let mut out = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if n.backward || n.op.is_empty() {
            continue;
        }
        let Some(&v) = n.outputs.first() else {
            continue;
        };
        let sc = scopes(&n.name);
        let rank = seen
            .entry((sc.join("/"), n.op.clone(), g.values[v].bytes))
            .or_insert(0);
        let r = *rank;
        *rank += 1;
        let rest = n.outputs.len() > 1 && n.outputs[1..].iter().all(|&w| !live[w]);
        if count[i] < 2 || (live[v] && !rest) {
            continue;
        }
        out.push(Rerun {
            scope: sc.iter().fold(String::new(), |q, c| join(&q, c)),
            op: n.op.clone(),
            rank: r,
            bytes: g.values[v].bytes,
            value: g.values[v].name.clone(),
            rest,
            only_rest: live[v],
        });
    }
    out
}

/// The Python module for an op plan: `RECOMPUTE` (scope, op, rank, bytes, value name,
/// rest per [`Rerun`]) and `apply(model)`, which installs the hooks.
pub fn pytorch_op_module(h: &PytorchHeader, reruns: &[Rerun]) -> String {
    let list: String = reruns.iter().map(Rerun::python_line).collect();
    format!(
        r#""""Recompute plan made by memplan (op granularity).

{header}
apply(model) makes every training forward of `model` drop the {n} values below after
forward and compute them again from their inputs when backward needs them (saved-tensor
hooks; the values are bitwise the same, BatchNorm's running statistics are not updated
again). Each entry: the module call (the exporter's scope; `relu_2` is the third call of
`relu`), the ONNX op, its rank among that call's ops of that kind and size, its bytes,
its name, and whether the op's other outputs (BatchNorm's batch statistics, MaxPool's
indices, dropout's mask) are dropped too ("rest": only they are, the value is kept).
PyTorch 2.1 or later; eager mode. For torch.compile (PyTorch 2.4 or later) call
compile_policy(model, *example_inputs) instead, before compiling: the compiler then
recomputes the same values, fused with their neighbours.
"""

RECOMPUTE = [
{list}]
{runtime}"#,
        header = h.lines(),
        n = reruns.len(),
        runtime = RUNTIME,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remat::graph::{RNode, RValue};

    fn node(name: &str, op: &str, inputs: Vec<usize>, out: usize) -> RNode {
        RNode {
            name: name.into(),
            cost: 1.0,
            inputs,
            outputs: vec![out],
            backward: false,
            recomputable: true,
            op: op.into(),
        }
    }

    #[test]
    fn reruns_name_the_module_call_and_rank() {
        let value = |name: &str, producer| RValue {
            name: name.into(),
            bytes: 64,
            producer,
            fixed: producer.is_none(),
            held: false,
        };
        let g = RematGraph {
            name: "t".into(),
            nodes: vec![
                node("/layer1/layer1.0/relu/Relu", "Relu", vec![0], 1),
                node("/layer1/layer1.0/Add", "Add", vec![1, 0], 2),
                node("/layer1/layer1.0/Add_1", "Add", vec![2, 0], 3),
                node("/layer1/layer1.0/relu_2/Relu", "Relu", vec![3], 4),
            ],
            values: vec![
                value("x", None),
                value("a", Some(0)),
                value("b", Some(1)),
                value("c", Some(2)),
                value("d", Some(3)),
            ],
        };
        // c and d dropped after forward (the last forward node is 3) and run again.
        use Instr::{Compute, Free};
        let plan = vec![
            Compute(0),
            Compute(1),
            Compute(2),
            Compute(3),
            Free(3),
            Free(4),
            Compute(2),
            Compute(3),
        ];
        let r = reruns(&g, &plan);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].scope.as_str(), r[0].op.as_str(), r[0].rank),
            ("layer1.0", "Add", 1)
        );
        assert_eq!(
            (r[1].scope.as_str(), r[1].op.as_str(), r[1].rank),
            ("layer1.0.relu_2", "Relu", 0)
        );
        let text = pytorch_op_module(
            &PytorchHeader {
                model: "m.onnx".into(),
                batch: Some(8),
                budget_bytes: Some(1000),
                peak_bytes: 900,
                method: "ilp".into(),
            },
            &r,
        );
        assert!(text.contains("    (\"layer1.0\", \"Add\", 1, 64, \"c\", False),\n"));
        // Only a node's other outputs dropped (MaxPool's indices): written "rest".
        let only = Rerun {
            rest: true,
            only_rest: true,
            ..r[0].clone()
        };
        assert!(only.python_line().ends_with(", \"c\", \"rest\"),\n"));
        assert!(text.contains("def apply(model):"));
    }
}

#[cfg(test)]
mod restriction_tests {
    use super::*;
    use crate::remat::graph::{replay, RNode, RValue};
    use crate::remat::heuristics::{candidates, plan_with_drops};

    /// x → MatMul(x, W) → Add(·, b) → Relu → Flatten → Mul; the backward reads the
    /// Relu's and the Flatten's outputs.
    fn graph() -> RematGraph {
        let value = |name: &str, producer: Option<usize>, fixed| RValue {
            name: name.into(),
            bytes: 100,
            producer,
            fixed,
            held: false,
        };
        let node = |name: &str, op: &str, inputs: Vec<usize>, out: usize, backward| RNode {
            name: name.into(),
            cost: 1.0,
            inputs,
            outputs: vec![out],
            backward,
            recomputable: !backward,
            op: op.into(),
        };
        RematGraph {
            name: "t".into(),
            nodes: vec![
                node("/fc/MatMul", "MatMul", vec![0, 1], 3, false),
                node("/fc/Add", "Add", vec![2, 3], 4, false),
                node("/act/Relu", "Relu", vec![4], 5, false),
                node("/Flatten", "Flatten", vec![5], 6, false),
                node("/Mul", "Mul", vec![6, 6], 7, false),
                node("/Mul/grad", "", vec![7, 6], 8, true),
                node("/act/Relu/grad", "", vec![8, 5], 9, true),
            ],
            values: vec![
                value("x", None, true),
                value("W", None, true),
                value("b", None, true),
                value("mm", Some(0), false),
                value("lin", Some(1), false),
                value("act", Some(2), false),
                value("flat", Some(3), false),
                value("out", Some(4), false),
                value("g_out", Some(5), false),
                value("g_act", Some(6), false),
            ],
        }
    }

    #[test]
    fn a_plan_for_pytorch_keeps_what_the_file_cannot_rerun() {
        let mut g = graph();
        assert!(!reruns_in_pytorch(&g, 0), "MatMul");
        assert!(!reruns_in_pytorch(&g, 1), "a Linear's bias: inside addmm");
        assert!(reruns_in_pytorch(&g, 2), "Relu");
        let kept = keep_what_pytorch_cannot_rerun(&mut g);
        assert_eq!(
            kept,
            vec![
                ("Add".to_string(), 1),
                ("Flatten".into(), 1),
                ("MatMul".into(), 1)
            ]
        );
        assert!(g.nodes[2].recomputable && !g.nodes[3].recomputable);
        // Dropping the Relu's output recomputes it from the bias Add's, which cannot
        // run again: that value stays live until the recompute (it was freed after
        // the Relu before, and the plan did not replay).
        let c = candidates(&g);
        assert!(
            c.contains(&5) && !c.contains(&4) && !c.contains(&6),
            "{c:?}"
        );
        let mut dropped = vec![false; g.values.len()];
        dropped[5] = true;
        let plan = plan_with_drops(&g, &dropped);
        let r = replay(&g, &plan).unwrap();
        assert_eq!(r.recompute_cost, 1.0, "only the Relu runs again");
    }
}

#[cfg(test)]
mod runtime_tests {
    use super::{RUNTIME, RUNTIME_OPS};

    #[test]
    fn the_runtime_knows_the_ops_listed() {
        for op in RUNTIME_OPS {
            assert!(RUNTIME.contains(&format!("    \"{op}\": (")), "{op}");
        }
        let table = &RUNTIME[RUNTIME.find("_ATEN = {").unwrap()..];
        let table = &table[..table.find("\n}").unwrap()];
        assert_eq!(table.matches("\": (").count(), RUNTIME_OPS.len());
    }
}
