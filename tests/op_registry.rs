//! The registry-wide test: every registered op has a row here, and every row is
//! checked the same way.
//!
//! - **Shape and FLOPs.** Inference gives the row's output shapes and FLOPs. These
//!   are worked out by hand from the op's documented cost.
//! - **Kernel.** The CPU kernel's outputs have the inferred dtypes and shapes,
//!   and the values inference folded (small integer tensors) where it did.
//!   A row marked `no_cpu_kernel` instead expects the kernel to say it has none.
//! - **Backward.** Where the backward rule gives a gradient to a float input, the
//!   kernel's gradient passes the finite-difference check of
//!   tests/exec_backward.rs (`common::opcase::check`).
//! - **Facts.** Every op states its device kernels: no family match gives
//!   `CudaKernels::UNLISTED`.
//!
//! CPU against emulated CUDA for every op with device kernels is
//! tests/cuda.rs's `every_device_op_has_a_case`. A new op fails here until it
//! has its row.

mod common;

use std::collections::BTreeSet;

use common::opcase::*;
use memplan::exec::Tensor;
use memplan::ir::{Attr, DType};
use memplan::ops::{registry, Cx, KernelCx, Launch};

/// One op application, what inference must give for it, and how its kernel runs.
struct Row {
    case: Case,
    shapes: Vec<Vec<usize>>,
    flops: u64,
    /// The CPU executor has no kernel for it (it must say so).
    no_cpu_kernel: bool,
    /// Its backward cannot run on the CPU: LpPool's and GlobalLpPool's rules save
    /// too little (tests/exec_backward.rs `kernels_refuse_unsaved_tensors`),
    /// GlobalMaxPool's kernel makes no indices yet, LpNormalization has none yet,
    /// RoiAlign's max mode has no PyTorch gradient (its rule refuses).
    no_backward_kernel: bool,
    /// A sampled output (Bernoulli): its gradient is zero by definition (as
    /// PyTorch's), and a finite difference jumps wherever a draw flips.
    sampled: bool,
}

fn row(case: Case, shapes: &[&[usize]], flops: u64) -> Row {
    Row {
        case,
        shapes: shapes.iter().map(|s| s.to_vec()).collect(),
        flops,
        no_cpu_kernel: false,
        no_backward_kernel: false,
        sampled: false,
    }
}

impl Row {
    fn no_cpu_kernel(mut self) -> Row {
        self.no_cpu_kernel = true;
        self
    }
    fn no_backward_kernel(mut self) -> Row {
        self.no_backward_kernel = true;
        self
    }
    fn sampled(mut self) -> Row {
        self.sampled = true;
        self
    }
}

fn s(v: &str) -> Attr {
    Attr::String(v.into())
}

fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

fn i64s(v: &[i64]) -> Tensor {
    Tensor::i64(vec![v.len()], v.to_vec())
}

fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v])
}

fn int_scalar(v: i64) -> Tensor {
    Tensor::i64(vec![], vec![v])
}

/// Unary rows: op, FLOPs per element, input range (kept away from kinks and
/// outside the domain's edges).
const UNARY: &[(&str, u64, f32, f32)] = &[
    ("Identity", 0, -1.0, 1.0),
    ("Relu", 1, 0.1, 1.0),
    ("Neg", 1, -1.0, 1.0),
    ("Abs", 1, 0.1, 1.0),
    ("Floor", 1, 0.1, 0.4),
    ("Ceil", 1, 0.1, 0.4),
    ("Round", 1, 0.1, 0.4),
    ("Sign", 1, 0.1, 0.4),
    ("Sqrt", 1, 0.5, 2.0),
    ("Reciprocal", 1, 0.5, 2.0),
    ("Exp", 1, -1.0, 1.0),
    ("Log", 1, 0.5, 2.0),
    ("Erf", 1, -1.0, 1.0),
    ("Sin", 1, -1.0, 1.0),
    ("Cos", 1, -1.0, 1.0),
    ("Tan", 1, -1.0, 1.0),
    ("Tanh", 1, -1.0, 1.0),
    ("Atan", 1, -1.0, 1.0),
    ("LeakyRelu", 1, 0.1, 1.0),
    ("ThresholdedRelu", 1, 1.2, 2.0),
    ("Sigmoid", 3, -1.0, 1.0),
    ("HardSigmoid", 3, -2.0, 2.0),
    ("HardSwish", 4, -2.0, 2.0),
    ("Softplus", 3, -1.0, 1.0),
    ("Softsign", 3, 0.1, 1.0),
    ("Elu", 3, -1.0, -0.1),
    ("Selu", 4, 0.1, 1.0),
    ("Celu", 4, -1.0, -0.1),
    ("Mish", 6, -1.0, 1.0),
    ("Gelu", 8, -1.0, 1.0),
    ("Asin", 1, -0.8, 0.8),
    ("Acos", 1, -0.8, 0.8),
    ("Sinh", 1, -1.0, 1.0),
    ("Cosh", 1, -1.0, 1.0),
    ("Asinh", 1, -1.0, 1.0),
    ("Acosh", 1, 1.2, 2.0),
    ("Atanh", 1, -0.8, 0.8),
    ("Swish", 4, -1.0, 1.0),
    ("Shrink", 2, 0.6, 1.0),
];

/// One row per registered op (a few ops have two, for a second form), in one order
/// (one random stream): the families' files in turn.
fn rows() -> Vec<Row> {
    let mut r = Rng(12);
    let mut v = Vec::new();
    elementwise_shape::rows(&mut r, &mut v);
    linalg_conv_norm::rows(&mut r, &mut v);
    signal::rows(&mut r, &mut v);
    sequence_spatial::rows(&mut r, &mut v);
    window3d::rows(&mut r, &mut v);
    v
}

#[path = "op_registry/elementwise_shape.rs"]
mod elementwise_shape;
#[path = "op_registry/linalg_conv_norm.rs"]
mod linalg_conv_norm;
#[path = "op_registry/sequence_spatial.rs"]
mod sequence_spatial;
#[path = "op_registry/signal.rs"]
mod signal;
#[path = "op_registry/window3d.rs"]
mod window3d;

#[test]
fn every_registered_op_has_a_row() {
    let reg = registry();
    let names: BTreeSet<&str> = reg.names().into_iter().collect();
    let rows: BTreeSet<&str> = rows().iter().map(|r| r.case.op).collect();
    let missing: Vec<_> = names.difference(&rows).collect();
    let stale: Vec<_> = rows.difference(&names).collect();
    assert!(
        missing.is_empty(),
        "registered ops without a row: {missing:?}"
    );
    assert!(stale.is_empty(), "rows for ops not registered: {stale:?}");
}

#[test]
fn shape_rules_flops_and_cpu_kernels_agree() {
    let reg = registry();
    let mut failures = Vec::new();
    for row in rows() {
        let case = &row.case;
        let rule = reg.get("", case.op).unwrap();
        let node = case.node();
        let facts = case.facts();
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Some).collect(),
            opset: case.opset,
        };
        let outs = match rule.infer(&cx) {
            Ok(o) => o,
            Err(e) => {
                failures.push(format!("{}: infer: {e}", case.op));
                continue;
            }
        };
        let shapes: Vec<Vec<usize>> = outs.iter().map(|f| f.shape.clone()).collect();
        if shapes != row.shapes {
            failures.push(format!(
                "{}: shapes {shapes:?}, row says {:?}",
                case.op, row.shapes
            ));
        }
        let flops = rule.flops(&cx, &outs);
        if flops != row.flops {
            failures.push(format!(
                "{}: {flops} FLOPs, row says {}",
                case.op, row.flops
            ));
        }
        let kcx = KernelCx {
            node: &node,
            inputs: case.inputs.iter().map(Some).collect(),
            outputs: outs.iter().map(Some).collect(),
            opset: case.opset,
            seed: 7,
            dropout: true,
            extras: false,
        };
        match (rule.forward_cpu(&kcx), row.no_cpu_kernel) {
            (Ok(ts), false) => {
                // Folded constants are what the kernel computes.
                for (k, (t, f)) in ts.iter().zip(&outs).enumerate() {
                    let Some(v) = &f.value else { continue };
                    let folded: Vec<f64> = (0..v.data.len()).map(|i| v.data.float(i)).collect();
                    if folded != t.to_f64s() {
                        failures.push(format!(
                            "{}: output {k} folds to {folded:?}, the kernel gives {:?}",
                            case.op,
                            t.to_f64s()
                        ));
                    }
                }
                for (k, (t, f)) in ts.iter().zip(&outs).enumerate() {
                    if (t.dtype(), &t.shape) != (f.dtype, &f.shape) {
                        failures.push(format!(
                            "{}: output {k} is {} {:?}, inferred {} {:?}",
                            case.op,
                            t.dtype(),
                            t.shape,
                            f.dtype,
                            f.shape
                        ));
                    }
                }
                if ts.len() < outs.len() {
                    failures.push(format!(
                        "{}: {} outputs of {}",
                        case.op,
                        ts.len(),
                        outs.len()
                    ));
                }
            }
            (Err(e), false) => failures.push(format!("{}: kernel: {e}", case.op)),
            (Ok(_), true) => failures.push(format!(
                "{}: has a CPU kernel now; drop no_cpu_kernel from its row",
                case.op
            )),
            (Err(e), true) => {
                if !e.to_string().contains("no kernel") {
                    failures.push(format!("{}: expected no kernel, got: {e}", case.op));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn differentiable_rows_pass_finite_differences() {
    let reg = registry();
    let mut st = Stats::default();
    let mut r = Rng(99);
    let mut checked = 0;
    let mut failures = Vec::new();
    for row in rows() {
        let case = &row.case;
        if row.no_cpu_kernel || row.no_backward_kernel || row.sampled {
            continue;
        }
        let rule = reg.get("", case.op).unwrap();
        let node = case.node();
        let facts = case.facts();
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Some).collect(),
            opset: case.opset,
        };
        let outs = rule.infer(&cx).unwrap();
        let Some(bw) = rule.backward(&cx, &outs).unwrap() else {
            continue;
        };
        let differentiable = bw.grads.iter().any(|g| {
            g.input < case.inputs.len()
                && case.inputs[g.input].dtype().is_float()
                && !case.consts.contains(&g.input)
        });
        if differentiable {
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                check(case, &mut r, &mut st)
            }));
            match res {
                Ok(()) => checked += 1,
                Err(e) => failures.push(format!(
                    "{}: {}",
                    case.op,
                    e.downcast_ref::<String>()
                        .map_or("panicked", |s| s.as_str())
                )),
            }
        }
    }
    report("registry", &st);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked > 60, "only {checked} rows differentiated");
}

#[test]
fn every_op_states_its_device_kernels() {
    let reg = registry();
    for name in reg.names() {
        let k = reg.get("", name).unwrap().cuda_kernels(name);
        assert!(
            k.listed,
            "{name}: its family's cuda_kernels has no arm for it"
        );
        assert_eq!(
            k.forward.is_empty(),
            k.launch == Launch::Host,
            "{name}: kernels without a launcher, or a launcher without kernels"
        );
    }
}
