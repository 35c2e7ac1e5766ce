//! `fit` agrees with the training profile: at each strategy's max_batch the step
//! fits, at max_batch + 1 it does not (for planned checkpointing: the planner finds a
//! plan within the budget at max_batch and none at max_batch + 1). Bad budgets and
//! models fail cleanly.

mod common;

use std::process::Command;

use memplan::fit::{
    fit, parse_memory, plan_step, plan_step_under, planned_max_batch, AffineStep, FitOptions,
    LOWEST_PEAK_TIME_LIMIT_S,
};
use memplan::infer::{infer, Bindings};
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::graph::replay;
use memplan::remat::modules::every_block;
use memplan::remat::plan::Solver;
use memplan::train::{build_schedule, TrainOptions};

fn peak(model: &memplan::ir::Model, b: u64, opts: &TrainOptions) -> u64 {
    let inf = infer(
        model,
        &Bindings {
            batch: Some(b),
            ..Default::default()
        },
    )
    .unwrap();
    simulate(&build_schedule(model, &inf, opts).unwrap())
        .peak()
        .total()
}

#[test]
fn max_batch_agrees_with_profile() {
    for (name, mem) in [
        ("resnet50", 8u64 << 30),
        ("gpt2", 12 << 30),
        ("bert_base", 6 << 30),
        ("cnn", 64 << 20),
    ] {
        let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
        let o = FitOptions {
            memory: mem,
            train: TrainOptions::default(),
            gpus: 4,
            target_batch: Some(512),
            dims: Default::default(),
            plan_time_limit_s: 20.0,
            device: None,
            routing: None,
            cluster: None,
        };
        let r = fit(&model, name, &o).unwrap();
        // Thirteen strategies (FSDP2 resharding and not among them), the two
        // offloads, then the combinations (target batch).
        let single = r.strategies.iter().filter(|s| s.combines.is_none()).count();
        assert_eq!(single, 15);
        assert!(r.strategies[..15].iter().all(|s| s.combines.is_none()));
        assert!(r.recommendation.is_some(), "{name}");
        let base = &r.strategies[0];
        assert_eq!(base.name, "as-exported");
        assert!(base.max_batch > 0, "{name}");
        // The as-exported answer is exactly what `profile --train` says.
        let at = peak(&model, base.max_batch, &o.train);
        let next = peak(&model, base.max_batch + 1, &o.train);
        assert_eq!(at, base.peak_bytes, "{name}");
        assert!(at <= mem && next > mem, "{name}: {at} / {next} vs {mem}");
        // Every strategy fits at its answer (peak_bytes <= budget) and the memory-saving
        // ones fit at least as much.
        for st in &r.strategies {
            assert!(st.peak_bytes <= mem, "{name} {}", st.name);
        }
        let by = |n: &str| r.strategies.iter().find(|s| s.name == n).unwrap().max_batch;
        assert!(by("mixed-precision") > base.max_batch, "{name}");
        assert!(by("checkpointing-sqrt") > base.max_batch, "{name}");
        check_planned(&model, name, &o, &r, base.max_batch);
        // Every block checkpointed: fits at its answer, not at the next batch.
        let eb = r
            .strategies
            .iter()
            .find(|s| s.name == "checkpoint-every-block")
            .unwrap();
        let ck = |b: u64| {
            let inf = infer(
                &model,
                &Bindings {
                    batch: Some(b),
                    ..Default::default()
                },
            )
            .unwrap();
            let s = build_schedule(&model, &inf, &o.train).unwrap();
            every_block(&from_schedule(&s, name)).unwrap().peak_bytes
        };
        // Selective blocks keep their matrix products: between the two.
        let sel = by("checkpoint-every-block-selective");
        assert!(
            sel >= base.max_batch && sel <= eb.max_batch,
            "{name}: {sel}"
        );
        assert_eq!(ck(eb.max_batch), eb.peak_bytes, "{name}");
        assert!(ck(eb.max_batch + 1) > mem, "{name}");
        if name == "cnn" {
            assert_eq!(eb.max_batch, base.max_batch, "no repeated blocks");
        } else {
            assert!(
                eb.max_batch > base.max_batch && eb.overhead > 0.0,
                "{name}: {eb:?}"
            );
        }
        assert!(
            by("zero-3") >= by("zero-2") && by("zero-2") >= by("zero-1"),
            "{name}"
        );
        // FSDP2 shards what ZeRO-3 shards; keeping the units gathered for backward
        // costs memory.
        assert!(
            by("fsdp2") >= by("fsdp2-no-reshard") && by("fsdp2") >= by("zero-1"),
            "{name}"
        );
        assert!(
            by("zero-1") >= base.max_batch && by("data-parallel") <= base.max_batch,
            "{name}"
        );
        let ga = r
            .strategies
            .iter()
            .find(|s| s.name == "grad-accumulation")
            .unwrap();
        let steps = ga.accumulation_steps.unwrap();
        assert!(
            ga.global_batch.unwrap() >= 512 && (512u64).div_ceil(steps) <= ga.max_batch,
            "{name}"
        );
    }
}

/// Planned checkpointing: at its max batch the reported plan replays within the
/// memory, the ILP's lowest-peak plan fits, and at the next batch it does not (nor
/// does greedy find a plan); it fits at least the as-exported batch. The ILP plans
/// get the time `fit` gives each lowest-peak plan.
fn check_planned(
    model: &memplan::ir::Model,
    name: &str,
    o: &FitOptions,
    r: &memplan::fit::FitReport,
    as_exported: u64,
) {
    let st = r
        .strategies
        .iter()
        .find(|s| s.name == "checkpointing-planned")
        .unwrap();
    let sqrt = r
        .strategies
        .iter()
        .find(|s| s.name == "checkpointing-sqrt")
        .unwrap();
    let mb = st.max_batch;
    assert!(mb > as_exported, "{name}: {mb} <= {as_exported}");
    assert!(st.peak_bytes <= o.memory, "{name}");
    assert!(st.overhead > 0.0, "{name}: {st:?}");
    if mb <= sqrt.max_batch {
        // Where √n segments also fit, the planner recomputes less than they do.
        assert!(st.overhead < sqrt.overhead, "{name}: {st:?} vs {sqrt:?}");
    }
    let lb = st.lower_bound_overhead.unwrap();
    assert!(lb >= 0.0 && lb <= st.overhead + 1e-9, "{name}: {st:?}");
    assert!(
        st.planner.is_some() && st.recomputed_tensors.unwrap() > 0,
        "{name}"
    );
    let inf = infer(
        model,
        &Bindings {
            batch: Some(mb),
            ..Default::default()
        },
    )
    .unwrap();
    let g = from_schedule(&build_schedule(model, &inf, &o.train).unwrap(), name);
    let lo = FitOptions {
        plan_time_limit_s: o.plan_time_limit_s.min(LOWEST_PEAK_TIME_LIMIT_S),
        ..o.clone()
    };
    // A plan at max_batch exists: the planner asked for the memory at max_batch
    // finds one (fit's own answer comes from lowest-peak plans made at other
    // batches, replayed here by fit; a fresh lowest-peak search aims at the op-local
    // bound, far below the memory, and its heuristic result need not be as low).
    let low = plan_step_under(model, o, mb, Solver::Ilp, None).unwrap();
    assert!(
        low.peak_bytes <= o.memory,
        "{name}: {} at {mb}",
        low.peak_bytes
    );
    assert_eq!(replay(&g, &low.plan).unwrap().peak_bytes, low.peak_bytes);
    // One more sample: neither the ILP's lowest peak nor greedy fits.
    let next = plan_step_under(model, &lo, mb + 1, Solver::Ilp, Some(0)).unwrap();
    assert!(
        next.peak_bytes > o.memory,
        "{name}: the ILP still fits at {}",
        mb + 1
    );
    assert!(
        !plan_step(model, o, mb + 1, Solver::Greedy)
            .unwrap()
            .feasible,
        "{name}"
    );
}

#[test]
fn planned_checkpointing_search() {
    // Few batches are planned, and the answers agree with plain scans near them.
    let model = load_model(&common::shipped("resnet18.onnx")).unwrap();
    let o = FitOptions {
        memory: 2 << 30,
        train: TrainOptions::default(),
        gpus: 1,
        target_batch: None,
        dims: Default::default(),
        plan_time_limit_s: 20.0,
        device: None,
        routing: None,
        cluster: None,
    };
    let r = fit(&model, "resnet18", &o).unwrap();
    let base = r.strategies[0].max_batch;
    let p = planned_max_batch(&model, &o, base).unwrap();
    let (mb, gmb) = (p.max_batch, p.greedy_max_batch);
    assert!(base < gmb && gmb <= mb, "{base} {gmb} {mb}");
    assert!(p.probes <= 8 && p.ilp_solves <= 10, "{p:?}");
    // Found on the step's affine graph, in a few lowest-peak plans.
    assert!(
        p.affine && p.ilp_solves <= 1 + memplan::fit::CONFIRM_ROUNDS,
        "{p:?}"
    );
    // Greedy fits up to its answer and not beyond.
    for b in gmb.saturating_sub(2)..=gmb {
        assert!(
            plan_step(&model, &o, b, Solver::Greedy).unwrap().feasible,
            "{b}"
        );
    }
    for b in gmb + 1..=gmb + 2 {
        assert!(
            !plan_step(&model, &o, b, Solver::Greedy).unwrap().feasible,
            "{b}"
        );
    }
    // The reported plan is one within the memory at the answer.
    assert!(p.report.feasible && p.report.peak_bytes <= o.memory);
    assert_eq!(p.report.budget_bytes, o.memory);
    // Starting from nothing known gives the same answer.
    let q = planned_max_batch(&model, &o, 0).unwrap();
    assert_eq!((q.max_batch, q.greedy_max_batch), (mb, gmb));
    // Too small for anything: 0, and the reported peak is the lowest reachable.
    let tiny = FitOptions {
        memory: 1 << 20,
        ..o.clone()
    };
    let p = planned_max_batch(&model, &tiny, 0).unwrap();
    assert_eq!((p.max_batch, p.greedy_max_batch), (0, 0));
    assert!(p.report.min_feasible_bytes > 1 << 20);
}

#[test]
fn memory_sizes_parse() {
    assert_eq!(parse_memory("16GiB").unwrap(), 16 << 30);
    assert_eq!(parse_memory("16G").unwrap(), 16 << 30);
    assert_eq!(parse_memory("80GB").unwrap(), 80_000_000_000);
    assert_eq!(parse_memory("1.5 TiB").unwrap(), 3 << 39);
    assert_eq!(parse_memory("512").unwrap(), 512);
    for bad in ["0", "0GiB", "-4GiB", "lots", "12 parsecs", "", "GiB"] {
        assert!(parse_memory(bad).is_err(), "{bad}");
    }
}

/// `memplan fit ARGS`: (success, stdout, stderr).
fn fit_cli(args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["fit"];
    all.extend_from_slice(args);
    common::run_memplan(&all)
}

fn fails(args: &[&str], needles: &[&str]) {
    let (ok, _, err) = fit_cli(args);
    assert!(!ok, "{args:?} should fail");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    for n in needles {
        assert!(err.contains(n), "'{n}' not in {err}");
    }
}

#[test]
fn bad_fit_input() {
    let cnn = common::shipped("cnn.onnx");
    let cnn = cnn.to_str().unwrap();
    fails(&[cnn, "--memory", "0"], &["--memory"]);
    fails(&[cnn, "--memory", "-1GiB"], &[]);
    fails(&[cnn, "--memory", "plenty"], &["--memory"]);
    fails(&[cnn, "--memory", "16GiB", "--gpus", "0"], &["--gpus"]);
    // Too small for batch 1: say what batch 1 needs.
    fails(
        &[cnn, "--memory", "1KiB", "--tensors-only"],
        &["cnn.onnx", "batch 1 needs"],
    );
    // On the device, the CUDA context alone does not fit.
    fails(&[cnn, "--memory", "300MiB"], &["--memory", "CUDA context"]);
    fails(&[cnn, "--gpu", "a1000"], &["--gpu", "unknown GPU", "h100"]);
    fails(
        &[
            cnn,
            "--memory",
            "1GiB",
            "--alloc-conf",
            "max_split_size_mb:4",
        ],
        &["--alloc-conf", "max_split_size_mb"],
    );
    fails(
        &[
            cnn,
            "--memory",
            "1GiB",
            "--allocator",
            "default",
            "--alloc-conf",
            "expandable_segments:True",
        ],
        &["--allocator", "contradicts"],
    );
    fails(&[cnn], &["--memory"]);
    // A model with a fixed batch.
    let dir = tempfile::tempdir().unwrap();
    let mut m = common::mlp();
    let g = m.graph.as_mut().unwrap();
    g.input[0] = common::value_info("x", 1, &[common::D::N(1), common::D::N(4)]);
    g.output.clear();
    g.output.push(common::value_info(
        "y",
        1,
        &[common::D::N(1), common::D::N(3)],
    ));
    let p = common::write_tmp(&dir, "fixed.onnx", &common::encode(&m));
    fails(
        &[p.to_str().unwrap(), "--memory", "1GiB"],
        &["fixed.onnx", "no batch dimension"],
    );
    let (ok, out, err) = fit_cli(&[cnn, "--memory", "64MiB", "--tensors-only", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["memory_bytes"], 64 << 20);
    assert!(v["strategies"][0]["max_batch"].as_u64().unwrap() > 0);
    assert!(v.get("device").is_none());
}

#[test]
fn op_without_backward_rule_is_named() {
    // A float Mod on the gradient path: PyTorch differentiates it, memplan has no rule.
    let dir = tempfile::tempdir().unwrap();
    let mut m = common::mlp();
    let g = m.graph.as_mut().unwrap();
    g.node.last_mut().unwrap().output[0] = "pre".into();
    let mut modn = common::node("Mod", "wrap_mod", &["pre", "b2"], &["y"]);
    modn = common::with_int(modn, "fmod", 1);
    g.node.push(modn);
    let p = common::write_tmp(&dir, "mod.onnx", &common::encode(&m));
    let path = p.to_str().unwrap();
    fails(
        &[path, "--memory", "1GiB"],
        &["mod.onnx", "wrap_mod", "Mod", "no backward rule"],
    );
    // Inference profiling of the same model is fine.
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(["profile", path, "--batch", "2"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(["profile", path, "--batch", "2", "--train"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn affine_step_max_fit_agrees_with_replay() {
    // A fixed plan's largest fitting batch, solved from its lines, is where the
    // replay on the schedule built at that batch fits and at the next does not.
    let model = load_model(&common::shipped("resnet18.onnx")).unwrap();
    let o = FitOptions {
        memory: 1 << 30,
        train: TrainOptions::default(),
        gpus: 1,
        target_batch: None,
        dims: Default::default(),
        plan_time_limit_s: 5.0,
        device: None,
        routing: None,
        cluster: None,
    };
    let g = |b: u64| {
        let b = Bindings {
            batch: Some(b),
            ..Default::default()
        };
        memplan::step::build(&model, &b, &o.train, "r18")
            .unwrap()
            .graph
    };
    let mut step = AffineStep::new(g(2), &g(3), 2).expect("same structure at 2 and 3");
    let plan = plan_step(&model, &o, 16, Solver::Greedy).unwrap().plan;
    let b = step.max_fit(&plan, o.memory);
    assert!(b >= 2, "{b}");
    let (at, next) = (g(b), g(b + 1));
    assert!(step.matches(&at, b) && step.matches(&next, b + 1));
    assert!(!step.matches(&next, b));
    let peak = |gr: &memplan::remat::graph::RematGraph| replay(gr, &plan).unwrap().peak_bytes;
    assert!(peak(&at) <= o.memory && peak(&next) > o.memory, "{b}");
    assert_eq!(peak(step.at(b)), peak(&at));
}

/// Where the default allocator fragments, the hint's flags keep the user's other
/// settings (spaces taken out), replace their `expandable_segments`, name
/// `--allocator expandable` where they named the allocator, and run.
#[test]
fn fragmentation_hint_keeps_the_users_alloc_conf() {
    let m = common::shipped("resnet18.onnx");
    let m = m.to_str().unwrap();
    let args = [m, "--memory", "2GiB", "--time-limit", "2"];
    // The flags the hint names, split as a shell would split the pasted line.
    let hint = |extra: &[&str]| -> Vec<String> {
        let (ok, out, err) = fit_cli(&[&args[..], extra].concat());
        assert!(ok, "{err}");
        let line = out
            .lines()
            .find(|l| l.contains("fit again with "))
            .unwrap_or_else(|| panic!("no hint in {out}"));
        let flags = line.split("fit again with ").nth(1).unwrap();
        let flags = flags.split(" for the batches").next().unwrap();
        flags.split_whitespace().map(String::from).collect()
    };
    let mine = "expandable_segments:False, garbage_collection_threshold : 0.8";
    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--alloc-conf", mine],
            &[
                "--alloc-conf",
                "garbage_collection_threshold:0.8,expandable_segments:True",
            ],
        ),
        (
            &["--allocator", "default", "--alloc-conf", mine],
            &[
                "--allocator",
                "expandable",
                "--alloc-conf",
                "garbage_collection_threshold:0.8",
            ],
        ),
    ];
    for (given, expected) in cases {
        let flags = hint(given);
        assert_eq!(flags, expected, "given {given:?}");
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let (ok, out, err) = fit_cli(&[&args[..], &flags].concat());
        assert!(ok, "{flags:?}: {err}");
        assert!(!out.contains("fit again with"), "{out}");
    }
}
