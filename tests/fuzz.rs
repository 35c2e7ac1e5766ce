//! Property-based fuzzing (proptest) of everything memplan reads from a file: seed
//! models, plan files, costs and benchmark DAGs (tests/data/fuzz/) are mutated (bytes
//! flipped, set, inserted or cut; numbers swapped for extremes) and run through what a
//! command runs on them: loading, lowering, inference and the training schedule (with
//! a recompute plan), or the JSON readers. Any outcome but a panic passes: an error is
//! what bad input gets. docs/SECURITY.md.
//!
//! `PROPTEST_CASES` sets the cases per target (default 48 here); CI runs more.

mod common;

use std::path::{Path, PathBuf};

use proptest::prelude::*;

fn seed_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz")
}

/// The seed files whose names end in `suffix`, sorted.
fn seeds(suffix: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(seed_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p.file_name().unwrap().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no seeds *{suffix} in tests/data/fuzz");
    out
}

/// One edit of a seed's bytes.
#[derive(Debug, Clone)]
enum Edit {
    Flip(u32, u8),
    Set(u32, u8),
    Insert(u32, Vec<u8>),
    Cut(u32),
    /// Eight bytes at a position set to an extreme little-endian integer.
    Extreme(u32, u8),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let one = prop_oneof![
        (any::<u32>(), 1u8..=255).prop_map(|(p, b)| Edit::Flip(p, b)),
        (any::<u32>(), any::<u8>()).prop_map(|(p, b)| Edit::Set(p, b)),
        (any::<u32>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, v)| Edit::Insert(p, v)),
        any::<u32>().prop_map(Edit::Cut),
        (any::<u32>(), 0u8..5).prop_map(|(p, k)| Edit::Extreme(p, k)),
    ];
    prop::collection::vec(one, 1..6)
}

fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        if b.is_empty() {
            break;
        }
        let at = |p: u32, len: usize| p as usize % len;
        match e {
            Edit::Flip(p, x) => {
                let i = at(*p, b.len());
                b[i] ^= x;
            }
            Edit::Set(p, x) => {
                let i = at(*p, b.len());
                b[i] = *x;
            }
            Edit::Insert(p, v) => {
                let i = at(*p, b.len() + 1);
                b.splice(i..i, v.iter().copied());
            }
            Edit::Cut(p) => b.truncate(at(*p, b.len())),
            Edit::Extreme(p, k) => {
                let v: i64 = [i64::MAX, i64::MIN, -1, 1 << 40, 1 << 31][*k as usize];
                let i = at(*p, b.len());
                for (j, byte) in v.to_le_bytes().iter().enumerate() {
                    if let Some(x) = b.get_mut(i + j) {
                        *x = *byte;
                    }
                }
            }
        }
    }
    b
}

/// In JSON text, the `n`-th number replaced by an extreme one.
fn swap_number(text: &str, n: usize, k: usize) -> String {
    const EXTREMES: [&str; 6] = [
        "1e308",
        "-1",
        "18446744073709551615",
        "9223372036854775808",
        "-1e-308",
        "0",
    ];
    let bytes = text.as_bytes();
    let mut starts = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if (c.is_ascii_digit() || c == b'-') && (i == 0 || !bytes[i - 1].is_ascii_alphanumeric()) {
            let s = i;
            i += 1;
            while i < bytes.len() && (bytes[i].is_ascii_digit() || b".eE+-".contains(&bytes[i])) {
                i += 1;
            }
            starts.push((s, i));
        } else {
            i += 1;
        }
    }
    if starts.is_empty() {
        return text.to_string();
    }
    let (s, e) = starts[n % starts.len()];
    format!(
        "{}{}{}",
        &text[..s],
        EXTREMES[k % EXTREMES.len()],
        &text[e..]
    )
}

/// What `memplan profile --train` and `plan` run on a model file, with `--batch 2`
/// and, for a model whose batch is fixed, without.
fn run_model(path: &Path) {
    let Ok(model) = memplan::onnx::load_model(path) else {
        return;
    };
    for batch in [Some(2), None] {
        run_bound(&model, batch);
    }
}

fn run_bound(model: &memplan::ir::Model, batch: Option<u64>) {
    use memplan::infer::{infer, Bindings};
    let b = Bindings {
        batch,
        ..Default::default()
    };
    let Ok(m) = memplan::infer::lower::lower(model, &b) else {
        return;
    };
    let Ok(inf) = infer(&m, &b) else {
        return;
    };
    let _ = memplan::memory::profile_inference(&m.graph, &inf);
    let opts = memplan::train::TrainOptions {
        loss: memplan::train::Loss::Mean,
        ..Default::default()
    };
    if let Ok(s) = memplan::train::build_schedule(&m, &inf, &opts) {
        let _ = memplan::memory::simulate(&s);
        if let Ok(step) = memplan::step::build(model, &b, &opts, "fuzz") {
            let budget = step.graph.baseline_peak().unwrap_or(0) / 2;
            let _ = memplan::remat::plan::plan(
                &step.graph,
                budget.max(1),
                memplan::remat::plan::Solver::Greedy,
                0.5,
            );
        }
    }
}

/// Every seed model as it is, the crash cases among them (issue 49: a Col2Im with a
/// block or image of 2^40 per side, a DepthToSpace with blocksize 2^33, multiplied
/// unchecked in their shape rules), runs without a panic.
#[test]
fn seeds_never_panic() {
    for (name, _) in seeds(".onnx") {
        let path = seed_dir().join(&name);
        assert!(
            std::panic::catch_unwind(|| run_model(&path)).is_ok(),
            "{name} panicked"
        );
    }
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// Mutated models: loading, lowering, inference, the training step and a plan.
    #[test]
    fn models_never_panic(seed in 0usize..64, e in edits()) {
        let seeds = seeds(".onnx");
        let (name, bytes) = &seeds[seed % seeds.len()];
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, apply(bytes, &e)).unwrap();
        run_model(&p);
    }

    /// Mutated plan files, costs and DAGs, byte by byte and number by number.
    #[test]
    fn json_inputs_never_panic(
        seed in 0usize..64,
        e in edits(),
        n in any::<usize>(),
        k in any::<usize>(),
        bytewise in any::<bool>(),
    ) {
        let mut all = seeds(".plan.json");
        all.extend(seeds(".costs.json"));
        all.extend(seeds(".dag.json"));
        let (name, bytes) = &all[seed % all.len()];
        let text = if bytewise {
            apply(bytes, &e)
        } else {
            swap_number(&String::from_utf8_lossy(bytes), n, k).into_bytes()
        };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, &text).unwrap();
        if name.ends_with(".plan.json") {
            if let Ok(f) = memplan::remat::planfile::PlanFile::read(&p) {
                let _ = memplan::remat::graph::replay(&f.graph, &f.plan);
                let _ = f.infeasible();
            }
        } else if name.ends_with(".costs.json") {
            let _ = memplan::remat::costs::load_costs(&p);
        } else if let Ok(g) = memplan::remat::dag::load_dag(&p) {
            let budget = g.baseline_peak().unwrap_or(0) / 2;
            let _ = memplan::remat::plan::plan(&g, budget.max(1), memplan::remat::plan::Solver::Greedy, 0.5);
        }
    }
}

/// The seeds themselves load and plan (the harness mutates something that works).
#[test]
fn the_seeds_work() {
    for (name, _) in seeds(".onnx") {
        let p = seed_dir().join(&name);
        let m = memplan::onnx::load_model(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!m.graph.order.is_empty(), "{name}");
    }
    assert!(memplan::remat::planfile::PlanFile::read(&seed_dir().join("mlp.plan.json")).is_ok());
    assert!(memplan::remat::costs::load_costs(&seed_dir().join("mlp.costs.json")).is_ok());
    assert!(memplan::remat::dag::load_dag(&seed_dir().join("chain.dag.json")).is_ok());
}
