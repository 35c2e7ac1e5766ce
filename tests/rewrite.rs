//! `plan --rewrite`: the planned training step as ONNX. The file decodes, has one
//! node per compute in plan order (recomputations as renamed copies, backward ops in
//! the ai.memplan domain), and reads back into the same graph and plan, whose replay
//! gives the predicted peak.

mod common;

use std::path::Path;
use std::process::Command;

use memplan::infer::Bindings;
use memplan::onnx::proto::ModelProto;
use memplan::remat::graph::{replay, Instr, RematGraph};
use memplan::remat::plan::{plan, PlanReport, Solver};
use memplan::rewrite::{keys, read_rewrite, rewrite, write_loaded, Loaded, DOMAIN, DOMAIN_VERSION};
use memplan::train::{Loss, Optimizer, Precision, TrainOptions};
use prost::Message;

fn meta<'a>(props: &'a [memplan::onnx::proto::StringStringEntryProto], k: &str) -> Option<&'a str> {
    props
        .iter()
        .find(|e| e.key.as_deref() == Some(k))
        .and_then(|e| e.value.as_deref())
}

fn planned(name: &str, batch: u64, frac: f64, solver: Solver) -> (Loaded, RematGraph, PlanReport) {
    planned_with(name, batch, frac, solver, &TrainOptions::default())
}

fn planned_with(
    name: &str,
    batch: u64,
    frac: f64,
    solver: Solver,
    opts: &TrainOptions,
) -> (Loaded, RematGraph, PlanReport) {
    let src = Loaded::from_file(
        &common::shipped(&format!("{name}.onnx")),
        &Bindings {
            batch: Some(batch),
            ..Default::default()
        },
        opts,
    )
    .unwrap();
    let g = src.graph(name);
    let base = replay(&g, &g.no_recompute_plan()).unwrap().peak_bytes;
    let r = plan(&g, (base as f64 * frac) as u64, solver, 10.0).unwrap();
    (src, g, r)
}

fn computes(plan: &[Instr]) -> usize {
    plan.iter()
        .filter(|o| matches!(o, Instr::Compute(_)))
        .count()
}

/// SSA: every name written once, every input defined before it is read.
fn assert_ssa(graph: &memplan::onnx::proto::GraphProto) {
    let mut defined: std::collections::HashSet<&str> = graph
        .initializer
        .iter()
        .map(|t| t.name())
        .chain(graph.input.iter().map(|v| v.name()))
        .collect();
    for n in &graph.node {
        for i in n.input.iter().filter(|i| !i.is_empty()) {
            assert!(
                defined.contains(i.as_str()),
                "{}: '{i}' read before written",
                n.name()
            );
        }
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            assert!(
                defined.insert(o.as_str()),
                "{}: '{o}' written twice",
                n.name()
            );
        }
    }
}

/// Writes, decodes, checks the structure, reads back; returns the file size.
fn round_trip(name: &str, batch: u64, frac: f64, solver: Solver) -> usize {
    round_trip_with(name, batch, frac, solver, &TrainOptions::default())
}

fn round_trip_with(
    name: &str,
    batch: u64,
    frac: f64,
    solver: Solver,
    opts: &TrainOptions,
) -> usize {
    let (src, g, r) = planned_with(name, batch, frac, solver, opts);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(format!("{name}.rewrite.onnx"));
    let stats = write_loaded(&src, &g, &r, &out).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(bytes.len(), stats.bytes);

    // A valid ModelProto with both opsets and the plan's figures.
    let m = ModelProto::decode(bytes.as_slice()).unwrap();
    assert!(
        m.ir_version.unwrap() >= 10,
        "{name}: node metadata needs IR 10"
    );
    let opset = |d: &str| {
        m.opset_import
            .iter()
            .find(|o| o.domain.as_deref().unwrap_or("") == d)
            .and_then(|o| o.version)
    };
    assert_eq!(opset(DOMAIN), Some(DOMAIN_VERSION), "{name}");
    assert_eq!(opset(""), Some(src.model.opset()), "{name}");
    assert_eq!(
        meta(&m.metadata_props, keys::PEAK),
        Some(r.peak_bytes.to_string().as_str())
    );
    assert_eq!(
        meta(&m.metadata_props, keys::BUDGET),
        Some(r.budget_bytes.to_string().as_str())
    );
    let graph = m.graph.as_ref().unwrap();
    let orig = src.proto.graph.as_ref().unwrap();
    assert_eq!(
        graph.initializer, orig.initializer,
        "{name}: parameters kept"
    );
    assert_eq!(graph.input, orig.input);
    assert_eq!(graph.output, orig.output);

    // One node per compute (views re-derived for recomputations aside), plan order.
    let implicit = graph
        .node
        .iter()
        .filter(|n| meta(&n.metadata_props, keys::IMPLICIT).is_some())
        .count();
    assert_eq!(implicit, stats.implicit_nodes);
    assert_eq!(graph.node.len() - implicit, computes(&r.plan), "{name}");
    let mut k = 0;
    for op in &r.plan {
        if let Instr::Compute(i) = *op {
            while meta(&graph.node[k].metadata_props, keys::IMPLICIT).is_some() {
                k += 1;
            }
            let n = &graph.node[k];
            assert_eq!(
                meta(&n.metadata_props, keys::NODE),
                Some(i.to_string().as_str())
            );
            assert!(
                n.name().starts_with(&g.nodes[i].name),
                "{name}: {}",
                n.name()
            );
            assert_eq!(
                n.domain() == DOMAIN,
                !g.nodes[i].recomputable,
                "{}",
                n.name()
            );
            k += 1;
        }
    }
    // Recomputations: renamed copies writing new names.
    let recomputes: Vec<_> = graph
        .node
        .iter()
        .filter(|n| meta(&n.metadata_props, keys::RECOMPUTE).is_some())
        .collect();
    assert!(
        !recomputes.is_empty(),
        "{name}: the budget forces recomputation"
    );
    assert_eq!(recomputes.len(), stats.recomputes);
    for n in &recomputes {
        assert!(n.name().contains("/recompute"), "{}", n.name());
        assert!(n.output.iter().all(|o| o.is_empty() || o.contains("__r")));
    }
    assert_ssa(graph);
    // Loss, backward and optimizer in the custom domain; backward ops named after
    // their forward op.
    let custom: Vec<_> = graph.node.iter().filter(|n| n.domain() == DOMAIN).collect();
    assert_eq!(
        custom.len(),
        g.nodes.iter().filter(|n| !n.recomputable).count(),
        "{name}"
    );
    for n in &custom {
        let fwd_op = n
            .attribute
            .iter()
            .find(|a| a.name() == "forward_op")
            .map(|a| String::from_utf8_lossy(a.s.as_ref().unwrap()).into_owned());
        match n.op_type() {
            "Loss" | "LossGrad" | "Optimizer" => assert!(fwd_op.is_none()),
            op => assert_eq!(Some(op.to_string()), fwd_op.map(|f| f + "Grad")),
        }
    }
    for op in ["Loss", "LossGrad", "Optimizer"] {
        assert_eq!(
            custom.iter().filter(|n| n.op_type() == op).count(),
            1,
            "{op}"
        );
    }

    // Read back: same graph, same plan, same peak.
    let back = read_rewrite(&out).unwrap();
    assert_eq!(back.plan, r.plan, "{name}");
    assert_eq!(
        serde_json::to_value(&back.graph).unwrap(),
        serde_json::to_value(&g).unwrap(),
        "{name}"
    );
    assert_eq!(back.predicted_peak_bytes, r.peak_bytes);
    assert_eq!(back.budget_bytes, r.budget_bytes);
    assert_eq!(serde_json::json!(back.solver), serde_json::json!(solver));
    assert_eq!(back.implicit_nodes, stats.implicit_nodes);
    let o = back.options;
    assert_eq!(
        (o.optimizer, o.precision, o.loss),
        (opts.optimizer, opts.precision, opts.loss)
    );
    assert_eq!(back.bindings.batch, Some(batch));
    let replayed = replay(&back.graph, &back.plan).unwrap();
    assert_eq!(replayed.peak_bytes, r.peak_bytes, "{name}");
    assert_eq!(replayed.recompute_cost, r.recompute_flops);
    eprintln!(
        "{name} {solver:?}: {} nodes ({} computes, {} recomputes, {} implicit views, {} custom), {} frees, {} bytes",
        stats.nodes, stats.computes, stats.recomputes, stats.implicit_nodes, stats.custom_nodes, stats.frees, stats.bytes
    );
    bytes.len()
}

#[test]
fn mlp_round_trips() {
    round_trip("mlp", 8, 0.6, Solver::Greedy);
}

#[test]
fn resnet18_round_trips() {
    round_trip("resnet18", 8, 0.6, Solver::Greedy);
}

#[test]
fn transformer_views_round_trip() {
    // Reshapes and transposes alias storages: recomputations re-derive stale views.
    round_trip("transformer", 2, 0.5, Solver::Greedy);
    round_trip("transformer", 2, 0.5, Solver::Sqrt);
}

#[test]
fn training_options_round_trip() {
    // Autocast copies are extra outputs of forward kernels; the options are recorded.
    let opts = TrainOptions {
        optimizer: Optimizer::Momentum,
        precision: Precision::AmpFp16,
        loss: Loss::Sum,
        ..Default::default()
    };
    round_trip_with("cnn", 4, 0.6, Solver::Greedy, &opts);
}

#[test]
fn no_recompute_plan_is_the_model_plus_training_ops() {
    let (src, g, r) = planned("mlp", 4, 0.99, Solver::None);
    let (m, stats) = rewrite(&src, &g, &r).unwrap();
    assert_eq!(stats.recomputes, 0);
    let graph = m.graph.unwrap();
    let fwd: Vec<_> = graph.node.iter().filter(|n| n.domain() != DOMAIN).collect();
    let orig = &src.proto.graph.as_ref().unwrap().node;
    assert_eq!(fwd.len(), orig.len());
    for (a, b) in fwd.iter().zip(orig) {
        assert_eq!(
            (&a.op_type, &a.input, &a.output, &a.attribute),
            (&b.op_type, &b.input, &b.output, &b.attribute)
        );
    }
}

#[test]
fn a_forward_node_first_run_after_a_recomputation_reads_the_new_version() {
    // Drop a forward activation at once and recompute it for its forward reader (what
    // an exact planner may do across a long skip connection).
    let (src, g, mut r) = planned("mlp", 4, 0.99, Solver::None);
    let base = g.no_recompute_plan();
    let (at, i, v) = base
        .iter()
        .enumerate()
        .find_map(|(k, op)| match *op {
            Instr::Compute(i) if g.nodes[i].recomputable && !g.nodes[i].outputs.is_empty() => {
                let v = g.nodes[i].outputs[0];
                let rd = g.nodes.iter().position(|n| n.inputs.contains(&v))?;
                g.nodes[rd].recomputable.then_some((k, i, v))
            }
            _ => None,
        })
        .unwrap();
    let mut p = base.clone();
    p.splice(at + 1..at + 1, [Instr::Free(v), Instr::Compute(i)]);
    let rep = replay(&g, &p).unwrap();
    r.plan = p;
    r.peak_bytes = rep.peak_bytes;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("early.onnx");
    let stats = write_loaded(&src, &g, &r, &out).unwrap();
    assert_eq!(stats.recomputes, 1);
    let m = ModelProto::decode(std::fs::read(&out).unwrap().as_slice()).unwrap();
    let reader = m
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .find(|n| meta(&n.metadata_props, keys::SOURCE_INPUTS).is_some())
        .expect("a first computation reads a recomputed tensor");
    assert!(reader.input.iter().any(|i| i.ends_with("__r1")));
    let back = read_rewrite(&out).unwrap();
    assert_eq!(back.plan, r.plan);
    assert_eq!(
        replay(&back.graph, &back.plan).unwrap().peak_bytes,
        rep.peak_bytes
    );
}

#[test]
fn a_plan_for_another_graph_is_refused() {
    let (src, _, _) = planned("mlp", 4, 0.6, Solver::Greedy);
    let (_, g2, r2) = planned("cnn", 4, 0.6, Solver::Greedy);
    let e = rewrite(&src, &g2, &r2).unwrap_err().to_string();
    assert!(e.contains("not this model's training step"), "{e}");
}

#[test]
fn bad_files_give_clear_errors() {
    let (src, g, r) = planned("mlp", 8, 0.6, Solver::Greedy);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mlp.rewrite.onnx");
    write_loaded(&src, &g, &r, &out).unwrap();
    let bytes = std::fs::read(&out).unwrap();

    let truncated = common::write_tmp(&dir, "truncated.onnx", &bytes[..bytes.len() / 2]);
    let e = read_rewrite(&truncated).unwrap_err().to_string();
    assert!(e.starts_with("not a valid ONNX model"), "{e}");
    let empty = common::write_tmp(&dir, "empty.onnx", b"");
    assert!(read_rewrite(&empty).is_err());

    let e = read_rewrite(&common::shipped("mlp.onnx"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not written by memplan's plan rewrite"), "{e}");

    // A node removed: the count recorded does not match.
    let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
    let nodes = &mut m.graph.as_mut().unwrap().node;
    let last = nodes.len() - 1;
    nodes.remove(last);
    let cut = common::write_tmp(&dir, "cut.onnx", &common::encode(&m));
    let e = read_rewrite(&cut).unwrap_err().to_string();
    assert!(e.starts_with("memplan rewrite:"), "{e}");

    // A recomputation renamed.
    let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
    let nodes = &mut m.graph.as_mut().unwrap().node;
    let a = nodes
        .iter()
        .position(|n| n.name().ends_with("/recompute1"))
        .unwrap();
    nodes[a].name = Some("renamed".into());
    let renamed = common::write_tmp(&dir, "renamed.onnx", &common::encode(&m));
    let e = read_rewrite(&renamed).unwrap_err().to_string();
    assert!(e.contains("should be named"), "{e}");

    // A newer format version.
    let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
    for e in &mut m.metadata_props {
        if e.key.as_deref() == Some(keys::VERSION) {
            e.value = Some("2".into());
        }
    }
    let v2 = common::write_tmp(&dir, "v2.onnx", &common::encode(&m));
    let e = read_rewrite(&v2).unwrap_err().to_string();
    assert!(e.contains("version 2 is not supported"), "{e}");
}

fn memplan(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_writes_a_rewrite_that_matches_plan_json() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.onnx");
    let json = dir.path().join("plan.json");
    let model = common::shipped("resnet18.onnx");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let o = memplan(&[
        "plan",
        &s(&model),
        "--batch",
        "4",
        "--budget",
        "0.6",
        "--solver",
        "greedy",
        "--rewrite",
        &s(&out),
        "-o",
        &s(&json),
    ]);
    // Greedy cannot meet 60 %: both files are written for the lowest-peak plan, and
    // the exit status says the budget was not met.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("no plan fits the budget"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let plan: Vec<Instr> = doc["plan"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| {
            let id = op["id"].as_u64().unwrap() as usize;
            match op["op"].as_str().unwrap() {
                "compute" => Instr::Compute(id),
                _ => Instr::Free(id),
            }
        })
        .collect();
    let back = read_rewrite(&out).unwrap();
    assert_eq!(back.plan, plan);
    assert_eq!(
        serde_json::to_value(&back.graph).unwrap(),
        doc["graph"],
        "the graph read back is the one plan.json holds"
    );
    assert_eq!(
        replay(&back.graph, &back.plan).unwrap().peak_bytes,
        doc["predicted_peak_bytes"].as_u64().unwrap()
    );
    assert!(
        back.summary().contains("planned by greedy"),
        "{}",
        back.summary()
    );

    // memplan's other commands say what the file is, in one line, without panicking.
    for cmd in [
        vec!["profile", &s(&out)],
        vec!["profile", &s(&out), "--batch", "4", "--train"],
        vec!["plan", &s(&out), "--batch", "4", "--budget", "0.5"],
    ] {
        let o = memplan(&cmd.iter().map(|a| a.as_ref()).collect::<Vec<&str>>());
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("memplan rewrite:"), "{err}");
        assert!(!err.contains("internal error"), "{err}");
    }

    // --rewrite needs an ONNX model.
    let o = memplan(&[
        "plan",
        "--dag",
        "x.json",
        "--budget",
        "0.5",
        "--rewrite",
        &s(&out),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--rewrite"), "{err}");
}
