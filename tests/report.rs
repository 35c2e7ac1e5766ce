//! `memplan report`: the page is well formed and self-contained, its peak label is
//! the JSON's peak, it has one series per category, long steps are downsampled
//! without losing the peak, bad input is one line; and a real browser (headless
//! Chromium, when installed: CI installs it and sets MEMPLAN_REQUIRE_CHROMIUM=1)
//! renders it: the DOM after its script ran, and a screenshot.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use memplan::units::human_bytes;

const CATEGORIES: [&str; 6] = [
    "parameters",
    "buffers",
    "gradients",
    "optimizer",
    "saved_activations",
    "temporaries",
];

/// `profile --train --json`'s `training` object.
fn training_json(model: &Path, batch: &str) -> serde_json::Value {
    let (ok, out, err) = common::run_memplan(&[
        "profile",
        model.to_str().unwrap(),
        "--batch",
        batch,
        "--train",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["training"].clone()
}

/// Writes a report with `extra` flags into `dir` and returns its text.
fn report(dir: &Path, name: &str, model: &Path, extra: &[&str]) -> (PathBuf, String) {
    let out = dir.join(name);
    let mut args = vec![
        "report",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, stdout, err) = common::run_memplan(&args);
    assert!(ok, "report {extra:?} failed: {err}");
    assert!(stdout.is_empty(), "with -o nothing goes to stdout");
    let text = std::fs::read_to_string(&out).unwrap();
    (out, text)
}

/// An element's start tag as parsed: name and attributes.
#[derive(Debug)]
struct Tag {
    name: String,
    attrs: Vec<(String, String)>,
}

impl Tag {
    fn attr(&self, k: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
}

/// Checks that `doc` is well formed as XML (past an optional doctype or XML
/// declaration, and with `script` and `style` content as raw text, as HTML has it):
/// one root, every element closed in order, void elements self-closed, attributes
/// quoted, `&` only in entities, no stray `<`. Returns the start tags in order.
fn well_formed(doc: &str) -> Result<Vec<Tag>, String> {
    const VOID: [&str; 6] = ["meta", "link", "br", "hr", "img", "input"];
    let b = doc.as_bytes();
    let mut i = 0;
    let mut stack: Vec<String> = Vec::new();
    let mut tags = Vec::new();
    let mut roots = 0;
    let at = |i: usize| format!("at byte {i}: {}", &doc[i..doc.len().min(i + 60)]);
    let entity_ok = |s: &str| {
        ["&amp;", "&lt;", "&gt;", "&quot;", "&#39;"]
            .iter()
            .any(|e| s.starts_with(e))
            || (s.starts_with("&#")
                && s[2..]
                    .find(';')
                    .is_some_and(|k| k > 0 && s[2..2 + k].bytes().all(|c| c.is_ascii_digit())))
    };
    while i < b.len() {
        match b[i] {
            b'<' => {
                let rest = &doc[i..];
                if rest.starts_with("<!--") {
                    i += rest.find("-->").ok_or_else(|| at(i))? + 3;
                } else if rest.starts_with("<!DOCTYPE") || rest.starts_with("<?xml") {
                    if roots > 0 || !stack.is_empty() {
                        return Err(format!("prolog inside the document {}", at(i)));
                    }
                    i += rest.find('>').ok_or_else(|| at(i))? + 1;
                } else if let Some(r) = rest.strip_prefix("</") {
                    let end = r.find('>').ok_or_else(|| at(i))?;
                    let name = r[..end].trim();
                    match stack.pop() {
                        Some(open) if open == name => {}
                        other => return Err(format!("</{name}> closes {other:?} {}", at(i))),
                    }
                    i += 2 + end + 1;
                } else {
                    // A start tag: name, attributes, `>` or `/>`.
                    let mut j = i + 1;
                    while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'-') {
                        j += 1;
                    }
                    let name = doc[i + 1..j].to_string();
                    if name.is_empty() {
                        return Err(format!("stray '<' {}", at(i)));
                    }
                    let mut attrs = Vec::new();
                    let closed;
                    loop {
                        while j < b.len() && b[j].is_ascii_whitespace() {
                            j += 1;
                        }
                        if doc[j..].starts_with("/>") {
                            closed = true;
                            j += 2;
                            break;
                        }
                        if doc[j..].starts_with('>') {
                            closed = false;
                            j += 1;
                            break;
                        }
                        let k = j;
                        while j < b.len()
                            && (b[j].is_ascii_alphanumeric() || b[j] == b'-' || b[j] == b':')
                        {
                            j += 1;
                        }
                        if k == j || !doc[j..].starts_with("=\"") {
                            return Err(format!("bad attribute {}", at(k)));
                        }
                        let v0 = j + 2;
                        let v1 = v0 + doc[v0..].find('"').ok_or_else(|| at(k))?;
                        let v = &doc[v0..v1];
                        if v.contains('<') {
                            return Err(format!("'<' in an attribute {}", at(k)));
                        }
                        for (p, _) in v.match_indices('&') {
                            if !entity_ok(&v[p..]) {
                                return Err(format!("bad entity in an attribute {}", at(v0 + p)));
                            }
                        }
                        if attrs
                            .iter()
                            .any(|(n, _): &(String, String)| *n == doc[k..j])
                        {
                            return Err(format!("attribute given twice {}", at(k)));
                        }
                        attrs.push((doc[k..j].to_string(), v.to_string()));
                        j = v1 + 1;
                    }
                    if stack.is_empty() {
                        roots += 1;
                        if roots > 1 {
                            return Err(format!("a second root element {}", at(i)));
                        }
                    }
                    if VOID.contains(&name.as_str()) && !closed {
                        return Err(format!("void <{name}> not self-closed {}", at(i)));
                    }
                    let raw = name == "script" || name == "style";
                    tags.push(Tag {
                        name: name.clone(),
                        attrs,
                    });
                    i = j;
                    if !closed {
                        if raw {
                            let close = format!("</{name}>");
                            i += doc[i..].find(&close).ok_or_else(|| at(i))? + close.len();
                        } else {
                            stack.push(name);
                        }
                    }
                }
            }
            b'&' => {
                if !entity_ok(&doc[i..]) {
                    return Err(format!("bad entity {}", at(i)));
                }
                i += 1;
            }
            c => {
                if stack.is_empty() && !c.is_ascii_whitespace() {
                    return Err(format!("text outside the root {}", at(i)));
                }
                i += 1;
            }
        }
    }
    if let Some(open) = stack.last() {
        return Err(format!("<{open}> never closed"));
    }
    if roots != 1 {
        return Err("no root element".into());
    }
    Ok(tags)
}

/// No network references: no http(s) anywhere, no `src`, every `href` a fragment,
/// no CSS imports or urls.
fn self_contained(doc: &str, tags: &[Tag]) {
    assert!(!doc.contains("http:") && !doc.contains("https:"));
    for t in tags {
        assert!(t.attr("src").is_none(), "<{}> has a src", t.name);
        for (k, v) in &t.attrs {
            if k.ends_with("href") {
                assert!(v.starts_with('#'), "<{}> {k}={v}", t.name);
            }
            assert!(!v.starts_with("//"), "<{}> {k}={v}", t.name);
        }
        assert!(
            !["link", "iframe", "img", "object", "embed", "base"].contains(&t.name.as_str()),
            "<{}>",
            t.name
        );
    }
    assert!(!doc.contains("@import") && !doc.contains("url("));
}

/// The step chart's series: `data-category` of every `<path>` in it, in order.
fn series(tags: &[Tag]) -> Vec<String> {
    let start = tags
        .iter()
        .position(|t| t.attr("id") == Some("step-chart"))
        .expect("a step chart");
    tags[start + 1..]
        .iter()
        .take_while(|t| t.name != "svg")
        .filter(|t| t.name == "path")
        .filter_map(|t| t.attr("data-category").map(str::to_string))
        .collect()
}

/// One series per category, each exactly once.
fn one_series_per_category(found: &[String]) {
    let mut s = found.to_vec();
    s.sort();
    let mut want: Vec<String> = CATEGORIES.iter().map(|c| c.to_string()).collect();
    want.sort();
    assert_eq!(s, want, "series: {found:?}");
}

/// The peak label: its bytes (attribute and text) equal `peak`.
fn peak_label_is(tags: &[Tag], doc: &str, peak: u64) {
    let t = tags
        .iter()
        .find(|t| t.attr("id") == Some("peak-label"))
        .expect("a peak label");
    assert_eq!(t.attr("data-bytes"), Some(peak.to_string().as_str()));
    let k = doc.find("id=\"peak-label\"").unwrap();
    let text = &doc[k + doc[k..].find('>').unwrap() + 1..k + doc[k..].find("</text>").unwrap()];
    assert!(
        text.contains(&format!("peak {} ({peak} bytes)", human_bytes(peak))),
        "label: {text}"
    );
}

#[test]
fn the_page_is_well_formed_and_self_contained_with_every_section() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::shipped("resnet18.onnx");
    let t = training_json(&m, "16");
    let (_, doc) = report(
        dir.path(),
        "r18.html",
        &m,
        &[
            "--batch",
            "16",
            "--budget",
            "0.7",
            "--pareto",
            "--solver",
            "greedy",
            "--memory",
            "2GiB",
            "--target-batch",
            "64",
        ],
    );
    let tags = well_formed(&doc).unwrap_or_else(|e| panic!("not well formed: {e}"));
    self_contained(&doc, &tags);
    for id in [
        "summary",
        "step",
        "peak",
        "modules",
        "plan",
        "pareto",
        "fit",
        "step-chart",
        "plan-chart",
        "pareto-chart",
        "largest",
        "module-table",
        "fit-table",
        "recommendation",
    ] {
        assert!(
            tags.iter().any(|t| t.attr("id") == Some(id)),
            "no #{id} in the page"
        );
    }
    one_series_per_category(&series(&tags));
    let peak = t["peak_bytes"].as_u64().unwrap();
    peak_label_is(&tags, &doc, peak);
    // The breakdown at the peak is the JSON's.
    for c in CATEGORIES {
        let row = tags
            .iter()
            .position(|x| x.name == "tr" && x.attr("data-category") == Some(c))
            .unwrap_or_else(|| panic!("no breakdown row {c}"));
        let cell = tags[row..]
            .iter()
            .find_map(|x| x.attr("data-bytes"))
            .unwrap();
        assert_eq!(cell, t["breakdown"][c].as_u64().unwrap().to_string(), "{c}");
    }
    // The plan is `memplan plan`'s: same peaks, both curves drawn.
    let (ok, out, err) = common::run_memplan(&[
        "plan",
        m.to_str().unwrap(),
        "--batch",
        "16",
        "--budget",
        "0.7",
        "--solver",
        "greedy",
        "--json",
    ]);
    // Greedy cannot meet 70 %: the lowest-peak plan is printed, and the exit fails.
    assert!(!ok && err.contains("no plan fits the budget"), "{err}");
    let pj: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(pj["feasible"], false);
    let sec = tags.iter().find(|x| x.attr("id") == Some("plan")).unwrap();
    assert_eq!(
        sec.attr("data-peak-bytes").unwrap(),
        pj["peak_bytes"].as_u64().unwrap().to_string()
    );
    assert_eq!(
        sec.attr("data-baseline-bytes").unwrap(),
        pj["baseline_peak_bytes"].as_u64().unwrap().to_string()
    );
    assert_eq!(pj["baseline_peak_bytes"].as_u64(), Some(peak));
    assert!(
        pj["peak_bytes"].as_u64().unwrap() < peak,
        "greedy lowers the peak"
    );
    assert!(doc.contains("id=\"plan-after\"") && doc.contains("id=\"plan-before\""));
}

#[test]
fn a_long_step_is_downsampled_and_keeps_its_peak() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::shipped("gpt2.onnx");
    let t = training_json(&m, "2");
    let timeline = t["timeline"].as_array().unwrap();
    assert!(timeline.len() > 2000, "GPT-2's step is long");
    let (_, doc) = report(dir.path(), "gpt2.html", &m, &["--batch", "2"]);
    assert!(doc.len() < 300 * 1024, "{} bytes", doc.len());
    let tags = well_formed(&doc).unwrap_or_else(|e| panic!("not well formed: {e}"));
    self_contained(&doc, &tags);
    one_series_per_category(&series(&tags));
    let peak = t["peak_bytes"].as_u64().unwrap();
    peak_label_is(&tags, &doc, peak);
    // The hover data: at most 1000 points, the peak step among them with its bytes.
    let k = doc.find("id=\"step-data\">").unwrap() + "id=\"step-data\">".len();
    let data: serde_json::Value =
        serde_json::from_str(&doc[k..k + doc[k..].find("</script>").unwrap()]).unwrap();
    let points = data["points"].as_array().unwrap();
    assert!(
        points.len() <= 1000 && points.len() >= 500,
        "{}",
        points.len()
    );
    let peak_step = timeline.iter().enumerate().fold(0, |b, (i, p)| {
        if p["total"].as_u64() > timeline[b]["total"].as_u64() {
            i
        } else {
            b
        }
    });
    let label = tags
        .iter()
        .find(|t| t.attr("id") == Some("peak-label"))
        .unwrap();
    assert_eq!(
        label.attr("data-step"),
        Some(peak_step.to_string().as_str())
    );
    let at_peak = points
        .iter()
        .find(|p| p[0].as_u64() == Some(peak_step as u64))
        .expect("the peak step is drawn");
    let sum: u64 = (4..10).map(|j| at_peak[j].as_u64().unwrap()).sum();
    assert_eq!(sum, peak);
    // Every series path has at most one point per drawn step (plus its two corners).
    for tg in tags.iter().filter(|t| t.attr("class") == Some("series")) {
        let d = tg.attr("d").unwrap();
        assert!(d.matches('L').count() <= 1000 + 2, "{}", d.len());
    }
}

#[test]
fn the_chart_alone_as_svg() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::shipped("resnet18.onnx");
    let t = training_json(&m, "4");
    let (_, doc) = report(
        dir.path(),
        "r18.svg",
        &m,
        &["--batch", "4", "--format", "svg"],
    );
    assert!(doc.starts_with("<?xml"));
    let tags = well_formed(&doc).unwrap_or_else(|e| panic!("not well formed: {e}"));
    assert_eq!(tags[0].name, "svg");
    assert_eq!(tags[0].attr("xmlns"), Some("http://www.w3.org/2000/svg"));
    // The namespace is the only URL; nothing is fetched.
    assert_eq!(doc.matches("http").count(), 1);
    assert!(tags
        .iter()
        .all(|t| t.attr("href").is_none() && t.attr("src").is_none()));
    one_series_per_category(&series(&tags));
    peak_label_is(&tags, &doc, t["peak_bytes"].as_u64().unwrap());
    assert!(!doc.contains("<script"), "the SVG alone has no script");
}

#[test]
fn bad_input_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.html");
    let o = out.to_str().unwrap();
    let gpt2 = common::shipped("gpt2.onnx");
    let g = gpt2.to_str().unwrap();
    let cases: [(Vec<&str>, &str); 5] = [
        (vec!["report", g, "-o", o], "--batch"),
        (
            vec!["report", "no/such/model.onnx", "--batch", "1", "-o", o],
            "no/such/model.onnx",
        ),
        (
            vec!["report", g, "--batch", "1", "-o", "/no/such/dir/r.html"],
            "cannot write /no/such/dir/r.html",
        ),
        (
            vec![
                "report", g, "--batch", "1", "--format", "svg", "--budget", "0.5",
            ],
            "--format svg",
        ),
        (
            vec!["report", g, "--batch", "1", "--budget", "lots", "-o", o],
            "--budget",
        ),
    ];
    for (args, needle) in cases {
        let (ok, stdout, err) = common::run_memplan(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(needle),
            "{err}"
        );
        assert!(!err.contains("panicked") && !err.contains("internal error"));
        assert!(!out.exists(), "{args:?} left an output file behind");
    }
}

/// The browser, if there is one: MEMPLAN_CHROMIUM, else `chromium` on the PATH.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEMPLAN_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n)))
            .find(|p| p.is_file())
    })
}

/// Runs headless Chromium on `page` with `args`; returns its stdout.
fn headless(browser: &Path, profile: &Path, page: &Path, args: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg("180")
        .arg(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-extensions",
            "--disable-dev-shm-usage",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_browser_renders_the_report() {
    let Some(browser) = chromium() else {
        if std::env::var("MEMPLAN_REQUIRE_CHROMIUM").as_deref() == Ok("1") {
            panic!(
                "MEMPLAN_REQUIRE_CHROMIUM=1 but no chromium on the PATH (apt-get install chromium)"
            );
        }
        eprintln!("SKIPPED a_browser_renders_the_report: no chromium on the PATH (apt-get install chromium; CI sets MEMPLAN_REQUIRE_CHROMIUM=1)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let m = common::shipped("resnet50.onnx");
    let t = training_json(&m, "8");
    let peak = t["peak_bytes"].as_u64().unwrap();
    let (page, _) = report(dir.path(), "r50.html", &m, &["--batch", "8"]);
    let profile = dir.path().join("profile");

    // The DOM after the script ran.
    let dom = headless(&browser, &profile, &page, &["--dump-dom"]);
    assert!(
        dom.contains("data-script=\"ran\""),
        "the page's script did not run to its end"
    );
    let k = dom
        .find("id=\"peak-label\"")
        .expect("a peak label in the DOM");
    let open = dom[..k].rfind('<').unwrap();
    let end = k + dom[k..].find("</text>").unwrap();
    let label = &dom[open..end];
    assert!(
        label.contains(&format!("data-bytes=\"{peak}\"")),
        "label: {label}"
    );
    assert!(
        label.contains(&format!("peak {} ({peak} bytes)", human_bytes(peak))),
        "label: {label}"
    );
    let s0 = dom.find("<svg id=\"step-chart\"").expect("the step chart");
    let chart = &dom[s0..s0 + dom[s0..].find("</svg>").unwrap()];
    let mut found: Vec<String> = chart
        .match_indices("<path ")
        .filter_map(|(i, _)| {
            let tag = &chart[i..i + chart[i..].find('>').unwrap()];
            let a = tag.find("data-category=\"")? + "data-category=\"".len();
            Some(tag[a..a + tag[a..].find('"').unwrap()].to_string())
        })
        .collect();
    one_series_per_category(&found);
    found.dedup();
    assert_eq!(found.len(), 6);

    // Hovering: a copy of the page that moves the mouse over the chart's middle
    // shows that step's figures.
    let html = std::fs::read_to_string(&page).unwrap();
    let hover = dir.path().join("hover.html");
    let poke = "<script>(function(){var z=document.getElementById('hover-zone');var r=z.getBoundingClientRect();z.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+r.width/2,clientY:r.top+r.height/2,bubbles:true}));})();</script></body>";
    std::fs::write(&hover, html.replace("</body>", poke)).unwrap();
    let dom = headless(&browser, &profile, &hover, &["--dump-dom"]);
    let k = dom.find("<div id=\"tooltip\"").expect("a tooltip");
    let tip = &dom[k..k + dom[k..].find("</table>").expect("figures in the tooltip")];
    assert!(!tip[..tip.find('>').unwrap()].contains("hidden"), "{tip}");
    assert!(
        tip.contains("step ") && tip.contains("total") && tip.contains("saved activations"),
        "{tip}"
    );

    // A screenshot: a PNG of the window's size, not blank.
    let shot = dir.path().join("r50.png");
    headless(
        &browser,
        &profile,
        &page,
        &[
            "--window-size=1100,1400",
            &format!("--screenshot={}", shot.display()),
        ],
    );
    let png = std::fs::read(&shot).expect("a screenshot");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |k: usize| u32::from_be_bytes(png[k..k + 4].try_into().unwrap());
    assert_eq!((be(16), be(20)), (1100, 1400), "width and height");
    // A blank page of this size compresses to a few KiB; charts and tables do not.
    assert!(png.len() > 60 * 1024, "{} bytes: blank?", png.len());
    assert!(png.ends_with(b"IEND\xaeB`\x82"), "a PNG ends with IEND");
}

#[test]
fn a_plan_file_and_a_checkpoint_preset_are_drawn() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::shipped("resnet18.onnx");
    let ms = m.to_str().unwrap();
    let pf = dir.path().join("plan.json");
    let (ok, out, err) = common::run_memplan(&[
        "plan",
        ms,
        "--batch",
        "16",
        "--budget",
        "0.7",
        "--solver",
        "greedy",
        "--json",
        "-o",
        pf.to_str().unwrap(),
    ]);
    // Greedy cannot meet 70 %: the lowest-peak plan is still written.
    assert!(!ok && err.contains("no plan fits the budget"), "{err}");
    let pj: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (_, doc) = report(
        dir.path(),
        "planned.html",
        &m,
        &["--batch", "16", "--plan", pf.to_str().unwrap()],
    );
    let tags = well_formed(&doc).unwrap_or_else(|e| panic!("not well formed: {e}"));
    let sec = tags.iter().find(|t| t.attr("id") == Some("plan")).unwrap();
    assert_eq!(
        sec.attr("data-peak-bytes").unwrap(),
        pj["peak_bytes"].as_u64().unwrap().to_string()
    );
    // Another batch: the file does not fit, one line.
    let (ok, _, err) =
        common::run_memplan(&["report", ms, "--batch", "8", "--plan", pf.to_str().unwrap()]);
    assert!(
        !ok && err.lines().count() == 1 && err.contains("made for batch 16"),
        "{err}"
    );
    // A module preset lists the checkpointed modules.
    let (_, doc) = report(
        dir.path(),
        "ck.html",
        &m,
        &["--batch", "16", "--checkpoint", "every-block"],
    );
    well_formed(&doc).unwrap_or_else(|e| panic!("not well formed: {e}"));
    assert!(doc.contains("Checkpointed modules (8): <code>layer1.0</code>"));
}

/// The examples in docs/report/ are what the tests say a report is.
#[test]
fn the_documented_examples_are_well_formed_small_and_self_contained() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/report");
    let mut pages = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&p).unwrap();
        assert!(bytes.len() < 300 * 1024, "{name}: {} bytes", bytes.len());
        if name.ends_with(".html") {
            let doc = String::from_utf8(bytes).unwrap();
            let tags = well_formed(&doc).unwrap_or_else(|e| panic!("{name}: {e}"));
            self_contained(&doc, &tags);
            one_series_per_category(&series(&tags));
            pages += 1;
        } else if name.ends_with(".png") {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name}");
        }
    }
    assert!(pages >= 4, "{pages} example pages");
}
