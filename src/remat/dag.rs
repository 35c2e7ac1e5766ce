//! Reads the node-link JSON of the published rematerialization benchmarks into a
//! [`RematGraph`]: Checkmate's `*_train.json` (`nodes: [{id, name, backward,
//! cost_cpu, cost_ram}]`, `links: [{source, target}]`, ids topological) and
//! Moccasin's random layered graphs (`nodes: [{name, out_cost, duration}]`,
//! `links: [{"0": u, "1": v}]`, `graph.order`). One value per node: its output.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::graph::{RNode, RValue, RematGraph};
use crate::error::{Error, Result};

fn bad(path: &Path, why: impl Into<String>) -> Error {
    Error::NotDag {
        path: path.to_path_buf(),
        reason: why.into(),
    }
}

/// Loads a benchmark DAG.
pub fn load_dag(path: &Path) -> Result<RematGraph> {
    let text = crate::files::read_json_text(path)?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(path, format!("JSON: {e}")))?;
    let nodes = v["nodes"]
        .as_array()
        .ok_or_else(|| bad(path, "no 'nodes' list"))?;
    let links = v["links"]
        .as_array()
        .ok_or_else(|| bad(path, "no 'links' list"))?;
    let name = v["graph"]["name"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| {
            path.file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        });
    let checkmate = nodes.first().is_some_and(|n| n.get("cost_ram").is_some());
    let key = |n: &Value| -> Option<String> {
        let k = if checkmate { &n["id"] } else { &n["name"] };
        match k {
            Value::Number(x) => Some(x.to_string()),
            Value::String(s) => Some(s.clone()),
            _ => None,
        }
    };
    // Node keys → positions in execution order.
    let mut keys = Vec::with_capacity(nodes.len());
    for n in nodes {
        keys.push(key(n).ok_or_else(|| bad(path, "a node has no id/name"))?);
    }
    let order = execution_order(path, &v, &keys, checkmate)?;
    if order.len() != nodes.len() {
        return Err(bad(path, "graph.order does not list every node once"));
    }
    let mut pos = vec![usize::MAX; nodes.len()];
    for (p, &i) in order.iter().enumerate() {
        if pos[i] != usize::MAX {
            return Err(bad(path, "graph.order repeats a node"));
        }
        pos[i] = p;
    }
    let by_key: HashMap<&str, usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), pos[i]))
        .collect();
    let inputs = inputs_of(path, links, &by_key, nodes.len())?;
    let num = |n: &Value, k: &str| n[k].as_f64().unwrap_or(0.0);
    let mut g = RematGraph {
        name,
        nodes: Vec::with_capacity(nodes.len()),
        values: Vec::with_capacity(nodes.len()),
    };
    for (p, &i) in order.iter().enumerate() {
        let n = &nodes[i];
        let (cost, bytes) = if checkmate {
            (num(n, "cost_cpu"), num(n, "cost_ram"))
        } else {
            (num(n, "duration"), num(n, "out_cost"))
        };
        if !(cost >= 0.0 && bytes >= 0.0) {
            return Err(bad(
                path,
                format!("node {} has a negative cost or size", keys[i]),
            ));
        }
        if !(cost <= MAX_COST && bytes <= MAX_VALUE_BYTES as f64) {
            return Err(bad(
                path,
                format!(
                    "node {} has a cost or size beyond what memplan counts (cost {cost}, {bytes} bytes; at most {MAX_COST} and {MAX_VALUE_BYTES})",
                    keys[i]
                ),
            ));
        }
        let label = match &n["name"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        g.values.push(RValue {
            name: label.clone(),
            bytes: bytes as u64,
            producer: Some(p),
            fixed: false,
            held: false,
        });
        g.nodes.push(RNode {
            name: label,
            cost,
            inputs: inputs[p].clone(),
            outputs: vec![p],
            backward: n["backward"].as_bool().unwrap_or(false),
            recomputable: true,
            op: String::new(),
        });
    }
    let total: u128 = g.values.iter().map(|v| v.bytes as u128).sum();
    if total > MAX_VALUE_BYTES as u128 {
        return Err(bad(
            path,
            format!(
                "its values total {total} bytes, beyond what memplan counts ({MAX_VALUE_BYTES})"
            ),
        ));
    }
    Ok(g)
}

/// The nodes' positions in execution order: Checkmate's by id, Moccasin's as
/// `graph.order` lists them (each key resolved against `keys`).
fn execution_order(path: &Path, v: &Value, keys: &[String], checkmate: bool) -> Result<Vec<usize>> {
    Ok(if checkmate {
        let mut idx: Vec<usize> = (0..keys.len()).collect();
        idx.sort_by_key(|&i| v["nodes"][i]["id"].as_u64().unwrap_or(u64::MAX));
        idx
    } else {
        let by_key: HashMap<&str, usize> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), i))
            .collect();
        let ord = v["graph"]["order"]
            .as_array()
            .ok_or_else(|| bad(path, "no graph.order"))?;
        ord.iter()
            .map(|k| {
                let k = match k {
                    Value::Number(x) => x.to_string(),
                    Value::String(s) => s.clone(),
                    _ => String::new(),
                };
                by_key
                    .get(k.as_str())
                    .copied()
                    .ok_or_else(|| bad(path, format!("order names unknown node {k}")))
            })
            .collect::<Result<_>>()?
    })
}

/// Each node's inputs (by position) from the links, which must follow the order.
fn inputs_of(
    path: &Path,
    links: &[Value],
    by_key: &HashMap<&str, usize>,
    n: usize,
) -> Result<Vec<Vec<usize>>> {
    let mut inputs: Vec<Vec<usize>> = vec![Vec::new(); n];
    for l in links {
        let end = |a: &str, b: &str| -> Result<usize> {
            let k = match l.get(a).or_else(|| l.get(b)) {
                Some(Value::Number(x)) => x.to_string(),
                Some(Value::String(s)) => s.clone(),
                _ => return Err(bad(path, "a link has no endpoints")),
            };
            by_key
                .get(k.as_str())
                .copied()
                .ok_or_else(|| bad(path, format!("a link names unknown node {k}")))
        };
        let (s, t) = (end("source", "0")?, end("target", "1")?);
        if s >= t {
            return Err(bad(path, format!("link {s} -> {t} goes against the order")));
        }
        if !inputs[t].contains(&s) {
            inputs[t].push(s);
        }
    }
    Ok(inputs)
}

/// The most bytes a DAG's values may total (and so any one of them): 4 EiB, so that
/// every sum of them fits 64 bits.
const MAX_VALUE_BYTES: u64 = 1 << 62;

/// The largest cost of one node (seconds or FLOPs): far past any real one, finite.
const MAX_COST: f64 = 1e18;
