//! `memplan plan --costs FILE` (measured costs replace FLOPs), `plan --roofline`
//! (modelled seconds) and `plan --pareto` (the budget sweep), through the built binary
//! and the library.

mod common;

use std::path::{Path, PathBuf};

use memplan::infer::{infer, Bindings};
use memplan::onnx::load_model;
use memplan::remat::costs::{apply_costs, apply_roofline, parse_costs, Costs, Roofline};
use memplan::remat::dag::load_dag;
use memplan::remat::from_schedule::from_schedule;
use memplan::remat::graph::{replay, RematGraph};
use memplan::remat::pareto::{budgets, pareto};
use memplan::remat::plan::{plan, Solver};
use memplan::train::{build_schedule, TrainOptions};
use serde_json::Value;

fn fails(args: &[&str], needles: &[&str]) {
    let (ok, _, err) = common::run_memplan(args);
    assert!(!ok, "{args:?} should fail");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    for n in needles {
        assert!(err.contains(n), "'{n}' not in {err}");
    }
}

fn model_graph(name: &str, b: u64) -> RematGraph {
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
    from_schedule(&s, name)
}

fn bench_dag(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/remat-graphs")
        .join(name)
}

/// Node names of a model's graph, as plan.json (-o) lists them.
fn node_names(model: &str, batch: &str, dir: &Path) -> Vec<String> {
    let out = dir.join("names.json");
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        model,
        "--batch",
        batch,
        "--budget",
        "0.9",
        "--solver",
        "none",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(doc["cost_unit"], "flops");
    doc["graph"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap().to_string())
        .collect()
}

fn write_costs(dir: &Path, file: &str, costs: &[(String, f64)]) -> PathBuf {
    let map: serde_json::Map<String, Value> = costs
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::json!(v)))
        .collect();
    let p = dir.join(file);
    std::fs::write(&p, serde_json::to_vec(&map).unwrap()).unwrap();
    p
}

#[test]
fn measured_costs_replace_flops_and_change_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::shipped("resnet18.onnx");
    let model = model.to_str().unwrap();
    let names = node_names(model, "8", dir.path());
    let base = [
        "plan", model, "--batch", "8", "--budget", "0.92", "--solver", "greedy", "--json",
    ];
    let flops = common::memplan_json(&base);
    assert_eq!(flops["cost_unit"], "flops");
    assert!(flops["feasible"].as_bool().unwrap());
    let chosen: Vec<String> = serde_json::from_value(flops["recomputed"].clone()).unwrap();
    assert!(!chosen.is_empty());

    // Every node 1 s: the step costs one second per node, and the overhead counts
    // recomputations.
    let ones: Vec<(String, f64)> = names.iter().map(|n| (n.clone(), 1.0)).collect();
    let f = write_costs(dir.path(), "ones.json", &ones);
    let mut args = base.to_vec();
    args.extend(["--costs", f.to_str().unwrap()]);
    let secs = common::memplan_json(&args);
    assert_eq!(secs["cost_unit"], "seconds");
    assert_eq!(secs["baseline_flops"].as_f64().unwrap(), names.len() as f64);
    let rc = secs["recompute_flops"].as_f64().unwrap();
    assert!(rc >= 1.0 && rc.fract() == 0.0, "{rc}");
    assert!((secs["overhead"].as_f64().unwrap() - rc / names.len() as f64).abs() < 1e-12);

    // Make the nodes the FLOP plan recomputes very expensive and everything else
    // cheap: the planner must choose differently, and its cost is in those seconds.
    let g = model_graph("resnet18", 8);
    let by_flops = plan(
        &g,
        flops["budget_bytes"].as_u64().unwrap(),
        Solver::Greedy,
        10.0,
    )
    .unwrap();
    let mut count = vec![0u32; g.nodes.len()];
    for op in &by_flops.plan {
        if let memplan::remat::graph::Instr::Compute(i) = op {
            count[*i] += 1;
        }
    }
    let skewed: Vec<(String, f64)> = g
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.clone(), if count[i] > 1 { 5.0 } else { 1e-3 }))
        .collect();
    let f = write_costs(dir.path(), "skewed.json", &skewed);
    let mut args = base.to_vec();
    args.extend(["--costs", f.to_str().unwrap()]);
    let s = common::memplan_json(&args);
    assert!(s["feasible"].as_bool().unwrap());
    let chosen2: Vec<String> = serde_json::from_value(s["recomputed"].clone()).unwrap();
    assert_ne!(chosen, chosen2, "measured costs did not change the plan");
    // The library agrees: same graph, costs applied, same plan figures.
    let mut g2 = g.clone();
    apply_costs(&mut g2, &Costs(skewed.clone())).unwrap();
    let r2 = plan(&g2, by_flops.budget_bytes, Solver::Greedy, 10.0).unwrap();
    assert_eq!(r2.recompute_flops, s["recompute_flops"].as_f64().unwrap());
    assert_eq!(r2.baseline_flops, g2.base_cost());
    assert!(r2.recompute_flops < 5.0 * count.iter().filter(|&&c| c > 1).count() as f64);
    let check = replay(&g2, &r2.plan).unwrap();
    assert_eq!(check.recompute_cost, r2.recompute_flops);

    // The human report names the unit.
    let text: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
    let (ok, out, err) = common::run_memplan(&text);
    assert!(ok, "{err}");
    assert!(out.contains("(seconds)"), "{out}");

    // A benchmark DAG takes costs by its node names too.
    let dag = bench_dag("vgg16_train.json");
    let d = load_dag(&dag).unwrap();
    let costs: Vec<(String, f64)> = d.nodes.iter().map(|n| (n.name.clone(), 0.5)).collect();
    let f = write_costs(dir.path(), "dag.json", &costs);
    let v = common::memplan_json(&[
        "plan",
        "--dag",
        dag.to_str().unwrap(),
        "--budget",
        "0.9",
        "--solver",
        "greedy",
        "--costs",
        f.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(v["cost_unit"], "seconds");
    assert_eq!(
        v["baseline_flops"].as_f64().unwrap(),
        0.5 * d.nodes.len() as f64
    );
    let v = common::memplan_json(&[
        "plan",
        "--dag",
        dag.to_str().unwrap(),
        "--budget",
        "0.9",
        "--solver",
        "greedy",
        "--json",
    ]);
    assert_eq!(v["cost_unit"], "benchmark");
}

/// `--roofline FLOPS,BYTES`: each node costs the longer of its FLOPs at FLOPS per
/// second and of the bytes it reads and writes at BYTES per second.
#[test]
fn roofline_costs_are_the_longer_of_compute_and_memory_time() {
    let g = model_graph("resnet18", 8);
    let moved = |g: &RematGraph, i: usize| -> f64 {
        let n = &g.nodes[i];
        let mut v: Vec<usize> = n.inputs.iter().chain(&n.outputs).copied().collect();
        v.sort_unstable();
        v.dedup();
        v.iter().map(|&v| g.values[v].bytes).sum::<u64>() as f64
    };
    let rates = |f: f64, b: f64| Roofline {
        flops_per_second: f,
        bytes_per_second: b,
    };
    let r = rates(100e9, 20e9);
    let mut g2 = g.clone();
    apply_roofline(&mut g2, r);
    let is_view = |i: usize| g.nodes[i].outputs.is_empty() && g.nodes[i].cost == 0.0;
    let (mut compute_bound, mut memory_bound, mut views) = (0, 0, 0);
    for (i, (a, b)) in g.nodes.iter().zip(&g2.nodes).enumerate() {
        if is_view(i) {
            // a view (resnet18's Flatten): no kernel, no cost
            assert_eq!(b.cost, 0.0, "{}", a.name);
            views += 1;
            continue;
        }
        let (c, m) = (a.cost / 100e9, moved(&g, i) / 20e9);
        assert_eq!(b.cost, c.max(m), "{}", a.name);
        if c > m {
            compute_bound += 1;
        } else {
            memory_bound += 1;
        }
        if a.op == "Relu" || a.op == "Add" {
            assert_eq!(b.cost, m, "{}: an elementwise op is memory-bound", a.name);
        }
    }
    // resnet18 has both kinds: its convolutions are compute-bound at this balance.
    assert!(
        compute_bound > 10 && memory_bound > 10,
        "{compute_bound} / {memory_bound}"
    );
    assert!(views >= 1, "no view in resnet18's step");
    // One rate infinite: the other alone decides.
    let mut only_bytes = g.clone();
    apply_roofline(&mut only_bytes, rates(f64::MAX, 1.0));
    assert!((0..g.nodes.len())
        .filter(|&i| !is_view(i))
        .all(|i| only_bytes.nodes[i].cost == moved(&g, i)));

    // Through the CLI: modelled seconds, in the unit's own name, and the plan the
    // library makes on the modelled graph.
    let model = common::shipped("resnet18.onnx");
    let model = model.to_str().unwrap();
    let base = [
        "plan",
        model,
        "--batch",
        "8",
        "--budget",
        "0.9",
        "--solver",
        "greedy",
        "--json",
        "--roofline",
        "100G,20G",
    ];
    let v = common::memplan_json(&base);
    assert_eq!(v["cost_unit"], "roofline");
    assert!(v["feasible"].as_bool().unwrap());
    assert_eq!(v["baseline_flops"].as_f64().unwrap(), g2.base_cost());
    let lib = plan(
        &g2,
        v["budget_bytes"].as_u64().unwrap(),
        Solver::Greedy,
        10.0,
    )
    .unwrap();
    assert_eq!(lib.recompute_flops, v["recompute_flops"].as_f64().unwrap());
    let text: Vec<&str> = base.iter().copied().filter(|a| *a != "--json").collect();
    let (ok, out, err) = common::run_memplan(&text);
    assert!(ok, "{err}");
    assert!(out.contains("(roofline)"), "{out}");

    // Bad rates and conflicting cost sources: one line each.
    let with = |rates: &str| -> Vec<String> {
        [
            "plan",
            model,
            "--batch",
            "8",
            "--budget",
            "0.9",
            "--roofline",
            rates,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    for (rates, needle) in [
        ("94G", "FLOPS,BYTES"),
        ("0,17G", "at least 1"),
        ("94G,17X", "unknown prefix"),
        ("94G,fast", "rate per second"),
    ] {
        let args = with(rates);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&args, &[needle]);
    }
    let dag = bench_dag("vgg16_train.json");
    fails(
        &[
            "plan",
            "--dag",
            dag.to_str().unwrap(),
            "--budget",
            "0.9",
            "--roofline",
            "1G,1G",
        ],
        &["--roofline"],
    );
}

#[test]
fn bad_costs_files_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cnn = common::shipped("cnn.onnx");
    let cnn = cnn.to_str().unwrap();
    let names = node_names(cnn, "2", dir.path());
    let all: Vec<(String, f64)> = names.iter().map(|n| (n.clone(), 1e-3)).collect();
    let with = |file: &Path| -> Vec<String> {
        [
            "plan", cnn, "--batch", "2", "--budget", "0.8", "--solver", "greedy", "--costs",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([file.to_str().unwrap().to_string()])
        .collect()
    };
    let check = |file: &Path, needles: &[&str]| {
        let args = with(file);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut n = needles.to_vec();
        let fname = file.file_name().unwrap().to_str().unwrap();
        n.push(fname);
        fails(&args, &n);
    };
    // A typo'd name: named, with how many.
    let mut typo = all.clone();
    typo.push(("/conv9/Conv".into(), 1.0));
    check(
        &write_costs(dir.path(), "typo.json", &typo),
        &["1 name matches no node", "'/conv9/Conv'"],
    );
    // Missing nodes: count and the first few names.
    let missing = &all[3..];
    check(
        &write_costs(dir.path(), "missing.json", missing),
        &["3 nodes of", "have no cost", &format!("'{}'", names[0])],
    );
    // Both at once, still one line.
    let mut both = missing.to_vec();
    both.push(("nope".into(), 1.0));
    check(
        &write_costs(dir.path(), "both.json", &both),
        &["'nope'", "3 nodes of"],
    );
    let mut neg = all.clone();
    neg[1].1 = -0.5;
    check(
        &write_costs(dir.path(), "neg.json", &neg),
        &[&names[1], "from 0 to"],
    );
    let zero: Vec<(String, f64)> = names.iter().map(|n| (n.clone(), 0.0)).collect();
    check(
        &write_costs(dir.path(), "zero.json", &zero),
        &["every cost is 0"],
    );
    let p = dir.path().join("string.json");
    std::fs::write(&p, format!("{{\"{}\": \"fast\"}}", names[0])).unwrap();
    check(&p, &["expected a number of seconds"]);
    let p = dir.path().join("twice.json");
    std::fs::write(&p, format!("{{\"{0}\": 1.0, \"{0}\": 2.0}}", names[0])).unwrap();
    check(&p, &["given twice"]);
    let p = dir.path().join("list.json");
    std::fs::write(&p, "[1, 2, 3]").unwrap();
    check(&p, &["JSON object"]);
    let p = dir.path().join("nan.json");
    std::fs::write(&p, "{\"x\": NaN}").unwrap();
    check(&p, &["JSON object"]);
    check(&dir.path().join("absent.json"), &["cannot read"]);

    // The parser on its own.
    assert!(parse_costs("{\"a\": 1e400}").is_err());
    assert_eq!(
        parse_costs("{\"a\": 1, \"b\": 0.25}").unwrap(),
        Costs(vec![("a".into(), 1.0), ("b".into(), 0.25)])
    );
    // Nothing is changed by a failed apply.
    let mut g = model_graph("cnn", 2);
    let before: Vec<f64> = g.nodes.iter().map(|n| n.cost).collect();
    assert!(apply_costs(&mut g, &Costs(missing.to_vec())).is_err());
    assert_eq!(before, g.nodes.iter().map(|n| n.cost).collect::<Vec<_>>());
}

/// The curve's invariants: budgets decrease from the no-recompute peak, feasible
/// points fit, overhead and its bound never decrease, only the last point may be
/// infeasible.
fn check_curve(points: &[Value], baseline: Option<u64>, what: &str) {
    assert!(!points.is_empty(), "{what}");
    if let Some(b) = baseline {
        assert_eq!(points[0]["budget_bytes"].as_u64().unwrap(), b, "{what}");
    }
    assert_eq!(
        points[0]["budget_fraction"].as_f64().unwrap(),
        1.0,
        "{what}"
    );
    let mut prev: Option<&Value> = None;
    for (i, p) in points.iter().enumerate() {
        let budget = p["budget_bytes"].as_u64().unwrap();
        let feasible = p["feasible"].as_bool().unwrap();
        if feasible {
            assert!(p["peak_bytes"].as_u64().unwrap() <= budget, "{what} {p}");
        } else {
            assert_eq!(
                i,
                points.len() - 1,
                "{what}: the sweep goes on after an infeasible point"
            );
        }
        assert!(
            p["lower_bound_overhead"].as_f64().unwrap() <= p["overhead"].as_f64().unwrap() + 1e-9
                || !feasible,
            "{what} {p}"
        );
        if let Some(q) = prev {
            assert!(budget < q["budget_bytes"].as_u64().unwrap(), "{what}");
            if feasible {
                assert!(
                    p["overhead"].as_f64().unwrap() >= q["overhead"].as_f64().unwrap(),
                    "{what}: overhead fell as the budget fell: {q} then {p}"
                );
            }
            assert!(
                p["lower_bound_overhead"].as_f64().unwrap()
                    >= q["lower_bound_overhead"].as_f64().unwrap(),
                "{what}"
            );
        }
        prev = Some(p);
    }
}

#[test]
fn pareto_curve_is_monotone_and_fits() {
    let resnet = common::shipped("resnet18.onnx");
    let resnet = resnet.to_str().unwrap();
    // Greedy on a model, every point replanned.
    let v = common::memplan_json(&[
        "plan", "--pareto", resnet, "--batch", "8", "--solver", "greedy", "--json",
    ]);
    let pts = v.as_array().unwrap();
    assert!(pts.len() >= 8, "{v}");
    check_curve(pts, None, "resnet18 greedy");
    assert!(pts.iter().all(|p| p["cost_unit"] == "flops"));
    assert!(pts.last().unwrap()["overhead"].as_f64().unwrap() > 0.0);
    // The library's curve: each plan replays to its peak, and the sweep ends at the
    // lowest reachable peak.
    let g = model_graph("resnet18", 8);
    let c = pareto(&g, Solver::Greedy, 10.0, 11, None).unwrap();
    let base = replay(&g, &g.no_recompute_plan()).unwrap().peak_bytes;
    assert_eq!(c.baseline_peak_bytes, base);
    assert!(c.min_feasible_bytes < base && c.min_feasible_bytes >= g.op_local_bound());
    for p in &c.points {
        let r = replay(&g, &p.plan).unwrap();
        assert_eq!(r.peak_bytes, p.peak_bytes);
        assert_eq!(r.recompute_cost, p.recompute_cost);
    }
    let last = c.points.last().unwrap();
    assert!(!last.feasible || last.budget_bytes == c.min_feasible_bytes);
    let json: Vec<Value> = c
        .points
        .iter()
        .map(|p| serde_json::to_value(p).unwrap())
        .collect();
    check_curve(&json, Some(base), "resnet18 library");

    // The default solver (ilp) on a benchmark DAG, and on a small model.
    let dag = bench_dag("vgg16_train.json");
    let v = common::memplan_json(&[
        "plan",
        "--pareto",
        "--dag",
        dag.to_str().unwrap(),
        "--time-limit",
        "5",
        "--json",
    ]);
    check_curve(v.as_array().unwrap(), None, "vgg16 ilp");
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["cost_unit"] == "benchmark"));
    let cnn = common::shipped("cnn.onnx");
    let v = common::memplan_json(&[
        "plan",
        "--pareto",
        cnn.to_str().unwrap(),
        "--batch",
        "4",
        "--time-limit",
        "5",
        "--json",
    ]);
    check_curve(v.as_array().unwrap(), None, "cnn ilp");

    // `none` reaches nothing below the baseline: the curve is one point; asked to go
    // lower, the first lower budget is infeasible and ends the sweep.
    let v = common::memplan_json(&[
        "plan", "--pareto", resnet, "--batch", "8", "--solver", "none", "--json",
    ]);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    let v = common::memplan_json(&[
        "plan", "--pareto", resnet, "--batch", "8", "--solver", "none", "--budget", "0.5", "--json",
    ]);
    let pts = v.as_array().unwrap();
    assert_eq!(pts.len(), 2, "{v}");
    assert!(pts[0]["feasible"].as_bool().unwrap() && !pts[1]["feasible"].as_bool().unwrap());
    check_curve(pts, None, "none");

    // --budget sets the low end; the table names the unit.
    let v = common::memplan_json(&[
        "plan", "--pareto", resnet, "--batch", "8", "--budget", "0.95", "--solver", "greedy",
        "--json",
    ]);
    let pts = v.as_array().unwrap();
    check_curve(pts, None, "to 0.95");
    let last = pts.last().unwrap();
    let f = last["budget_fraction"].as_f64().unwrap();
    assert!((f - 0.95).abs() < 1e-6 && last["feasible"] == true, "{v}");
    let (ok, out, err) = common::run_memplan(&[
        "plan", "--pareto", resnet, "--batch", "8", "--solver", "greedy",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("overhead") && out.contains("(flops)"), "{out}");
    fails(
        &["plan", "--pareto", resnet, "--batch", "8", "-o", "x.json"],
        &["--pareto", "--output"],
    );
    fails(&["plan", resnet, "--batch", "8"], &["--budget"]);
}

#[test]
fn sweep_budgets() {
    assert_eq!(budgets(100, 50, 6), vec![100, 90, 80, 70, 60, 50]);
    assert_eq!(budgets(100, 100, 11), vec![100]);
    assert_eq!(budgets(10, 7, 11), vec![10, 9, 8, 7]);
    assert_eq!(budgets(100, 200, 3), vec![100]);
}

/// A budget no plan meets: the lowest-peak plan is still printed (`"feasible":
/// false`), then one line on stderr, and the exit status fails, so that a script
/// does not go on to train over budget. `--solver none` and `sqrt` (one schedule
/// each, whatever the budget) are exempt. A percentage budget is the same share as
/// a fraction.
#[test]
fn an_unmet_budget_fails_after_the_report() {
    let cnn = common::shipped("cnn.onnx");
    let cnn = cnn.to_str().unwrap();
    let (ok, out, err) = common::run_memplan(&[
        "plan", cnn, "--batch", "2", "--budget", "1B", "--solver", "greedy", "--json",
    ]);
    assert!(!ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["feasible"], false);
    assert!(err.contains("no plan fits the budget of 1 B"), "{err}");
    assert!(err.contains("the lowest peak found is"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    for solver in ["none", "sqrt"] {
        let (ok, _, err) = common::run_memplan(&[
            "plan", cnn, "--batch", "2", "--budget", "1B", "--solver", solver, "--json",
        ]);
        assert!(ok, "{solver}: {err}");
    }
    let share = |b: &str| {
        common::memplan_json(&[
            "plan", cnn, "--batch", "2", "--budget", b, "--solver", "none", "--json",
        ])["budget_bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(share("80%"), share("0.8"));
    assert!(share("80%") < share("90%"));
    fails(
        &["plan", cnn, "--batch", "2", "--budget", "120%"],
        &["--budget", "percentage"],
    );
}
