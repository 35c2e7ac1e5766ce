//! Fused patterns: subgraphs the exporter writes op by op that PyTorch runs as one
//! kernel saving less (the exact and tanh GELU, SiLU, the exporter's decomposition of
//! `scaled_dot_product_attention`, LayerNorm decomposed below opset 17). The schedule
//! models what the fused kernel saves. One pattern is no kernel of PyTorch's but one
//! op the exporter writes as two: `torch.rsqrt` in RMSNorm's statistics, which saves
//! its result alone where the exported `Sqrt`, `Div` would save the square root too.

use std::collections::HashMap;

use petgraph::stable_graph::NodeIndex;

use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId, TensorKind};
use crate::ops::Fact;

/// Which fused kernel a pattern stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedKind {
    /// Exact GELU (`F.gelu`): saves only its input.
    Gelu,
    /// `scaled_dot_product_attention` (flash attention): saves q, k, v, the output
    /// and the per-row logsumexp.
    Sdpa,
    /// SiLU (`F.silu`, `nn.SiLU`): saves only its input.
    Silu,
    /// The tanh GELU (`F.gelu(x, approximate="tanh")`): saves only its input.
    GeluTanh,
    /// `nn.LayerNorm` / `F.layer_norm` as exporters below opset 17 write it
    /// (`native_layer_norm`, `NativeLayerNormBackward0`): saves its input and the
    /// per-row mean and reciprocal standard deviation (float32).
    LayerNorm,
    /// RMSNorm's statistics `torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`
    /// (transformers' LlamaRMSNorm, T5, Gemma). Not fused in PyTorch: run op by op,
    /// `PowBackward0` saving `x` and `RsqrtBackward0` its result; as a pattern only
    /// because the exporter writes rsqrt as two nodes (`Div(1, Sqrt(·))` or
    /// `Reciprocal(Sqrt(·))`) whose rules would also save the square root.
    Rsqrt,
}

/// A recognised fused pattern: nodes PyTorch runs as one kernel. The schedule keeps
/// one forward step per node (each writing its output as written), but only the last
/// node's backward step reads anything: what the fused kernel saves ([`Self::reads`]
/// and the [`Self::extras`] its forward step writes); the inner nodes' backward steps
/// read nothing saved.
#[derive(Debug, Clone)]
pub struct FusedPattern {
    /// Which kernel.
    pub kind: FusedKind,
    /// The pattern's nodes in execution order; the last one writes the output.
    pub nodes: Vec<NodeIndex>,
    /// Forward tensors the fused backward reads (GELU: `x`; SDPA: q and k before
    /// scaling, v and the output).
    pub reads: Vec<TensorId>,
    /// Extra tensors the fused forward makes for backward (SDPA: the f32 logsumexp
    /// `[batch, heads, queries]`), written by the last node's forward step.
    pub extras: Vec<Fact>,
    /// Physical dim order of the output, when not contiguous-as-shaped.
    pub out_layout: Option<Vec<usize>>,
}

impl FusedPattern {
    /// An activation PyTorch runs as one op that saves only its input `x`.
    fn of_input(kind: FusedKind, nodes: Vec<NodeIndex>, x: TensorId) -> FusedPattern {
        FusedPattern {
            kind,
            nodes,
            reads: vec![x],
            extras: Vec::new(),
            out_layout: None,
        }
    }

    /// The last node (execution order): the one whose steps carry the fused kernel's
    /// reads and extras.
    pub fn last(&self) -> NodeIndex {
        *self.nodes.last().expect("a pattern has nodes")
    }
}

/// Every fused pattern of the model: exact and tanh GELU, SiLU, the exporter's SDPA,
/// decomposed LayerNorm and RMSNorm's rsqrt.
pub fn fused_patterns(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let pos: HashMap<NodeIndex, usize> = model
        .graph
        .order
        .iter()
        .enumerate()
        .map(|(i, &n)| (n, i))
        .collect();
    let mut out = find_erf_gelu(model, inf);
    out.extend(find_silu(model, inf));
    out.extend(find_tanh_gelu(model, inf));
    out.extend(find_sdpa(model, inf));
    out.extend(find_layer_norm(model, inf));
    out.extend(find_rms_rsqrt(model, inf));
    for p in &mut out {
        p.nodes.sort_by_key(|n| pos[n]);
        p.nodes.dedup();
    }
    out.sort_by_key(|p| pos[&p.last()]);
    out
}

/// What a node of a fused pattern saves: the inner nodes read nothing; the last one
/// reads what PyTorch's fused kernel saves.
#[derive(Debug, Clone, Default)]
pub(super) struct Fusion {
    /// Forward tensors the backward reads.
    pub(super) reads: Vec<TensorId>,
    /// Extra tensors the fused forward makes for backward.
    pub(super) extras: Vec<Fact>,
    /// Physical dim order of the node's output, when not contiguous-as-shaped.
    pub(super) out_layout: Option<Vec<usize>>,
}

/// The per-node view of the patterns.
pub(super) fn per_node(patterns: &[FusedPattern]) -> HashMap<NodeIndex, Fusion> {
    let mut out = HashMap::new();
    for p in patterns {
        for &n in &p.nodes {
            out.insert(n, Fusion::default());
        }
        out.insert(
            p.last(),
            Fusion {
                reads: p.reads.clone(),
                extras: p.extras.clone(),
                out_layout: p.out_layout.clone(),
            },
        );
    }
    out
}

/// Consumers of a tensor, in execution order.
fn consumers(model: &Model, t: TensorId) -> Vec<NodeIndex> {
    let g = &model.graph;
    g.order
        .iter()
        .copied()
        .filter(|&c| g.node(c).inputs.contains(&Some(t)))
        .collect()
}

/// Finds exact-GELU subgraphs `Mul(Mul(x, Add(Erf(Div(x, √2)), 1)), 0.5)` (the 0.5
/// multiply last or absent): PyTorch runs `F.gelu` fused and saves only `x`.
fn find_erf_gelu(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let g = &model.graph;
    let mut out = Vec::new();
    let is_const = |t: TensorId| inf.facts[t].value.is_some() || g.tensor(t).init.is_some();
    let single = |t: TensorId, op: &str| match consumers(model, t).as_slice() {
        [c] if g.node(*c).op_type == op => Some(*c),
        _ => None,
    };
    let out0 = |n: NodeIndex| g.node(n).outputs.first().copied().flatten();
    for &ix in &g.order {
        let n = g.node(ix);
        if n.op_type != "Erf" {
            continue;
        }
        let Some(div_out) = n.inputs.first().copied().flatten() else {
            continue;
        };
        let Some(div) = g.tensor(div_out).producer else {
            continue;
        };
        if !matches!(g.node(div).op_type.as_str(), "Div" | "Mul") {
            continue;
        }
        let Some(x) = g
            .node(div)
            .inputs
            .iter()
            .flatten()
            .copied()
            .find(|&t| !is_const(t))
        else {
            continue;
        };
        let Some(add) = out0(ix).and_then(|t| single(t, "Add")) else {
            continue;
        };
        let Some(mul) = out0(add).and_then(|t| single(t, "Mul")) else {
            continue;
        };
        if !g.node(mul).inputs.contains(&Some(x)) {
            continue;
        }
        let last = out0(mul)
            .and_then(|t| single(t, "Mul"))
            .filter(|&m| g.node(m).inputs.iter().flatten().any(|&t| is_const(t)))
            .unwrap_or(mul);
        out.push(FusedPattern::of_input(
            FusedKind::Gelu,
            vec![div, ix, add, mul, last],
            x,
        ));
    }
    out
}

/// Finds SiLU as exporters write it, `Mul(x, Sigmoid(x))` (either operand order),
/// where the sigmoid feeds only that multiply: PyTorch runs `F.silu` as one op whose
/// backward (`SiluBackward0`) saves only `x`, where the op-by-op rules would save
/// `x` and `sigmoid(x)`. (A model that writes `x * torch.sigmoid(x)` by hand saves
/// both in PyTorch; the exported graphs are the same, and `F.silu` is what
/// torchvision, timm and transformers use.)
fn find_silu(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let g = &model.graph;
    let mut out = Vec::new();
    for &ix in &g.order {
        let n = g.node(ix);
        if n.op_type != "Sigmoid" {
            continue;
        }
        let (Some(x), Some(s)) = (
            n.inputs.first().copied().flatten(),
            n.outputs.first().copied().flatten(),
        ) else {
            continue;
        };
        if !inf.facts[x].dtype.is_float() || inf.facts[x].value.is_some() {
            continue;
        }
        let [mul] = consumers(model, s)[..] else {
            continue;
        };
        let m = g.node(mul);
        let is_silu = m.op_type == "Mul"
            && (m.inputs == [Some(x), Some(s)] || m.inputs == [Some(s), Some(x)])
            && inf.facts[s].shape == inf.facts[x].shape
            && !g.outputs.contains(&s);
        if !is_silu {
            continue;
        }
        out.push(FusedPattern::of_input(FusedKind::Silu, vec![ix, mul], x));
    }
    out
}

/// Finds the tanh GELU as the TorchScript exporter writes `F.gelu(x,
/// approximate="tanh")` (Gemma, StarCoder2, timm's `gelu_tanh`):
/// `0.5 · (x · (1 + tanh(k · (x + c · x · (x · x)))))`, with `x · x · x` as two
/// multiplies. PyTorch runs it as one op (`GeluBackward0`) that saves only `x`.
/// GPT-2's `NewGELUActivation` writes the same formula in Python with `torch.pow`
/// (`Pow(x, 3)` in the graph) and is run op by op in PyTorch too, so it is left
/// alone; so are other hand-written variants (BLOOM's).
fn find_tanh_gelu(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let g = &model.graph;
    let mut out = Vec::new();
    // Constants: folded values and initializers that are not parameters (a learnable
    // coefficient makes it another function, which PyTorch differentiates op by op).
    let is_const = |t: TensorId| {
        inf.facts[t].value.is_some()
            || (g.tensor(t).init.is_some() && g.tensor(t).kind != TensorKind::Parameter)
    };
    let single = |t: TensorId, op: &str| match consumers(model, t).as_slice() {
        [c] if g.node(*c).op_type == op && !g.outputs.contains(&t) => Some(*c),
        _ => None,
    };
    let out0 = |n: NodeIndex| g.node(n).outputs.first().copied().flatten();
    let producer = |t: TensorId, op: &str| {
        g.tensor(t)
            .producer
            .filter(|&p| g.node(p).op_type == op && out0(p) == Some(t))
    };
    // The non-constant operand of a binary node with one constant operand.
    let var_of = |n: NodeIndex| -> Option<TensorId> {
        let ins: Vec<TensorId> = g.node(n).inputs.iter().flatten().copied().collect();
        match ins.as_slice() {
            [a, b] if is_const(*a) && !is_const(*b) => Some(*b),
            [a, b] if is_const(*b) && !is_const(*a) => Some(*a),
            _ => None,
        }
    };
    let operands =
        |n: NodeIndex| -> Vec<TensorId> { g.node(n).inputs.iter().flatten().copied().collect() };
    for &ix in &g.order {
        if g.node(ix).op_type != "Tanh" {
            continue;
        }
        let found = (|| {
            // Backward from the tanh: k · (x + c · x³).
            let m3_out = g.node(ix).inputs.first().copied().flatten()?;
            let m3 = producer(m3_out, "Mul")?;
            let a0_out = var_of(m3)?;
            let a0 = producer(a0_out, "Add")?;
            // `x + c · x · (x · x)`, the sum's operands in either order.
            type Cube = (NodeIndex, TensorId, NodeIndex, TensorId, NodeIndex);
            let cube_of = |m2_out: TensorId, x: TensorId| -> Option<Cube> {
                let m2 = producer(m2_out, "Mul")?;
                let m1_out = var_of(m2)?;
                let m1 = producer(m1_out, "Mul")?;
                let m0_out = match operands(m1).as_slice() {
                    [a, b] | [b, a] if *a == x && *b != x => *b,
                    _ => return None,
                };
                let m0 = producer(m0_out, "Mul")?;
                (operands(m0) == [x, x]).then_some((m2, m1_out, m1, m0_out, m0))
            };
            let (x, m2_out, (m2, m1_out, m1, m0_out, m0)) = match operands(a0).as_slice() {
                [p, q] => [(*p, *q), (*q, *p)]
                    .into_iter()
                    .filter(|&(x, _)| !is_const(x))
                    .find_map(|(x, m2_out)| cube_of(m2_out, x).map(|c| (x, m2_out, c)))?,
                _ => return None,
            };
            // Forward from the tanh: x · (1 + tanh(..)), then an optional · 0.5.
            let a1 = single(out0(ix)?, "Add")?;
            var_of(a1)?;
            let m4 = single(out0(a1)?, "Mul")?;
            if !operands(m4).contains(&x) {
                return None;
            }
            let last = out0(m4)
                .and_then(|t| single(t, "Mul"))
                .filter(|&m| var_of(m).is_some())
                .unwrap_or(m4);
            // Every inner value feeds only the pattern.
            for (t, op) in [
                (m0_out, "Mul"),
                (m1_out, "Mul"),
                (m2_out, "Add"),
                (a0_out, "Mul"),
                (m3_out, "Tanh"),
            ] {
                single(t, op)?;
            }
            Some((x, vec![m0, m1, m2, a0, m3, ix, a1, m4, last]))
        })();
        if let Some((x, nodes)) = found {
            if inf.facts[x].dtype.is_float() {
                out.push(FusedPattern::of_input(FusedKind::GeluTanh, nodes, x));
            }
        }
    }
    out
}

/// Finds attention written out by the TorchScript exporter's decomposition of
/// `scaled_dot_product_attention`: `MatMul(Mul(q, √s), Mul(kᵀ, √s))` → [Add mask] →
/// Softmax → [Dropout] → `MatMul(·, v)`. PyTorch runs it as one fused kernel
/// (flash attention) that saves q, k, v, the output and the per-row logsumexp
/// (float32, `[batch, heads, queries]`), and writes its output in `[B, S, H, D]`
/// order. Eager attention (HF BERT/GPT-2: `q @ kᵀ` then a division) does not match
/// and is differentiated op by op, as PyTorch does.
fn find_sdpa(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let g = &model.graph;
    let mut out = Vec::new();
    let is_const = |t: TensorId| inf.facts[t].value.is_some() || g.tensor(t).init.is_some();
    let producer = |t: TensorId| g.tensor(t).producer;
    let out0 = |n: NodeIndex| g.node(n).outputs.first().copied().flatten();
    for &sm in &g.order {
        if g.node(sm).op_type != "Softmax" {
            continue;
        }
        let mut pattern = vec![sm];
        let Some(mut src) = g
            .node(sm)
            .inputs
            .first()
            .copied()
            .flatten()
            .and_then(producer)
        else {
            continue;
        };
        if g.node(src).op_type == "Add" {
            pattern.push(src);
            let next = g
                .node(src)
                .inputs
                .iter()
                .flatten()
                .find_map(|&t| producer(t).filter(|&p| g.node(p).op_type == "MatMul"));
            let Some(p) = next else { continue };
            src = p;
        }
        if g.node(src).op_type != "MatMul" {
            continue;
        }
        let m1 = src;
        // Both operands scaled by a constant: the exporter's SDPA signature.
        let scaled: Option<Vec<TensorId>> = g
            .node(m1)
            .inputs
            .iter()
            .map(|t| {
                let p = producer((*t)?)?;
                let n = g.node(p);
                if n.op_type != "Mul" {
                    return None;
                }
                let ins: Vec<TensorId> = n.inputs.iter().flatten().copied().collect();
                let var: Vec<TensorId> = ins.iter().copied().filter(|&t| !is_const(t)).collect();
                (ins.len() == 2 && var.len() == 1).then(|| {
                    pattern.push(p);
                    var[0]
                })
            })
            .collect();
        let Some(qk) = scaled else { continue };
        let Some(mut probs) = out0(sm) else { continue };
        let mut uses = consumers(model, probs);
        if let [d] = uses.as_slice() {
            if g.node(*d).op_type == "Dropout" {
                pattern.push(*d);
                let Some(p) = out0(*d) else { continue };
                probs = p;
                uses = consumers(model, probs);
            }
        }
        let [m2] = uses.as_slice() else { continue };
        let m2n = g.node(*m2);
        if m2n.op_type != "MatMul" || m2n.inputs.first() != Some(&Some(probs)) {
            continue;
        }
        let (Some(v), Some(o)) = (m2n.inputs.get(1).copied().flatten(), out0(*m2)) else {
            continue;
        };
        let shape = &inf.facts[o].shape;
        if shape.len() != 4 {
            continue;
        }
        pattern.push(m1);
        pattern.push(*m2);
        let lse = Fact::new(DType::F32, shape[..3].to_vec());
        // The kernel writes its output in its query's memory layout, which is the
        // layout the model's following transpose (back to tokens × features) restores:
        // that transpose and reshape are then views, as in PyTorch.
        let out_layout = match consumers(model, o).as_slice() {
            [t] if g.node(*t).op_type == "Transpose" => g
                .node(*t)
                .attrs
                .ints("perm")
                .filter(|p| p.len() == 4)
                .map(|p| p.iter().map(|&d| d as usize).collect()),
            _ => None,
        };
        out.push(FusedPattern {
            kind: FusedKind::Sdpa,
            nodes: pattern,
            reads: vec![qk[0], qk[1], v, o],
            extras: vec![lse],
            out_layout,
        });
    }
    out
}

/// Look-ups the normalization finders share.
struct Look<'a> {
    model: &'a Model,
    inf: &'a Inferred,
}

impl Look<'_> {
    fn op(&self, n: NodeIndex) -> &str {
        &self.model.graph.node(n).op_type
    }

    /// The node's present inputs, in order.
    fn inputs(&self, n: NodeIndex) -> Vec<TensorId> {
        self.model
            .graph
            .node(n)
            .inputs
            .iter()
            .flatten()
            .copied()
            .collect()
    }

    fn out0(&self, n: NodeIndex) -> Option<TensorId> {
        self.model.graph.node(n).outputs.first().copied().flatten()
    }

    /// The only consumer of `t`, when it is an `op` node and `t` is no graph output.
    fn single(&self, t: TensorId, op: &str) -> Option<NodeIndex> {
        match consumers(self.model, t).as_slice() {
            [c] if self.op(*c) == op && !self.model.graph.outputs.contains(&t) => Some(*c),
            _ => None,
        }
    }

    /// A constant: a folded value that is not a parameter.
    fn is_const(&self, t: TensorId) -> bool {
        self.inf.facts[t].value.is_some()
            && self.model.graph.tensor(t).kind != TensorKind::Parameter
    }

    /// The value of a one-element constant.
    fn scalar(&self, t: TensorId) -> Option<f64> {
        let v = self.inf.facts[t].value.as_ref()?;
        (self.is_const(t) && v.data.len() == 1).then(|| v.data.float(0))
    }

    /// A floating activation (or graph input): what a pattern normalizes.
    fn is_var(&self, t: TensorId) -> bool {
        self.inf.facts[t].dtype.is_float() && !self.is_const(t)
    }

    /// The operand of binary node `n` other than `t`, when `t` is one of exactly two.
    fn other(&self, n: NodeIndex, t: TensorId) -> Option<TensorId> {
        match self.inputs(n).as_slice() {
            [a, b] if *a == t && *b != t => Some(*b),
            [a, b] if *b == t && *a != t => Some(*a),
            _ => None,
        }
    }

    /// How many trailing dims ReduceMean node `n` averages with `keepdims` (its
    /// axes the last k, as attribute or, from opset 18, constant input); `None` for
    /// anything else (all axes by default, other axes, dims dropped).
    fn trailing_mean(&self, n: NodeIndex) -> Option<usize> {
        let node = self.model.graph.node(n);
        if node.op_type != "ReduceMean" || node.attrs.int_or("keepdims", 1) != 1 {
            return None;
        }
        let x = node.inputs.first().copied().flatten()?;
        let rank = self.inf.facts[x].shape.len() as i64;
        let axes: Vec<i64> = match node.attrs.ints("axes") {
            Some(a) => a.to_vec(),
            None => {
                let v = self.inf.facts[node.inputs.get(1).copied().flatten()?]
                    .value
                    .as_ref()?;
                (0..v.data.len()).map(|i| v.data.int(i)).collect()
            }
        };
        let mut axes: Vec<i64> = axes
            .into_iter()
            .map(|a| if a < 0 { a + rank } else { a })
            .collect();
        axes.sort_unstable();
        axes.dedup();
        let k = axes.len() as i64;
        let trailing =
            (1..=rank).contains(&k) && axes.iter().zip(rank - k..).all(|(&a, want)| a == want);
        trailing.then_some(k as usize)
    }

    /// Whether `w` is a parameter shaped as the normalized (last `k`) dims of `x`:
    /// a LayerNorm's weight or bias.
    fn is_affine(&self, w: TensorId, x: TensorId, k: usize) -> bool {
        let xs = &self.inf.facts[x].shape;
        self.model.graph.tensor(w).kind == TensorKind::Parameter
            && self.inf.facts[w].shape.as_slice() == &xs[xs.len() - k..]
    }
}

/// Finds LayerNorm as the TorchScript exporter writes `nn.LayerNorm` below opset 17
/// (where ONNX has no LayerNormalization): `μ = ReduceMean(x)`, `d = x − μ`,
/// `s = Sqrt(ReduceMean(Pow(d, 2)) + eps)`, `Div(d, s)`, then `Mul(·, weight)` and
/// `Add(·, bias)` where the module has them (both means over the same trailing
/// dims, every inner value feeding only the pattern). PyTorch runs it as
/// `native_layer_norm`, whose backward saves the input, the weight, the bias and the
/// per-row mean and reciprocal standard deviation (float32, `[rows.., 1..]`). The
/// pattern reads `x`, `μ` and `s`: the graph's own per-row statistics, the bytes of
/// PyTorch's two in float32 (they follow the policy's type under bf16, where
/// PyTorch keeps float32 statistics).
fn find_layer_norm(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let l = Look { model, inf };
    let g = &model.graph;
    let mut out = Vec::new();
    for &m1 in &g.order {
        if l.op(m1) != "ReduceMean" {
            continue;
        }
        let found = (|| {
            let x = l.inputs(m1).first().copied().filter(|&x| l.is_var(x))?;
            let k = l.trailing_mean(m1)?;
            let mean = l.out0(m1)?;
            let sub = l.single(mean, "Sub")?;
            let d = l.out0(sub)?;
            if l.inputs(sub) != [x, mean] || g.outputs.contains(&d) {
                return None;
            }
            // `d` feeds the square and the division, nothing else.
            let (pow, div) = match consumers(model, d).as_slice() {
                [a, b] if l.op(*a) == "Pow" && l.op(*b) == "Div" => (*a, *b),
                [a, b] if l.op(*a) == "Div" && l.op(*b) == "Pow" => (*b, *a),
                _ => return None,
            };
            match l.inputs(pow).as_slice() {
                [b, e] if *b == d && l.scalar(*e) == Some(2.0) => {}
                _ => return None,
            }
            let m2 = l.single(l.out0(pow)?, "ReduceMean")?;
            if l.trailing_mean(m2)? != k {
                return None;
            }
            let var = l.out0(m2)?;
            let add = l.single(var, "Add")?;
            if !l.other(add, var).is_some_and(|e| l.is_const(e)) {
                return None;
            }
            let sqrt = l.single(l.out0(add)?, "Sqrt")?;
            let s = l.out0(sqrt)?;
            if l.single(s, "Div")? != div || l.inputs(div) != [d, s] {
                return None;
            }
            let mut nodes = vec![m1, sub, pow, m2, add, sqrt, div];
            // The affine part: `· weight`, then `+ bias`.
            let mut y = l.out0(div)?;
            for op in ["Mul", "Add"] {
                let Some(n) = l.single(y, op) else { break };
                if !l.other(n, y).is_some_and(|w| l.is_affine(w, x, k)) {
                    break;
                }
                nodes.push(n);
                y = l.out0(n)?;
            }
            Some(FusedPattern {
                kind: FusedKind::LayerNorm,
                nodes,
                reads: vec![x, mean, s],
                extras: Vec::new(),
                out_layout: None,
            })
        })();
        out.extend(found);
    }
    out
}

/// Finds RMSNorm's statistics as exporters write `torch.rsqrt(x.pow(2).mean(dims,
/// keepdim=True) + eps)` (transformers' LlamaRMSNorm and its copies in Mistral,
/// Qwen2, Gemma, T5LayerNorm): `Pow(x, 2)`, a ReduceMean over trailing dims,
/// `Add(eps)`, `Sqrt`, then `Div(1, ·)` (TorchScript's rsqrt) or `Reciprocal`
/// (dynamo's), every inner value feeding only the next node. PyTorch runs these op
/// by op, saving `x` (`PowBackward0`) and rsqrt's result `r` (`RsqrtBackward0`);
/// the nodes' own rules would save the square root as well (Sqrt's result,
/// Div's divisor), so the pattern reads `x` and `r` only. The rest of the norm
/// (`x · r`, `weight · ·`) is left op by op: its rules save what eager's
/// `MulBackward0`s save. A hand-written `1 / torch.sqrt(·)` exports as the same
/// `Reciprocal(Sqrt(·))` and saves the square root too in PyTorch (one per-row
/// value per norm); `torch.rsqrt` is what those models use. `x / torch.sqrt(·)`
/// (Div with `x` as dividend) does not match: eager saves what its rules save.
fn find_rms_rsqrt(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let l = Look { model, inf };
    let g = &model.graph;
    let mut out = Vec::new();
    for &pow in &g.order {
        if l.op(pow) != "Pow" {
            continue;
        }
        let found = (|| {
            let x = match l.inputs(pow).as_slice() {
                [x, e] if l.is_var(*x) && l.scalar(*e) == Some(2.0) => *x,
                _ => return None,
            };
            let mean = l.single(l.out0(pow)?, "ReduceMean")?;
            l.trailing_mean(mean)?;
            let var = l.out0(mean)?;
            let add = l.single(var, "Add")?;
            if !l.other(add, var).is_some_and(|e| l.is_const(e)) {
                return None;
            }
            let sqrt = l.single(l.out0(add)?, "Sqrt")?;
            let s = l.out0(sqrt)?;
            if g.outputs.contains(&s) {
                return None;
            }
            let last = match consumers(model, s).as_slice() {
                [c] if l.op(*c) == "Reciprocal" => *c,
                [c] if l.op(*c) == "Div" => match l.inputs(*c).as_slice() {
                    [one, b] if *b == s && l.scalar(*one) == Some(1.0) => *c,
                    _ => return None,
                },
                _ => return None,
            };
            let r = l.out0(last)?;
            Some(FusedPattern {
                kind: FusedKind::Rsqrt,
                nodes: vec![pow, mean, add, sqrt, last],
                reads: vec![x, r],
                extras: Vec::new(),
                out_layout: None,
            })
        })();
        out.extend(found);
    }
    out
}
