//! Every figure `profile --json` prints for every model in models/ is what it was
//! when recorded (tests/data/golden/profile.json): inference, and a training step
//! under AdamW fp32 and SGD amp-bf16, at batch 2. Refactors must not change one
//! number. Each case keeps a digest of the whole JSON (timeline included) and its
//! scalar figures by path, so a difference names the figure.
//!
//! `MEMPLAN_BLESS=1 cargo test --test golden` rewrites the file: only for an
//! intended change of the numbers, said in the commit.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

const MODES: [(&str, &[&str]); 3] = [
    ("inference", &[]),
    (
        "train_adamw_fp32",
        &["--train", "--optimizer", "adamw", "--precision", "fp32"],
    ),
    (
        "train_sgd_amp_bf16",
        &["--train", "--optimizer", "sgd", "--precision", "amp-bf16"],
    ),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// FNV-1a over the canonical (sorted-key) JSON text.
fn digest(v: &Value) -> String {
    let text = serde_json::to_string(v).unwrap();
    let mut h: u64 = 0xcbf29ce484222325;
    for b in text.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// Scalar figures by JSON path, arrays of objects (the timeline) left to the digest.
fn figures(v: &Value, path: &str, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                figures(x, &p, out);
            }
        }
        Value::Array(a) if a.iter().any(|x| x.is_object()) && a.len() > 8 => {
            out.insert(format!("{path}.len"), Value::from(a.len()));
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                figures(x, &format!("{path}[{i}]"), out);
            }
        }
        x => {
            out.insert(path.to_string(), x.clone());
        }
    }
}

fn run(model: &str, args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memplan"))
        .current_dir(root())
        .args(["profile", model, "--batch", "2", "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{model} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn profile_figures_are_unchanged() {
    let file = root().join("tests/data/golden/profile.json");
    let mut models: Vec<String> = std::fs::read_dir(root().join("models"))
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().into_string().unwrap();
            n.ends_with(".onnx").then(|| format!("models/{n}"))
        })
        .collect();
    models.sort();
    let mut now = serde_json::Map::new();
    for m in &models {
        for (mode, args) in MODES {
            let v = run(m, args);
            let mut f = BTreeMap::new();
            figures(&v, "", &mut f);
            now.insert(
                format!("{m} {mode}"),
                serde_json::json!({ "digest": digest(&v), "figures": f }),
            );
        }
    }
    if std::env::var("MEMPLAN_BLESS").is_ok_and(|v| v == "1") {
        let text = serde_json::to_string_pretty(&Value::Object(now)).unwrap();
        std::fs::write(&file, text + "\n").unwrap();
        return;
    }
    let text = std::fs::read_to_string(&file).unwrap();
    let want: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
    let mut bad = Vec::new();
    for (k, w) in &want {
        let Some(n) = now.get(k) else {
            bad.push(format!("{k}: no longer produced"));
            continue;
        };
        if n["digest"] == w["digest"] {
            continue;
        }
        let (wf, nf) = (
            w["figures"].as_object().unwrap(),
            n["figures"].as_object().unwrap(),
        );
        let mut diffs: Vec<String> = wf
            .iter()
            .filter(|(p, x)| nf.get(*p) != Some(x))
            .map(|(p, x)| format!("{p}: {x} -> {}", nf.get(p).unwrap_or(&Value::Null)))
            .collect();
        diffs.extend(
            nf.keys()
                .filter(|p| !wf.contains_key(*p))
                .map(|p| format!("{p}: new")),
        );
        if diffs.is_empty() {
            diffs.push("the timeline differs".into());
        }
        bad.push(format!("{k}: {}", diffs.join("; ")));
    }
    for k in now.keys().filter(|k| !want.contains_key(*k)) {
        bad.push(format!("{k}: not recorded (MEMPLAN_BLESS=1 to record)"));
    }
    assert!(
        bad.is_empty(),
        "profile figures changed:\n{}",
        bad.join("\n")
    );
    assert_eq!(want.len(), models.len() * MODES.len());
}
