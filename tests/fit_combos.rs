//! `fit`'s combinations, offload rows and recommendation; the small-state optimizers'
//! and the frozen weight dtypes' bytes, by hand on models/mlp.onnx; bad flags.
//!
//! Every combination row is checked as `fit`'s single rows are: the configuration is
//! built again here from its names (precision, gradient residency, checkpointing,
//! per-GPU partition) at `max_batch` (it fits, at the reported peak) and
//! `max_batch + 1` (it does not).

mod common;

use std::process::Command;

use memplan::fit::{fit, partition, Dist, FitOptions, FitReport};
use memplan::infer::{infer, Bindings};
use memplan::ir::Model;
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::remat::checkpoint_sqrt;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::modules::every_block;
use memplan::train::{
    build_schedule, Optimizer, ParamSelection, Precision, Schedule, StorageKind, TrainOptions,
    WeightDtype,
};

fn schedule(model: &Model, b: u64, opts: &TrainOptions) -> Schedule {
    let inf = infer(
        model,
        &Bindings {
            batch: Some(b),
            ..Default::default()
        },
    )
    .unwrap();
    build_schedule(model, &inf, opts).unwrap()
}

/// The per-GPU peak of the configuration a row names, built from scratch.
fn config_peak(model: &Model, names: &[String], b: u64, o: &FitOptions) -> u64 {
    let has = |n: &str| names.iter().any(|x| x == n);
    let mut t = o.train.clone();
    if has("mixed-precision") {
        t.precision = Precision::AmpFp16;
    }
    t.grads_resident = has("grad-accumulation");
    let dist = if has("data-parallel") {
        Dist::DataParallel
    } else if has("zero-1") {
        Dist::Zero(1)
    } else if has("zero-2") {
        Dist::Zero(2)
    } else if has("zero-3") {
        Dist::Zero(3)
    } else if has("zero-offload") {
        Dist::ZeroOffload
    } else if has("zero-3-offload") {
        Dist::Zero3Offload
    } else if has("fsdp2") {
        Dist::Fsdp { reshard: true }
    } else if has("fsdp2-no-reshard") {
        Dist::Fsdp { reshard: false }
    } else {
        Dist::Single
    };
    let mp = model_parallel(names);
    let gpus = if dist == Dist::Single {
        1
    } else {
        o.gpus / mp.ranks()
    };
    let mut s = replica_rank(model, schedule(model, b, &t), mp);
    if has("checkpoint-every-block") {
        partition(&mut s, dist, gpus);
        return every_block(&from_schedule(&s, "t")).unwrap().peak_bytes;
    }
    if has("checkpoint-every-block-selective") {
        partition(&mut s, dist, gpus);
        let g = from_schedule(&s, "t");
        let t = memplan::remat::modules::ModuleTree::build(&g);
        return memplan::remat::modules::every_block_with(&g, &t, true)
            .unwrap()
            .peak_bytes;
    }
    if has("checkpointing-sqrt") {
        s = checkpoint_sqrt(&s, 0).schedule;
    }
    partition(&mut s, dist, gpus);
    simulate(&s).peak().total()
}

/// The `tp-N` and `pp-N` of a row's names.
fn model_parallel(names: &[String]) -> memplan::fit::combo::Mp {
    let degree = |p: &str| {
        names
            .iter()
            .find_map(|n| n.strip_prefix(p).and_then(|d| d.parse().ok()))
            .unwrap_or(1)
    };
    memplan::fit::combo::Mp {
        tp: degree("tp-"),
        pp: degree("pp-"),
    }
}

/// The step of the replica's rank with the highest peak (as `fit` picks it without a
/// device; on one, the most reserved bytes).
fn replica_rank(model: &Model, s: Schedule, mp: memplan::fit::combo::Mp) -> Schedule {
    if mp.ranks() == 1 {
        return s;
    }
    let names: Vec<String> = (0..s.tensor_storage.len())
        .map(|t| model.graph.tensor(t).name.to_string())
        .collect();
    memplan::parallel::ranks(s, &names, &mp.layout(mp.pp))
        .unwrap()
        .into_iter()
        .map(|r| r.schedule)
        .max_by_key(|s| simulate(s).peak().total())
        .unwrap()
}

fn check_rows(model: &Model, name: &str, o: &FitOptions, r: &FitReport) -> usize {
    let mut checked = 0;
    for row in &r.strategies {
        let Some(names) = &row.combines else { continue };
        assert!(names.len() >= 2, "{name} {}", row.name);
        assert_eq!(row.name, names.join("+"));
        if row.max_batch == 0 {
            assert!(config_peak(model, names, 1, o) > o.memory, "{}", row.name);
            continue;
        }
        let at = config_peak(model, names, row.max_batch, o);
        let next = config_peak(model, names, row.max_batch + 1, o);
        assert_eq!(at, row.peak_bytes, "{name} {}", row.name);
        assert!(
            at <= o.memory && next > o.memory,
            "{name} {}: {at} / {next} vs {}",
            row.name,
            o.memory
        );
        let gb = row.global_batch.unwrap();
        let target = o.target_batch.unwrap();
        // Combinations run on every GPU: global = micro-batch × steps × data-parallel
        // ranks (the GPUs over a replica's tensor- and pipeline-parallel ranks).
        let k = row.accumulation_steps.unwrap_or(1);
        let dp = (o.gpus / model_parallel(names).ranks()).max(1);
        assert_eq!(gb % (k * dp), 0, "{}", row.name);
        assert!(gb / (k * dp) <= row.max_batch, "{}", row.name);
        if row.accumulation_steps.is_some() {
            assert!(gb >= target, "{}", row.name);
        }
        checked += 1;
    }
    checked
}

#[test]
fn combinations_agree_with_the_profile() {
    for (name, mem, gpus, target) in [
        ("resnet18", 3u64 << 30, 4u64, 2048u64),
        ("cnn", 64 << 20, 1, 100_000),
    ] {
        let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
        let o = FitOptions {
            memory: mem,
            train: TrainOptions::default(),
            gpus,
            target_batch: Some(target),
            dims: Default::default(),
            plan_time_limit_s: 5.0,
            device: None,
            routing: None,
            cluster: None,
        };
        let r = fit(&model, name, &o).unwrap();
        // 2 precisions × 3 checkpointing schemes × the ways over GPUs (8 on several,
        // 3 on one), less the single strategies; a row with the same figures as an
        // earlier one is named in its `same_as` instead of listed.
        let combos = r.strategies.iter().filter(|s| s.combines.is_some()).count()
            + r.strategies
                .iter()
                .filter_map(|s| s.same_as.as_ref())
                .map(Vec::len)
                .sum::<usize>();
        let expect = if gpus > 1 { 36 - 4 } else { 18 - 3 };
        assert!(combos >= expect - 1, "{name}: {combos} combination rows");
        let checked = check_rows(&model, name, &o, &r);
        assert!(checked >= expect / 2, "{name}: {checked}");
        // Offload rows: host and PCIe bytes, and they fit at least what ZeRO-2 does.
        let by = |n: &str| r.strategies.iter().find(|s| s.name == n).unwrap();
        for n in ["zero-offload", "zero-3-offload"] {
            let row = by(n);
            assert!(
                row.host_bytes.unwrap() > 0 && row.pcie_bytes.unwrap() > 0,
                "{n}"
            );
            let names = vec![n.to_string()];
            assert_eq!(
                config_peak(&model, &names, row.max_batch, &o),
                row.peak_bytes,
                "{name} {n}"
            );
            assert!(config_peak(&model, &names, row.max_batch + 1, &o) > mem);
        }
        assert!(by("zero-offload").max_batch >= by("as-exported").max_batch);
        assert!(by("zero-3-offload").max_batch >= by("zero-offload").max_batch);
        // The recommendation reaches the target and no row that reaches it is
        // preferred to it (less extra compute, or as little and less communication).
        let rec = r.recommendation.as_ref().expect("reachable");
        assert!(rec.global_batch >= target, "{rec:?}");
        let dp = (gpus / model_parallel(&rec.strategies).ranks()).max(1);
        assert_eq!(
            rec.global_batch,
            rec.micro_batch * rec.accumulation_steps * dp
        );
        assert!(rec.peak_bytes <= mem);
        assert!(!rec.why.is_empty());
        for row in &r.strategies {
            let reaches = row.global_batch.unwrap_or(0) >= target && row.max_batch > 0;
            if !reaches || row.name == "checkpointing-planned" {
                continue;
            }
            let ov = (row.overhead * 1e9).round() as i64;
            let rov = (rec.overhead * 1e9).round() as i64;
            assert!(ov >= rov, "{name}: {} beats {rec:?}", row.name);
            if ov == rov && row.combines.is_some() {
                assert!(
                    row.communication_bytes.unwrap_or(0) >= rec.communication_bytes,
                    "{name}: {} vs {rec:?}",
                    row.name
                );
            }
        }
    }
}

#[test]
fn combinations_fit_where_single_strategies_do_not() {
    // 440000 bytes: no single strategy fits cnn.onnx at batch 1 (fit fails without a
    // target), but mixed precision with ZeRO-Offload and accumulation does.
    let model = load_model(&common::shipped("cnn.onnx")).unwrap();
    let o = FitOptions {
        memory: 440_000,
        train: TrainOptions::default(),
        gpus: 1,
        target_batch: None,
        dims: Default::default(),
        plan_time_limit_s: 5.0,
        device: None,
        routing: None,
        cluster: None,
    };
    let e = fit(&model, "cnn", &o).unwrap_err().to_string();
    assert!(e.contains("nothing fits"), "{e}");
    let o = FitOptions {
        target_batch: Some(1000),
        ..o
    };
    let r = fit(&model, "cnn", &o).unwrap();
    let rec = r.recommendation.as_ref().unwrap();
    assert!(
        rec.peak_bytes <= o.memory && rec.global_batch >= 1000,
        "{rec:?}"
    );
    assert!(rec.strategies.iter().any(|s| s == "grad-accumulation"));
    check_rows(&model, "cnn", &o, &r);
}

#[test]
fn communication_counts() {
    // ZeRO's counts on mlp.onnx: Ψ = 26122 fp32 gradients = 104488 bytes.
    let model = load_model(&common::shipped("mlp.onnx")).unwrap();
    let s = schedule(&model, 4, &TrainOptions::default());
    let g = 26122 * 4;
    let t = |d, n, k| memplan::fit::traffic(&s, d, n, k);
    assert_eq!(t(Dist::DataParallel, 4, 1).communication_bytes, 2 * g);
    assert_eq!(t(Dist::Zero(1), 4, 1).communication_bytes, 2 * g);
    assert_eq!(t(Dist::Zero(2), 4, 1).communication_bytes, 2 * g);
    assert_eq!(t(Dist::Zero(3), 4, 1).communication_bytes, 3 * g);
    assert_eq!(t(Dist::Zero(3), 4, 2).communication_bytes, 6 * g);
    assert_eq!(t(Dist::Single, 1, 1).communication_bytes, 0);
    // Offload on one GPU: Adam's 2Ψ state and Ψ gradients on the host; Ψ down and Ψ
    // up per step; ZeRO-3 offload: parameters too, up twice.
    let zo = t(Dist::ZeroOffload, 1, 1);
    assert_eq!(
        (zo.communication_bytes, zo.pcie_bytes, zo.host_bytes),
        (0, 2 * g, 3 * g)
    );
    let z3o = t(Dist::Zero3Offload, 2, 1);
    assert_eq!(z3o.host_bytes, 4 * g / 2);
    assert_eq!(z3o.pcie_bytes, 3 * g / 2);
    // Offload takes the state and gradients off the GPU.
    let mut p = s.clone();
    partition(&mut p, Dist::ZeroOffload, 1);
    assert_eq!(
        p.bytes_where(|x| matches!(x.kind, StorageKind::OptimizerState | StorageKind::ParamGrad)),
        0
    );
    assert!(simulate(&p).peak().total() < simulate(&s).peak().total());
}

fn state_bytes(o: Optimizer) -> u64 {
    let model = load_model(&common::shipped("mlp.onnx")).unwrap();
    let s = schedule(
        &model,
        4,
        &TrainOptions {
            optimizer: o,
            ..Default::default()
        },
    );
    s.bytes_where(|x| x.kind == StorageKind::OptimizerState)
}

#[test]
fn optimizer_state_by_hand() {
    // mlp.onnx: fc1 [128, 64] + 128, fc2 [128, 128] + 128, fc3 [10, 128] + 10.
    assert_eq!(state_bytes(Optimizer::Adam), 2 * 4 * 26122);
    // 8-bit: weights of 4096+ elements 2 bytes each + 2 fp32 absmax per 2048;
    // smaller tensors fp32; two shared 256-entry maps.
    let big = (2 * 8192 + 2 * 4 * 4) + (2 * 16384 + 2 * 8 * 4);
    let small = 2 * 4 * (128 + 128 + 1280 + 10);
    assert_eq!(state_bytes(Optimizer::Adam8bit), big + small + 2 * 256 * 4);
    assert_eq!(state_bytes(Optimizer::Lion), 4 * 26122);
    // Adafactor: row + column factors of each weight, full vectors for biases.
    let fac = (128 + 64) + 128 + (128 + 128) + 128 + (10 + 128) + 10;
    assert_eq!(state_bytes(Optimizer::Adafactor), 4 * fac);
    // `profile --train` reports it.
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args([
            "profile",
            "--train",
            "--batch",
            "4",
            "--json",
            "--optimizer",
        ])
        .arg("adam8bit")
        .arg(common::shipped("mlp.onnx"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["training"]["optimizer_bytes"].as_u64(),
        Some(big + small + 2048)
    );
}

#[test]
fn frozen_weight_dtypes_by_hand() {
    let model = load_model(&common::shipped("mlp.onnx")).unwrap();
    let params = |wd: Option<WeightDtype>| {
        let mut sel = ParamSelection::new(None, Some("fc3")).unwrap();
        sel.frozen_dtype = wd;
        let s = schedule(
            &model,
            4,
            &TrainOptions {
                optimizer: Optimizer::Sgd,
                params: sel,
                ..Default::default()
            },
        );
        let p = s.bytes_where(|x| x.kind == StorageKind::Parameter);
        let dequant: Vec<_> = s
            .storages
            .iter()
            .filter(|x| x.name.ends_with("@dequant"))
            .map(|x| (x.bytes, x.saved))
            .collect();
        (p, dequant)
    };
    // fc3 trains (1290 fp32); fc1, fc2 frozen: 24576 weight + 256 bias elements.
    let fc3 = 1290 * 4;
    assert_eq!(params(None).0, 26122 * 4);
    assert_eq!(params(Some(WeightDtype::Bf16)).0, fc3 + 24832 * 2);
    // int8: the Gemm (transB) weights' rows are dim 0: 128 fp32 absmax each; the
    // biases stay fp32.
    let (p, dq) = params(Some(WeightDtype::Int8));
    assert_eq!(p, fc3 + 256 * 4 + (8192 + 128 * 4) + (16384 + 128 * 4));
    // Each frozen weight is dequantized to fp32 for its op, and not saved.
    assert_eq!(dq, vec![(8192 * 4, false), (16384 * 4, false)]);
    // Backward through a frozen quantized weight (fc1 trains, so fc2's input
    // gradient is needed) dequantizes it again, a temporary of that step. fc3, the
    // head writing the output, stays unquantized, as transformers leaves a model's
    // last module.
    let mut sel = ParamSelection::new(None, Some("fc1")).unwrap();
    sel.frozen_dtype = Some(WeightDtype::Nf4);
    let s = schedule(
        &model,
        4,
        &TrainOptions {
            optimizer: Optimizer::Sgd,
            params: sel,
            ..Default::default()
        },
    );
    let again: Vec<_> = s
        .storages
        .iter()
        .filter(|x| x.name.ends_with("@dequant/grad"))
        .map(|x| (x.name.as_str(), x.bytes, x.saved))
        .collect();
    assert_eq!(again, vec![("fc2.weight@dequant/grad", 16384 * 4, false)]);
    assert!(s
        .storages
        .iter()
        .any(|x| x.name == "fc3.weight" && x.bytes == 1280 * 4));
    // nf4: half a byte each, a byte per 64, 4 bytes per 256 blocks, the offset.
    let nf4 = |n: u64| n / 2 + n / 64 + 4 * (n / 64).div_ceil(256) + 4;
    assert_eq!(
        params(Some(WeightDtype::Nf4)).0,
        fc3 + 256 * 4 + nf4(8192) + nf4(16384)
    );
}

fn cli(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn contradicting_flags_fail_in_one_line() {
    let mlp = common::shipped("mlp.onnx");
    let mlp = mlp.to_str().unwrap();
    let cnn = common::shipped("cnn.onnx");
    let cnn = cnn.to_str().unwrap();
    for (args, needle, code) in [
        (
            vec![
                "profile",
                mlp,
                "--batch",
                "2",
                "--train",
                "--weight-dtype",
                "nf4",
            ],
            "--freeze or --trainable",
            1,
        ),
        (
            vec!["fit", mlp, "--memory", "1GiB", "--weight-dtype", "int8"],
            "frozen parameters",
            1,
        ),
        (
            vec![
                "profile",
                mlp,
                "--batch",
                "2",
                "--train",
                "--weight-dtype",
                "nf4",
                "--trainable",
                "fc",
            ],
            "all 6 parameters train",
            1,
        ),
        (
            vec![
                "profile",
                cnn,
                "--batch",
                "2",
                "--train",
                "--weight-dtype",
                "int8",
                "--freeze",
                "conv",
            ],
            "none of the 2 frozen parameters",
            1,
        ),
        (
            vec![
                "profile",
                mlp,
                "--batch",
                "2",
                "--train",
                "--weight-dtype",
                "nf2",
                "--freeze",
                "fc1",
            ],
            "nf2",
            2,
        ),
        (
            vec![
                "profile",
                mlp,
                "--batch",
                "2",
                "--train",
                "--optimizer",
                "adam4bit",
            ],
            "adam4bit",
            2,
        ),
        (
            vec![
                "verify",
                mlp,
                "--batch",
                "2",
                "--budget",
                "0.5",
                "--optimizer",
                "lion",
            ],
            "lion",
            1,
        ),
    ] {
        let (c, err) = cli(&args);
        assert_eq!(c, Some(code), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Consistent flags work.
    let (c, err) = cli(&[
        "profile",
        mlp,
        "--batch",
        "2",
        "--train",
        "--weight-dtype",
        "nf4",
        "--trainable",
        "fc3",
    ]);
    assert_eq!(c, Some(0), "{err}");
}

/// AdamW on four H100s (the step timed) towards a global batch of 64, in `memory`,
/// on `device` if given.
fn on_four_h100s(memory: u64, device: Option<memplan::memory::device::DeviceModel>) -> FitOptions {
    let gpu = memplan::memory::device::Gpu::named("h100").unwrap();
    FitOptions {
        memory,
        train: TrainOptions {
            optimizer: Optimizer::Adamw,
            ..TrainOptions::default()
        },
        gpus: 4,
        target_batch: Some(64),
        dims: Default::default(),
        plan_time_limit_s: 5.0,
        device,
        routing: None,
        cluster: Some(memplan::fit::time::Cluster::of(gpu, 4, None).unwrap()),
    }
}

/// With a card (the step timed), `fit` adds tensor- and pipeline-parallel rows; each
/// is rebuilt here as the worst rank of its replica under ZeRO-1 over the
/// data-parallel ranks left, and agrees with its row, as every other row does.
#[test]
fn tensor_and_pipeline_parallel_rows_agree_with_their_ranks() {
    let model = load_model(&common::shipped("llm/fsdp_llama_b.onnx")).unwrap();
    let o = on_four_h100s(48 << 20, None);
    let r = fit(&model, "fsdp_llama_b", &o).unwrap();
    let mp_rows: Vec<&str> = r
        .strategies
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| n.contains("tp-") || n.contains("pp-"))
        .collect();
    assert!(mp_rows.len() >= 4, "{mp_rows:?}");
    assert!(check_rows(&model, "fsdp_llama_b", &o, &r) >= mp_rows.len());
    for row in r.strategies.iter().filter(|s| s.name.contains("pp-")) {
        assert!(row.step_seconds.is_some(), "{}", row.name);
    }
}

#[test]
fn the_answer_does_not_depend_on_the_threads() {
    // fit solves families of combinations side by side on a shared cache: one
    // thread and three must give the same report, byte for byte, on a device
    // (replays, family settling) with model-parallel rows and a target.
    use memplan::memory::allocator::AllocConf;
    use memplan::memory::device::{DeviceModel, Gpu};
    let model = load_model(&common::shipped("llm/fsdp_llama_b.onnx")).unwrap();
    let gpu = Gpu::named("h100").unwrap();
    let d = DeviceModel::new(AllocConf::default(), Some(gpu), Some(64 << 20))
        .with_memory(160 << 20, 8 << 20);
    let o = on_four_h100s(160 << 20, Some(d));
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let r = pool.install(|| fit(&model, "fsdp_llama_b", &o)).unwrap();
        serde_json::to_string(&r).unwrap()
    };
    let one = on(1);
    assert!(one.contains("tp-2") && one.contains("fsdp2"), "{one}");
    assert_eq!(one, on(3));
}
