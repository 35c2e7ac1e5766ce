//! The repository is self-contained: nothing a fresh clone builds, tests, benches or
//! runs in CI reads outside it (the team's reference folder beside the checkout is
//! not part of a user's clone).

use std::path::Path;

/// Lines containing `needle` in `path` (a file, or every file under a folder).
fn scan(path: &Path, needle: &str, hits: &mut Vec<String>) {
    if path.is_dir() {
        for e in std::fs::read_dir(path).unwrap() {
            scan(&e.unwrap().path(), needle, hits);
        }
    } else if let Ok(text) = std::fs::read_to_string(path) {
        for (i, line) in text.lines().enumerate() {
            if line.contains(needle) {
                hits.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
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
            "infer",
            &[
                "exec", "train", "remat", "memory", "report", "fit", "parallel",
            ],
        ),
        (
            "train",
            &["exec", "remat", "memory", "report", "fit", "parallel"],
        ),
        ("memory", &["exec", "remat", "report", "fit", "parallel"]),
        ("parallel", &["exec", "report", "fit"]),
        ("units.rs", &above_numeric),
        ("choice.rs", &above_numeric),
    ];
    let mut hits = Vec::new();
    for (path, banned) in rules {
        for b in *banned {
            assert!(root.join(path).exists(), "no src/{path}");
            let mut h = Vec::new();
            scan(&root.join(path), &format!("crate::{b}"), &mut h);
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
/// and src/cmd/), and no library code (comments aside) names a flag: errors name
/// a `Setting`, which the binary turns into its flag (`cmd::flag_for`).
#[test]
fn the_library_knows_no_command_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut hits = Vec::new();
    scan(&root, "clap", &mut hits);
    let mut flags = Vec::new();
    scan(&root, "--", &mut flags);
    hits.extend(flags.into_iter().filter(|h| {
        let line = h.splitn(3, ':').nth(2).unwrap_or("").trim();
        let code = line.split("//").next().unwrap_or("");
        // `--name` in code; NVRTC's own options are not memplan's flags.
        code.match_indices("--")
            .any(|(i, _)| code[i + 2..].starts_with(|c: char| c.is_ascii_lowercase()))
            && !code.contains("--std=")
    }));
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

/// Files by responsibility: no hand-written source file (library, tests,
/// benches) over 1200 lines (src/onnx/proto.rs is generated by tools/protogen).
#[test]
fn no_source_file_over_1200_lines() {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("onnx/proto.rs") {
                let n = std::fs::read_to_string(&p).unwrap().lines().count();
                if n > 1200 {
                    out.push(format!("{}: {n} lines", p.display()));
                }
            }
        }
    }
    let mut long = Vec::new();
    for d in ["src", "tests", "benches"] {
        walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join(d), &mut long);
    }
    assert!(long.is_empty(), "split these:\n{}", long.join("\n"));
}

/// One owner of the training step (src/step.rs): no other library file lowers a
/// model or builds a training schedule (the stages' own definitions aside, and
/// inference, which lowers before it infers: src/infer/mod.rs).
#[test]
fn the_training_step_is_built_in_one_place() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut hits = Vec::new();
    for needle in [
        "build_schedule(",
        "lower::lower(",
        "lower::lowered(",
        "lowered(load",
    ] {
        scan(&root, needle, &mut hits);
    }
    hits.retain(|h| {
        let (p, line) = (
            h.split(':').next().unwrap_or(""),
            h.splitn(3, ':').nth(2).unwrap_or(""),
        );
        let code = line.trim_start();
        !(p.ends_with("src/step.rs")
            || (p.ends_with("src/infer/mod.rs") && code.contains("lower::lower(model, bindings)"))
            || code.starts_with("//")
            || code.starts_with("pub fn build_schedule(")
            || code.contains("fn lowered("))
    });
    assert!(
        hits.is_empty(),
        "the training step built outside src/step.rs:\n{}",
        hits.join("\n")
    );
}

/// No import circle between the library's top-level modules (src/<m>.rs, src/<m>/),
/// counting `crate::<m>` in code (comments and doc links aside).
#[test]
fn no_import_circle() {
    use std::collections::{BTreeMap, BTreeSet};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut tops = BTreeSet::new();
    for e in std::fs::read_dir(&root).unwrap() {
        let p = e.unwrap().path();
        let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
        if (p.is_dir() || p.extension().is_some_and(|x| x == "rs"))
            && !["main", "lib", "cmd"].contains(&stem.as_str())
        {
            tops.insert(stem);
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for t in &tops {
        let mut hits = Vec::new();
        for p in [root.join(t), root.join(format!("{t}.rs"))] {
            if p.exists() {
                scan(&p, "crate::", &mut hits);
            }
        }
        for h in hits {
            let line = h.splitn(3, ':').nth(2).unwrap_or("");
            let code = line.split("//").next().unwrap_or("");
            for part in code.split("crate::").skip(1) {
                let name: String = part
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if &name != t && tops.contains(&name) {
                    edges.entry(t.clone()).or_default().insert(name);
                }
            }
        }
    }
    // A circle: some module reaches itself.
    let mut circles = Vec::new();
    for start in &tops {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<String> = edges.get(start).into_iter().flatten().cloned().collect();
        while let Some(m) = todo.pop() {
            if m == *start {
                circles.push(start.clone());
                break;
            }
            if seen.insert(m.clone()) {
                todo.extend(edges.get(&m).into_iter().flatten().cloned());
            }
        }
    }
    assert!(
        circles.is_empty(),
        "modules on an import circle: {circles:?} ({edges:?})"
    );
}

/// models/ holds the models and the script that makes them (issue 51: files by kind):
/// ONNX files, folders of them (census/, llm/), export.py and README.md, at most 45
/// entries. What PyTorch measured goes to tests/data/pytorch/, measurement runs to
/// docs/benchmarks/data/, PyTorch scripts to tools/pytorch/.
#[test]
fn models_holds_models() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut n = 0;
    let mut other = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        n += 1;
        let model =
            p.is_dir() || name.ends_with(".onnx") || name == "export.py" || name == "README.md";
        if !model {
            other.push(name);
        }
    }
    assert!(n <= 45, "models/ holds {n} entries (at most 45)");
    assert!(
        other.is_empty(),
        "not models: {other:?} (references: tests/data/pytorch/; runs: docs/benchmarks/data/; \
         scripts: tools/pytorch/)"
    );
}

/// The repository's files: `git ls-files` where this is a git checkout, else every
/// file under the root but target/ and dot-folders other than .ci/. Paths relative to
/// the root, with `/`.
fn repository_files(root: &Path) -> Vec<String> {
    if let Ok(out) = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
    {
        if out.status.success() && !out.stdout.is_empty() {
            return String::from_utf8_lossy(&out.stdout)
                .split('\0')
                .filter(|f| !f.is_empty() && root.join(f).is_file())
                .map(str::to_string)
                .collect();
        }
    }
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if name != "target" && (!name.starts_with('.') || name == ".ci") {
                    walk(root, &p, out);
                }
            } else {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy();
                out.push(rel.replace('\\', "/"));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

/// Test inputs read by directory (a test or tool takes every file there, or derives
/// their names): (folder, file-name ending).
const READ_BY_DIRECTORY: [(&str, &str); 5] = [
    // tests/fuzz.rs: every seed of the folder.
    ("tests/data/fuzz/", ".json"),
    // tests/repo.rs counts them; benches/planner.sh and tests/planner.rs take `*.json`.
    ("tests/data/remat-graphs/", ".json"),
    // tests/conformance.rs: the conformance suite's data.
    ("tests/data/conformance/", ".json"),
    // tests/finetune.rs `op_plan_file`: the plan beside the Python file a
    // reference's `checkpoint_file` names.
    ("tests/data/pytorch/op_plans/", ".plan.json"),
    // memplan-export's model configs, found by the model's name.
    ("python/memplan_export/configs/", ".json"),
];

/// Every JSON file in the repository is read by a test or named where the command that
/// writes or reads it is given: its path, or a tail of it from a folder on (its file
/// name at least), appears in a file of tests/, src/, benches/, tools/, python/ or .ci/
/// that is not itself JSON, or in any Markdown file (docs/, the READMEs). A path under a
/// folder the file is no longer in does not count. [`READ_BY_DIRECTORY`] aside.
#[test]
fn every_json_file_is_read_or_named() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = repository_files(root);
    let namers = ["tests/", "src/", "benches/", "tools/", "python/", ".ci/"];
    // Every `....json` token of the naming files: the characters of a path before
    // ".json", leading "./" and "/" trimmed.
    let mut tokens = std::collections::BTreeSet::new();
    for f in &files {
        let namer = f.ends_with(".md")
            || (namers.iter().any(|d| f.starts_with(d)) && !f.ends_with(".json"));
        let Some(text) = namer
            .then(|| std::fs::read_to_string(root.join(f)).ok())
            .flatten()
        else {
            continue;
        };
        let b = text.as_bytes();
        let path_byte = |c: u8| c.is_ascii_alphanumeric() || b"_.-/".contains(&c);
        let mut from = 0;
        while let Some(i) = text[from..].find(".json").map(|i| i + from) {
            let mut s = i;
            while s > 0 && path_byte(b[s - 1]) {
                s -= 1;
            }
            let t = text[s..i + 5].trim_start_matches(['.', '/']);
            if t.len() > 5 {
                tokens.insert(t.to_string());
            }
            from = i + 5;
        }
    }
    let named = |p: &str| {
        tokens.iter().any(|t| {
            p.ends_with(t.as_str())
                && (p.len() == t.len() || p.as_bytes()[p.len() - t.len() - 1] == b'/')
        })
    };
    let jsons: Vec<&String> = files.iter().filter(|f| f.ends_with(".json")).collect();
    assert!(jsons.len() > 100, "{} JSON files found", jsons.len());
    let unnamed: Vec<&&String> = jsons
        .iter()
        .filter(|f| {
            !READ_BY_DIRECTORY
                .iter()
                .any(|(d, end)| f.starts_with(d) && f.ends_with(end))
                && !named(f)
        })
        .collect();
    assert!(
        unnamed.is_empty(),
        "JSON files no test reads and no doc names (measurement runs: docs/benchmarks/data/ \
         and its README.md; references: tests/data/pytorch/ and its README.md): {unnamed:?}"
    );
}

/// Functions a reader can hold in mind: clippy's `too_many_lines` is on at 150
/// lines (clippy.toml, Cargo.toml), and the functions let past it are an
/// allow-list that may only shrink (each allow says why it is long).
#[test]
fn long_functions_are_a_short_allow_list() {
    const ALLOWED: usize = 9;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let clippy = std::fs::read_to_string(dir.join("clippy.toml")).unwrap();
    assert!(
        clippy.contains("too-many-lines-threshold = 150"),
        "{clippy}"
    );
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
    assert!(manifest.contains("too_many_lines = \"warn\""));
    let mut hits = Vec::new();
    for d in ["src", "tests", "benches"] {
        scan(&dir.join(d), "allow(clippy::too_many_lines)", &mut hits);
    }
    hits.retain(|h| !h.contains("tests/repo.rs"));
    assert!(
        hits.len() <= ALLOWED,
        "{} long functions allowed, at most {ALLOWED}:\n{}",
        hits.len(),
        hits.join("\n")
    );
    assert!(
        hits.iter().all(|h| h.contains("// Long by design: ")),
        "an allow says why:\n{}",
        hits.join("\n")
    );
}
