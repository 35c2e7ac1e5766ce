//! Fused patterns: subgraphs the exporter writes op by op that PyTorch runs as one
//! kernel saving less (the exact and tanh GELU, SiLU, Hardswish below opset 14, the
//! exporters' decomposition of `scaled_dot_product_attention`, LayerNorm decomposed
//! below opset 17, GroupNorm through InstanceNormalization). Each finder takes the
//! spellings of both PyTorch exporters at the opsets they write (tests/opsets.rs). The schedule
//! models what the fused kernel saves. One pattern is no kernel of PyTorch's but one
//! op the exporter writes as two: `torch.rsqrt` in RMSNorm's statistics, which saves
//! its result alone where the exported `Sqrt`, `Div` would save the square root too.
//! And one op the exporter writes as an integer round trip: QAT's fake quantization,
//! a QuantizeLinear → DequantizeLinear pair that PyTorch runs as one float → float
//! kernel saving a bool mask ([`FusedKind::FakeQuant`]).

use std::collections::{HashMap, HashSet};

use petgraph::stable_graph::NodeIndex;

use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId, TensorKind};
use crate::ops::{Backward, Fact, Grad, Saved};

mod attention;
mod cast_back;
use attention::find_sdpa;
pub use attention::SDPA_F32_LAYOUT;
pub(crate) use cast_back::cast_backs;

/// Which fused kernel a pattern stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedKind {
    /// Exact GELU (`F.gelu`): saves only its input.
    Gelu,
    /// `scaled_dot_product_attention` (flash attention; in float32 the memory-efficient
    /// kernel, [`SDPA_F32_LAYOUT`]): saves q, k, v, the output and the per-row logsumexp
    /// (and an additive mask that is not constant).
    Sdpa,
    /// SiLU (`F.silu`, `nn.SiLU`): saves only its input.
    Silu,
    /// Hardswish (`F.hardswish`, `nn.Hardswish`: MobileNetV3) as the TorchScript
    /// exporter writes it below opset 14, `x · HardSigmoid(x)`: saves only its input
    /// (`HardswishBackward0`).
    HardSwish,
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
    /// Fake quantization (QAT: `torch.ao.quantization.FakeQuantize`,
    /// `torch.fake_quantize_per_tensor_affine`, `torch.fake_quantize_per_channel_affine`),
    /// exported as `QuantizeLinear` → [`Clip` to 127 →] `DequantizeLinear` of the same
    /// scale, zero point and axis: PyTorch runs one float → float kernel
    /// (`fake_quantize_per_{tensor,channel}_affine_cachemask`) whose backward
    /// (`FakeQuantize*CachemaskBackward0`) saves only a bool mask of the input's shape
    /// (1 byte per element: where the rounded value was inside the range) and passes
    /// the gradient straight through where it is set. No 8-bit tensor exists: the
    /// pair's integer values are views of the input, costing nothing
    /// ([`FakeQuant`] has the parts and the schedule's rules).
    FakeQuant,
    /// `nn.GroupNorm` / `F.group_norm` as the exporters write it (ONNX's
    /// GroupNormalization came at opset 18 and had per-group scales until 21):
    /// `Reshape` to `[N, G, -1]`, `InstanceNormalization` with constant ones and
    /// zeros, `Reshape` back, then `Mul(·, weight)`, `Add(·, bias)` where the module
    /// has them. PyTorch runs `native_group_norm` (`NativeGroupNormBackward0`):
    /// saves the input, the weight and the per-(image, group) mean and rstd
    /// (float32 `[N, G]`); the nodes' own rules would also save the normalized
    /// activation for the weight's gradient.
    GroupNorm,
    /// Weight normalization (`torch.nn.utils.parametrizations.weight_norm`,
    /// `nn.utils.weight_norm`: wav2vec 2.0's positional convolution, HiFi-GAN and
    /// WaveNet-style vocoders) over the first or last dim, exported as
    /// `ReduceL2(v)`, `Div(v, ·)`, `Mul(·, g)`: PyTorch runs `_weight_norm_interface`
    /// (`WeightNormInterfaceBackward0`), which saves `v`, `g` (parameters) and the
    /// norms; the nodes' own rules would also save the `v / ‖v‖` quotient for `g`'s
    /// gradient.
    WeightNorm,
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
    /// scaling and before the dynamo exporter's transpose of k, v, the output, and a
    /// mask that is not constant).
    pub reads: Vec<TensorId>,
    /// Extra tensors the fused forward makes for backward (SDPA: the f32 logsumexp
    /// `[batch, heads, queries]`), written by the last node's forward step.
    pub extras: Vec<Fact>,
    /// Physical dim order of the output, when not contiguous-as-shaped.
    pub out_layout: Option<Vec<usize>>,
    /// A [`FusedKind::FakeQuant`]'s parts (`None` for every other kind).
    pub fake_quant: Option<FakeQuant>,
}

/// The parts of a fake quantization ([`FusedKind::FakeQuant`]) and how the schedule
/// runs it. PyTorch's kernel reads the float input `x` and writes the float output
/// and the mask at once; the schedule keeps the exported nodes, each its own step:
/// - the QuantizeLinear's step reads `x` and writes the mask (its Extra, bool of
///   `x`'s shape); its integer output is a view of `x`'s storage (no bytes);
/// - the Clip's step (the `(0, 127)` range) writes nothing, its output a view too;
/// - the DequantizeLinear's step reads that view (`x`'s storage) and writes the float
///   output: the fused kernel's float → float forward ([`crate::ops::quantize::fake_quantize`]);
/// - the qparam nodes (the exporter's `Cast` of the zero point to 8 bits, of a
///   double scale to float, the `Constant`s they cast and the Clip's 8-bit bound,
///   each feeding only this pattern) are PyTorch's buffers or host scalars: a
///   Cast's output is a view of its input, a Constant's storage has no bytes (a
///   Python number in PyTorch), and none runs a kernel (the scale and zero point
///   are read from their folded values, the range is [`Self::qmin`],
///   [`Self::qmax`]);
/// - backward: the DequantizeLinear's and Clip's gradients are views of the incoming
///   one; the QuantizeLinear's reads it and the mask and writes `x`'s gradient
///   ([`crate::ops::quantize::fake_quantize_backward`]), new as PyTorch's, or added
///   into a parameter's (a weight's fake quantization trains the float weight).
#[derive(Debug, Clone, PartialEq)]
pub struct FakeQuant {
    /// The float input.
    pub x: TensorId,
    /// The scale (QuantizeLinear's input 1; the DequantizeLinear's is the same).
    pub scale: TensorId,
    /// The zero point, when given (else 0).
    pub zero_point: Option<TensorId>,
    /// The quantized axis of `x` (per channel); `None`: per tensor.
    pub axis: Option<usize>,
    /// The integer range (PyTorch's `quant_min`): the quantized type's, narrowed by
    /// the Clip.
    pub qmin: i64,
    /// The integer range's top (`quant_max`).
    pub qmax: i64,
    /// The QuantizeLinear.
    pub quantize: NodeIndex,
    /// The Clip between them (the `(0, 127)` range), if any.
    pub clip: Option<NodeIndex>,
    /// The DequantizeLinear.
    pub dequantize: NodeIndex,
    /// The qparam nodes (Cast, Constant) that compute the scale, the zero point and
    /// the Clip's bounds for this pattern alone.
    pub qparams: Vec<NodeIndex>,
}

/// A node's part in a [`FakeQuant`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeQuantRole {
    /// A Cast or Constant computing the scale, the zero point or a Clip bound.
    QParam,
    /// The QuantizeLinear: the mask; backward, the masked gradient.
    Quantize,
    /// The Clip: a view forward and backward.
    Clip,
    /// The DequantizeLinear: the float output; backward, a view.
    Dequantize,
}

impl FakeQuant {
    /// The part node `n` plays, if any.
    pub fn role(&self, n: NodeIndex) -> Option<FakeQuantRole> {
        if n == self.quantize {
            Some(FakeQuantRole::Quantize)
        } else if Some(n) == self.clip {
            Some(FakeQuantRole::Clip)
        } else if n == self.dequantize {
            Some(FakeQuantRole::Dequantize)
        } else if self.qparams.contains(&n) {
            Some(FakeQuantRole::QParam)
        } else {
            None
        }
    }

    /// The backward rule of the pattern's node playing `role` (`None` for a qparam
    /// node: its own rule). The QuantizeLinear's gradient (of `x`) reads its mask
    /// (Extra 0, `mask`); the Clip's and the DequantizeLinear's pass the gradient
    /// through as a view and read nothing.
    pub fn rule(&self, role: FakeQuantRole, mask: &Fact) -> Option<Backward> {
        match role {
            FakeQuantRole::QParam => None,
            FakeQuantRole::Quantize => Some(Backward {
                grads: vec![Grad {
                    input: 0,
                    needs: vec![Saved::Extra(0)],
                }],
                extras: vec![mask.clone()],
                flops: mask
                    .numel()
                    .saturating_mul(crate::ops::quantize::FAKE_QUANT_BACKWARD_FLOPS),
            }),
            FakeQuantRole::Clip | FakeQuantRole::Dequantize => Some(Backward::each(&[0], &[], 0)),
        }
    }

    /// Whether the node playing `role` writes its output 0 into its input 0's
    /// storage (a view, whatever the dtypes): the QuantizeLinear, the Clip, a Cast
    /// among the qparam nodes.
    pub fn aliases(&self, role: FakeQuantRole, op_type: &str) -> bool {
        match role {
            FakeQuantRole::Quantize | FakeQuantRole::Clip => true,
            FakeQuantRole::QParam => op_type == "Cast",
            FakeQuantRole::Dequantize => false,
        }
    }
}

/// Each node of a fake quantization in `patterns`: its pattern's index and its
/// role.
pub fn fake_quant_roles(patterns: &[FusedPattern]) -> HashMap<NodeIndex, (usize, FakeQuantRole)> {
    let mut out = HashMap::new();
    for (k, p) in patterns.iter().enumerate() {
        if let Some(fq) = &p.fake_quant {
            for &n in &p.nodes {
                if let Some(r) = fq.role(n) {
                    out.insert(n, (k, r));
                }
            }
        }
    }
    out
}

impl FusedKind {
    /// Whether the kernel is on autocast's float32 list and saves the float32 copy
    /// of a half input (`NativeGroupNormBackward0._saved_input` is float32 under
    /// AMP), which the pattern's nodes make on their way (GroupNorm's
    /// InstanceNormalization).
    pub fn saves_float32_copy(self) -> bool {
        self == FusedKind::GroupNorm
    }
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
            fake_quant: None,
        }
    }

    /// The last node (execution order): the one whose steps carry the fused kernel's
    /// reads and extras.
    pub fn last(&self) -> NodeIndex {
        *self.nodes.last().expect("a pattern has nodes")
    }
}

/// Every fused pattern of the model: exact and tanh GELU, SiLU and Hardswish, the exporter's SDPA,
/// decomposed LayerNorm and GroupNorm, weight normalization, RMSNorm's rsqrt and
/// fake quantization.
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
    out.extend(find_group_norm(model, inf));
    out.extend(find_weight_norm(model, inf));
    out.extend(find_rms_rsqrt(model, inf));
    out.extend(find_fake_quant(model, inf));
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
    /// The same where the output is float32, when that differs (SDPA: [`SDPA_F32_LAYOUT`]).
    pub(super) out_layout_f32: Option<Vec<usize>>,
    /// Flash attention (SDPA without a mask) writes its output in its query's memory
    /// layout: when the query is contiguous as shaped, so is the output, whatever
    /// `out_layout` says.
    pub(super) layout_of: Option<TensorId>,
}

/// The per-node view of the patterns (fake quantization apart: its nodes keep
/// rules of their own, [`FakeQuant::rule`]).
pub(super) fn per_node(patterns: &[FusedPattern]) -> HashMap<NodeIndex, Fusion> {
    let mut out = HashMap::new();
    for p in patterns.iter().filter(|p| p.fake_quant.is_none()) {
        for &n in &p.nodes {
            out.insert(n, Fusion::default());
        }
        out.insert(
            p.last(),
            Fusion {
                reads: p.reads.clone(),
                extras: p.extras.clone(),
                out_layout: p.out_layout.clone(),
                out_layout_f32: (p.kind == FusedKind::Sdpa).then(|| SDPA_F32_LAYOUT.to_vec()),
                layout_of: (p.kind == FusedKind::Sdpa
                    && p.out_layout.as_deref() != Some(&SDPA_F32_LAYOUT[..]))
                .then(|| p.reads.first().copied())
                .flatten(),
            },
        );
    }
    out
}

/// The nodes that read a tensor, each once (by node index; no caller depends on
/// their execution order). A computed tensor's readers come from its producer's
/// edges, so that a pattern search asking once per candidate stays linear (a
/// mixture-of-experts export has 6,144 SwiGLU experts in 177,000 nodes); a graph
/// input's or an initializer's are found by a walk.
fn consumers(model: &Model, t: TensorId) -> Vec<NodeIndex> {
    let g = &model.graph;
    let reads = |c: &NodeIndex| g.node(*c).inputs.contains(&Some(t));
    let mut out: Vec<NodeIndex> = match g.tensor(t).producer {
        Some(p) => g
            .nodes
            .edges_directed(p, petgraph::Direction::Outgoing)
            .filter(|e| e.weight().tensor == t)
            .map(|e| petgraph::visit::EdgeRef::target(&e))
            .filter(reads)
            .collect(),
        None => g.order.iter().copied().filter(reads).collect(),
    };
    out.sort_unstable();
    out.dedup();
    out
}

/// Finds exact-GELU subgraphs `Mul(Mul(x, Add(Erf(Div(x, √2)), 1)), 0.5)` (the 0.5
/// multiply last or absent; the TorchScript exporter) or `Mul(x, Mul(0.5, Add(Erf(Div(x,
/// √2)), 1)))` (the dynamo exporter below opset 20): PyTorch runs `F.gelu` fused and
/// saves only `x`.
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
        let has_const = |m: NodeIndex| g.node(m).inputs.iter().flatten().any(|&t| is_const(t));
        let next = out0(mul).and_then(|t| single(t, "Mul"));
        let last = if g.node(mul).inputs.contains(&Some(x)) {
            // `x · (1 + erf)`, then `· 0.5` (TorchScript).
            next.filter(|&m| has_const(m)).unwrap_or(mul)
        } else {
            // `0.5 · (1 + erf)`, then `x ·` (the dynamo exporter below opset 20,
            // where ONNX has no Gelu).
            let Some(last) =
                next.filter(|&m| has_const(mul) && g.node(m).inputs.contains(&Some(x)))
            else {
                continue;
            };
            last
        };
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
/// torchvision, timm and transformers use.) Hardswish below opset 14 is the same
/// shape, `Mul(x, HardSigmoid(x))` with `HardSigmoid`'s `α = 1/6, β = 1/2`
/// (`F.hardswish`, whose `HardswishBackward0` saves only `x`).
fn find_silu(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let g = &model.graph;
    let mut out = Vec::new();
    for &ix in &g.order {
        let n = g.node(ix);
        let kind = match n.op_type.as_str() {
            "Sigmoid" => FusedKind::Silu,
            "HardSigmoid"
                if (n.attrs.float("alpha").unwrap_or(0.2) - 1.0 / 6.0).abs() < 1e-6
                    && (n.attrs.float("beta").unwrap_or(0.5) - 0.5).abs() < 1e-6 =>
            {
                FusedKind::HardSwish
            }
            _ => continue,
        };
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
            && (m.inputs[..] == [Some(x), Some(s)] || m.inputs[..] == [Some(s), Some(x)])
            && inf.facts[s].shape == inf.facts[x].shape
            && !g.outputs.contains(&s);
        if !is_silu {
            continue;
        }
        out.push(FusedPattern::of_input(kind, vec![ix, mul], x));
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

    /// The only consumer of `t` that reads its value, when it is an `op` node and
    /// `t` is no graph output: `CastLike` nodes taking only their type from `t`
    /// (the dynamo exporter's cast of a weight to the activation's type) aside.
    fn single_value_read(&self, t: TensorId, op: &str) -> Option<NodeIndex> {
        let g = &self.model.graph;
        let reads: Vec<NodeIndex> = consumers(self.model, t)
            .into_iter()
            .filter(|&c| !(self.op(c) == "CastLike" && g.node(c).inputs.first() != Some(&Some(t))))
            .collect();
        match reads.as_slice() {
            [c] if self.op(*c) == op && !g.outputs.contains(&t) => Some(*c),
            _ => None,
        }
    }

    /// A `CastLike` taking its type from `like` whose output has its input's type:
    /// a no-op, as PyTorch's `.to(y.dtype)` on a tensor of that type.
    fn noop_cast_like(&self, n: NodeIndex, like: TensorId) -> bool {
        match (self.op(n), self.inputs(n).as_slice(), self.out0(n)) {
            ("CastLike", [i, l], Some(o)) => {
                *l == like && self.inf.facts[*i].dtype == self.inf.facts[o].dtype
            }
            _ => false,
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
        let (axes, rank) = self.reduce_axes(n)?;
        let k = axes.len() as i64;
        let trailing =
            (1..=rank).contains(&k) && axes.iter().zip(rank - k..).all(|(&a, want)| a == want);
        trailing.then_some(k as usize)
    }

    /// The axes reduce node `n` reduces (attribute, or from opset 18 a constant
    /// input), non-negative, sorted and deduplicated, with its input's rank; `None`
    /// when it names none (every axis by default) or they are not constant.
    fn reduce_axes(&self, n: NodeIndex) -> Option<(Vec<i64>, i64)> {
        let node = self.model.graph.node(n);
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
        Some((axes, rank))
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
                fake_quant: None,
            })
        })();
        out.extend(found);
    }
    out
}

/// Finds GroupNorm as the exporters write `nn.GroupNorm` ([`FusedKind::GroupNorm`]):
/// `r = Reshape(x)` to `[N, G, M]` (`x` floating `[N, C, ...]`, `G` dividing `C`),
/// `InstanceNormalization(r, ones, zeros)` (constant, not parameters), `Reshape`
/// back to `x`'s shape, then `Mul(·, weight)` and `Add(·, bias)` with operands of
/// `C` elements broadcast per channel (`[C, 1, ...]`; parameters, or the constant
/// ones and zeros a module without affine exports, possibly of one element, either
/// possibly through `Unsqueeze` and, below opset 21 in the dynamo exporter, a
/// `CastLike` taking its type from the normalized value), where the exporter writes
/// them; every inner value feeds only the next node (besides such type-only reads).
/// The pattern reads `x`; its extras are the float32 mean and rstd `[N, G]`.
fn find_group_norm(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let l = Look { model, inf };
    let g = &model.graph;
    let facts = &inf.facts;
    let mut out = Vec::new();
    for &norm in &g.order {
        if l.op(norm) != "InstanceNormalization" {
            continue;
        }
        let found = (|| {
            let (r, scale, bias) = match l.inputs(norm).as_slice() {
                [r, s, b] => (*r, *s, *b),
                _ => return None,
            };
            // A constant (folded: the dynamo exporter's `Expand(CastLike(1, x), [G])`
            // below opset 21 folds), no parameter.
            let fixed = |t: TensorId| {
                g.tensor(t).kind != TensorKind::Parameter
                    && (facts[t].value.is_some()
                        || g.tensor(t).producer.is_some_and(|p| l.op(p) == "Constant"))
            };
            if !fixed(scale) || !fixed(bias) {
                return None;
            }
            let r1 = g.tensor(r).producer?;
            let x = match l.inputs(r1).as_slice() {
                [x, _] if l.op(r1) == "Reshape" && l.is_var(*x) => *x,
                _ => return None,
            };
            if l.single(r, "InstanceNormalization")? != norm {
                return None;
            }
            let xs = &facts[x].shape;
            let rs = &facts[r].shape;
            let c = *xs.get(1)?;
            let groups = *rs.get(1)?;
            if xs.len() < 3 || rs.len() != 3 || rs[0] != xs[0] || groups == 0 || c % groups != 0 {
                return None;
            }
            let r2 = l.single(l.out0(norm)?, "Reshape")?;
            let mut y = l.out0(r2)?;
            if &facts[y].shape != xs {
                return None;
            }
            let mut nodes = vec![r1, norm, r2];
            // The affine part: `· weight`, then `+ bias`, per channel: a parameter
            // of C elements or a constant (one value: the ones and zeros a module
            // without affine exports), shaped `[C or 1, 1, ...]`, as given or through
            // Unsqueeze nodes feeding only this.
            let per_channel = |n: NodeIndex, w: TensorId, y: TensorId| -> Option<Vec<NodeIndex>> {
                let ws = &facts[w].shape;
                if ws.len() + 1 != xs.len() || ws[1..].iter().any(|&d| d != 1) {
                    return None;
                }
                let mut chain = Vec::new();
                let (mut t, mut reader) = (w, n);
                loop {
                    if l.single(t, l.op(reader)) != Some(reader) {
                        return None;
                    }
                    match g.tensor(t).producer {
                        // A CastLike takes its type from the normalized value.
                        Some(p) if l.op(p) == "Unsqueeze" || l.noop_cast_like(p, y) => {
                            chain.push(p);
                            t = *l.inputs(p).first()?;
                            reader = p;
                        }
                        _ => break,
                    }
                }
                // A parameter per channel; a constant per channel or one value.
                let ok = match facts[t].numel() {
                    n if n == c as u64 && ws[0] == c => {
                        g.tensor(t).kind == TensorKind::Parameter || fixed(t)
                    }
                    1 => fixed(t),
                    _ => false,
                };
                ok.then_some(chain)
            };
            for op in ["Mul", "Add"] {
                let Some(n) = l.single_value_read(y, op) else {
                    break;
                };
                let Some(chain) = l.other(n, y).and_then(|w| per_channel(n, w, y)) else {
                    break;
                };
                // A CastLike taking its type from `y` is the operand's.
                if consumers(model, y)
                    .into_iter()
                    .any(|c| c != n && !chain.contains(&c))
                {
                    break;
                }
                nodes.extend(chain);
                nodes.push(n);
                y = l.out0(n)?;
            }
            let stat = Fact::new(DType::F32, vec![xs[0], groups]);
            Some(FusedPattern {
                kind: FusedKind::GroupNorm,
                nodes,
                reads: vec![x],
                extras: vec![stat.clone(), stat],
                out_layout: None,
                fake_quant: None,
            })
        })();
        out.extend(found);
    }
    out
}

/// Finds weight normalization ([`FusedKind::WeightNorm`]): `n = ReduceL2(v)` with
/// `keepdims` over every axis but the first or the last (PyTorch's fused
/// `_weight_norm_interface` runs only there; other dims run op by op), `Div(v, n)`,
/// then `Mul(·, g)`, with `v` and `g` parameters and `g` shaped as `n`; every inner
/// value feeds only the next node. The pattern reads the norms `n`.
fn find_weight_norm(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let l = Look { model, inf };
    let g = &model.graph;
    let facts = &inf.facts;
    let param = |t: TensorId| g.tensor(t).kind == TensorKind::Parameter;
    let mut out = Vec::new();
    for &red in &g.order {
        if l.op(red) != "ReduceL2" {
            continue;
        }
        let found = (|| {
            let node = g.node(red);
            let v = *l.inputs(red).first()?;
            if !param(v) || node.attrs.int_or("keepdims", 1) != 1 {
                return None;
            }
            let n = l.out0(red)?;
            let (vs, ns) = (&facts[v].shape, &facts[n].shape);
            let (axes, rank) = l.reduce_axes(red)?;
            let kept: Vec<i64> = (0..rank).filter(|k| !axes.contains(k)).collect();
            // One kept axis, the first or the last: `_weight_norm`'s fused path.
            if ns.len() != vs.len() || !matches!(kept[..], [d] if d == 0 || d == rank - 1) {
                return None;
            }
            let div = l.single(n, "Div")?;
            if l.inputs(div) != [v, n] {
                return None;
            }
            let mul = l.single(l.out0(div)?, "Mul")?;
            let q = l.out0(div)?;
            let gain = l.other(mul, q)?;
            if !param(gain) || facts[gain].shape != *ns {
                return None;
            }
            Some(FusedPattern {
                kind: FusedKind::WeightNorm,
                nodes: vec![red, div, mul],
                reads: vec![n],
                extras: Vec::new(),
                out_layout: None,
                fake_quant: None,
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
                fake_quant: None,
            })
        })();
        out.extend(found);
    }
    out
}

/// The integer range of a quantized type.
fn int_range(dt: DType) -> Option<(i64, i64)> {
    Some(match dt {
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::U16 => (0, 65535),
        DType::I16 => (-32768, 32767),
        _ => return None,
    })
}

/// Finds fake quantization as the TorchScript exporter writes PyTorch's
/// `fake_quantize_per_tensor_affine` and `fake_quantize_per_channel_affine` (what
/// `torch.ao.quantization.FakeQuantize` calls): `QuantizeLinear(x, scale, zp)`, for
/// the `(0, 127)` range `Clip(·, , 127)`, then `DequantizeLinear(·, scale, zp)` with
/// the same scale, zero point (the same tensors or equal constants) and axis; the
/// integer values feed nothing else; `x` floating, the output of its dtype and
/// shape; 8- or 16-bit integers; no blocked quantization. The range is the
/// quantized type's narrowed by the Clip (PyTorch's `quant_min`, `quant_max`).
/// The nodes that compute the scale, the zero point and the Clip's bounds for this
/// pattern alone, from folded values (`Cast` of the zero-point buffer to 8 bits;
/// `Constant` and `Cast` of a Python scalar's double; the Clip's uint8 `Constant`),
/// are its qparam nodes. A QuantizeLinear that matches
/// nothing keeps its own rule (refused where its input requires a gradient).
fn find_fake_quant(model: &Model, inf: &Inferred) -> Vec<FusedPattern> {
    let l = Look { model, inf };
    let g = &model.graph;
    let mut out = Vec::new();
    // Same tensor, or both constants of equal values (or both absent).
    let same = |a: Option<TensorId>, b: Option<TensorId>| match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) if a == b => true,
        (Some(a), Some(b)) => {
            let (fa, fb) = (&inf.facts[a], &inf.facts[b]);
            fa.dtype == fb.dtype
                && fa.value.is_some()
                && fa.value == fb.value
                && l.model.graph.tensor(a).kind != TensorKind::Parameter
                && l.model.graph.tensor(b).kind != TensorKind::Parameter
        }
        _ => false,
    };
    let input = |n: NodeIndex, i: usize| g.node(n).inputs.get(i).copied().flatten();
    for &qn in &g.order {
        if l.op(qn) != "QuantizeLinear" {
            continue;
        }
        let found = (|| {
            let x = input(qn, 0)?;
            let scale = input(qn, 1)?;
            let zp = input(qn, 2);
            let xf = &inf.facts[x];
            if !xf.dtype.is_float() {
                return None;
            }
            let q = l.out0(qn)?;
            let (mut qmin, mut qmax) = int_range(inf.facts[q].dtype)?;
            let blocked = |n: NodeIndex| g.node(n).attrs.int_or("block_size", 0) != 0;
            if blocked(qn) || !inf.facts[scale].dtype.is_float() {
                return None;
            }
            // The `(0, 127)` range's Clip.
            let mut cur = q;
            let mut clip = None;
            if let Some(c) = l.single(q, "Clip") {
                if input(c, 0) != Some(q) {
                    return None;
                }
                let bound = |i: usize, attr: &str| -> Option<Option<f64>> {
                    match input(c, i) {
                        Some(t) => inf.facts[t]
                            .value
                            .as_ref()
                            .filter(|v| v.data.len() == 1)
                            .map(|v| Some(v.data.float(0))),
                        None => Some(g.node(c).attrs.float(attr).map(f64::from)),
                    }
                };
                if let Some(lo) = bound(1, "min")? {
                    qmin = qmin.max(lo.ceil() as i64);
                }
                if let Some(hi) = bound(2, "max")? {
                    qmax = qmax.min(hi.floor() as i64);
                }
                if qmin > qmax {
                    return None;
                }
                clip = Some(c);
                cur = l.out0(c)?;
            }
            let dq = l.single(cur, "DequantizeLinear")?;
            if input(dq, 0) != Some(cur)
                || blocked(dq)
                || !same(Some(scale), input(dq, 1))
                || !same(zp, input(dq, 2))
            {
                return None;
            }
            let y = l.out0(dq)?;
            if inf.facts[y].dtype != xf.dtype || inf.facts[y].shape != xf.shape {
                return None;
            }
            // Per tensor, or per axis (the same axis on both nodes).
            let sf = &inf.facts[scale];
            let axis = if sf.numel() == 1 && sf.rank() <= 1 {
                None
            } else {
                let ax = |n: NodeIndex| {
                    crate::ops::axis(g.node(n).attrs.int_or("axis", 1), xf.rank()).ok()
                };
                let a = ax(qn)?;
                if ax(dq)? != a || sf.shape != [xf.shape[a]] {
                    return None;
                }
                Some(a)
            };
            // The qparam nodes: Casts and Constants with folded outputs that feed
            // only the pattern (or each other).
            let mut inside: HashSet<NodeIndex> =
                [Some(qn), clip, Some(dq)].into_iter().flatten().collect();
            let mut qparams = Vec::new();
            let mut todo: Vec<TensorId> = [Some(scale), zp].into_iter().flatten().collect();
            if let Some(c) = clip {
                todo.extend(g.node(c).inputs.iter().skip(1).flatten().copied());
            }
            while let Some(t) = todo.pop() {
                let Some(p) = g.tensor(t).producer else {
                    continue;
                };
                if inside.contains(&p) || !matches!(l.op(p), "Cast" | "Constant") {
                    continue;
                }
                let outs: Vec<TensorId> = g.node(p).outputs.iter().flatten().copied().collect();
                let only_here = outs.iter().all(|&o| {
                    inf.facts[o].value.is_some()
                        && !g.outputs.contains(&o)
                        && consumers(model, o).iter().all(|c| inside.contains(c))
                });
                if !only_here {
                    continue;
                }
                inside.insert(p);
                qparams.push(p);
                todo.extend(g.node(p).inputs.iter().flatten().copied());
            }
            let mut nodes = qparams.clone();
            nodes.extend([Some(qn), clip, Some(dq)].into_iter().flatten());
            Some(FusedPattern {
                kind: FusedKind::FakeQuant,
                nodes,
                reads: Vec::new(),
                extras: vec![Fact::new(DType::Bool, xf.shape.clone())],
                out_layout: None,
                fake_quant: Some(FakeQuant {
                    x,
                    scale,
                    zero_point: zp,
                    axis,
                    qmin,
                    qmax,
                    quantize: qn,
                    clip,
                    dequantize: dq,
                    qparams,
                }),
            })
        })();
        out.extend(found);
    }
    out
}
