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
//! - The training step and `verify` on the device: tests/cuda_step.rs.
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeSet;

use common::devices::{agree, device, emulated};
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

fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v])
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

#[allow(clippy::too_many_lines)] // Long by design: a table of kernel cases.
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
    // The inverse and hyperbolic trigonometric family, Swish, Shrink.
    for (op, lo, hi) in [
        ("Asin", -0.8, 0.8),
        ("Acos", -0.8, 0.8),
        ("Sinh", -1.0, 1.0),
        ("Cosh", -1.0, 1.0),
        ("Asinh", -1.0, 1.0),
        ("Acosh", 1.2, 2.0),
        ("Atanh", -0.8, 0.8),
        ("Swish", -1.0, 1.0),
        ("Shrink", 0.6, 1.0),
    ] {
        v.push(Case::new(op, vec![r.range(&[3, 4], lo, hi)]));
    }
    let c = Case::new("Swish", vec![r.t(&[3, 4])]).attr("alpha", Attr::Float(1.702));
    v.push(c.opset(24));
    let c = Case::new("Shrink", vec![r.range(&[3, 4], -2.0, 2.0)])
        .attr("lambd", Attr::Float(0.3))
        .attr("bias", Attr::Float(0.1));
    v.push(c);
    v.push(Case::new("ReduceMin", vec![r.t(&[2, 3, 4])]).attr("axes", ints(&[1])));
    let like = Tensor::i64(vec![1], vec![0]);
    v.push(Case::new("CastLike", vec![r.t(&[2, 3]), like]));
    // A host op (shape computation) through the fallback.
    v.push(Case::new("Shape", vec![r.t(&[2, 3])]));
    v
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

/// The same cases on the host emulation of kernels/ (src/exec/cuda/emulate.rs):
/// the real launchers and kernels, compiled by `c++` (or `$CXX`), no GPU needed.
fn ops_agree_with_cpu_on(dev: &Device) {
    run_cases(dev);
}

device_test!(ops_agree_with_cpu_on: ops_agree_with_cpu, ops_agree_with_cpu_emulated);

/// 3-D convolutions and pools (video models) against their planar forms: the
/// device's window kernels are 2-D (kernels/common.cuh `Win`), so a 3-D Conv,
/// MaxPool or AveragePool runs on the host, forward and backward, never through
/// a 2-D kernel; on the emulation its results agree with the CPU's.
fn window_cases(r: &mut Rng) -> Vec<(Case, bool)> {
    let conv = |x: &[usize], w: &[usize], r: &mut Rng| Case::new("Conv", vec![r.t(x), r.t(w)]);
    let pool = |op: &'static str, x: &[usize], k: &[i64], r: &mut Rng| {
        let c = Case::new(op, vec![r.distinct(x)]).attr("kernel_shape", ints(k));
        if op == "MaxPool" {
            c.outs(2, 1)
        } else {
            c
        }
    };
    vec![
        (conv(&[1, 2, 3, 4, 4], &[3, 2, 2, 2, 2], r), true),
        (conv(&[1, 2, 4, 4], &[3, 2, 2, 2], r), false),
        (pool("MaxPool", &[1, 2, 3, 4, 4], &[2, 2, 2], r), true),
        (pool("MaxPool", &[1, 2, 4, 4], &[2, 2], r), false),
        (pool("AveragePool", &[1, 2, 3, 4, 4], &[2, 2, 2], r), true),
        (pool("AveragePool", &[1, 2, 4, 4], &[2, 2], r), false),
    ]
}

#[test]
fn windows_3d_take_the_host_path() {
    use memplan::exec::cuda::ops::{backward_path, forward_path};
    for (c, three) in window_cases(&mut Rng(3)) {
        let (node, facts) = (c.node(), c.facts());
        let facts: Vec<Option<&Fact>> = facts.iter().map(Some).collect();
        let want = if three { Path::Host } else { Path::Device };
        let fwd = forward_path(&node, &facts, c.n_out, c.opset, true).unwrap();
        assert_eq!(fwd, want, "{} {:?} forward", c.op, c.inputs[0].shape);
        let bwd = backward_path(&node, &facts);
        assert_eq!(bwd, want, "{} {:?} backward", c.op, c.inputs[0].shape);
    }
    if let Some(dev) = emulated("windows_3d_take_the_host_path") {
        let mut r = Rng(4);
        for (c, three) in window_cases(&mut Rng(3)) {
            let path = check(&dev, &c, &mut r);
            assert_eq!(
                path == Path::Host,
                three,
                "{} {:?}",
                c.op,
                c.inputs[0].shape
            );
        }
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
    // cudarc allocates with cuMemAllocAsync from the device's default memory
    // pool, which takes memory from the driver in chunks: 32 MiB at a time on
    // an H200 (measured 4 December 2026: 4 MiB of tensors moved cuMemGetInfo by
    // 32 MiB; resnet18's 334 MiB step by 352 MiB). So the driver's delta is at
    // least the tensors' bytes (the workspace was allocated before the mark) and
    // at most those bytes rounded up to such chunks, with one chunk to spare.
    const POOL_CHUNK: u64 = 32 << 20;
    let tensors = (4 << 20) + 120;
    assert!(c.mem_get_info_peak_delta_bytes >= tensors, "{c:?}");
    assert!(
        c.mem_get_info_peak_delta_bytes <= tensors.div_ceil(POOL_CHUNK) * POOL_CHUNK + POOL_CHUNK,
        "{c:?}"
    );
    assert_eq!(
        dev.memory().workspace_bytes,
        memplan::exec::cuda::CUBLAS_WORKSPACE_BYTES as u64
    );
}

/// Whole models forward on the emulation against the CPU executor (same seeded
/// parameters and inputs, Dropout on), rel 1e-4.
fn models_forward_agree_on(dev: &Device) {
    models_forward(dev);
}

device_test!(models_forward_agree_on: models_forward_agree, models_forward_agree_emulated);

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

/// Float ops with gradients that have no device kernels yet and take the host
/// path, forward and backward, as docs/CUDA.md lists them: allowed (and
/// printed) in `device_coverage_of_models`; any other float data on the host
/// fails it.
const HOST_FLOAT_OPS: &[&str] = &[
    "Resize",
    "Einsum",
    "GatherND",
    "GridSample",
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "Attention",
    "RMSNormalization",
    "RotaryEmbedding",
    "LRN",
    "MeanVarianceNormalization",
    "InstanceNormalization",
    "GroupNormalization",
    "ConvTranspose",
    "RNN",
    "GRU",
    "LSTM",
    // Fake quantization (QuantizeLinear -> [Clip ->] DequantizeLinear, one fused
    // float op: train::FakeQuant): the mask and output computed on the host from the
    // downloaded input, the masked gradient likewise (exec::train).
    "QuantizeLinear",
    "DequantizeLinear",
    // The random ops draw on the host by design (ops::random: drop-path masks of
    // [batch, 1, ..], a few bytes; the timm models in models/).
    "RandomUniform",
    "RandomUniformLike",
    "RandomNormal",
    "RandomNormalLike",
    "Bernoulli",
    // No device kernel yet, forward and backward on the host: ReduceL2
    // (F.normalize: siglip_tiny), Pad (F.unfold's padding: tnt_tiny).
    "ReduceL2",
    "Pad",
];

/// Whether a node runs on the host by design: an op of [`HOST_FLOAT_OPS`], or a
/// 3-D Conv, MaxPool or AveragePool (the device's window kernels are planar;
/// models/video_cnn), never their 1-D and 2-D forms.
fn documented_host(node: &memplan::ir::Node, facts: &[Option<&Fact>]) -> bool {
    let op = node.op_type.as_str();
    let three_d = matches!(op, "Conv" | "MaxPool" | "AveragePool")
        && facts
            .first()
            .copied()
            .flatten()
            .is_some_and(|f| f.rank() == 5);
    HOST_FLOAT_OPS.contains(&op) || three_d
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
                inputs: facts.iter().copied().collect(),
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
                let documented = documented_host(node, &facts);
                if trains && !documented && backward_path(node, &facts) == Path::Host {
                    bad.push(format!(
                        "{name}: backward of {} '{}'",
                        node.op_type, node.name
                    ));
                }
            }
            let path = forward_path(node, &facts, node.outputs.len(), model.opset(), true).unwrap();
            if path == Path::Host {
                *host.entry(node.op_type.to_string()).or_default() += 1;
                if documented_host(node, &facts) {
                    continue;
                }
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
