//! Mixed precision (`--precision amp-fp16` / `amp-bf16`) against what PyTorch saves
//! under CUDA autocast (tests/data/pytorch/amp_reference.json, written by
//! `python tools/pytorch/amp_reference.py`: every model of models/ on *fake* CUDA tensors,
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
/// 21 exactly; whisper_mini (−400 bytes), clip_tiny (−16, −32) and gpt2_dynamo
/// (−1,024) by what they differ in float32; mixer_tiny, tnt_tiny, convit_tiny and
/// poolformer_tiny (its drop-path noise, 4 bytes a block) by under 0.01 %.
const ALLOWED: &[(&str, f64, &str)] = &[
    // F.cross_entropy is on no autocast list: its log_softmax runs in half (saved,
    // LogSoftmaxBackward0), and nll_loss, on the float32 list, saves a float32 copy
    // of it. memplan counts the float32 log-probabilities only: 2 bytes a score less.
    ("mlp_loss", 0.0025, "cross_entropy's half log-probabilities"),
];

/// The model at `path` (lowered, as the command line reads it) at `batch`, and the
/// step under `precision` with `loss`.
fn step(
    path: &std::path::Path,
    batch: u64,
    precision: Precision,
    loss: Loss,
) -> (memplan::ir::Model, memplan::train::Schedule) {
    let bind = Bindings {
        batch: Some(batch),
        ..Default::default()
    };
    let model = memplan::infer::lower::lowered(load_model(path).unwrap(), &bind).unwrap();
    let inf = infer(&model, &bind).unwrap();
    let opts = TrainOptions {
        precision,
        loss,
        ..Default::default()
    };
    let s = build_schedule(&model, &inf, &opts).unwrap();
    (model, s)
}

fn reference() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(common::pytorch_data("amp_reference.json")).unwrap();
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
        let path = common::shipped(&format!("{name}.onnx"));
        let allowed = ALLOWED.iter().find(|a| a.0 == name).map_or(0.0005, |a| a.1);
        for b in [2u64, 4] {
            for (key, precision) in [
                ("amp-fp16", Precision::AmpFp16),
                ("amp-bf16", Precision::AmpBf16),
            ] {
                let x = &r[&format!("batch_{b}")][key];
                let want = x["saved_bytes"].as_u64().unwrap();
                let loss = match x["loss"].as_str() {
                    Some("graph") => Loss::Graph,
                    _ => Loss::Mean,
                };
                let got = step(&path, b, precision, loss).1.saved_activation_bytes();
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
    let (_, s) = step(
        &common::shipped("gpt2.onnx"),
        2,
        Precision::AmpFp16,
        Loss::Mean,
    );
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
    let (_, s) = step(&path, 2, Precision::AmpBf16, Loss::Mean);
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

/// Where memplan differs from PyTorch's CUDA autocast by more than 0.05 % on the
/// census sample (tools/census/amp_check.json), and why.
const CENSUS_ALLOWED: &[(&str, f64, &str)] = &[
    // BLOOM's own GeLUFunction saves only its input; its formula exports as
    // transformers' gelu_fast, which PyTorch runs op by op (docs/CENSUS.md): +129 %
    // in float32, +61 % here.
    ("hf_bloom", 0.62, "GeLUFunction"),
    // What float32 differs by already (−0.10 %, −0.18 %).
    ("fcn_resnet50", 0.002, "as in float32"),
    ("hf_deberta_v2", 0.002, "as in float32"),
];

/// The census sample's committed exports (models/census/, and tests/data/amp/ for
/// three RMSNorm models) under `amp-fp16`, against PyTorch's CUDA autocast
/// (`python tools/census/amp_check.py`). The check found six rules, now memplan's:
/// a weight read through a view (`Transpose(W)` before each MatMul) is cast once
/// however many times it is used (ALBERT's shared layer: +9.9 % before); a broadcast
/// operand's expansion is copied from its autocast copy (Falcon's shared key:
/// −2.1 %); `norm` (ReduceL2) reads its half input as it is (swin_v2_t's cosine
/// attention: +9.1 %); a `Cast` to float32 copies a half tensor (OLMo2 −7.1 %,
/// Gemma2 −3.5 %); an RMSNorm's cast back to its input's type returns to half
/// (Qwen3's q/k norms, +3.1 % with the previous rule alone); stochastic depth's
/// noise follows the activation it scales (maxvit_t +0.72 %, poolformer_tiny
/// +0.58 %).
#[test]
fn census_sample_matches_pytorch_under_cuda_autocast() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/census/amp_check.json"),
    )
    .unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let batch = r["_meta"]["batch"].as_u64().unwrap();
    let mut checked = 0;
    for (name, x) in r.as_object().unwrap() {
        let mut path = common::shipped(&format!("census/{name}.onnx"));
        if !path.exists() {
            path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("tests/data/amp/{name}.onnx"));
        }
        let (Some(want), true) = (x["pytorch"].as_u64(), path.exists()) else {
            continue;
        };
        let got = step(&path, batch, Precision::AmpFp16, Loss::Mean)
            .1
            .saved_activation_bytes();
        let allowed = CENSUS_ALLOWED
            .iter()
            .find(|a| a.0 == name)
            .map_or(0.0005, |a| a.1);
        let d = got as f64 / want as f64 - 1.0;
        assert!(
            d.abs() <= allowed,
            "{name} batch {batch}: saved {got} vs PyTorch {want} ({:+.3}%)",
            d * 100.0
        );
        checked += 1;
    }
    assert!(checked >= 53, "{checked} census models");
}

/// The executor runs what the census check changed, under AMP: ALBERT's shared
/// layer (one weight copy read through each layer's transpose), Falcon's shared key
/// (the expansion copied from the half copy), SigLIP's `norm` (read in half) and
/// the RMSNorms' casts to float32 and back (Qwen3, OLMo2) and PoolFormer's
/// drop-path noise in half: measured peak =
/// predicted, gradients bitwise equal with recomputation.
#[test]
fn executor_runs_the_autocast_rules_the_census_found() {
    for (path, budget) in [
        (common::shipped("census/hf_albert.onnx"), "0.9"),
        (common::shipped("census/hf_falcon.onnx"), "5MiB"),
        (common::shipped("siglip_tiny.onnx"), "0.98"),
        (amp_data("hf_qwen3"), "4.5MiB"),
        (amp_data("hf_olmo2"), "4.5MiB"),
        (common::shipped("poolformer_tiny.onnx"), "0.98"),
    ] {
        common::verify_exact_with(&path, budget, &["--precision", "amp-fp16"]);
    }
}

fn amp_data(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/amp/{name}.onnx"))
}

/// Qwen3's q norm under autocast: the cast to float32 of the half projection is a
/// float32 copy (saved by the norm's `pow` and multiply), and the cast back returns
/// to half (what the weight's multiply saves), as PyTorch's `.to(torch.float32)`
/// and `.to(input_dtype)` do; in float32 both are the input itself.
#[test]
fn rms_norm_casts_follow_the_norms_input_type() {
    let dtype_of = |precision, name: &str| {
        let (model, s) = step(&amp_data("hf_qwen3"), 2, precision, Loss::Mean);
        let t = model.graph.tensor_id(name).expect(name);
        s.storages[s.tensor_storage[t]].dtype
    };
    let up = "/m/model/layers.0/self_attn/q_norm/Cast_output_0";
    let back = "/m/model/layers.0/self_attn/q_norm/Cast_1_output_0";
    use memplan::ir::DType;
    assert_eq!(dtype_of(Precision::AmpFp16, up), DType::F32);
    assert_eq!(dtype_of(Precision::AmpFp16, back), DType::F16);
    assert_eq!(dtype_of(Precision::AmpBf16, back), DType::BF16);
    assert_eq!(dtype_of(Precision::Fp32, back), DType::F32);
}
