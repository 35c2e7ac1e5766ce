//! The default planner (`--solver ilp`, src/remat/portfolio.rs) against the exact
//! Checkmate MILP, the baselines and its own lower bounds, on the published
//! benchmark graphs and on shipped models. Every plan is checked with `replay`.

mod common;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use memplan::remat::bounds::{memory_floor, stage_lower_bound};
use memplan::remat::checkmate::{solve_checkmate, IlpOptions, IlpStatus};
use memplan::remat::dag::load_dag;
use memplan::remat::graph::{replay, RematGraph};
use memplan::remat::plan::{plan, PlanReport, Solver};

/// CBC is not re-entrant (one solve at a time per process): the tests take turns,
/// so that one test's time limit is not spent waiting for another's solve.
static CBC: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    CBC.lock().unwrap_or_else(|e| e.into_inner())
}

fn dag(name: &str) -> RematGraph {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/remat-graphs")
        .join(name);
    load_dag(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn base_peak(g: &RematGraph) -> u64 {
    replay(g, &g.no_recompute_plan()).unwrap().peak_bytes
}

/// Plans and checks the report against an independent replay.
fn checked(g: &RematGraph, budget: u64, s: Solver, secs: f64) -> PlanReport {
    let r = plan(g, budget, s, secs).unwrap();
    let rep = replay(g, &r.plan).unwrap_or_else(|e| panic!("{} {s:?}: {e}", g.name));
    assert_eq!(rep.peak_bytes, r.peak_bytes, "{} {s:?}", g.name);
    assert_eq!(r.feasible, rep.peak_bytes <= budget, "{} {s:?}", g.name);
    assert!(r.min_feasible_bytes <= r.peak_bytes);
    assert!(
        r.min_feasible_bytes >= r.op_local_bound_bytes.max(r.proven_floor_bytes),
        "{} {s:?}: a plan below the op-local bound or a proven floor",
        g.name
    );
    if r.feasible {
        assert!(
            r.lower_bound_overhead <= r.overhead + 1e-12,
            "{} {s:?}: bound {} above the plan's overhead {}",
            g.name,
            r.lower_bound_overhead,
            r.overhead
        );
    }
    r
}

#[test]
fn ilp_equals_the_checkmate_optimum_on_vgg16() {
    let _cbc = serial();
    let g = dag("vgg16_train.json");
    let base = base_peak(&g);
    for f in [0.95, 0.9, 0.85] {
        let budget = (base as f64 * f) as u64;
        let exact = solve_checkmate(
            &g,
            budget,
            &IlpOptions {
                time_limit: Duration::from_secs(60),
                lp_bound: false,
            },
        )
        .unwrap();
        assert_eq!(exact.status, IlpStatus::Optimal, "checkmate at {f}");
        let opt = exact.objective.unwrap() / g.base_cost() - 1.0;
        let r = checked(&g, budget, Solver::Ilp, 30.0);
        assert!(r.feasible, "ilp at {f}");
        assert!(
            (1.0 + r.overhead) <= (1.0 + opt) * 1.005,
            "ilp {} vs checkmate {} at {f}",
            r.overhead,
            opt
        );
        // The stage bound is a bound on Checkmate's optimum.
        let lb = stage_lower_bound(&g, budget).unwrap() / g.base_cost();
        assert!(lb <= opt + 1e-9, "stage bound {lb} above the optimum {opt}");
        assert!(lb > 0.0, "the bound is not trivial at {f}");
    }
}

#[test]
fn ilp_beats_or_ties_the_baselines_on_the_benchmark_graphs() {
    let _cbc = serial();
    for name in [
        "segnet_train.json",
        "mobilenet_train.json",
        "resnet50_train.json",
        "random_layered_n100.json",
    ] {
        let g = dag(name);
        let base = base_peak(&g);
        for f in [0.9, 0.7, 0.5] {
            let budget = (base as f64 * f) as u64;
            let ilp = checked(&g, budget, Solver::Ilp, 4.0);
            for s in [Solver::Greedy, Solver::Sqrt] {
                let b = checked(&g, budget, s, 4.0);
                if b.feasible {
                    assert!(ilp.feasible, "{name} {f}: {s:?} fits and ilp does not");
                    assert!(
                        ilp.overhead <= b.overhead + 1e-12,
                        "{name} {f}: ilp {} > {s:?} {}",
                        ilp.overhead,
                        b.overhead
                    );
                }
            }
        }
    }
}

#[test]
fn resnet50_at_80_percent_gets_a_plan_with_a_small_proven_gap() {
    let _cbc = serial();
    // The shared README: Checkmate's MILP found no schedule in 1 206 s here.
    let g = dag("resnet50_train.json");
    let budget = (base_peak(&g) as f64 * 0.8) as u64;
    let r = checked(&g, budget, Solver::Ilp, 10.0);
    assert!(r.feasible);
    assert!(r.lower_bound_overhead > 0.0);
    assert!(
        r.overhead - r.lower_bound_overhead < 0.001,
        "gap {} - {}",
        r.overhead,
        r.lower_bound_overhead
    );
}

#[test]
fn lowest_peak_is_near_the_op_local_bound_where_that_is_reachable() {
    let _cbc = serial();
    for name in [
        "vgg16_train.json",
        "vgg19_train.json",
        "fcn8_vgg_train.json",
        "segnet_train.json",
        "vgg_unet_train.json",
    ] {
        let g = dag(name);
        // A budget nothing meets: the report says so and gives the lowest peak.
        let r = checked(&g, 1, Solver::Ilp, 5.0);
        assert!(!r.feasible);
        assert_eq!(
            r.op_local_bound_bytes,
            memory_floor(&g).max(g.op_local_bound())
        );
        let ratio = r.min_feasible_bytes as f64 / r.op_local_bound_bytes as f64;
        assert!(
            ratio <= 1.05,
            "{name}: lowest peak {ratio:.3} x the op-local bound"
        );
    }
}

#[test]
fn budgets_below_the_memory_floor_are_infeasible_with_the_floor_reported() {
    let _cbc = serial();
    // With Adam, the optimizer step (every gradient and both moments live) sets
    // a floor that no recomputation lowers; below it, infeasible, floor reported.
    let model = memplan::onnx::load_model(&common::shipped("mlp.onnx")).unwrap();
    let inf = memplan::infer::infer(
        &model,
        &memplan::infer::Bindings {
            batch: Some(4),
            ..Default::default()
        },
    )
    .unwrap();
    let s = memplan::train::build_schedule(&model, &inf, &Default::default()).unwrap();
    let g = memplan::remat::from_schedule::from_schedule(&s, "mlp");
    let floor = memory_floor(&g);
    assert!(floor > g.fixed_bytes(), "held gradients count in the floor");
    let r = checked(&g, floor - 1, Solver::Ilp, 5.0);
    assert!(!r.feasible);
    assert!(stage_lower_bound(&g, floor - 1).is_none());
    assert!(r.op_local_bound_bytes >= floor);
}

/// A chain of `k` forward nodes and its backward: `b_i` reads `f_i` and the
/// gradient `b_{i+1}`; every value is one byte. Its floor is 3 bytes (a backward
/// node's two inputs and output); reaching it means recomputing `f_i` from `f_0`
/// before every `b_i`, from values that were themselves dropped.
fn chain(k: usize) -> RematGraph {
    use memplan::remat::graph::{RNode, RValue};
    let mut g = RematGraph {
        name: format!("chain{k}"),
        nodes: Vec::new(),
        values: Vec::new(),
    };
    let mut add = |name: String, inputs: Vec<usize>, backward: bool| {
        let id = g.nodes.len();
        g.values.push(RValue {
            name: name.clone(),
            bytes: 1,
            producer: Some(id),
            fixed: false,
            held: false,
        });
        g.nodes.push(RNode {
            name,
            cost: 1.0,
            inputs,
            outputs: vec![id],
            backward,
            recomputable: true,
            op: String::new(),
        });
        id
    };
    let mut prev = None;
    let mut fwd = Vec::new();
    for i in 0..k {
        let id = add(format!("f{i}"), prev.into_iter().collect(), false);
        fwd.push(id);
        prev = Some(id);
    }
    let mut grad = add("loss".into(), vec![fwd[k - 1]], true);
    for i in (0..k).rev() {
        grad = add(format!("b{i}"), vec![fwd[i], grad], true);
    }
    g
}

#[test]
fn nested_recomputation_reaches_the_floor_of_a_chain() {
    let _cbc = serial();
    let g = chain(30);
    let floor = memory_floor(&g);
    assert_eq!(floor, 3);
    assert!(base_peak(&g) > 30);
    // At the floor: a plan exists (f_i recomputed from f_0 before each b_i).
    let r = checked(&g, floor, Solver::Ilp, 5.0);
    assert!(r.feasible, "peak {} at floor {floor}", r.peak_bytes);
    let mut runs = vec![0usize; g.nodes.len()];
    for op in &r.plan {
        if let memplan::remat::graph::Instr::Compute(i) = op {
            runs[*i] += 1;
        }
    }
    assert!(
        runs[0] > 2,
        "f0 runs {} times: no nested recomputation",
        runs[0]
    );
    // Below it: infeasible, and the lowest peak reported is the floor.
    let r = checked(&g, floor - 1, Solver::Ilp, 5.0);
    assert!(!r.feasible);
    assert_eq!(r.min_feasible_bytes, floor);
    // Halfway: planned, cheaper than at the floor.
    let half = checked(&g, base_peak(&g) / 2, Solver::Ilp, 5.0);
    assert!(half.feasible);
}

#[test]
fn dtr_plans_replay_within_the_budget_and_tightening_keeps_the_cost() {
    use memplan::remat::dtr::{plans, simulate, tighten, Prepared, HEURISTICS};
    for (name, fracs) in [
        ("vgg_unet_train.json", &[0.9, 0.7, 0.5][..]),
        ("mobilenet_train.json", &[0.9, 0.7, 0.5]),
        ("random_layered_n100.json", &[0.9, 0.8, 0.7]),
        ("random_layered_n500.json", &[0.9, 0.8]),
    ] {
        let g = dag(name);
        let base = base_peak(&g);
        let floor = memory_floor(&g);
        let pr = Prepared::new(&g);
        for &f in fracs {
            let budget = ((base as f64 * f) as u64).max(floor);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let d = plans(&g, budget, deadline);
            let p = d
                .cheapest
                .unwrap_or_else(|| panic!("{name} {f}: no plan within the budget"));
            let r = replay(&g, &p).unwrap();
            assert!(r.peak_bytes <= budget, "{name} {f}");
            let low = replay(&g, &d.lowest.unwrap()).unwrap();
            assert!(low.peak_bytes <= r.peak_bytes && low.peak_bytes >= floor);
            // Tightening an untightened plan: same computes, same cost, no higher peak.
            let loose = g.no_recompute_plan();
            let t = tighten(&g, &loose);
            let (a, b) = (replay(&g, &loose).unwrap(), replay(&g, &t).unwrap());
            assert_eq!(a.cost, b.cost);
            assert!(b.peak_bytes <= a.peak_bytes);
            // Every rule's plan replays, whatever its peak.
            for h in HEURISTICS {
                if let Some(p) = simulate(&g, &pr, h, budget, 1 << 22, Some(deadline)) {
                    replay(&g, &p).unwrap_or_else(|e| panic!("{name} {f} {h:?}: {e}"));
                }
            }
        }
    }
}

/// Lazy pinning (a node's resident inputs pinned in Sethi–Ullman order with the
/// missing ones, not first) reaches random layered n250 at 80 % of its
/// no-recompute peak, where the same rules pinning first stay above 90 %.
#[test]
fn lazy_pinning_reaches_lower_peaks_than_pinning_first() {
    use memplan::remat::dtr::{simulate, Prepared, HEURISTICS, LAZY_COST, LAZY_MEMORY};
    let g = dag("random_layered_n250.json");
    let base = base_peak(&g);
    let budget = (base as f64 * 0.8) as u64;
    let pr = Prepared::new(&g);
    let peak = |k: usize| {
        let p = simulate(&g, &pr, HEURISTICS[k], budget, 1 << 24, None).unwrap();
        replay(&g, &p).unwrap().peak_bytes
    };
    // The lazy rules are [0] (cost) and [8] (memory), pinning lazily.
    for (first, lazy) in [(0, LAZY_COST), (8, LAZY_MEMORY)] {
        let (f, l) = (HEURISTICS[first], HEURISTICS[lazy]);
        assert!(!f.lazy && l.lazy);
        assert_eq!(f.weight, l.weight);
        assert_eq!(
            (f.dist_exp, f.stale_exp, f.eager),
            (l.dist_exp, l.stale_exp, l.eager)
        );
        let (a, b) = (peak(first), peak(lazy));
        assert!(b <= budget, "lazy rule {lazy}: {b} > {budget}");
        assert!(a as f64 > 0.9 * base as f64, "rule {first}: {a}");
    }
}

/// Random layered n1000 at 70 % of its no-recompute peak is feasible: computing
/// each node from nothing, its inputs rebuilt in Sethi–Ullman order, never needs
/// more than 58.9 % of it (docs/BENCHMARKS.md; that schedule is far too long to
/// write out, so the point stays open in the benchmark).
#[test]
fn building_each_node_from_nothing_bounds_the_lowest_peak() {
    use memplan::remat::dtr::Prepared;
    for (name, frac) in [
        ("random_layered_n1000.json", 0.589),
        ("random_layered_n500.json", 0.714),
        ("random_layered_n250.json", 0.953),
    ] {
        let g = dag(name);
        let pr = Prepared::new(&g);
        let most = (0..g.values.len())
            .map(|v| pr.need_from_nothing(v))
            .max()
            .unwrap();
        let f = most as f64 / base_peak(&g) as f64;
        assert!((f - frac).abs() < 0.001, "{name}: {f}");
        // A peak some schedule reaches: never under the proven memory floor.
        assert!(most >= memory_floor(&g), "{name}");
        // Nothing is fixed or held in these graphs: the whole schedule's peak.
        assert_eq!(pr.from_nothing_peak(&g), Some(most), "{name}");
    }
}

/// `memplan bench`'s certificates. The from-nothing bound makes n1000 at 70 %
/// `feasible` where nothing plans it (the chain search now does); at 50 % nothing
/// is known.
#[test]
fn bench_status_says_what_is_proven() {
    use memplan::remat::bench::status;
    assert_eq!(status(true, 10, 20, None, Solver::Ilp), "planned");
    assert_eq!(status(false, 10, 20, Some(5), Solver::Ilp), "infeasible");
    assert_eq!(status(false, 30, 20, Some(25), Solver::Ilp), "feasible");
    assert_eq!(status(false, 30, 20, Some(35), Solver::Checkmate), "open");
    assert_eq!(status(false, 30, 20, None, Solver::Ilp), "open");
    assert_eq!(status(false, 30, 20, Some(25), Solver::Greedy), "no plan");
    let g = dag("random_layered_n1000.json");
    let (base, floor) = (base_peak(&g), memory_floor(&g));
    let from_nothing = memplan::remat::dtr::Prepared::new(&g).from_nothing_peak(&g);
    let at = |f: f64| {
        status(
            false,
            (base as f64 * f) as u64,
            floor,
            from_nothing,
            Solver::Ilp,
        )
    };
    assert_eq!(at(0.7), "feasible");
    assert_eq!(at(0.5), "open");
}

/// The random layered points that were open before nested recomputation and the
/// materialization floor (docs/benchmarks/log.md): each is now planned or proven
/// infeasible, within the benchmark's 10 s. (n250 at 70 % is planned by the chain
/// search since 2026-12-04, n1000 at 70 % too, checked below; n500 and n1000 at
/// 50 % are still open; n250 at 80 % is planned by lazy pinning,
/// at an absurd cost: the rule's run is checked above, the whole planner is not
/// here, as it needs most of the 10 s.) Early gaps, the simulation's local search
/// and hoisting brought n100 at 70 % from 1.6385 to 1.47, n1000 at 90 % from
/// 1.0730 to 1.0124 and at 80 % from 1.7029 to 1.12; held-input gaps brought n100
/// at 80 % from 1.0693 to Checkmate's proven optimum, 1.0230 (HiGHS, 718 s), and
/// at 70 % to 1.0723, n1000 at 80 % to 1.06, and planned n500 at 70 %
/// (docs/benchmarks/log.md).
#[test]
fn random_layered_points_are_planned_or_below_the_floor() {
    let _cbc = serial();
    for (name, fracs, secs) in [
        ("random_layered_n100.json", &[0.9, 0.8, 0.7, 0.5][..], 5.0),
        ("random_layered_n250.json", &[0.9, 0.7, 0.5], 5.0),
        ("random_layered_n500.json", &[0.9, 0.8, 0.7], 10.0),
        ("random_layered_n1000.json", &[0.9, 0.8], 10.0),
    ] {
        let g = dag(name);
        let base = base_peak(&g);
        for &f in fracs {
            let budget = (base as f64 * f) as u64;
            let r = checked(&g, budget, Solver::Ilp, secs);
            let was = match (name, f) {
                // Within 1 % of Checkmate's optimum, 1.0230.
                ("random_layered_n100.json", 0.8) => 1.0230 * 1.01,
                ("random_layered_n100.json", 0.7) => 1.15,
                ("random_layered_n1000.json", 0.9) => 1.04,
                ("random_layered_n1000.json", 0.8) => 1.2,
                _ => f64::INFINITY,
            };
            assert!(r.overhead <= was, "{name} at {f}: {}", r.overhead);
            assert!(
                r.feasible || budget < r.op_local_bound_bytes,
                "{name} at {f}: open (lowest peak {:.3}, floor {:.3} of the baseline)",
                r.min_feasible_bytes as f64 / base as f64,
                r.op_local_bound_bytes as f64 / base as f64
            );
        }
    }
}

/// The gap model alone reached 2.0x (mobilenet) and 2.8x (resnet50) the bound; the
/// simulation 1.0x and 1.222x; the chain search's bisection brings resnet50 to 1.111x.
#[test]
fn nested_recomputation_lowers_the_lowest_peak_on_mobilenet_and_resnet50() {
    let _cbc = serial();
    // resnet50: 1.222x before the chain search, 1.111x with it (2026-12-04).
    for (name, within) in [("mobilenet_train.json", 1.10), ("resnet50_train.json", 1.2)] {
        let g = dag(name);
        let r = checked(&g, 1, Solver::Ilp, 5.0);
        let ratio = r.min_feasible_bytes as f64 / r.op_local_bound_bytes as f64;
        assert!(
            ratio <= within,
            "{name}: lowest peak {ratio:.3} x the op-local bound"
        );
    }
}

/// `t` reads `x = f(s1)` and `y = f(s2)` and writes nothing of size: the op-local
/// bound is 2 bytes, but whichever of `x`, `y` is made resident last needs its own
/// input resident beside the other: 3 bytes, which a plan reaches.
#[test]
fn the_materialization_floor_sees_past_the_op_local_bound() {
    use memplan::remat::bounds::materialization_floor;
    use memplan::remat::graph::{RNode, RValue};
    let mut g = RematGraph {
        name: "two-branches".into(),
        nodes: Vec::new(),
        values: Vec::new(),
    };
    for (name, inputs, bytes) in [
        ("s1", vec![], 1),
        ("s2", vec![], 1),
        ("x", vec![0], 1),
        ("y", vec![1], 1),
        ("t", vec![2, 3], 0),
    ] {
        let id = g.nodes.len();
        g.values.push(RValue {
            name: name.into(),
            bytes,
            producer: Some(id),
            fixed: false,
            held: false,
        });
        g.nodes.push(RNode {
            name: name.into(),
            cost: 1.0,
            inputs,
            outputs: vec![id],
            backward: false,
            recomputable: true,
            op: String::new(),
        });
    }
    assert_eq!(g.op_local_bound(), 2);
    assert_eq!(materialization_floor(&g, 2), 3);
    assert_eq!(memory_floor(&g), 3);
    let _cbc = serial();
    assert!(!checked(&g, 2, Solver::Ilp, 2.0).feasible);
    assert!(stage_lower_bound(&g, 2).is_none());
    assert!(checked(&g, 3, Solver::Ilp, 2.0).feasible);
}

/// A recursion as deep as the graph is long stays within a test thread's stack:
/// past `MAX_DEPTH` nested recomputations a run gives up instead.
#[test]
fn deep_nested_recomputation_does_not_overflow_the_stack() {
    use memplan::remat::dtr::{plans, MAX_DEPTH};
    let g = chain(MAX_DEPTH + 500);
    let h = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(3);
            let d = plans(&g, memory_floor(&g), deadline);
            d.lowest.map(|p| replay(&g, &p).unwrap().peak_bytes)
        })
        .unwrap();
    h.join().expect("the simulation overflowed its stack");
}

/// The reverse chain search (src/remat/chain.rs) plans the two random layered
/// points every forward rule had left without a plan: n250 at 70 % (open before)
/// and n1000 at 70 % (feasible, no plan). Each plan replays within the budget and
/// computes every node.
#[test]
fn the_chain_search_plans_what_the_forward_rules_miss() {
    use memplan::remat::chain;
    let _cbc = serial();
    for name in ["random_layered_n250.json", "random_layered_n1000.json"] {
        let g = dag(name);
        assert!(chain::applies(&g));
        let budget = (base_peak(&g) as f64 * 0.7) as u64;
        let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let chain::Probe::Plan(plan) = chain::plan_within(&g, budget, end) else {
            panic!("{name}: no plan")
        };
        let r = replay(&g, &plan).unwrap();
        assert!(
            r.peak_bytes <= budget,
            "{name}: {} > {budget}",
            r.peak_bytes
        );
        assert!(r.recompute_cost > 0.0, "{name}: 70 % needs recomputation");
    }
    // Below what the graph's last node needs, no chain exists: proven.
    let g = dag("random_layered_n250.json");
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    assert!(matches!(
        chain::plan_within(&g, memory_floor(&g) - 1, end),
        chain::Probe::Impossible
    ));
}

/// An exhausted chain search is a proof (one unread value, one output per node):
/// resnet50 at 1.05x its op-local bound is impossible, which neither the op-local
/// bound nor the materialization floor shows; the whole report says infeasible
/// with that floor. (At 1.111x a chain exists, and 1 byte less is exhausted in
/// about 18 s of a release build: the lowest peak is exactly 1.111x, outside the
/// issue's 10 %; docs/BENCHMARKS.md.) On n100 the lowest peak the report gives is
/// its floor, reached.
#[test]
fn an_exhausted_chain_search_proves_a_budget_impossible() {
    use memplan::remat::chain;
    let _cbc = serial();
    let g = dag("resnet50_train.json");
    assert!(chain::exhaustion_proves(&g));
    let floor = memory_floor(&g).max(g.op_local_bound());
    let budget = floor + floor / 20;
    let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
    assert!(matches!(
        chain::plan_within(&g, budget, end),
        chain::Probe::Impossible
    ));
    let r = checked(&g, budget, Solver::Ilp, 5.0);
    assert!(!r.feasible);
    assert!(r.proven_floor_bytes > budget, "{}", r.proven_floor_bytes);
    assert!(r.op_local_bound_bytes <= budget);

    let g = dag("random_layered_n100.json");
    let r = checked(&g, 1, Solver::Ilp, 5.0);
    assert_eq!(r.min_feasible_bytes, r.op_local_bound_bytes);
}

/// The chain search's verdicts against brute force: on small random DAGs (one
/// unread value), the lowest peak over every schedule (a search over which values
/// are resident and which nodes ran, frees anywhere) is planned by the chain
/// search, and one byte less is proven impossible.
#[test]
#[allow(clippy::needless_range_loop)]
fn chain_search_verdicts_match_brute_force_on_small_graphs() {
    use memplan::remat::chain::{self, Probe};
    use memplan::remat::graph::{RNode, RValue};
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, HashMap};
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    for case in 0..60 {
        let n = 4 + rnd(4) as usize;
        let mut inputs: Vec<Vec<usize>> = vec![Vec::new(); n];
        for i in 1..n {
            for j in 0..i {
                if rnd(3) == 0 || (j + 1 == i && inputs[i].is_empty()) {
                    inputs[i].push(j);
                }
            }
        }
        // One unread value: everything nothing reads feeds the last node.
        for j in 0..n - 1 {
            if !inputs.iter().any(|ins| ins.contains(&j)) {
                inputs[n - 1].push(j);
            }
        }
        let bytes: Vec<u64> = (0..n).map(|_| 1 + rnd(5)).collect();
        let g = RematGraph {
            name: format!("random{case}"),
            values: (0..n)
                .map(|i| RValue {
                    name: format!("v{i}"),
                    bytes: bytes[i],
                    producer: Some(i),
                    fixed: false,
                    held: false,
                })
                .collect(),
            nodes: (0..n)
                .map(|i| RNode {
                    name: format!("n{i}"),
                    cost: 1.0,
                    inputs: inputs[i].clone(),
                    outputs: vec![i],
                    backward: false,
                    recomputable: true,
                    op: String::new(),
                })
                .collect(),
        };
        assert!(chain::exhaustion_proves(&g));
        // Brute force: states (resident, ran), the peak so far minimised.
        let size = |m: u32| -> u64 { (0..n).filter(|&i| m >> i & 1 == 1).map(|i| bytes[i]).sum() };
        let all = (1u32 << n) - 1;
        let mut best: HashMap<(u32, u32), u64> = HashMap::new();
        let mut heap = BinaryHeap::new();
        heap.push(Reverse((0u64, 0u32, 0u32)));
        let lowest = loop {
            let Reverse((peak, res, ran)) = heap.pop().expect("a schedule exists");
            if ran == all {
                break peak;
            }
            if best.get(&(res, ran)).is_some_and(|&p| p <= peak) {
                continue;
            }
            best.insert((res, ran), peak);
            for i in 0..n {
                let bit = 1u32 << i;
                if res & bit != 0 {
                    heap.push(Reverse((peak, res & !bit, ran)));
                } else if inputs[i].iter().all(|&u| res >> u & 1 == 1) {
                    let now = size(res | bit);
                    heap.push(Reverse((peak.max(now), res | bit, ran | bit)));
                }
            }
        };
        let end = std::time::Instant::now() + Duration::from_secs(10);
        match chain::plan_within(&g, lowest, end) {
            Probe::Plan(p) => assert!(replay(&g, &p).unwrap().peak_bytes <= lowest),
            _ => panic!("case {case}: no chain at the lowest peak {lowest}"),
        }
        assert!(
            matches!(chain::plan_within(&g, lowest - 1, end), Probe::Impossible),
            "case {case}: {} not proven impossible",
            lowest - 1
        );
    }
}
