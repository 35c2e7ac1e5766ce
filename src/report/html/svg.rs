//! The report's charts as inline SVG: the step by category (stacked), a plan's curve
//! before and after, and the budget–overhead curve. Long series are downsampled to
//! at most [`MAX_POINTS`] points, each the largest of its stretch, so the peak is
//! always drawn.

use std::fmt::Write as _;

use super::data::PlanView;
use crate::memory::{Breakdown, Category};
use crate::remat::pareto::ParetoCurve;
use crate::report::train::TrainingReport;
use crate::train::StepKind;
use crate::units::human_bytes;

/// The charts' style (the page's, and a standalone SVG's own).
pub const SVG_CSS: &str = "
svg{font-family:system-ui,-apple-system,'Segoe UI',sans-serif}
svg .grid{stroke:#eee}svg .axis{stroke:#888}svg .tick{font-size:11px;fill:#555}svg .axis-title{font-size:11px;fill:#333}
svg .legend{font-size:12px;fill:#333}svg .phase-label{font-size:11px;fill:#333}svg .phase-edge{stroke:#999;stroke-dasharray:3 3}
svg .series{stroke-width:1;stroke-linejoin:round}svg .peak-line{stroke:#222;stroke-dasharray:4 3}svg .peak-dot{fill:#222}
#peak-label{font-size:12px;font-weight:600;fill:#111}
";

/// The most points drawn per series.
pub const MAX_POINTS: usize = 1000;

/// A category as the charts draw it: its key (the
/// `data-category` of its series), label and bytes come from the category.
pub struct Cat {
    /// The category.
    pub cat: Category,
    /// Fill colour.
    pub color: &'static str,
}

impl Cat {
    /// The key in `training.breakdown`.
    pub fn key(&self) -> &'static str {
        self.cat.key()
    }

    /// What the legend says.
    pub fn label(&self) -> &'static str {
        self.cat.label()
    }

    /// Its bytes in a breakdown.
    pub fn get(&self, b: &Breakdown) -> u64 {
        b.get(self.cat)
    }
}

/// The categories, bottom of the stack first (the order of
/// `memory::simulate::CATEGORIES`).
pub const CATS: [Cat; 6] = [
    cat(Category::Parameters, "#4e79a7"),
    cat(Category::Buffers, "#9c755f"),
    cat(Category::Gradients, "#f28e2b"),
    cat(Category::Optimizer, "#edc948"),
    cat(Category::SavedActivations, "#59a14f"),
    cat(Category::Temporaries, "#e15759"),
];

const fn cat(cat: Category, color: &'static str) -> Cat {
    Cat { cat, color }
}

/// Escapes text for XML and HTML (content and quoted attributes).
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            _ => o.push(c),
        }
    }
    o
}

/// Indices of at most `max` points of `values`: all of them when few enough, else
/// the largest of each of `max` equal stretches (the first of equals). The first
/// largest value overall is always among them.
pub fn downsample(values: &[u64], max: usize) -> Vec<usize> {
    let n = values.len();
    if n <= max.max(1) {
        return (0..n).collect();
    }
    (0..max)
        .map(|b| {
            let (a, z) = (b * n / max, ((b + 1) * n / max).max(b * n / max + 1));
            (a..z).fold(a, |best, i| if values[i] > values[best] { i } else { best })
        })
        .collect()
}

/// A short byte label for an axis (`256 MiB`, `1.5 GiB`, `1.25 GiB`).
pub fn short_bytes(v: u64) -> String {
    if v < 1024 {
        return format!("{v} B");
    }
    let units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut x = v as f64 / 1024.0;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    let t = format!("{x:.2}");
    let t = t.trim_end_matches('0').trim_end_matches('.');
    format!("{t} {}", units[u])
}

/// A tick step in bytes (a power of two: 256 MiB, 512 MiB, 1 GiB, ...) that divides
/// `[0, top]` into at most 6 steps, and the axis top.
fn byte_ticks(top: u64) -> (u64, u64) {
    let top = top.max(1);
    for unit in [1u64, 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50] {
        for m in [1u64, 2, 4, 8, 16, 32, 64, 128, 256, 512] {
            let step = m.saturating_mul(unit);
            if top.div_ceil(step) <= 6 {
                return (step, top.div_ceil(step) * step);
            }
        }
    }
    (top, top)
}

/// A step for `n` things in at most 8 ticks (1, 2 or 5 times a power of ten).
fn count_step(n: usize) -> usize {
    let mut p = 1usize;
    loop {
        for m in [1, 2, 5] {
            if n / (m * p) <= 8 {
                return m * p;
            }
        }
        p *= 10;
    }
}

/// A plot area: its position and the scales of its axes.
struct Frame {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
    /// Values on the x axis run from 0 to this.
    x_max: f64,
    /// Values on the y axis run from 0 to this.
    y_max: f64,
}

impl Frame {
    fn x(&self, v: f64) -> f64 {
        if self.x_max <= 0.0 {
            return self.left + self.width / 2.0;
        }
        self.left + v / self.x_max * self.width
    }
    fn y(&self, v: f64) -> f64 {
        self.top + self.height - v / self.y_max.max(f64::MIN_POSITIVE) * self.height
    }
    fn bottom(&self) -> f64 {
        self.top + self.height
    }
    fn right(&self) -> f64 {
        self.left + self.width
    }

    /// Grid lines and labels of a byte y axis with ticks every `step`.
    fn byte_axis(&self, s: &mut String, step: u64) {
        let mut v = 0u64;
        while v as f64 <= self.y_max {
            let y = self.y(v as f64);
            let _ = write!(
                s,
                r#"<line class="grid" x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                self.left,
                self.right(),
                self.left - 6.0,
                y + 4.0,
                esc(&short_bytes(v))
            );
            match v.checked_add(step.max(1)) {
                Some(next) => v = next,
                None => break,
            }
        }
    }

    /// Ticks and labels of a step-count x axis (`n` steps).
    fn step_axis(&self, s: &mut String, n: usize, title: &str) {
        let step = count_step(n.max(1));
        let mut v = 0usize;
        while v < n.max(1) {
            let x = self.x(v as f64);
            let _ = write!(
                s,
                r#"<line class="axis" x1="{x:.1}" y1="{b:.1}" x2="{x:.1}" y2="{:.1}"/><text class="tick" x="{x:.1}" y="{:.1}" text-anchor="middle">{v}</text>"#,
                self.bottom() + 4.0,
                self.bottom() + 15.0,
                b = self.bottom(),
            );
            v += step;
        }
        let _ = write!(
            s,
            r#"<line class="axis" x1="{l:.1}" y1="{b:.1}" x2="{r:.1}" y2="{b:.1}"/><line class="axis" x1="{l:.1}" y1="{t:.1}" x2="{l:.1}" y2="{b:.1}"/><text class="axis-title" x="{r:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            self.bottom() + 54.0,
            esc(title),
            l = self.left,
            r = self.right(),
            b = self.bottom(),
            t = self.top,
        );
    }
}

/// The SVG element's opening tag; `standalone` adds the namespace a file of its own
/// needs.
fn open_svg(id: &str, w: u32, h: u32, label: &str, standalone: bool) -> String {
    format!(
        r#"<svg{} id="{id}" class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="{}">"#,
        if standalone {
            r#" xmlns="http://www.w3.org/2000/svg""#
        } else {
            ""
        },
        esc(label)
    )
}

/// Colour of a phase's band.
fn phase_color(k: StepKind) -> &'static str {
    match k {
        StepKind::Forward => "#d6e6f5",
        StepKind::Loss => "#f9d9b8",
        StepKind::Backward => "#f4d3d3",
        StepKind::Optimizer => "#dcdcdc",
    }
}

/// A phase's name.
pub fn phase_name(k: StepKind) -> &'static str {
    match k {
        StepKind::Forward => "forward",
        StepKind::Loss => "loss",
        StepKind::Backward => "backward",
        StepKind::Optimizer => "optimizer",
    }
}

/// Runs of equal phases: `(first step, last step, phase)`.
pub fn phase_runs(phases: &[StepKind]) -> Vec<(usize, usize, StepKind)> {
    let mut out: Vec<(usize, usize, StepKind)> = Vec::new();
    for (i, &k) in phases.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.2 == k => r.1 = i,
            _ => out.push((i, i, k)),
        }
    }
    out
}

/// The phase bands under a plot and dashed lines where a phase starts.
fn phase_strip(s: &mut String, f: &Frame, phases: &[StepKind]) {
    let y = f.bottom() + 22.0;
    for (a, b, k) in phase_runs(phases) {
        let x0 = f.x(a as f64 - 0.5).max(f.left);
        let x1 = f.x(b as f64 + 0.5).min(f.right());
        let _ = write!(
            s,
            r#"<rect class="phase" data-phase="{n}" x="{x0:.1}" y="{y:.1}" width="{:.1}" height="16" fill="{}"><title>{n}: steps {a} to {b}</title></rect>"#,
            (x1 - x0).max(2.0),
            phase_color(k),
            n = phase_name(k),
        );
        if x1 - x0 > 56.0 {
            let _ = write!(
                s,
                r#"<text class="phase-label" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                (x0 + x1) / 2.0,
                y + 12.0,
                phase_name(k)
            );
        }
        if a > 0 {
            let _ = write!(
                s,
                r#"<line class="phase-edge" x1="{x0:.1}" y1="{:.1}" x2="{x0:.1}" y2="{:.1}"/>"#,
                f.top,
                y + 16.0
            );
        }
    }
}

/// A legend row of coloured swatches.
fn legend(s: &mut String, x: f64, y: f64, items: &[(&str, &str)]) {
    let mut x = x;
    for (label, color) in items {
        let _ = write!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text class="legend" x="{:.1}" y="{y:.1}">{}</text>"#,
            y - 10.0,
            x + 16.0,
            esc(label)
        );
        x += 28.0 + 6.6 * label.len() as f64;
    }
}

/// The step chart: memory by category over the training step, stacked, with the
/// phases marked and the peak annotated with its op. `peak_op` is the op type of
/// the peak step. Returns the SVG and the steps drawn.
pub fn step_chart(t: &TrainingReport, peak_op: &str, standalone: bool) -> (String, Vec<usize>) {
    let (w, h) = (1000u32, 430u32);
    let n = t.timeline.len();
    let totals: Vec<u64> = t.timeline.iter().map(|p| p.total).collect();
    let idx = downsample(&totals, MAX_POINTS);
    let peak_step = totals
        .iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > totals[b] { i } else { b });
    let (tick, top) = byte_ticks(t.peak_bytes.max(totals.iter().copied().max().unwrap_or(0)));
    let f = Frame {
        left: 78.0,
        top: 42.0,
        width: w as f64 - 98.0,
        height: h as f64 - 142.0,
        x_max: n.saturating_sub(1) as f64,
        y_max: top as f64,
    };
    let mut s = open_svg(
        "step-chart",
        w,
        h,
        "memory over the training step by category",
        standalone,
    );
    if standalone {
        let _ = write!(s, "<style>{SVG_CSS}</style>");
    }
    let phases: Vec<StepKind> = t.timeline.iter().map(|p| p.phase).collect();
    f.byte_axis(&mut s, tick);
    // Each category is drawn as the area under its cumulative top, the highest
    // first, so each lower one paints over it and leaves its own band: one path per
    // category with a single outline. Points inside flat stretches are dropped.
    let mut tops: Vec<Vec<u64>> = Vec::with_capacity(CATS.len());
    let mut acc = vec![0u64; idx.len()];
    for c in &CATS {
        for (a, &i) in acc.iter_mut().zip(&idx) {
            *a += c.get(&t.timeline[i].bytes);
        }
        tops.push(acc.clone());
    }
    for (c, top) in CATS.iter().zip(&tops).rev() {
        let mut d = String::new();
        let last = idx.len().saturating_sub(1);
        for (j, (&i, &u)) in idx.iter().zip(top).enumerate() {
            let flat = j > 0 && j < last && top[j - 1] == u && top[j + 1] == u;
            if !flat {
                let _ = write!(
                    d,
                    "{}{:.1},{:.1}",
                    if j == 0 { "M" } else { " L" },
                    f.x(i as f64),
                    f.y(u as f64)
                );
            }
        }
        let (x0, x1) = (
            f.x(idx.first().copied().unwrap_or(0) as f64),
            f.x(idx.last().copied().unwrap_or(0) as f64),
        );
        let _ = write!(
            s,
            r#"<path class="series" data-category="{}" fill="{c}" stroke="{c}" d="{d} L{x1:.1},{b:.1} L{x0:.1},{b:.1} Z"><title>{}</title></path>"#,
            c.key(),
            c.label(),
            b = f.bottom(),
            c = c.color
        );
    }
    f.step_axis(&mut s, n, "step of the training step (execution order)");
    phase_strip(&mut s, &f, &phases);
    if let Some(p) = t.timeline.get(peak_step) {
        let (x, y) = (f.x(peak_step as f64), f.y(p.total as f64));
        let text = format!(
            "peak {} ({} bytes) at step {peak_step}: {} ({peak_op}, {})",
            human_bytes(p.total),
            p.total,
            p.node,
            phase_name(p.phase)
        );
        // About 6.8 px per character at 12 px: keep the label inside the chart.
        let est = 6.8 * text.chars().count() as f64;
        let (lx, anchor) = if x + 6.0 + est <= w as f64 - 4.0 {
            (x + 6.0, "start")
        } else if x - 6.0 - est >= 4.0 {
            (x - 6.0, "end")
        } else {
            (
                (w as f64 / 2.0).max(x - est / 2.0).min(x + est / 2.0),
                "middle",
            )
        };
        let _ = write!(
            s,
            r#"<line class="peak-line" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}"/><circle class="peak-dot" cx="{x:.1}" cy="{y:.1}" r="4"/><text id="peak-label" x="{:.1}" y="{:.1}" text-anchor="{}" data-bytes="{}" data-step="{peak_step}" data-op="{}" data-node="{}">{}</text>"#,
            f.top - 12.0,
            f.bottom(),
            lx,
            f.top - 16.0,
            anchor,
            p.total,
            esc(peak_op),
            esc(&p.node),
            esc(&text)
        );
    }
    let items: Vec<(&str, &str)> = CATS.iter().map(|c| (c.label(), c.color)).collect();
    legend(&mut s, f.left, h as f64 - 14.0, &items);
    if !standalone {
        let _ = write!(
            s,
            r#"<line id="hover-line" x1="0" y1="{:.1}" x2="0" y2="{:.1}" visibility="hidden"/><rect id="hover-zone" x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="transparent" data-left="{:.1}" data-width="{:.1}" data-steps="{n}"/>"#,
            f.top,
            f.bottom(),
            f.left,
            f.top,
            f.width,
            f.height,
            f.left,
            f.width
        );
    }
    s.push_str("</svg>");
    (s, idx)
}

/// A polyline of `values` over `f`, downsampled.
fn polyline(f: &Frame, values: &[u64], id: &str, class: &str) -> String {
    let mut pts = String::new();
    for (j, i) in downsample(values, MAX_POINTS).into_iter().enumerate() {
        let _ = write!(
            pts,
            "{}{:.1},{:.1}",
            if j == 0 { "" } else { " " },
            f.x(i as f64),
            f.y(values[i] as f64)
        );
    }
    format!(r#"<polyline id="{id}" class="{class}" fill="none" points="{pts}"/>"#)
}

/// A plan's curve against the step without recomputation, on the original step's
/// axis; ticks under the plot where something is recomputed.
pub fn plan_chart(p: &PlanView, phases: &[StepKind]) -> String {
    let (w, h) = (1000u32, 380u32);
    let n = p.before.len();
    let hi = p
        .before
        .iter()
        .chain(&p.after)
        .copied()
        .max()
        .unwrap_or(0)
        .max(p.budget_bytes.unwrap_or(0));
    let (tick, top) = byte_ticks(hi);
    let f = Frame {
        left: 78.0,
        top: 30.0,
        width: w as f64 - 98.0,
        height: h as f64 - 120.0,
        x_max: n.saturating_sub(1) as f64,
        y_max: top as f64,
    };
    let mut s = open_svg(
        "plan-chart",
        w,
        h,
        "live bytes before and after the plan",
        false,
    );
    f.byte_axis(&mut s, tick);
    s.push_str(&polyline(&f, &p.before, "plan-before", "before"));
    s.push_str(&polyline(&f, &p.after, "plan-after", "after"));
    if let Some(b) = p.budget_bytes {
        let y = f.y(b as f64);
        let _ = write!(
            s,
            r#"<line class="budget" x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">budget {}</text>"#,
            f.left,
            f.right(),
            f.right(),
            y - 4.0,
            esc(&human_bytes(b))
        );
    }
    // One tick per pixel column at most.
    let mut last_px = f64::NEG_INFINITY;
    for &i in &p.recompute_at {
        let x = f.x(i as f64);
        if x - last_px >= 1.0 {
            let _ = write!(
                s,
                r#"<line class="recompute" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}"/>"#,
                f.bottom() - 8.0,
                f.bottom()
            );
            last_px = x;
        }
    }
    f.step_axis(
        &mut s,
        n,
        "step of the training step (recomputations drawn at the step they precede)",
    );
    phase_strip(&mut s, &f, phases);
    legend(
        &mut s,
        f.left,
        h as f64 - 14.0,
        &[
            (
                &format!("no recompute (peak {})", human_bytes(p.baseline_peak_bytes)),
                "#9a9a9a",
            ),
            (
                &format!("planned (peak {})", human_bytes(p.peak_bytes)),
                "#1f5fa8",
            ),
            ("recomputation", "#b03030"),
        ],
    );
    s.push_str("</svg>");
    s
}

/// The budget–overhead curve of a sweep: extra compute against the budget, with the
/// proven lower bound; `chosen` marks a budget.
pub fn pareto_chart(c: &ParetoCurve, chosen: Option<u64>) -> String {
    let (w, h) = (1000u32, 340u32);
    let pts: Vec<_> = c.points.iter().filter(|p| p.feasible).collect();
    let x_hi = c
        .baseline_peak_bytes
        .max(pts.iter().map(|p| p.budget_bytes).max().unwrap_or(0));
    let x_lo = pts
        .iter()
        .map(|p| p.budget_bytes)
        .min()
        .unwrap_or(0)
        .min(x_hi);
    let y_hi = pts
        .iter()
        .map(|p| p.overhead.max(p.lower_bound_overhead))
        .fold(0.0f64, f64::max);
    // Overhead axis in percent: ticks of 1, 2 or 5 times a power of ten.
    let ystep = [
        0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0,
    ]
    .into_iter()
    .find(|&st| y_hi * 100.0 / st <= 6.0)
    .unwrap_or(1000.0);
    let ytop = ((y_hi * 100.0 / ystep).ceil().max(1.0)) * ystep;
    let f = Frame {
        left: 78.0,
        top: 24.0,
        width: w as f64 - 98.0,
        height: h as f64 - 90.0,
        x_max: (x_hi - x_lo) as f64,
        y_max: ytop,
    };
    let mut s = open_svg("pareto-chart", w, h, "extra compute against budget", false);
    let mut v = 0.0;
    while v <= ytop + 1e-9 {
        let y = f.y(v);
        let _ = write!(
            s,
            r#"<line class="grid" x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}%</text>"#,
            f.left,
            f.right(),
            f.left - 6.0,
            y + 4.0,
            format!("{v:.2}")
                .trim_end_matches('0')
                .trim_end_matches('.')
        );
        v += ystep;
    }
    let xs = |b: u64| f.x((b - x_lo) as f64);
    for k in 0..=4 {
        let b = x_lo + (x_hi - x_lo) * k / 4;
        let _ = write!(
            s,
            r#"<text class="tick" x="{:.1}" y="{:.1}" text-anchor="{}">{}</text>"#,
            xs(b),
            f.bottom() + 15.0,
            match k {
                0 => "start",
                4 => "end",
                _ => "middle",
            },
            esc(&short_bytes(b))
        );
    }
    let _ = write!(
        s,
        r#"<line class="axis" x1="{l:.1}" y1="{b:.1}" x2="{r:.1}" y2="{b:.1}"/><text class="axis-title" x="{r:.1}" y="{:.1}" text-anchor="end">budget (peak allowed)</text><text class="axis-title" x="{l:.1}" y="{:.1}">extra compute</text>"#,
        f.bottom() + 30.0,
        f.top - 8.0,
        l = f.left,
        r = f.right(),
        b = f.bottom(),
    );
    let line = |get: &dyn Fn(&crate::remat::pareto::ParetoPoint) -> f64| {
        pts.iter()
            .map(|p| format!("{:.1},{:.1}", xs(p.budget_bytes), f.y(get(p) * 100.0)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = write!(
        s,
        r#"<polyline id="pareto-bound" class="bound" fill="none" points="{}"/><polyline id="pareto-curve" class="after" fill="none" points="{}"/>"#,
        line(&|p| p.lower_bound_overhead),
        line(&|p| p.overhead)
    );
    for p in &pts {
        let _ = write!(
            s,
            r#"<circle class="pareto-point" cx="{:.1}" cy="{:.1}" r="3.5" data-budget="{}" data-overhead="{}"><title>budget {} ({:.0}%): peak {}, {:.2}% extra compute, {} recomputed</title></circle>"#,
            xs(p.budget_bytes),
            f.y(p.overhead * 100.0),
            p.budget_bytes,
            p.overhead,
            esc(&human_bytes(p.budget_bytes)),
            p.budget_fraction * 100.0,
            esc(&human_bytes(p.peak_bytes)),
            p.overhead * 100.0,
            p.recomputed
        );
    }
    if let Some(b) = chosen.filter(|&b| b >= x_lo && b <= x_hi) {
        let x = xs(b);
        let _ = write!(
            s,
            r#"<line class="budget" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}"/>"#,
            f.top,
            f.bottom()
        );
    }
    legend(
        &mut s,
        f.left,
        h as f64 - 12.0,
        &[
            ("extra compute of the plan", "#1f5fa8"),
            ("proven lower bound", "#9a9a9a"),
        ],
    );
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsampling_keeps_every_stretch_largest_and_the_peak() {
        let v: Vec<u64> = (0..3079u64).map(|i| (i * 7919) % 1000).collect();
        let peak = v
            .iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > v[b] { i } else { b });
        let idx = downsample(&v, MAX_POINTS);
        assert_eq!(idx.len(), MAX_POINTS);
        assert!(idx.windows(2).all(|w| w[0] < w[1]));
        assert!(idx.contains(&peak));
        assert_eq!(
            downsample(&v[..10], MAX_POINTS),
            (0..10).collect::<Vec<_>>()
        );
        assert!(downsample(&[], MAX_POINTS).is_empty());
    }

    #[test]
    fn axis_ticks_and_labels() {
        assert_eq!(byte_ticks(994 << 20), (256 << 20, 1 << 30));
        assert_eq!(byte_ticks(2470 << 20), (512 << 20, 5 << 29));
        assert_eq!(short_bytes(1 << 30), "1 GiB");
        assert_eq!(short_bytes(3 << 29), "1.5 GiB");
        assert_eq!(short_bytes(768 << 20), "768 MiB");
        assert_eq!(short_bytes(12), "12 B");
        assert_eq!(count_step(3079), 500);
        assert_eq!(
            esc("a<b & 'c' \"d\">"),
            "a&lt;b &amp; &#39;c&#39; &quot;d&quot;&gt;"
        );
    }

    #[test]
    fn phase_runs_are_maximal() {
        use StepKind::*;
        let r = phase_runs(&[Forward, Forward, Loss, Backward, Backward, Optimizer]);
        assert_eq!(
            r,
            vec![
                (0, 1, Forward),
                (2, 2, Loss),
                (3, 4, Backward),
                (5, 5, Optimizer)
            ]
        );
    }
}
