//! The GPU backend (feature `cuda`; docs/CUDA.md).
//!
//! - `nvrtc_compiles_every_kernel`: every kernels/*.cu compiles with NVRTC for
//!   several architectures and defines the kernels it is expected to; needs only
//!   libnvrtc (no GPU). Skips with the reason when libnvrtc cannot be loaded,
//!   unless `MEMPLAN_REQUIRE_NVRTC=1` (CI, .ci/cuda-nvrtc.sh), where it fails.
//! - `missing_cuda_is_an_error_not_a_panic`: opening a device where the driver
//!   or a GPU is missing answers with one line.
//! - `ops_agree_with_cpu`: op by op, forward (outputs and extras) and backward
//!   (every differentiable input), the device launchers against the CPU kernels,
//!   relative 1e-4 in f32 (max-norm: `max|gpu − cpu| ≤ 1e-4 · max|cpu|`), integer
//!   and bool outputs exactly. Skips with the reason when no GPU is usable.
//! - `models_forward_agree`: whole models (mlp, cnn, transformer) forward.
//! - `*_emulated`: the same on the host emulation of kernels/ (needs `c++`; with
//!   `MEMPLAN_REQUIRE_CXX=1` a missing compiler fails instead of skipping).
//! - `device_coverage_of_models`: no data goes through the host fallback in any
//!   model of models/, forward or backward.
//! - `train_step_agrees[_emulated]`: the training step on the device
//!   (`exec::cuda::step::DeviceStep`) following a baseline and planned schedules:
//!   counted device peak == replay's, live bytes per instruction == the CPU
//!   allocator's, gradients against the CPU executor, planned runs bitwise equal
//!   to the device baseline. `train_step_fused_emulated`: the transformer (fused
//!   exact GELU and SDPA, the logsumexp through the host), the same checks.
//!   `train_step_refusals_emulated`: a half-precision policy is refused in one
//!   line. `verify_on_device[_emulated]`: `verify_cuda`.
//! - ignored: `train_step_larger_emulated` (mobilenet_v2, resnet18 on the
//!   emulation), `resnet18_relu_sign_flips_emulated` (why resnet18's gradients
//!   differ from the CPU's: ReLU inputs within rounding of 0).
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeSet;

use common::opcase::{Case, Rng};
use memplan::exec::cuda::kernels;
use memplan::exec::cuda::ops::{backward, forward, DevBackwardCx, DevKernelCx, Path};
use memplan::exec::cuda::{probe, Device, DeviceTensor};
use memplan::exec::cuda_src::SOURCES;
use memplan::exec::Tensor;
use memplan::ir::Attr;
use memplan::ops::{registry, BackwardCx, Cx, Fact, KernelCx, Saved};

#[test]
fn nvrtc_compiles_every_kernel() {
    let required = std::env::var("MEMPLAN_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if !kernels::nvrtc_available() {
        assert!(
            !required,
            "MEMPLAN_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH={:?})",
            std::env::var("LD_LIBRARY_PATH").ok()
        );
        eprintln!(
            "SKIP nvrtc_compiles_every_kernel: libnvrtc cannot be loaded (install the \
             nvidia-cuda-nvrtc-cu12 wheel and put its lib/ on LD_LIBRARY_PATH; see .ci/cuda-nvrtc.sh)"
        );
        return;
    }
    let mut compiled = 0;
    for arch in ["compute_75", "compute_80", "compute_90"] {
        for src in SOURCES {
            let ptx = kernels::compile(src, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let text = kernels::ptx_text(&ptx);
            for k in src.kernels() {
                assert!(
                    text.contains(&format!(".entry {k}(")),
                    "{arch}: kernels/{} does not define entry {k}",
                    src.file
                );
            }
            compiled += 1;
        }
    }
    let names: usize = SOURCES.iter().map(|s| s.kernels().len()).sum();
    eprintln!(
        "NVRTC compiled {compiled} programs ({} files x 3 architectures, {names} kernels each time)",
        SOURCES.len()
    );
}

#[test]
fn missing_cuda_is_an_error_not_a_panic() {
    let libs = probe();
    eprintln!("CUDA libraries loadable: {libs:?}");
    match Device::new(0) {
        Ok(dev) => eprintln!("a GPU is usable here: {}", dev.name().unwrap()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("Device::new(0): {msg}");
            assert!(!msg.contains('\n'), "one line: {msg}");
            if !libs.driver {
                assert!(msg.contains("libcuda"), "{msg}");
            }
        }
    }
}

/// The device, or why there is none (printed).
fn device(test: &str) -> Option<Device> {
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIP {test}: no usable GPU: {e}");
            None
        }
    }
}

fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v])
}

/// `max|got − want| ≤ 1e-4 · max|want|` for floats, equality otherwise.
fn agree(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(
        (got.dtype(), &got.shape),
        (want.dtype(), &want.shape),
        "{what}: dtype and shape"
    );
    if !want.dtype().is_float() {
        assert_eq!(got.to_i64s(), want.to_i64s(), "{what}");
        return;
    }
    let (g, w) = (got.to_f32().unwrap(), want.to_f32().unwrap());
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (&a, &b)) in g.iter().zip(w.iter()).enumerate() {
        let d = match (a.is_nan(), b.is_nan()) {
            (true, true) => 0.0,
            (false, false) => (a - b).abs(),
            _ => f32::INFINITY,
        };
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    assert!(
        worst <= 1e-4 * scale,
        "{what}: element {at}: gpu {} cpu {} (max|cpu| {scale})",
        g[at],
        w[at]
    );
}

/// Forward (with extras) and backward of `case` on the CPU and on the device.
fn check(dev: &Device, case: &Case, rng: &mut Rng) -> Path {
    let what = format!(
        "{} {:?} {:?}",
        case.op,
        case.inputs
            .iter()
            .map(|t| t.shape.clone())
            .collect::<Vec<_>>(),
        case.attrs
    );
    let rule = registry().get("", case.op).unwrap();
    let node = case.node();
    let facts = case.facts();
    let cx = Cx {
        node: &node,
        inputs: facts.iter().map(Some).collect(),
        opset: case.opset,
    };
    let out_facts = rule.infer(&cx).unwrap_or_else(|e| panic!("{what}: {e}"));
    let kcx = KernelCx {
        node: &node,
        inputs: case.inputs.iter().map(Some).collect(),
        outputs: out_facts.iter().take(case.n_out).map(Some).collect(),
        opset: case.opset,
        seed: 7,
        dropout: true,
        extras: true,
    };
    let cpu = rule
        .forward_cpu(&kcx)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let dins: Vec<DeviceTensor> = case.inputs.iter().map(|t| dev.upload(t).unwrap()).collect();
    let dcx = DevKernelCx {
        node: &node,
        inputs: dins.iter().map(Some).collect(),
        input_facts: facts.iter().map(Some).collect(),
        outputs: out_facts.iter().take(case.n_out).map(Some).collect(),
        opset: case.opset,
        seed: 7,
        dropout: true,
        extras: true,
    };
    let (gpu, path) = forward(dev, &dcx).unwrap_or_else(|e| panic!("{what}: device forward: {e}"));
    assert_eq!(gpu.len(), cpu.len(), "{what}: output count");
    for (k, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        agree(
            &format!("{what} forward output {k}"),
            &dev.download(g).unwrap(),
            c,
        );
    }
    let Some(bw) = rule.backward(&cx, &out_facts).unwrap() else {
        return path;
    };
    let diff: Vec<usize> = bw
        .grads
        .iter()
        .map(|g| g.input)
        .filter(|&i| {
            i < case.inputs.len() && case.inputs[i].dtype().is_float() && !case.consts.contains(&i)
        })
        .collect();
    if diff.is_empty() {
        return path;
    }
    let mut needs: Vec<Saved> = Vec::new();
    for g in bw.grads.iter().filter(|g| diff.contains(&g.input)) {
        for &s in &g.needs {
            if !needs.contains(&s) {
                needs.push(s);
            }
        }
    }
    let gs: Vec<Tensor> = (0..case.grad_outs).map(|o| rng.t(&cpu[o].shape)).collect();
    let dgs: Vec<DeviceTensor> = gs.iter().map(|t| dev.upload(t).unwrap()).collect();
    let cpu_saved = |s: Saved| -> &Tensor {
        match s {
            Saved::Input(i) => &case.inputs[i],
            Saved::Output(i) => &cpu[i],
            Saved::Extra(i) => &cpu[case.n_out + i],
        }
    };
    let gpu_saved = |s: Saved| -> &DeviceTensor {
        match s {
            Saved::Input(i) => &dins[i],
            Saved::Output(i) => &gpu[i],
            Saved::Extra(i) => &gpu[case.n_out + i],
        }
    };
    let bcx = BackwardCx {
        node: &node,
        inputs: facts.iter().map(Some).collect(),
        outputs: out_facts.iter().take(case.n_out).map(Some).collect(),
        opset: case.opset,
        saved: needs.iter().map(|&s| (s, cpu_saved(s))).collect(),
        grads: (0..case.n_out).map(|o| gs.get(o)).collect(),
        wanted: diff.clone(),
        dropout: true,
    };
    let want = rule
        .backward_cpu(&bcx)
        .unwrap_or_else(|e| panic!("{what}: cpu backward: {e}"));
    let dbcx = DevBackwardCx {
        node: &node,
        inputs: facts.iter().map(Some).collect(),
        outputs: out_facts.iter().take(case.n_out).map(Some).collect(),
        opset: case.opset,
        saved: needs.iter().map(|&s| (s, gpu_saved(s))).collect(),
        grads: (0..case.n_out).map(|o| dgs.get(o)).collect(),
        wanted: diff.clone(),
        dropout: true,
    };
    let (got, _) = backward(dev, &dbcx).unwrap_or_else(|e| panic!("{what}: device backward: {e}"));
    for &i in &diff {
        let g = got[i]
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: no gradient {i}"));
        agree(
            &format!("{what} gradient {i}"),
            &dev.download(g).unwrap(),
            want[i].as_ref().unwrap(),
        );
    }
    path
}

fn cases(r: &mut Rng) -> Vec<Case> {
    let mut v = Vec::new();
    for op in [
        "Relu",
        "Tanh",
        "Erf",
        "Sigmoid",
        "Gelu",
        "Exp",
        "Neg",
        "Abs",
        "LeakyRelu",
        "Softplus",
        "Sin",
        "Cos",
        "HardSwish",
        "HardSigmoid",
        "Elu",
        "Identity",
    ] {
        v.push(Case::new(op, vec![r.t(&[3, 4, 5])]).opset(20));
    }
    for op in ["Sqrt", "Log", "Reciprocal"] {
        v.push(Case::new(op, vec![r.range(&[3, 7], 0.5, 2.0)]));
    }
    v.push(
        Case::new("Gelu", vec![r.t(&[4, 6])])
            .attr("approximate", Attr::String("tanh".into()))
            .opset(20),
    );
    for op in ["Add", "Sub", "Mul", "Div"] {
        v.push(Case::new(
            op,
            vec![r.t(&[2, 3, 4]), r.range(&[4], 0.5, 1.5)],
        ));
        v.push(Case::new(
            op,
            vec![r.t(&[2, 1, 4]), r.range(&[3, 1], 0.5, 1.5)],
        ));
        v.push(Case::new(
            op,
            vec![r.t(&[5, 6]), r.range(&[5, 6], 0.5, 1.5)],
        ));
    }
    v.push(Case::new("Pow", vec![r.range(&[3, 4], 0.5, 2.0), scalar(3.0)]).consts(&[1]));
    v.push(Case::new(
        "Pow",
        vec![r.range(&[3, 4], 0.5, 2.0), r.range(&[4], 0.5, 2.0)],
    ));
    for op in ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"] {
        v.push(Case::new(op, vec![r.t(&[3, 4]), r.t(&[4])]));
    }
    let c = Tensor::bool(vec![3, 1], vec![true, false, true]);
    v.push(Case::new("Where", vec![c, r.t(&[3, 4]), r.t(&[4])]));
    v.push(
        Case::new(
            "Clip",
            vec![r.range(&[4, 5], -1.0, 7.0), scalar(0.0), scalar(6.0)],
        )
        .consts(&[1, 2]),
    );
    for (n_out, training) in [(1, true), (2, true), (1, false)] {
        let t = Tensor::bool(vec![], vec![training]);
        v.push(
            Case::new("Dropout", vec![r.t(&[4, 33]), scalar(0.3), t])
                .consts(&[1])
                .outs(n_out, 1),
        );
    }
    // GEMMs.
    v.push(Case::new(
        "MatMul",
        vec![r.t(&[2, 3, 4, 5]), r.t(&[2, 3, 5, 6])],
    ));
    v.push(Case::new("MatMul", vec![r.t(&[2, 3, 4, 5]), r.t(&[5, 6])]));
    v.push(Case::new("MatMul", vec![r.t(&[4, 5]), r.t(&[3, 5, 6])]));
    v.push(Case::new(
        "MatMul",
        vec![r.t(&[2, 1, 4, 5]), r.t(&[1, 3, 5, 6])],
    ));
    v.push(Case::new("MatMul", vec![r.t(&[5]), r.t(&[3, 5, 6])]));
    v.push(Case::new("MatMul", vec![r.t(&[3, 4, 5]), r.t(&[5])]));
    for (ta, tb) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let a = if ta == 1 { r.t(&[5, 4]) } else { r.t(&[4, 5]) };
        let b = if tb == 1 { r.t(&[6, 5]) } else { r.t(&[5, 6]) };
        v.push(
            Case::new("Gemm", vec![a, b, r.t(&[6])])
                .attr("transA", Attr::Int(ta))
                .attr("transB", Attr::Int(tb))
                .attr("alpha", Attr::Float(0.5))
                .attr("beta", Attr::Float(2.0)),
        );
    }
    // Convolution and pooling.
    v.push(
        Case::new(
            "Conv",
            vec![r.t(&[2, 3, 9, 8]), r.t(&[4, 3, 3, 3]), r.t(&[4])],
        )
        .attr("pads", ints(&[1, 1, 1, 1]))
        .attr("strides", ints(&[2, 2])),
    );
    v.push(Case::new(
        "Conv",
        vec![r.t(&[2, 4, 5, 5]), r.t(&[6, 4, 1, 1])],
    ));
    v.push(
        Case::new("Conv", vec![r.t(&[1, 4, 7, 7]), r.t(&[4, 2, 3, 3])])
            .attr("group", Attr::Int(2))
            .attr("dilations", ints(&[2, 2]))
            .attr("pads", ints(&[2, 2, 2, 2])),
    );
    v.push(
        Case::new("MaxPool", vec![r.t(&[2, 3, 9, 9])])
            .attr("kernel_shape", ints(&[3, 3]))
            .attr("strides", ints(&[2, 2]))
            .attr("pads", ints(&[1, 1, 1, 1])),
    );
    v.push(
        Case::new("AveragePool", vec![r.t(&[2, 3, 8, 8])])
            .attr("kernel_shape", ints(&[3, 3]))
            .attr("strides", ints(&[2, 2]))
            .attr("pads", ints(&[1, 1, 1, 1])),
    );
    v.push(Case::new("GlobalAveragePool", vec![r.t(&[2, 5, 4, 3])]));
    // Normalization.
    let bn = |r: &mut Rng| {
        vec![
            r.t(&[4, 3, 5, 5]),
            r.range(&[3], 0.5, 1.5),
            r.t(&[3]),
            r.t(&[3]),
            r.range(&[3], 0.5, 1.5),
        ]
    };
    v.push(Case::new("BatchNormalization", bn(r)));
    v.push(
        Case::new("BatchNormalization", bn(r))
            .attr("training_mode", Attr::Int(1))
            .outs(3, 1)
            .opset(15),
    );
    v.push(Case::new(
        "LayerNormalization",
        vec![r.t(&[3, 4, 10]), r.range(&[10], 0.5, 1.5), r.t(&[10])],
    ));
    v.push(
        Case::new(
            "LayerNormalization",
            vec![r.t(&[2, 3, 4, 5]), r.range(&[5], 0.5, 1.5)],
        )
        .attr("axis", Attr::Int(-2)),
    );
    v.push(Case::new("Softmax", vec![r.t(&[3, 4, 7])]).opset(13));
    v.push(
        Case::new("Softmax", vec![r.t(&[3, 4, 7])])
            .attr("axis", Attr::Int(1))
            .opset(13),
    );
    v.push(Case::new("LogSoftmax", vec![r.t(&[5, 9])]).opset(13));
    // Reductions.
    v.push(Case::new("ReduceMean", vec![r.t(&[2, 3, 4, 5])]).attr("axes", ints(&[2, 3])));
    v.push(
        Case::new("ReduceMean", vec![r.t(&[2, 3, 4])])
            .attr("axes", ints(&[1]))
            .attr("keepdims", Attr::Int(0)),
    );
    v.push(
        Case::new(
            "ReduceSum",
            vec![r.t(&[2, 3, 4]), Tensor::i64(vec![1], vec![-1])],
        )
        .opset(13),
    );
    v.push(Case::new("ReduceMax", vec![r.t(&[2, 3, 4])]).attr("axes", ints(&[0, 2])));
    // Data movement.
    v.push(Case::new("Transpose", vec![r.t(&[2, 3, 4, 5])]).attr("perm", ints(&[0, 2, 1, 3])));
    v.push(Case::new(
        "Reshape",
        vec![r.t(&[2, 3, 4]), Tensor::i64(vec![2], vec![6, -1])],
    ));
    v.push(Case::new("Flatten", vec![r.t(&[2, 3, 4])]).attr("axis", Attr::Int(1)));
    v.push(
        Case::new(
            "Unsqueeze",
            vec![r.t(&[2, 3]), Tensor::i64(vec![1], vec![1])],
        )
        .opset(13),
    );
    v.push(
        Case::new(
            "Squeeze",
            vec![r.t(&[2, 1, 3]), Tensor::i64(vec![1], vec![1])],
        )
        .opset(13),
    );
    v.push(Case::new("Concat", vec![r.t(&[2, 3, 4]), r.t(&[2, 5, 4])]).attr("axis", Attr::Int(1)));
    v.push(
        Case::new(
            "Split",
            vec![r.t(&[2, 9, 4]), Tensor::i64(vec![3], vec![2, 3, 4])],
        )
        .attr("axis", Attr::Int(1))
        .outs(3, 3)
        .opset(13),
    );
    // Slice on the device: one block along one axis with step 1 (rotate_half).
    for (starts, ends, axes) in [(0, 4, -1), (4, i64::MAX, -1), (-2, 3, 1)] {
        v.push(Case::new(
            "Slice",
            vec![
                r.t(&[2, 3, 8]),
                Tensor::i64(vec![1], vec![starts]),
                Tensor::i64(vec![1], vec![ends]),
                Tensor::i64(vec![1], vec![axes]),
            ],
        ));
    }
    v.push(Case::new(
        "Expand",
        vec![r.t(&[3, 1]), Tensor::i64(vec![3], vec![2, 3, 4])],
    ));
    v.push(Case::new(
        "Gather",
        vec![
            r.t(&[10, 6]),
            Tensor::i64(vec![2, 3], vec![1, 3, 1, 9, 0, -1]),
        ],
    ));
    v.push(
        Case::new(
            "Gather",
            vec![r.t(&[3, 5, 4]), Tensor::i64(vec![2], vec![4, 0])],
        )
        .attr("axis", Attr::Int(1)),
    );
    // A constant scalar index (a `select`: its backward saves nothing and reads
    // the index from its fact).
    v.push(Case::new(
        "Gather",
        vec![r.t(&[4, 5]), Tensor::i64(vec![], vec![2])],
    ));
    v.push(
        Case::new(
            "Gather",
            vec![r.t(&[3, 5, 4]), Tensor::i64(vec![], vec![-1])],
        )
        .attr("axis", Attr::Int(1)),
    );
    // Casts (ONNX codes: FLOAT 1, INT32 6, INT64 7, BOOL 9), truncation and
    // saturation included.
    let xf = Tensor::f32(
        vec![2, 4],
        vec![-2.7, -0.5, 0.0, 0.4, 3.9, 1e20, -1e20, f32::NAN],
    );
    for to in [1, 6, 7, 9] {
        v.push(Case::new("Cast", vec![xf.clone()]).attr("to", Attr::Int(to)));
    }
    let xi = Tensor::i64(vec![5], vec![-3, 0, 7, 1 << 40, -(1 << 40)]);
    for to in [1, 6, 9] {
        v.push(Case::new("Cast", vec![xi.clone()]).attr("to", Attr::Int(to)));
    }
    let xb = Tensor::bool(vec![3], vec![true, false, true]);
    v.push(Case::new("Cast", vec![xb.clone()]).attr("to", Attr::Int(1)));
    v.push(Case::new("Cast", vec![xb]).attr("to", Attr::Int(7)));
    v.push(
        Case::new(
            "GatherElements",
            vec![
                r.t(&[3, 4]),
                Tensor::i64(vec![3, 2], vec![0, 3, -1, 2, 1, 1]),
            ],
        )
        .attr("axis", Attr::Int(1)),
    );
    v.push(Case::new(
        "GatherElements",
        vec![
            Tensor::i64(vec![2, 3], vec![10, 11, 12, 13, 14, 15]),
            Tensor::i64(vec![1, 3], vec![1, 0, 1]),
        ],
    ));
    // Rounding (inputs away from the integers; zero gradients), ReduceMin, and
    // CastLike to the type of its second input.
    for op in ["Floor", "Ceil"] {
        v.push(Case::new(op, vec![r.range(&[3, 4], -2.4, -1.6)]));
    }
    v.push(Case::new("ReduceMin", vec![r.t(&[2, 3, 4])]).attr("axes", ints(&[1])));
    let like = Tensor::i64(vec![1], vec![0]);
    v.push(Case::new("CastLike", vec![r.t(&[2, 3]), like]));
    // A host op (shape computation) through the fallback.
    v.push(Case::new("Shape", vec![r.t(&[2, 3])]));
    v
}

/// The host emulation built with `$MEMPLAN_CXX` (default `c++`), or `None` with the
/// reason printed; with `MEMPLAN_REQUIRE_CXX=1` (CI) a missing compiler fails.
fn emulated(test: &str) -> Option<Device> {
    let cxx = std::env::var("MEMPLAN_CXX").unwrap_or_else(|_| "c++".into());
    if std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_err()
    {
        let required = std::env::var("MEMPLAN_REQUIRE_CXX").is_ok_and(|v| v == "1");
        assert!(!required, "MEMPLAN_REQUIRE_CXX=1 but {cxx} cannot run");
        eprintln!("SKIP {test}: no C++ compiler ({cxx}) for the host emulation");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let emu = memplan::exec::cuda::emulate::Emulator::build(dir.path(), &cxx)
        .unwrap_or_else(|e| panic!("{e}"));
    Some(Device::emulated(emu))
}

/// Every op with device kernels has a case in [`cases`], so that
/// `ops_agree_with_cpu[_emulated]` checks its launchers against the CPU.
#[test]
fn every_device_op_has_a_case() {
    let covered: BTreeSet<&str> = cases(&mut Rng(0xC0DA)).iter().map(|c| c.op).collect();
    let reg = registry();
    let missing: Vec<&str> = reg
        .names()
        .into_iter()
        .filter(|n| !reg.get("", n).unwrap().cuda_kernels(n).forward.is_empty())
        .filter(|n| !covered.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "ops with device kernels but no case: {missing:?}"
    );
}

/// Every case of [`cases`] on `dev`, against the CPU.
fn run_cases(dev: &Device) {
    eprintln!("device: {} ({})", dev.name().unwrap(), dev.arch());
    let mut r = Rng(0xC0DA);
    let cs = cases(&mut r);
    let mut host = Vec::new();
    for c in &cs {
        if check(dev, c, &mut r) == Path::Host {
            host.push(c.op);
        }
    }
    assert_eq!(
        host,
        vec!["Shape"],
        "only the shape computation runs on the host"
    );
    let m = dev.memory();
    eprintln!("{} op cases agree; memory {m:?}", cs.len());
    assert_eq!(m.live_bytes, 0, "every device tensor was freed");
}

#[test]
fn ops_agree_with_cpu() {
    let Some(dev) = device("ops_agree_with_cpu") else {
        return;
    };
    run_cases(&dev);
}

/// The same cases on the host emulation of kernels/ (src/exec/cuda/emulate.rs):
/// the real launchers and kernels, compiled by `c++` (or `$CXX`), no GPU needed.
#[test]
fn ops_agree_with_cpu_emulated() {
    if let Some(dev) = emulated("ops_agree_with_cpu_emulated") {
        run_cases(&dev);
    }
}

#[test]
fn allocator_counts_and_cross_checks() {
    let Some(dev) = device("allocator_counts_and_cross_checks") else {
        return;
    };
    // Every kernel compiles and loads on this GPU (modules take device memory:
    // loaded before the mark).
    dev.preload().unwrap();
    dev.synchronize().unwrap();
    let (free0, _) = dev.mem_get_info().unwrap();
    dev.counter().reset_peak();
    dev.counter().mark(free0 as u64);
    let a = dev.zeros(memplan::ir::DType::F32, &[1 << 20]).unwrap();
    let b = dev.zeros(memplan::ir::DType::I64, &[3, 5]).unwrap();
    dev.synchronize().unwrap();
    dev.counter().sample(dev.mem_get_info().unwrap().0 as u64);
    assert_eq!(dev.memory().live_bytes, (4 << 20) + 120);
    drop(a);
    assert_eq!(dev.memory().live_bytes, 120);
    assert_eq!(dev.memory().peak_bytes, (4 << 20) + 120);
    drop(b);
    let c = dev.counter().driver_check().unwrap();
    eprintln!(
        "driver check: {c:?}, workspace {} bytes",
        dev.memory().workspace_bytes
    );
    // The driver rounds to pages: at least the counted bytes, within 2 MiB per allocation.
    assert!(c.mem_get_info_peak_delta_bytes >= (4 << 20), "{c:?}");
    assert!(
        c.mem_get_info_peak_delta_bytes <= (4 << 20) + (4 << 20),
        "{c:?}"
    );
    assert_eq!(
        dev.memory().workspace_bytes,
        memplan::exec::cuda::CUBLAS_WORKSPACE_BYTES as u64
    );
}

/// Whole models forward on the emulation against the CPU executor (same seeded
/// parameters and inputs, Dropout on), rel 1e-4.
#[test]
fn models_forward_agree_emulated() {
    if let Some(dev) = emulated("models_forward_agree_emulated") {
        models_forward(&dev);
    }
}

/// The same on a GPU.
#[test]
fn models_forward_agree() {
    let Some(dev) = device("models_forward_agree") else {
        return;
    };
    models_forward(&dev);
}

fn models_forward(dev: &Device) {
    use memplan::exec::{random_input, Executor, Options};
    use memplan::infer::{infer, Bindings};
    for name in ["mlp", "cnn", "transformer"] {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(format!("{name}.onnx"));
        let model = memplan::onnx::load_model(&path).unwrap();
        let inf = infer(
            &model,
            &Bindings {
                batch: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let opts = Options::default();
        let g = &model.graph;
        let inputs: Vec<Tensor> = g
            .inputs
            .iter()
            .enumerate()
            .map(|(i, &t)| random_input(&inf.facts[t], 1 + i as u64, 100).unwrap())
            .collect();
        let want = Executor::new(&model, &inf, opts)
            .unwrap()
            .forward(&inputs)
            .unwrap();
        let run = memplan::exec::cuda::run::forward(dev, &model, &inf, opts, &inputs)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (k, (got, want)) in run.outputs.iter().zip(&want).enumerate() {
            agree(&format!("{name} output {k}"), got, want);
        }
        let mut host: std::collections::BTreeMap<&str, usize> = Default::default();
        for op in &run.host_nodes {
            *host.entry(op.as_str()).or_default() += 1;
        }
        eprintln!("{name}: device forward agrees; nodes on the host: {host:?}");
        for op in host.keys() {
            assert!(
                matches!(
                    *op,
                    "Constant" | "Shape" | "Gather" | "Unsqueeze" | "Concat"
                ),
                "{name}: {op} ran on the host"
            );
        }
    }
}

/// Which nodes of the models in models/ the device forward of a training step
/// (`extras` on) would run on the host: only shape computations (outputs folded
/// to constants by inference, or small integer tensors) may; data there (a float
/// or large tensor without a folded value) is listed and fails, as is a backward
/// into a float tensor that runs on the host.
#[test]
fn device_coverage_of_models() {
    use memplan::exec::cuda::ops::{backward_path, forward_path};
    use memplan::infer::{infer, Bindings};
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
        .collect();
    names.sort();
    let mut bad = Vec::new();
    for path in names {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let model = memplan::onnx::load_model(&path).unwrap();
        let inf = infer(
            &model,
            &Bindings {
                batch: Some(1),
                ..Default::default()
            },
        )
        .unwrap();
        let g = &model.graph;
        let mut host: std::collections::BTreeMap<String, usize> = Default::default();
        for &ix in &g.order {
            let node = g.node(ix);
            let facts: Vec<Option<&Fact>> = node
                .inputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect();
            // Backward: any gradient into a float tensor that is not a constant
            // must be computed on the device.
            let rule = registry().get(&node.domain, &node.op_type).unwrap();
            let cx = Cx {
                node,
                inputs: facts.clone(),
                opset: model.opset(),
            };
            let outs: Vec<Fact> = node
                .outputs
                .iter()
                .map(|t| {
                    t.map_or_else(
                        || Fact::new(memplan::ir::DType::F32, vec![]),
                        |t| inf.facts[t].clone(),
                    )
                })
                .collect();
            if let Ok(Some(bw)) = rule.backward(&cx, &outs) {
                let trains = bw.grads.iter().any(|g| {
                    facts
                        .get(g.input)
                        .copied()
                        .flatten()
                        .is_some_and(|f| f.dtype.is_float() && f.value.is_none())
                });
                if trains && backward_path(node, &facts) == Path::Host {
                    bad.push(format!(
                        "{name}: backward of {} '{}'",
                        node.op_type, node.name
                    ));
                }
            }
            let path = forward_path(node, &facts, node.outputs.len(), model.opset(), true).unwrap();
            if path == Path::Host {
                *host.entry(node.op_type.clone()).or_default() += 1;
                let data = node.outputs.iter().flatten().any(|&t| {
                    let f = &inf.facts[t];
                    f.value.is_none() && (f.dtype.is_float() || f.numel() > 64)
                });
                if data {
                    bad.push(format!("{name}: {} '{}'", node.op_type, node.name));
                }
            }
        }
        eprintln!("{name}: on the host: {host:?}");
    }
    for b in &bad {
        eprintln!("float/large data on the host: {b}");
    }
    assert!(
        bad.is_empty(),
        "{} nodes with data run on the host",
        bad.len()
    );
}

/// A model's training step set up as `exec_train` does it (seeded parameters
/// and inputs), for the device step.
struct StepSetup {
    name: String,
    opt: memplan::train::Optimizer,
    model: memplan::ir::Model,
    inf: memplan::infer::Inferred,
    s: memplan::train::Schedule,
    g: memplan::remat::graph::RematGraph,
    params: Vec<Option<Tensor>>,
    inputs: Vec<Tensor>,
}

fn step_setup(name: &str, batch: u64, opt: memplan::train::Optimizer) -> StepSetup {
    step_setup_with(name, batch, opt, memplan::train::Precision::Fp32)
}

fn step_setup_with(
    name: &str,
    batch: u64,
    opt: memplan::train::Optimizer,
    precision: memplan::train::Precision,
) -> StepSetup {
    use memplan::exec::{Executor, Options};
    use memplan::infer::{infer, Bindings};
    use memplan::train::{build_schedule, Loss, TrainOptions};
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(format!("{name}.onnx"));
    let model = memplan::onnx::load_model(&path).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(batch),
            ..Default::default()
        },
    )
    .unwrap();
    let topts = TrainOptions {
        optimizer: opt,
        precision,
        loss: Loss::Mean,
        grads_resident: false,
    };
    let s = build_schedule(&model, &inf, &topts).unwrap();
    let g = memplan::remat::from_schedule::from_schedule(&s, name);
    let params = Executor::new(&model, &inf, Options::default())
        .unwrap()
        .params()
        .to_vec();
    let inputs = memplan::exec::verify::seeded_inputs(&model, &inf).unwrap();
    StepSetup {
        name: name.into(),
        opt,
        model,
        inf,
        s,
        g,
        params,
        inputs,
    }
}

fn step_on<B: memplan::exec::train::StepBackend>(
    b: &B,
    su: &StepSetup,
    plan: &[memplan::remat::graph::Instr],
) -> memplan::exec::train::StepResult {
    use memplan::exec::train::{train_step_on, StepOptions};
    train_step_on(
        b,
        &su.model,
        &su.inf,
        &su.s,
        &su.g,
        plan,
        &su.params,
        &su.inputs,
        &StepOptions {
            optimizer: su.opt,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", su.name))
}

/// The device step's live bytes after every instruction are the CPU allocator's
/// (the schedule's), and its peak is replay's; the first difference is named.
fn same_counts(
    su: &StepSetup,
    what: &str,
    plan: &[memplan::remat::graph::Instr],
    dev: &memplan::exec::train::StepResult,
    cpu: &memplan::exec::train::StepResult,
) {
    let predicted = memplan::remat::graph::replay(&su.g, plan)
        .unwrap()
        .peak_bytes;
    if let Some(k) = (0..plan.len()).find(|&k| dev.live_after[k] != cpu.live_after[k]) {
        let name = match plan[k] {
            memplan::remat::graph::Instr::Compute(i) => su.g.nodes[i].name.clone(),
            memplan::remat::graph::Instr::Free(v) => format!("free {}", su.g.values[v].name),
        };
        panic!(
            "{} {what}: after instruction {k} ({name}) the device counts {} B live, the schedule {} B",
            su.name, dev.live_after[k], cpu.live_after[k]
        );
    }
    assert_eq!(dev.peak_bytes, predicted, "{} {what}: device peak", su.name);
    assert_eq!(cpu.peak_bytes, predicted, "{} {what}: CPU peak", su.name);
}

fn bitwise(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.shape == y.shape
                && x.to_f32()
                    .unwrap()
                    .iter()
                    .zip(y.to_f32().unwrap().iter())
                    .all(|(u, v)| u.to_bits() == v.to_bits())
        })
}

/// Each gradient agrees with the CPU's at rel 1e-4 (max-norm, as [`agree`]); a
/// gradient that is zero up to rounding (e.g. a convolution bias before a
/// BatchNorm: max|cpu| below 1e-4 of the model's largest gradient) is held to
/// 1e-6 of that largest gradient (a few f32 roundings of it) instead of to its
/// own noise.
fn grads_agree(name: &str, got: &[Tensor], want: &[Tensor]) {
    assert_eq!(got.len(), want.len());
    let maxabs = |t: &Tensor| t.to_f32().unwrap().iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = want.iter().map(maxabs).fold(0f32, f32::max);
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        if maxabs(w) >= 1e-4 * global {
            agree(&format!("{name} gradient {k}"), g, w);
            continue;
        }
        let d = g
            .to_f32()
            .unwrap()
            .iter()
            .zip(w.to_f32().unwrap().iter())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            d <= 1e-6 * global,
            "{name} gradient {k} (zero up to rounding): |gpu - cpu| {d}, largest gradient {global}"
        );
    }
}

/// The training step of `name` on `dev`: baseline and planned (drop-all and a
/// greedy plan at half way between the op-local bound and the baseline peak).
/// Device counted peak == replay's exactly (and the live bytes after every
/// instruction == the CPU allocator's); gradients agree with the CPU executor
/// (rel 1e-4); planned gradients, loss and updated parameters bitwise equal to
/// the device baseline.
///
/// With `cpu_strict` false (larger models, where a ReLU input within rounding of
/// 0 may take the other side on the device and switch that element's gradient:
/// `resnet18_relu_sign_flips_emulated`), the agreement with the CPU is printed,
/// not asserted; the peaks and the bitwise checks still are.
fn device_step(
    dev: &Device,
    name: &str,
    batch: u64,
    opt: memplan::train::Optimizer,
    cpu_strict: bool,
) {
    use memplan::exec::cuda::step::DeviceStep;
    use memplan::exec::train::Cpu;
    use memplan::remat::heuristics::{candidates, greedy, plan_with_drops};
    let t0 = std::time::Instant::now();
    let su = step_setup(name, batch, opt);
    let b = DeviceStep::new(dev);
    let base_plan = su.g.no_recompute_plan();
    let cpu = step_on(&Cpu, &su, &base_plan);
    let base = step_on(&b, &su, &base_plan);
    same_counts(&su, "baseline", &base_plan, &base, &cpu);
    assert_eq!(dev.memory().live_bytes, 0, "{name}: every tensor freed");
    if cpu_strict {
        grads_agree(name, &base.grads, &cpu.grads);
        for (k, (p, c)) in base.params.iter().zip(&cpu.params).enumerate() {
            if let (Some(p), Some(c)) = (p, c) {
                agree(&format!("{name} updated parameter {k}"), p, c);
            }
        }
    } else {
        let worst = base
            .grads
            .iter()
            .zip(&cpu.grads)
            .map(|(g, c)| {
                let (g, c) = (g.to_f32().unwrap(), c.to_f32().unwrap());
                let s = c.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                g.iter()
                    .zip(c.iter())
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                    / s
            })
            .fold(0f32, f32::max);
        eprintln!("{name}: gradients vs CPU, largest per-tensor relative difference {worst:e}");
    }
    assert!(
        (base.loss - cpu.loss).abs() <= 1e-4 * cpu.loss.abs().max(1e-6),
        "{name}: loss {} vs CPU {}",
        base.loss,
        cpu.loss
    );
    let mut drop_all = vec![false; su.g.values.len()];
    for v in candidates(&su.g) {
        drop_all[v] = true;
    }
    let lo = su.g.op_local_bound();
    let budget = lo + base.peak_bytes.saturating_sub(lo) / 2;
    for (what, plan) in [
        ("drop-all", plan_with_drops(&su.g, &drop_all)),
        ("greedy", greedy(&su.g, budget).0),
    ] {
        let cpu_p = step_on(&Cpu, &su, &plan);
        let p = step_on(&b, &su, &plan);
        same_counts(&su, what, &plan, &p, &cpu_p);
        let recomputed = p.executions.iter().filter(|&&e| e > 1).count();
        assert!(
            recomputed > 0,
            "{name} {what}: the plan recomputes something"
        );
        assert!(
            bitwise(&p.grads, &base.grads),
            "{name} {what}: gradients bitwise equal to the device baseline"
        );
        assert_eq!(p.loss.to_bits(), base.loss.to_bits(), "{name} {what}: loss");
        let (pp, bp): (Vec<Tensor>, Vec<Tensor>) = p
            .params
            .iter()
            .zip(&base.params)
            .filter_map(|(x, y)| Some((x.clone()?, y.clone()?)))
            .unzip();
        assert!(bitwise(&pp, &bp), "{name} {what}: updated parameters");
        eprintln!(
            "{name} ({opt}) {what}: device peak {} B == predicted (baseline {} B), {recomputed} steps recomputed, bitwise equal",
            p.peak_bytes, base.peak_bytes
        );
    }
    let m = dev.memory();
    eprintln!(
        "{name} ({opt}, batch {batch}) on {}: baseline peak {} B == predicted, {}; workspace peak {} B, launch bucket peak (temporaries, outputs in flight) {} B; {:.1} s",
        dev.name().unwrap(),
        base.peak_bytes,
        if cpu_strict {
            "gradients agree with the CPU"
        } else {
            "CPU agreement printed above"
        },
        m.workspace_peak_bytes,
        m.launch_peak_bytes,
        t0.elapsed().as_secs_f64()
    );
}

/// The training step on the host emulation: mlp and cnn with SGD (on the device),
/// mlp with Adam (the update through the host).
#[test]
fn train_step_agrees_emulated() {
    use memplan::train::Optimizer;
    let Some(dev) = emulated("train_step_agrees_emulated") else {
        return;
    };
    device_step(&dev, "mlp", 4, Optimizer::Sgd, true);
    device_step(&dev, "mlp", 4, Optimizer::Adam, true);
    device_step(&dev, "mlp", 4, Optimizer::Momentum, true);
    device_step(&dev, "cnn", 2, Optimizer::Sgd, true);
}

/// The transformer on the host emulation: its fused patterns (exact GELU, SDPA)
/// run op by op on the device kernels, the attention's logsumexp through the host
/// (uploaded into its Extra storage), so the counted peak is still replay's.
#[test]
fn train_step_fused_emulated() {
    use memplan::train::Optimizer;
    let Some(dev) = emulated("train_step_fused_emulated") else {
        return;
    };
    let su = step_setup("transformer", 2, Optimizer::Sgd);
    assert!(!su.s.fused.is_empty(), "the transformer has fused patterns");
    device_step(&dev, "transformer", 2, Optimizer::Sgd, true);
}

/// What the device step cannot run yet is refused before anything runs, in one
/// line naming it: a half-precision policy (amp-fp16).
#[test]
fn train_step_refusals_emulated() {
    use memplan::exec::cuda::step::DeviceStep;
    use memplan::exec::train::{train_step_on, StepOptions};
    let Some(dev) = emulated("train_step_refusals_emulated") else {
        return;
    };
    let su = step_setup_with(
        "mlp",
        4,
        memplan::train::Optimizer::Sgd,
        memplan::train::Precision::AmpFp16,
    );
    let err = train_step_on(
        &DeviceStep::new(&dev),
        &su.model,
        &su.inf,
        &su.s,
        &su.g,
        &su.g.no_recompute_plan(),
        &su.params,
        &su.inputs,
        &StepOptions::default(),
    )
    .expect_err("refused")
    .to_string();
    eprintln!("{err}");
    assert!(
        err.contains("half-precision") && !err.contains('\n'),
        "{err}"
    );
    assert_eq!(dev.memory().live_bytes, 0, "nothing was allocated");
}

/// The same on a GPU, plus larger models.
#[test]
fn train_step_agrees() {
    use memplan::train::Optimizer;
    let Some(dev) = device("train_step_agrees") else {
        return;
    };
    device_step(&dev, "mlp", 4, Optimizer::Sgd, true);
    device_step(&dev, "mlp", 4, Optimizer::Adam, true);
    device_step(&dev, "cnn", 2, Optimizer::Sgd, true);
    device_step(&dev, "transformer", 2, Optimizer::Sgd, true);
    device_step(&dev, "resnet18", 2, Optimizer::Sgd, false);
    device_step(&dev, "mobilenet_v2", 2, Optimizer::Sgd, false);
}

/// Larger models on the host emulation (slow: run with `--ignored`;
/// `MEMPLAN_EMU_MODELS=mobilenet_v2,resnet18` picks them, batch 1).
#[test]
#[ignore]
fn train_step_larger_emulated() {
    use memplan::train::Optimizer;
    let Some(dev) = emulated("train_step_larger_emulated") else {
        return;
    };
    let list = std::env::var("MEMPLAN_EMU_MODELS").unwrap_or_else(|_| "mobilenet_v2".into());
    for name in list.split(',').filter(|n| !n.is_empty()) {
        // mobilenet_v2 agrees with the CPU at batch 1 (checked); others printed.
        device_step(&dev, name, 1, Optimizer::Sgd, name == "mobilenet_v2");
    }
}

/// `verify` on the device (here the host emulation): both runs' counted
/// device peaks equal the predicted ones, planned gradients bitwise equal to the
/// device baseline, gradients against the CPU executor within 1e-4.
#[test]
fn verify_on_device_emulated() {
    if let Some(dev) = emulated("verify_on_device_emulated") {
        verify_on(&dev);
    }
}

/// The same on a GPU (`mem_get_info_peak_delta_bytes` is then measured).
#[test]
fn verify_on_device() {
    let Some(dev) = device("verify_on_device") else {
        return;
    };
    verify_on(&dev);
}

fn verify_on(dev: &Device) {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/cnn.onnx");
    let r = verify_report(dev, &path, 1_100_000);
    assert!(r.recomputations > 0);
    let json = serde_json::to_value(&r).unwrap();
    for k in [
        "device_name",
        "mem_get_info_peak_delta_bytes",
        "workspace_peak_bytes",
        "launch_peak_bytes",
        "cpu_max_rel_grad_diff",
        "measured_peak_bytes",
    ] {
        assert!(json.get(k).is_some(), "{k}");
    }
}

/// The copies torch.matmul and torch.einsum save (an expanded one among them) are
/// allocated on the device at the schedule's size: measured == predicted.
#[test]
fn strided_matmul_copies_on_device_emulated() {
    if let Some(dev) = emulated("strided_matmul_copies_on_device_emulated") {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/ops/strided_matmul.onnx");
        verify_report(&dev, &path, u64::MAX);
    }
}

/// `verify` on the device at batch 2 under `budget` bytes (greedy): measured ==
/// predicted with and without the plan, gradients as on the CPU.
fn verify_report(
    dev: &Device,
    path: &std::path::Path,
    budget: u64,
) -> memplan::exec::verify::VerifyReport {
    use memplan::exec::train::StepOptions;
    use memplan::exec::verify::{verify_cuda, PlanSource, VerifyOptions};
    use memplan::infer::{infer, Bindings};
    use memplan::remat::plan::Solver;
    use memplan::remat::planfile::StepSource;
    use memplan::train::{Loss, Optimizer, Precision, TrainOptions};
    let model = memplan::onnx::load_model(path).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let train = TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
    };
    let source = StepSource::new(path, Some(2), &Default::default(), &train);
    let v = verify_cuda(
        &model,
        &inf,
        &source,
        &PlanSource::Budget {
            bytes: budget,
            solver: Solver::Greedy,
            time_limit_s: 10.0,
        },
        &VerifyOptions {
            train,
            step: StepOptions::default(),
            runs: 1,
            max_memory: u64::MAX,
        },
        dev,
    )
    .unwrap();
    let r = &v.report;
    eprintln!("{}", r.to_text());
    assert_eq!(r.device, "cuda");
    assert!(r.device_name.is_some());
    assert_eq!(r.measured_peak_bytes, r.predicted_peak_bytes);
    assert_eq!(
        r.baseline_measured_peak_bytes,
        r.baseline_predicted_peak_bytes
    );
    assert!(r.gradients_identical && r.updated_params_identical);
    assert!(r.cpu_max_rel_grad_diff.unwrap() <= 1e-4, "{r:?}");
    assert!(r.workspace_peak_bytes.is_some());
    v.report
}

/// Why resnet18's gradients can differ from the CPU's beyond 1e-4 below some
/// layer (docs/CUDA.md): the forward pre-activations of every ReLU agree except
/// a few within rounding of 0 that take the other side (a discrete difference of
/// f32 rounding, not a kernel error). Slow: `--ignored`; `MEMPLAN_EMU_BATCH`.
#[test]
#[ignore]
fn resnet18_relu_sign_flips_emulated() {
    use memplan::exec::{Executor, Options};
    use memplan::infer::{infer, Bindings};
    let Some(dev) = emulated("resnet18_relu_sign_flips_emulated") else {
        return;
    };
    let batch: u64 = std::env::var("MEMPLAN_EMU_BATCH").map_or(1, |b| b.parse().unwrap());
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/resnet18.onnx");
    let mut model = memplan::onnx::load_model(&path).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(batch),
            ..Default::default()
        },
    )
    .unwrap();
    let relus: Vec<(String, usize)> = model
        .graph
        .order
        .iter()
        .map(|&ix| model.graph.node(ix))
        .filter(|n| n.op_type == "Relu")
        .map(|n| (n.name.clone(), n.inputs[0].unwrap()))
        .collect();
    for (_, t) in &relus {
        model.graph.outputs.push(*t);
    }
    let opts = Options::default();
    let inputs: Vec<Tensor> = memplan::exec::verify::seeded_inputs(&model, &inf).unwrap();
    let cpu = Executor::new(&model, &inf, opts)
        .unwrap()
        .forward(&inputs)
        .unwrap();
    let d = memplan::exec::cuda::run::forward(&dev, &model, &inf, opts, &inputs).unwrap();
    let mut total = 0;
    for (k, (name, _)) in relus.iter().enumerate() {
        let (a, b) = (
            d.outputs[k + 1].to_f32().unwrap(),
            cpu[k + 1].to_f32().unwrap(),
        );
        agree(name, &d.outputs[k + 1], &cpu[k + 1]);
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let flips: Vec<(f32, f32)> = a
            .iter()
            .zip(b.iter())
            .filter(|(x, y)| (**x > 0.0) != (**y > 0.0))
            .map(|(x, y)| (*x, *y))
            .collect();
        for &(x, y) in &flips {
            assert!(x.abs().max(y.abs()) <= 1e-5 * scale, "{name}: {x} vs {y}");
        }
        if !flips.is_empty() {
            eprintln!("{name}: pre-activation sign flips (device, cpu): {flips:?}");
        }
        total += flips.len();
    }
    eprintln!(
        "resnet18 batch {batch}: {total} ReLU inputs within rounding of 0 take the other side"
    );
}
