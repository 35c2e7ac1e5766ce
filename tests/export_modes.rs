//! What the exporters write, read as PyTorch trains: files exported for inference say
//! so (one small model, Conv, BatchNorm, ReLU, Dropout, Conv, BatchNorm, exported six
//! ways), and the dynamo exporter's buffers do not train (a rotary embedding's
//! `inv_freq`). The files are made by tests/data/export_modes/export_modes.py, with
//! what PyTorch saves for backward in one training step
//! (tests/data/export_modes/pytorch.json).

mod common;

use std::path::PathBuf;

use common::*;

fn file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/export_modes")
        .join(name)
}

/// `profile --train --json` at batch 2: (saved bytes, `training.warnings`, the
/// `warning:` lines on standard error).
fn train(name: &str) -> (u64, Vec<String>, Vec<String>) {
    let path = file(name);
    let p = path.to_str().unwrap();
    let args = [
        "profile",
        p,
        "--batch",
        "2",
        "--train",
        "--optimizer",
        "sgd",
        "--json",
    ];
    let (ok, out, err) = run_memplan(&args);
    assert!(ok, "{name}: {err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let t = &j["training"];
    let warnings = t["warnings"]
        .as_array()
        .unwrap_or_else(|| panic!("{name}: no training.warnings"))
        .iter()
        .map(|w| w.as_str().unwrap().to_string())
        .collect();
    let lines = err
        .lines()
        .filter(|l| l.starts_with("warning: "))
        .map(String::from)
        .collect();
    (
        t["saved_activation_bytes"].as_u64().unwrap(),
        warnings,
        lines,
    )
}

fn pytorch(key: &str) -> u64 {
    let text = std::fs::read_to_string(file("pytorch.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(j["batch"], 2);
    j[key].as_u64().unwrap()
}

fn pytorch_saved() -> u64 {
    pytorch("saved_bytes")
}

#[test]
fn training_mode_exports_match_pytorch_and_say_nothing() {
    let torch = pytorch_saved();
    for name in ["ts_train.onnx", "dynamo_train.onnx"] {
        let (saved, warnings, lines) = train(name);
        assert_eq!(saved, torch, "{name}: saved bytes against PyTorch's");
        assert!(warnings.is_empty(), "{name}: {warnings:?}");
        assert!(lines.is_empty(), "{name}: {lines:?}");
    }
}

#[test]
fn inference_exports_are_named_and_undercount() {
    let torch = pytorch_saved();
    // (file, what its one warning must say)
    let cases = [
        // TorchScript's defaults in eval mode: BatchNorm folded into the weights.
        (
            "ts_eval.onnx",
            "2 convolution weights were made by the exporter's constant folding",
        ),
        // Eval mode without folding: BatchNorm written in inference mode.
        (
            "ts_eval_nofold.onnx",
            "2 BatchNormalization nodes are in inference mode",
        ),
        // The dynamo exporter's default optimizer, in training mode.
        (
            "dynamo_train_optimized.onnx",
            "the exporter's optimizer folded BatchNorm into 2 nodes",
        ),
        // The dynamo exporter in eval mode: named by its fx nodes.
        (
            "dynamo_eval.onnx",
            "2 BatchNormalization nodes are in inference mode",
        ),
    ];
    for (name, says) in cases {
        let (saved, warnings, lines) = train(name);
        assert_eq!(warnings.len(), 1, "{name}: {warnings:?}");
        assert!(warnings[0].contains(says), "{name}: {warnings:?}");
        assert!(warnings[0].contains("Exporting your model"), "{name}");
        assert_eq!(lines.len(), 1, "{name}: {lines:?}");
        assert!(lines[0].ends_with(&warnings[0]), "{name}: {lines:?}");
        // What the warning is about: no dropout mask, or no BatchNorm, is saved.
        assert!(saved < torch, "{name}: {saved} saved, PyTorch {torch}");
    }
}

#[test]
fn every_training_command_warns_and_inference_profiles_do_not() {
    let path = file("ts_eval.onnx");
    let p = path.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("report.html");
    let commands: [&[&str]; 4] = [
        &["plan", p, "--batch", "2", "--budget", "1GiB"],
        &["verify", p, "--batch", "2", "--budget", "1GiB"],
        &["fit", p, "--memory", "1GiB"],
        &[
            "report",
            p,
            "--batch",
            "2",
            "--output",
            html.to_str().unwrap(),
        ],
    ];
    for args in commands {
        let (ok, _, err) = run_memplan(args);
        assert!(ok, "{args:?}: {err}");
        let n = err.lines().filter(|l| l.starts_with("warning: ")).count();
        assert_eq!(n, 1, "{args:?}: {err}");
    }
    // Profiling inference is what the file was made for.
    let (ok, _, err) = run_memplan(&["profile", p, "--batch", "2"]);
    assert!(ok, "{err}");
    assert!(!err.contains("warning"), "{err}");
}

#[test]
fn dynamo_buffers_do_not_train() {
    use memplan::onnx::proto::ModelProto;
    use prost::Message;

    // `inv_freq` is a float initializer that Cos and Sin read through a MatMul: as a
    // parameter it would train, and the multiplies would save the projection too.
    let torch = pytorch("rotary_saved_bytes");
    let (saved, _, _) = train("rotary_dynamo.onnx");
    assert_eq!(saved, torch, "saved bytes against PyTorch's");

    // The same file without the exporter's input kinds trains `inv_freq`.
    let bytes = std::fs::read(file("rotary_dynamo.onnx")).unwrap();
    let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
    let g = m.graph.as_mut().unwrap();
    let kinds = g
        .value_info
        .iter()
        .flat_map(|vi| &vi.metadata_props)
        .filter(|p| p.key() == "pkg.torch.export.graph_signature.InputSpec.kind")
        .count();
    assert!(kinds >= 2, "the export lost its input kinds");
    for vi in &mut g.value_info {
        vi.metadata_props.clear();
    }
    let dir = tempfile::tempdir().unwrap();
    let bare = dir.path().join("rotary_bare.onnx");
    std::fs::write(&bare, m.encode_to_vec()).unwrap();
    std::fs::copy(
        file("rotary_dynamo.onnx.data"),
        dir.path().join("rotary_dynamo.onnx.data"),
    )
    .unwrap();
    let j = memplan_json(&[
        "profile",
        bare.to_str().unwrap(),
        "--batch",
        "2",
        "--train",
        "--optimizer",
        "sgd",
        "--json",
    ]);
    let t = &j["training"];
    assert_eq!(t["trainable_params"], 2, "{t}");
    assert!(t["saved_activation_bytes"].as_u64().unwrap() > torch, "{t}");
}
