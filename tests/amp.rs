//! Mixed precision (`--precision amp-fp16` / `amp-bf16`) against what PyTorch saves
//! under CUDA autocast (models/amp_reference.json, written by
//! `python models/amp_reference.py`: every model of models/ on *fake* CUDA tensors,
//! so autocast's CUDA cast lists, its weight cache, CUDA's dropout and BatchNorm run
//! as on a GPU without one; SDPA's kernel is the one an H200 picked). Saved bytes
//! by storage, the model input included, parameters and buffers left out: memplan's
//! `saved_activation_bytes`.

mod common;

use memplan::infer::{infer, Bindings};
use memplan::onnx::load_model;
use memplan::train::{build_schedule, Loss, Precision, TrainOptions};
use serde_json::Value;

/// Where memplan is not within 0.05 % of PyTorch, and why. Every other model is:
/// 20 exactly; whisper_mini (−400 bytes), clip_tiny (−16, −32) and gpt2_dynamo
/// (−1,024) by what they differ in float32; mixer_tiny, tnt_tiny and convit_tiny by
/// under 0.01 %.
const ALLOWED: &[(&str, f64, &str)] = &[
    // F.cross_entropy is on no autocast list: its log_softmax runs in half (saved,
    // LogSoftmaxBackward0), and nll_loss, on the float32 list, saves a float32 copy
    // of it. memplan counts the float32 log-probabilities only: 2 bytes a score less.
    ("mlp_loss", 0.0025, "cross_entropy's half log-probabilities"),
    // Not traced: +1,024 bytes at batch 2, +2,048 at 4 (exact in float32).
    ("siglip_tiny", 0.002, "not traced"),
    // Not traced: +0.58 % at batch 2, +0.95 % at 4 (4,624 and 9,248 bytes); the
    // GroupNorm inputs, weight casts and drop-path factors were checked.
    ("poolformer_tiny", 0.01, "not traced"),
];

fn reference() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(common::shipped("amp_reference.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

#[test]
fn saved_activations_match_pytorch_under_cuda_autocast() {
    let mut checked = 0;
    let mut report = Vec::new();
    for (name, r) in reference().iter().filter(|(k, _)| !k.starts_with('_')) {
        if r.get("error").is_some() {
            continue;
        }
        let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
        let allowed = ALLOWED.iter().find(|a| a.0 == name).map_or(0.0005, |a| a.1);
        for b in [2u64, 4] {
            let inf = infer(
                &model,
                &Bindings {
                    batch: Some(b),
                    ..Default::default()
                },
            )
            .unwrap();
            for (key, precision) in [
                ("amp-fp16", Precision::AmpFp16),
                ("amp-bf16", Precision::AmpBf16),
            ] {
                let x = &r[&format!("batch_{b}")][key];
                let want = x["saved_bytes"].as_u64().unwrap();
                let opts = TrainOptions {
                    precision,
                    loss: match x["loss"].as_str() {
                        Some("graph") => Loss::Graph,
                        _ => Loss::Mean,
                    },
                    ..Default::default()
                };
                let got = build_schedule(&model, &inf, &opts)
                    .unwrap()
                    .saved_activation_bytes();
                let d = got as f64 / want as f64 - 1.0;
                report.push(format!(
                    "{name} b{b} {key}: {got} vs {want} ({:+.3}%)",
                    d * 100.0
                ));
                assert!(
                    d.abs() <= allowed,
                    "{name} batch {b} {key}: saved {got} vs PyTorch {want} ({:+.3}%)",
                    d * 100.0
                );
                checked += 1;
            }
        }
    }
    println!("{}", report.join("\n"));
    assert_eq!(checked, 116, "29 models, 2 batches, 2 precisions");
}

/// A Python scalar widens nothing: GPT-2's tanh GELU computes `0.5 * x` in half
/// (the exporter writes the scalar as a 0-d float32 constant), so the half product
/// is saved, not a float32 one (GPT-2 was 3.9 % over before).
#[test]
fn a_scalar_constant_does_not_widen_a_half_tensor() {
    let x = &reference()["gpt2"]["batch_2"]["amp-fp16"];
    assert!(x["saved_by"]["MulBackward0._saved_self float16"].as_u64() > Some(0));
    let model = load_model(&common::shipped("gpt2.onnx")).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let opts = TrainOptions {
        precision: Precision::AmpFp16,
        ..Default::default()
    };
    let s = build_schedule(&model, &inf, &opts).unwrap();
    let half = s
        .storages
        .iter()
        .find(|st| st.saved && st.name == "/transformer/h.0/mlp/act/Mul_output_0")
        .expect("the GELU's 0.5 * x is saved");
    assert_eq!(half.dtype, memplan::ir::DType::F16);
}

/// GroupNorm under autocast saves the float32 copy of a half input, as
/// `native_group_norm` (on autocast's float32 list) does; the CPU executor runs the
/// step reading that copy: the measured peak is the predicted one and recomputation
/// leaves the gradients bitwise equal.
#[test]
fn group_norm_saves_its_float32_copy_and_runs() {
    let path = common::shipped("wav2vec2_tiny.onnx");
    let x = &reference()["wav2vec2_tiny"]["batch_2"]["amp-bf16"];
    assert!(x["saved_by"]["NativeGroupNormBackward0._saved_input float32"].as_u64() > Some(0));
    let model = load_model(&path).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let opts = TrainOptions {
        precision: Precision::AmpBf16,
        ..Default::default()
    };
    let s = build_schedule(&model, &inf, &opts).unwrap();
    assert_eq!(
        s.fused_copies.len(),
        1,
        "one GroupNorm, on a convolution's output"
    );
    let (_, _, copy) = s.fused_copies[0];
    assert!(s.storages[copy].saved);
    assert_eq!(s.storages[copy].dtype, memplan::ir::DType::F32);
    for precision in ["amp-bf16", "amp-fp16"] {
        common::verify_exact_with(&path, "0.9", &["--precision", precision]);
    }
}
