//! Training-step memory against what PyTorch measured for the same models
//! (models/training_reference.json, written by `python models/export.py --training`
//! on CPU): saved activations within 2 %, the step's peak within 10 %, for every
//! model at both batch sizes and both optimizers.
//!
//! On CPU, PyTorch's dropout saves a float32 noise tensor where CUDA's
//! native_dropout saves a 1-byte mask; memplan models CUDA. The reference records
//! the CPU numbers and the dropout elements, so the comparison removes the 3 extra
//! bytes per dropout element from PyTorch's saved bytes and from its peak
//! (`saved_bytes_cuda_equivalent`).

mod common;

use memplan::infer::{infer, Bindings};
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::train::{build_schedule, Optimizer, TrainOptions};
use serde_json::Value;

fn reference() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(common::shipped("training_reference.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

#[test]
fn saved_activations_and_peak_match_pytorch() {
    let mut checked = 0;
    let mut report = Vec::new();
    for (name, r) in reference().iter().filter(|(k, _)| !k.starts_with('_')) {
        let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
        for b in [2u64, 4] {
            let x = &r[format!("batch_{b}")];
            let inf = infer(
                &model,
                &Bindings {
                    batch: Some(b),
                    ..Default::default()
                },
            )
            .unwrap();
            let cpu_dropout_extra = x["saved_bytes"].as_u64().unwrap()
                - x["saved_bytes_cuda_equivalent"].as_u64().unwrap();
            for (key, optimizer) in [("sgd", Optimizer::Sgd), ("adam", Optimizer::Adam)] {
                let opts = TrainOptions {
                    optimizer,
                    ..Default::default()
                };
                let s = build_schedule(&model, &inf, &opts).unwrap();
                let peak = simulate(&s).peak().total();
                let want_saved = x["saved_bytes_cuda_equivalent"].as_u64().unwrap();
                let want_peak = x[key]["step_peak_bytes"].as_u64().unwrap() - cpu_dropout_extra;
                let ds = s.saved_activation_bytes() as f64 / want_saved as f64 - 1.0;
                let dp = peak as f64 / want_peak as f64 - 1.0;
                report.push(format!(
                    "{name} b{b} {key}: saved {ds:+.2}%, peak {dp:+.2}%",
                    ds = ds * 100.0,
                    dp = dp * 100.0
                ));
                assert!(
                    ds.abs() <= 0.02,
                    "{name} batch {b}: saved {} vs PyTorch {want_saved} ({:+.2}%)",
                    s.saved_activation_bytes(),
                    ds * 100.0
                );
                assert!(
                    dp.abs() <= 0.10,
                    "{name} batch {b} {key}: peak {peak} vs PyTorch {want_peak} ({:+.2}%)",
                    dp * 100.0
                );
                // Persistent parts are exact.
                let grads = s.bytes_where(|st| st.kind == memplan::train::StorageKind::ParamGrad);
                assert_eq!(
                    grads,
                    x["grads_bytes"].as_u64().unwrap(),
                    "{name}: gradients"
                );
                if key == "adam" {
                    let states =
                        s.bytes_where(|st| st.kind == memplan::train::StorageKind::OptimizerState);
                    let want = x["adam"]["optimizer_state_bytes"].as_u64().unwrap()
                        - x["adam"]["optimizer_state_scalar_bytes"]
                            .as_u64()
                            .unwrap_or(0);
                    assert_eq!(states, want, "{name}: Adam state");
                }
                checked += 1;
            }
        }
    }
    println!("{}", report.join("\n"));
    assert!(checked >= 44, "{checked} cases");
}
