//! How frozen parameters are stored: in a float type (`model.half()` on the frozen
//! base), or quantized as bitsandbytes stores them for QLoRA / LLM.int8() finetuning.
//!
//! | dtype | bytes of a frozen tensor of `n` elements |
//! |---|---|
//! | fp32 | `4n` |
//! | fp16, bf16 | `2n` |
//! | int8 | `n` (int8 `CB`) + `4·rows` (fp32 `SCB`, one absmax per output row) |
//! | nf4 | `⌈n/2⌉` (4-bit codes) + `⌈n/64⌉` (8-bit absmax per 64-block) + `4·⌈⌈n/64⌉/256⌉` (fp32 per 256 of those) + 4 (the fp32 offset) |
//!
//! Sources. int8: Dettmers et al. 2022, "LLM.int8()", §3.1 vector-wise quantization,
//! as bitsandbytes' `Int8Params` keeps it (`CB` int8 of the weight's shape, `SCB`
//! fp32 of `out_features`): the row is the output feature, dim 0 of PyTorch's
//! `[out, in]` Linear and `[out, in, k..]` Conv weights, and the last dim of a
//! weight an ONNX `MatMul` reads as its second operand (exported transposed,
//! `[in, out]`; a `Gemm`'s without `transB`). nf4: Dettmers et al. 2023, "QLoRA", §3: 4-bit NormalFloat with
//! blocksize 64; Double Quantization stores the first-level fp32 absmax as 8-bit
//! floats, with one fp32 constant per 256 of them (0.127 bits per parameter instead of
//! 0.5); bitsandbytes' `quantize_4bit(compress_statistics=True)` also keeps the fp32
//! mean it subtracts from the absmax (`offset`). Shared 256-entry code tables are not
//! counted (one per process).
//!
//! int8 and nf4 apply, as bitsandbytes' `Linear8bitLt` / `Linear4bit` replace
//! `nn.Linear`, to frozen 2-D weights that a `MatMul` or `Gemm` reads as its second
//! operand; other frozen parameters (biases, norms, embeddings, convolutions) keep
//! the precision's dtype. As transformers quantizes a model (`BitsAndBytesConfig`:
//! `get_keys_to_not_convert`), the output head stays unquantized: a weight whose
//! `MatMul` or `Gemm` writes a graph output (`lm_head`: the logits), and a weight an
//! embedding (`Gather`) also reads (tied embeddings) ([`Quantized::of`]). fp32,
//! fp16 and bf16 apply to every frozen parameter.
//!
//! Dequantized temporaries: each forward op that reads an int8 or nf4 weight first
//! dequantizes it to the compute dtype, a temporary that lives while the op runs
//! (`bnb.matmul_4bit`: `F.dequantize_4bit(B).to(A.dtype)`). The op saves the
//! quantized weight, not the dequantized one, and its backward dequantizes it again
//! to the incoming gradient's dtype for the input gradient (`MatMul4Bit.backward`):
//! another temporary, of that backward step.

use crate::ir::{DType, Model, Node, TensorId};

/// Storage of the frozen parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// float32.
    Fp32,
    /// float16.
    Fp16,
    /// bfloat16.
    Bf16,
    /// LLM.int8(): int8 with an fp32 absmax per output row.
    Int8,
    /// QLoRA's 4-bit NormalFloat, double-quantized absmax per 64 elements.
    Nf4,
}

crate::choice::choice!(WeightDtype {
    Fp32 => "fp32", "float32";
    Fp16 => "fp16", "float16 (model.half() on the frozen base)";
    Bf16 => "bf16", "bfloat16";
    Int8 => "int8", "LLM.int8(): 1 byte per parameter plus an fp32 absmax per output row";
    Nf4 => "nf4", "QLoRA NF4: 4 bits per parameter plus a double-quantized absmax per 64";
});

/// nf4 elements per first-level absmax (QLoRA §3, bitsandbytes `Params4bit`).
pub const NF4_BLOCK: u64 = 64;
/// First-level absmax values per second-level fp32 constant (QLoRA §3).
pub const NF4_DOUBLE_BLOCK: u64 = 256;

impl WeightDtype {
    /// The float type a frozen parameter is computed in: its own for the float
    /// types, `None` (the training precision's) for the quantized ones, which are
    /// dequantized to it.
    pub fn float(self) -> Option<DType> {
        match self {
            WeightDtype::Fp32 => Some(DType::F32),
            WeightDtype::Fp16 => Some(DType::F16),
            WeightDtype::Bf16 => Some(DType::BF16),
            WeightDtype::Int8 | WeightDtype::Nf4 => None,
        }
    }

    /// Whether the weight is dequantized before each use.
    pub fn is_quantized(self) -> bool {
        self.float().is_none()
    }

    /// Bytes of a frozen parameter of `numel` elements with `rows` output rows.
    pub fn bytes(self, numel: u64, rows: u64) -> u64 {
        match self {
            WeightDtype::Fp32 => numel.saturating_mul(4),
            WeightDtype::Fp16 | WeightDtype::Bf16 => numel.saturating_mul(2),
            WeightDtype::Int8 => numel.saturating_add(rows.saturating_mul(4)),
            WeightDtype::Nf4 => {
                let blocks = numel.div_ceil(NF4_BLOCK);
                numel.div_ceil(2) + blocks + 4 * blocks.div_ceil(NF4_DOUBLE_BLOCK) + 4
            }
        }
    }
}

/// The output rows of a weight of shape `shape`: its last dim when it is stored
/// `[in, out]` (a `MatMul`'s second operand, a `Gemm`'s without `transB`), else dim
/// 0; 1 for a scalar.
pub fn output_rows(shape: &[usize], in_out: bool) -> u64 {
    let d = if in_out { shape.last() } else { shape.first() };
    d.map_or(1, |&d| d as u64)
}

/// The Linear weight node `n` reads, when it is a `MatMul` or `Gemm` whose second
/// operand is a 2-D tensor: `(weight, in_out, view)`, `in_out` when the weight is stored
/// `[in, out]` (so its output rows are its last dim). The dynamo exporter writes
/// `F.linear(x, W)` on a 3-D `x` as `MatMul(x, Transpose(W))`: the weight is then the
/// Transpose's input, stored `[out, in]`, and `view` is the transposed tensor.
pub fn linear_weight(model: &Model, n: &Node) -> Option<(TensorId, bool, Option<TensorId>)> {
    if n.op_type != "MatMul" && n.op_type != "Gemm" {
        return None;
    }
    let t = n.inputs.get(1).copied().flatten()?;
    let in_out = n.op_type == "MatMul" || n.attrs.int("transB").unwrap_or(0) == 0;
    let g = &model.graph;
    if let Some(p) = g.tensor(t).producer.map(|p| g.node(p)) {
        let w = p.inputs.first().copied().flatten()?;
        let perm = p.attrs.ints("perm");
        let swaps = perm.is_none_or(|p| p[..] == [1, 0]);
        return (p.op_type == "Transpose" && swaps && g.tensor(w).init.is_some()).then_some((
            w,
            !in_out,
            Some(t),
        ));
    }
    Some((t, in_out, None))
}

/// Which tensors are quantized Linear weights (bitsandbytes replaces `nn.Linear`: a
/// 2-D weight a `MatMul` or `Gemm` reads as its second operand), by tensor id.
pub struct Quantized {
    /// The frozen Linear weights stored quantized, and their transposed views (the
    /// `Transpose(W)` a MatMul reads is read as the weight: dequantized by the MatMul,
    /// the Transpose only views).
    pub quantized: Vec<bool>,
    /// Linear weights: `Some(true)` when stored `[in, out]`, so that their output rows
    /// are the last dim.
    pub linear_rhs: Vec<Option<bool>>,
    /// A weight's transposed view that a MatMul reads, by the view.
    pub weight_of_view: Vec<Option<TensorId>>,
}

impl Quantized {
    /// `candidates`: the frozen parameters of a quantized `--weight-dtype`; the Linear
    /// weights among them are quantized, but those a quantized base keeps in its float
    /// type, as transformers leaves them (see the module docs): the output head, which
    /// a `MatMul` or `Gemm` writing a graph output reads, and any weight a `Gather`
    /// reads (an embedding, tied or not).
    pub fn of(model: &Model, inf: &crate::infer::Inferred, candidates: &[bool]) -> Quantized {
        let g = &model.graph;
        let n_t = g.tensors.len();
        let mut linear_rhs: Vec<Option<bool>> = vec![None; n_t];
        let mut weight_of_view: Vec<Option<TensorId>> = vec![None; n_t];
        let mut kept = vec![false; n_t];
        for &ix in &g.order {
            let n = g.node(ix);
            if n.op_type == "Gather" {
                if let Some(w) = n.inputs.first().copied().flatten() {
                    kept[w] = true;
                }
            }
            let Some((w, in_out, view)) = linear_weight(model, n) else {
                continue;
            };
            if n.outputs.iter().flatten().any(|o| g.outputs.contains(o)) {
                kept[w] = true;
            }
            if inf.facts[w].shape.len() == 2 {
                linear_rhs[w] = Some(in_out);
                if let Some(v) = view {
                    weight_of_view[v] = Some(w);
                }
            }
        }
        let weights: Vec<bool> = (0..n_t)
            .map(|t| candidates[t] && linear_rhs[t].is_some() && !kept[t])
            .collect();
        let quantized = (0..n_t)
            .map(|t| weights[t] || weight_of_view[t].is_some_and(|w| weights[w]))
            .collect();
        Quantized {
            quantized,
            linear_rhs,
            weight_of_view,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_by_hand() {
        // A 768×768 weight: 589824 elements.
        let n = 768 * 768;
        assert_eq!(WeightDtype::Fp16.bytes(n, 768), 2 * n);
        assert_eq!(WeightDtype::Int8.bytes(n, 768), n + 768 * 4);
        // nf4: 294912 code bytes, 9216 absmax bytes, 36 second-level constants.
        assert_eq!(WeightDtype::Nf4.bytes(n, 768), 294912 + 9216 + 36 * 4 + 4);
        // QLoRA's 4.127 bits per parameter, within the offset.
        let bits = (WeightDtype::Nf4.bytes(n, 768) - 4) as f64 * 8.0 / n as f64;
        assert!((bits - 4.127).abs() < 0.001, "{bits}");
        assert_eq!(output_rows(&[768, 3072], true), 3072);
        assert_eq!(output_rows(&[64, 3, 7, 7], false), 64);
    }
}
