//! Builds small ONNX models in Rust (no Python) for tests.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod devices;
pub mod opcase;

use std::path::PathBuf;

use memplan::onnx::proto::{
    self, tensor_shape_proto::dimension::Value as DimValue, type_proto, AttributeProto, GraphProto,
    ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto,
    ValueInfoProto,
};
use prost::Message;

/// A dimension in a declared shape.
pub enum D {
    /// dim_value
    N(i64),
    /// dim_param
    S(&'static str),
}

pub fn value_info(name: &str, elem: i32, dims: &[D]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| proto::tensor_shape_proto::Dimension {
                            denotation: None,
                            value: Some(match d {
                                D::N(v) => DimValue::DimValue(*v),
                                D::S(s) => DimValue::DimParam((*s).into()),
                            }),
                        })
                        .collect(),
                }),
            })),
            denotation: None,
        }),
        ..Default::default()
    }
}

pub fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub fn with_ints(mut n: NodeProto, attr: &str, v: &[i64]) -> NodeProto {
    n.attribute.push(AttributeProto {
        name: Some(attr.into()),
        r#type: Some(proto::attribute_proto::AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    });
    n
}

pub fn with_int(mut n: NodeProto, attr: &str, v: i64) -> NodeProto {
    n.attribute.push(AttributeProto {
        name: Some(attr.into()),
        r#type: Some(proto::attribute_proto::AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    });
    n
}

/// A float32 initializer with zero-filled raw data.
pub fn weight(name: &str, dims: &[i64]) -> TensorProto {
    let n: i64 = dims.iter().product();
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(1),
        raw_data: Some(vec![0u8; 4 * n as usize].into()),
        ..Default::default()
    }
}

/// An int64 initializer.
pub fn ints(name: &str, v: &[i64]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: vec![v.len() as i64],
        data_type: Some(7),
        int64_data: v.to_vec(),
        ..Default::default()
    }
}

pub fn model(
    nodes: Vec<NodeProto>,
    inits: Vec<TensorProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
) -> ModelProto {
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        producer_name: Some("memplan-tests".into()),
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: nodes,
            initializer: inits,
            input: inputs,
            output: outputs,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A 2-layer MLP: x[batch, 4] → Gemm(8) → Relu → Gemm(3) → y[batch, 3].
pub fn mlp() -> ModelProto {
    model(
        vec![
            with_int(node("Gemm", "fc1", &["x", "w1", "b1"], &["h"]), "transB", 1),
            node("Relu", "relu", &["h"], &["r"]),
            with_int(node("Gemm", "fc2", &["r", "w2", "b2"], &["y"]), "transB", 1),
        ],
        vec![
            weight("w1", &[8, 4]),
            weight("b1", &[8]),
            weight("w2", &[3, 8]),
            weight("b2", &[3]),
        ],
        vec![value_info("x", 1, &[D::S("batch"), D::N(4)])],
        vec![value_info("y", 1, &[D::S("batch"), D::N(3)])],
    )
}

/// Writes bytes to a fresh temporary file and returns its path (kept alive by the dir).
pub fn write_tmp(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

pub fn encode(m: &ModelProto) -> Vec<u8> {
    m.encode_to_vec()
}

/// Path of a shipped model.
pub fn shipped(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name)
}

/// Path of a reference file: what PyTorch measured that a test compares with, and the
/// generated plans it names (tests/data/pytorch/, tests/data/pytorch/README.md).
pub fn pytorch_data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/pytorch")
        .join(name)
}

/// An int64 scalar initializer.
pub fn scalar_int(name: &str, v: i64) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: vec![],
        data_type: Some(7),
        int64_data: vec![v],
        ..Default::default()
    }
}

/// A float32 scalar initializer.
pub fn scalar_float(name: &str, v: f32) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: vec![],
        data_type: Some(1),
        float_data: vec![v],
        ..Default::default()
    }
}

/// Runs the memplan binary: (success, stdout, stderr).
pub fn run_memplan(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs memplan, which must succeed, and parses what it prints as JSON.
pub fn memplan_json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = run_memplan(args);
    assert!(ok, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

/// The step peak a CUDA run would have, as a PyTorch reference measured it
/// (models/export.py, `_analyse_timeline`): the CPU timeline's peak after taking
/// out, at every instant, what is alive there that a CUDA run would not hold: 3 of
/// every 4 bytes of CPU dropout's float32 noise (CUDA keeps a 1-byte mask), the
/// CPU RNG states that non-reentrant checkpoint calls keep (host memory on a GPU),
/// copies a CPU convolution kernel makes of operands the dispatcher handed it
/// contiguous (ResNet-50's every-block peak holds one of 24.5 MiB), and the
/// scratch a CPU convolution kernel allocates itself and frees before it returns
/// (oneDNN's weight reorders: ResNet-18 with a frozen stem peaks holding one of
/// 9 MiB; the CPU conv3d's buffers). Taken at every instant, not only at the raw
/// peak: by a backward peak most of forward's noise and many checkpoints' states
/// are freed, and without the scratch the peak may move. `m`: one optimizer's entry.
/// A reference file's JSON object ([`pytorch_data`]).
pub fn json_object(file: &str) -> serde_json::Map<String, serde_json::Value> {
    let text = std::fs::read_to_string(pytorch_data(file)).unwrap();
    match serde_json::from_str(&text).unwrap() {
        serde_json::Value::Object(m) => m,
        other => panic!("{file}: not an object: {other}"),
    }
}

pub fn device_equivalent_peak(m: &serde_json::Value) -> u64 {
    m["resident_bytes_before_step"].as_u64().unwrap()
        + m["device_equivalent_step_peak_delta_bytes"]
            .as_u64()
            .expect("reference measured with the device-equivalent peak (models/export.py)")
}

/// The fp32 SGD training step (loss `out.mean()`) of the model at `path`, at `batch`:
/// loaded, inferred and scheduled as the library does (no lowering).
pub fn sgd_schedule(path: &std::path::Path, batch: u64) -> memplan::train::Schedule {
    use memplan::train::{build_schedule, Loss, Optimizer, Precision, TrainOptions};
    let model = memplan::onnx::load_model(path).unwrap();
    let b = memplan::infer::Bindings {
        batch: Some(batch),
        ..Default::default()
    };
    let inf = memplan::infer::infer(&model, &b).unwrap();
    let opts = TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    };
    build_schedule(&model, &inf, &opts).unwrap()
}

/// `memplan profile PATH --batch 2 --train --optimizer sgd --json`: its `training`
/// object.
pub fn train_json(path: &std::path::Path) -> serde_json::Value {
    let (ok, out, err) = run_train(path);
    assert!(ok, "{}: {err}", path.display());
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{}: {e}: {out}", path.display()));
    v["training"].clone()
}

/// Runs `memplan profile PATH --batch 2 --train --optimizer sgd --json`: (success,
/// stdout, stderr).
pub fn run_train(path: &std::path::Path) -> (bool, String, String) {
    let p = path.to_str().unwrap();
    run_memplan(&[
        "profile",
        p,
        "--batch",
        "2",
        "--train",
        "--optimizer",
        "sgd",
        "--json",
    ])
}

/// `memplan verify PATH --batch 2 --budget BUDGET --optimizer sgd --json`, checked:
/// the measured peak is the predicted one and the gradients are identical to the
/// step's without recomputation. Returns the report.
pub fn verify_exact(path: &std::path::Path, budget: &str) -> serde_json::Value {
    verify_exact_with(path, budget, &[])
}

/// [`verify_exact`] with more arguments (`--precision amp-fp16`).
pub fn verify_exact_with(path: &std::path::Path, budget: &str, more: &[&str]) -> serde_json::Value {
    let p = path.to_str().unwrap();
    let mut args = vec![
        "verify",
        p,
        "--batch",
        "2",
        "--budget",
        budget,
        "--optimizer",
        "sgd",
        "--json",
    ];
    args.extend_from_slice(more);
    let v = memplan_json(&args);
    let name = path.display();
    assert_eq!(
        v["measured_peak_bytes"], v["predicted_peak_bytes"],
        "{name}: {v}"
    );
    assert_eq!(v["gradients_identical"], true, "{name}: {v}");
    v
}
