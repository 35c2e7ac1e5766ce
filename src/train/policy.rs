//! Precision policies, following PyTorch autocast.
//!
//! | op class | fp32 | amp-fp16 / amp-bf16 | bf16 |
//! |---|---|---|---|
//! | Conv, ConvTranspose, MatMul, Gemm ("lower precision" list) | fp32 | inputs cast to half, output half | bf16 |
//! | Softmax, LogSoftmax, LayerNorm, Group/InstanceNorm, Reduce*, Pow, Exp, Log, Erf?, losses ("fp32" list) | fp32 | inputs cast to fp32, output fp32 | bf16 |
//! | everything else (element-wise, BatchNorm, data movement) | fp32 | runs in the widest input type | bf16 |
//!
//! Under AMP the parameters stay fp32 (master weights), each weight read by a
//! lower-precision op is cast to half once and the copy is cached for the step
//! (autocast's weight cache), and gradients and optimizer states are fp32. `bf16` is
//! pure bf16 training: parameters, activations, gradients and states all bf16.

use crate::ir::DType;

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

/// How autocast treats an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    /// Runs in the half type (autocast's lower-precision list).
    Half,
    /// Runs in float32 (autocast's fp32 list).
    Full,
    /// Runs in the widest floating type of its inputs.
    Promote,
}

/// The autocast class of an ONNX op type: the one table of the policy.
pub fn op_class(op_type: &str) -> OpClass {
    match op_type {
        // Einsum is not on autocast's lists itself, but torch.einsum runs as bmm,
        // which is: its result is the half type.
        "Conv" | "ConvTranspose" | "MatMul" | "Gemm" | "Einsum" => OpClass::Half,
        "Softmax"
        | "LogSoftmax"
        | "LayerNormalization"
        | "GroupNormalization"
        | "InstanceNormalization"
        | "LpNormalization"
        | "ReduceSum"
        | "ReduceMean"
        | "ReduceProd"
        | "ReduceL1"
        | "ReduceL2"
        | "ReduceSumSquare"
        | "ReduceLogSum"
        | "ReduceLogSumExp"
        | "Pow"
        | "Exp"
        | "Log"
        | "CumSum"
        | "Softplus" => OpClass::Full,
        _ => OpClass::Promote,
    }
}

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

    /// Output float type of an op given its float inputs' types.
    pub fn output_dtype(self, op_type: &str, input_float: Option<DType>) -> DType {
        let widest = input_float.unwrap_or(DType::F32);
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::AmpFp16 | Precision::AmpBf16 => match op_class(op_type) {
                OpClass::Half => self.half().expect("amp has a half type"),
                OpClass::Full => DType::F32,
                OpClass::Promote => widest,
            },
        }
    }
}
