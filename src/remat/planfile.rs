//! plan.json: the plan written by `memplan plan -o` and read by `memplan verify
//! --plan` (format in docs/PLAN_FORMAT.md).
//!
//! Reading is strict, and everything is checked before anything runs: the format tag
//! and the version are checked first (a reader must reject a version it does not
//! know); then, against the training step the reader built, the step it was made for
//! (model file, batch, bound dims, optimizer, precision, loss; the `step` key), the
//! graph itself (every node's name, inputs and outputs, every value's name and bytes:
//! a plan from another model or batch cannot pass), and the plan (replayed: a read of
//! a freed value, a value freed twice or a node never computed is rejected), whose
//! peak must equal the file's `predicted_peak_bytes`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::graph::{replay, Instr, RematGraph};
use crate::error::{Error, Result};
use crate::train::TrainOptions;

/// The `format` tag.
pub const FORMAT: &str = "memplan-plan";
/// The one version this memplan reads and writes.
pub const VERSION: u64 = 1;

/// What the plan's training step was built from (the `step` key; absent in files
/// made from a benchmark DAG).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSource {
    /// The model's file name (no folder).
    pub model: String,
    /// The batch size given (`None`: the model's own).
    pub batch: Option<u64>,
    /// Other bound dimensions.
    #[serde(default)]
    pub dims: BTreeMap<String, u64>,
    /// `sgd`, `momentum`, `adam` or `adamw`.
    pub optimizer: String,
    /// `fp32`, `amp-fp16`, `amp-bf16` or `bf16`.
    pub precision: String,
    /// `mean` or `sum`.
    pub loss: String,
    /// `--freeze` pattern (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze: Option<String>,
    /// `--trainable` pattern (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable: Option<String>,
}

impl StepSource {
    /// The source of a step built from `model` with these bindings and options.
    pub fn new(
        model: &Path,
        batch: Option<u64>,
        dims: &BTreeMap<String, u64>,
        opts: &TrainOptions,
    ) -> StepSource {
        let name = |v: serde_json::Value| v.as_str().unwrap_or_default().to_string();
        StepSource {
            model: model
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            batch,
            dims: dims.clone(),
            optimizer: name(serde_json::json!(opts.optimizer)),
            precision: name(serde_json::json!(opts.precision)),
            loss: name(serde_json::json!(opts.loss)),
            freeze: opts.params.freeze.as_ref().map(|p| p.as_str().to_string()),
            trainable: opts
                .params
                .trainable
                .as_ref()
                .map(|p| p.as_str().to_string()),
        }
    }
}

/// A plan.json document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanFile {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u64,
    /// The rematerialization graph of the step.
    pub graph: RematGraph,
    /// The budget the plan was made for.
    pub budget_bytes: u64,
    /// The plan's replayed peak.
    pub predicted_peak_bytes: u64,
    /// The planner.
    pub solver: String,
    /// What node costs count.
    pub cost_unit: String,
    /// The instructions.
    pub plan: Vec<Instr>,
    /// The training step it was made for (ONNX models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepSource>,
    /// Whether the plan meets its budget: `false` for the lowest-peak plan written
    /// when none does (absent in files written before this key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feasible: Option<bool>,
}

impl PlanFile {
    /// The document as JSON bytes.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a plan serializes")
    }

    /// Reads `path`: format and version first, then the document's structure.
    pub fn read(path: &Path) -> Result<PlanFile> {
        let bad = |m: String| Error::Plan(format!("{}: {m}", path.display()));
        let text = crate::files::read_capped(path, crate::files::MAX_JSON_BYTES)?;
        let v: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if v.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(bad(format!(
                "not a memplan plan (no \"format\": \"{FORMAT}\")"
            )));
        }
        match v.get("version").and_then(|x| x.as_u64()) {
            Some(VERSION) => {}
            Some(other) => {
                return Err(bad(format!(
                    "plan format version {other} is unknown (this memplan reads version {VERSION})"
                )))
            }
            None => return Err(bad("no \"version\"".into())),
        }
        let plan: PlanFile =
            serde_json::from_value(v).map_err(|e| bad(format!("malformed plan: {e}")))?;
        // Byte counts past 2^62 are no device's: refused, so that every sum stays
        // inside 64 bits.
        for (key, n) in [
            ("budget_bytes", plan.budget_bytes),
            ("predicted_peak_bytes", plan.predicted_peak_bytes),
        ] {
            if n > 1 << 62 {
                return Err(bad(format!("\"{key}\" {n} is beyond what memplan counts")));
            }
        }
        // Costs and sizes a replay and an overhead can count: finite, not negative
        // (negative costs printed an overhead of -inf %).
        if let Some(n) = plan
            .graph
            .nodes
            .iter()
            .find(|n| !(n.cost.is_finite() && (0.0..=1e18).contains(&n.cost)))
        {
            return Err(bad(format!(
                "node '{}' has cost {}, not a finite cost from 0 to 1e18",
                n.name, n.cost
            )));
        }
        plan.graph
            .check()
            .map_err(|e| bad(format!("its graph: {e}")))?;
        Ok(plan)
    }

    /// Whether the plan misses its budget: as the file says, or, in a file without
    /// `feasible`, by its predicted peak.
    pub fn infeasible(&self) -> bool {
        self.feasible == Some(false) || self.predicted_peak_bytes > self.budget_bytes
    }

    /// Checks the file against the step `source` whose graph is `g`, and replays the
    /// plan; returns the replayed peak. Every mismatch is one line with its reason.
    pub fn check_against(&self, g: &RematGraph, source: &StepSource) -> Result<u64> {
        let bad = |m: String| Err(Error::Plan(format!("the plan does not fit this run: {m}")));
        if let Some(s) = &self.step {
            // Values quoted; an absent pattern is `none`, which no quoted pattern equals.
            let q = |v: &str| format!("'{v}'");
            let pattern = |p: &Option<String>| p.as_deref().map_or("none".into(), q);
            let pairs = [
                ("model", q(&s.model), q(&source.model)),
                ("optimizer", q(&s.optimizer), q(&source.optimizer)),
                ("precision", q(&s.precision), q(&source.precision)),
                ("loss", q(&s.loss), q(&source.loss)),
                (
                    "frozen parameters",
                    pattern(&s.freeze),
                    pattern(&source.freeze),
                ),
                (
                    "trainable parameters",
                    pattern(&s.trainable),
                    pattern(&source.trainable),
                ),
            ];
            for (what, had, want) in pairs {
                if had != want {
                    return bad(format!("it was made for {what} {had}, this run is {want}"));
                }
            }
            if s.batch != source.batch {
                let show = |b: Option<u64>| b.map_or("the model's own".into(), |b| b.to_string());
                return bad(format!(
                    "it was made for batch {}, this run is batch {}",
                    show(s.batch),
                    show(source.batch)
                ));
            }
            if s.dims != source.dims {
                return bad(format!(
                    "it was made for dims {:?}, this run binds {:?}",
                    s.dims, source.dims
                ));
            }
        }
        let pg = &self.graph;
        if pg.nodes.len() != g.nodes.len() || pg.values.len() != g.values.len() {
            return bad(format!(
                "its step has {} nodes and {} values, this one {} and {} (another model?)",
                pg.nodes.len(),
                pg.values.len(),
                g.nodes.len(),
                g.values.len()
            ));
        }
        for (i, (a, b)) in pg.nodes.iter().zip(&g.nodes).enumerate() {
            if a.name != b.name {
                return bad(format!(
                    "node {i} is '{}' in the plan, '{}' here (another model?)",
                    a.name, b.name
                ));
            }
            if a.inputs != b.inputs || a.outputs != b.outputs || a.recomputable != b.recomputable {
                return bad(format!("node '{}' reads or writes other values", a.name));
            }
        }
        for (a, b) in pg.values.iter().zip(&g.values) {
            if a.name != b.name {
                return bad(format!(
                    "value '{}' is '{}' here (another model?)",
                    a.name, b.name
                ));
            }
            if a.bytes != b.bytes {
                return bad(format!(
                    "'{}' is {} bytes in the plan, {} here (another batch or shape?)",
                    a.name, a.bytes, b.bytes
                ));
            }
            if (a.fixed, a.held, a.producer) != (b.fixed, b.held, b.producer) {
                return bad(format!("value '{}' is kept or produced otherwise", a.name));
            }
        }
        let r =
            replay(g, &self.plan).map_err(|e| Error::Plan(format!("the plan is invalid: {e}")))?;
        if r.peak_bytes != self.predicted_peak_bytes {
            return bad(format!(
                "predicted_peak_bytes is {}, the plan replays to {}",
                self.predicted_peak_bytes, r.peak_bytes
            ));
        }
        Ok(r.peak_bytes)
    }
}
