//! Module plans (`remat::modules`, `remat::module_plan`): the module tree, the
//! checkpoint semantics on hand-built graphs (each rule), the search, the preset,
//! and the CLI (`plan --granularity module`, `--checkpoint every-block`, `--pytorch`,
//! `-o` then `verify --plan`).

mod common;

use memplan::remat::graph::{replay, Instr, RNode, RValue, RematGraph};
use memplan::remat::module_plan::{pytorch_module, search, PytorchHeader};
use memplan::remat::modules::{
    every_block, module_plan_for, module_plan_in, module_plan_with, repeated_blocks,
    saved_at_forward_end, ModuleTree,
};

/// Builds a graph from `(name, inputs, outputs, backward)` rows; values from
/// `(name, bytes, fixed, held)`.
fn graph(
    values: &[(&str, u64, bool, bool)],
    nodes: &[(&str, &[&str], &[&str], bool)],
) -> RematGraph {
    let id = |n: &str| values.iter().position(|v| v.0 == n).unwrap();
    let mut vals: Vec<RValue> = values
        .iter()
        .map(|&(name, bytes, fixed, held)| RValue {
            name: name.into(),
            bytes,
            producer: None,
            fixed,
            held,
        })
        .collect();
    let nodes: Vec<RNode> = nodes
        .iter()
        .enumerate()
        .map(|(i, &(name, ins, outs, backward))| {
            for o in outs {
                vals[id(o)].producer.get_or_insert(i);
            }
            RNode {
                name: name.into(),
                cost: 10.0,
                inputs: ins.iter().map(|v| id(v)).collect(),
                outputs: outs.iter().map(|v| id(v)).collect(),
                backward,
                recomputable: !backward,
                op: name
                    .trim_end_matches("/grad")
                    .rsplit('/')
                    .next()
                    .unwrap()
                    .into(),
            }
        })
        .collect();
    RematGraph {
        name: "hand".into(),
        nodes,
        values: vals,
    }
}

/// `pre` → module `a` (`lin`, `act`, `out`) → `head` → loss → backward.
/// `a`'s input `h0` is read by no backward node; `h2` (act's output) is read by `a`'s
/// backward only; `h3` (a's output) by head's backward.
fn chain() -> RematGraph {
    graph(
        &[
            ("x", 1, true, false),
            ("W", 2, true, false),
            ("h0", 16, false, false),
            ("h1", 32, false, false),
            ("h2", 64, false, false),
            ("h3", 128, false, false),
            ("y", 256, false, true),
            ("L", 4, false, true),
            ("gy", 8, false, false),
            ("g3", 8, false, false),
            ("g2", 8, false, false),
            ("g1", 8, false, false),
            ("g0", 8, false, false),
            ("gx", 8, false, false),
        ],
        &[
            ("/pre/Relu", &["x"], &["h0"], false),
            ("/a/lin/MatMul", &["h0", "W"], &["h1"], false),
            ("/a/act/Relu", &["h1"], &["h2"], false),
            ("/a/out/MatMul", &["h2", "W"], &["h3"], false),
            ("/head/MatMul", &["h3", "W"], &["y"], false),
            ("loss", &["y"], &["L"], true),
            ("loss/grad", &["L"], &["gy"], true),
            ("/head/MatMul/grad", &["gy", "h3", "W"], &["g3"], true),
            ("/a/out/MatMul/grad", &["g3", "h2", "W"], &["g2"], true),
            ("/a/act/Relu/grad", &["g2", "h2"], &["g1"], true),
            ("/a/lin/MatMul/grad", &["g1", "W"], &["g0"], true),
            ("/pre/Relu/grad", &["g0", "x"], &["gx"], true),
        ],
    )
}

/// Names of the values live right before the `nth` compute of node `node`.
fn live_before(g: &RematGraph, plan: &[Instr], node: usize, nth: usize) -> Vec<String> {
    let mut live: Vec<bool> = g.values.iter().map(|v| v.fixed).collect();
    let mut seen = 0;
    for op in plan {
        match *op {
            Instr::Compute(i) => {
                if i == node {
                    seen += 1;
                    if seen == nth {
                        break;
                    }
                }
                for &v in &g.nodes[i].outputs {
                    live[v] = true;
                }
            }
            Instr::Free(v) => live[v] = false,
            Instr::Load(v) => live[v] = true,
        }
    }
    (0..g.values.len())
        .filter(|&v| live[v] && !g.values[v].fixed)
        .map(|v| g.values[v].name.clone())
        .collect()
}

fn computes(plan: &[Instr], node: usize) -> usize {
    plan.iter().filter(|&&i| i == Instr::Compute(node)).count()
}

#[test]
fn the_tree_follows_scopes() {
    let g = chain();
    let t = ModuleTree::build(&g);
    let paths: Vec<&str> = t.modules.iter().map(|m| m.path.as_str()).collect();
    assert_eq!(paths, ["pre", "a", "a.lin", "a.act", "a.out", "head"]);
    let a = t.find("a").unwrap();
    assert_eq!(t.modules[a].forward, [1, 2, 3]);
    assert_eq!(t.modules[a].backward, [8, 9, 10]);
    assert!(t.modules[a].contiguous);
    assert!(t.unscoped.is_empty());
    assert!(repeated_blocks(&t).is_empty());
}

#[test]
fn no_module_is_the_baseline() {
    let g = chain();
    let p = module_plan_for(&g, &[]).unwrap();
    assert_eq!(p.peak_bytes, g.baseline_peak().unwrap());
    assert_eq!(p.recompute_cost, 0.0);
    // h2 (a's backward) and h3 (head's backward) are kept; h0 is freed after lin.
    assert_eq!(p.saved_bytes, 64 + 128);
    assert_eq!(
        p.saved_bytes,
        saved_at_forward_end(&g, &g.no_recompute_plan())
    );
}

#[test]
fn checkpointing_keeps_inputs_drops_inner_and_stops_early() {
    let g = chain();
    let p = module_plan_for(&g, &["a"]).unwrap();
    replay(&g, &p.plan).unwrap();
    // Inner h2 is not kept for backward; a's input h0 is (the frame keeps it).
    assert_eq!(p.saved_bytes, 16 + 128);
    // Early stop: out (whose output only head's backward reads) is not rerun; lin
    // and act are, once each.
    assert_eq!(computes(&p.plan, 3), 1);
    assert_eq!(computes(&p.plan, 1), 2);
    assert_eq!(computes(&p.plan, 2), 2);
    assert_eq!(p.recompute_cost, 20.0);
    // The recomputation runs right before a's first backward node that unpacks.
    let at = p.plan.iter().position(|&i| i == Instr::Compute(8)).unwrap();
    let prev = p.plan[..at]
        .iter()
        .rev()
        .find(|i| matches!(i, Instr::Compute(_)));
    assert_eq!(prev, Some(&Instr::Compute(2)));
    // Before it: h0 kept, h1 freed after its last recompute reader, h2 recomputed.
    let live = live_before(&g, &p.plan, 8, 1);
    assert!(live.contains(&"h0".to_string()), "{live:?}");
    assert!(live.contains(&"h2".to_string()), "{live:?}");
    assert!(!live.contains(&"h1".to_string()), "{live:?}");
    // h2 lives to its last backward reader (act's backward), h0 to a's last
    // unpacking backward node (lin's), then both are freed.
    let live = live_before(&g, &p.plan, 10, 1);
    assert!(!live.contains(&"h2".to_string()), "{live:?}");
    assert!(live.contains(&"h0".to_string()), "{live:?}");
    let live = live_before(&g, &p.plan, 11, 1);
    assert!(!live.contains(&"h0".to_string()), "{live:?}");
    // During forward, h2 is gone once out has read it.
    let live = live_before(&g, &p.plan, 4, 1);
    assert!(!live.contains(&"h2".to_string()), "{live:?}");
}

/// An offloaded module: what its backward reads and it wrote goes to the host after
/// its last forward read and comes back right before each backward node that reads
/// it (h2 twice: out's and act's backward); nothing runs again; its input stays.
#[test]
fn offloading_loads_before_each_backward_read_and_reruns_nothing() {
    let g = chain();
    let t = ModuleTree::build(&g);
    let p = module_plan_with(&g, &t, &[], &[], &["a"]).unwrap();
    let r = replay(&g, &p.plan).unwrap();
    assert_eq!(p.offloaded, vec!["a".to_string()]);
    assert_eq!((p.recompute_cost, r.recompute_cost), (0.0, 0.0));
    for n in 0..g.nodes.len() {
        assert_eq!(computes(&p.plan, n), 1);
    }
    // h2 (64 B) is loaded before out's and act's backward nodes: 128 B back, as much
    // in host copies; h3 is read by head's backward only, h0 is a's input.
    let loads: Vec<usize> = p
        .plan
        .iter()
        .filter_map(|i| match i {
            Instr::Load(v) => Some(*v),
            _ => None,
        })
        .collect();
    assert_eq!(loads.len(), 2);
    assert!(loads.iter().all(|&v| g.values[v].name == "h2"));
    assert_eq!(
        (r.loaded_bytes, p.host_bytes, p.pcie_bytes),
        (128, 128, 256)
    );
    for (node, nth) in [(8, 1), (9, 1)] {
        let at = p
            .plan
            .iter()
            .position(|&i| i == Instr::Compute(node))
            .unwrap();
        assert!(matches!(p.plan[at - 1], Instr::Load(v) if g.values[v].name == "h2"));
        assert!(live_before(&g, &p.plan, node, nth).contains(&"h2".to_string()));
    }
    // Gone after forward (the out MatMul read it last) and between the two loads.
    assert!(!live_before(&g, &p.plan, 4, 1).contains(&"h2".to_string()));
    // Only h3 (head's backward reads it); h0, read by no backward node, is not held
    // by a checkpoint frame here.
    assert_eq!(p.saved_bytes, 128);
    let none = module_plan_with(&g, &t, &[], &[], &[]).unwrap();
    assert!(p.peak_bytes <= none.peak_bytes);
    // One way per module.
    let e = module_plan_with(&g, &t, &["a"], &[], &["a"]).unwrap_err();
    assert!(e.contains("listed both whole and offloaded"), "{e}");
}

#[test]
fn a_selective_checkpoint_keeps_matmul_outputs_and_reruns_the_rest() {
    let g = chain();
    let t = ModuleTree::build(&g);
    let p = module_plan_in(&g, &t, &[], &["a"]).unwrap();
    replay(&g, &p.plan).unwrap();
    assert_eq!(p.modules, ["a"]);
    assert_eq!(p.selective, ["a"]);
    // Only act reruns: lin and out (MatMul) are served from the cache.
    assert_eq!(computes(&p.plan, 1), 1);
    assert_eq!(computes(&p.plan, 2), 2);
    assert_eq!(computes(&p.plan, 3), 1);
    assert_eq!(p.recompute_cost, 10.0);
    // Forward keeps a's input h0 (the frame), lin's output h1 (the cache) and h3.
    assert_eq!(p.saved_bytes, 16 + 32 + 128);
    // The rerun of act reads the cached h1, which is then freed; h2 is rebuilt.
    let live = live_before(&g, &p.plan, 8, 1);
    assert!(live.contains(&"h2".to_string()), "{live:?}");
    assert!(!live.contains(&"h1".to_string()), "{live:?}");
    // out's output h3 lies past the early stop: the frame holds it to a's last
    // unpacking backward node (lin's), after head's backward has read it.
    let live = live_before(&g, &p.plan, 10, 1);
    assert!(live.contains(&"h3".to_string()), "{live:?}");
    let live = live_before(&g, &p.plan, 11, 1);
    assert!(!live.contains(&"h3".to_string()), "{live:?}");
    // Cheaper than the full checkpoint, which reruns lin too, and keeps more.
    let full = module_plan_for(&g, &["a"]).unwrap();
    assert!(p.recompute_cost < full.recompute_cost);
    assert!(p.saved_bytes > full.saved_bytes);
    // A module is checkpointed one way or the other.
    let e = module_plan_in(&g, &t, &["a"], &["a"]).unwrap_err();
    assert!(e.contains("both whole and selective"), "{e}");
    let e = module_plan_in(&g, &t, &["a", "a"], &[]).unwrap_err();
    assert!(e.contains("twice"), "{e}");
}

#[test]
fn a_selective_checkpoint_caches_until_the_recomputation() {
    // m = mm (MatMul, h0 -> h1, read only by head's Add) then act (Relu, h0 -> h2,
    // read by m's backward). The cache holds h1 until m's recomputation gives it
    // back, although nothing reads it after head's Add.
    let g = graph(
        &[
            ("x", 1, true, false),
            ("W", 2, true, false),
            ("h0", 16, false, false),
            ("h1", 32, false, false),
            ("h2", 64, false, false),
            ("y", 8, false, true),
            ("L", 4, false, true),
            ("gy", 8, false, false),
            ("g1", 8, false, false),
            ("g2", 8, false, false),
            ("ga", 8, false, false),
            ("gb", 8, false, false),
            ("gx", 8, false, false),
        ],
        &[
            ("/pre/Relu", &["x"], &["h0"], false),
            ("/m/mm/MatMul", &["h0", "W"], &["h1"], false),
            ("/m/act/Relu", &["h0"], &["h2"], false),
            ("/head/Add", &["h1", "h2"], &["y"], false),
            ("loss", &["y"], &["L"], true),
            ("loss/grad", &["L"], &["gy"], true),
            ("/head/Add/grad", &["gy"], &["g1", "g2"], true),
            ("/m/act/Relu/grad", &["g2", "h2"], &["ga"], true),
            ("/m/mm/MatMul/grad", &["g1", "W"], &["gb"], true),
            ("/pre/Relu/grad", &["ga", "gb", "x"], &["gx"], true),
        ],
    );
    let t = ModuleTree::build(&g);
    let p = module_plan_in(&g, &t, &[], &["m"]).unwrap();
    replay(&g, &p.plan).unwrap();
    assert_eq!(computes(&p.plan, 1), 1);
    assert_eq!(computes(&p.plan, 2), 2);
    // Held through head's backward to act's rerun, then given back and freed.
    let live = live_before(&g, &p.plan, 2, 2);
    assert!(live.contains(&"h1".to_string()), "{live:?}");
    let live = live_before(&g, &p.plan, 7, 1);
    assert!(!live.contains(&"h1".to_string()), "{live:?}");
    // Whole, the module drops h1 after head's Add (its rerun writes it again).
    let full = module_plan_for(&g, &["m"]).unwrap();
    let live = live_before(&g, &full.plan, 6, 1);
    assert!(!live.contains(&"h1".to_string()), "{live:?}");
    // One module, one way.
    let e = module_plan_in(&g, &t, &["m"], &["m"]).unwrap_err();
    assert!(e.contains("both whole and selective"), "{e}");
}

#[test]
fn the_search_may_choose_selective_checkpoints() {
    let g = chain();
    // The full checkpoint of `a` drops h2 and keeps h0; the selective one also
    // keeps h1 and h3 to the end of a's backward. At the full plan's peak, the
    // search with selective candidates is never costlier, and its plan replays.
    let full = module_plan_for(&g, &["a"]).unwrap();
    let off = search(&g, full.peak_bytes, false, 10.0).unwrap();
    let on = search(&g, full.peak_bytes, true, 10.0).unwrap();
    assert!(off.feasible && on.feasible);
    assert!(on.best.recompute_cost <= off.best.recompute_cost);
    replay(&g, &on.best.plan).unwrap();
    assert!(
        on.candidates > off.candidates,
        "{} {}",
        on.candidates,
        off.candidates
    );
    // Each variant lies in the other: never both in one plan.
    let mut m = on.best.modules.clone();
    m.sort();
    m.dedup();
    assert_eq!(m.len(), on.best.modules.len());
}

#[test]
fn a_leaf_checkpoint_reruns_only_what_its_backward_reads() {
    let g = chain();
    // a.out saves its input (a.out's arg) and W: nothing inside is rerun.
    let p = module_plan_for(&g, &["a.out"]).unwrap();
    replay(&g, &p.plan).unwrap();
    assert_eq!(p.recompute_cost, 0.0);
    assert_eq!(p.peak_bytes, g.baseline_peak().unwrap());
    // a.act's output h2 is read by a.out's backward (outside a.act): kept; and its
    // input h1 is kept by the checkpoint: worse than no checkpoint, as in PyTorch.
    let p = module_plan_for(&g, &["a.act"]).unwrap();
    assert_eq!(p.saved_bytes, 32 + 64 + 128);
}

#[test]
fn bad_module_sets_are_refused() {
    let g = chain();
    let e = module_plan_for(&g, &["a", "a.act"]).unwrap_err();
    assert!(e.contains("inside"), "{e}");
    let e = module_plan_for(&g, &["nope"]).unwrap_err();
    assert!(e.contains("no module 'nope'"), "{e}");
}

/// `b.relu` runs twice (TorchScript names the second call `relu_1`).
fn shared() -> RematGraph {
    graph(
        &[
            ("x", 1, true, false),
            ("W", 2, true, false),
            ("h0", 16, false, false),
            ("h1", 32, false, false),
            ("h2", 64, false, false),
            ("L", 4, false, true),
            ("g", 8, false, false),
            ("g1", 8, false, false),
            ("g0", 8, false, false),
            ("gx", 8, false, false),
        ],
        &[
            ("/layers.0/relu/Relu", &["x"], &["h0"], false),
            ("/layers.0/lin/MatMul", &["h0", "W"], &["h1"], false),
            ("/layers.0/relu_1/Relu", &["h1"], &["h2"], false),
            ("/layers.1/Relu", &["h2"], &["L"], false),
            ("Constant_7", &[], &["g"], false),
            ("/layers.1/Relu/grad", &["L", "g"], &["g1"], true),
            ("/layers.0/relu_1/Relu/grad", &["g1", "h2"], &["g0"], true),
            (
                "/layers.0/lin/MatMul/grad",
                &["g0", "h0", "W"],
                &["gx"],
                true,
            ),
        ],
    )
}

#[test]
fn a_module_called_twice_is_not_a_candidate() {
    let g = shared();
    let t = ModuleTree::build(&g);
    let relu = t.find("layers.0.relu").unwrap();
    assert!(!t.modules[relu].contiguous);
    assert_eq!(t.modules[relu].forward, [0, 2]);
    assert!(t.find("layers.0.relu_1").is_none());
    let e = module_plan_for(&g, &["layers.0.relu"]).unwrap_err();
    assert!(e.contains("more than one piece"), "{e}");
    assert_eq!(t.unscoped_names(&g), ["Constant_7"]);
    let blocks: Vec<&str> = repeated_blocks(&t)
        .iter()
        .map(|&m| t.modules[m].path.as_str())
        .collect();
    assert_eq!(blocks, ["layers.0", "layers.1"]);
    let p = every_block(&g).unwrap();
    assert_eq!(p.modules, ["layers.0", "layers.1"]);
    replay(&g, &p.plan).unwrap();
    let s = search(&g, g.baseline_peak().unwrap() - 1, false, 10.0).unwrap();
    assert!(s.excluded.contains(&"layers.0.relu".to_string()));
    assert_eq!(s.unscoped, ["Constant_7"]);
}

#[test]
fn the_search_is_exact_on_small_trees() {
    let g = chain();
    let base = g.baseline_peak().unwrap();
    let s = search(&g, base, false, 10.0).unwrap();
    assert!(s.feasible && s.proven_optimal);
    assert!(s.best.modules.is_empty());
    // Every antichain, by brute force: the cheapest that fits.
    let sets: [&[&str]; 6] = [
        &[],
        &["a"],
        &["a.act"],
        &["a.lin"],
        &["a.out"],
        &["a.lin", "a.act"],
    ];
    let plans: Vec<_> = sets
        .iter()
        .map(|s| module_plan_for(&g, s).unwrap())
        .collect();
    let lowest = plans.iter().map(|p| p.peak_bytes).min().unwrap();
    assert!(lowest < base);
    let s = search(&g, lowest, false, 10.0).unwrap();
    assert!(s.feasible && s.proven_optimal, "{s:?}");
    let best = plans
        .iter()
        .filter(|p| p.peak_bytes <= lowest)
        .map(|p| p.recompute_cost)
        .fold(f64::INFINITY, f64::min);
    assert_eq!(s.best.recompute_cost, best);
    assert_eq!(
        replay(&g, &s.best.plan).unwrap().peak_bytes,
        s.best.peak_bytes
    );
    let s = search(&g, lowest - 1, false, 10.0).unwrap();
    assert!(!s.feasible && s.proven_optimal);
    assert_eq!(s.lowest_peak, lowest);
}

#[test]
fn the_pytorch_file_lists_the_modules() {
    let h = PytorchHeader {
        model: "models/resnet50.onnx".into(),
        batch: Some(8),
        budget_bytes: Some(1 << 30),
        peak_bytes: 1000,
        method: "module:greedy".into(),
    };
    let py = pytorch_module(&h, &["layer1.0".into(), "transformer.h.\"x".into()], &[]);
    assert!(py.starts_with("\"\"\"Activation checkpointing plan made by memplan."));
    assert!(py.contains("model: models/resnet50.onnx\nbatch: 8\n"));
    assert!(
        py.contains("CHECKPOINT_MODULES = [\n    \"layer1.0\",\n    \"transformer.h.\\\"x\",\n]")
    );
    assert!(py.contains("def apply(model):"));
    assert!(py.contains("model.get_submodule(name)"));
    assert!(py.contains("use_reentrant=False"));
    assert!(!py.contains("SELECTIVE_MODULES"));
    // Selective modules: the policy and the context_fn, only for those listed.
    let sel = pytorch_module(
        &h,
        &["layer1.0".into(), "layer2".into()],
        &["layer2".into()],
    );
    assert!(sel.contains("import torch\nimport torch.utils.checkpoint\n"));
    assert!(sel.contains("SELECTIVE_MODULES = [\n    \"layer2\",\n]"));
    assert!(sel.contains("torch.ops.aten.convolution.default"));
    assert!(sel.contains("CheckpointPolicy.MUST_SAVE"));
    assert!(sel.contains("create_selective_checkpoint_contexts(_policy)"));
    assert!(sel.contains(
        "extra = {\"context_fn\": _selective_context} if name in SELECTIVE_MODULES else {}"
    ));
    assert!(sel.contains("_forward, *args, use_reentrant=False, **_extra, **kwargs"));
    assert!(sel.contains("Modules in SELECTIVE_MODULES keep"));
}

#[test]
fn cli_module_plans_keep_every_key() {
    let m = common::shipped("transformer.onnx");
    let m = m.to_str().unwrap();
    let op = common::memplan_json(&["plan", m, "--batch", "64", "--budget", "0.7", "--json"]);
    assert_eq!(op["granularity"], "op");
    assert_eq!(op["feasible"], true, "{op}");
    assert_eq!(op["checkpoint_modules"], serde_json::json!([]));
    let v = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "64",
        "--budget",
        "0.7",
        "--granularity",
        "module",
        "--json",
    ]);
    for k in op.as_object().unwrap().keys() {
        assert!(v.get(k).is_some(), "module plan lacks '{k}'");
    }
    assert_eq!(v["granularity"], "module");
    assert!(v["feasible"].as_bool().unwrap(), "{v}");
    assert!(v["peak_bytes"].as_u64().unwrap() <= v["budget_bytes"].as_u64().unwrap());
    assert!(!v["checkpoint_modules"].as_array().unwrap().is_empty());
    assert!(v["overhead"].as_f64().unwrap() >= v["lower_bound_overhead"].as_f64().unwrap() - 1e-12);
    assert!(v["method"].as_str().unwrap().starts_with("module:"));
    let e = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "64",
        "--checkpoint",
        "every-block",
        "--json",
    ]);
    assert_eq!(
        e["checkpoint_modules"],
        serde_json::json!(["layers.0", "layers.1"])
    );
    assert!(e["peak_bytes"].as_u64().unwrap() < e["baseline_peak_bytes"].as_u64().unwrap());
    assert!(
        e["saved_bytes_at_forward_end"].as_u64().unwrap()
            < op["saved_bytes_at_forward_end"].as_u64().unwrap()
    );
    // An op plan as Python: one RECOMPUTE entry per recomputed forward node (made
    // recomputing only what the file reruns: 0.85 of the peak, where 0.7 was reached
    // by recomputing matrix products too).
    let py = std::env::temp_dir().join(format!("memplan-op-{}.py", std::process::id()));
    let o = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "64",
        "--budget",
        "0.85",
        "--json",
        "--pytorch",
        py.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&py).unwrap();
    let _ = std::fs::remove_file(&py);
    assert!(text.contains("\nRECOMPUTE = [\n") && text.contains("\ndef apply(model):"));
    let entries = text.matches("\n    (\"").count();
    assert!(o["recomputed"].as_array().unwrap().len() >= entries, "{o}");
    assert_eq!(
        entries > 0,
        o["recompute_flops"].as_f64().unwrap() > 0.0,
        "{o}"
    );
    let dag = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/remat-graphs/vgg16_train.json");
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        "--dag",
        dag.to_str().unwrap(),
        "--budget",
        "0.9",
        "--pytorch",
        "/dev/null",
    ]);
    assert!(
        !ok && err.contains("needs an ONNX model") && err.trim().lines().count() == 1,
        "{err}"
    );
}

#[test]
fn cli_module_plan_verifies_and_writes_python() {
    let dir = std::env::temp_dir().join(format!("memplan-module-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let py = dir.join("ckpt.py");
    let m = common::shipped("transformer.onnx");
    let m = m.to_str().unwrap();
    let v = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "2",
        "--checkpoint",
        "every-block",
        "--json",
        "-o",
        plan.to_str().unwrap(),
        "--pytorch",
        py.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&py).unwrap();
    assert!(text.contains("CHECKPOINT_MODULES = [\n    \"layers.0\",\n    \"layers.1\",\n]"));
    assert!(text.contains(&format!("({} bytes)", v["peak_bytes"])));
    let r = common::memplan_json(&[
        "verify",
        m,
        "--batch",
        "2",
        "--plan",
        plan.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(r["measured_peak_bytes"], v["peak_bytes"], "{r}");
    assert_eq!(r["predicted_peak_bytes"], v["peak_bytes"], "{r}");
    assert_eq!(r["gradients_identical"], true, "{r}");
    assert!(r["recomputations"].as_u64().unwrap() > 0, "{r}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_profile_reports_every_block() {
    let m = common::shipped("resnet18.onnx");
    let m = m.to_str().unwrap();
    let v = common::memplan_json(&[
        "profile",
        m,
        "--batch",
        "4",
        "--train",
        "--checkpoint",
        "every-block",
        "--json",
    ]);
    let t = &v["training"];
    let c = &t["checkpoint"];
    assert_eq!(c["preset"], "every-block");
    assert_eq!(
        c["modules"],
        serde_json::json!([
            "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0",
            "layer4.1"
        ])
    );
    assert!(c["peak_bytes"].as_u64().unwrap() < t["peak_bytes"].as_u64().unwrap());
    assert!(
        c["saved_bytes_at_forward_end"].as_u64().unwrap()
            < c["baseline_saved_bytes_at_forward_end"].as_u64().unwrap()
    );
    assert!(c["overhead"].as_f64().unwrap() > 0.0);
    // The same figures as `plan --checkpoint every-block`.
    let p = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "4",
        "--checkpoint",
        "every-block",
        "--json",
    ]);
    assert_eq!(p["peak_bytes"], c["peak_bytes"]);
    assert_eq!(
        p["saved_bytes_at_forward_end"],
        c["saved_bytes_at_forward_end"]
    );
    assert_eq!(p["overhead"], c["overhead"]);
    let (ok, out, _) = common::run_memplan(&[
        "profile",
        m,
        "--batch",
        "4",
        "--train",
        "--checkpoint",
        "every-block",
    ]);
    assert!(
        ok && out.contains("checkpoint every-block: 8 modules"),
        "{out}"
    );
    let (ok, _, err) = common::run_memplan(&["profile", m, "--checkpoint", "every-block"]);
    assert!(!ok && err.contains("--train"), "{err}");
}

/// `--checkpoint every-block:selective` checkpoints the same blocks as every-block,
/// each keeping its matrix products' and attention's outputs: it saves more at
/// forward end and recomputes less; `=nothing` is every-block; `plan` gives the same
/// figures and its `--pytorch` file lists every block in SELECTIVE_MODULES with a
/// policy that saves matrix products and fused attention; `fit` has the row.
#[test]
fn every_block_selective_keeps_the_matrix_products() {
    let m = common::shipped("llama_small.onnx");
    let m = m.to_str().unwrap();
    let profile = |preset: &str| {
        let v = common::memplan_json(&[
            "profile",
            m,
            "--batch",
            "2",
            "--train",
            "--checkpoint",
            preset,
            "--json",
        ]);
        v["training"]["checkpoint"].clone()
    };
    let whole = profile("every-block");
    let sel = profile("every-block:selective");
    assert_eq!(sel["preset"], "every-block:selective");
    assert_eq!(sel["modules"], whole["modules"]);
    assert_eq!(sel["selective_modules"], whole["modules"]);
    assert_eq!(whole["selective_modules"], serde_json::json!([]));
    let n = |c: &serde_json::Value, k: &str| c[k].as_f64().unwrap();
    assert!(n(&sel, "saved_bytes_at_forward_end") > n(&whole, "saved_bytes_at_forward_end"));
    assert!(n(&sel, "saved_bytes_at_forward_end") < n(&sel, "baseline_saved_bytes_at_forward_end"));
    assert!(n(&sel, "recompute_flops") < n(&whole, "recompute_flops"));
    assert!(n(&sel, "recompute_flops") > 0.0);
    let same = profile("every-block:selective=matmul-attention");
    assert_eq!(
        same["saved_bytes_at_forward_end"],
        sel["saved_bytes_at_forward_end"]
    );
    let nothing = profile("every-block:selective=nothing");
    assert_eq!(nothing["peak_bytes"], whole["peak_bytes"]);
    assert_eq!(nothing["recompute_flops"], whole["recompute_flops"]);
    let py = std::env::temp_dir().join(format!("memplan-sel-{}.py", std::process::id()));
    let p = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "2",
        "--checkpoint",
        "every-block:selective",
        "--json",
        "--pytorch",
        py.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&py).unwrap();
    let _ = std::fs::remove_file(&py);
    assert_eq!(p["peak_bytes"], sel["peak_bytes"]);
    assert_eq!(p["method"], "module:every-block:selective");
    assert_eq!(p["selective_modules"], sel["modules"]);
    let list = text.split("SELECTIVE_MODULES = [").nth(1).unwrap();
    for b in sel["modules"].as_array().unwrap() {
        assert!(
            list.contains(&format!("\"{}\"", b.as_str().unwrap())),
            "{b}"
        );
    }
    assert!(
        text.contains("_scaled_dot_product_flash_attention") && text.contains("aten.mm.default")
    );
    let f = common::memplan_json(&["fit", m, "--gpu", "rtx4090", "--json"]);
    let rows = f.to_string();
    assert!(rows.contains("checkpoint-every-block-selective"), "{rows}");
}

/// What PyTorch keeps after forward with these modules checkpointed (resnet18, batch
/// 4; measured by tools/checkpoint_saved_bytes.py with torch 2.15.0): the module
/// plans' saved bytes at forward end are exactly these.
#[test]
fn saved_bytes_equal_pytorch_with_checkpointed_modules() {
    let m = common::shipped("resnet18.onnx");
    let m = m.to_str().unwrap();
    let saved = |args: &[&str]| {
        let mut a = vec!["plan", m, "--batch", "4", "--json"];
        a.extend(args);
        common::memplan_json(&a)["saved_bytes_at_forward_end"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(saved(&["--budget", "0.99", "--solver", "none"]), 86_349_312);
    assert_eq!(saved(&["--checkpoint", "every-block"]), 46_973_440);
    assert_eq!(saved(&["--checkpoint-modules", "layer2.0"]), 79_923_712);
    assert_eq!(saved(&["--checkpoint-modules", "layer1"]), 63_868_416);
    // A Conv checkpointed alone saves its input anyway: nothing changes.
    assert_eq!(
        saved(&["--checkpoint-modules", "layer3.1.conv1"]),
        86_349_312
    );
    // What `--granularity module --budget 0.8` chooses at batch 8 (pools, downsample
    // branches and blocks).
    assert_eq!(
        saved(&[
            "--checkpoint-modules",
            "maxpool,layer1.0,layer1.1,layer2.0.downsample,layer2.1,layer3.0.downsample,\
             layer3.1,layer4.0.downsample,layer4.1"
        ]),
        48_994_816
    );
    // Asked for explicitly, a module called three times is refused in one line.
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        m,
        "--batch",
        "4",
        "--checkpoint-modules",
        "layer1.0.relu",
    ]);
    assert!(!ok && err.contains("more than one piece"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn nested_containers_are_named_as_pytorch_names_them() {
    use memplan::remat::modules::join;
    assert_eq!(join("", "layer1"), "layer1");
    assert_eq!(join("layer1", "layer1.0"), "layer1.0");
    assert_eq!(
        join("layer1.0.downsample", "downsample.0"),
        "layer1.0.downsample.0"
    );
    assert_eq!(join("transformer", "h.0"), "transformer.h.0");
    assert_eq!(
        join("encoder.layer.3", "attention"),
        "encoder.layer.3.attention"
    );
}

/// A searched module plan runs for real: measured peak = predicted, gradients
/// bitwise equal (unet_small, real weights; the search is exact there).
#[test]
fn cli_searched_module_plan_verifies() {
    let dir = std::env::temp_dir().join(format!("memplan-module-s-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let m = common::shipped("unet_small.onnx");
    let m = m.to_str().unwrap();
    let v = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "8",
        "--granularity",
        "module",
        "--budget",
        "0.8",
        "--json",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(v["feasible"], true, "{v}");
    assert_eq!(v["proven_optimal"], true, "{v}");
    assert_eq!(v["method"], "module:exhaustive");
    assert_eq!(
        v["checkpoint_modules"],
        serde_json::json!(["enc1", "enc2", "mid"])
    );
    let r = common::memplan_json(&[
        "verify",
        m,
        "--batch",
        "8",
        "--plan",
        plan.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(r["measured_peak_bytes"], v["peak_bytes"], "{r}");
    assert_eq!(r["gradients_identical"], true, "{r}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plan --checkpoint every-block:offload` and `--offload-modules`: the JSON names the
/// offloaded modules with host and PCIe bytes, the `--pytorch` file lists them under
/// OFFLOAD_MODULES (and checkpoints none), and `verify --plan` and `--rewrite`, which
/// run recomputation only, refuse the plan in one line.
#[test]
fn cli_offload_plans() {
    let dir = std::env::temp_dir().join(format!("memplan-offload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (plan, py) = (dir.join("plan.json"), dir.join("off.py"));
    let m = common::shipped("transformer.onnx");
    let m = m.to_str().unwrap();
    let v = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "2",
        "--checkpoint",
        "every-block:offload",
        "--json",
        "-o",
        plan.to_str().unwrap(),
        "--pytorch",
        py.to_str().unwrap(),
    ]);
    assert_eq!(v["method"], "module:every-block:offload");
    assert_eq!(
        v["offloaded_modules"],
        serde_json::json!(["layers.0", "layers.1"])
    );
    let host = v["host_bytes"].as_u64().unwrap();
    assert!(host > 0 && v["pcie_bytes"].as_u64().unwrap() == 2 * host);
    assert_eq!(v["recompute_flops"], 0.0);
    let text = std::fs::read_to_string(&py).unwrap();
    assert!(text.contains("OFFLOAD_MODULES = [\n    \"layers.0\",\n    \"layers.1\",\n]"));
    assert!(text.contains("CHECKPOINT_MODULES = [\n]"), "{text}");
    assert!(text.contains("saved_tensors_hooks"));
    let given = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "2",
        "--offload-modules",
        "layers.0,layers.1",
        "--json",
    ]);
    assert_eq!(given["peak_bytes"], v["peak_bytes"]);
    assert!(given.get("pcie_seconds").is_none());
    let on = common::memplan_json(&[
        "plan",
        m,
        "--batch",
        "2",
        "--checkpoint",
        "every-block:offload",
        "--gpu",
        "h100",
        "--json",
    ]);
    let secs = on["pcie_seconds"].as_f64().unwrap();
    assert!(
        (secs - on["pcie_bytes"].as_f64().unwrap() / 63e9).abs() < 1e-12,
        "{on}"
    );
    for args in [
        vec![
            "verify",
            m,
            "--batch",
            "2",
            "--plan",
            plan.to_str().unwrap(),
        ],
        vec![
            "plan",
            m,
            "--batch",
            "2",
            "--offload-modules",
            "layers.0",
            "--rewrite",
            dir.join("r.onnx").to_str().unwrap(),
        ],
        vec!["plan", m, "--batch", "2", "--offload-modules", "nosuch"],
    ] {
        let (ok, _, err) = common::run_memplan(&args);
        assert!(!ok, "{args:?}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains("offload") || err.contains("no module 'nosuch'"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
