//! The training step on the GPU backend (feature `cuda`; docs/CUDA.md), on a GPU
//! and on the host emulation of kernels/ (tests/common/devices.rs).
//!
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

use common::devices::{agree, device, emulated};
use memplan::exec::cuda::Device;
use memplan::exec::Tensor;

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
        params: Default::default(),
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
        params: Default::default(),
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
        .map(|n| (n.name.to_string(), n.inputs[0].unwrap()))
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
