//! `memplan verify` (memplan::exec::verify): the CPU training step measured against
//! the memory model, for every model in models/, and the command's bad input.
//!
//! Per model (fp32, SGD, mean loss, a small batch), three runs against the
//! no-recompute baseline:
//! - the baseline itself: measured peak == predicted peak, to the byte;
//! - the planner's plan (`ilp`) at 50 % of the baseline peak, or, where no plan
//!   reaches 50 % (parameters and gradients alone exceed it at a small batch), the
//!   lowest-peak plan the planner returns for that budget;
//! - every droppable activation dropped and recomputed (`plan_with_drops` over all
//!   candidates: the most recomputation a drop plan has);
//!
//! each: measured peak == predicted, gradients, loss and updated parameters bitwise
//! identical to the baseline's. mlp, cnn and transformer run by default; the others
//! are `#[ignore]`d (run `cargo test --release --test verify -- --ignored`, which
//! `.ci/run` does).

mod common;

use std::path::PathBuf;

use memplan::exec::train::StepOptions;
use memplan::exec::verify::{verify, PlanSource, Step, VerifyOptions, VerifyReport};
use memplan::infer::{infer, Bindings};
use memplan::onnx::load_model;
use memplan::remat::graph::replay;
use memplan::remat::heuristics::{candidates, plan_with_drops};
use memplan::remat::plan::{plan, Solver};
use memplan::remat::planfile::StepSource;
use memplan::train::{Loss, Optimizer, Precision, TrainOptions};
use serde_json::Value;

fn sgd() -> TrainOptions {
    TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    }
}

fn check(r: &VerifyReport, what: &str) {
    eprintln!(
        "{what}: baseline {} / {}, planned {} / {} ({}, {} recomputations), grads identical {}",
        r.baseline_predicted_peak_bytes,
        r.baseline_measured_peak_bytes,
        r.predicted_peak_bytes,
        r.measured_peak_bytes,
        r.plan_source,
        r.recomputations,
        r.gradients_identical
    );
    assert_eq!(
        r.baseline_measured_peak_bytes, r.baseline_predicted_peak_bytes,
        "{what}: baseline"
    );
    assert_eq!(
        r.measured_peak_bytes, r.predicted_peak_bytes,
        "{what}: planned"
    );
    assert!(
        r.gradients_identical,
        "{what}: max diff {}",
        r.max_abs_grad_diff
    );
    assert_eq!(r.max_abs_grad_diff, 0.0, "{what}");
    assert!(r.updated_params_identical, "{what}");
}

/// Verifies `name` at `batch`: the 50 % (or lowest-peak) plan and the all-dropped
/// plan. Returns the two reports.
fn verify_model(name: &str, batch: u64) -> (VerifyReport, VerifyReport) {
    verify_path(&common::shipped(&format!("{name}.onnx")), name, batch)
}

fn verify_path(path: &std::path::Path, name: &str, batch: u64) -> (VerifyReport, VerifyReport) {
    let model = load_model(path).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(batch),
            ..Default::default()
        },
    )
    .unwrap();
    let train = sgd();
    let source = StepSource::new(path, Some(batch), &Default::default(), &train);
    let step = Step::new(&model, &inf, &train, name).unwrap();
    let g = step.graph();
    let base = replay(g, &g.no_recompute_plan()).unwrap().peak_bytes;
    let half = plan(g, base / 2, Solver::Ilp, 5.0).unwrap();
    let label = if half.feasible {
        format!("50 % ({})", half.method)
    } else {
        format!(
            "lowest peak, 50 % unreachable ({}; floor {})",
            half.method, half.op_local_bound_bytes
        )
    };
    let mut all = vec![false; g.values.len()];
    for v in candidates(g) {
        all[v] = true;
    }
    let dropped = plan_with_drops(g, &all);
    let o = VerifyOptions {
        train,
        step: StepOptions::default(),
        runs: 1,
        max_memory: u64::MAX,
    };
    let run = |plan, label: String| {
        verify(
            &model,
            &inf,
            &source,
            &PlanSource::Given { plan, label },
            &o,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .report
    };
    let a = run(half.plan.clone(), label);
    check(&a, &format!("{name} batch {batch} {}", a.plan_source));
    let b = run(dropped, "all droppable dropped".into());
    check(&b, &format!("{name} batch {batch} all dropped"));
    assert!(b.recomputations > 0 || candidates(g).is_empty(), "{name}");
    (a, b)
}

/// One model per op the census added (tests/data/ops/export*.py made them): Resize
/// (four modes), Einsum (MaxViT-style), stochastic depth (RandomUniformLike) with
/// SiLU, GatherND (boolean-mask indexing), GridSample (bilinear). Measured peak ==
/// predicted, baseline and planned, gradients bitwise.
#[test]
fn census_ops_measured_equals_predicted() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/ops");
    for name in [
        "resize",
        "einsum",
        "droppath",
        "gathernd",
        "gridsample",
        "strided_matmul",
    ] {
        let (a, b) = verify_path(&dir.join(format!("{name}.onnx")), name, 2);
        assert!(
            a.recomputations + b.recomputations > 0,
            "{name}: nothing recomputed"
        );
    }
}

#[test]
fn mlp_measured_equals_predicted() {
    verify_model("mlp", 4);
}

#[test]
fn cnn_measured_equals_predicted() {
    let (a, b) = verify_model("cnn", 2);
    assert!(a.recomputations > 0 && b.recomputations > 0);
    assert!(a.measured_peak_bytes < a.baseline_measured_peak_bytes);
}

/// A 3-D (video) CNN: Conv, MaxPool, AveragePool, BatchNormalization and
/// GlobalAveragePool over `[N, C, D, H, W]` (models/video_cnn).
#[test]
fn video_cnn_measured_equals_predicted() {
    let (a, b) = verify_model("video_cnn", 2);
    assert!(a.recomputations > 0 && b.recomputations > 0);
    assert!(a.measured_peak_bytes < a.baseline_measured_peak_bytes);
}

#[test]
fn transformer_measured_equals_predicted() {
    verify_model("transformer", 2);
}

/// Issue 13's architectures in models/ (mlp_loss, trained on its own loss, has its
/// own test below; fcn_resnet50 is shape-only at 64x64): measured == predicted at
/// batch 2, baseline, planned and all dropped, gradients bitwise.
#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn new_architectures_measure_what_they_predict() {
    for name in [
        "unet_small",
        "transformer_dynamo_raw",
        "whisper_mini",
        "lstm_lm",
        "gru_classifier",
        "rnn_tagger",
        "mixer_tiny",
        "cait_tiny",
        "convit_tiny",
        "tnt_tiny",
        "clip_tiny",
        "siglip_tiny",
        "data2vec_audio_tiny",
        "poolformer_tiny",
        "wav2vec2_tiny",
    ] {
        verify_model(name, 2);
    }
}

#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn resnet18_measured_equals_predicted() {
    verify_model("resnet18", 1);
    verify_model("resnet18_dynamo", 1);
}

#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn mobilenet_v2_measured_equals_predicted() {
    let (a, _) = verify_model("mobilenet_v2", 1);
    assert!(a.plan_source.starts_with("50 %"), "{}", a.plan_source);
}

#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn resnet50_measured_equals_predicted() {
    verify_model("resnet50", 1);
    // Batch 8: activations dominate and 50 % is reachable.
    let (a, _) = verify_model("resnet50", 8);
    assert!(a.plan_source.starts_with("50 %"), "{}", a.plan_source);
    assert!(a.measured_peak_bytes * 2 <= a.baseline_measured_peak_bytes);
}

#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn gpt2_measured_equals_predicted() {
    verify_model("gpt2", 1);
    verify_model("gpt2_dynamo", 1);
}

#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn bert_base_measured_equals_predicted() {
    verify_model("bert_base", 1);
}

#[test]
#[ignore = "release build: cargo test --release --test verify -- --ignored"]
fn vit_b_16_measured_equals_predicted() {
    verify_model("vit_b_16", 1);
}

// ---- the command ----

fn fails(args: &[&str], needles: &[&str]) {
    let (ok, _, err) = common::run_memplan(args);
    assert!(!ok, "{args:?} should fail");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    for n in needles {
        assert!(err.contains(n), "'{n}' not in {err}");
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memplan-verify-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn cnn() -> String {
    common::shipped("cnn.onnx").display().to_string()
}

const KEYS: [&str; 11] = [
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "baseline_predicted_peak_bytes",
    "baseline_measured_peak_bytes",
    "gradients_identical",
    "max_abs_grad_diff",
    "baseline_seconds",
    "planned_seconds",
    "measured_overhead",
    "predicted_overhead",
    "baseline_gflops_per_second",
];

#[test]
fn plan_file_round_trip_and_costs() {
    let m = cnn();
    let p = tmp("plan.json");
    let c = tmp("costs.json");
    let ps = p.to_str().unwrap();
    let planned = common::memplan_json(&[
        "plan",
        &m,
        "--batch",
        "2",
        "--budget",
        "0.8",
        "--optimizer",
        "sgd",
        "--json",
        "-o",
        ps,
    ]);
    let v = common::memplan_json(&[
        "verify",
        &m,
        "--batch",
        "2",
        "--plan",
        ps,
        "--optimizer",
        "sgd",
        "--json",
        "--write-costs",
        c.to_str().unwrap(),
    ]);
    for k in KEYS {
        assert!(v.get(k).is_some(), "no key {k}: {v}");
    }
    assert_eq!(v["predicted_peak_bytes"], planned["peak_bytes"]);
    assert_eq!(v["measured_peak_bytes"], planned["peak_bytes"]);
    assert_eq!(
        v["baseline_measured_peak_bytes"],
        planned["baseline_peak_bytes"]
    );
    assert_eq!(v["gradients_identical"], true);
    assert_eq!(v["plan_source"], "file");
    assert!(v["recomputations"].as_u64().unwrap() > 0);
    // The measured costs drive the planner.
    let costs: serde_json::Map<String, Value> =
        serde_json::from_slice(&std::fs::read(&c).unwrap()).unwrap();
    assert!(costs.values().all(|s| s.as_f64().unwrap() >= 0.0));
    assert!(costs.values().any(|s| s.as_f64().unwrap() > 0.0));
    let with_costs = common::memplan_json(&[
        "plan",
        &m,
        "--batch",
        "2",
        "--budget",
        "0.8",
        "--optimizer",
        "sgd",
        "--costs",
        c.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(with_costs["cost_unit"], "seconds");
    assert_eq!(with_costs["feasible"], true);
    // --budget plans in place.
    let v = common::memplan_json(&[
        "verify",
        &m,
        "--batch",
        "2",
        "--budget",
        "0.8",
        "--optimizer",
        "sgd",
        "--json",
        "--runs",
        "2",
    ]);
    assert_eq!(v["measured_peak_bytes"], v["predicted_peak_bytes"]);
    assert!(v["measured_peak_bytes"].as_u64() <= v["budget_bytes"].as_u64());
    assert_eq!(v["runs"], 2);
}

#[test]
fn bad_plans_are_rejected_before_running() {
    let m = cnn();
    let p = tmp("good.json");
    let ps = p.to_str().unwrap();
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        &m,
        "--batch",
        "2",
        "--budget",
        "0.8",
        "--optimizer",
        "sgd",
        "-o",
        ps,
    ]);
    assert!(ok, "{err}");
    // `verify` of cnn at `batch` with the plan file `plan` (SGD) fails with `needles`.
    let rejects = |batch: &str, plan: &str, needles: &[&str]| {
        fails(
            &[
                "verify",
                &m,
                "--batch",
                batch,
                "--plan",
                plan,
                "--optimizer",
                "sgd",
            ],
            needles,
        );
    };
    // Another batch, another model, other options.
    rejects("4", ps, &["made for batch 2", "batch 4"]);
    let mlp = common::shipped("mlp.onnx").display().to_string();
    fails(
        &[
            "verify",
            &mlp,
            "--batch",
            "2",
            "--plan",
            ps,
            "--optimizer",
            "sgd",
        ],
        &["made for model 'cnn.onnx'"],
    );
    fails(
        &["verify", &m, "--batch", "2", "--plan", ps],
        &["made for optimizer 'sgd'", "'adam'"],
    );
    let doc: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let write = |name: &str, v: &Value| {
        let q = tmp(name);
        std::fs::write(&q, serde_json::to_vec(v).unwrap()).unwrap();
        q.display().to_string()
    };
    // Unknown version.
    let mut v2 = doc.clone();
    v2["version"] = 2.into();
    let q = write("v2.json", &v2);
    rejects("2", &q, &["version 2 is unknown"]);
    // Not a plan.
    let q = write("other.json", &serde_json::json!({"a": 1}));
    rejects("2", &q, &["not a memplan plan"]);
    // A file without the `step` key (older writers) is still matched by its graph.
    let mut nostep = doc.clone();
    nostep.as_object_mut().unwrap().remove("step");
    let q = write("nostep.json", &nostep);
    rejects("4", &q, &["bytes in the plan", "another batch"]);
    // A schedule that reads a freed value: move a free to right after its producer.
    let plan = doc["plan"].as_array().unwrap().clone();
    let values = doc["graph"]["values"].as_array().unwrap();
    let nodes = doc["graph"]["nodes"].as_array().unwrap();
    let mut broken = None;
    'find: for (k, op) in plan.iter().enumerate() {
        if op["op"] != "free" {
            continue;
        }
        let v = op["id"].as_u64().unwrap();
        let Some(prod) = values[v as usize]["producer"].as_u64() else {
            continue;
        };
        let at = plan
            .iter()
            .position(|o| o["op"] == "compute" && o["id"].as_u64() == Some(prod))
            .unwrap();
        // A reader between the producer and the free.
        let read = plan[at + 1..k].iter().any(|o| {
            o["op"] == "compute"
                && nodes[o["id"].as_u64().unwrap() as usize]["inputs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|i| i.as_u64() == Some(v))
        });
        if read {
            let mut p2 = plan.clone();
            let f = p2.remove(k);
            p2.insert(at + 1, f);
            broken = Some(p2);
            break 'find;
        }
    }
    let mut bad = doc.clone();
    bad["plan"] = Value::Array(broken.expect("a free after a read"));
    let q = write("freed.json", &bad);
    rejects("2", &q, &["the plan is invalid", "which is not live"]);
    // A predicted peak the plan does not replay to.
    let mut lie = doc.clone();
    lie["predicted_peak_bytes"] = 1.into();
    let q = write("lie.json", &lie);
    rejects("2", &q, &["predicted_peak_bytes is 1"]);
    // Missing file.
    fails(
        &[
            "verify",
            &m,
            "--batch",
            "2",
            "--plan",
            "/nonexistent/plan.json",
        ],
        &["cannot read"],
    );
}

#[test]
fn refusals() {
    let m = cnn();
    let a = |extra: &[&str]| -> Vec<String> {
        ["verify", m.as_str(), "--batch", "2", "--optimizer", "sgd"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let call = |extra: &[&str], needles: &[&str]| {
        let v = a(extra);
        let v: Vec<&str> = v.iter().map(String::as_str).collect();
        fails(&v, needles);
    };
    call(
        &["--budget", "0.8", "--max-memory", "1MiB"],
        &[
            "the run needs about",
            "5 × the predicted peak of 1.30 MiB (1359332 bytes)",
            "--max-memory",
        ],
    );
    call(
        &["--budget", "0.3"],
        &["no plan fits the budget", "lowest peak"],
    );
    call(&[], &["--budget"]);
    call(&["--budget", "0.8", "--runs", "0"], &["--runs"]);
    call(
        &["--budget", "0.8", "--max-memory", "lots"],
        &["--max-memory"],
    );
    call(&["--budget", "0.8", "--lr", "NaN"], &["--lr"]);
}

/// `verify --device cuda` without the `cuda` feature says to build with it; with
/// the feature and no usable GPU, the probe's one line; with a GPU it runs and
/// adds the device keys. `--device cpu` (the default) reports `device: "cpu"`.
#[test]
fn device_cuda_without_a_gpu_is_one_line() {
    let m = cnn();
    let args = ["verify", &m, "--batch", "2", "--budget", "0.8", "--json"];
    let cpu = common::memplan_json(&args);
    assert_eq!(cpu["device"], "cpu");
    assert!(cpu["device_name"].is_null() && cpu["cpu_max_rel_grad_diff"].is_null());
    for k in KEYS {
        assert!(cpu.get(k).is_some(), "{k}");
    }
    let mut a = args.to_vec();
    a.extend(["--device", "cuda"]);
    if !cfg!(feature = "cuda") {
        fails(&a, &["--device cuda", "--features cuda"]);
        return;
    }
    let (ok, out, err) = common::run_memplan(&a);
    if ok {
        let v: Value = serde_json::from_str(&out).unwrap();
        eprintln!("a GPU ran it: {}", v["device_name"]);
        assert_eq!(v["device"], "cuda");
        assert_eq!(v["measured_peak_bytes"], v["predicted_peak_bytes"]);
        assert!(v["mem_get_info_peak_delta_bytes"].is_u64());
    } else {
        eprintln!("no GPU: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("CUDA"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// An MLP whose first output is its own loss: Gemm → Relu → Gemm → scores
/// `[batch, 10]` → SoftmaxCrossEntropyLoss against integer labels (random in
/// `[0, 10)`, as verify draws them).
fn mlp_with_loss() -> String {
    use common::*;
    let m = model(
        vec![
            with_int(node("Gemm", "fc1", &["x", "w1", "b1"], &["h"]), "transB", 1),
            node("Relu", "relu", &["h"], &["r"]),
            with_int(
                node("Gemm", "fc2", &["r", "w2", "b2"], &["scores"]),
                "transB",
                1,
            ),
            node(
                "SoftmaxCrossEntropyLoss",
                "ce",
                &["scores", "labels"],
                &["loss"],
            ),
        ],
        vec![
            weight("w1", &[8, 4]),
            weight("b1", &[8]),
            weight("w2", &[10, 8]),
            weight("b2", &[10]),
        ],
        vec![
            value_info("x", 1, &[D::S("batch"), D::N(4)]),
            value_info("labels", 7, &[D::S("batch")]),
        ],
        vec![value_info("loss", 1, &[])],
    );
    let p = tmp("mlp_loss.onnx");
    std::fs::write(&p, encode(&m)).unwrap();
    p.display().to_string()
}

/// `--loss graph` trains on the loss the model computes: verify measures the
/// predicted peak, baseline and planned; profile --train reports it; a model
/// whose first output is not a scalar is refused in one line naming it.
#[test]
fn graph_loss_trains_on_the_models_own_loss() {
    let m = mlp_with_loss();
    let v = common::memplan_json(&[
        "verify",
        &m,
        "--batch",
        "64",
        "--budget",
        "0.99",
        "--optimizer",
        "sgd",
        "--loss",
        "graph",
        "--json",
    ]);
    assert_eq!(v["measured_peak_bytes"], v["predicted_peak_bytes"]);
    assert_eq!(
        v["baseline_measured_peak_bytes"],
        v["baseline_predicted_peak_bytes"]
    );
    let p = common::memplan_json(&[
        "profile", &m, "--batch", "4", "--train", "--loss", "graph", "--json",
    ]);
    assert!(p["training"]["peak_bytes"].as_u64().unwrap() > 0, "{p}");
    fails(
        &[
            "profile",
            &cnn(),
            "--batch",
            "2",
            "--train",
            "--loss",
            "graph",
        ],
        &["not a scalar", "--loss"],
    );
}

/// The memory guard bounds what the process will use, not just the step's tensors:
/// GPT-2 at batch 2 predicts 2.37 GiB but the CPU executor's process reaches 9.6 GB
/// (measured), so `--max-memory 8GiB` stops it before it allocates.
#[test]
fn the_memory_guard_counts_the_executor() {
    let gpt2 = common::shipped("gpt2.onnx");
    let t = std::time::Instant::now();
    let (ok, _, err) = common::run_memplan(&[
        "verify",
        gpt2.to_str().unwrap(),
        "--batch",
        "2",
        "--solver",
        "sqrt",
        "--budget",
        "100%",
        "--max-memory",
        "8GiB",
    ]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("the run needs about 11.86 GiB") && err.contains("--max-memory"),
        "{err}"
    );
    // Refused before any run: the step takes tens of seconds.
    assert!(t.elapsed().as_secs() < 60, "{:?}", t.elapsed());
}
