//! Checkmate's MILP (src/remat/checkmate.rs) on hand-built graphs and on a published
//! benchmark graph. Every returned plan is checked with `replay`, never with the
//! solver's own accounting.

use std::path::Path;
use std::time::Duration;

use memplan::remat::checkmate::{solve_checkmate, IlpOptions, IlpResult, IlpStatus};
use memplan::remat::graph::{replay, RNode, RValue, RematGraph};

const MB: u64 = 1 << 20;

fn opts(secs: u64, lp_bound: bool) -> IlpOptions {
    IlpOptions {
        time_limit: Duration::from_secs(secs),
        lp_bound,
    }
}

fn value(name: String, bytes: u64, producer: Option<usize>) -> RValue {
    RValue {
        name,
        bytes,
        producer,
        fixed: producer.is_none(),
        held: false,
    }
}

fn node(name: String, cost: f64, inputs: Vec<usize>, outputs: Vec<usize>, backward: bool) -> RNode {
    RNode {
        name,
        cost,
        inputs,
        outputs,
        backward,
        recomputable: true,
        op: String::new(),
    }
}

/// Checkmate's linear graph: `n` forward nodes in a chain, then `n` backward nodes
/// in reverse; backward node `i` reads forward output `i` and the previous
/// backward output. Node `k` writes value `k`; all sizes and costs equal.
fn chain(n: usize) -> RematGraph {
    let mut g = RematGraph {
        name: format!("chain{n}"),
        nodes: Vec::new(),
        values: Vec::new(),
    };
    for i in 0..n {
        let inputs = if i == 0 { vec![] } else { vec![i - 1] };
        g.values.push(value(format!("f{i}"), MB, Some(i)));
        g.nodes
            .push(node(format!("f{i}"), 1.0, inputs, vec![i], false));
    }
    for (b, i) in (0..n).rev().enumerate() {
        let k = n + b;
        let mut inputs = vec![i];
        if b > 0 {
            inputs.push(k - 1);
        }
        g.values.push(value(format!("b{i}"), MB, Some(k)));
        g.nodes
            .push(node(format!("b{i}"), 1.0, inputs, vec![k], true));
    }
    g
}

fn peak(g: &RematGraph) -> u64 {
    replay(g, &g.no_recompute_plan()).unwrap().peak_bytes
}

/// What must hold of any result: a plan replays within the budget and costs what
/// the result says; the bounds are below the objective; "optimal" means proven.
fn check(g: &RematGraph, budget: u64, r: &IlpResult) {
    match r.status {
        IlpStatus::Optimal | IlpStatus::Feasible => {
            let plan = r.plan.as_ref().expect("a plan");
            let rep = replay(g, plan).expect("the plan replays");
            assert!(
                rep.peak_bytes <= budget,
                "peak {} > budget {budget}",
                rep.peak_bytes
            );
            let obj = r.objective.expect("an objective");
            assert!((rep.cost - obj).abs() <= 1e-9 * obj.abs().max(1.0));
            assert!(obj >= g.base_cost() - 1e-9);
            let lb = r.lower_bound.expect("a lower bound");
            assert!(lb <= obj + 1e-9, "bound {lb} above objective {obj}");
            if r.status == IlpStatus::Optimal {
                assert!(
                    (lb - obj).abs() <= 1e-6 * obj.abs().max(1.0),
                    "optimal but bound {lb} < {obj}"
                );
            }
            if let Some(lp) = r.lp_lower_bound {
                assert!(
                    lp <= obj + 1e-6 * obj.abs().max(1.0),
                    "LP bound {lp} above objective {obj}"
                );
            }
        }
        IlpStatus::Infeasible | IlpStatus::NoSolution => {
            assert!(r.plan.is_none() && r.objective.is_none());
        }
    }
}

#[test]
fn no_recomputation_at_the_no_recompute_peak() {
    let g = chain(8);
    let budget = peak(&g);
    let r = solve_checkmate(&g, budget, &opts(30, true)).unwrap();
    check(&g, budget, &r);
    assert_eq!(r.status, IlpStatus::Optimal);
    assert_eq!(r.objective, Some(g.base_cost()));
    assert_eq!(r.lp_lower_bound, Some(g.base_cost()));
}

#[test]
fn tighter_budgets_recompute_within_the_budget() {
    let g = chain(8);
    let (lo, hi) = (g.op_local_bound(), peak(&g));
    assert!(lo < hi);
    let mut last = g.base_cost();
    // From just below the no-recompute peak down to the op-local bound.
    for budget in (lo..hi).rev().step_by(MB as usize) {
        let r = solve_checkmate(&g, budget, &opts(60, true)).unwrap();
        check(&g, budget, &r);
        assert_eq!(
            r.status,
            IlpStatus::Optimal,
            "budget {budget}: {}",
            r.solver_status
        );
        let obj = r.objective.unwrap();
        assert!(
            obj > g.base_cost(),
            "budget {budget}: no recomputation below the peak"
        );
        assert!(obj >= last - 1e-9, "less memory cannot cost less");
        let lp = r.lp_lower_bound.expect("LP bound");
        assert!(lp <= obj + 1e-9 && lp >= g.base_cost() - 1e-9);
        last = obj;
    }
}

#[test]
fn one_byte_below_the_peak_already_needs_a_recomputation() {
    let g = chain(10);
    let budget = peak(&g) - 1;
    let r = solve_checkmate(&g, budget, &opts(60, false)).unwrap();
    check(&g, budget, &r);
    assert_eq!(r.status, IlpStatus::Optimal);
    assert!(r.objective.unwrap() > g.base_cost());
    assert!(r.lp_lower_bound.is_none());
}

#[test]
fn below_the_op_local_bound_is_infeasible() {
    let g = chain(8);
    let r = solve_checkmate(&g, g.op_local_bound() - 1, &opts(30, true)).unwrap();
    assert_eq!(r.status, IlpStatus::Infeasible);
    assert!(r.plan.is_none() && r.objective.is_none());
}

#[test]
fn the_solver_proves_infeasibility_when_nothing_may_be_recomputed() {
    // Above the op-local bound, but with forward nodes that may not run twice
    // every node runs once in order, so the no-recompute peak is the minimum.
    let mut g = chain(8);
    for n in &mut g.nodes {
        n.recomputable = false;
    }
    let budget = peak(&g) - 1;
    assert!(budget >= g.op_local_bound());
    let r = solve_checkmate(&g, budget, &opts(30, false)).unwrap();
    assert_eq!(r.status, IlpStatus::Infeasible, "{}", r.solver_status);
    assert!(r.solver_status.starts_with("CBC"), "{}", r.solver_status);
}

/// A chain with the parts a training graph has: fixed parameters read by every
/// node, a held gradient written by each backward node, and forward nodes with
/// two outputs (one read by the next node, one saved for backward only).
fn training_like(n: usize) -> RematGraph {
    let mut g = RematGraph {
        name: format!("train{n}"),
        nodes: Vec::new(),
        values: Vec::new(),
    };
    let w = g.values.len();
    g.values.push(value("weights".into(), 3 * MB, None));
    let mut act = vec![0; n];
    let mut saved = vec![0; n];
    for i in 0..n {
        let k = g.nodes.len();
        act[i] = g.values.len();
        g.values.push(value(format!("a{i}"), MB, Some(k)));
        saved[i] = g.values.len();
        g.values.push(value(format!("s{i}"), MB / 2, Some(k)));
        let mut inputs = vec![w];
        if i > 0 {
            inputs.push(act[i - 1]);
        }
        g.nodes.push(node(
            format!("f{i}"),
            1.0 + i as f64,
            inputs,
            vec![act[i], saved[i]],
            false,
        ));
    }
    let mut grad = act[n - 1];
    for i in (0..n).rev() {
        let k = g.nodes.len();
        let gi = g.values.len();
        g.values.push(value(format!("g{i}"), MB, Some(k)));
        let gw = g.values.len();
        g.values.push(RValue {
            held: true,
            ..value(format!("dw{i}"), MB / 4, Some(k))
        });
        g.nodes.push(node(
            format!("b{i}"),
            2.0,
            vec![w, saved[i], grad],
            vec![gi, gw],
            true,
        ));
        grad = gi;
    }
    g
}

#[test]
fn fixed_held_and_multi_output_values() {
    let g = training_like(8);
    let (lo, hi) = (g.op_local_bound(), peak(&g));
    let r = solve_checkmate(&g, hi, &opts(30, false)).unwrap();
    check(&g, hi, &r);
    assert_eq!(r.objective, Some(g.base_cost()));
    // Down from the peak in quarter-MB steps: optimal plans that cost more as the
    // budget shrinks, then (held gradients pile up) infeasible all the way down.
    let (mut last, mut optimal, mut infeasible) = (g.base_cost(), 0, false);
    let mut budget = hi - MB / 4;
    while budget >= lo {
        let r = solve_checkmate(&g, budget, &opts(60, true)).unwrap();
        check(&g, budget, &r);
        match r.status {
            IlpStatus::Optimal => {
                assert!(
                    !infeasible,
                    "budget {budget}: feasible below an infeasible budget"
                );
                let obj = r.objective.unwrap();
                assert!(obj > g.base_cost() && obj >= last - 1e-9);
                last = obj;
                optimal += 1;
            }
            IlpStatus::Infeasible => infeasible = true,
            s => panic!("budget {budget}: {s:?} ({})", r.solver_status),
        }
        budget -= MB / 4;
    }
    assert!(
        optimal >= 3 && infeasible,
        "{optimal} optimal budgets, infeasible: {infeasible}"
    );
}

#[test]
fn a_time_limit_never_reports_an_unproven_optimum() {
    let g = chain(30);
    let budget = g.op_local_bound() + 2 * MB;
    let r = solve_checkmate(&g, budget, &opts(0, true)).unwrap();
    check(&g, budget, &r);
    if r.status == IlpStatus::Optimal {
        assert!(
            r.solver_status.contains("proven optimal true"),
            "{}",
            r.solver_status
        );
    }
}

/// Reads a Checkmate `*_train.json` (networkx node-link: `nodes` with `id`,
/// `cost_cpu`, `cost_ram`; `links` with `source`, `target`; ids topological):
/// one node per graph node, writing one value of `cost_ram` bytes.
fn load_checkmate(path: &Path) -> RematGraph {
    let text = std::fs::read_to_string(path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let nodes = v["nodes"].as_array().unwrap();
    let mut g = RematGraph {
        name: path.display().to_string(),
        nodes: Vec::new(),
        values: Vec::new(),
    };
    let mut sorted: Vec<&serde_json::Value> = nodes.iter().collect();
    sorted.sort_by_key(|n| n["id"].as_u64().unwrap());
    for (i, n) in sorted.iter().enumerate() {
        assert_eq!(n["id"].as_u64(), Some(i as u64));
        let name = n["name"].as_str().unwrap_or("").to_string();
        g.values.push(value(
            name.clone(),
            n["cost_ram"].as_f64().unwrap() as u64,
            Some(i),
        ));
        let backward = n["backward"].as_bool().unwrap_or(false);
        g.nodes.push(node(
            name,
            n["cost_cpu"].as_f64().unwrap(),
            vec![],
            vec![i],
            backward,
        ));
    }
    for l in v["links"].as_array().unwrap() {
        let (s, t) = (
            l["source"].as_u64().unwrap() as usize,
            l["target"].as_u64().unwrap() as usize,
        );
        assert!(s < t);
        if !g.nodes[t].inputs.contains(&s) {
            g.nodes[t].inputs.push(s);
        }
    }
    g
}

#[test]
fn vgg16_at_90_percent_matches_the_published_optimum() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/remat-graphs/vgg16_train.json");
    if !path.exists() {
        eprintln!("skipped: {} not found", path.display());
        return;
    }
    let g = load_checkmate(&path);
    assert_eq!(g.nodes.len(), 45);
    let budget = (peak(&g) as f64 * 0.9) as u64;
    let r = solve_checkmate(&g, budget, &opts(60, true)).unwrap();
    check(&g, budget, &r);
    let overhead = r.objective.unwrap() / g.base_cost();
    let lp = r.lp_lower_bound.map(|b| b / g.base_cost());
    eprintln!(
        "vgg16 90%: {:?}, overhead {overhead:.4}, LP {lp:?}, {:.2} s, {}",
        r.status, r.seconds, r.solver_status
    );
    assert!(matches!(r.status, IlpStatus::Optimal | IlpStatus::Feasible));
    // README: Checkmate MILP 1.0197 (optimal), LP bound 1.0076.
    assert!(
        (overhead - 1.0197).abs() <= 0.005 * 1.0197,
        "overhead {overhead}"
    );
}
