//! Keeps the committed census honest (docs/CENSUS.md, tools/census/results.json,
//! made by `python tools/census/census.py`): the counts CENSUS.md states are the ones
//! results.json's per-model list gives, the pass rates meet the bar, and the CI
//! subset (models/census/: one shape-only export per family, with the census's
//! recorded status and numbers in manifest.json) gives the same status, step peak
//! and saved bytes when memplan is run on it now, with no panic anywhere.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn json(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// `<suite>: <A> attempted, <E> exported, <P> profiled` lines of CENSUS.md.
fn stated_counts() -> BTreeMap<String, [u64; 3]> {
    let text = std::fs::read_to_string(root().join("docs/CENSUS.md")).unwrap();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((suite, rest)) = line.split_once(": ") else {
            continue;
        };
        let parts: Vec<&str> = rest.split(", ").collect();
        let num = |i: usize, what: &str| -> Option<u64> {
            parts.get(i)?.strip_suffix(what)?.trim().parse().ok()
        };
        if let (3, Some(a), Some(e), Some(p)) = (
            parts.len(),
            num(0, " attempted"),
            num(1, " exported"),
            num(2, " profiled"),
        ) {
            out.insert(suite.trim().to_string(), [a, e, p]);
        }
    }
    out
}

#[test]
fn stated_counts_are_the_results() {
    let r = json(&root().join("tools/census/results.json"));
    let stated = stated_counts();
    assert!(
        stated.contains_key("torchvision") && stated.contains_key("transformers"),
        "CENSUS.md states no counts: {stated:?}"
    );
    let mut from_models: BTreeMap<String, [u64; 3]> = BTreeMap::new();
    for (name, m) in r["models"].as_object().unwrap() {
        let suite = m["suite"].as_str().unwrap().to_string();
        let status = m["status"].as_str().unwrap();
        assert_ne!(status, "panic", "{name}: memplan panicked");
        let c = from_models.entry(suite).or_default();
        c[0] += 1;
        c[1] += u64::from(status != "export_failed");
        c[2] += u64::from(status == "ok");
    }
    for (suite, s) in r["suites"].as_object().unwrap() {
        let want = [
            s["attempted"].as_u64().unwrap(),
            s["exported"].as_u64().unwrap(),
            s["profiled"].as_u64().unwrap(),
        ];
        assert_eq!(
            stated.get(suite),
            Some(&want),
            "{suite}: CENSUS.md vs results.json"
        );
        assert_eq!(
            from_models.get(suite),
            Some(&want),
            "{suite}: per-model list"
        );
    }
    // The bar: at least 95 % of what exports profiles.
    for suite in ["torchvision", "transformers"] {
        let [_, e, p] = stated[suite];
        assert!(
            p as f64 >= 0.95 * e as f64,
            "{suite}: {p} of {e} exported models profile"
        );
    }
}

#[test]
fn subset_reproduces_the_census() {
    let dir = root().join("models/census");
    let m = json(&dir.join("manifest.json"));
    let args: Vec<String> = m["memplan_args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let files = m["files"].as_object().unwrap();
    assert!(files.len() >= 40, "{} files", files.len());
    let mut bad = Vec::new();
    for (file, want) in files {
        let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
            .arg("profile")
            .arg(dir.join(file))
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() != Some(101) && !stderr.contains("panicked"),
            "{file}: memplan panicked: {stderr}"
        );
        let status = if out.status.success() { "ok" } else { "error" };
        if status != want["status"].as_str().unwrap() {
            bad.push(format!(
                "{file}: {status}, census {}: {stderr}",
                want["status"]
            ));
            continue;
        }
        if status == "error" {
            // One line, naming what stops it (the census keeps its start).
            // The census ran memplan on the bare file name: compare what follows it.
            let after = |s: &str| -> String {
                let key = format!("{file}: ");
                s.split_once(&key).map_or(s, |(_, r)| r).to_string()
            };
            let reason = after(want["reason"].as_str().unwrap_or(""));
            let first = stderr.lines().next().unwrap_or("");
            if stderr.lines().count() != 1
                || reason.is_empty()
                || !after(first).starts_with(&reason)
            {
                bad.push(format!("{file}: error '{first}', census '{reason}'"));
            }
            continue;
        }
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        for key in ["peak_bytes", "saved_activation_bytes"] {
            let got = v["training"][key].as_u64();
            if got != want[key].as_u64() {
                bad.push(format!("{file}: {key} {got:?}, census {}", want[key]));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the census subset changed:\n{}",
        bad.join("\n")
    );
}
