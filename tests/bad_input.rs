//! Every kind of bad input gets a one-line error naming the file (and node), a
//! non-zero exit, and never a panic.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

/// Runs `memplan profile` and returns (exit success, stderr).
fn profile(path: &Path, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .arg("profile")
        .arg(path)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a clean failure: non-zero exit, one `error:` line containing all `needles`.
fn fails_with(path: &Path, extra: &[&str], needles: &[&str]) {
    let (ok, _, err) = profile(path, extra);
    assert!(!ok, "expected failure for {path:?} {extra:?}");
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "'{n}' not in: {err}");
    }
}

#[test]
fn the_test_model_itself_profiles() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    let (ok, out, err) = profile(&p, &["--batch", "4", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["count"], 8 * 4 + 8 + 3 * 8 + 3);
    // x 64 B + h 128 B live while fc1 runs... peak is at relu: h + r = 256 B.
    assert_eq!(v["inference"]["activation_peak_bytes"], 4 * 8 * 4 * 2);
}

#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = encode(&mlp());
    let p = write_tmp(&dir, "trunc.onnx", &bytes[..bytes.len() / 2]);
    fails_with(
        &p,
        &["--batch", "2"],
        &["trunc.onnx", "not a valid ONNX model"],
    );
}

#[test]
fn not_onnx_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "notes.txt", b"hello, this is not a model\n");
    fails_with(&p, &[], &["notes.txt", "not a valid ONNX model"]);
    let p = write_tmp(&dir, "empty.onnx", b"");
    fails_with(&p, &[], &["empty.onnx", "empty"]);
    let p = write_tmp(&dir, "png.onnx", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
    fails_with(&p, &[], &["png.onnx", "not a valid ONNX model"]);
    fails_with(
        Path::new("/nonexistent/model.onnx"),
        &[],
        &["/nonexistent/model.onnx", "cannot read"],
    );
    fails_with(dir.path(), &[], &["cannot read"]);
}

#[test]
fn cycle() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![
            node("Add", "a", &["x", "q"], &["p"]),
            node("Relu", "b", &["p"], &["q"]),
        ],
        vec![],
        vec![value_info("x", 1, &[D::N(2)])],
        vec![value_info("q", 1, &[D::N(2)])],
    );
    let p = write_tmp(&dir, "cycle.onnx", &encode(&m));
    fails_with(&p, &[], &["cycle.onnx", "cycle", "node '"]);
}

#[test]
fn undefined_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![node("Add", "adder", &["x", "ghost"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::N(2)])],
        vec![value_info("y", 1, &[D::N(2)])],
    );
    let p = write_tmp(&dir, "undef.onnx", &encode(&m));
    fails_with(&p, &[], &["undef.onnx", "adder", "ghost"]);
}

/// A dynamo export saved with `include_initializers=False` reads parameters nothing
/// defines: the error says how to export without weights instead.
#[test]
fn weights_left_out_of_the_export() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![node(
            "Gather",
            "node_embedding",
            &["model.embed_tokens.weight", "x"],
            &["y"],
        )],
        vec![],
        vec![value_info("x", 7, &[D::N(2)])],
        vec![value_info("y", 1, &[D::N(2), D::N(8)])],
    );
    let p = write_tmp(&dir, "noweights.onnx", &encode(&m));
    fails_with(
        &p,
        &[],
        &[
            "model.embed_tokens.weight",
            "include_initializers=False",
            "memplan-export",
        ],
    );
    // A name that is no parameter's gets no such advice.
    let (_, _, err) = profile(&write_tmp(&dir, "undef.onnx", &encode(&undefined())), &[]);
    assert!(!err.contains("memplan-export"), "{err}");
}

fn undefined() -> memplan::onnx::proto::ModelProto {
    model(
        vec![node("Add", "adder", &["x", "ghost"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::N(2)])],
        vec![value_info("y", 1, &[D::N(2)])],
    )
}

#[test]
fn wrong_arity() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![node("Relu", "r2", &["x", "x"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::N(2)])],
        vec![value_info("y", 1, &[D::N(2)])],
    );
    let p = write_tmp(&dir, "arity.onnx", &encode(&m));
    fails_with(&p, &[], &["arity.onnx", "r2", "Relu", "2 inputs"]);
}

#[test]
fn negative_and_overflowing_dims() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![node("Relu", "r", &["x"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::N(-3)])],
        vec![],
    );
    let p = write_tmp(&dir, "neg.onnx", &encode(&m));
    fails_with(&p, &[], &["neg.onnx", "negative"]);

    let mut w = weight("w", &[1]);
    w.dims = vec![-1, 4];
    w.raw_data = None;
    let m = model(vec![], vec![w], vec![], vec![]);
    let p = write_tmp(&dir, "neginit.onnx", &encode(&m));
    fails_with(&p, &[], &["neginit.onnx", "'w'", "negative"]);

    let big = 1i64 << 40;
    let m = model(
        vec![node("Relu", "r", &["x"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::N(big), D::N(big)])],
        vec![],
    );
    let p = write_tmp(&dir, "huge.onnx", &encode(&m));
    fails_with(&p, &[], &["huge.onnx", "overflow"]);

    // Overflow produced inside the graph: Expand to a huge shape.
    let m = model(
        vec![node("Expand", "ex", &["x", "s"], &["y"])],
        vec![ints("s", &[big, big, 16])],
        vec![value_info("x", 1, &[D::N(1)])],
        vec![],
    );
    let p = write_tmp(&dir, "expand.onnx", &encode(&m));
    fails_with(&p, &[], &["expand.onnx", "ex", "overflow"]);
}

#[test]
fn absurd_batch() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    fails_with(
        &p,
        &["--batch", "0"],
        &["mlp.onnx", "batch size 0", "(--batch)"],
    );
    fails_with(
        &p,
        &["--batch", "1099511627776"],
        &["mlp.onnx", "out of range"],
    );
    fails_with(&p, &["--batch", "-4"], &[]);
    fails_with(&p, &["--batch", "many"], &[]);
}

#[test]
fn unsupported_ops_are_listed() {
    let dir = tempfile::tempdir().unwrap();
    let mut custom = node("FusedThing", "f1", &["x"], &["z"]);
    custom.domain = Some("com.example".into());
    let m = model(
        vec![
            node("Frobnicate", "frob_a", &["x"], &["y"]),
            node("Frobnicate", "frob_b", &["y"], &["y2"]),
            custom,
        ],
        vec![],
        vec![value_info("x", 1, &[D::N(2)])],
        vec![],
    );
    let p = write_tmp(&dir, "unsup.onnx", &encode(&m));
    fails_with(
        &p,
        &[],
        &[
            "unsup.onnx",
            "Frobnicate (node 'frob_a')",
            "com.example.FusedThing (node 'f1')",
        ],
    );
}

#[test]
fn batch_contradicting_the_graph() {
    let dir = tempfile::tempdir().unwrap();
    // Input batch fixed to 1.
    let m = model(
        vec![node("Relu", "r", &["x"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::N(1), D::N(4)])],
        vec![],
    );
    let p = write_tmp(&dir, "fixed.onnx", &encode(&m));
    fails_with(
        &p,
        &["--batch", "8"],
        &["fixed.onnx", "batch size 8", "fixed to 1", "(--batch)"],
    );
    let (ok, out, _) = profile(&p, &["--json"]);
    assert!(ok);
    assert!(out.contains("\"batch\": 1"));

    // Batch symbolic at the input, but a Reshape hard-codes batch 1 inside.
    let m = model(
        vec![node("Reshape", "flat", &["x", "shape"], &["y"])],
        vec![ints("shape", &[1, 8])],
        vec![value_info("x", 1, &[D::S("batch"), D::N(2), D::N(4)])],
        vec![],
    );
    let p = write_tmp(&dir, "reshape.onnx", &encode(&m));
    assert!(profile(&p, &["--batch", "1"]).0);
    fails_with(
        &p,
        &["--batch", "8"],
        &["reshape.onnx", "flat", "cannot reshape"],
    );

    // A graph output declares a fixed batch the binding contradicts.
    let m = model(
        vec![node("Relu", "r", &["x"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::S("N"), D::N(4)])],
        vec![value_info("y", 1, &[D::N(1), D::N(4)])],
    );
    let p = write_tmp(&dir, "outfixed.onnx", &encode(&m));
    fails_with(
        &p,
        &["--batch", "8"],
        &["outfixed.onnx", "output 'y'", "fixed to 1"],
    );
}

#[test]
fn unbound_dims_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![node("Relu", "r", &["x"], &["y"])],
        vec![],
        vec![value_info("x", 1, &[D::S("batch"), D::S("seq")])],
        vec![],
    );
    let p = write_tmp(&dir, "seq.onnx", &encode(&m));
    fails_with(&p, &["--batch", "2"], &["seq.onnx", "'seq'", "--dim seq="]);
    fails_with(&p, &["--dim", "seq=4"], &["seq.onnx", "'batch'", "--batch"]);
    assert!(profile(&p, &["--batch", "2", "--dim", "seq=4"]).0);
    fails_with(
        &p,
        &["--batch", "2", "--dim", "seq=4", "--dim", "nope=3"],
        &["nope"],
    );
    fails_with(&p, &["--batch", "2", "--dim", "seq"], &["NAME=VALUE"]);
}

#[test]
fn shape_errors_name_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(
        vec![node("MatMul", "mm", &["x", "w"], &["y"])],
        vec![weight("w", &[5, 3])],
        vec![value_info("x", 1, &[D::S("batch"), D::N(4)])],
        vec![],
    );
    let p = write_tmp(&dir, "mm.onnx", &encode(&m));
    fails_with(
        &p,
        &["--batch", "2"],
        &["mm.onnx", "node 'mm' (MatMul)", "inner dimensions"],
    );

    // Corrupt weight payload: raw_data length does not match dims.
    let mut w = weight("w", &[4, 3]);
    w.raw_data = Some(vec![0u8; 7].into());
    let m = model(
        vec![node("MatMul", "mm", &["x", "w"], &["y"])],
        vec![w],
        vec![value_info("x", 1, &[D::S("batch"), D::N(4)])],
        vec![],
    );
    let p = write_tmp(&dir, "rawlen.onnx", &encode(&m));
    fails_with(
        &p,
        &["--batch", "2"],
        &["rawlen.onnx", "'w'", "raw_data holds 7 bytes"],
    );
}

/// Training-only flags on an inference profile are refused, not ignored.
#[test]
fn training_flags_need_train() {
    let m = shipped("cnn.onnx");
    for flag in [
        ["--freeze", "conv"],
        ["--trainable", "conv"],
        ["--weight-dtype", "bf16"],
    ] {
        let args = [&["--batch", "2"][..], &flag[..]].concat();
        fails_with(&m, &args, &[flag[0], "--train"]);
    }
}

/// A `--dag` file that is not a benchmark graph says so, and not that it is not ONNX.
#[test]
fn bad_dag_files() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text, needle) in [
        ("notjson.json", "nodes: 1", "JSON"),
        (
            "unknown.json",
            r#"{"nodes":[{"id":0,"name":"a","backward":false,"cost_cpu":1,"cost_ram":5}],"links":[{"source":0,"target":7}]}"#,
            "unknown node 7",
        ),
        (
            "negative.json",
            r#"{"nodes":[{"id":0,"name":"a","backward":false,"cost_cpu":1,"cost_ram":-5}],"links":[]}"#,
            "negative",
        ),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        let (ok, _, err) = run_memplan(&["plan", "--dag", p.to_str().unwrap(), "--budget", "0.5"]);
        assert!(!ok && !err.contains("panicked"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        for n in [name, "not a rematerialization DAG", needle] {
            assert!(err.contains(n), "'{n}' not in {err}");
        }
        assert!(!err.contains("ONNX"), "{err}");
    }
}

/// `--moe-routing` sizes experts; on a model without them it is an error, and an
/// unknown assumption or a capacity factor that is no positive number is refused.
#[test]
fn moe_routing_needs_experts_and_a_known_assumption() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    fails_with(
        &p,
        &["--batch", "2", "--moe-routing", "worst"],
        &[
            "routing 'worst'",
            "no mixture-of-experts routing",
            "(--moe-routing)",
        ],
    );
    for bad in ["even", "capacity=0", "capacity=-2", "capacity=nan"] {
        let (ok, _, err) = profile(&p, &["--batch", "2", "--moe-routing", bad]);
        assert!(!ok && err.contains("--moe-routing"), "{bad}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A device or a FIFO given as the model or as a JSON input is refused at once in
/// one line (before: `/dev/zero` was read until memory ran out, a FIFO blocked the
/// open forever).
#[cfg(unix)]
#[test]
fn special_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let model = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    let m = model.to_str().unwrap();
    for special in ["/dev/zero", fifo.to_str().unwrap()] {
        for args in [
            vec!["profile", special],
            vec!["plan", "--dag", special, "--budget", "1GiB"],
            vec![
                "plan", m, "--batch", "2", "--budget", "50%", "--costs", special,
            ],
        ] {
            let (ok, _, err) = common::run_memplan(&args);
            assert!(!ok, "{args:?}");
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            assert!(err.contains("not a regular file"), "{args:?}: {err}");
        }
    }
}

/// Standard output that goes away (`| head -1`) ends the command quietly and
/// successfully, as `cat` does; a full disk (`> /dev/full`) is one error line. Before,
/// both panicked in every command that prints.
#[cfg(unix)]
#[test]
fn failed_writes_to_standard_output() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let model = common::shipped("resnet50.onnx");
    let mut child = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args([
            "profile",
            model.to_str().unwrap(),
            "--batch",
            "8",
            "--train",
            "--detail",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("model"), "{first}");
    // The reader is dropped here: the rest (hundreds of KiB) meets a closed pipe.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(err.is_empty(), "{err}");

    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    for args in [
        vec!["profile", model.to_str().unwrap(), "--batch", "8"],
        vec!["fit", model.to_str().unwrap(), "--memory", "8GiB", "--json"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
            .args(&args)
            .stdout(full.try_clone().unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("cannot write to standard output"), "{err}");
    }
}

/// A graph output that is a sequence or an optional, declared as a tensor (or left
/// untyped) so that loading lets it through: one line naming it. Before, lowering
/// indexed the tensor table with `usize::MAX` (382 panics in a one-op campaign).
#[test]
fn a_sequence_or_optional_graph_output_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (op, name) in [("SequenceConstruct", "seq"), ("Optional", "opt")] {
        let m = model(
            vec![node(op, "maker", &["x"], &["y"])],
            vec![],
            vec![value_info("x", 1, &[D::N(2), D::N(3)])],
            vec![value_info("y", 1, &[D::N(2), D::N(3)])],
        );
        let p = write_tmp(&dir, &format!("{name}.onnx"), &encode(&m));
        fails_with(&p, &["--batch", "2"], &["'y'"]);
        fails_with(&p, &["--batch", "2", "--train"], &["'y'"]);
    }
}

/// Values past what memplan counts are one line each, never an overflow panic:
/// `--alloc-conf roundup_power2_divisions` of 2^55, a `--dag` node of 1e30 bytes, a
/// plan.json budget of 2^63 (which also left a 0-byte report behind), and
/// `--time-limit` of inf, 1e308 or NaN (bench did not check it).
#[test]
fn values_past_what_memplan_counts() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    let m = model.to_str().unwrap();
    let run = |args: &[&str]| {
        let (ok, _, err) = common::run_memplan(args);
        assert!(!err.contains("internal error"), "{args:?}: {err}");
        (ok, err)
    };
    // A division count this large only rounds as plain 512-byte blocks do.
    let (ok, err) = run(&[
        "profile",
        m,
        "--batch",
        "2",
        "--train",
        "--alloc-conf",
        "roundup_power2_divisions:36028797018963968",
    ]);
    assert!(ok, "{err}");
    let dag = dir.path().join("dag.json");
    std::fs::write(
        &dag,
        r#"{"graph": {"name": "x"}, "nodes": [{"id": 0, "name": "a", "cost_cpu": 1, "cost_ram": 1e30},
            {"id": 1, "name": "b", "cost_cpu": 1, "cost_ram": 10}], "links": [{"source": 0, "target": 1}]}"#,
    )
    .unwrap();
    let (ok, err) = run(&["plan", "--dag", dag.to_str().unwrap(), "--budget", "1GiB"]);
    assert!(!ok && err.contains("beyond what memplan counts"), "{err}");
    for v in ["inf", "1e308", "NaN"] {
        let (ok, err) = run(&["bench", m, "--time-limit", v]);
        assert!(!ok && err.contains("--time-limit"), "{err}");
    }
    let (plan, mut doc) = plan_json(&dir, m);
    doc["budget_bytes"] = serde_json::json!(1u64 << 63);
    std::fs::write(&plan, serde_json::to_vec(&doc).unwrap()).unwrap();
    let html = dir.path().join("r.html");
    let (ok, err) = run(&[
        "report",
        m,
        "--batch",
        "8",
        "--plan",
        plan.to_str().unwrap(),
        "-o",
        html.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("budget_bytes"), "{err}");
    assert!(!html.exists(), "a failed report leaves no file");
}

/// `plan MODEL --batch 8 --budget 100% -o plan.json` in `dir`: the file and its JSON.
fn plan_json(dir: &tempfile::TempDir, model: &str) -> (std::path::PathBuf, serde_json::Value) {
    let plan = dir.path().join("plan.json");
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        model,
        "--batch",
        "8",
        "--budget",
        "100%",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let doc = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    (plan, doc)
}

/// An output flag naming an input is refused, and the input is left as it was; an
/// output in a missing folder fails before any work.
#[test]
fn outputs_never_overwrite_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    let m = model.to_str().unwrap();
    let before = std::fs::read(&model).unwrap();
    for args in [
        vec!["plan", m, "--batch", "8", "--budget", "95%", "--rewrite", m],
        vec!["plan", m, "--batch", "8", "--budget", "95%", "-o", m],
        vec!["report", m, "--batch", "8", "-o", m],
    ] {
        let (ok, _, err) = common::run_memplan(&args);
        assert!(!ok && err.contains("does not overwrite"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    assert_eq!(std::fs::read(&model).unwrap(), before);
    let missing = dir.path().join("no/r.html");
    let (ok, _, err) =
        common::run_memplan(&["report", m, "--batch", "8", "-o", missing.to_str().unwrap()]);
    assert!(!ok && err.contains("cannot write"), "{err}");
}

/// A training chain of 60,000 forward and 60,000 backward nodes: planning recomputes
/// through the whole chain (the lowest-peak plan drops everything), which overflowed
/// the stack when `heuristics::ensure` recursed; and `greedy` stops at
/// `--time-limit` (it ran past 120 s on 50,000 nodes).
#[test]
fn deep_dags_plan_within_the_stack_and_the_time_limit() {
    let n = 60_000;
    let mut nodes = Vec::with_capacity(2 * n);
    let mut links = Vec::with_capacity(3 * n);
    for i in 0..n {
        nodes.push(
            serde_json::json!({"id": i, "name": format!("f{i}"), "cost_cpu": 1, "cost_ram": 100}),
        );
        if i + 1 < n {
            links.push(serde_json::json!({"source": i, "target": i + 1}));
        }
    }
    for i in 0..n {
        nodes.push(serde_json::json!({"id": n + i, "name": format!("b{i}"), "cost_cpu": 1, "cost_ram": 100, "backward": true}));
        // b_i reads the forward value it differentiates and the gradient before it.
        links.push(serde_json::json!({"source": n - 1 - i, "target": n + i}));
        if i > 0 {
            links.push(serde_json::json!({"source": n + i - 1, "target": n + i}));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let dag = dir.path().join("chain.json");
    let doc = serde_json::json!({"graph": {"name": "chain"}, "nodes": nodes, "links": links});
    std::fs::write(&dag, serde_json::to_vec(&doc).unwrap()).unwrap();
    // In a thread with a 512 KiB stack: recursion 60,000 deep cannot fit there.
    let path = dag.clone();
    std::thread::Builder::new()
        .stack_size(512 << 10)
        .spawn(move || {
            let g = memplan::remat::dag::load_dag(&path).unwrap();
            let r =
                memplan::remat::plan::plan(&g, u64::MAX, memplan::remat::plan::Solver::Sqrt, 2.0)
                    .unwrap();
            assert!(r.peak_bytes > 0);
        })
        .unwrap()
        .join()
        .unwrap();
    for solver in ["sqrt", "greedy"] {
        let t = std::time::Instant::now();
        let (_, out, err) = common::run_memplan(&[
            "plan",
            "--dag",
            dag.to_str().unwrap(),
            "--budget",
            "30%",
            "--solver",
            solver,
            "--time-limit",
            "2",
        ]);
        assert!(
            !err.contains("overflow") && !err.contains("internal error"),
            "{err}"
        );
        assert!(
            out.contains("lowest") || err.contains("no plan fits"),
            "{out}{err}"
        );
        // The limit bounds the walk; loading, replays and the report come on top.
        assert!(t.elapsed().as_secs() < 90, "{solver}: {:?}", t.elapsed());
    }
}

/// An opset of the default domain no onnx release defines is refused, not echoed
/// back as the model's format.
#[test]
fn out_of_range_opsets_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for v in [0i64, -3, 99_999] {
        let mut m = mlp();
        for o in &mut m.opset_import {
            if o.domain.as_deref().unwrap_or("").is_empty() {
                o.version = Some(v);
            }
        }
        let p = write_tmp(&dir, &format!("opset{v}.onnx"), &encode(&m));
        fails_with(
            &p,
            &["--batch", "2"],
            &[&format!("opset {v}"), "out of range"],
        );
    }
}

/// Costs no run can have are refused, in `--costs` (1e308 seconds summed to an
/// overhead of NaN %) and in a plan file's graph (negative costs gave -inf %); an
/// infeasible plan says so in plan.json (`"feasible": false`).
#[test]
fn costs_and_plans_that_no_run_can_have() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tmp(&dir, "mlp.onnx", &encode(&mlp()));
    let m = model.to_str().unwrap();
    let (plan, mut doc) = plan_json(&dir, m);
    assert_eq!(doc["feasible"], true);
    let names: Vec<String> = doc["graph"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap().to_string())
        .collect();
    let costs = dir.path().join("costs.json");
    let huge: serde_json::Map<String, serde_json::Value> = names
        .iter()
        .map(|n| (n.clone(), serde_json::json!(1e308)))
        .collect();
    std::fs::write(&costs, serde_json::to_vec(&huge).unwrap()).unwrap();
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        m,
        "--batch",
        "8",
        "--budget",
        "100%",
        "--costs",
        costs.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("seconds from 0"), "{err}");
    doc["graph"]["nodes"][0]["cost"] = serde_json::json!(-5.0);
    std::fs::write(&plan, serde_json::to_vec(&doc).unwrap()).unwrap();
    let (ok, _, err) = common::run_memplan(&[
        "verify",
        m,
        "--batch",
        "8",
        "--plan",
        plan.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("not a finite cost"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}
