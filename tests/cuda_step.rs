//! The training step on the GPU backend (feature `cuda`; docs/CUDA.md). Each test
//! body is written once and run twice by `device_test!` (tests/common/devices.rs):
//! `name` on a GPU (skipped, with the reason, without one) and `name_emulated` on
//! the host emulation of kernels/.
//!
//! - `train_step_agrees[_emulated]`: the training step on the device
//!   (`exec::cuda::step::DeviceStep`) following a baseline and planned schedules:
//!   counted device peak == replay's, live bytes per instruction == the CPU
//!   allocator's, gradients against the CPU executor, planned runs bitwise equal
//!   to the device baseline; `train_step_agrees_larger_models` (GPU only) adds
//!   the transformer, resnet18 and mobilenet_v2. `train_step_fused`: the
//!   transformer (fused exact GELU and SDPA, the logsumexp through the host), the
//!   same checks. `train_step_half`: amp-fp16, amp-bf16 and bf16 (float16/bfloat16
//!   storages); `train_step_loss_sum`: the sum loss and the model's own;
//!   `half_conversions_bitwise`: kernels/half.cu's rounding is the CPU's bit for
//!   bit. `train_step_resident`: resident gradients (persistent `.grad`) under
//!   fp32 and the half policies. `train_step_refusals`: an invalid plan is refused
//!   in one line. `verify_on_device`: `verify_cuda`.
//! - ignored: `train_step_larger` (mobilenet_v2, resnet18), `resnet18_relu_sign_flips`
//!   (why resnet18's gradients differ from the CPU's: ReLU inputs within rounding
//!   of 0).
#![cfg(feature = "cuda")]

mod common;

use common::devices::{agree, device};
use memplan::exec::cuda::Device;
use memplan::exec::Tensor;

/// A model's training step set up as `exec_train` does it (seeded parameters
/// and inputs), for the device step.
struct StepSetup {
    name: String,
    opt: memplan::train::Optimizer,
    loss: memplan::train::Loss,
    model: memplan::ir::Model,
    step: memplan::step::TrainingStep,
    params: Vec<Option<Tensor>>,
    inputs: Vec<Tensor>,
}

fn step_setup(name: &str, batch: u64, opt: memplan::train::Optimizer) -> StepSetup {
    step_setup_with(
        name,
        batch,
        opt,
        memplan::train::Precision::Fp32,
        memplan::train::Loss::Mean,
        false,
    )
}

fn step_setup_with(
    name: &str,
    batch: u64,
    opt: memplan::train::Optimizer,
    precision: memplan::train::Precision,
    loss: memplan::train::Loss,
    grads_resident: bool,
) -> StepSetup {
    use memplan::exec::{Executor, Options};
    use memplan::infer::{infer, Bindings};
    use memplan::train::{build_schedule, TrainOptions};
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
        loss,
        grads_resident,
        params: Default::default(),
    };
    let schedule = build_schedule(&model, &inf, &topts).unwrap();
    let graph = memplan::remat::from_schedule::from_schedule(&schedule, name);
    let params = Executor::new(&model, &inf, Options::default())
        .unwrap()
        .params()
        .to_vec();
    let inputs = memplan::exec::verify::seeded_inputs(&model, &inf).unwrap();
    StepSetup {
        name: name.into(),
        opt,
        loss,
        model,
        step: memplan::step::TrainingStep {
            inferred: inf,
            schedule,
            graph,
        },
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
        &su.step,
        plan,
        &su.params,
        &su.inputs,
        &StepOptions {
            optimizer: su.opt,
            loss: su.loss,
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
    let predicted = memplan::remat::graph::replay(&su.step.graph, plan)
        .unwrap()
        .peak_bytes;
    if let Some(k) = (0..plan.len()).find(|&k| dev.live_after[k] != cpu.live_after[k]) {
        let name = match plan[k] {
            memplan::remat::graph::Instr::Compute(i) => su.step.graph.nodes[i].name.clone(),
            memplan::remat::graph::Instr::Free(v) => {
                format!("free {}", su.step.graph.values[v].name)
            }
            memplan::remat::graph::Instr::Load(v) => {
                format!("load {}", su.step.graph.values[v].name)
            }
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

/// `max|got − want| / max|want|` (0 when equal).
fn rel_diff(got: &Tensor, want: &Tensor) -> f32 {
    let (g, w) = (got.to_f32().unwrap(), want.to_f32().unwrap());
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    g.iter()
        .zip(w.iter())
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// Each gradient (or updated parameter: `noun`) agrees with the CPU's at rel
/// `tol` (max-norm, as [`agree`] at 1e-4); one that is zero up to rounding (e.g.
/// a convolution bias before a BatchNorm: max|cpu| below 1e-4 of the model's
/// largest gradient) is held to `tol / 100` of that largest one (at 1e-4: a few
/// f32 roundings of it) instead of to its own noise.
fn grads_agree(name: &str, noun: &str, got: &[Tensor], want: &[Tensor], tol: f32) {
    assert_eq!(got.len(), want.len());
    let maxabs = |t: &Tensor| t.to_f32().unwrap().iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = want.iter().map(maxabs).fold(0f32, f32::max);
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            (g.dtype(), &g.shape),
            (w.dtype(), &w.shape),
            "{name} {noun} {k}"
        );
        if maxabs(w) >= 1e-4 * global {
            let d = rel_diff(g, w);
            assert!(
                d <= tol,
                "{name} {noun} {k}: relative difference {d} > {tol}"
            );
            continue;
        }
        let d = g
            .to_f32()
            .unwrap()
            .iter()
            .zip(w.to_f32().unwrap().iter())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            d <= tol / 100.0 * global,
            "{name} {noun} {k} (zero up to rounding): |gpu - cpu| {d}, largest {noun} {global}"
        );
    }
}

/// How a device step is set up and held against the CPU executor.
#[derive(Debug, Clone, Copy)]
struct Run {
    precision: memplan::train::Precision,
    loss: memplan::train::Loss,
    /// Relative tolerance of the gradients, updated parameters and loss against
    /// the CPU executor's; `None`: printed, not asserted.
    cpu_tol: Option<f32>,
    /// Resident gradients (`grads_resident`: persistent `.grad`, zeroed before
    /// the step).
    resident: bool,
}

impl Run {
    fn fp32(cpu_strict: bool) -> Run {
        Run {
            precision: memplan::train::Precision::Fp32,
            loss: memplan::train::Loss::Mean,
            cpu_tol: cpu_strict.then_some(1e-4),
            resident: false,
        }
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
    device_run(dev, name, batch, opt, Run::fp32(cpu_strict));
}

/// [`device_step`] under `run`'s precision policy and loss, the CPU agreement
/// at `run.cpu_tol`. Returns the largest per-tensor relative gradient
/// difference against the CPU and how many gradients are bitwise the CPU's.
fn device_run(
    dev: &Device,
    name: &str,
    batch: u64,
    opt: memplan::train::Optimizer,
    run: Run,
) -> (f32, usize) {
    use memplan::exec::cuda::step::DeviceStep;
    use memplan::exec::train::Cpu;
    use memplan::remat::heuristics::{candidates, greedy, plan_with_drops};
    let t0 = std::time::Instant::now();
    let su = step_setup_with(name, batch, opt, run.precision, run.loss, run.resident);
    let what_run = format!(
        "{name} ({opt}, {}, loss {}{})",
        run.precision,
        run.loss,
        if run.resident { ", resident" } else { "" }
    );
    let b = DeviceStep::new(dev);
    let base_plan = su.step.graph.no_recompute_plan();
    let cpu = step_on(&Cpu, &su, &base_plan);
    let base = step_on(&b, &su, &base_plan);
    same_counts(&su, "baseline", &base_plan, &base, &cpu);
    assert_eq!(dev.memory().live_bytes, 0, "{name}: every tensor freed");
    let worst = base
        .grads
        .iter()
        .zip(&cpu.grads)
        .map(|(g, c)| rel_diff(g, c))
        .fold(0f32, f32::max);
    let same = base
        .grads
        .iter()
        .zip(&cpu.grads)
        .filter(|(g, c)| bitwise(std::slice::from_ref(*g), std::slice::from_ref(*c)))
        .count();
    eprintln!(
        "{what_run}: gradients vs CPU, largest per-tensor relative difference {worst:e}, {same} of {} bitwise equal",
        cpu.grads.len()
    );
    if let Some(tol) = run.cpu_tol {
        grads_agree(&what_run, "gradient", &base.grads, &cpu.grads, tol);
        // The same rule for the updated parameters: one initialised at zero whose
        // gradient is zero up to rounding (roberta_mlm's attention key biases:
        // softmax does not see a bias added to every key) is that rounding noise
        // times the learning rate.
        let (bp, cp): (Vec<Tensor>, Vec<Tensor>) = base
            .params
            .iter()
            .zip(&cpu.params)
            .filter_map(|(x, y)| Some((x.clone()?, y.clone()?)))
            .unzip();
        grads_agree(&what_run, "updated parameter", &bp, &cp, tol);
        assert!(
            (base.loss - cpu.loss).abs() <= tol as f64 * cpu.loss.abs().max(1e-6),
            "{what_run}: loss {} vs CPU {}",
            base.loss,
            cpu.loss
        );
    }
    let mut drop_all = vec![false; su.step.graph.values.len()];
    for v in candidates(&su.step.graph) {
        drop_all[v] = true;
    }
    let lo = su.step.graph.op_local_bound();
    let budget = lo + base.peak_bytes.saturating_sub(lo) / 2;
    for (what, plan) in [
        ("drop-all", plan_with_drops(&su.step.graph, &drop_all)),
        ("greedy", greedy(&su.step.graph, budget).0),
    ] {
        let cpu_p = step_on(&Cpu, &su, &plan);
        let p = step_on(&b, &su, &plan);
        same_counts(&su, what, &plan, &p, &cpu_p);
        let recomputed = p.executions.iter().filter(|&&e| e > 1).count();
        assert!(
            recomputed > 0,
            "{what_run} {what}: the plan recomputes something"
        );
        assert!(
            bitwise(&p.grads, &base.grads),
            "{what_run} {what}: gradients bitwise equal to the device baseline"
        );
        assert_eq!(
            p.loss.to_bits(),
            base.loss.to_bits(),
            "{what_run} {what}: loss"
        );
        let (pp, bp): (Vec<Tensor>, Vec<Tensor>) = p
            .params
            .iter()
            .zip(&base.params)
            .filter_map(|(x, y)| Some((x.clone()?, y.clone()?)))
            .unzip();
        assert!(bitwise(&pp, &bp), "{what_run} {what}: updated parameters");
        eprintln!(
            "{what_run} {what}: device peak {} B == predicted (baseline {} B), {recomputed} steps recomputed, bitwise equal",
            p.peak_bytes, base.peak_bytes
        );
    }
    let m = dev.memory();
    eprintln!(
        "{what_run}, batch {batch} on {}: baseline peak {} B == predicted, {}; workspace peak {} B, launch bucket peak (temporaries, outputs in flight) {} B; {:.1} s",
        dev.name().unwrap(),
        base.peak_bytes,
        match run.cpu_tol {
            Some(t) => format!("gradients agree with the CPU (rel {t:e})"),
            None => "CPU agreement printed above".into(),
        },
        m.workspace_peak_bytes,
        m.launch_peak_bytes,
        t0.elapsed().as_secs_f64()
    );
    (worst, same)
}

/// The training step on the host emulation: mlp and cnn with SGD (on the device),
/// mlp with Adam (the update through the host).
fn train_step_agrees_on(dev: &Device) {
    use memplan::train::Optimizer;
    device_step(dev, "mlp", 4, Optimizer::Sgd, true);
    device_step(dev, "mlp", 4, Optimizer::Adam, true);
    device_step(dev, "mlp", 4, Optimizer::Momentum, true);
    device_step(dev, "cnn", 2, Optimizer::Sgd, true);
}

device_test!(train_step_agrees_on: train_step_agrees, train_step_agrees_emulated);

/// The transformer on the host emulation: its fused patterns (exact GELU, SDPA)
/// run op by op on the device kernels, the attention's logsumexp through the host
/// (uploaded into its Extra storage), so the counted peak is still replay's.
fn train_step_fused_on(dev: &Device) {
    use memplan::train::Optimizer;
    let su = step_setup("transformer", 2, Optimizer::Sgd);
    assert!(
        !su.step.schedule.fused.is_empty(),
        "the transformer has fused patterns"
    );
    device_step(dev, "transformer", 2, Optimizer::Sgd, true);
}

device_test!(train_step_fused_on: train_step_fused, train_step_fused_emulated);

/// Half-precision policies on the host emulation: every float value in its
/// storage's type (2 bytes an element under amp-fp16/amp-bf16 autocast copies,
/// pure bf16 everywhere), computed in f32 from widened inputs, outputs rounded as
/// the CPU rounds them. Device peak == replay, live bytes after every
/// instruction == the CPU allocator's, planned runs bitwise the device baseline.
///
/// Against the CPU executor, gradients, updated parameters and the loss are held
/// to rel 2e-3 (amp-fp16) and 2e-2 (amp-bf16, bf16), about four ulps of the half
/// type (2^-11 relative for float16, 2^-8 for bfloat16), not bitwise: the
/// device's f32 arithmetic is the CPU's only to rounding (block reductions,
/// summation order), and a value within an f32 rounding of a half-precision
/// rounding boundary then rounds to the neighbouring half value, which later
/// layers carry. Measured here (printed): mlp bitwise under all three policies;
/// cnn ≤ 8.5e-7 under AMP, bitwise under bf16; the transformer bitwise under AMP
/// and 9.9e-3 (2.5 bf16 ulps) under bf16.
fn train_step_half_on(dev: &Device) {
    use memplan::train::{Loss, Optimizer, Precision};
    let half = |precision, tol| Run {
        precision,
        loss: Loss::Mean,
        cpu_tol: Some(tol),
        resident: false,
    };
    for (precision, tol) in [
        (Precision::AmpFp16, 2e-3),
        (Precision::AmpBf16, 2e-2),
        (Precision::Bf16, 2e-2),
    ] {
        let su = step_setup_with("mlp", 4, Optimizer::Sgd, precision, Loss::Mean, false);
        assert!(
            su.step
                .schedule
                .storages
                .iter()
                .any(|st| matches!(st.dtype, memplan::ir::DType::F16 | memplan::ir::DType::BF16)),
            "{precision}: half-precision storages"
        );
        device_run(dev, "mlp", 4, Optimizer::Sgd, half(precision, tol));
        device_run(dev, "cnn", 2, Optimizer::Sgd, half(precision, tol));
        device_run(dev, "transformer", 2, Optimizer::Sgd, half(precision, tol));
    }
    // Pure bf16 with Adam: the update through the host, its bf16 state and
    // foreach temporary written back into their device storages.
    device_run(dev, "mlp", 4, Optimizer::Adam, half(Precision::Bf16, 2e-2));
}

device_test!(train_step_half_on: train_step_half, train_step_half_emulated);

/// The sum loss (and the model's own loss) on the host emulation: the gradient,
/// a scalar broadcast to the output's shape, is materialised on the device and
/// counted as the schedule's scalar storage, the rest apart as workspace; the
/// same checks as `train_step_agrees_emulated` (CPU agreement at rel 1e-4).
fn train_step_loss_sum_on(dev: &Device) {
    use memplan::train::{Loss, Optimizer, Precision};
    let sum = Run {
        precision: Precision::Fp32,
        loss: Loss::Sum,
        cpu_tol: Some(1e-4),
        resident: false,
    };
    device_run(dev, "mlp", 4, Optimizer::Sgd, sum);
    device_run(dev, "cnn", 2, Optimizer::Momentum, sum);
    device_run(dev, "transformer", 2, Optimizer::Sgd, sum);
    device_run(
        dev,
        "mlp",
        4,
        Optimizer::Sgd,
        Run {
            precision: Precision::AmpBf16,
            cpu_tol: Some(2e-2),
            ..sum
        },
    );
    device_run(
        dev,
        "mlp_loss",
        4,
        Optimizer::Sgd,
        Run {
            loss: Loss::Graph,
            ..sum
        },
    );
}

device_test!(train_step_loss_sum_on: train_step_loss_sum, train_step_loss_sum_emulated);

/// kernels/half.cu's conversions are the CPU's (`half` 2.x) bit for bit: every
/// float16 and bfloat16 value widened; float32 values rounded (every half
/// value's neighbourhood: itself, the midpoints to its neighbours and one f32
/// ulp either side, infinities, NaNs with payloads, subnormals, and random bit
/// patterns); half gradients accumulated and a bf16 SGD step as the CPU does.
fn half_conversions_bitwise_on(dev: &Device) {
    use memplan::exec::train::{Cpu, StepBackend};
    use memplan::ir::DType;
    let bits =
        |t: &Tensor| -> Vec<u32> { t.to_f32().unwrap().iter().map(|x| x.to_bits()).collect() };
    for dt in [DType::F16, DType::BF16] {
        // Every half value, widened.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let h = match dt {
            DType::F16 => Tensor::new(
                vec![all.len()],
                memplan::exec::Elems::F16(all.iter().map(|&b| half::f16::from_bits(b)).collect()),
            ),
            _ => Tensor::new(
                vec![all.len()],
                memplan::exec::Elems::BF16(all.iter().map(|&b| half::bf16::from_bits(b)).collect()),
            ),
        };
        let d = dev.upload(&h).unwrap();
        assert_eq!(d.bytes(), 2 * all.len() as u64, "{dt}: 2 bytes an element");
        let w = dev.download(&dev.convert(&d, DType::F32).unwrap()).unwrap();
        assert_eq!(w.dtype(), DType::F32);
        let cpu = h.cast(DType::F32).unwrap();
        let (got, want) = (bits(&w), bits(&cpu));
        if let Some(k) = (0..got.len()).find(|&k| got[k] != want[k]) {
            panic!(
                "{dt} {:#06x} widened: device {:#010x}, CPU {:#010x}",
                all[k], got[k], want[k]
            );
        }
        // f32 values around every half value, specials and random patterns.
        let wide = cpu.to_f32().unwrap().into_owned();
        let mut xs: Vec<f32> = Vec::new();
        for k in 0..wide.len() {
            let (a, b) = (wide[k], wide[(k + 1) % wide.len()]);
            xs.push(a);
            if a.is_finite() {
                xs.push(f32::from_bits(a.to_bits().wrapping_add(1)));
                xs.push(f32::from_bits(a.to_bits().wrapping_sub(1)));
            }
            if a.is_finite() && b.is_finite() && a.signum() == b.signum() {
                let mid = ((a as f64 + b as f64) / 2.0) as f32;
                xs.extend([
                    mid,
                    f32::from_bits(mid.to_bits() + 1),
                    f32::from_bits(mid.to_bits() - 1),
                ]);
            }
        }
        xs.extend([
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            65504.0,
            65520.0,
            65519.99,
        ]);
        xs.extend([
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc0_1234),
            f32::from_bits(0x7fbf_ffff),
        ]);
        let mut z: u64 = 0x1234_5678;
        for _ in 0..200_000 {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut v = z;
            v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            xs.push(f32::from_bits((v ^ (v >> 31)) as u32));
        }
        let x = Tensor::f32(vec![xs.len()], xs.clone());
        let r = dev
            .download(&dev.convert(&dev.upload(&x).unwrap(), dt).unwrap())
            .unwrap();
        let cpu = x.cast(dt).unwrap();
        assert_eq!(r.dtype(), dt);
        let half_bits = |t: &Tensor| -> Vec<u16> {
            match &t.elems {
                memplan::exec::Elems::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
                memplan::exec::Elems::BF16(v) => v.iter().map(|x| x.to_bits()).collect(),
                _ => unreachable!(),
            }
        };
        let (got, want) = (half_bits(&r), half_bits(&cpu));
        if let Some(k) = (0..got.len()).find(|&k| got[k] != want[k]) {
            panic!(
                "{dt}: {:#010x} rounded: device {:#06x}, CPU {:#06x}",
                xs[k].to_bits(),
                got[k],
                want[k]
            );
        }
        eprintln!(
            "{dt}: 65536 values widened, {} rounded, bitwise the CPU's",
            xs.len()
        );
        // Accumulation in f32, rounded back, and the bf16 SGD step.
        let n = 4096;
        let a: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173)
            .collect();
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.0917)
            .collect();
        let (a, g) = (
            Tensor::from_f32(dt, vec![n], a).unwrap(),
            Tensor::from_f32(dt, vec![n], g).unwrap(),
        );
        let acc = dev.upload(&a).unwrap();
        dev.accumulate_half(&acc, &dev.upload(&g).unwrap()).unwrap();
        let mut want = a.clone();
        Cpu.accumulate(&mut want, &g).unwrap();
        assert_eq!(
            bits(&dev.download(&acc).unwrap()),
            bits(&want),
            "{dt} accumulate"
        );
        let p = dev.upload(&a).unwrap();
        dev.sgd_half(&p, &dev.upload(&g).unwrap(), 0.01).unwrap();
        let ps: Vec<f32> = a
            .to_f32()
            .unwrap()
            .iter()
            .zip(g.to_f32().unwrap().iter())
            .map(|(p, g)| p - 0.01 * g)
            .collect();
        let want = Tensor::from_f32(dt, vec![n], ps).unwrap();
        assert_eq!(bits(&dev.download(&p).unwrap()), bits(&want), "{dt} sgd");
    }
}

device_test!(half_conversions_bitwise_on: half_conversions_bitwise, half_conversions_bitwise_emulated);

/// Resident gradients (`grads_resident`, gradient accumulation) on the host
/// emulation: each parameter's persistent `.grad` is a zeroed device tensor from
/// before the first instruction (counted from the start, as the schedule counts
/// it), its first gradient written into it on the device (as the CPU writes it),
/// later contributions added in place. The same checks as
/// `train_step_agrees_emulated` and `train_step_half_emulated` (device peak ==
/// replay, live bytes after every instruction == the CPU allocator's, CPU
/// agreement at the same tolerances, planned runs bitwise the device baseline),
/// and the gradients and updated parameters bitwise the device's without
/// residency (the CPU executor's gradients do not depend on it either:
/// tests/exec_train.rs `optimizers_peak_and_plans`).
fn train_step_resident_on(dev: &Device) {
    use memplan::exec::cuda::step::DeviceStep;
    use memplan::train::{Loss, Optimizer, Precision, StorageKind};
    use Optimizer::{Adam, Adamw, Momentum, Sgd};
    use Precision::{AmpBf16, AmpFp16, Bf16, Fp32};
    let mut accumulated = 0;
    for (name, batch, opt, precision, tol) in [
        ("mlp", 4, Sgd, Fp32, 1e-4),
        ("mlp", 4, Adam, Fp32, 1e-4),
        ("mlp", 4, Momentum, Fp32, 1e-4),
        ("cnn", 2, Sgd, Fp32, 1e-4),
        ("cnn", 2, Adamw, Fp32, 1e-4),
        ("transformer", 2, Sgd, Fp32, 1e-4),
        ("mlp", 4, Sgd, AmpFp16, 2e-3),
        ("cnn", 2, Sgd, AmpFp16, 2e-3),
        ("transformer", 2, Sgd, AmpFp16, 2e-3),
        ("mlp", 4, Sgd, AmpBf16, 2e-2),
        ("cnn", 2, Sgd, AmpBf16, 2e-2),
        ("transformer", 2, Sgd, AmpBf16, 2e-2),
        ("mlp", 4, Sgd, Bf16, 2e-2),
        ("cnn", 2, Sgd, Bf16, 2e-2),
        ("transformer", 2, Sgd, Bf16, 2e-2),
        ("mlp", 4, Adam, Bf16, 2e-2),
        // Tied input/output embeddings: the second contribution added in place
        // (in bf16 by `accumulate_half` under pure bf16). Pure bf16 through two
        // attention layers differs from the CPU by up to 2.5e-2 (the tied
        // embedding's gradient, about six bf16 ulps, bitwise the same without
        // residency): half rounding carried further than in the smaller models.
        ("roberta_mlm", 2, Sgd, Fp32, 1e-4),
        ("roberta_mlm", 2, Sgd, AmpFp16, 2e-3),
        ("roberta_mlm", 2, Momentum, Bf16, 5e-2),
    ] {
        let what = format!("{name} ({opt}, {precision}, resident)");
        let su = step_setup_with(name, batch, opt, precision, Loss::Mean, true);
        let resident: Vec<usize> = (0..su.step.schedule.storages.len())
            .filter(|&v| {
                let st = &su.step.schedule.storages[v];
                st.kind == StorageKind::ParamGrad && st.persistent
            })
            .collect();
        assert_eq!(
            resident.len(),
            su.step.schedule.with_grad.len(),
            "{what}: one resident .grad per trained parameter"
        );
        assert!(
            su.step
                .schedule
                .steps
                .iter()
                .all(|st| st.writes.iter().all(|w| !resident.contains(w))),
            "{what}: no step allocates a resident .grad"
        );
        let adds = su
            .step
            .schedule
            .steps
            .iter()
            .filter(|st| st.updates.iter().any(|u| resident.contains(u)))
            .count();
        accumulated += adds;
        let resident_bytes: u64 = resident
            .iter()
            .map(|&v| su.step.schedule.storages[v].bytes)
            .sum();
        device_run(
            dev,
            name,
            batch,
            opt,
            Run {
                precision,
                loss: Loss::Mean,
                cpu_tol: Some(tol),
                resident: true,
            },
        );
        let plain = step_setup_with(name, batch, opt, precision, Loss::Mean, false);
        let b = DeviceStep::new(dev);
        let r = step_on(&b, &su, &su.step.graph.no_recompute_plan());
        let p = step_on(&b, &plain, &plain.step.graph.no_recompute_plan());
        assert!(
            bitwise(&r.grads, &p.grads),
            "{what}: gradients bitwise the device's without residency"
        );
        let (rp, pp): (Vec<Tensor>, Vec<Tensor>) = r
            .params
            .iter()
            .zip(&p.params)
            .filter_map(|(x, y)| Some((x.clone()?, y.clone()?)))
            .unzip();
        assert!(
            bitwise(&rp, &pp),
            "{what}: updated parameters bitwise the device's without residency"
        );
        eprintln!(
            "{what}: {} resident .grad storages ({resident_bytes} B, live from the start), \
             {adds} backward steps add into one; baseline peak {} B (not resident: {} B); \
             gradients and parameters bitwise the non-resident device step's",
            resident.len(),
            r.peak_bytes,
            p.peak_bytes
        );
    }
    assert!(
        accumulated > 0,
        "some parameter's later gradients are added into its resident .grad"
    );
}

device_test!(train_step_resident_on: train_step_resident, train_step_resident_emulated);

/// The device step refuses nothing of its own any more (resident gradients,
/// half-precision policies and the sum loss, refused before, run:
/// `train_step_resident_emulated`, `train_step_half_emulated`,
/// `train_step_loss_sum_emulated`). A refusal that remains, an invalid plan
/// (here one that never computes the first step), is still one line, before
/// anything is allocated on the device.
fn train_step_refusals_on(dev: &Device) {
    use memplan::exec::cuda::step::DeviceStep;
    use memplan::exec::train::{train_step_on, StepOptions};
    let su = step_setup_with(
        "mlp",
        4,
        memplan::train::Optimizer::Sgd,
        memplan::train::Precision::AmpFp16,
        memplan::train::Loss::Mean,
        true,
    );
    let plan = su.step.graph.no_recompute_plan();
    let first = plan
        .iter()
        .position(|op| matches!(op, memplan::remat::graph::Instr::Compute(_)))
        .unwrap();
    let mut bad = plan.clone();
    bad.remove(first);
    let err = train_step_on(
        &DeviceStep::new(dev),
        &su.model,
        &su.step,
        &bad,
        &su.params,
        &su.inputs,
        &StepOptions::default(),
    )
    .expect_err("refused")
    .to_string();
    eprintln!("{err}");
    assert!(
        err.contains("the plan is invalid") && !err.contains('\n'),
        "{err}"
    );
    let m = dev.memory();
    assert_eq!(
        (m.live_bytes, m.peak_bytes),
        (0, 0),
        "nothing was allocated"
    );
}

device_test!(train_step_refusals_on: train_step_refusals, train_step_refusals_emulated);

/// On a GPU, larger models too (`train_step_agrees` runs the small ones).
#[test]
fn train_step_agrees_larger_models() {
    use memplan::train::Optimizer;
    let Some(dev) = device("train_step_agrees_larger_models") else {
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
fn train_step_larger_on(dev: &Device) {
    use memplan::train::Optimizer;
    let list = std::env::var("MEMPLAN_EMU_MODELS").unwrap_or_else(|_| "mobilenet_v2".into());
    for name in list.split(',').filter(|n| !n.is_empty()) {
        // mobilenet_v2 agrees with the CPU at batch 1 (checked); others printed.
        device_step(dev, name, 1, Optimizer::Sgd, name == "mobilenet_v2");
    }
}

device_test!(#[ignore]
    train_step_larger_on: train_step_larger, train_step_larger_emulated);

/// `verify` on the device (here the host emulation): both runs' counted
/// device peaks equal the predicted ones, planned gradients bitwise equal to the
/// device baseline, gradients against the CPU executor within 1e-4.
fn verify_on_device_on(dev: &Device) {
    verify_on(dev);
}

device_test!(verify_on_device_on: verify_on_device, verify_on_device_emulated);

fn verify_on(dev: &Device) {
    use memplan::train::{Loss, Precision};
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/cnn.onnx");
    let r = verify_report(dev, &path, 1_100_000, Precision::Fp32, Loss::Mean, 1e-4);
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
fn strided_matmul_copies_on_device_on(dev: &Device) {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/ops/strided_matmul.onnx");
    verify_report(
        dev,
        &path,
        u64::MAX,
        memplan::train::Precision::Fp32,
        memplan::train::Loss::Mean,
        1e-4,
    );
}

device_test!(strided_matmul_copies_on_device_on: strided_matmul_copies_on_device, strided_matmul_copies_on_device_emulated);

/// `verify` on the device under half-precision policies and the sum loss (the
/// library call `verify --device cuda` makes; no refusal left for them): measured
/// == predicted, planned runs bitwise the device baseline, gradients as the CPU's
/// (rel 1e-4 in f32; 2e-2 under a half policy, see `train_step_half_emulated`).
fn verify_half_and_sum_on_device_on(dev: &Device) {
    use memplan::train::{Loss, Precision};
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/cnn.onnx");
    for (precision, loss, tol) in [
        (Precision::AmpFp16, Loss::Mean, 2e-3),
        (Precision::AmpBf16, Loss::Sum, 2e-2),
        (Precision::Bf16, Loss::Mean, 2e-2),
        (Precision::Fp32, Loss::Sum, 1e-4),
    ] {
        let base = {
            let su = step_setup_with(
                "cnn",
                2,
                memplan::train::Optimizer::Sgd,
                precision,
                loss,
                false,
            );
            memplan::remat::graph::replay(&su.step.graph, &su.step.graph.no_recompute_plan())
                .unwrap()
                .peak_bytes
        };
        let r = verify_report(dev, &path, base * 85 / 100, precision, loss, tol);
        assert!(r.recomputations > 0, "{precision} {loss}: recomputes");
    }
}

device_test!(verify_half_and_sum_on_device_on: verify_half_and_sum_on_device, verify_half_and_sum_on_device_emulated);

/// `verify_cuda` with resident gradients (the library call; the CLI's `verify`
/// builds schedules without them): cnn under fp32 and amp-bf16 with a greedy
/// plan at 85 % of the baseline, measured == predicted, gradients bitwise.
fn verify_resident_on_device_on(dev: &Device) {
    use memplan::train::{Loss, Precision};
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/cnn.onnx");
    for (precision, tol) in [(Precision::Fp32, 1e-4), (Precision::AmpBf16, 2e-2)] {
        let su = step_setup_with(
            "cnn",
            2,
            memplan::train::Optimizer::Sgd,
            precision,
            Loss::Mean,
            true,
        );
        let base =
            memplan::remat::graph::replay(&su.step.graph, &su.step.graph.no_recompute_plan())
                .unwrap()
                .peak_bytes;
        let r = verify_report_with(
            dev,
            &path,
            base * 85 / 100,
            precision,
            Loss::Mean,
            true,
            tol,
        );
        assert_eq!(
            r.baseline_predicted_peak_bytes, base,
            "{precision}: resident schedule"
        );
        assert!(r.recomputations > 0, "{precision}: recomputes");
    }
}

device_test!(verify_resident_on_device_on: verify_resident_on_device, verify_resident_on_device_emulated);

/// `verify` on the device at batch 2 under `budget` bytes (greedy): measured ==
/// predicted with and without the plan, gradients as on the CPU.
fn verify_report(
    dev: &Device,
    path: &std::path::Path,
    budget: u64,
    precision: memplan::train::Precision,
    loss: memplan::train::Loss,
    cpu_tol: f64,
) -> memplan::exec::verify::VerifyReport {
    verify_report_with(dev, path, budget, precision, loss, false, cpu_tol)
}

/// [`verify_report`], gradients resident or not.
fn verify_report_with(
    dev: &Device,
    path: &std::path::Path,
    budget: u64,
    precision: memplan::train::Precision,
    loss: memplan::train::Loss,
    grads_resident: bool,
    cpu_tol: f64,
) -> memplan::exec::verify::VerifyReport {
    use memplan::exec::train::StepOptions;
    use memplan::exec::verify::{verify_cuda, PlanSource, VerifyOptions};
    use memplan::infer::{infer, Bindings};
    use memplan::remat::plan::Solver;
    use memplan::remat::planfile::StepSource;
    use memplan::train::{Optimizer, TrainOptions};
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
        precision,
        loss,
        grads_resident,
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
    assert!(r.cpu_max_rel_grad_diff.unwrap() <= cpu_tol, "{r:?}");
    assert!(r.workspace_peak_bytes.is_some());
    v.report
}

/// Why resnet18's gradients can differ from the CPU's beyond 1e-4 below some
/// layer (docs/CUDA.md): the forward pre-activations of every ReLU agree except
/// a few within rounding of 0 that take the other side (a discrete difference of
/// f32 rounding, not a kernel error). Slow: `--ignored`; `MEMPLAN_EMU_BATCH`.
fn resnet18_relu_sign_flips_on(dev: &Device) {
    use memplan::exec::{Executor, Options};
    use memplan::infer::{infer, Bindings};
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
    let d = memplan::exec::cuda::run::forward(dev, &model, &inf, opts, &inputs).unwrap();
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

device_test!(#[ignore]
    resnet18_relu_sign_flips_on: resnet18_relu_sign_flips, resnet18_relu_sign_flips_emulated);
