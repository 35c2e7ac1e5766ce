//! Shape inference: binds symbolic dimensions, then walks the execution order giving
//! every tensor a concrete dtype and shape (and folding small constant subgraphs).
//!
//! Batch rule: `--batch N` binds every graph-input dimension whose `dim_param`
//! contains "batch" (case-insensitive). If no input has such a name, the batch is
//! dim 0 of every graph input: named or anonymous dims there are bound to N, and a
//! fixed dim 0 that differs from N is an error. `--dim name=value` binds any other
//! named dimension. An unbound dimension is an error naming it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::error::{Error, Result, Setting};
use crate::ir::{DimDecl, Model, TensorId, TensorKind};
use crate::moe::{Routing, RoutingSummary, Site};
use crate::ops::{registry, shape::literal_fact, Cx, Fact, RuleError};

pub mod lower;

/// A model lowered for its bindings (borrowed where nothing needed lowering) and
/// its inferred shapes: what every command plans and runs.
#[derive(Debug)]
pub struct Inference<'m> {
    /// The model as planned and run: lowered where it needs to be.
    pub model: Cow<'m, Model>,
    /// Shapes and FLOPs under the bindings.
    pub inferred: Inferred,
}

/// `model` lowered for `bindings` ([`lower`]: control flow and sequences unrolled)
/// and inferred. [`infer`] alone refuses a model that needs lowering.
pub fn inference<'m>(model: &'m Model, bindings: &Bindings) -> Result<Inference<'m>> {
    let model = lower::lower(model, bindings)?;
    let inferred = infer(&model, bindings)?;
    Ok(Inference { model, inferred })
}

/// Largest accepted batch size: far beyond any real GPU step, small enough that
/// sizes stay well inside u64.
pub const MAX_BATCH: u64 = 1 << 24;

/// User bindings for symbolic dimensions.
#[derive(Debug, Clone, Default)]
pub struct Bindings {
    /// `--batch N`.
    pub batch: Option<u64>,
    /// `--dim name=value`.
    pub dims: BTreeMap<String, u64>,
    /// `--moe-routing`: how many tokens each expert of a mixture-of-experts layer
    /// receives ([`crate::moe`]); `None` is the default, balanced, not asked for.
    pub routing: Option<Routing>,
}

/// The result of inference over a model.
#[derive(Debug, Clone)]
pub struct Inferred {
    /// One fact per tensor id.
    pub facts: Vec<Fact>,
    /// FLOPs of each node, indexed like [`crate::ir::Graph::order`].
    pub flops: Vec<u64>,
    /// The batch size in effect (bound, or fixed by the model), if the model has one.
    pub batch: Option<u64>,
    /// The routing assumption that sized the experts, when the model has any.
    pub routing: Option<RoutingSummary>,
}

impl Inferred {
    /// Bytes of a tensor.
    pub fn bytes(&self, t: TensorId) -> u64 {
        self.facts[t].bytes().unwrap_or(u64::MAX)
    }

    /// Total forward FLOPs.
    pub fn total_flops(&self) -> u64 {
        self.flops.iter().fold(0u64, |a, &f| a.saturating_add(f))
    }
}

fn looks_like_batch(name: &str) -> bool {
    name.to_ascii_lowercase().contains("batch")
}

/// Whether the model has a batch dimension to bind (see the module docs' rule).
pub fn has_batch_dim(model: &Model) -> bool {
    let g = &model.graph;
    let decls: Vec<&[DimDecl]> = g
        .inputs
        .iter()
        .map(|&t| g.tensor(t).declared_shape.as_deref().unwrap_or(&[]))
        .collect();
    let named = decls
        .iter()
        .flat_map(|d| d.iter())
        .any(|d| matches!(d, DimDecl::Named(n) if looks_like_batch(n)));
    named
        || decls
            .iter()
            .any(|d| matches!(d.first(), Some(DimDecl::Named(_) | DimDecl::Unknown)))
}

/// Checks that every op is supported; lists each unsupported op type once with a node.
pub fn check_supported(model: &Model) -> Result<()> {
    if crate::onnx::is_rewrite(model) {
        return Err(Error::Rewrite(format!(
            "a training step planned by memplan's plan rewrite (backward ops in domain {}), \
             not a model: run memplan on the original model",
            crate::onnx::REWRITE_DOMAIN
        )));
    }
    let reg = registry();
    let mut missing: Vec<(String, String)> = Vec::new();
    let mut value_shaped = None;
    let mut check = |domain: &str, op_type: &str, name: &str| {
        if reg.get(domain, op_type).is_none() {
            let key = if domain.is_empty() {
                op_type.to_string()
            } else {
                format!("{domain}.{op_type}")
            };
            if !missing.iter().any(|(k, _)| *k == key) {
                missing.push((key, name.to_string()));
            }
        }
    };
    for &ix in &model.graph.order {
        let n = model.graph.node(ix);
        // Supported ops first: no op is both supported and lowered or value-shaped
        // (`tests::lowered_and_value_shaped_ops_are_not_supported`).
        if reg.get(&n.domain, &n.op_type).is_some() {
            continue;
        }
        if lower::is_lowered(n) {
            // Lowered (lower) into the ops of its subgraphs, checked here.
            for a in n.attrs.values() {
                if let crate::ir::Attr::Graph(bytes) = a {
                    use prost::Message;
                    // A subgraph that does not decode is reported when lowered.
                    if let Ok(g) = crate::onnx::proto::GraphProto::decode(bytes.clone()) {
                        subgraph_ops(&g, &mut check);
                    }
                }
            }
            continue;
        }
        if let Some(&(_, input)) = crate::ops::VALUE_SHAPED
            .iter()
            .find(|(op, _)| n.domain.is_empty() && *op == n.op_type)
        {
            value_shaped.get_or_insert((n, input));
            continue;
        }
        check(&n.domain, &n.op_type, &n.name);
    }
    if !missing.is_empty() {
        return Err(Error::Unsupported(missing));
    }
    match value_shaped {
        Some((n, input)) => Err(Error::rule(
            &n.name,
            &n.op_type,
            crate::numeric::RuleError::NotConstant(input),
        )),
        None => Ok(()),
    }
}

/// Calls `check(domain, op_type, name)` for every node of a subgraph and of the
/// subgraphs inside it, except the ops [`lower`] rewrites.
fn subgraph_ops(g: &crate::onnx::proto::GraphProto, check: &mut impl FnMut(&str, &str, &str)) {
    for n in &g.node {
        let domain = match n.domain() {
            "ai.onnx" => "",
            d => d,
        };
        if domain.is_empty() && lower::LOWERED.contains(&n.op_type()) {
            for a in &n.attribute {
                if let Some(sub) = &a.g {
                    subgraph_ops(sub, check);
                }
            }
        } else {
            check(domain, n.op_type(), n.name());
        }
    }
}

/// Resolves the concrete shape of every graph input.
/// Concrete input shapes, the batch in effect, and every named dim's value.
type Bound = (Vec<Vec<usize>>, Option<u64>, BTreeMap<String, u64>);

fn bind_inputs(model: &Model, b: &Bindings) -> Result<Bound> {
    let g = &model.graph;
    if let Some(n) = b.batch {
        if n == 0 || n > MAX_BATCH {
            return Err(Error::setting(
                Setting::Batch,
                format!("batch size {n} is out of range (1..={MAX_BATCH})"),
            ));
        }
    }
    let decls: Vec<&[DimDecl]> = g
        .inputs
        .iter()
        .map(|&t| g.tensor(t).declared_shape.as_deref().unwrap_or(&[]))
        .collect();
    let named_batch = decls
        .iter()
        .flat_map(|d| d.iter())
        .any(|d| matches!(d, DimDecl::Named(n) if looks_like_batch(n)));
    let mut env: BTreeMap<String, u64> = b.dims.clone();
    let mut batch = b.batch;
    for (&t, d) in g.inputs.iter().zip(&decls) {
        let info = g.tensor(t);
        if info.declared_shape.is_none() {
            return Err(Error::Binding(format!(
                "graph input '{}' has no declared shape",
                info.name
            )));
        }
        for (i, dd) in d.iter().enumerate() {
            let is_batch = match dd {
                DimDecl::Named(n) if named_batch => looks_like_batch(n),
                _ => !named_batch && i == 0,
            };
            match (dd, is_batch, b.batch) {
                (DimDecl::Named(n), true, Some(v)) => {
                    if let Some(&prev) = b.dims.get(n) {
                        if prev != v {
                            return Err(Error::setting(
                                Setting::Batch,
                                format!("batch size {v} contradicts dimension {n} = {prev}"),
                            ));
                        }
                    }
                    env.insert(n.clone(), v);
                }
                (DimDecl::Fixed(f), true, Some(v)) if *f != v as i64 => {
                    return Err(Error::setting(
                        Setting::Batch,
                        format!(
                            "batch size {v} contradicts input '{}', whose batch dimension (dim {i}) is fixed to {f} in the model",
                            info.name
                        ),
                    ));
                }
                (DimDecl::Fixed(f), true, None) => {
                    batch = batch.or(u64::try_from(*f).ok());
                }
                _ => {}
            }
        }
    }
    for name in b.dims.keys() {
        let used = decls
            .iter()
            .flat_map(|d| d.iter())
            .any(|d| matches!(d, DimDecl::Named(n) if n == name));
        if !used {
            return Err(Error::setting(
                Setting::Dim(name.clone()),
                format!("no graph input has a dimension named '{name}'"),
            ));
        }
    }
    let mut shapes = Vec::with_capacity(decls.len());
    for (&t, d) in g.inputs.iter().zip(&decls) {
        let name = &g.tensor(t).name;
        let mut shape = Vec::with_capacity(d.len());
        for (i, dd) in d.iter().enumerate() {
            let v = match dd {
                DimDecl::Fixed(f) => u64::try_from(*f).map_err(|_| {
                    Error::Binding(format!("input '{name}' has negative dimension {f} at {i}"))
                })?,
                DimDecl::Named(n) => *env.get(n).ok_or_else(|| Error::UnboundDim {
                    dim: n.clone(),
                    input: name.to_string(),
                    hint: Some(if looks_like_batch(n) || (!named_batch && i == 0) {
                        Setting::Batch
                    } else {
                        Setting::Dim(n.clone())
                    }),
                })?,
                DimDecl::Unknown if !named_batch && i == 0 => {
                    b.batch.ok_or_else(|| Error::UnboundDim {
                        dim: "dim 0 (unnamed)".into(),
                        input: name.to_string(),
                        hint: Some(Setting::Batch),
                    })?
                }
                DimDecl::Unknown => {
                    return Err(Error::UnboundDim {
                        dim: format!("dim {i} (unnamed)"),
                        input: name.to_string(),
                        hint: None,
                    })
                }
            };
            shape.push(usize::try_from(v).map_err(|_| {
                Error::Binding(format!("input '{name}' dimension {i} = {v} is too large"))
            })?);
        }
        shapes.push(shape);
    }
    Ok((shapes, batch, env))
}

/// Infers every tensor's dtype and shape for the given bindings.
pub fn infer(model: &Model, b: &Bindings) -> Result<Inferred> {
    check_supported(model)?;
    let (mut facts, batch, env) = initial_facts(model, b)?;
    let g = &model.graph;
    let mut flops = Vec::with_capacity(g.order.len());
    let routing = b.routing.unwrap_or_default();
    let mut sites = Vec::new();
    for &ix in &g.order {
        flops.push(infer_node(model, ix, &mut facts, routing)?);
        sites.extend(crate::moe::site(model, ix, &facts));
    }
    let routing = routed(b, &sites)?;
    let facts: Vec<Fact> = facts
        .into_iter()
        .enumerate()
        .map(|(t, f)| {
            f.ok_or_else(|| {
                Error::Graph(format!("tensor '{}' was never computed", g.tensor(t).name))
            })
        })
        .collect::<Result<_>>()?;
    // Every later sum of tensor sizes must fit in u64.
    let total: u128 = facts
        .iter()
        .map(|f| f.bytes().unwrap_or(u64::MAX) as u128)
        .sum();
    if total > u64::MAX as u128 {
        return Err(Error::Binding(format!(
            "the tensors of this model at these sizes total {total} bytes, beyond 64 bits"
        )));
    }
    check_outputs(model, b, &env, &facts)?;
    Ok(Inferred {
        facts,
        flops,
        batch,
        routing,
    })
}

/// What the routing assumption sized; an error when `--moe-routing` was given for a
/// model without expert routing.
fn routed(b: &Bindings, sites: &[Site]) -> Result<Option<RoutingSummary>> {
    let routing = b.routing.unwrap_or_default();
    if sites.is_empty() {
        if let Some(r) = b.routing {
            return Err(Error::setting(
                Setting::MoeRouting,
                format!(
                    "routing '{r}' given, but this model has no mixture-of-experts routing (no \
                     NonZero over a TopK's expert indices)"
                ),
            ));
        }
    }
    Ok(RoutingSummary::of(sites, routing))
}

/// The fact of an expert's token selection whose mask is not a known constant: sized
/// by the routing assumption ([`crate::moe`]).
fn expert_selection(
    model: &Model,
    ix: petgraph::stable_graph::NodeIndex,
    facts: &[Option<Fact>],
    routing: Routing,
) -> Option<Fact> {
    let mask = model.graph.node(ix).inputs.first().copied().flatten()?;
    let m = facts[mask].as_ref()?;
    if m.value.is_some() {
        return None;
    }
    let site = crate::moe::site(model, ix, facts)?;
    Some(crate::moe::selection_fact(&site, m.rank(), routing))
}

/// Every named dim's value.
type Env = BTreeMap<String, u64>;

/// The facts known before any node runs: graph inputs (bound) and initializers;
/// with the batch in effect and every named dim's value.
pub(crate) fn initial_facts(
    model: &Model,
    b: &Bindings,
) -> Result<(Vec<Option<Fact>>, Option<u64>, Env)> {
    let g = &model.graph;
    let (input_shapes, batch, env) = bind_inputs(model, b)?;
    let mut facts: Vec<Option<Fact>> = vec![None; g.tensors.len()];
    for (&t, shape) in g.inputs.iter().zip(input_shapes) {
        let info = g.tensor(t);
        let dtype = info.declared_dtype.ok_or_else(|| {
            Error::Binding(format!(
                "graph input '{}' has no tensor element type",
                info.name
            ))
        })?;
        let fact = Fact::new(dtype, shape);
        if fact.bytes().is_none() {
            return Err(Error::Binding(format!(
                "input '{}' of shape {:?} overflows a 64-bit byte count",
                info.name, fact.shape
            )));
        }
        facts[t] = Some(fact);
    }
    for (t, info) in g.tensors.iter().enumerate() {
        if let Some(init) = &info.init {
            facts[t] = Some(literal_fact(init));
        }
    }
    Ok((facts, batch, env))
}

/// Infers one node from the facts of its inputs: writes its outputs' facts and
/// returns its FLOPs. `facts` is indexed by tensor id and covers every tensor.
pub(crate) fn infer_node(
    model: &Model,
    ix: petgraph::stable_graph::NodeIndex,
    facts: &mut [Option<Fact>],
    routing: Routing,
) -> Result<u64> {
    let g = &model.graph;
    let node = g.node(ix);
    if let Some(f) = expert_selection(model, ix, facts, routing) {
        if let Some(t) = node.outputs.first().copied().flatten() {
            facts[t] = Some(f);
        }
        return Ok(0);
    }
    let err = |reason: String| Error::node(&node.name, &node.op_type, reason);
    let rule_err = |e: RuleError| Error::rule(&node.name, &node.op_type, e);
    let Some(op) = registry().get(&node.domain, &node.op_type) else {
        return Err(if lower::is_lowered(node) {
            err("control flow and sequences are lowered first (memplan::lower::lower)".into())
        } else {
            Error::Unsupported(vec![(node.op_type.to_string(), node.name.to_string())])
        });
    };
    let ar = op.arity();
    if node.inputs.len() < ar.min_in || node.inputs.len() > ar.max_in {
        return Err(err(format!(
            "has {} inputs, expected {}",
            node.inputs.len(),
            range_text(ar.min_in, ar.max_in)
        )));
    }
    if node.outputs.len() < ar.min_out || node.outputs.len() > ar.max_out {
        return Err(err(format!(
            "has {} outputs, expected {}",
            node.outputs.len(),
            range_text(ar.min_out, ar.max_out)
        )));
    }
    let inputs = node
        .inputs
        .iter()
        .map(|t| t.and_then(|t| facts[t].as_ref()))
        .collect();
    let cx = Cx {
        node,
        inputs,
        opset: model.opset(),
    };
    let out = op.infer(&cx).map_err(rule_err)?;
    if out.len() < node.outputs.len() {
        return Err(err(format!(
            "rule gave {} outputs for {} declared",
            out.len(),
            node.outputs.len()
        )));
    }
    let f = op.flops(&cx, &out);
    if f == u64::MAX {
        return Err(err("its FLOP count overflows 64 bits".into()));
    }
    // The input facts are borrowed from `facts` until here.
    drop(cx);
    for (slot, (t, f)) in node.outputs.iter().zip(out).enumerate() {
        let Some(t) = *t else { continue };
        if f.bytes().is_none() {
            return Err(err(format!(
                "output {slot} '{}' of shape {:?} overflows a 64-bit byte count",
                g.tensor(t).name,
                f.shape
            )));
        }
        facts[t] = Some(f);
    }
    Ok(f)
}

fn range_text(lo: usize, hi: usize) -> String {
    match (lo, hi) {
        (l, h) if l == h => l.to_string(),
        (l, usize::MAX) => format!("at least {l}"),
        (l, h) => format!("{l} to {h}"),
    }
}

/// Compares inferred shapes with the shapes the model declares (graph outputs and
/// `value_info`): a fixed dim that differs, or a bound name (such as the batch) that
/// takes another value, means the bindings contradict something fixed inside the
/// graph, or a rule is wrong; either way the answer would be wrong, so it is an error.
/// For graph outputs, a named dim must also take one value everywhere it appears.
fn check_outputs(
    model: &Model,
    b: &Bindings,
    env: &BTreeMap<String, u64>,
    facts: &[Fact],
) -> Result<()> {
    let g = &model.graph;
    let mut seen: BTreeMap<&str, usize> =
        env.iter().map(|(k, &v)| (k.as_str(), v as usize)).collect();
    let declared_activations = (0..g.tensors.len()).filter(|&t| {
        g.tensor(t).kind == TensorKind::Activation && g.tensor(t).declared_shape.is_some()
    });
    for t in g.outputs.iter().copied().chain(declared_activations) {
        let info = g.tensor(t);
        let is_output = info.kind == TensorKind::Output || g.outputs.contains(&t);
        let what = if is_output { "output" } else { "tensor" };
        let f = &facts[t];
        if let Some(dt) = info.declared_dtype {
            if dt != f.dtype {
                return Err(Error::Binding(format!(
                    "{what} '{}' is declared {dt} but computes as {}",
                    info.name, f.dtype
                )));
            }
        }
        let Some(decl) = &info.declared_shape else {
            continue;
        };
        let mismatch = |why: String| {
            let producer = info
                .producer
                .map(|p| format!(" (from node '{}')", g.node(p).name))
                .unwrap_or_default();
            Error::Binding(format!(
                "{what} '{}'{producer} is inferred as {:?}, but the model declares {}: {why}{}",
                info.name,
                f.shape,
                decl_text(decl),
                if b.batch.is_some() {
                    " (does the model fix the batch size internally?)"
                } else {
                    ""
                }
            ))
        };
        if decl.len() != f.rank() {
            return Err(mismatch("ranks differ".into()));
        }
        for (i, (d, &v)) in decl.iter().zip(&f.shape).enumerate() {
            match d {
                DimDecl::Fixed(x) if *x != v as i64 => {
                    return Err(mismatch(format!("dim {i} is fixed to {x}")))
                }
                DimDecl::Named(n) => match seen.get(n.as_str()) {
                    Some(&prev) if prev != v => {
                        return Err(mismatch(format!("'{n}' is both {prev} and {v}")))
                    }
                    None if is_output => {
                        seen.insert(n, v);
                    }
                    _ => {}
                },
                _ => {}
            }
        }
    }
    Ok(())
}

fn decl_text(d: &[DimDecl]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|x| match x {
            DimDecl::Fixed(v) => v.to_string(),
            DimDecl::Named(n) => n.clone(),
            DimDecl::Unknown => "?".into(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use crate::ops::{registry, VALUE_SHAPED};

    #[test]
    fn lowered_and_value_shaped_ops_are_not_supported() {
        let ops = super::lower::LOWERED
            .iter()
            .chain(VALUE_SHAPED.iter().map(|(op, _)| op));
        for op in ops {
            assert!(registry().get("", op).is_none(), "{op}");
        }
    }
}
