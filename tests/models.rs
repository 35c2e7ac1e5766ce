//! Every model in models/ loads, every tensor gets a concrete shape, and parameter
//! counts and output shapes equal what PyTorch reports (tests/data/pytorch/reference.json,
//! written by models/export.py).

mod common;

use memplan::infer::{infer, Bindings};
use memplan::memory::profile_inference;
use memplan::onnx::load_model;
use serde_json::Value;

fn reference() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(common::pytorch_data("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v.as_object().unwrap().clone()
}

fn batch(b: u64) -> Bindings {
    Bindings {
        batch: Some(b),
        ..Default::default()
    }
}

fn check_io(name: &str, list: &Value, got: &[(String, String, Vec<usize>)]) {
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), got.len(), "{name}: count");
    for (want, (gname, gdtype, gshape)) in list.iter().zip(got) {
        assert_eq!(want["name"].as_str().unwrap(), gname, "{name}");
        assert_eq!(want["dtype"].as_str().unwrap(), gdtype, "{name} {gname}");
        let shape: Vec<usize> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(&shape, gshape, "{name} {gname}");
    }
}

#[test]
fn every_shipped_model_matches_pytorch() {
    let refs = reference();
    let mut checked = 0;
    for (name, r) in refs.iter().filter(|(k, _)| !k.starts_with('_')) {
        let path = common::shipped(&format!("{name}.onnx"));
        let model = load_model(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.opset(), r["opset"].as_i64().unwrap(), "{name}");
        assert!(
            model.graph.model_order_is_topological,
            "{name}: exported node order should be topological"
        );
        for (b, outputs, inputs) in [
            (2, &r["outputs"], &r["inputs"]),
            (3, &r["outputs_batch3"], &r["inputs_batch3"]),
        ] {
            let inf = infer(&model, &batch(b)).unwrap_or_else(|e| panic!("{name} @{b}: {e}"));
            assert_eq!(inf.facts.len(), model.graph.tensors.len());
            let g = &model.graph;
            let io = |ts: &[usize]| -> Vec<(String, String, Vec<usize>)> {
                ts.iter()
                    .map(|&t| {
                        (
                            g.tensor(t).name.to_string(),
                            inf.facts[t].dtype.name().to_string(),
                            inf.facts[t].shape.clone(),
                        )
                    })
                    .collect()
            };
            check_io(name, inputs, &io(&g.inputs));
            check_io(name, outputs, &io(&g.outputs));
            let prof = profile_inference(g, &inf);
            assert_eq!(
                prof.params_count,
                r["params_count"].as_u64().unwrap(),
                "{name}"
            );
            assert_eq!(
                prof.params_bytes,
                r["params_bytes"].as_u64().unwrap(),
                "{name}"
            );
            assert!(prof.activation_peak_bytes > 0, "{name}");
            assert!(prof.peak_node.is_some(), "{name}");
        }
        checked += 1;
    }
    assert!(checked >= 29, "only {checked} models in reference.json");
}

#[test]
fn memory_and_flops_are_affine_in_batch() {
    for name in ["resnet18", "gpt2", "bert_base", "vit_b_16", "transformer"] {
        let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
        let at = |b| {
            let inf = infer(&model, &batch(b)).unwrap();
            let p = profile_inference(&model.graph, &inf);
            (p.activation_peak_bytes, inf.total_flops())
        };
        // The peak is a max of affine functions of the batch (batch-independent
        // tensors such as exporter-made weight transposes dominate at tiny batches),
        // so it is affine once the peak step is stable: compare 8, 16, 32.
        let (m1, f1) = at(8);
        let (m2, f2) = at(16);
        let (m4, f4) = at(32);
        assert_eq!(
            m4 - m2,
            2 * (m2 - m1),
            "{name}: activation peak not affine in batch"
        );
        assert_eq!(f4 - f2, 2 * (f2 - f1), "{name}: FLOPs not affine in batch");
        assert!(m2 > m1 && f2 > f1, "{name}");
    }
}

/// Known figures: ResNet-50 forward at batch 1 is ~4.1 GMACs (8.2 GFLOP) in the
/// literature (convolutions and the classifier); GPT-2 124M forward over 128 tokens is
/// about 2 × params × tokens plus attention.
#[test]
fn flops_match_published_counts() {
    let model = load_model(&common::shipped("resnet50.onnx")).unwrap();
    let inf = infer(&model, &batch(1)).unwrap();
    let conv_gemm: u64 = model
        .graph
        .order
        .iter()
        .zip(&inf.flops)
        .filter(|(&ix, _)| matches!(model.graph.node(ix).op_type.as_str(), "Conv" | "Gemm"))
        .map(|(_, &f)| f)
        .sum();
    let gmacs = conv_gemm as f64 / 2e9;
    assert!(
        (4.0..4.2).contains(&gmacs),
        "resnet50 conv+gemm = {gmacs} GMACs"
    );

    let model = load_model(&common::shipped("gpt2.onnx")).unwrap();
    let inf = infer(&model, &batch(1)).unwrap();
    let matmul: u64 = model
        .graph
        .order
        .iter()
        .zip(&inf.flops)
        .filter(|(&ix, _)| matches!(model.graph.node(ix).op_type.as_str(), "MatMul" | "Gemm"))
        .map(|(_, &f)| f)
        .sum();
    // Weights excluding the position embedding (not multiplied): 124,439,808 - 1024·768;
    // the token embedding is used as the LM head. Attention adds 2·(2·128·128·768)·12.
    let expected =
        2.0 * (124_439_808.0 - 1024.0 * 768.0) * 128.0 + 12.0 * 2.0 * 2.0 * 128.0 * 128.0 * 768.0;
    let ratio = matmul as f64 / expected;
    assert!(
        (0.98..1.02).contains(&ratio),
        "gpt2 matmul flops ratio {ratio}"
    );
}

#[test]
fn both_exporters_agree() {
    for (ts, dy) in [("resnet18", "resnet18_dynamo"), ("gpt2", "gpt2_dynamo")] {
        let at = |name: &str| {
            let m = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
            let inf = infer(&m, &batch(4)).unwrap();
            let p = profile_inference(&m.graph, &inf);
            let outs: Vec<Vec<usize>> = m
                .graph
                .outputs
                .iter()
                .map(|&t| inf.facts[t].shape.clone())
                .collect();
            (p.params_count, outs)
        };
        assert_eq!(at(ts), at(dy), "{ts} vs {dy}");
    }
}

/// Every tensor (graph inputs and node outputs) gets the dtype and shape that
/// onnxruntime produced when it executed the graph at batch 2
/// (tests/data/pytorch/tensor_shapes.json, written by tools/pytorch/tensor_shapes.py).
#[test]
fn every_tensor_matches_onnxruntime_execution() {
    let text = std::fs::read_to_string(common::pytorch_data("tensor_shapes.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    let mut models = 0;
    let mut tensors = 0;
    for (name, expected) in all.as_object().unwrap() {
        let path = common::shipped(&format!("{name}.onnx"));
        let model = load_model(&path).unwrap();
        let inf = infer(&model, &batch(2)).unwrap();
        let g = &model.graph;
        let expected = expected.as_object().unwrap();
        let mut ours = 0;
        for (t, info) in g.tensors.iter().enumerate() {
            if info.producer.is_none() && info.init.is_some() {
                continue; // initializers
            }
            let want = expected
                .get(info.name.as_str())
                .unwrap_or_else(|| panic!("{name}: '{}' not in the fixture", info.name));
            let dtype = want[0].as_str().unwrap();
            let shape: Vec<usize> = want[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(
                inf.facts[t].dtype.name(),
                dtype,
                "{name}: dtype of '{}'",
                info.name
            );
            assert_eq!(
                inf.facts[t].shape, shape,
                "{name}: shape of '{}'",
                info.name
            );
            ours += 1;
        }
        assert_eq!(ours, expected.len(), "{name}: tensor count");
        tensors += ours;
        models += 1;
    }
    assert!(
        models >= 11 && tensors > 7000,
        "{models} models, {tensors} tensors"
    );
}
