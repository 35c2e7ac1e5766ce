//! Control flow and sequences lowered to plain ops (src/lower.rs), on models as the
//! exporters write them.
//!
//! Data: tests/data/lowering/export.py wrote the .onnx files and expected.json
//! (onnxruntime 1.32's outputs on fixed inputs; torch 2.15, onnx 1.23.2):
//! - `dynamo_split`: dynamo with `optimize=False`: chunk, split and unbind as
//!   SplitToSequence + SequenceAt;
//! - `scripted_control`: torch.jit.script through the TorchScript exporter: a Loop
//!   over the batch rows (trip count folded from the bound batch) growing a list
//!   (SequenceEmpty / SequenceInsert / ConcatFromSequence), an If on a shape;
//! - `scan_rnn`: a tanh RNN as Scan over axis 1, its body reading main-graph weights;
//! - `if_dynamic`: an If on a graph input, which memplan refuses.

use std::path::PathBuf;
use std::process::Command;

use memplan::exec::{Executor, Options, Tensor};
use memplan::infer::lower::{is_lowered, lowered};
use memplan::infer::{infer, Bindings};
use memplan::ir::Model;
use memplan::onnx::load_model;
use serde_json::Value;

fn path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/lowering/{name}.onnx"))
}

fn expected() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/lowering/expected.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn batch(n: u64) -> Bindings {
    Bindings {
        batch: Some(n),
        ..Default::default()
    }
}

fn lowered_at(name: &str, b: u64) -> Model {
    lowered(load_model(&path(name)).unwrap(), &batch(b)).unwrap()
}

fn op_count(m: &Model, op: &str) -> usize {
    m.graph
        .order
        .iter()
        .filter(|&&ix| m.graph.node(ix).op_type == op)
        .count()
}

fn f32s(v: &Value) -> (Vec<usize>, Vec<f32>) {
    let shape = v["shape"].as_array().unwrap();
    let data = v["data"].as_array().unwrap();
    (
        shape.iter().map(|d| d.as_u64().unwrap() as usize).collect(),
        data.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
    )
}

/// The CPU executor's outputs on the lowered graph equal onnxruntime's on the
/// original (max-norm relative error below 1e-5), and nothing to lower is left.
#[test]
fn lowered_models_compute_what_onnxruntime_computes() {
    let exp = expected();
    for name in ["dynamo_split", "scripted_control", "scan_rnn"] {
        let e = &exp[name];
        let original = load_model(&path(name)).unwrap();
        let ops: Vec<&str> = e["ops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(
            original
                .graph
                .order
                .iter()
                .any(|&ix| is_lowered(original.graph.node(ix))),
            "{name}: {ops:?}"
        );
        let model = lowered_at(name, 2);
        assert!(
            !model
                .graph
                .order
                .iter()
                .any(|&ix| is_lowered(model.graph.node(ix))),
            "{name}: lowered"
        );
        let inf = infer(&model, &batch(2)).unwrap();
        let inputs: Vec<Tensor> = model
            .graph
            .inputs
            .iter()
            .map(|&t| {
                let (shape, data) = f32s(&e["inputs"][model.graph.tensor(t).name.as_str()]);
                Tensor::f32(shape, data)
            })
            .collect();
        let exec = Executor::new(&model, &inf, Options::default()).unwrap();
        let outs = exec.forward(&inputs).unwrap();
        for (k, &t) in model.graph.outputs.iter().enumerate() {
            let (shape, want) = f32s(&e["outputs"][model.graph.tensor(t).name.as_str()]);
            assert_eq!(outs[k].shape, shape, "{name}");
            let got = outs[k].as_f32().unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            assert!(err < 1e-5, "{name}: relative error {err:.3e}");
        }
    }
}

/// How far each construct unrolls follows the bindings: the scripted Loop runs once
/// per batch row, the Scan once per step of its axis (5), the sequences hold one
/// tensor per chunk.
#[test]
fn unrolling_follows_the_bound_shapes() {
    // Each Loop iteration applies the inner Linear to one row (a MatMul: the row
    // is 1-D); the four Linears outside the loop are Gemms.
    for b in [1, 2, 5] {
        let m = lowered_at("scripted_control", b);
        assert_eq!(op_count(&m, "MatMul"), b as usize, "batch {b}");
        assert_eq!(op_count(&m, "Gemm"), 4, "batch {b}");
        assert_eq!(op_count(&m, "Loop"), 0);
    }
    // The RNN step's two MatMuls, five times, plus h0's.
    let m = lowered_at("scan_rnn", 3);
    assert_eq!(op_count(&m, "MatMul"), 2 * 5 + 1);
    assert_eq!(op_count(&m, "Tanh"), 5);
    // chunk(2) and split([4, 12]) are SplitToSequence nodes 'node_split' and
    // 'node_split_with_sizes' (dynamo writes unbind as Slice + Squeeze): one Slice
    // per element, 2 + 2.
    let m = lowered_at("dynamo_split", 2);
    let names: Vec<&str> = m
        .graph
        .order
        .iter()
        .map(|&ix| m.graph.node(ix))
        .filter(|n| n.op_type == "Slice" && n.name.starts_with("node_split"))
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(names.len(), 2 + 2, "{names:?}");
}

/// The training step of every lowered model runs on the CPU executor with the peak
/// predicted (these graphs are too small for recomputation to lower it).
#[test]
fn lowered_models_train_with_the_predicted_peak() {
    for name in ["dynamo_split", "scripted_control", "scan_rnn"] {
        let args = ["--batch", "2", "--optimizer", "adam", "--budget", "1GiB"];
        let v = json("verify", name, &args);
        assert_eq!(
            v["baseline_measured_peak_bytes"], v["baseline_predicted_peak_bytes"],
            "{name}: {v}"
        );
        assert_eq!(
            v["measured_peak_bytes"], v["predicted_peak_bytes"],
            "{name}: {v}"
        );
        assert_eq!(v["gradients_identical"], true, "{name}: {v}");
    }
}

fn memplan(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// An If on a value known only at run time is refused in one line naming the node;
/// so is writing a lowered model back as ONNX (--rewrite).
#[test]
fn what_does_not_fold_is_refused_in_one_line() {
    let p = path("if_dynamic");
    let (ok, err) = memplan(&["profile", p.to_str().unwrap(), "--batch", "2"]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("'If_0' (If)") && err.contains("condition depends on input values"),
        "{err}"
    );
    let p = path("scripted_control");
    let out = std::env::temp_dir().join("memplan-lowering-rewrite.onnx");
    let (ok, err) = memplan(&[
        "plan",
        p.to_str().unwrap(),
        "--batch",
        "2",
        "--budget",
        "0.9",
        "--rewrite",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("rewritten step"), "{err}");
}

/// `memplan <cmd> <model> <args> --json`, which must succeed.
fn json(cmd: &str, name: &str, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .arg(cmd)
        .arg(path(name))
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn train_peak(name: &str, b: u64) -> u64 {
    let v = json("profile", name, &["--batch", &b.to_string(), "--train"]);
    v["training"]["peak_bytes"].as_u64().unwrap()
}

/// `fit` on a model whose step grows with the batch by more nodes (the Loop over
/// the rows): the largest batch is found by search, not by an affine model of a
/// fixed step; it fits and one more does not.
#[test]
fn fit_searches_when_the_step_changes_with_the_batch() {
    let budget = 64 * 1024;
    let v = json(
        "fit",
        "scripted_control",
        &["--memory", "64KiB", "--tensors-only"],
    );
    let b = v["strategies"][0]["max_batch"].as_u64().unwrap();
    assert_eq!(v["strategies"][0]["name"], "as-exported");
    assert!(b > 1, "{v}");
    let at_b = train_peak("scripted_control", b);
    assert_eq!(v["strategies"][0]["peak_bytes"].as_u64().unwrap(), at_b);
    assert!(at_b <= budget);
    assert!(train_peak("scripted_control", b + 1) > budget);
}

/// Slice assignments (tests/data/lowering/export_slice_assign.py: `a[:, :, 1:, 2:]
/// += r` and `a[:, 1, :3] = ...`), as the TorchScript exporter writes them (three
/// ScatterNDs over index grids built from shapes) and as the dynamo exporter does
/// (five ScatterNDs over transposed data, a ScatterElements for the select, the
/// scalar 0.5 an initializer), become SliceScatters with no grid left, at any batch;
/// the CPU executor computes PyTorch's output, and the training step saves exactly
/// the bytes PyTorch saves (3,024 at batch 3; 14,760 and 4,176 before), with the
/// model's two parameters (not the scalar), and runs with the peak predicted.
#[test]
fn slice_assignments_lose_their_index_grids() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/lowering/slice_assign.json");
    let e: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let scatters = |m: &Model| op_count(m, "ScatterND") + op_count(m, "ScatterElements");
    for (name, n) in [("slice_assign", 3), ("slice_assign_dynamo", 6)] {
        let original = load_model(&path(name)).unwrap();
        assert_eq!(scatters(&original), n, "{name}");
        for b in [1, 3, 5] {
            let m = lowered_at(name, b);
            assert_eq!(scatters(&m), 0, "{name} batch {b}");
            assert_eq!(op_count(&m, "SliceScatter"), n, "{name} batch {b}");
            // The grids' Range → Expand → Unsqueeze → Concat chains are gone: no
            // integer tensor the size of a box is left (a grid holds 60·b·k).
            let inf = infer(&m, &batch(b)).unwrap();
            let biggest_int = inf
                .facts
                .iter()
                .filter(|f| f.dtype.is_int())
                .map(|f| f.numel())
                .max()
                .unwrap_or(0);
            assert!(
                biggest_int <= 8,
                "{name} batch {b}: an integer tensor of {biggest_int}"
            );
        }
        let m = lowered_at(name, 3);
        let inf = infer(&m, &batch(3)).unwrap();
        let (shape, data) = f32s(&e["inputs"]["x"]);
        let exec = Executor::new(&m, &inf, Options::default()).unwrap();
        let out = exec.forward(&[Tensor::f32(shape, data)]).unwrap();
        let (shape, want) = f32s(&e["outputs"]["y"]);
        assert_eq!(out[0].shape, shape);
        let err = out[0]
            .as_f32()
            .unwrap()
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err < 1e-5, "{name}: max error {err:.3e}");
        let v = json(
            "profile",
            name,
            &["--batch", "3", "--train", "--optimizer", "sgd"],
        );
        assert_eq!(
            v["training"]["saved_activation_bytes"], e["saved_bytes"],
            "{name} {v}"
        );
        assert_eq!(v["training"]["trainable_params"], 2, "{name} {v}");
        let v = json("verify", name, &["--batch", "3", "--budget", "1GiB"]);
        assert_eq!(
            v["measured_peak_bytes"], v["predicted_peak_bytes"],
            "{name} {v}"
        );
        assert_eq!(v["gradients_identical"], true, "{name} {v}");
    }
    // A rewritten step holds the model's own nodes: refused in one line.
    let out = std::env::temp_dir().join("memplan-slice-assign-rewrite.onnx");
    let p = path("slice_assign");
    let (ok, err) = memplan(&[
        "plan",
        p.to_str().unwrap(),
        "--batch",
        "3",
        "--budget",
        "0.9",
        "--rewrite",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("ScatterND"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// A 4.8 KB Loop of 10,000 iterations over 202 nodes is refused in one line once
/// unrolling passes `MAX_ADDED_NODES` (it unrolled to 2 million nodes, 26 s and
/// 5.9 GB, before).
#[test]
fn unrolling_has_a_budget() {
    let p = path("loop_huge");
    let (ok, err) = memplan(&["profile", p.to_str().unwrap(), "--train"]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains(&memplan::infer::lower::MAX_ADDED_NODES.to_string()),
        "{err}"
    );
}
