//! Recompute plans: the training schedule as a rematerialization graph keeps the
//! memory model of `profile --train`; every plan replays (inputs live at each
//! compute) and the baselines' plans fit the budgets they claim to fit.

mod common;

use std::path::PathBuf;

use memplan::infer::{infer, Bindings};
use memplan::memory::simulate;
use memplan::onnx::load_model;
use memplan::remat::dag::load_dag;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::graph::{replay, RematGraph};
use memplan::remat::plan::{plan, Solver};
use memplan::train::{build_schedule, TrainOptions};

fn model_graph(name: &str, b: u64) -> (RematGraph, u64) {
    let model = load_model(&common::shipped(&format!("{name}.onnx"))).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(b),
            ..Default::default()
        },
    )
    .unwrap();
    let s = build_schedule(&model, &inf, &TrainOptions::default()).unwrap();
    let peak = simulate(&s).peak().total();
    (from_schedule(&s, name), peak)
}

fn bench_dags() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/remat-graphs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

#[test]
fn schedule_graph_keeps_the_training_memory_model() {
    for name in [
        "mlp",
        "cnn",
        "transformer",
        "resnet18",
        "mobilenet_v2",
        "vit_b_16",
        "bert_base",
        "gpt2",
    ] {
        let (g, peak) = model_graph(name, 2);
        let r = replay(&g, &g.no_recompute_plan()).unwrap();
        assert_eq!(r.peak_bytes, peak, "{name}");
        assert_eq!(r.recompute_cost, 0.0);
        assert!(g.op_local_bound() <= peak, "{name}");
    }
}

#[test]
fn shared_benchmark_graphs_load() {
    let dags = bench_dags();
    assert!(dags.len() >= 11, "{dags:?}");
    for p in &dags {
        let g = load_dag(p).unwrap();
        assert!(g.nodes.len() >= 45, "{p:?}");
        let r = replay(&g, &g.no_recompute_plan()).unwrap();
        assert!(r.peak_bytes >= g.op_local_bound(), "{p:?}");
    }
    let vgg = load_dag(
        &dags
            .iter()
            .find(|p| p.ends_with("vgg16_train.json"))
            .unwrap()
            .clone(),
    )
    .unwrap();
    assert_eq!(
        (
            vgg.nodes.len(),
            vgg.nodes.iter().map(|n| n.inputs.len()).sum::<usize>()
        ),
        (45, 87)
    );
}

#[test]
fn baselines_replay_and_fit_what_they_claim() {
    let mut graphs: Vec<RematGraph> = bench_dags().iter().map(|p| load_dag(p).unwrap()).collect();
    graphs.push(model_graph("resnet18", 8).0);
    graphs.push(model_graph("transformer", 8).0);
    for g in &graphs {
        let base = replay(g, &g.no_recompute_plan()).unwrap().peak_bytes;
        for frac in [0.9, 0.7, 0.5] {
            let budget = (base as f64 * frac) as u64;
            for solver in [Solver::None, Solver::Sqrt, Solver::Greedy] {
                let r = plan(g, budget, solver, 10.0).unwrap();
                // The plan replays, and the report is the replay's.
                let check = replay(g, &r.plan).unwrap();
                assert_eq!(check.peak_bytes, r.peak_bytes, "{} {solver:?}", g.name);
                assert_eq!(r.feasible, r.peak_bytes <= budget);
                assert!(r.overhead >= 0.0, "{} {solver:?} {}", g.name, r.overhead);
                if solver == Solver::None {
                    assert_eq!(r.overhead, 0.0);
                }
                assert!(r.min_feasible_bytes >= g.op_local_bound());
                if solver == Solver::Greedy && r.min_feasible_bytes <= budget {
                    assert!(
                        r.feasible,
                        "{} at {frac}: greedy failed though {} is reachable",
                        g.name, r.min_feasible_bytes
                    );
                }
            }
        }
    }
}

#[test]
fn impossible_budget_is_reported_not_an_error() {
    let (g, _) = model_graph("cnn", 4);
    let r = plan(&g, 1, Solver::Greedy, 10.0).unwrap();
    assert!(!r.feasible);
    assert!(r.peak_bytes >= r.min_feasible_bytes && r.min_feasible_bytes >= r.op_local_bound_bytes);
}
