//! QAT fake quantization (src/train/fusion.rs `FakeQuant`, src/ops/quantize.rs
//! `fake_quantize`): an exported QuantizeLinear → [Clip →] DequantizeLinear pair
//! trained as PyTorch's one float → float op, saving a bool mask.
//!
//! - The kernel against PyTorch's `fake_quantize_per_{tensor,channel}_affine`, bit
//!   for bit (tests/data/fusion/saved.json's `fake_quant_reference`, made by
//!   tests/data/fusion/export.py): ties rounded half to even, values clamped
//!   beyond the range, per tensor and per axis, the mask.
//! - One training step of the QAT models of tests/data/fusion on the CPU executor
//!   against PyTorch's eager step on the same input and weights (loss, output and
//!   each parameter's gradient, summed); tests/fusion.rs checks their saved bytes.
//! - A weight's fake quantization: its gradient is the straight-through one, the
//!   incoming gradient masked to the unclamped range, into the float parameter; the
//!   pair's FLOPs; every precision policy runs.
//! - What is not a pair: a QuantizeLinear whose float input requires a gradient is
//!   refused in one line; a DequantizeLinear of a frozen int8 weight loads and
//!   profiles, and trains what is around it.
//!
//! No finite-difference check: the straight-through gradient is by definition not
//! the derivative of the fake quantization (a staircase, flat between steps).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{model, node, value_info, with_int, D};
use memplan::exec::train::{train_step, StepOptions};
use memplan::exec::{Executor, Options, Tensor};
use memplan::infer::{infer, Bindings, Inferred};
use memplan::ir::Model;
use memplan::onnx::load_model;
use memplan::onnx::proto::TensorProto;
use memplan::ops::quantize::{
    fake_quantize, fake_quantize_backward, FakeQuantParams, FAKE_QUANT_FLOPS,
};
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::graph::replay;
use memplan::step::TrainingStep;
use memplan::train::{
    build_schedule, FusedKind, Loss, Optimizer, Precision, Schedule, StepKind, TrainOptions,
};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fusion")
}

fn saved_json() -> Value {
    let text = std::fs::read_to_string(dir().join("saved.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The training step of schedule `s` (of a model inferred as `inf`), its graph
/// named `name`.
fn training_step(inf: &Inferred, s: Schedule, name: &str) -> TrainingStep {
    let graph = from_schedule(&s, name);
    TrainingStep {
        inferred: inf.clone(),
        schedule: s,
        graph,
    }
}

fn opts(precision: Precision) -> TrainOptions {
    TrainOptions {
        optimizer: Optimizer::Sgd,
        precision,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// An initializer of `data_type` holding `raw` little-endian bytes.
fn raw_init(name: &str, dims: &[i64], data_type: i32, raw: Vec<u8>) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(data_type),
        raw_data: Some(raw.into()),
        ..Default::default()
    }
}

/// A float32 initializer with the given values.
fn f32_init(name: &str, dims: &[i64], v: &[f32]) -> TensorProto {
    raw_init(
        name,
        dims,
        1,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

/// An 8-bit initializer (`data_type` 2: uint8, 3: int8).
fn int8_init(name: &str, dims: &[i64], data_type: i32, v: &[i64]) -> TensorProto {
    raw_init(name, dims, data_type, v.iter().map(|&x| x as u8).collect())
}

/// An int32 initializer (a zero-point buffer, as PyTorch keeps it).
fn i32_init(name: &str, dims: &[i64], v: &[i32]) -> TensorProto {
    raw_init(
        name,
        dims,
        6,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

/// A `Constant` node of the given tensor.
fn constant(name: &str, out: &str, t: TensorProto) -> memplan::onnx::proto::NodeProto {
    let mut n = node("Constant", name, &[], &[out]);
    n.attribute.push(memplan::onnx::proto::AttributeProto {
        name: Some("value".into()),
        r#type: Some(memplan::onnx::proto::attribute_proto::AttributeType::Tensor as i32),
        t: Some(t),
        ..Default::default()
    });
    n
}

fn load(p: &memplan::onnx::proto::ModelProto) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_tmp(&dir, "m.onnx", &common::encode(p));
    let m = load_model(&path).unwrap();
    (dir, m)
}

/// The kernel gives PyTorch's forward values bit for bit and its mask (the
/// gradient of the sum: one where kept, zero where clamped).
#[test]
fn kernel_matches_pytorch_bit_for_bit() {
    let r = &saved_json()["fake_quant_reference"];
    let shape: Vec<usize> = r["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let x: Vec<f32> = r["x"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| floats(row).into_iter().map(|v| v as f32))
        .collect();
    let x = Tensor::f32(shape.clone(), x);
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    let mut clamped = 0;
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let p = FakeQuantParams {
            scale: floats(&c["scale"]).iter().map(|&v| v as f32).collect(),
            zero_point: floats(&c["zero_point"]).iter().map(|&v| v as i64).collect(),
            axis: c["axis"].as_u64().map(|a| a as usize),
            qmin: c["qmin"].as_i64().unwrap(),
            qmax: c["qmax"].as_i64().unwrap(),
        };
        let (y, mask) = fake_quantize(&x, &p, true).unwrap();
        let want: Vec<f32> = floats(&c["out"]).iter().map(|&v| v as f32).collect();
        let got = y.as_f32().unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{name}: element {i}: {g} vs PyTorch's {w}"
            );
        }
        let mask = mask.unwrap();
        let want_mask: Vec<bool> = c["mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_bool().unwrap())
            .collect();
        assert_eq!(
            mask,
            Tensor::bool(shape.clone(), want_mask.clone()),
            "{name}"
        );
        clamped += want_mask.iter().filter(|m| !**m).count();
        // The straight-through gradient: the incoming one where the mask is set.
        let g = Tensor::f32(shape.clone(), (0..15).map(|i| i as f32 + 0.5).collect());
        let d = fake_quantize_backward(&g, &mask, memplan::ir::DType::F32).unwrap();
        for (i, (&dv, &m)) in d.as_f32().unwrap().iter().zip(&want_mask).enumerate() {
            assert_eq!(dv, if m { i as f32 + 0.5 } else { 0.0 }, "{name}");
        }
    }
    assert!(clamped >= 5, "the reference clamps some values ({clamped})");
    // Ties at scale 0.25, zero point 3: 0.125 / 0.25 = 0.5 rounds to 0, 0.375 to
    // 2 (half to even), -0.125 to 0, -0.375 to -2.
    let y = &floats(&cases[0]["out"])[..4];
    assert_eq!(y, [0.0, 0.5, 0.0, -0.5]);
}

/// A graph `out = x + DQ(Q(w))` of a weight `w` (per axis on a `[2, 3]` weight, or
/// through PyTorch's `(0, 127)` Clip): the weight's gradient is the loss's
/// gradient (`1/numel` for a mean over the batch) where the mask is set, zero
/// where clamped, into the float parameter; the output is the fake quantization.
#[test]
fn a_weight_fake_quantization_trains_the_float_weight() {
    let w = [0.3f32, -2.0, 1.26, 0.05, 40.0, -0.12];
    for clip in [false, true] {
        // As the exporter writes it: the int32 zero-point buffer cast to 8 bits, the
        // Clip's bound a uint8 Constant.
        let mut nodes = vec![
            with_int(
                node("Cast", "zcast", &["zp"], &["z"]),
                "to",
                if clip { 2 } else { 3 },
            ),
            with_int(
                node("QuantizeLinear", "q", &["w", "s", "z"], &["wq"]),
                "axis",
                0,
            ),
        ];
        let inits = vec![
            f32_init("w", &[2, 3], &w),
            f32_init("s", &[2], &[0.1, 0.25]),
            i32_init("zp", &[2], &[3, 100]),
        ];
        let mut dq_in = "wq";
        if clip {
            nodes.push(constant("hi_const", "hi", int8_init("", &[], 2, &[127])));
            nodes.push(node("Clip", "clip", &["wq", "", "hi"], &["wc"]));
            dq_in = "wc";
        }
        nodes.push(with_int(
            node("DequantizeLinear", "dq", &[dq_in, "s", "z"], &["wf"]),
            "axis",
            0,
        ));
        nodes.push(node("Add", "add", &["x", "wf"], &["out"]));
        let p = model(
            nodes,
            inits,
            vec![value_info("x", 1, &[D::S("batch"), D::N(2), D::N(3)])],
            vec![value_info("out", 1, &[D::S("batch"), D::N(2), D::N(3)])],
        );
        let (_d, m) = load(&p);
        let inf = infer(
            &m,
            &Bindings {
                batch: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let s = build_schedule(&m, &inf, &opts(Precision::Fp32)).unwrap();
        let fq: Vec<_> = s
            .fused
            .iter()
            .filter(|p| p.kind == FusedKind::FakeQuant)
            .collect();
        assert_eq!(fq.len(), 1);
        let f = fq[0].fake_quant.as_ref().unwrap();
        let range = if clip { (0, 127) } else { (-128, 127) };
        assert_eq!((f.qmin, f.qmax, f.axis), (range.0, range.1, Some(0)));
        // The zero point's Cast (and the Clip's Constant) are the pattern's qparams.
        assert_eq!(f.qparams.len(), 1 + clip as usize);
        assert_eq!(fq[0].nodes.len(), 3 + 2 * clip as usize);
        // Saved: the mask alone, one byte per weight element (the weight is a
        // parameter; the integer values are views and cost nothing).
        assert_eq!(s.saved_activation_bytes(), 6, "clip {clip}");
        let flops = |name: &str, kind: StepKind| {
            s.steps
                .iter()
                .find(|st| st.name == name && st.kind == kind)
                .map(|st| st.flops)
                .unwrap()
        };
        assert_eq!(
            flops("q", StepKind::Forward) + flops("dq", StepKind::Forward),
            6 * FAKE_QUANT_FLOPS
        );
        assert_eq!(flops("q/grad", StepKind::Backward), 6);
        assert_eq!(flops("dq/grad", StepKind::Backward), 0);
        // One step on the CPU executor.
        let training = training_step(&inf, s, "w");
        let (s, g) = (&training.schedule, &training.graph);
        let plan = g.no_recompute_plan();
        let params = Executor::new(&m, &inf, Options::default())
            .unwrap()
            .params()
            .to_vec();
        let x = Tensor::f32(vec![2, 2, 3], vec![0.0; 12]);
        let r = train_step(
            &m,
            &training,
            &plan,
            &params,
            &[x],
            &StepOptions {
                optimizer: Optimizer::Sgd,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.peak_bytes, replay(g, &plan).unwrap().peak_bytes);
        let want = fake_quantize(
            &Tensor::f32(vec![2, 3], w.to_vec()),
            &FakeQuantParams {
                scale: vec![0.1, 0.25],
                zero_point: vec![3, 100],
                axis: Some(0),
                qmin: range.0,
                qmax: range.1,
            },
            true,
        )
        .unwrap();
        let out = r.output.as_f32().unwrap();
        assert_eq!(&out[..6], want.0.as_f32().unwrap(), "clip {clip}");
        // By hand: channel 0 (scale 0.1, zero point 3): 0.3 -> 6 and 1.26 -> 16 kept,
        // -2.0 -> -17, kept in int8's [-128, 127], clamped in the Clip's [0, 127];
        // channel 1 (0.25, 100): 0.05 -> 100 and -0.12 -> 100 kept, 40 -> 260 clamped.
        let mask: Vec<bool> = match want.1.unwrap().elems {
            memplan::exec::Elems::Bool(m) => m,
            _ => unreachable!(),
        };
        let by_hand = if clip {
            [true, false, true, true, false, true]
        } else {
            [true, true, true, true, false, true]
        };
        assert_eq!(mask, by_hand);
        let k = s
            .with_grad
            .iter()
            .position(|&t| m.graph.tensor(t).name == "w")
            .unwrap();
        let gw = r.grads[k].as_f32().unwrap();
        for (i, (&gv, &keep)) in gw.iter().zip(&mask).enumerate() {
            // Mean over 12 outputs, two batch rows each reading the weight.
            let want = if keep { 2.0 / 12.0 } else { 0.0 };
            assert!(
                (gv - want).abs() < 1e-7,
                "clip {clip}: w[{i}]: {gv} vs {want}"
            );
        }
    }
}

/// One eager PyTorch step of the QAT models at batch 2 on a computed input
/// (tests/data/fusion/export.py `reference`), run on the CPU executor from the same
/// weights: the loss, the output and every parameter's gradient agree (sums, to
/// 1e-6 of their size: f32 summation order; the outputs' sums agree to the bit
/// here).
#[test]
fn qat_models_step_as_pytorch() {
    let saved = saved_json();
    for name in ["qat_convnet", "fake_quant_fn"] {
        let r = &saved[name]["reference"];
        let m = load_model(&dir().join(format!("{name}.onnx"))).unwrap();
        let inf = infer(
            &m,
            &Bindings {
                batch: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let s = build_schedule(&m, &inf, &opts(Precision::Fp32)).unwrap();
        let training = training_step(&inf, s, name);
        let (s, plan) = (&training.schedule, training.graph.no_recompute_plan());
        let params = Executor::new(&m, &inf, Options::default())
            .unwrap()
            .params()
            .to_vec();
        let shape: Vec<usize> = r["input_shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let n: usize = shape.iter().product();
        // export.py's reference_input: ((37 i) mod 101 - 50) / 25 in float32.
        let x: Vec<f32> = (0..n)
            .map(|i| ((37 * i) % 101) as f32 - 50.0)
            .map(|v| v / 25.0)
            .collect();
        let step = train_step(
            &m,
            &training,
            &plan,
            &params,
            &[Tensor::f32(shape, x)],
            &StepOptions {
                optimizer: Optimizer::Sgd,
                dropout: false,
                ..Default::default()
            },
        )
        .unwrap();
        let close = |what: &str, got: f64, want: f64, scale: f64| {
            assert!(
                (got - want).abs() <= 1e-6 * scale.abs().max(1e-3),
                "{name}: {what}: memplan {got:.9e}, PyTorch {want:.9e}"
            );
        };
        close(
            "loss",
            step.loss,
            r["loss"].as_f64().unwrap(),
            r["loss"].as_f64().unwrap(),
        );
        let sums = |t: &Tensor| {
            let v = t.to_f64s();
            [
                v.iter().sum::<f64>(),
                v.iter().map(|x| x.abs()).sum(),
                v.iter().map(|x| x * x).sum(),
            ]
        };
        let want = floats(&r["output"]);
        let got = sums(&step.output);
        for k in 0..3 {
            close("output", got[k], want[k], want[1]);
        }
        let grads = r["grads"].as_object().unwrap();
        assert_eq!(
            grads.len(),
            s.with_grad.len(),
            "{name}: parameters with a gradient"
        );
        for (k, &t) in s.with_grad.iter().enumerate() {
            let pname = &m.graph.tensor(t).name;
            let want = floats(&grads[pname.as_str()]);
            let got = sums(&step.grads[k]);
            for j in 0..3 {
                close(
                    &format!("{pname} gradient"),
                    got[j],
                    want[j],
                    want[1].max(want[2]),
                );
            }
        }
    }
}

/// The QAT models run one step under every precision policy, measured peak =
/// predicted (the fake quantization's output in its input's type: autocast does
/// not list it).
#[test]
fn qat_models_run_under_every_precision() {
    for name in ["qat_convnet", "fake_quant_fn"] {
        let m = load_model(&dir().join(format!("{name}.onnx"))).unwrap();
        let inf = infer(
            &m,
            &Bindings {
                batch: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let params = Executor::new(&m, &inf, Options::default())
            .unwrap()
            .params()
            .to_vec();
        let inputs = memplan::exec::verify::seeded_inputs(&m, &inf).unwrap();
        for p in [
            Precision::Fp32,
            Precision::AmpFp16,
            Precision::AmpBf16,
            Precision::Bf16,
        ] {
            let s = build_schedule(&m, &inf, &opts(p)).unwrap();
            let training = training_step(&inf, s, name);
            let plan = training.graph.no_recompute_plan();
            let r = train_step(
                &m,
                &training,
                &plan,
                &params,
                &inputs,
                &StepOptions {
                    optimizer: Optimizer::Sgd,
                    ..Default::default()
                },
            )
            .unwrap_or_else(|e| panic!("{name} {p:?}: {e}"));
            assert_eq!(
                r.peak_bytes,
                replay(&training.graph, &plan).unwrap().peak_bytes,
                "{name} {p:?}"
            );
            assert!(r.loss.is_finite(), "{name} {p:?}");
        }
    }
}

/// `x → Gemm → QuantizeLinear → DequantizeLinear` where the pair does not match
/// (another scale, another axis): the QuantizeLinear's float input requires a
/// gradient, so training is refused in one line naming the node.
#[test]
fn a_quantize_outside_a_pair_is_refused_in_one_line() {
    for (dq_scale, dq_axis) in [("s2", 1), ("s", 0)] {
        let p = model(
            vec![
                with_int(node("Gemm", "fc", &["x", "w", "b"], &["h"]), "transB", 1),
                with_int(node("Cast", "zcast", &["zp"], &["z"]), "to", 3),
                with_int(
                    node("QuantizeLinear", "q", &["h", "s", "z"], &["hq"]),
                    "axis",
                    1,
                ),
                with_int(
                    node("DequantizeLinear", "dq", &["hq", dq_scale, "z"], &["out"]),
                    "axis",
                    dq_axis,
                ),
            ],
            vec![
                common::weight("w", &[2, 3]),
                common::weight("b", &[2]),
                f32_init("s", &[2], &[0.1, 0.2]),
                f32_init("s2", &[2], &[0.1, 0.3]),
                i32_init("zp", &[2], &[0, 0]),
            ],
            vec![value_info("x", 1, &[D::N(2), D::N(3)])],
            vec![value_info("out", 1, &[D::N(2), D::N(2)])],
        );
        let (_d, m) = load(&p);
        let inf = infer(&m, &Bindings::default()).unwrap();
        let e = build_schedule(&m, &inf, &opts(Precision::Fp32))
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'), "{e}");
        assert!(
            e.contains("'q'") && e.contains("QuantizeLinear") && e.contains("fake quantization"),
            "{e}"
        );
    }
}

/// A frozen int8 weight (`DequantizeLinear` of an int8 initializer, per axis) in
/// front of a MatMul: it loads, profiles for inference and training (`memplan
/// profile --train`), and the trainable layer after it trains; nothing flows into
/// the integers.
#[test]
fn a_frozen_int8_weight_loads_and_profiles() {
    let p = model(
        vec![
            with_int(
                node("DequantizeLinear", "dq", &["wq", "s", "z"], &["w"]),
                "axis",
                1,
            ),
            node("MatMul", "mm", &["x", "w"], &["h"]),
            node("MatMul", "mm2", &["h", "w2"], &["out"]),
        ],
        vec![
            int8_init(
                "wq",
                &[3, 4],
                3,
                &[1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, 127],
            ),
            f32_init("s", &[4], &[0.1, 0.2, 0.3, 0.4]),
            int8_init("z", &[4], 3, &[0, 1, 0, -1]),
            common::weight("w2", &[4, 2]),
        ],
        vec![value_info("x", 1, &[D::S("batch"), D::N(3)])],
        vec![value_info("out", 1, &[D::S("batch"), D::N(2)])],
    );
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_tmp(&dir, "frozen.onnx", &common::encode(&p));
    let m = load_model(&path).unwrap();
    let inf = infer(
        &m,
        &Bindings {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let s = build_schedule(&m, &inf, &opts(Precision::Fp32)).unwrap();
    assert!(s.fused.is_empty());
    let names: Vec<&str> = s
        .with_grad
        .iter()
        .map(|&t| m.graph.tensor(t).name.as_str())
        .collect();
    assert_eq!(names, ["w2"]);
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .arg("profile")
        .arg(&path)
        .args(["--batch", "2", "--train", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["training"]["peak_bytes"].as_u64().unwrap() > 0, "{v}");
}

/// The QAT models' step on the GPU backend's host emulation (feature `cuda`):
/// the fake quantizations take the host path (mask and output from the downloaded
/// input, uploaded into their storages; the masked gradient likewise), and the
/// device counts the schedule's bytes: measured = predicted, baseline and planned,
/// gradients identical and within 1e-4 of the CPU's (fp32; amp-fp16 2e-3, bf16
/// 2e-2).
#[cfg(feature = "cuda")]
#[test]
fn qat_models_verify_on_the_emulated_device() {
    use memplan::exec::verify::{verify_cuda, PlanSource, VerifyOptions};
    use memplan::remat::plan::Solver;
    use memplan::remat::planfile::StepSource;
    let Some(dev) = common::devices::emulated("qat_models_verify_on_the_emulated_device") else {
        return;
    };
    // Under a half-precision policy too (the fake quantization's output in its
    // input's type), gradients against the CPU's at about four ulps of the half
    // type (tests/cuda_step.rs `train_step_half_emulated`).
    let cases = ["qat_convnet", "fake_quant_fn"].into_iter().flat_map(|n| {
        [
            (n, Precision::Fp32, 1e-4),
            (n, Precision::AmpFp16, 2e-3),
            (n, Precision::Bf16, 2e-2),
        ]
    });
    for (name, precision, tol) in cases {
        let path = dir().join(format!("{name}.onnx"));
        let m = load_model(&path).unwrap();
        let inf = infer(
            &m,
            &Bindings {
                batch: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let train = opts(precision);
        let s = build_schedule(&m, &inf, &train).unwrap();
        let g = from_schedule(&s, name);
        let baseline = replay(&g, &g.no_recompute_plan()).unwrap().peak_bytes;
        let source = StepSource::new(&path, Some(2), &Default::default(), &train);
        let v = verify_cuda(
            &m,
            &inf,
            &source,
            &PlanSource::Budget {
                bytes: baseline * 97 / 100,
                solver: Solver::Greedy,
                time_limit_s: 10.0,
            },
            &VerifyOptions {
                train,
                step: StepOptions::default(),
                runs: 1,
                max_memory: u64::MAX,
            },
            &dev,
        )
        .unwrap_or_else(|e| panic!("{name} {precision}: {e}"));
        let r = &v.report;
        eprintln!("{name} {precision}: {}", r.to_text());
        assert_eq!(r.measured_peak_bytes, r.predicted_peak_bytes, "{name}");
        assert_eq!(
            r.baseline_measured_peak_bytes, r.baseline_predicted_peak_bytes,
            "{name}"
        );
        assert!(
            r.gradients_identical && r.updated_params_identical,
            "{name}"
        );
        assert!(
            r.cpu_max_rel_grad_diff.unwrap() <= tol,
            "{name} {precision}: {r:?}"
        );
    }
}
