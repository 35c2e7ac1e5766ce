//! Node costs other than FLOPs: measured (`memplan plan --costs FILE`) or modelled
//! by a roofline (`memplan plan --roofline FLOPS,BYTES`).
//!
//! The file is one JSON object mapping node names to seconds, e.g.
//! `{"/conv1/Conv": 0.0012, "/conv1/Conv/grad": 0.0025, "loss": 1e-5, ...}`. Node names
//! are those of the [`RematGraph`]: for ONNX models the forward node's name, `<node>/grad`
//! for its backward, `loss`, `loss/grad` and `optimizer` (plan.json lists them under
//! `graph.nodes`); for benchmark DAGs the file's node names.
//!
//! The file must give every node a cost and name nothing else: a cost in seconds
//! cannot be mixed with FLOPs, and a name that matches no node is almost always a typo
//! or a file made for another model. Each cost must be a finite number >= 0, no name
//! may appear twice, and the costs may not all be 0 (the overhead would be undefined).
//! Every violation is one error line naming how many entries are wrong and the first
//! few of them.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::graph::RematGraph;
use crate::error::{Error, Result};

/// What node costs (and therefore `recompute_flops`, `baseline_flops`) count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CostUnit {
    /// FLOPs (multiply-add = 2): the default for ONNX models.
    Flops,
    /// Measured seconds (`--costs`).
    Seconds,
    /// Seconds modelled from FLOPs and bytes moved at a machine's rates (`--roofline`).
    Roofline,
    /// The benchmark file's own compute-cost units (`--dag`).
    Benchmark,
}

impl fmt::Display for CostUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CostUnit::Flops => "flops",
            CostUnit::Seconds => "seconds",
            CostUnit::Roofline => "roofline",
            CostUnit::Benchmark => "benchmark",
        })
    }
}

/// Node name → seconds, in file order (duplicates kept, so they can be reported).
#[derive(Debug, Clone, PartialEq)]
pub struct Costs(pub Vec<(String, f64)>);

/// A JSON object read entry by entry: serde_json's maps silently keep the last of
/// two equal keys, which would hide a mistake in the file.
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object mapping node names to seconds")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut a: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = a.next_entry::<String, serde_json::Value>()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn bad(why: impl Into<String>) -> Error {
    Error::Costs(why.into())
}

/// Up to three names, quoted, then "..." when there are more.
fn examples<'a>(names: impl IntoIterator<Item = &'a str>, total: usize) -> String {
    let shown: Vec<String> = names
        .into_iter()
        .take(3)
        .map(|n| format!("'{n}'"))
        .collect();
    let more = if total > shown.len() { ", ..." } else { "" };
    format!("{}{more}", shown.join(", "))
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The most seconds one node may cost: a year (1e308 summed to infinity, and the
/// overhead printed as NaN %).
const MAX_NODE_SECONDS: f64 = 365.0 * 86400.0;

/// Parses the text of a costs file.
pub fn parse_costs(text: &str) -> Result<Costs> {
    let Entries(entries) = serde_json::from_str(text).map_err(|e| {
        bad(format!(
            "expected a JSON object of node name -> seconds: {e}"
        ))
    })?;
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(entries.len());
    for (name, v) in entries {
        if !seen.insert(name.clone()) {
            return Err(bad(format!("'{name}' is given twice")));
        }
        let secs = match &v {
            serde_json::Value::Number(n) => n.as_f64(),
            _ => None,
        };
        match secs {
            Some(s) if (0.0..=MAX_NODE_SECONDS).contains(&s) => out.push((name, s)),
            Some(s) => {
                return Err(bad(format!(
                    "'{name}': {s} is not a number of seconds from 0 to {MAX_NODE_SECONDS} (a year)"
                )))
            }
            None => {
                return Err(bad(format!(
                    "'{name}': expected a number of seconds, found {v}"
                )))
            }
        }
    }
    Ok(Costs(out))
}

/// Reads a costs file.
pub fn load_costs(path: &Path) -> Result<Costs> {
    let text = crate::files::read_json_text(path)?;
    parse_costs(&text)
}

/// Replaces every node's cost by the measured one. Fails, changing nothing, when a
/// name matches no node, a node has no cost, two nodes share a name, or every cost
/// is 0.
pub fn apply_costs(g: &mut RematGraph, costs: &Costs) -> Result<()> {
    let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(g.nodes.len());
    for (i, n) in g.nodes.iter().enumerate() {
        if by_name.insert(n.name.as_str(), i).is_some() {
            return Err(bad(format!(
                "node name '{}' is used by more than one node of the graph, so costs cannot be given by name",
                n.name
            )));
        }
    }
    let mut cost = vec![None; g.nodes.len()];
    let mut unknown = Vec::new();
    for (name, s) in &costs.0 {
        match by_name.get(name.as_str()) {
            Some(&i) => cost[i] = Some(*s),
            None => unknown.push(name.as_str()),
        }
    }
    let missing: Vec<&str> = g
        .nodes
        .iter()
        .zip(&cost)
        .filter(|(_, c)| c.is_none())
        .map(|(n, _)| n.name.as_str())
        .collect();
    let mut problems = Vec::new();
    if !unknown.is_empty() {
        problems.push(format!(
            "{} no node of '{}' ({})",
            plural(unknown.len(), "name matches", "names match"),
            g.name,
            examples(unknown.iter().copied(), unknown.len())
        ));
    }
    if !missing.is_empty() {
        problems.push(format!(
            "{} of {} have no cost ({}); every node needs one, since seconds cannot be mixed with FLOPs (plan.json from -o lists the names under graph.nodes)",
            plural(missing.len(), "node", "nodes"),
            g.nodes.len(),
            examples(missing.iter().copied(), missing.len())
        ));
    }
    if !problems.is_empty() {
        return Err(bad(problems.join("; ")));
    }
    if cost.iter().all(|c| *c == Some(0.0)) && !cost.is_empty() {
        return Err(bad("every cost is 0: the overhead would be undefined"));
    }
    for (n, c) in g.nodes.iter_mut().zip(cost) {
        n.cost = c.expect("checked");
    }
    Ok(())
}

/// A machine's rates for the roofline cost model (`plan --roofline FLOPS,BYTES`): the
/// FLOP rate its compute-bound kernels reach and the bytes per second its
/// memory-bound ones move.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// FLOPs per second (multiply-add = 2).
    pub flops_per_second: f64,
    /// Bytes read and written per second.
    pub bytes_per_second: f64,
}

impl std::str::FromStr for Roofline {
    type Err = String;

    /// `FLOPS,BYTES`: two rates per second, each a number with an optional SI
    /// prefix (`94G,17G`, `9.4e10,1.7e10`).
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let (f, b) = text
            .split_once(',')
            .ok_or_else(|| format!("'{text}': expected FLOPS,BYTES per second, e.g. 94G,17G"))?;
        Ok(Roofline {
            flops_per_second: crate::units::parse_rate(f)?,
            bytes_per_second: crate::units::parse_rate(b)?,
        })
    }
}

/// Replaces every node's FLOP cost by the seconds a roofline model gives it: the
/// longer of its FLOPs at the FLOP rate and of the bytes it reads and writes (each
/// input and output value once, weights included) at the byte rate. A step that
/// computes nothing and writes nothing (a view, a reshape, a constant) costs 0: no
/// kernel runs for it.
///
/// Why: an op rerun in eager PyTorch is its own kernel and its own pass over memory.
/// Counted in FLOPs, a ReLU or an addition is nearly free beside a convolution, so
/// a FLOP-costed plan drops many elementwise outputs; on a CPU each such rerun costs
/// a pass over its tensor. (ResNet-50 at batch 8, 525 MiB, on two cores: the
/// roofline-costed plan reruns 64 values where the FLOP-costed one reruns 78, at the
/// same peak; docs/BENCHMARKS.md, "Roofline costs", times both.)
pub fn apply_roofline(g: &mut RematGraph, r: Roofline) {
    let values = &g.values;
    for n in &mut g.nodes {
        if n.outputs.is_empty() && n.cost == 0.0 {
            continue;
        }
        let mut seen: Vec<usize> = n.inputs.iter().chain(&n.outputs).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        let bytes: u64 = seen.iter().map(|&v| values[v].bytes).sum();
        n.cost = (n.cost / r.flops_per_second).max(bytes as f64 / r.bytes_per_second);
    }
}
