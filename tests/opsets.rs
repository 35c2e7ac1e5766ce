//! The same models through both PyTorch exporters at the opsets users export with:
//! every spelling saves what PyTorch saves. tests/data/opsets/export_opsets.py made
//! the files and pytorch.json (what PyTorch 2.15 saved for backward in one training
//! step at batch 2, on the CPU, float32, no dropout):
//!
//! - `blocks`: Conv, GroupNorm, GELU, Conv, Hardswish. The TorchScript exporter at
//!   opset 13 writes Hardswish as `x · HardSigmoid(x)`; the dynamo exporter at opset
//!   18 writes GELU as `x · (0.5 · (1 + erf(x / √2)))`, and below opset 21 GroupNorm
//!   through InstanceNormalization with expanded, cast constants and its affine part
//!   through CastLike.
//! - `attention`: `scaled_dot_product_attention` with a boolean padding mask. Both
//!   exporters below opset 23 zero fully masked rows after the Softmax
//!   (`Where(IsNaN(p), 0, p)`).

mod common;

use std::path::PathBuf;

use common::*;
use memplan::train::FusedKind;
use serde_json::Value;

fn file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/opsets")
        .join(name)
}

fn pytorch() -> Value {
    let text = std::fs::read_to_string(file("pytorch.json")).unwrap();
    let j: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(j["batch"], 2);
    j
}

/// The exported files of `model`, from pytorch.json.
fn files_of(model: &str) -> Vec<String> {
    let j = pytorch();
    let files: Vec<String> = j["files"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, m)| *m == model)
        .map(|(f, _)| f.clone())
        .collect();
    assert!(files.len() >= 5, "{model}: {files:?}");
    files
}

/// The fused patterns of `name`'s training step at batch 2, by kind.
fn kinds(name: &str) -> Vec<FusedKind> {
    let s = sgd_schedule(&file(name), 2);
    s.fused.iter().map(|p| p.kind).collect()
}

fn saved(name: &str) -> u64 {
    train_json(&file(name))["saved_activation_bytes"]
        .as_u64()
        .unwrap()
}

#[test]
fn every_exporter_and_opset_saves_what_pytorch_saves() {
    let j = pytorch();
    for model in ["blocks", "attention"] {
        let torch = j[format!("{model}_saved_bytes")].as_u64().unwrap();
        for f in files_of(model) {
            assert_eq!(saved(&f), torch, "{f}: memplan's saved bytes, PyTorch's");
        }
    }
}

#[test]
fn each_spelling_is_its_fused_kernel() {
    for f in files_of("blocks") {
        let k = kinds(&f);
        let count = |kind| k.iter().filter(|&&x| x == kind).count();
        // ONNX has GroupNormalization with per-channel scales from opset 21 and Gelu
        // from opset 20; below, both are patterns.
        let opset: u32 = f.trim_start_matches(|c: char| !c.is_ascii_digit())[..2]
            .parse()
            .unwrap();
        let dynamo = f.contains("dynamo");
        assert_eq!(
            count(FusedKind::GroupNorm),
            usize::from(opset < 21),
            "{f}: {k:?}"
        );
        let gelu = if dynamo { opset < 20 } else { true };
        assert_eq!(count(FusedKind::Gelu), usize::from(gelu), "{f}: {k:?}");
        assert_eq!(
            count(FusedKind::HardSwish),
            usize::from(opset < 14),
            "{f}: {k:?}"
        );
    }
    for f in files_of("attention") {
        let k = kinds(&f);
        // At opset 23 the dynamo exporter writes ONNX's Attention op: no pattern.
        let sdpa = usize::from(!f.ends_with("dynamo23.onnx"));
        let count = k.iter().filter(|&&x| x == FusedKind::Sdpa).count();
        assert_eq!(count, sdpa, "{f}: {k:?}");
    }
}

/// `verify`: the CPU step of each new spelling (and of ONNX's Attention op, whose
/// boolean mask is saved as PyTorch's float copy) measures the predicted peak; the
/// blocks under a budget that makes them recompute, with the gradients of the step
/// without recomputation, bit for bit.
#[test]
fn the_new_spellings_run_on_the_cpu_executor() {
    for (f, budget) in [
        ("blocks_ts13.onnx", "0.9"),
        ("blocks_dynamo18.onnx", "0.9"),
        ("blocks_dynamo20.onnx", "0.9"),
        ("attention_ts17.onnx", "1GiB"),
        ("attention_dynamo20.onnx", "1GiB"),
        ("attention_dynamo23.onnx", "1GiB"),
    ] {
        let v = verify_exact(&file(f), budget);
        assert_eq!(
            v["baseline_measured_peak_bytes"], v["baseline_predicted_peak_bytes"],
            "{f}: {v}"
        );
        if budget == "0.9" {
            assert!(v["recomputations"].as_u64().unwrap() > 0, "{f}: {v}");
        }
    }
}
