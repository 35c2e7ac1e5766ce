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
    let (ok, out, err) = common::run_train(&file(name));
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
        assert!(warnings[0].contains("docs/usage/exporting.md"), "{name}");
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
    let (saved, warnings, _) = train("rotary_dynamo.onnx");
    assert_eq!(saved, torch, "saved bytes against PyTorch's");
    assert!(warnings.is_empty(), "{warnings:?}");

    // With the default optimize=True the tables are folded into initializers with
    // no input kind: they train, and the file says so.
    let (_, warnings, lines) = train("rotary_dynamo_optimized.onnx");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("computed 2 float initializers from other values"),
        "{warnings:?}"
    );
    assert_eq!(lines.len(), 1, "{lines:?}");
    // The optimizer also folded the transposed Linear weight into `val_<n>`: it is
    // named for its module, as named_parameters() names it.
    let path = file("rotary_dynamo_optimized.onnx");
    let j = memplan_json(&[
        "profile",
        path.to_str().unwrap(),
        "--batch",
        "2",
        "--train",
        "--trainable",
        r"^q\.weight$",
        "--json",
    ]);
    assert_eq!(j["training"]["trainable_params"], 1, "{}", j["training"]);

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
    let t = train_json(&bare);
    assert_eq!(t["trainable_params"], 2, "{t}");
    assert!(t["saved_activation_bytes"].as_u64().unwrap() > torch, "{t}");
}

#[test]
fn a_dynamo_conv3d_without_bias_loads_and_runs() {
    // onnxscript's aten_conv3d writes the missing bias as zeros of shape [4, 2],
    // which Conv does not take; lowering drops it (PyTorch's convolution has none).
    let (saved, _, _) = train("conv3d_dynamo.onnx");
    assert_eq!(saved, pytorch("conv3d_saved_bytes"));
    let path = file("conv3d_dynamo.onnx");
    verify_exact(&path, "1GiB");
    // The zeros' nodes (Shape, Concat, CastLike, Expand) go with the bias.
    let j = memplan_json(&[
        "profile",
        path.to_str().unwrap(),
        "--batch",
        "2",
        "--json",
        "--detail",
    ]);
    let ops: Vec<&str> = j["node_table"]
        .as_array()
        .unwrap_or_else(|| panic!("no node_table: {j}"))
        .iter()
        .map(|n| n["op"].as_str().unwrap())
        .collect();
    assert!(ops.contains(&"Conv"), "{ops:?}");
    for gone in ["Expand", "CastLike", "Concat", "Shape"] {
        assert!(!ops.contains(&gone), "{gone} left: {ops:?}");
    }
}

/// `(shape, data)` of a tensor in pytorch.json.
fn tensor(v: &serde_json::Value) -> (Vec<usize>, Vec<f32>) {
    let shape = v["shape"].as_array().unwrap();
    let data = v["data"].as_array().unwrap();
    (
        shape.iter().map(|d| d.as_u64().unwrap() as usize).collect(),
        data.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
    )
}

#[test]
fn the_executor_reads_the_dynamo_exporters_external_data() {
    use memplan::exec::{Executor, Options, Tensor};
    use memplan::infer::{infer, Bindings};

    // conv3d_dynamo.onnx keeps its weights in a .data file beside it (the rotary
    // model's are inline): the CPU executor's output is PyTorch's (for conv3d,
    // without the zero bias lowering dropped).
    let text = std::fs::read_to_string(file("pytorch.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (name, key) in [
        ("rotary_dynamo.onnx", "rotary_io"),
        ("conv3d_dynamo.onnx", "conv3d_io"),
    ] {
        let b = Bindings {
            batch: Some(2),
            dims: Default::default(),
            routing: None,
        };
        let m = memplan::onnx::load_model(&file(name)).unwrap();
        let m = memplan::infer::lower::lowered(m, &b).unwrap();
        let inf = infer(&m, &b).unwrap();
        let exec = Executor::new(&m, &inf, Options::default()).unwrap();
        let (shape, x) = tensor(&j[key]["x"]);
        let out = exec.forward(&[Tensor::f32(shape, x)]).unwrap();
        let (shape, want) = tensor(&j[key]["y"]);
        assert_eq!(out[0].shape, shape, "{name}");
        let got = out[0].as_f32().unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-5 * scale.max(1.0), "{name}: max error {err:.3e}");
    }
}

#[test]
fn a_dynamo_index_by_a_buffer_saves_what_pytorch_saves() {
    // `table[index]` is GatherND over a one-input Concat of the index unsqueezed;
    // PyTorch's IndexBackward saves the buffer's view, no copy (1,944 bytes before).
    let (saved, _, _) = train("index_dynamo.onnx");
    assert_eq!(saved, pytorch("index_saved_bytes"));
    let path = file("index_dynamo.onnx");
    verify_exact(&path, "1GiB");
}

#[test]
fn a_weight_folded_alone_is_no_inference_export() {
    use common::{encode, model, node, value_info, weight, D};
    use memplan::train::inference_export::InferenceExport;

    // A Conv whose weight the exporter folded from parameters (weight_norm, in a
    // training-mode export) keeps its bias's name: no sign. With a folded bias too
    // (a BatchNorm folded in): one.
    let sign = |bias: &str| {
        let m = model(
            vec![node("Conv", "c", &["x", "onnx::Conv_7", bias], &["y"])],
            vec![weight("onnx::Conv_7", &[4, 3, 3, 3]), weight(bias, &[4])],
            vec![value_info(
                "x",
                1,
                &[D::S("batch"), D::N(3), D::N(8), D::N(8)],
            )],
            vec![value_info(
                "y",
                1,
                &[D::S("batch"), D::N(4), D::N(6), D::N(6)],
            )],
        );
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.onnx");
        std::fs::write(&p, encode(&m)).unwrap();
        InferenceExport::of(&memplan::onnx::load_model(&p).unwrap()).folded_conv_weights
    };
    assert_eq!(sign("c.bias"), 0);
    assert_eq!(sign("onnx::Conv_8"), 1);
}
