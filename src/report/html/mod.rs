//! The HTML report: one self-contained page (inline SVG and CSS, a little JavaScript
//! for hovering, no network references) that pictures one training step's memory:
//! the step by category with its phases and peak, the breakdown and the largest
//! tensors at the peak, bytes per module, and, when given, a plan's curve before and
//! after, the budget–overhead curve and the fit table. [`Report::svg`] is the step
//! chart alone.
//!
//! The page is well-formed XML apart from its doctype and the raw text of its
//! `script` and `style` elements: every element is closed, void ones self-closed,
//! text and attributes escaped.

pub mod data;
pub mod svg;

use std::fmt::Write as _;

use crate::fit::FitReport;
use crate::memory::simulate::CATEGORIES;
use crate::memory::Replay;
use crate::remat::graph::RematGraph;
use crate::remat::pareto::ParetoCurve;
use crate::report::train::TrainingReport;
use crate::train::{Schedule, StepKind};
use crate::units::{human_bytes, human_flops};
use data::{largest_at_peak, module_rows, LiveRow, ModuleRow, PlanView};
use svg::{esc, pareto_chart, phase_name, plan_chart, step_chart, CATS, SVG_CSS};

/// Tensors listed at the peak.
pub const LARGEST: usize = 12;

/// Module depth shown in the per-module table (0: top-level modules, 1: one level
/// down, as `layer1.0` or `transformer.h.3`).
pub const MODULE_DEPTH: usize = 1;

/// Everything the report shows.
#[derive(Debug, Clone)]
pub struct Report {
    /// The model as named on the command line.
    pub model: String,
    /// Batch size.
    pub batch: Option<u64>,
    /// The step (the `training` object of `profile --train --json`).
    pub training: TrainingReport,
    /// Op type of every step.
    pub ops: Vec<String>,
    /// The largest tensors live at the peak.
    pub largest: Vec<LiveRow>,
    /// Bytes per module.
    pub modules: Vec<ModuleRow>,
    /// A plan, if one was made or given.
    pub plan: Option<PlanView>,
    /// A budget sweep, if one was run.
    pub pareto: Option<ParetoCurve>,
    /// The fit table, if a memory was given.
    pub fit: Option<FitReport>,
}

impl Report {
    /// The report of a step: `s` replayed as `r` (and reported as `training`), `g`
    /// its graph ([`crate::remat::from_schedule::from_schedule`]).
    pub fn new(
        model: &str,
        batch: Option<u64>,
        s: &Schedule,
        r: &Replay,
        g: &RematGraph,
        training: TrainingReport,
    ) -> Report {
        Report {
            model: model.to_string(),
            batch,
            training,
            ops: s.steps.iter().map(|st| st.op.clone()).collect(),
            largest: largest_at_peak(s, r, LARGEST),
            modules: module_rows(s, r, g, MODULE_DEPTH),
            plan: None,
            pareto: None,
            fit: None,
        }
    }

    /// The op of the step at the peak.
    fn peak_op(&self) -> &str {
        let t = &self.training;
        let at = t.timeline.iter().enumerate().fold(0, |b, (i, p)| {
            if p.total > t.timeline[b].total {
                i
            } else {
                b
            }
        });
        self.ops.get(at).map_or("", |s| s.as_str())
    }

    /// The step chart alone, as an SVG document.
    pub fn svg(&self) -> String {
        let (s, _) = step_chart(&self.training, self.peak_op(), true);
        format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n{s}\n")
    }

    /// The whole page.
    pub fn html(&self) -> String {
        let t = &self.training;
        let (chart, drawn) = step_chart(t, self.peak_op(), false);
        let mut h = String::with_capacity(256 * 1024);
        let title = format!("memplan report: {}", self.model);
        let _ = write!(
            h,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n<title>{}</title>\n<style>{CSS}{SVG_CSS}</style>\n</head>\n<body>\n",
            esc(&title)
        );
        let _ = write!(
            h,
            "<header><h1>Memory of one training step</h1><p class=\"sub\">{} · batch {} · {} optimizer · {} · loss = {} of the first output · {} steps</p></header>",
            esc(&self.model),
            self.batch.map_or("as exported".to_string(), |b| b.to_string()),
            esc(&t.optimizer),
            esc(&t.precision),
            esc(&t.loss),
            t.timeline.len()
        );
        self.summary(&mut h);
        let _ = write!(
            h,
            "<section id=\"step\"><h2>The step</h2><p>Bytes live during each step of the training step, stacked by category, in execution order; the bands underneath mark the phases. Hover for a step's figures.</p><div class=\"chart-wrap\">{chart}<div id=\"tooltip\" hidden=\"hidden\"></div></div><p class=\"note\">{} of {} steps drawn (the largest of each stretch; the peak step is always among them).</p></section>",
            drawn.len(),
            t.timeline.len()
        );
        self.peak(&mut h);
        self.modules_section(&mut h);
        if let Some(p) = &self.plan {
            plan_section(
                &mut h,
                p,
                &t.timeline.iter().map(|x| x.phase).collect::<Vec<_>>(),
            );
        }
        if let Some(c) = &self.pareto {
            pareto_section(&mut h, c, self.plan.as_ref().and_then(|p| p.budget_bytes));
        }
        if let Some(f) = &self.fit {
            fit_section(&mut h, f);
        }
        let _ = write!(
            h,
            "<footer>Made by memplan from the model alone: no GPU run. Figures are the simulator's (docs/TRAINING_MEMORY.md).</footer>\n<script type=\"application/json\" id=\"step-data\">{}</script>\n<script>{JS}</script>\n</body>\n</html>\n",
            self.step_data(&drawn)
        );
        h
    }

    /// The drawn points as JSON for the hover script (`<`, `>` and `&` escaped, so
    /// the text never closes its element).
    fn step_data(&self, drawn: &[usize]) -> String {
        let t = &self.training;
        let points: Vec<serde_json::Value> = drawn
            .iter()
            .map(|&i| {
                let p = &t.timeline[i];
                let mut v = vec![
                    serde_json::json!(i),
                    serde_json::json!(p.node),
                    serde_json::json!(self.ops.get(i).map_or("", |s| s.as_str())),
                    serde_json::json!(phase_name(p.phase)),
                ];
                v.extend(CATS.iter().map(|c| serde_json::json!(c.get(&p.bytes))));
                serde_json::Value::Array(v)
            })
            .collect();
        let doc = serde_json::json!({
            "categories": CATS.iter().map(|c| c.key()).collect::<Vec<_>>(),
            "labels": CATS.iter().map(|c| c.label()).collect::<Vec<_>>(),
            "colors": CATS.iter().map(|c| c.color).collect::<Vec<_>>(),
            "points": points,
        });
        doc.to_string()
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('&', "\\u0026")
    }

    /// The key figures.
    fn summary(&self, h: &mut String) {
        let t = &self.training;
        let mut cards: Vec<(String, String)> = vec![
            (
                "peak".into(),
                format!(
                    "{} during {} ({})",
                    human_bytes(t.peak_bytes),
                    t.peak_node,
                    phase_name(t.peak_phase)
                ),
            ),
            ("parameters".into(), human_bytes(t.params_bytes)),
            ("gradients".into(), human_bytes(t.grads_bytes)),
            ("optimizer state".into(), human_bytes(t.optimizer_bytes)),
            (
                "saved for backward".into(),
                human_bytes(t.saved_activation_bytes),
            ),
            (
                "compute per step".into(),
                format!(
                    "{} ({} forward)",
                    human_flops(t.flops_per_step),
                    human_flops(t.flops_forward)
                ),
            ),
        ];
        if let Some(a) = &t.allocator {
            cards.push((
                "caching allocator".into(),
                format!(
                    "allocated peak {}, reserved {} in {} segments",
                    human_bytes(a.allocated_peak_bytes),
                    human_bytes(a.reserved_bytes),
                    a.segments
                ),
            ));
        }
        if let (Some(b), Some(d)) = (t.device_bytes, &t.device) {
            cards.push((
                "nvidia-smi".into(),
                format!(
                    "about {} (reserved + CUDA context {}{})",
                    human_bytes(b),
                    human_bytes(d.context_bytes),
                    d.gpu.as_ref().map(|g| format!(", {g}")).unwrap_or_default()
                ),
            ));
        }
        h.push_str("<section id=\"summary\" class=\"cards\">");
        for (k, v) in cards {
            let _ = write!(
                h,
                "<div class=\"card\"><div class=\"k\">{}</div><div class=\"v\">{}</div></div>",
                esc(&k),
                esc(&v)
            );
        }
        h.push_str("</section>\n");
    }

    /// The breakdown at the peak and the largest tensors live there.
    fn peak(&self, h: &mut String) {
        let t = &self.training;
        let _ = write!(
            h,
            "<section id=\"peak\"><h2>The peak</h2><p>{} during step <code>{}</code> ({}, {}).</p><table id=\"breakdown\"><thead><tr><th>category</th><th class=\"num\">bytes</th><th class=\"num\">share</th><th></th></tr></thead><tbody>",
            human_bytes(t.peak_bytes),
            esc(&t.peak_node),
            esc(self.peak_op()),
            phase_name(t.peak_phase)
        );
        for c in &CATS {
            let v = c.get(&t.breakdown);
            let pct = share(v, t.peak_bytes);
            let _ = write!(
                h,
                "<tr data-category=\"{}\"><td><span class=\"sw\" style=\"background:{}\"></span>{}</td><td class=\"num\" data-bytes=\"{v}\">{}</td><td class=\"num\">{pct:.1}%</td><td class=\"barcell\"><div class=\"bar\" style=\"width:{pct:.1}%;background:{}\"></div></td></tr>",
                c.key(),
                c.color,
                c.label(),
                human_bytes(v),
                c.color
            );
        }
        let _ = write!(
            h,
            "</tbody><tfoot><tr><td>total</td><td class=\"num\" data-bytes=\"{}\">{}</td><td class=\"num\">100%</td><td></td></tr></tfoot></table>",
            t.peak_bytes,
            human_bytes(t.peak_bytes)
        );
        h.push_str("<h3>Largest tensors live at the peak</h3><table id=\"largest\"><thead><tr><th class=\"num\">bytes</th><th>category</th><th>dtype</th><th>shape</th><th>tensor</th><th>made by</th></tr></thead><tbody>");
        for r in &self.largest {
            let cat = CATEGORIES
                .iter()
                .position(|&c| c == r.category)
                .map_or("", |k| CATS[k].label());
            let _ = write!(
                h,
                "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td><code>{}</code></td></tr>",
                human_bytes(r.bytes),
                cat,
                esc(&r.dtype),
                // A storage with no tensor shape (optimizer state: one vector over
                // every parameter) is flat, not a scalar.
                if r.shape.is_empty() && r.bytes > 8 {
                    "flat".to_string()
                } else {
                    format!(
                        "[{}]",
                        r.shape
                            .iter()
                            .map(|d| d.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                },
                esc(&r.name),
                esc(r.made_by.as_deref().unwrap_or("(resident)"))
            );
        }
        h.push_str("</tbody></table></section>\n");
    }

    /// Bytes per module.
    fn modules_section(&self, h: &mut String) {
        h.push_str("<section id=\"modules\"><h2>Per module</h2>");
        if self.modules.is_empty() {
            h.push_str("<p>The exporter left no module scopes in the node names: no module table.</p></section>\n");
            return;
        }
        let _ = write!(
            h,
            "<p>Modules from the exporter's scope names, two levels deep, in execution order. <em>Saved</em>: bytes its forward writes that backward reads. <em>At the peak</em>: bytes its forward and backward steps wrote that are live at the peak, and their share of the peak {}.</p><table id=\"module-table\"><thead><tr><th>module</th><th class=\"num\">forward steps</th><th class=\"num\">saved</th><th class=\"num\">at the peak</th><th class=\"num\">share</th><th></th></tr></thead><tbody>",
            human_bytes(self.training.peak_bytes)
        );
        for m in &self.modules {
            let pct = m.peak_share * 100.0;
            let _ = write!(
                h,
                "<tr class=\"depth{}\" data-module=\"{}\"><td><code>{}</code></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{pct:.1}%</td><td class=\"barcell\"><div class=\"bar\" style=\"width:{pct:.1}%\"></div></td></tr>",
                m.depth.min(3),
                esc(&m.path),
                esc(&m.path),
                m.forward_steps,
                human_bytes(m.saved_bytes),
                human_bytes(m.live_at_peak_bytes)
            );
        }
        h.push_str("</tbody></table></section>\n");
    }
}

/// `v` as a percentage of `of`.
fn share(v: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        v as f64 * 100.0 / of as f64
    }
}

/// A list of names, the first `n` shown.
fn name_list(names: &[String], n: usize) -> String {
    let mut s: String = names
        .iter()
        .take(n)
        .map(|m| format!("<code>{}</code>", esc(m)))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > n {
        let _ = write!(s, " and {} more", names.len() - n);
    }
    s
}

/// The plan: its curve against the step without recomputation, and what it recomputes.
fn plan_section(h: &mut String, p: &PlanView, phases: &[StepKind]) {
    let _ = write!(
        h,
        "<section id=\"plan\" data-peak-bytes=\"{}\" data-baseline-bytes=\"{}\"><h2>With a plan</h2><p>{}: peak {} instead of {} ({}), {:.2}% extra compute{}.</p><div class=\"chart-wrap\">{}</div>",
        p.peak_bytes,
        p.baseline_peak_bytes,
        esc(&p.label),
        human_bytes(p.peak_bytes),
        human_bytes(p.baseline_peak_bytes),
        match p.budget_bytes {
            Some(b) if p.feasible => format!("within the budget {}", human_bytes(b)),
            Some(b) => format!("<strong>over the budget {}</strong>", human_bytes(b)),
            None => "no budget".to_string(),
        },
        p.overhead * 100.0,
        if p.recompute_at.is_empty() {
            String::new()
        } else {
            format!(
                "; recomputation before {} of the steps",
                p.recompute_at.len()
            )
        },
        plan_chart(p, phases)
    );
    if let Some(l) = p.lowest_bytes {
        let _ = write!(
            h,
            "<p>The lowest peak the planner reached for this step: {}.</p>",
            human_bytes(l)
        );
    }
    if p.checkpointed {
        let _ = write!(
            h,
            "<p id=\"plan-modules\">Checkpointed modules ({}): {}.</p>",
            p.modules.len(),
            name_list(&p.modules, 40)
        );
    } else if !p.modules.is_empty() {
        let _ = write!(
            h,
            "<p id=\"plan-modules\">Modules whose ops are recomputed ({}): {}.</p>",
            p.modules.len(),
            name_list(&p.modules, 40)
        );
    }
    let _ = write!(
        h,
        "<p id=\"plan-recomputed\">Recomputed tensors ({}): {}.</p></section>",
        p.recomputed.len(),
        if p.recomputed.is_empty() {
            "none".to_string()
        } else {
            name_list(&p.recomputed, 30)
        }
    );
}

/// The budget sweep.
fn pareto_section(h: &mut String, c: &ParetoCurve, chosen: Option<u64>) {
    let _ = write!(
        h,
        "<section id=\"pareto\"><h2>Budget and extra compute</h2><p>Plans ({:?}) from the no-recompute peak {} down to the lowest peak reached, {}; the dashed line is the proven lower bound on extra compute.</p><div class=\"chart-wrap\">{}</div><table id=\"pareto-table\"><thead><tr><th class=\"num\">budget</th><th class=\"num\">of peak</th><th class=\"num\">peak</th><th class=\"num\">extra compute</th><th class=\"num\">lower bound</th><th class=\"num\">recomputed</th><th>fits</th></tr></thead><tbody>",
        c.solver,
        human_bytes(c.baseline_peak_bytes),
        human_bytes(c.min_feasible_bytes),
        pareto_chart(c, chosen)
    );
    for p in &c.points {
        let _ = write!(
            h,
            "<tr><td class=\"num\">{}</td><td class=\"num\">{:.0}%</td><td class=\"num\">{}</td><td class=\"num\">{:.2}%</td><td class=\"num\">{:.2}%</td><td class=\"num\">{}</td><td>{}</td></tr>",
            human_bytes(p.budget_bytes),
            p.budget_fraction * 100.0,
            human_bytes(p.peak_bytes),
            p.overhead * 100.0,
            p.lower_bound_overhead * 100.0,
            p.recomputed,
            if p.feasible { "yes" } else { "no" }
        );
    }
    h.push_str("</tbody></table></section>\n");
}

/// The fit table and its recommendation.
fn fit_section(h: &mut String, r: &FitReport) {
    let _ = write!(
        h,
        "<section id=\"fit\"><h2>Fitting {} per GPU</h2><p>The largest batch per strategy ({} GPU{}; batch 1 needs {} as exported){}.</p><table id=\"fit-table\"><thead><tr><th>strategy</th><th class=\"num\">max batch</th><th class=\"num\">peak</th>{}<th class=\"num\">extra compute</th><th>notes</th></tr></thead><tbody>",
        human_bytes(r.memory_bytes),
        r.gpus,
        if r.gpus == 1 { "" } else { "s" },
        human_bytes(r.batch1_bytes),
        r.device
            .as_ref()
            .map(|d| format!(
                "; decided on the caching allocator's reserved bytes within {}",
                human_bytes(d.allocator_capacity_bytes.unwrap_or(0))
            ))
            .unwrap_or_default(),
        if r.device.is_some() {
            "<th class=\"num\">nvidia-smi</th>"
        } else {
            ""
        }
    );
    for st in &r.strategies {
        let batch = match (st.max_batch, st.global_batch) {
            (0, _) => "none".to_string(),
            (b, Some(gb)) if gb != b => format!("{b} ({gb})"),
            (b, _) => b.to_string(),
        };
        let smi = match (&r.device, st.device_bytes) {
            (None, _) => String::new(),
            (Some(_), Some(b)) => format!("<td class=\"num\">{}</td>", human_bytes(b)),
            (Some(_), None) => "<td class=\"num\">-</td>".to_string(),
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td class=\"num\">{batch}</td><td class=\"num\">{}</td>{smi}<td class=\"num\">{:.1}%</td><td>{}</td></tr>",
            esc(&st.name),
            human_bytes(st.peak_bytes),
            st.overhead * 100.0,
            esc(&st.note)
        );
    }
    h.push_str("</tbody></table>");
    if let (Some(t), Some(rec)) = (r.target_batch, &r.recommendation) {
        let _ = write!(
            h,
            "<p id=\"recommendation\"><strong>Recommended for global batch {t}:</strong> {}: {}; peak {} per GPU; {:.1}% extra compute. {}</p>",
            esc(&rec.strategies.join(" + ")),
            crate::report::fit::split_phrase(rec, r.gpus),
            human_bytes(rec.peak_bytes),
            rec.overhead * 100.0,
            esc(&rec.why)
        );
    }
    if let Some(u) = &r.unreachable {
        let _ = write!(h, "<p>{}</p>", esc(u));
    }
    h.push_str("</section>\n");
}

/// The page's style.
const CSS: &str = "
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;color:#222;margin:24px auto;max-width:1040px;padding:0 16px;background:#fff}
h1{font-size:22px;margin:0}h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}h3{font-size:15px;margin:18px 0 6px}
.sub{color:#555;margin:4px 0 12px}.note{color:#666;font-size:12px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:8px}
.card{border:1px solid #e2e2e2;border-radius:6px;padding:6px 10px;background:#fafafa}.card .k{color:#666;font-size:12px}.card .v{font-weight:600;overflow-wrap:anywhere}
.chart-wrap{position:relative;overflow-x:auto}
svg.chart{display:block;max-width:100%;height:auto;font-family:system-ui,sans-serif}
#hover-line{stroke:#000;stroke-width:1;opacity:.5;pointer-events:none}
svg .before{stroke:#9a9a9a;stroke-width:1.5}svg .after{stroke:#1f5fa8;stroke-width:1.5}svg .bound{stroke:#9a9a9a;stroke-width:1.5;stroke-dasharray:5 4}
svg .budget{stroke:#b03030;stroke-dasharray:6 4}svg .recompute{stroke:#b03030}svg .pareto-point{fill:#1f5fa8}
#tooltip{position:absolute;top:52px;right:24px;background:rgba(255,255,255,.96);border:1px solid #bbb;border-radius:4px;padding:6px 8px;font-size:12px;pointer-events:none;max-width:420px}
#tooltip table{border-collapse:collapse}#tooltip td{padding:0 6px 0 0}
table{border-collapse:collapse;width:100%;margin:6px 0}th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top}
th{font-weight:600;color:#444;background:#f6f6f6}.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
td code{font-size:12px;overflow-wrap:anywhere}.barcell{width:28%}.bar{height:10px;background:#59a14f;border-radius:2px;min-width:1px}
.sw{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px}
tr.depth1 td:first-child{padding-left:24px}tr.depth2 td:first-child{padding-left:40px}tr.depth0 td{font-weight:600}
footer{margin:32px 0 8px;color:#777;font-size:12px}
";

/// Hovering over the step chart: the nearest drawn step's figures. Builds its
/// elements with the DOM (no markup in strings) and marks the page when it has run.
const JS: &str = "
(function(){
var el=document.getElementById('step-data');
var svg=document.getElementById('step-chart');
var zone=document.getElementById('hover-zone');
var line=document.getElementById('hover-line');
var tip=document.getElementById('tooltip');
if(!el||!svg||!zone||!line||!tip){return;}
var data=JSON.parse(el.textContent);
var pts=data.points;
var left=Number(zone.getAttribute('data-left'));
var width=Number(zone.getAttribute('data-width'));
var last=Math.max(Number(zone.getAttribute('data-steps'))-1,1);
function fmt(b){var u=['B','KiB','MiB','GiB','TiB','PiB'];var i=0;while(b>=1024&&i<5){b=b/1024;i++;}return (i===0?String(b):b.toFixed(2))+' '+u[i];}
function cell(tr,text,color){var td=document.createElement('td');if(color){var s=document.createElement('span');s.className='sw';s.style.background=color;td.appendChild(s);}td.appendChild(document.createTextNode(text));tr.appendChild(td);}
function show(q){
var x=left+q[0]/last*width;
line.setAttribute('x1',x);line.setAttribute('x2',x);line.setAttribute('visibility','visible');
while(tip.firstChild){tip.removeChild(tip.firstChild);}
var head=document.createElement('div');
head.textContent='step '+q[0]+' ('+q[3]+'): '+q[2]+' '+q[1];
tip.appendChild(head);
var t=document.createElement('table');var total=0;
for(var k=data.categories.length-1;k>=0;k--){var v=q[4+k];total+=v;var tr=document.createElement('tr');cell(tr,data.labels[k],data.colors[k]);cell(tr,fmt(v));t.appendChild(tr);}
var tr=document.createElement('tr');cell(tr,'total');cell(tr,fmt(total));t.appendChild(tr);
tip.appendChild(t);tip.hidden=false;
}
zone.addEventListener('mousemove',function(e){
var m=svg.getScreenCTM();if(!m){return;}
var p=svg.createSVGPoint();p.x=e.clientX;p.y=e.clientY;p=p.matrixTransform(m.inverse());
var step=(p.x-left)/width*last;
var lo=0,hi=pts.length-1;
while(lo<hi){var mid=(lo+hi)>>1;if(pts[mid][0]<step){lo=mid+1;}else{hi=mid;}}
if(lo>0&&Math.abs(pts[lo-1][0]-step)<=Math.abs(pts[lo][0]-step)){lo=lo-1;}
if(pts.length){show(pts[lo]);}
});
zone.addEventListener('mouseleave',function(){line.setAttribute('visibility','hidden');tip.hidden=true;});
document.documentElement.setAttribute('data-script','ran');
document.documentElement.setAttribute('data-points',String(pts.length));
})();
";
