//! The CPU training step (`memplan::exec::train`) against the memory model and
//! against finite differences.
//!
//! - Baseline (no recomputation): the allocator's measured peak equals the peak of
//!   `replay` of the same plan and of `simulate` of the schedule, exactly, and the
//!   live bytes after every instruction equal replay's bookkeeping.
//! - Gradients: central finite differences of the loss (summed in f64 from the f32
//!   forward of the same executor) along sparse seeded random directions (3 elements)
//!   in each parameter, plus one single element of the first and last parameter.
//!   ε = 1e-3: dense directions or ε = 1e-2 cross ReLU / max-pool kinks and meet the
//!   curvature of batch-2 BatchNorm (an ε sweep on cnn's conv1 converges on the
//!   kernel's gradient down to ε ≈ 5e-4, below which f32 noise takes over).
//!   Tolerance `1e-2·Σ|g·v| + 1e-4·(1 + mean|y|)`. `EXEC_TRAIN_VERBOSE=1` prints
//!   every check.
//! - Planned (every droppable value dropped; the greedy planner at a budget halfway
//!   between the op-local bound and the baseline peak), recomputing forward steps:
//!   loss, gradients and updated parameters bitwise identical to the baseline's;
//!   measured peak equal to replay's peak of that plan, live bytes equal after every
//!   instruction.
//! - Fused patterns (transformer: exact GELU; bert_base, vit_b_16 ignored: GELU and
//!   SDPA; decomposed LayerNorm and RMSNorm's rsqrt, tests/data/fusion): as above.
//! - Optimizers (momentum, Adam, AdamW; gradients resident or not): peaks as above;
//!   one update checked element-wise against PyTorch's formulas computed in f64.
//! - Precision policies (amp-fp16, amp-bf16, bf16) on mlp and cnn, SGD and Adam:
//!   half-precision storages (autocast copies, cached weight copies, bf16
//!   parameters and states), f32 compute; peaks as above, planned runs bitwise
//!   identical, gradients close to fp32's (cosine).
//!   Fused patterns under each policy (transformer, the SDPA model): peaks and
//!   planned runs as above.
//! - Bad plans (a read of a freed storage) and a schedule of another optimizer are
//!   rejected with the reason.

mod common;

use memplan::exec::train::{train_step, StepOptions, StepResult};
use memplan::exec::{Executor, Options, Tensor};
use memplan::infer::{infer, Bindings, Inferred};
use memplan::ir::Model;
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::graph::{replay, Instr, RematGraph};
use memplan::remat::heuristics::{candidates, greedy, plan_with_drops};
use memplan::step::TrainingStep;
use memplan::train::{build_schedule, Loss, Optimizer, Precision, TrainOptions};

struct Setup {
    opt: Optimizer,
    model: Model,
    step: TrainingStep,
    params: Vec<Option<Tensor>>,
    inputs: Vec<Tensor>,
}

fn sgd_fp32() -> TrainOptions {
    TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    }
}

fn setup(name: &str, batch: u64) -> Setup {
    setup_with(name, batch, sgd_fp32())
}

fn setup_with(name: &str, batch: u64, opts: TrainOptions) -> Setup {
    let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
    setup_from(model, name, batch, opts)
}

fn setup_from(model: Model, name: &str, batch: u64, opts: TrainOptions) -> Setup {
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(batch),
            ..Default::default()
        },
    )
    .unwrap();
    let step = training_step(&model, &inf, &opts, name);
    let params = Executor::new(&model, &inf, Options::default())
        .unwrap()
        .params()
        .to_vec();
    let inputs = memplan::exec::verify::seeded_inputs(&model, &inf).unwrap();
    Setup {
        opt: opts.optimizer,
        model,
        step,
        params,
        inputs,
    }
}

/// The training step of `model` (inferred as `inf`) under `opts`, its graph named
/// `name`.
fn training_step(model: &Model, inf: &Inferred, opts: &TrainOptions, name: &str) -> TrainingStep {
    let schedule = build_schedule(model, inf, opts).unwrap();
    let graph = from_schedule(&schedule, name);
    TrainingStep {
        inferred: inf.clone(),
        schedule,
        graph,
    }
}

fn run(su: &Setup, plan: &[Instr], params: &[Option<Tensor>], lr: f32) -> StepResult {
    train_step(
        &su.model,
        &su.step,
        plan,
        params,
        &su.inputs,
        &StepOptions {
            lr,
            optimizer: su.opt,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Live bytes after each instruction of `plan`, as replay counts them.
fn replay_live(g: &RematGraph, plan: &[Instr]) -> Vec<u64> {
    let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    let mut cur: u64 = g.fixed_bytes();
    let mut out = Vec::new();
    for op in plan {
        match *op {
            Instr::Compute(i) => {
                for &v in &g.nodes[i].outputs {
                    if !live[v] {
                        live[v] = true;
                        cur += g.values[v].bytes;
                    }
                }
            }
            Instr::Free(v) => {
                if live[v] {
                    live[v] = false;
                    cur -= g.values[v].bytes;
                }
            }
            Instr::Load(v) => {
                if !live[v] {
                    live[v] = true;
                    cur += g.values[v].bytes;
                }
            }
        }
        out.push(cur);
    }
    out
}

fn baseline_peak_matches(name: &str, batch: u64) -> (Setup, StepResult) {
    baseline_of(setup(name, batch), batch)
}

fn baseline_of(su: Setup, batch: u64) -> (Setup, StepResult) {
    let name = su.step.graph.name.clone();
    let name = name.as_str();
    let plan = su.step.graph.no_recompute_plan();
    let predicted = replay(&su.step.graph, &plan).unwrap().peak_bytes;
    let simulated = simulate(&su.step.schedule).peak().total();
    assert_eq!(predicted, simulated, "{name}: replay and simulate agree");
    let r = run(&su, &plan, &su.params, 0.01);
    eprintln!(
        "{name} batch {batch}: measured peak {} B, predicted {} B (simulate {} B), {} steps",
        r.peak_bytes,
        predicted,
        simulated,
        su.step.schedule.steps.len()
    );
    assert_eq!(r.peak_bytes, predicted, "{name}: measured = predicted peak");
    assert_eq!(
        r.live_after,
        replay_live(&su.step.graph, &plan),
        "{name}: live bytes after every instruction"
    );
    assert!(r.executions.iter().all(|&e| e == 1));
    (su, r)
}

/// Loss with parameter `t` moved by `eps · dir`.
fn loss_moved(su: &Setup, t: usize, dir: &[f32], eps: f32) -> f64 {
    let mut p = su.params.clone();
    let x = p[t].as_ref().unwrap();
    let v: Vec<f32> = x
        .to_f32()
        .unwrap()
        .iter()
        .zip(dir)
        .map(|(&a, &d)| a + eps * d)
        .collect();
    p[t] = Some(Tensor::from_f32(x.dtype(), x.shape.clone(), v).unwrap());
    run(su, &su.step.graph.no_recompute_plan(), &p, 0.0).loss
}

fn check_gradients(su: &Setup, r: &StepResult) {
    let name = &su.step.graph.name;
    let mut rng = 0x1234_5678u64;
    let mut next = || {
        rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    assert!(!su.step.schedule.with_grad.is_empty());
    let mean_abs: f64 =
        r.output.to_f64s().iter().map(|v| v.abs()).sum::<f64>() / r.output.numel().max(1) as f64;
    let mut worst: f64 = 0.0;
    for (k, &t) in su.step.schedule.with_grad.iter().enumerate() {
        let gt = r.grads[k].to_f32().unwrap();
        let n = gt.len();
        // Sparse random directions (a few elements): a dense one moves every
        // pre-activation and crosses ReLU / max-pool kinks within the step.
        let mut dirs: Vec<Vec<f32>> = Vec::new();
        for _ in 0..2 {
            let mut d = vec![0.0; n];
            for _ in 0..3 {
                let j = ((next() * 0.5 + 0.5) * n as f32) as usize % n;
                d[j] = next();
            }
            dirs.push(d);
        }
        if k == 0 || k + 1 == su.step.schedule.with_grad.len() {
            let mut e = vec![0.0; n];
            e[n / 2] = 1.0;
            dirs.push(e);
        }
        for dir in dirs {
            let an: f64 = gt
                .iter()
                .zip(&dir)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let scale: f64 = gt
                .iter()
                .zip(&dir)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let eps = 1e-3f32;
            let fd =
                (loss_moved(su, t, &dir, eps) - loss_moved(su, t, &dir, -eps)) / (2.0 * eps as f64);
            let err = (fd - an).abs();
            // f32 forward: the loss is the mean of f32 outputs, each rounded to
            // ~6e-8 relative; divided by 2ε that is ~3e-5 of the mean |output|.
            let tol = 1e-2 * scale + 1e-4 * (1.0 + mean_abs);
            assert!(
                err <= tol,
                "{name}: parameter {}: finite difference {fd:.6e}, gradient {an:.6e}, tolerance {tol:.2e}",
                su.model.graph.tensor(t).name
            );
            if std::env::var("EXEC_TRAIN_VERBOSE").is_ok() {
                eprintln!(
                    "  {}: fd {fd:.6e} an {an:.6e} err {err:.2e} tol {tol:.2e}",
                    su.model.graph.tensor(t).name
                );
            }
            worst = worst.max(err / (scale + 1e-12));
        }
    }
    eprintln!(
        "{name}: {} parameters checked, worst relative error {worst:.2e}",
        su.step.schedule.with_grad.len()
    );
}

/// Plans that recompute: every droppable value dropped (the most recomputation),
/// and the greedy planner at a budget halfway between the op-local bound and the
/// baseline peak.
fn plans(g: &RematGraph, baseline_peak: u64) -> Vec<(&'static str, Vec<Instr>)> {
    let mut drop_all = vec![false; g.values.len()];
    for v in candidates(g) {
        drop_all[v] = true;
    }
    let lo = g.op_local_bound();
    let budget = lo + (baseline_peak.saturating_sub(lo)) / 2;
    vec![
        ("drop-all", plan_with_drops(g, &drop_all)),
        ("greedy", greedy(g, budget).0),
    ]
}

fn planned_identical(su: &Setup, base: &StepResult) {
    for (what, plan) in plans(&su.step.graph, base.peak_bytes) {
        planned_run(su, base, what, &plan);
    }
}

fn planned_run(su: &Setup, base: &StepResult, what: &str, plan: &[Instr]) {
    let name = &su.step.graph.name;
    let predicted = replay(&su.step.graph, plan).unwrap();
    let r = run(su, plan, &su.params, 0.01);
    let recomputed = r.executions.iter().filter(|&&e| e > 1).count();
    eprintln!(
        "{name} planned ({what}): measured peak {} B, predicted {} B, baseline {} B, {recomputed} steps recomputed",
        r.peak_bytes, predicted.peak_bytes, base.peak_bytes
    );
    assert!(recomputed > 0, "{name}: the plan recomputes something");
    assert_eq!(r.peak_bytes, predicted.peak_bytes, "{name}: planned peak");
    assert_eq!(r.live_after, replay_live(&su.step.graph, plan));
    assert_eq!(r.loss.to_bits(), base.loss.to_bits(), "{name}: loss");
    for (k, (a, b)) in r.grads.iter().zip(&base.grads).enumerate() {
        let (a, b) = (a.to_f32().unwrap(), b.to_f32().unwrap());
        assert!(
            a.iter()
                .zip(b.iter())
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}: gradient {k} bitwise"
        );
    }
    assert_eq!(r.params, base.params, "{name}: updated parameters");
}

#[test]
fn mlp_baseline_peak_gradients_and_plan() {
    let (su, r) = baseline_peak_matches("mlp", 4);
    check_gradients(&su, &r);
    // SGD: p' = p - lr·g.
    for (k, &t) in su.step.schedule.with_grad.iter().enumerate() {
        let (p0, p1) = (
            su.params[t]
                .as_ref()
                .unwrap()
                .to_f32()
                .unwrap()
                .into_owned(),
            r.params[t].as_ref().unwrap().to_f32().unwrap().into_owned(),
        );
        let g = r.grads[k].to_f32().unwrap();
        for ((a, b), g) in p0.iter().zip(&p1).zip(g.iter()) {
            assert_eq!(*b, a - 0.01 * g);
        }
    }
    planned_identical(&su, &r);
}

#[test]
fn cnn_baseline_peak_gradients_and_plan() {
    let (su, r) = baseline_peak_matches("cnn", 2);
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

/// The exact-GELU fusion (and Dropout with real masks): the pattern's inner values
/// are recomputed from `x` at its backward; accounting unchanged.
#[test]
fn transformer_fused_gelu_baseline_gradients_and_plan() {
    let (su, r) = baseline_peak_matches("transformer", 2);
    assert!(!su.step.schedule.fused.is_empty());
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

/// Tied input/output embeddings (one parameter read by a Gather and, through a
/// Transpose, by a MatMul): the first contribution is a view of the MatMul's
/// gradient, the second is added out of place, as autograd does. Measured peak ==
/// predicted, gradients by finite differences, planned runs bitwise.
#[test]
fn tied_embeddings_baseline_gradients_and_plan() {
    let (su, r) = baseline_peak_matches("roberta_mlm", 2);
    let sums = su
        .step
        .schedule
        .steps
        .iter()
        .filter(|st| {
            st.writes.iter().any(|&w| {
                let name = &su.step.schedule.storages[w].name;
                su.step.schedule.storages[w].kind == memplan::train::StorageKind::ParamGrad
                    && st
                        .writes
                        .iter()
                        .any(|&p| su.step.schedule.storages[p].name == format!("{name}+"))
            })
        })
        .count();
    assert_eq!(
        sums, 1,
        "one out-of-place accumulation (the tied embedding)"
    );
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

/// SiLU as the exporter writes it (Sigmoid + Mul), fused: only `x` saved, the
/// sigmoid recomputed at the pattern's backward.
#[test]
fn llama_fused_silu_baseline_gradients_and_plan() {
    let (su, r) = baseline_peak_matches("llama_small", 2);
    let silu = su
        .step
        .schedule
        .fused
        .iter()
        .filter(|p| p.kind == memplan::train::FusedKind::Silu)
        .count();
    assert_eq!(silu, 2, "one SiLU per decoder layer");
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

/// `F.gelu(approximate="tanh")` written out by the exporter (Gemma's MLP, from the
/// census subset), fused: only `x` saved, the inner values recomputed at the
/// pattern's backward.
#[test]
fn gemma_fused_tanh_gelu_baseline_gradients_and_plan() {
    let (su, r) = baseline_peak_matches("census/hf_gemma", 1);
    let n = su
        .step
        .schedule
        .fused
        .iter()
        .filter(|p| p.kind == memplan::train::FusedKind::GeluTanh)
        .count();
    assert_eq!(n, 2, "one tanh GELU per decoder layer");
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

/// The normalization patterns of tests/data/fusion (made by its export.py;
/// tests/fusion.rs checks their saved bytes against PyTorch's): `nn.LayerNorm`
/// decomposed at opset 16 (affine, no affine, weight only) and LlamaRMSNorm's rsqrt
/// through both exporters (`Div(1, Sqrt)`, `Reciprocal(Sqrt)`). The inner values
/// are recomputed from what the pattern reads at its backward.
#[test]
fn decomposed_norms_baseline_gradients_and_plan() {
    use memplan::train::FusedKind;
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fusion");
    for (name, kind, n) in [
        ("layernorm_opset16", FusedKind::LayerNorm, 3),
        ("rmsnorm_llama", FusedKind::Rsqrt, 1),
        ("rmsnorm_llama_dynamo", FusedKind::Rsqrt, 1),
    ] {
        let model = load_model(&dir.join(format!("{name}.onnx"))).unwrap();
        let (su, r) = baseline_of(setup_from(model, name, 2, sgd_fp32()), 2);
        let found = su
            .step
            .schedule
            .fused
            .iter()
            .filter(|p| p.kind == kind)
            .count();
        assert_eq!(found, n, "{name}: {kind:?} patterns");
        check_gradients(&su, &r);
        planned_identical(&su, &r);
    }
}

/// A node reading one tensor at two slots (`Mul(h, h)`, `Mul(w, w)`: squares the
/// exporter writes): the first slot's gradient is new, the second is added into it
/// in place, never out of place.
#[test]
fn squares_accumulate_in_place() {
    use common::{model, node, value_info, weight, with_int, D};
    let p = model(
        vec![
            with_int(node("Gemm", "fc", &["x", "w", "b"], &["h"]), "transB", 1),
            node("Mul", "sq", &["h", "h"], &["h2"]),
            node("Mul", "wsq", &["s", "s"], &["s2"]),
            node("Mul", "y", &["h2", "s2"], &["out"]),
        ],
        vec![weight("w", &[4, 3]), weight("b", &[4]), weight("s", &[4])],
        vec![value_info("x", 1, &[D::S("batch"), D::N(3)])],
        vec![value_info("out", 1, &[D::S("batch"), D::N(4)])],
    );
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_tmp(&dir, "sq.onnx", &common::encode(&p));
    let su = setup_from(load_model(&path).unwrap(), "squares", 2, sgd_fp32());
    let updates = su
        .step
        .schedule
        .steps
        .iter()
        .filter(|st| !st.updates.is_empty())
        .count();
    assert_eq!(updates, 2, "h and s: one in-place accumulation each");
    let (su, r) = baseline_of(su, 2);
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

/// A deformable convolution as DCNv2 builds it (offsets and a sigmoid mask from
/// convolutions of its input) feeding RoiAlign (rois a float initializer
/// /// without gradient, batch indices a constant): DeformConv saves X, W,
/// offsets, mask and bias, RoiAlign only its rois and indices (torchvision's). Measured peak = predicted,
/// gradients of every parameter (offset and mask heads through DeformConv's
/// offset and mask gradients) by finite differences, planned runs bitwise.
#[test]
fn deform_conv_roi_align_baseline_gradients_and_plan() {
    use common::{ints, model, node, value_info, with_int, with_ints, D};
    use memplan::onnx::proto::TensorProto;
    let values = |name: &str, dims: &[i64], v: Vec<f32>| {
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        TensorProto {
            name: Some(name.into()),
            dims: dims.to_vec(),
            data_type: Some(1),
            raw_data: Some(raw.into()),
            ..Default::default()
        }
    };
    // Seeded values in [-0.5, 0.5) (zeros would put every sample on a kink).
    let filled = |name: &str, dims: &[i64], seed: u64| {
        let mut r = common::opcase::Rng(seed);
        let n: i64 = dims.iter().product();
        values(name, dims, (0..n).map(|_| r.f(-0.5, 0.5)).collect())
    };
    let rois = vec![0.5, 0.5, 4.5, 3.5, 1.0, 0.2, 5.0, 4.8, -0.5, 1.0, 3.0, 6.5];
    let pads = |n| with_ints(n, "pads", &[1, 1, 1, 1]);
    let roi = node("RoiAlign", "ra", &["h", "rois", "bidx"], &["out"]);
    let roi = with_int(with_int(roi, "output_height", 2), "output_width", 3);
    let mut p = model(
        vec![
            pads(node("Conv", "offc", &["x", "w_off"], &["off"])),
            pads(node("Conv", "maskc", &["x", "w_mask"], &["ml"])),
            node("Sigmoid", "sig", &["ml"], &["mask"]),
            pads(node(
                "DeformConv",
                "dc",
                &["x", "w", "off", "b", "mask"],
                &["h"],
            )),
            with_int(roi, "sampling_ratio", 2),
        ],
        vec![
            filled("w_off", &[18, 2, 3, 3], 1),
            filled("w_mask", &[9, 2, 3, 3], 2),
            filled("w", &[3, 2, 3, 3], 3),
            filled("b", &[3], 4),
            values("rois", &[3, 4], rois),
            ints("bidx", &[0, 1, 0]),
        ],
        vec![value_info(
            "x",
            1,
            &[D::S("batch"), D::N(2), D::N(5), D::N(6)],
        )],
        vec![value_info("out", 1, &[D::N(3), D::N(3), D::N(2), D::N(3)])],
    );
    p.opset_import[0].version = Some(19);
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_tmp(&dir, "dcn.onnx", &common::encode(&p));
    let su = setup_from(load_model(&path).unwrap(), "dcn_roi", 2, sgd_fp32());
    let (su, r) = baseline_of(su, 2);
    check_gradients(&su, &r);
    planned_identical(&su, &r);
}

#[test]
fn bad_plans_and_schedules_are_rejected() {
    let su = setup("mlp", 2);
    let plan = su.step.graph.no_recompute_plan();
    // Free the first value a backward step reads right after it is made.
    let (_, v) = su
        .step
        .graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.backward)
        .find_map(|(i, n)| {
            n.inputs
                .iter()
                .find(|&&v| !su.step.graph.values[v].fixed && !su.step.graph.values[v].held)
                .map(|&v| (i, v))
        })
        .unwrap();
    let p = su.step.graph.values[v].producer.unwrap();
    let mut bad: Vec<Instr> = plan.clone();
    let at = bad.iter().position(|o| *o == Instr::Compute(p)).unwrap();
    bad.insert(at + 1, Instr::Free(v));
    let err = train_step(
        &su.model,
        &su.step,
        &bad,
        &su.params,
        &su.inputs,
        &StepOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("not live"), "{err}");
    assert!(err.contains(&su.step.graph.values[v].name), "{err}");
    // A schedule built for another optimizer than the options'.
    let o = TrainOptions {
        optimizer: Optimizer::Adam,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    };
    let adam = training_step(&su.model, &su.step.inferred, &o, "mlp");
    let err = train_step(
        &su.model,
        &adam,
        &adam.graph.no_recompute_plan(),
        &su.params,
        &su.inputs,
        &StepOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("optimizer is adam"), "{err}");
}

/// The larger models of models/ without fused patterns, at batch 1: baseline peak
/// exact, planned runs bitwise identical (release build: about a minute). Run with
/// `cargo test --release --test exec_train -- --ignored`; `EXEC_TRAIN_MODELS=a,b`
/// picks models.
#[test]
#[ignore]
fn larger_models_baseline_and_planned() {
    larger_models("resnet18,resnet18_dynamo,mobilenet_v2,resnet50,gpt2,gpt2_dynamo");
}

/// The larger models with fused patterns (bert_base: exact GELU; vit_b_16: exact
/// GELU and SDPA) at batch 1, as [`larger_models_baseline_and_planned`].
#[test]
#[ignore]
fn fused_models_baseline_and_planned() {
    larger_models("bert_base,vit_b_16");
}

fn larger_models(all: &str) {
    let only = std::env::var("EXEC_TRAIN_MODELS").ok();
    for name in only.as_deref().unwrap_or(all).split(',') {
        let t0 = std::time::Instant::now();
        let (su, r) = baseline_peak_matches(name, 1);
        planned_identical(&su, &r);
        eprintln!("{name}: {:.1}s", t0.elapsed().as_secs_f64());
    }
}

/// `Loss::Sum`: the loss's gradient is one scalar storage (expanded as a view); the
/// peak still matches, and every gradient is the mean loss's times the output size
/// (up to f32 rounding: 1/40 is not exact).
#[test]
fn sum_loss() {
    let mean = setup("mlp", 4);
    let base = run(
        &mean,
        &mean.step.graph.no_recompute_plan(),
        &mean.params,
        0.0,
    );
    let o = TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Sum,
        grads_resident: false,
        params: Default::default(),
    };
    let sum = training_step(&mean.model, &mean.step.inferred, &o, "mlp");
    let (s, g) = (&sum.schedule, &sum.graph);
    let plan = g.no_recompute_plan();
    let r = train_step(
        &mean.model,
        &sum,
        &plan,
        &mean.params,
        &mean.inputs,
        &StepOptions {
            lr: 0.0,
            loss: Loss::Sum,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.peak_bytes, replay(g, &plan).unwrap().peak_bytes);
    assert_eq!(r.peak_bytes, simulate(s).peak().total());
    let n = base.output.numel() as f32;
    for (a, b) in r.grads.iter().zip(&base.grads) {
        let (a, b) = (a.to_f32().unwrap(), b.to_f32().unwrap());
        for (x, y) in a.iter().zip(b.iter()) {
            assert!(
                (x - y * n).abs() <= 1e-5 * (y * n).abs() + 1e-7,
                "{x} vs {}",
                y * n
            );
        }
    }
}

/// Momentum, Adam and AdamW, gradients resident or not, on mlp and cnn: state
/// (persistent) and foreach temporaries (allocated by the update) counted as the
/// schedule says, so the measured peak equals replay's and simulate's, baseline and
/// planned; planned runs bitwise identical; gradients independent of the optimizer
/// and of residency.
#[test]
fn optimizers_peak_and_plans() {
    for (name, batch) in [("mlp", 4), ("cnn", 2)] {
        let base = setup(name, batch);
        let sgd = run(
            &base,
            &base.step.graph.no_recompute_plan(),
            &base.params,
            0.01,
        );
        for opt in [
            Optimizer::Sgd,
            Optimizer::Momentum,
            Optimizer::Adam,
            Optimizer::Adamw,
        ] {
            for grads_resident in [false, true] {
                let su = setup_with(
                    name,
                    batch,
                    TrainOptions {
                        optimizer: opt,
                        precision: Precision::Fp32,
                        loss: Loss::Mean,
                        grads_resident,
                        params: Default::default(),
                    },
                );
                eprintln!("{name} {opt} grads_resident={grads_resident}:");
                let (su, r) = baseline_of(su, batch);
                assert_eq!(r.state.is_some(), opt != Optimizer::Sgd);
                for (a, b) in r.grads.iter().zip(&sgd.grads) {
                    assert_eq!(a, b, "{name} {opt}: gradients as under SGD");
                }
                planned_identical(&su, &r);
            }
        }
    }
}

/// One update by hand (f64) on a few elements of every parameter of mlp: momentum
/// (with and without weight decay), Adam, AdamW, PyTorch's formulas at step 1 from
/// zero state.
#[test]
fn optimizer_updates_by_hand() {
    for opt in [Optimizer::Momentum, Optimizer::Adam, Optimizer::Adamw] {
        for wd in [None, Some(0.1f64)] {
            let su = setup_with(
                "mlp",
                4,
                TrainOptions {
                    optimizer: opt,
                    precision: Precision::Fp32,
                    loss: Loss::Mean,
                    grads_resident: false,
                    params: Default::default(),
                },
            );
            let so = StepOptions {
                lr: 0.01,
                optimizer: opt,
                weight_decay: wd,
                ..Default::default()
            };
            let r = train_step(
                &su.model,
                &su.step,
                &su.step.graph.no_recompute_plan(),
                &su.params,
                &su.inputs,
                &so,
            )
            .unwrap();
            let (lr, b1, b2, eps) = (0.01f64, 0.9f64, 0.999f64, 1e-8f64);
            let state = r.state.as_ref().unwrap().to_f32().unwrap();
            let n: usize = r.grads.iter().map(|g| g.numel()).sum();
            let mut off = 0;
            let mut checked = 0;
            for (k, &t) in su.step.schedule.with_grad.iter().enumerate() {
                let p0 = su.params[t].as_ref().unwrap().to_f32().unwrap();
                let p1 = r.params[t].as_ref().unwrap().to_f32().unwrap();
                let g = r.grads[k].to_f32().unwrap();
                for j in [0, g.len() / 2, g.len() - 1] {
                    let (p, gj) = (p0[j] as f64, g[j] as f64);
                    let (want, m_want, v_want) = match opt {
                        Optimizer::Momentum => {
                            let gd = gj + wd.unwrap_or(0.0) * p;
                            (p - lr * gd, gd, 0.0)
                        }
                        Optimizer::Adam | Optimizer::Adamw => {
                            let (p, gd) = if opt == Optimizer::Adamw {
                                (p * (1.0 - lr * wd.unwrap_or(0.01)), gj)
                            } else {
                                (p, gj + wd.unwrap_or(0.0) * p)
                            };
                            let m = (1.0 - b1) * gd;
                            let v = (1.0 - b2) * gd * gd;
                            let denom = v.sqrt() / (1.0 - b2).sqrt() + eps;
                            (p - lr / (1.0 - b1) * m / denom, m, v)
                        }
                        Optimizer::Sgd
                        | Optimizer::Adam8bit
                        | Optimizer::Lion
                        | Optimizer::Adafactor => unreachable!(),
                    };
                    let tol = 1e-6 * (p.abs() + lr);
                    assert!(
                        (p1[j] as f64 - want).abs() <= tol,
                        "{opt} wd {wd:?}: parameter {k}[{j}]: {} vs {want}",
                        p1[j]
                    );
                    let m = state[off + j] as f64;
                    assert!(
                        (m - m_want).abs() <= 1e-6 * m_want.abs() + 1e-12,
                        "{opt}: m {m} vs {m_want}"
                    );
                    if opt != Optimizer::Momentum {
                        let v = state[n + off + j] as f64;
                        assert!(
                            (v - v_want).abs() <= 1e-5 * v_want + 1e-15,
                            "{opt}: v {v} vs {v_want}"
                        );
                    }
                    checked += 1;
                }
                off += g.len();
            }
            assert!(checked >= 12);
        }
    }
}

/// A float32 initializer with seeded values in [-0.5, 0.5).
fn rweight(name: &str, dims: &[i64], seed: u64) -> memplan::onnx::proto::TensorProto {
    let n: i64 = dims.iter().product();
    let mut z = seed;
    let v = (0..n)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    memplan::onnx::proto::TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(1),
        float_data: v,
        ..Default::default()
    }
}

/// A `Constant` node of a tensor value.
fn constant(out: &str, t: memplan::onnx::proto::TensorProto) -> memplan::onnx::proto::NodeProto {
    use memplan::onnx::proto::{attribute_proto::AttributeType, AttributeProto};
    let mut n = common::node("Constant", out, &[], &[out]);
    n.attribute.push(AttributeProto {
        name: Some("value".into()),
        r#type: Some(AttributeType::Tensor as i32),
        t: Some(t),
        ..Default::default()
    });
    n
}

fn f32_tensor(dims: &[i64], v: Vec<f32>) -> memplan::onnx::proto::TensorProto {
    memplan::onnx::proto::TensorProto {
        dims: dims.to_vec(),
        data_type: Some(1),
        float_data: v,
        ..Default::default()
    }
}

/// One attention head block written as the TorchScript exporter decomposes
/// `scaled_dot_product_attention` with an additive mask and training-mode dropout:
/// x [batch, 8, 16] → q, k, v (2 heads of 8) → `MatMul(Mul(q, s), Mul(kᵀ, s))` →
/// `Add(mask)` → Softmax → Dropout(0.1) → `MatMul(·, v)` → heads merged → Linear(16, 4).
/// The mask is an activation: `Mul(Constant, 1)` (a folded value) when `folded`,
/// else the mean of `x` over features (computed from the batch, no value).
fn sdpa_model(folded: bool) -> Model {
    use common::{ints, model, node, value_info, with_int, with_ints, D};
    let scale = 8f32.powf(-0.25);
    let mut nodes = vec![];
    for (n, w) in [("q", "wq"), ("k", "wk"), ("v", "wv")] {
        nodes.push(node(
            "MatMul",
            &format!("{n}_proj"),
            &["x", w],
            &[&format!("{n}0")],
        ));
        nodes.push(node(
            "Reshape",
            &format!("{n}_split"),
            &[&format!("{n}0"), "shp4"],
            &[&format!("{n}1")],
        ));
        let perm: &[i64] = if n == "k" {
            &[0, 2, 3, 1]
        } else {
            &[0, 2, 1, 3]
        };
        nodes.push(with_ints(
            node(
                "Transpose",
                &format!("{n}_heads"),
                &[&format!("{n}1")],
                &[&format!("{n}2")],
            ),
            "perm",
            perm,
        ));
    }
    nodes.push(constant("sc", f32_tensor(&[], vec![scale])));
    nodes.push(node("Mul", "q_scale", &["q2", "sc"], &["qs"]));
    nodes.push(node("Mul", "k_scale", &["k2", "sc"], &["ks"]));
    nodes.push(node("MatMul", "scores", &["qs", "ks"], &["s"]));
    if folded {
        // A causal mask.
        let m: Vec<f32> = (0..64)
            .map(|i| if i % 8 > i / 8 { -1e4 } else { 0.0 })
            .collect();
        nodes.push(constant("maskc", f32_tensor(&[8, 8], m)));
        nodes.push(constant("one", f32_tensor(&[], vec![1.0])));
        nodes.push(node("Mul", "mask_make", &["maskc", "one"], &["mask"]));
    } else {
        nodes.push(with_int(
            with_ints(
                node("ReduceMean", "mask_mean", &["x"], &["m0"]),
                "axes",
                &[2],
            ),
            "keepdims",
            1,
        ));
        nodes.push(node("Unsqueeze", "mask_make", &["m0", "ax1"], &["mask"]));
    }
    nodes.push(node("Add", "masked", &["s", "mask"], &["a"]));
    nodes.push(with_int(
        node("Softmax", "softmax", &["a"], &["p"]),
        "axis",
        -1,
    ));
    nodes.push(constant("ratio", f32_tensor(&[], vec![0.1])));
    nodes.push(constant(
        "tm",
        memplan::onnx::proto::TensorProto {
            dims: vec![],
            data_type: Some(9),
            int32_data: vec![1],
            ..Default::default()
        },
    ));
    nodes.push(node("Dropout", "attn_drop", &["p", "ratio", "tm"], &["pd"]));
    nodes.push(node("MatMul", "attn", &["pd", "v2"], &["o"]));
    nodes.push(with_ints(
        node("Transpose", "merge_t", &["o"], &["ot"]),
        "perm",
        &[0, 2, 1, 3],
    ));
    nodes.push(node("Reshape", "merge", &["ot", "shp3"], &["om"]));
    nodes.push(node("MatMul", "out_proj", &["om", "wo"], &["y"]));
    let p = model(
        nodes,
        vec![
            rweight("wq", &[16, 16], 1),
            rweight("wk", &[16, 16], 2),
            rweight("wv", &[16, 16], 3),
            rweight("wo", &[16, 4], 4),
            ints("shp4", &[0, 8, 2, 8]),
            ints("shp3", &[0, 8, 16]),
            ints("ax1", &[1]),
        ],
        vec![value_info("x", 1, &[D::S("batch"), D::N(8), D::N(16)])],
        vec![value_info("y", 1, &[D::S("batch"), D::N(8), D::N(4)])],
    );
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_tmp(&dir, "sdpa.onnx", &common::encode(&p));
    load_model(&path).unwrap()
}

/// SDPA with an additive mask and training-mode Dropout inside the pattern: with a
/// folded mask, peaks exact, finite differences (the Dropout mask regenerated at the
/// pattern's backward), planned runs bitwise identical; with a mask computed from
/// the batch, the same, the mask saved as PyTorch's kernel saves it (`attn_mask`,
/// `attn_bias`).
#[test]
fn sdpa_with_mask_and_dropout() {
    let o = TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    };
    for (folded, name) in [(true, "sdpa"), (false, "sdpa_unfolded")] {
        let su = setup_from(sdpa_model(folded), name, 2, o.clone());
        let p = su
            .step
            .schedule
            .fused
            .iter()
            .find(|p| p.kind == memplan::train::FusedKind::Sdpa)
            .expect("the SDPA pattern is recognised");
        assert_eq!(
            p.nodes.len(),
            7,
            "scale ×2, scores, mask add, softmax, dropout, output"
        );
        let mask_read = p
            .reads
            .iter()
            .any(|&t| su.model.graph.tensor(t).name.as_str() == "mask");
        assert_eq!(
            mask_read, !folded,
            "{name}: the mask is read unless constant"
        );
        let (su, r) = baseline_of(su, 2);
        check_gradients(&su, &r);
        planned_identical(&su, &r);
    }
}

/// The precision policies on mlp and cnn (SGD and Adam): every float storage in the
/// type the schedule gives it (autocast copies made by their consumer's step, cached
/// weight copies made once, bf16 parameters, gradients and states), compute in f32:
/// measured peak = replay = simulate, baseline and planned; planned runs bitwise
/// identical; gradients within half precision of fp32's (cosine > 0.999 fp16,
/// 0.99 bf16).
#[test]
fn precision_policies_peak_and_plans() {
    for (name, batch) in [("mlp", 4), ("cnn", 2)] {
        let f = setup(name, batch);
        let fp32 = run(&f, &f.step.graph.no_recompute_plan(), &f.params, 0.01);
        for prec in [Precision::AmpFp16, Precision::AmpBf16, Precision::Bf16] {
            for opt in [Optimizer::Sgd, Optimizer::Adam] {
                let su = setup_with(
                    name,
                    batch,
                    TrainOptions {
                        optimizer: opt,
                        precision: prec,
                        loss: Loss::Mean,
                        grads_resident: false,
                        params: Default::default(),
                    },
                );
                let half = su
                    .step
                    .schedule
                    .storages
                    .iter()
                    .filter(|st| st.dtype == prec.half().unwrap())
                    .count();
                let casts = su
                    .step
                    .schedule
                    .storages
                    .iter()
                    .filter(|st| st.kind == memplan::train::StorageKind::Cast)
                    .count();
                eprintln!("{name} {prec} {opt}: {half} half storages, {casts} casts");
                assert!(half > 0);
                assert_eq!(casts > 0, prec.is_amp());
                let (su, r) = baseline_of(su, batch);
                for (k, (a, b)) in r.grads.iter().zip(&fp32.grads).enumerate() {
                    let (a, b) = (a.to_f64s(), b.to_f64s());
                    let dot: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
                    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let cos = dot / (na * nb).max(1e-30);
                    // bf16 keeps 8 significant bits, fp16 11.
                    let min = if prec.half() == Some(memplan::ir::DType::F16) {
                        0.999
                    } else {
                        0.99
                    };
                    assert!(cos > min, "{name} {prec}: gradient {k}: cosine {cos}");
                }
                planned_identical(&su, &r);
            }
        }
    }
}

/// Fused patterns under the half-precision policies (transformer: exact GELU; the
/// SDPA model: autocast copies inside the attention, its Softmax on an f32 copy):
/// peaks exact, planned runs bitwise identical.
#[test]
fn fused_patterns_under_half_policies() {
    for prec in [Precision::AmpFp16, Precision::AmpBf16, Precision::Bf16] {
        let o = TrainOptions {
            optimizer: Optimizer::Adam,
            precision: prec,
            loss: Loss::Mean,
            grads_resident: false,
            params: Default::default(),
        };
        for su in [
            setup_with("transformer", 2, o.clone()),
            setup_from(sdpa_model(true), "sdpa", 2, o.clone()),
        ] {
            assert!(!su.step.schedule.fused.is_empty());
            eprintln!("{} {prec}:", su.step.graph.name);
            let (su, r) = baseline_of(su, 2);
            planned_identical(&su, &r);
        }
    }
}
