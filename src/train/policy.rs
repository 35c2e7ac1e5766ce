//! Precision policies, following PyTorch autocast.
//!
//! | op class | fp32 | amp-fp16 / amp-bf16 | bf16 |
//! |---|---|---|---|
//! | Conv, ConvTranspose, MatMul, Gemm ("lower precision" list) | fp32 | inputs cast to half, output half | bf16 |
//! | Softmax, LogSoftmax, LayerNorm, Group/InstanceNorm, LpNorm, sum-like Reduce*, CumSum, Pow, Exp, Log, Softplus, losses ("fp32" list) | fp32 | inputs cast to fp32, output fp32 | bf16 |
//! | ReduceL1, ReduceL2 (`norm`: "fp32_append_dtype") | fp32 | inputs read as they are, output fp32 | bf16 |
//! | Cast to a float type (`.float()`, `.to(dtype)`) | fp32 | the type it names | bf16 |
//! | everything else (element-wise, BatchNorm, data movement) | fp32 | runs in the widest input type | bf16 |
//!
//! Each op states its class beside its other rules ([`crate::ops::Op::autocast`]).
//!
//! Under AMP the parameters stay fp32 (master weights), each weight read by a
//! lower-precision op is cast to half once and the copy is cached for the step
//! (autocast's weight cache), and gradients and optimizer states are fp32. `bf16` is
//! pure bf16 training: parameters, activations, gradients and states all bf16.

use crate::infer::Inferred;
use crate::ir::{DType, Model, Node, TensorId, TensorKind};
use crate::ops::Autocast;

/// A precision policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Precision {
    /// Everything float32.
    #[serde(rename = "fp32")]
    Fp32,
    /// torch.autocast(dtype=float16).
    #[serde(rename = "amp-fp16")]
    AmpFp16,
    /// torch.autocast(dtype=bfloat16).
    #[serde(rename = "amp-bf16")]
    AmpBf16,
    /// Model and optimizer in bfloat16.
    #[serde(rename = "bf16")]
    Bf16,
}

crate::choice::choice!(Precision {
    Fp32 => "fp32", "Everything float32";
    AmpFp16 => "amp-fp16", "torch.autocast(dtype=float16)";
    AmpBf16 => "amp-bf16", "torch.autocast(dtype=bfloat16)";
    Bf16 => "bf16", "Model and optimizer in bfloat16";
});

impl Precision {
    /// The half type used by lower-precision ops (`None` for fp32).
    pub fn half(self) -> Option<DType> {
        match self {
            Precision::Fp32 => None,
            Precision::AmpFp16 => Some(DType::F16),
            Precision::AmpBf16 | Precision::Bf16 => Some(DType::BF16),
        }
    }

    /// True for the autocast policies.
    pub fn is_amp(self) -> bool {
        matches!(self, Precision::AmpFp16 | Precision::AmpBf16)
    }

    /// Storage type of parameters, gradients and optimizer states.
    pub fn master(self) -> DType {
        match self {
            Precision::Bf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// The float type autocast casts an op's float inputs to (`None`: left as they are).
    pub fn input_dtype(self, class: Autocast) -> Option<DType> {
        if !self.is_amp() {
            return None;
        }
        match class {
            Autocast::Half => self.half(),
            Autocast::Full => Some(DType::F32),
            Autocast::Widen | Autocast::AsWritten | Autocast::Promote => None,
        }
    }

    /// Output float type of an op of autocast class `class` given its float inputs'
    /// types and the type the graph writes it in.
    pub fn output_dtype(
        self,
        class: Autocast,
        input_float: Option<DType>,
        written: DType,
    ) -> DType {
        let widest = input_float.unwrap_or(DType::F32);
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::AmpFp16 | Precision::AmpBf16 => match class {
                Autocast::Half => self.half().expect("amp has a half type"),
                Autocast::Full | Autocast::Widen => DType::F32,
                Autocast::AsWritten => written,
                Autocast::Promote => widest,
            },
        }
    }
}

/// Whether pure-bf16 training of `model` runs in the types its file is written in:
/// under [`Precision::Bf16`], when every float parameter is already bfloat16 (a model
/// exported after `.to(torch.bfloat16)`). Such a file holds the model's own float32
/// upcasts as Casts (RMSNorm's variance, an eager softmax, the loss's
/// `logits.float()`), which the policy would otherwise turn into bfloat16 too.
pub fn exported_in_bf16(model: &Model, prec: Precision) -> bool {
    prec == Precision::Bf16 && file_half_type(model) == Some(DType::BF16)
}

/// The half type a file's float parameters are all written in (a model exported
/// after `.to(dtype)`), `None` where any is float32 or they differ. Such a file
/// trains in that type: a policy other than [`Precision::Bf16`] on a bfloat16 file
/// retypes every tensor (the commands warn).
pub fn file_half_type(model: &Model) -> Option<DType> {
    let mut half = None;
    for info in &model.graph.tensors {
        let Some(d) = info.declared_dtype.filter(|d| d.is_float()) else {
            continue;
        };
        // Buffers keep their own type (a rotary embedding's float32 inv_freq).
        if info.kind != TensorKind::Parameter || info.buffer {
            continue;
        }
        match half {
            _ if matches!(d, DType::F32 | DType::F64) => return None,
            None => half = Some(d),
            Some(h) if h != d => return None,
            _ => {}
        }
    }
    half
}

/// Where each tensor comes from, as autocast's type rules need it.
pub(super) struct Origins {
    /// Computed from the model's inputs (the rest come from parameters and
    /// constants alone: swin_v2's `cat(q_bias, zeros, v_bias)`).
    from_data: Vec<bool>,
    /// Random noise (stochastic depth's `x.new_empty(..).bernoulli_(p)`, written as
    /// RandomUniformLike → Less → Cast), and what is computed from it and constants
    /// alone.
    noise: Vec<bool>,
}

impl Origins {
    /// Every tensor's origin, in the graph's order.
    pub(super) fn of(model: &Model, inf: &Inferred) -> Origins {
        let g = &model.graph;
        let mut from_data: Vec<bool> = g
            .tensors
            .iter()
            .map(|t| t.kind == TensorKind::Input)
            .collect();
        let mut noise = vec![false; g.tensors.len()];
        for &ix in &g.order {
            let node = g.node(ix);
            let ins = || node.inputs.iter().flatten();
            let data = ins().any(|&t| from_data[t]);
            let random = node.op_type.starts_with("Random") || node.op_type == "Bernoulli";
            let derived = ins().any(|&t| noise[t])
                && ins().all(|&t| noise[t] || inf.facts[t].value.is_some());
            for &t in node.outputs.iter().flatten() {
                from_data[t] |= data;
                noise[t] |= random || derived;
            }
        }
        Origins { from_data, noise }
    }

    /// Of `node`'s float inputs `(slot, tensor)`, the slots whose types its output
    /// takes the widest of, as PyTorch's type promotion and autocast give it:
    /// - not a parameter: a module's weights and biases follow its input (BatchNorm
    ///   on a half input; a Linear's bias);
    /// - not a Linear's bias computed from parameters, where the exporters write
    ///   `F.linear` on a 3-D input as `MatMul` then `Add`
    ///   (`F.linear(x, w, cat(q_bias, zeros, v_bias))` casts it with the weight);
    /// - not noise, beside anything else: PyTorch makes it in the type of the
    ///   tensor it scales, which the exporter wrote as float32;
    /// - not a 0-d tensor (the exporters' spelling of a Python scalar: GELU's
    ///   `0.5 * x`), beside an input with dimensions.
    pub(super) fn promoting(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &Node,
        floats: Vec<(usize, TensorId)>,
    ) -> Vec<usize> {
        let g = &model.graph;
        let after_product = node.op_type == "Add"
            && node.inputs.iter().flatten().any(|&t| {
                g.tensor(t)
                    .producer
                    .is_some_and(|p| matches!(g.node(p).op_type.as_str(), "MatMul" | "Gemm"))
            });
        let mut keep: Vec<(usize, TensorId)> = floats
            .into_iter()
            .filter(|&(_, t)| g.tensor(t).kind != TensorKind::Parameter)
            .filter(|&(_, t)| {
                !(after_product && !self.from_data[t] && inf.facts[t].shape.len() == 1)
            })
            .collect();
        if keep.iter().any(|&(_, t)| !self.noise[t]) {
            keep.retain(|&(_, t)| !self.noise[t]);
        }
        if keep.iter().any(|&(_, t)| !inf.facts[t].shape.is_empty()) {
            keep.retain(|&(_, t)| !inf.facts[t].shape.is_empty());
        }
        keep.into_iter().map(|(k, _)| k).collect()
    }
}

/// The half input `x` of a `Softmax(Cast(x, to=FLOAT))`.
pub(super) fn upcast_softmax_source(
    model: &Model,
    inf: &Inferred,
    node: &crate::ir::Node,
) -> Option<TensorId> {
    if !(node.domain.is_empty() && node.op_type == "Softmax") {
        return None;
    }
    let g = &model.graph;
    let cast = g.node(g.tensor(node.inputs.first().copied().flatten()?).producer?);
    let x = cast.inputs.first().copied().flatten()?;
    let upcast = cast.domain.is_empty()
        && cast.op_type == "Cast"
        && cast.attrs.int("to") == Some(1) // ONNX FLOAT
        && matches!(inf.facts[x].dtype, DType::F16 | DType::BF16);
    upcast.then_some(x)
}
