//! The repository is self-contained: nothing a fresh clone builds, tests, benches or
//! runs in CI reads outside it (the team's reference folder beside the checkout is
//! not part of a user's clone).

use std::path::Path;

fn scan(dir: &Path, needle: &str, hits: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            scan(&p, needle, hits);
        } else if let Ok(text) = std::fs::read_to_string(&p) {
            for (i, line) in text.lines().enumerate() {
                if line.contains(needle) {
                    hits.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                }
            }
        }
    }
}

#[test]
fn nothing_reads_outside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Built by concatenation so this file does not match itself.
    let needle = format!("../{}", "shared");
    let mut hits = Vec::new();
    for d in ["src", "tests", "benches", ".ci"] {
        scan(&root.join(d), &needle, &mut hits);
    }
    assert!(
        hits.is_empty(),
        "reads outside the repository:\n{}",
        hits.join("\n")
    );
}

#[test]
fn benchmark_graphs_are_in_the_repository() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/remat-graphs");
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    assert!(readme.contains("Checkmate") && readme.contains("Moccasin"));
    let n = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "json")
        })
        .count();
    assert_eq!(n, 11);
}

/// The library's layers point one way (ARCHITECTURE.md, "Layers"): a module never
/// names a module above it. Each rule: the source files it covers and the crate
/// modules they may not name (`crate::x` paths, `use` lines and doc links alike).
#[test]
fn layers_point_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let above_numeric = [
        "ops", "exec", "train", "remat", "memory", "report", "fit", "infer", "onnx",
    ];
    let rules: &[(&str, &[&str])] = &[
        (
            "ir",
            &[
                "numeric", "ops", "exec", "train", "remat", "memory", "report", "fit", "infer",
                "onnx",
            ],
        ),
        ("numeric", &above_numeric),
        (
            "onnx",
            &[
                "ops", "exec", "train", "remat", "memory", "report", "fit", "infer",
            ],
        ),
        (
            "ops",
            &[
                "exec", "train", "remat", "memory", "report", "fit", "infer", "onnx",
            ],
        ),
        (
            "infer.rs",
            &["exec", "train", "remat", "memory", "report", "fit"],
        ),
        ("train", &["exec", "remat", "memory", "report", "fit"]),
        ("memory", &["exec", "remat", "report", "fit"]),
        ("units.rs", &above_numeric),
        ("choice.rs", &above_numeric),
    ];
    let mut hits = Vec::new();
    for (path, banned) in rules {
        for b in *banned {
            let mut h = Vec::new();
            let p = root.join(path);
            if p.is_dir() {
                scan(&p, &format!("crate::{b}"), &mut h);
            } else {
                let text = std::fs::read_to_string(&p).unwrap();
                for (i, line) in text.lines().enumerate() {
                    if line.contains(&format!("crate::{b}")) {
                        h.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                    }
                }
            }
            // `crate::ops` must not match `crate::ops_x`, nor `crate::onnx` `crate::onnx_x`.
            h.retain(|l| {
                let k = l.find(&format!("crate::{b}")).unwrap() + 7 + b.len();
                !l[k..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
            });
            hits.extend(
                h.into_iter()
                    .map(|l| format!("{path} may not name {b}: {l}")),
            );
        }
    }
    assert!(hits.is_empty(), "layering:\n{}", hits.join("\n"));
}

/// The library knows no command line: clap appears only in the binary (src/main.rs
/// and src/cmd/). (Library errors still name flags in places: `--batch`, `--dim`.)
#[test]
fn the_library_knows_no_command_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut hits = Vec::new();
    scan(&root, "clap", &mut hits);
    hits.retain(|h| {
        let p = h.split(':').next().unwrap_or("");
        !(p.ends_with("src/main.rs") || p.contains("src/cmd/"))
    });
    assert!(
        hits.is_empty(),
        "command line in the library:\n{}",
        hits.join("\n")
    );
}
